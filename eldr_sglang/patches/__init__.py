"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``eldr``).

``register()`` runs in every SGLang process (launcher, scheduler,
detokenizer). It always adds the ``--eldr-*`` flags and the late-binding fix
(``late_binding``), the CPU fixes only when CUDA is absent, and the capture
hooks only in the scheduler of a server started with ELDR flags. The
late-binding fix is unconditional because SGLang resolves and validates
``ServerArgs`` in the launcher process (``ServerArgs.resolve_once`` at
publish; children inherit the resolved record), and a plain decode server
needs it as much as an ELDR one. It only lifts a false refusal; apart from it,
a server without ELDR flags behaves exactly as stock SGLang.
"""

from __future__ import annotations

import multiprocessing

from eldr_sglang.patches.targets import (READS, SUPPORTED_SGLANG, TARGETS,  # noqa: F401
                                         check_sglang, missing_targets)


def register() -> None:
    """Called by SGLang's ``load_plugins()`` in every server process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from eldr_sglang.patches import cpu_compat, flags, late_binding

    if not cpu_compat.cuda_available():
        cpu_compat.install_import_shims()
        cpu_compat.register_hooks()
    HookRegistry.register(TARGETS["prepare_server_args"], flags.prepare_server_args_around, HookType.AROUND)
    HookRegistry.register(
        TARGETS["validate_prefill_complete"], late_binding.validate_prefill_complete_around, HookType.AROUND
    )

    config = flags.EngineConfig.from_env()
    if config.active and multiprocessing.current_process().name != "MainProcess":
        register_capture(config)


def register_capture(config) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from eldr_sglang.patches import capture, signatures, state

    if state.STATE is not None:
        return
    state.STATE = state.CaptureState(config)  # tensors and publisher: before the CUDA graphs
    HookRegistry.register(TARGETS["scheduler_init"], capture.scheduler_init_after, HookType.AFTER)
    HookRegistry.register(TARGETS["init_cuda_graphs"], capture.init_cuda_graphs_before, HookType.BEFORE)
    HookRegistry.register(TARGETS["forward"], capture.forward_around, HookType.AROUND)
    HookRegistry.register(TARGETS["select_experts"], capture.select_experts_after, HookType.AFTER)
    HookRegistry.register(TARGETS["topk_forward_cuda"], capture.topk_forward_after, HookType.AFTER)
    HookRegistry.register(TARGETS["disagg_prefill"], signatures.disagg_prefill_around, HookType.AROUND)
    HookRegistry.register(TARGETS["output_streamer"], signatures.output_streamer_class_after, HookType.AFTER)
    HookRegistry.register(TARGETS["release"], signatures.release_before, HookType.BEFORE)
