"""The SGLang objects the plugin hooks (``TARGETS``) and reads (``READS``) in the
supported version, and the guard that refuses an SGLang they do not fit."""

from __future__ import annotations

import importlib

SUPPORTED_SGLANG = "0.5.23"  # the hook targets below are read from this version

TARGETS = {
    "prepare_server_args": "sglang.srt.server_args.prepare_server_args",
    "validate_prefill_complete": "sglang.srt.arg_groups.pd_disaggregation_hook._validate_prefill_complete",
    "init_cuda_graphs": "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs",
    "forward": "sglang.srt.model_executor.model_runner.ModelRunner.forward",
    "select_experts": "sglang.srt.layers.moe.topk.select_experts",
    "topk_forward_cuda": "sglang.srt.layers.moe.topk.TopK.forward_cuda",
    "disagg_prefill": "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
                      ".process_batch_result_disagg_prefill",
    "release": "sglang.srt.mem_cache.common.release_kv_cache",
    "scheduler_init": "sglang.srt.managers.scheduler.Scheduler.__init__",
    "output_streamer": "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class",
}

# read (not hooked), after each forward: physical -> logical expert ids under EPLB,
# the live batch's slots and attention-DP layout, the decode graph's batch size
READS = {
    "expert_location": "sglang.srt.eplb.expert_location.get_global_expert_location_metadata",
    "dp_gather_slot": "sglang.srt.layers.dp_attention.dp_gather_slot",
    "dp_enabled": "sglang.srt.layers.dp_attention.is_dp_attention_enabled",
    "out_cache_loc_virtual": "sglang.srt.model_executor.forward_batch_info.ForwardBatch.out_cache_loc_virtual",
    "global_num_tokens_cpu": "sglang.srt.model_executor.forward_batch_info.ForwardBatch.global_num_tokens_cpu",
    "global_num_tokens_padded_cpu":
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.global_num_tokens_padded_cpu",
    "can_run_graph": "sglang.srt.model_executor.model_runner.ModelRunnerOutput.can_run_graph",
    "parallel": "sglang.srt.runtime_context.get_parallel",
    "exec": "sglang.srt.runtime_context.get_exec",
}


def missing_targets() -> list[str]:
    """Hook targets and read objects the installed SGLang lacks (renamed or moved),
    as dotted paths."""
    missing = []
    for path in (*TARGETS.values(), *READS.values()):
        parts = path.split(".")
        for cut in range(len(parts) - 1, 0, -1):  # longest importable module prefix
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for i, name in enumerate(parts[cut:], start=cut):
                    if i == len(parts) - 1 and name in getattr(obj, "__dataclass_fields__", {}):
                        break  # a dataclass field without a default (an instance attribute)
                    obj = getattr(obj, name)
            except AttributeError:
                missing.append(path)
            break
        else:
            missing.append(path)
    return missing


def check_sglang() -> None:
    """RuntimeError naming what is wrong when ELDR flags are given to an SGLang the
    hooks do not fit: another version, or a hook target missing."""
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    if version != SUPPORTED_SGLANG:
        raise RuntimeError(f"eldr-sglang supports sglang {SUPPORTED_SGLANG}; sglang {version} is "
                           "installed (pip install 'sglang==" + SUPPORTED_SGLANG + "')")
    missing = missing_targets()
    if missing:
        raise RuntimeError(f"sglang {version} lacks the hook target(s) {', '.join(missing)}")
