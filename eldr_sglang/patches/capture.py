"""Expert-id capture inside SGLang's scheduler process (the hooks that write).

Graph-safe by construction: SGLang 0.5.23 captures prefill (breakable) and decode
(full) forwards into CUDA graphs on NVIDIA GPUs, and a replay runs no Python.
So the work is split in three:

* BEFORE ``ModelRunner.init_cuda_graphs``: the state (staging buffer, KV-slot
  table, decode statistics) is allocated, once, before any graph is captured;
* AFTER ``layers.moe.topk.select_experts`` (inside the forward, so inside the
  graphs): one slice copy of the top-k ids into the staging buffer; no read of
  the live batch, no branch on tensor values, no host sync, no logging;
* AROUND ``ModelRunner.forward`` (every forward, graphed or not): after the
  original returned, eagerly, the staged rows go to the live batch's KV slots
  and decode statistics (:mod:`~eldr_sglang.patches.after_forward`).

Plus AFTER ``TopK.forward_cuda``: the top-k formats that skip ``select_experts``
(``TRITON_KERNEL``, ``BYPASSED``) get their ids from ``select_experts`` on the
same inputs for the staged layers, still tensor ops only.

Draft workers (speculative decoding) write nothing. Every hook is guarded: an
error is logged once and the server carries on as stock SGLang. Publication is
in :mod:`~eldr_sglang.patches.signatures`, trace mode in
:mod:`~eldr_sglang.patches.trace_log`, the state in :mod:`~eldr_sglang.patches.state`.
"""

from __future__ import annotations

import logging
import time

import torch

from eldr_sglang.patches import state as engine
from eldr_sglang.patches.after_forward import after_forward

logger = logging.getLogger("eldr_sglang.capture")


def scheduler_init_after(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.__init__``: the metrics endpoint is up as soon as the
    server is (not only after its first forward); rank 0 only."""
    state = engine.STATE
    if state is not None:
        state.scheduler = scheduler
    if state is not None and state.config.metrics_port and engine.tp_rank() == 0:
        try:
            from eldr_sglang.patches.metrics import serve_metrics

            host = getattr(getattr(scheduler, "server_args", None), "host", None) or "0.0.0.0"
            serve_metrics(state, state.config.metrics_port, host)  # the server's own --host
        except Exception as exc:
            state.fail_once(f"metrics endpoint on port {state.config.metrics_port}", exc)
    return result


def is_draft(model_runner) -> bool:
    return bool(getattr(model_runner, "is_draft_worker", False))


def prepare(state: engine.CaptureState, model_runner) -> None:
    """Build the state once (a failure disables the capture, logged)."""
    if state.ready or "initialisation" in state.failed:
        return
    try:
        engine.initialise(state, model_runner)
    except Exception as exc:
        state.fail_once("initialisation", exc)


def init_cuda_graphs_before(model_runner, *args, **kwargs):
    """BEFORE ``ModelRunner.init_cuda_graphs`` (called at start-up whether graphs
    are on or not): allocate everything the graphs will write."""
    state = engine.STATE
    if state is not None and not is_draft(model_runner):
        prepare(state, model_runner)
    return None


def forward_around(original, model_runner, forward_batch, *args, **kwargs):
    state = engine.STATE
    if state is None or is_draft(model_runner):
        return original(model_runner, forward_batch, *args, **kwargs)
    if not state.ready:  # init_cuda_graphs did not run: no graph captured yet either
        prepare(state, model_runner)
    state.forward_batch = forward_batch
    if state.cursor is not None:
        state.cursor.clear()
    started = time.perf_counter() if state.trace_writer is not None else 0.0  # trace mode times steps
    report = state.decode.report
    timer = report.timer() if report is not None and forward_batch.forward_mode.is_decode() else None
    try:
        output = original(model_runner, forward_batch, *args, **kwargs)
    finally:
        state.forward_batch = None
    try:
        after_forward(state, model_runner, forward_batch, output, timer)
        if state.trace_writer is not None and state.decode.hits is not None and forward_batch.forward_mode.is_decode():
            # forward_ms: host time of the forward call (the whole step on CPU; on a GPU
            # only the launch, as nothing here waits for the device)
            state.trace_writer.write("steps", {"batch_size": int(forward_batch.batch_size),
                                               "unique_per_layer": state.decode.active.sum(dim=1).tolist(),
                                               "forward_ms": round(1e3 * (time.perf_counter() - started), 3)})
    except Exception as exc:
        state.fail_once("capture after the forward", exc)
    return output


def stage_ids(state: engine.CaptureState, layer_id: int, topk_ids: torch.Tensor, dispatched: bool) -> None:
    """The in-graph write: ``stage[rows, layer] = topk_ids[:, :k]``. Python here runs
    at eager forwards and graph captures only; what it decides (column, extent)
    depends on the layer id and tensor shapes, never on tensor values."""
    if dispatched:
        state.physical_ids = True  # a server property: the same at every call
    if state.cursor is None:
        state.stage.write(layer_id, topk_ids)
    else:  # two-batch overlap (eager): micro-batches stage one after another
        offset = state.cursor.get(layer_id, 0)
        state.cursor[layer_id] = offset + state.stage.write(layer_id, topk_ids, offset)


def select_experts_after(result, *args, layer_id=None, **kwargs):
    state = engine.STATE
    if state is None or state.stage is None or layer_id is None:
        return result
    config = kwargs.get("topk_config")
    if config is not None and not getattr(config, "allow_routed_experts_capture", True):
        return result  # a draft model's layers (SGLang's own opt-out for them)
    try:
        stage_ids(state, layer_id, result.topk_ids, kwargs.get("expert_location_dispatch_info") is not None)
        if state.gate_prob is not None and state.forward_batch is not None and state.forward_batch.forward_mode.is_extend():
            _add_gate_sums(state, state.forward_batch, layer_id, args, kwargs)  # trace mode: prefill graph off
    except Exception as exc:
        state.fail_once("select_experts capture", exc)
    return result


def topk_forward_after(result, topk, *args, **kwargs):
    """AFTER ``TopK.forward_cuda``: formats that never call ``select_experts``
    (their MoE kernel routes from the logits) get the ids of the staged layers from
    ``select_experts`` on the same inputs; the ``select_experts`` hook stages them."""
    state = engine.STATE
    fmt = getattr(getattr(result, "format", None), "name", "STANDARD")
    if state is None or state.stage is None or fmt not in ("TRITON_KERNEL", "BYPASSED"):
        return result
    config = topk.topk_config
    if state.stage.column(topk.layer_id) is None or not getattr(config, "allow_routed_experts_capture", True):
        return result
    try:
        if fmt == "BYPASSED":
            result.to_standard()
        else:
            from sglang.srt.layers.moe import topk as topk_module

            hidden = args[0] if args else kwargs["hidden_states"]
            logits = args[1] if len(args) > 1 else kwargs["router_logits"]
            non_padded, dispatch = topk._resolve_routing_inputs(kwargs.get("num_token_non_padded"),
                                                                kwargs.get("expert_location_dispatch_info"))
            topk_module.select_experts(hidden_states=hidden, router_logits=logits, topk_config=config,
                                       layer_id=topk.layer_id, num_token_non_padded=non_padded,
                                       expert_location_dispatch_info=dispatch)
    except Exception as exc:
        state.fail_once(f"top-k capture for the {fmt} format", exc)
    return result


def _add_gate_sums(state: engine.CaptureState, fb, layer_id: int, args, kwargs) -> None:
    """Sum the gate's softmax probabilities and raw logits over each request's
    newly computed prompt tokens (trace mode, eager: the prefill graph is off
    there; cached tokens are not included)."""
    logits = kwargs.get("router_logits", args[1] if len(args) > 1 else None)
    if logits is None or fb.extend_seq_lens is None:
        return
    n_tok = int(fb.out_cache_loc.shape[0])
    logits = logits[:n_tok].float()
    rows = fb.req_pool_indices.long().repeat_interleave(fb.extend_seq_lens.long(), output_size=n_tok)
    state.gate_prob[:, layer_id].index_add_(0, rows, torch.softmax(logits, dim=-1))
    state.gate_logit[:, layer_id].index_add_(0, rows, logits)
