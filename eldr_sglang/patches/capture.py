"""Expert-id capture inside SGLang's scheduler process (the hooks that write).

Registered by ``eldr_sglang.patches.register_capture`` when ELDR flags are set:

* AFTER ``Scheduler.__init__``: remembers the scheduler, starts the metrics endpoint;
* AROUND ``ModelRunner.forward``: builds the state at the first forward, remembers
  the running ``ForwardBatch``, and after a decode step adds its distinct experts;
* AFTER ``layers.moe.topk.select_experts``: writes the top-k ids of the selected
  layers into the KV-slot table, for prefill (extend) and decode tokens alike
  (vectorised, on the model's device, no host sync); during decode batches it
  also marks the experts each layer activates (unique experts per step).

Ids are logical expert ids: with an expert-location dispatch (EPLB) the physical
slots SGLang returns are mapped back. Every hook is guarded: an error is logged
once and the server carries on as stock SGLang. Publication is in
:mod:`~eldr_sglang.patches.signatures`, trace mode in :mod:`~eldr_sglang.patches.trace_log`,
the state in :mod:`~eldr_sglang.patches.state`.
"""

from __future__ import annotations

import time

import torch

from eldr_sglang.patches import state as engine


def scheduler_init_after(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.__init__``: the metrics endpoint is up as soon as the
    server is (not only after its first forward); rank 0 only."""
    state = engine.STATE
    if state is not None:
        state.scheduler = scheduler
    if state is not None and state.config.metrics_port and engine.tp_rank() == 0:
        try:
            from eldr_sglang.patches.metrics import serve_metrics

            serve_metrics(state, state.config.metrics_port)
        except Exception as exc:
            state.fail_once(f"metrics endpoint on port {state.config.metrics_port}", exc)
    return result


def forward_around(original, model_runner, forward_batch, *args, **kwargs):
    state = engine.STATE
    if state is None:
        return original(model_runner, forward_batch, *args, **kwargs)
    try:
        if not state.ready and "initialisation" not in state.failed:  # one try: a failure disables capture
            engine.initialise(state, model_runner)
        state.forward_batch = forward_batch
    except Exception as exc:
        state.fail_once("initialisation", exc)
    started = time.perf_counter() if state.trace_writer is not None else 0.0  # trace mode times steps
    try:
        return original(model_runner, forward_batch, *args, **kwargs)
    finally:
        state.forward_batch = None
        try:
            mode = forward_batch.forward_mode
            if state.ready and mode.is_decode():
                d = state.decode
                d.unique_total += d.active.sum()
                if state.trace_writer is not None:
                    # forward_ms: host time of the forward call (the whole step on CPU; on a GPU
                    # only the launch, as nothing here waits for the device)
                    state.trace_writer.write("steps", {"batch_size": int(forward_batch.batch_size),
                                                       "unique_per_layer": d.active.sum(dim=1).tolist(),
                                                       "forward_ms": round(1e3 * (time.perf_counter() - started), 3)})
                d.active.zero_()
                d.steps += 1
                d.tokens += int(forward_batch.batch_size)
        except Exception as exc:
            state.fail_once("decode statistics", exc)


def select_experts_after(result, *args, layer_id=None, **kwargs):
    state = engine.STATE
    fb = state.forward_batch if state is not None else None
    if fb is None or layer_id is None or not state.ready:
        return result
    try:
        topk_ids = logical_ids(result.topk_ids, layer_id, kwargs)
        mode = fb.forward_mode
        if mode.is_extend():
            if state.table is not None:
                state.table.write(fb.out_cache_loc, layer_id, topk_ids)
            if state.gate_prob is not None:
                _add_gate_sums(state, fb, layer_id, args, kwargs)
        elif mode.is_decode():
            n = fb.batch_size
            if state.table is not None:  # generated tokens too: a later turn may hit them in the cache
                state.table.write(fb.out_cache_loc[:n], layer_id, topk_ids[:n])
            ids = topk_ids[:n].long()
            state.decode.active[layer_id].index_fill_(0, ids.flatten(), True)
            if state.decode_acc is not None:
                rows = fb.req_pool_indices[:n].long().repeat_interleave(ids.shape[1])
                layer = torch.full_like(rows, layer_id)
                state.decode_acc.index_put_((rows, layer, ids.flatten()),
                                            torch.ones_like(rows, dtype=torch.int32), accumulate=True)
    except Exception as exc:
        state.fail_once("select_experts capture", exc)
    return result


def logical_ids(topk_ids: torch.Tensor, layer_id: int, kwargs: dict) -> torch.Tensor:
    """Expert ids as logical experts. With an expert-location dispatch (EPLB,
    redundant experts) SGLang's ``select_experts`` returns physical slots; they are
    mapped back through ``physical_to_logical_map`` of the live expert-location
    metadata (read every call: a rebalance replaces it). Negative ids (padding) stay."""
    if kwargs.get("expert_location_dispatch_info") is None:
        return topk_ids
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    meta = get_global_expert_location_metadata()
    if meta is None:
        return topk_ids
    p2l = meta.physical_to_logical_map[layer_id].to(topk_ids.device)
    ids = topk_ids.long()
    return torch.where(ids >= 0, p2l[ids.clamp(min=0)], ids).to(topk_ids.dtype)


def _add_gate_sums(state: engine.CaptureState, fb, layer_id: int, args, kwargs) -> None:
    """Sum the gate's softmax probabilities and raw logits over each request's
    newly computed prompt tokens (trace mode; cached tokens are not included)."""
    logits = kwargs.get("router_logits", args[1] if len(args) > 1 else None)
    if logits is None or fb.extend_seq_lens is None:
        return
    n_tok = int(fb.out_cache_loc.shape[0])
    logits = logits[:n_tok].float()
    rows = fb.req_pool_indices.long().repeat_interleave(fb.extend_seq_lens.long(), output_size=n_tok)
    state.gate_prob[:, layer_id].index_add_(0, rows, torch.softmax(logits, dim=-1))
    state.gate_logit[:, layer_id].index_add_(0, rows, logits)
