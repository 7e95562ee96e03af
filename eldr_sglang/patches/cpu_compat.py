"""CPU compatibility for SGLang 0.5.23 on machines without CUDA.

Two kinds of fixes, both inactive when CUDA is present:

* import shims (``install_import_shims``), needed before ``import sglang`` in
  every process, so they run from a ``.pth`` start-up file that only the CPU
  install script writes: a stand-in ``sgl_kernel`` module for the CPU kernels
  that are not on PyPI (any call raises ``NotImplementedError`` naming the op),
  found only when no real ``sgl_kernel`` is installed, and the op schemas that
  PyPI's CUDA-built torchvision needs to import beside the CPU torch;
* run-time hooks (``register_hooks``) through SGLang's ``HookRegistry``, e.g.
  the pinned-memory + ``torch.cuda.Event`` branch of the prefill KV sender, and
  a plain allocator for host buffers on the ``cpu`` device (SGLang's default
  registers them with CUDA), so ``--enable-return-routed-experts`` runs on CPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import time
import types

logger = logging.getLogger(__name__)

_STANDIN = "sgl_kernel"


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch missing or broken
        return False


class _MissingKernel:
    """Callable placeholder for a CPU kernel that ships only in source form."""

    def __init__(self, name: str):
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self.__name__} is not available on this CPU install "
            "(eldr-sglang stand-in); SGLang should have taken a native torch path"
        )

    def __getattr__(self, item: str) -> "_MissingKernel":
        if item.startswith("__"):
            raise AttributeError(item)
        return _MissingKernel(f"{self.__name__}.{item}")


class _StandinModule(types.ModuleType):
    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _MissingKernel(item)


class _StandinLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = _StandinModule(spec.name)
        mod.__path__ = []  # a package, so `from sgl_kernel.x import y` resolves
        mod.__version__ = "0.0.0+eldr-cpu-standin"
        mod.ELDR_STANDIN = True
        return mod

    def exec_module(self, module):
        return None


class _StandinFinder(importlib.abc.MetaPathFinder):
    """Last-resort finder: answers for ``sgl_kernel*`` only if nothing else did."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _STANDIN and not fullname.startswith(_STANDIN + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _StandinLoader(), is_package=True)


# PyPI's torchvision wheel is a CUDA build: its C++ ops do not load beside the
# CPU torch, and its fake-tensor registrations then fail on the missing schemas.
# Declaring the schemas first lets it import (the ops stay unimplemented).
_TORCHVISION_SCHEMAS = {
    "torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "torchvision::qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


class _TorchvisionSchemaFinder(importlib.abc.MetaPathFinder):
    """Declares torchvision's op schemas just before torchvision is imported."""

    done = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" and not _TorchvisionSchemaFinder.done:
            _TorchvisionSchemaFinder.done = True
            try:
                declare_torchvision_schemas()
            except Exception as exc:  # never break an import over this
                logger.warning("eldr-sglang: torchvision schema shim failed: %s", exc)
        return None  # the normal finders import torchvision itself


def declare_torchvision_schemas() -> None:
    import torch

    for qualname, schema in _TORCHVISION_SCHEMAS.items():
        namespace, name = qualname.split("::")
        if hasattr(getattr(torch.ops, namespace), name):
            continue
        torch.library.define(qualname, schema)


def install_import_shims(torchvision: bool = False) -> None:
    """Make ``import sgl_kernel`` (and, on request, ``import torchvision``) work
    on a CPU-only install. Called from the ``eldr_sglang_cpu.pth`` start-up
    file that ``scripts/install_cpu.sh`` writes, so it also runs in SGLang's
    spawned scheduler processes before their first import."""
    if not any(isinstance(f, _StandinFinder) for f in sys.meta_path):
        if importlib.util.find_spec(_STANDIN) is None:  # no real sgl_kernel
            sys.meta_path.append(_StandinFinder())
    if torchvision and not any(isinstance(f, _TorchvisionSchemaFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionSchemaFinder())


def _sender_without_pinned_indices(result, self, *args, **kwargs):
    """Mooncake's sender copies page indices into pinned memory and records a
    ``torch.cuda.Event`` (``prefill._send_kv_chunk``); on CPU take the plain
    numpy path by turning that capability off per sender."""
    self.supports_host_tensor_indices = False
    return result


IDLE_YIELD_S = 0.002


def _yield_when_idle(original, self, *args, **kwargs):
    """Without ``--sleep-on-idle`` an idle scheduler spins at full speed; on a
    small CPU machine several idle servers then starve the busy one. Yield the
    core for 2 ms per idle loop instead (``--sleep-on-idle`` keeps its own
    behaviour)."""
    if getattr(self, "idle_sleeper", None) is not None:
        return original(self, *args, **kwargs)
    time.sleep(IDLE_YIELD_S)
    return None


def _alloc_host_plain(dims, dtype, device, pin_memory, allocator=None, registration_granularity_bytes=None):
    """Host buffer without CUDA host registration (there is no CUDA here)."""
    import torch

    return torch.zeros(dims, dtype=dtype, device="cpu")


def register_hooks() -> None:
    """Register the CPU run-time fixes with SGLang's ``HookRegistry``."""
    from sglang.srt.mem_cache.pool_host import common as pool_host
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    pool_host.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_host_plain  # routed-experts host cache on CPU

    HookRegistry.register(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__",
        _sender_without_pinned_indices,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle",
        _yield_when_idle,
        HookType.AROUND,
    )
