"""A CUDA-graph replay stand-in for CPU tests.

:class:`GraphRecorder` is a ``TorchDispatchMode`` that records the aten ops of
one call (the way a CUDA graph capture records kernels) and refuses what a
graph cannot hold: host syncs (``.item()``, ``.tolist()``, ``bool(tensor)``) and
ops whose output shape depends on tensor values (``nonzero``, boolean-mask
indexing, ``bincount``, ``unique``, ``repeat_interleave`` without
``output_size``). :meth:`GraphRecorder.replay` runs the recorded ops again on
the SAME tensors, with no Python of the caller: inputs overwritten in place
with another batch give that batch's result, and every intermediate result is
written back into the memory it had at recording (a graph's static memory).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten


class GraphUnsafe(RuntimeError):
    """An op that a CUDA graph cannot capture, or whose result would be baked in."""


_HOST_SYNC = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
_DATA_DEPENDENT = {
    aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default, aten.bincount.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.masked_scatter.default,
}


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (indices or ()) if t is not None)


def check_op(func, args, kwargs) -> None:
    """GraphUnsafe for an op a CUDA graph cannot replay faithfully."""
    name = str(func)
    if func in _HOST_SYNC:
        raise GraphUnsafe(f"host sync in a captured region: {name}")
    if func in _DATA_DEPENDENT:
        raise GraphUnsafe(f"data-dependent output shape in a captured region: {name}")
    if func.overloadpacket is aten.repeat_interleave and kwargs.get("output_size") is None:
        raise GraphUnsafe(f"repeat_interleave without output_size (a host sync): {name}")
    if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_) \
            and _has_bool_index(args):
        raise GraphUnsafe(f"boolean-mask indexing (data-dependent shape): {name}")


def _refuse(name: str):
    def refused(self, *args, **kwargs):
        raise GraphUnsafe(f"host sync in a captured region: Tensor.{name}()")

    return refused


class GraphRecorder(TorchDispatchMode):
    """``with GraphRecorder() as g: fn()`` records; ``g.replay()`` replays."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self._saved: dict = {}

    def __enter__(self):
        # reads of tensor data that bypass the dispatcher (host syncs all the same)
        for name in ("tolist", "numpy"):
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, _refuse(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check_op(func, args, kwargs)
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def op_names(self) -> list[str]:
        return [str(op[0]) for op in self.ops]

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            recorded, _ = tree_flatten(out)
            fresh, _ = tree_flatten(new)
            for old, val in zip(recorded, fresh):
                if isinstance(old, torch.Tensor) and isinstance(val, torch.Tensor) \
                        and old.data_ptr() != val.data_ptr():
                    old.copy_(val)  # the intermediate stays where the graph recorded it


def on_meta(tree):
    """Tensors of ``tree`` as empty meta tensors of the same shape and dtype."""
    return tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                    if isinstance(t, torch.Tensor) else t, tree)
