"""Signature publication and ``meta_info`` signatures (the hooks that read the table).

* AROUND ``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill``:
  for each request whose prefill finished (after its LAST chunk), counts the ids
  over all its prompt slots (cached prefix + new tokens) and hands a signature
  message to the publisher (and, in trace mode, the trace writer);
* BEFORE ``mem_cache.common.release_kv_cache``: keeps a requested ``meta_info``
  signature until the output is streamed, and writes decode traces;
* AFTER ``Scheduler.get_output_streamer_class``: adds the signature to
  ``meta_info`` for requests that ask for it.
"""

from __future__ import annotations

from eldr_sglang.patches import state as engine
from eldr_sglang.patches.messages import META_KEY, return_address, signature_message, wants_signature
from eldr_sglang.patches.state import HEALTH_CHECK_PREFIX, CaptureState
from eldr_sglang.patches.trace_records import clear_gate_sums, colocated, write_prefill_trace
from eldr_sglang.radix_signature import request_counts


def disagg_prefill_around(original, scheduler, batch, *args, **kwargs):
    """AROUND ``process_batch_result_disagg_prefill``: publish once per request, after
    its LAST chunk. Which requests finish their prefill in this batch is read before
    the call: SGLang decrements ``inflight_middle_chunks`` of a middle chunk inside it,
    so afterwards a middle chunk looks like a last one."""
    state = engine.STATE
    if state is None or state.table is None or (state.publisher is None and state.trace_writer is None):
        return original(scheduler, batch, *args, **kwargs)
    try:
        final = [req for req in batch.reqs if getattr(req, "inflight_middle_chunks", 0) <= 0]
    except Exception as exc:
        state.fail_once("signature publishing", exc)
        return original(scheduler, batch, *args, **kwargs)
    result = original(scheduler, batch, *args, **kwargs)
    publish_finished(state, scheduler, final)
    return result


def publish_finished(state: CaptureState, scheduler, reqs) -> None:
    """Publish (and trace) the whole prompt's counts of requests whose prefill is done."""
    try:
        for req in reqs:
            if getattr(req, "kv", None) is None or req.kv.req_pool_idx is None:
                continue
            if str(req.rid).startswith(HEALTH_CHECK_PREFIX) or req.bootstrap_room is None:
                clear_gate_sums(state, req.kv.req_pool_idx)  # the next request in this row starts at 0
                continue
            dest = return_address(req)
            publish = state.publisher is not None and (dest is not None or state.publisher.url is not None)
            if not publish and state.trace_writer is None:
                continue
            counts = request_counts(scheduler.req_to_token_pool, req, state.table)
            if publish:
                published = counts.index_select(0, state.publish_columns)
                state.publisher.submit(signature_message(req, published, state.publish_layers, packed=True,
                                                             model=state.model), dest)
            if state.trace_writer is not None:
                write_prefill_trace(state, req, scheduler, counts)
    except Exception as exc:
        state.fail_once("signature publishing", exc)


def release_before(req, *args, **kwargs):
    """BEFORE ``mem_cache.common.release_kv_cache`` (the request's KV rows are
    still valid): keep the signature a request asked for until its output is
    streamed; in trace mode, write its decode expert counts (and, on a co-located
    server, its prompt counts) and clear its row."""
    state = engine.STATE
    if state is None or getattr(req, "kv", None) is None or req.kv.req_pool_idx is None:
        return None
    try:
        if wants_signature(req) and req.rid not in state.returned:
            msg = meta_signature(state, req)
            if msg is not None:
                state.pending[req.rid] = msg
        if state.decode_acc is not None and str(req.rid).startswith(HEALTH_CHECK_PREFIX):
            state.decode_acc[req.kv.req_pool_idx].zero_()  # the row's next request starts at 0
            clear_gate_sums(state, req.kv.req_pool_idx)
        elif state.decode_acc is not None:
            if colocated(state) and state.table is not None:
                write_prefill_trace(state, req, state.scheduler)
            counts = state.decode_acc[req.kv.req_pool_idx]
            if int(counts.sum()) > 0:
                state.trace_writer.write("decode", {
                    "rid": req.rid, "bootstrap_room": req.bootstrap_room,
                    "prompt_tokens": len(req.origin_input_ids), "output_tokens": len(req.output_ids),
                    "decode_counts": counts.cpu().tolist()})
                counts.zero_()
    except Exception as exc:
        state.fail_once("release hook", exc)
    return None


def meta_signature(state: CaptureState, req) -> dict | None:
    if state.table is None or state.scheduler is None:
        return None
    counts = request_counts(state.scheduler.req_to_token_pool, req, state.table).index_select(0, state.publish_columns)
    return signature_message(req, counts, state.publish_layers)


def signature_for_meta_info(req) -> list:
    """``[message]`` the first time a request that asked for it
    (``sampling_params.custom_params.eldr_signature``) outputs, else ``[]``."""
    state = engine.STATE
    if state is None or not wants_signature(req):
        return []
    msg = state.pending.pop(req.rid, None)
    try:
        if msg is None and req.rid not in state.returned and req.kv.req_pool_idx is not None:
            msg = meta_signature(state, req)
    except Exception as exc:
        state.fail_once("signature in meta_info", exc)
    if req.finished():
        state.returned.discard(req.rid)
    elif msg is not None:
        state.returned.add(req.rid)
    return [msg] if msg is not None else []


def output_streamer_class_after(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.get_output_streamer_class``: a subclass that adds the
    signature to ``meta_info`` for requests that ask for it."""
    if engine.STATE is None or getattr(getattr(scheduler, "disaggregation_mode", None), "value", None) == "decode":
        return result  # a decode server received the prompt's KV, not its expert ids

    class ELDROutputStreamer(result):
        has_additional_customized_info = True

        def build_additional_customized_info(self, reqs):
            extra = super().build_additional_customized_info(reqs)
            if any(wants_signature(r) for r in reqs):  # else no key at all: stock meta_info
                extra[META_KEY] = [signature_for_meta_info(r) for r in reqs]
            return extra

        def is_request_level_customized_info_key(self, key: str) -> bool:
            return key == META_KEY or super().is_request_level_customized_info_key(key)

    return ELDROutputStreamer
