"""Expert-id capture inside SGLang's scheduler process.

Hooks (registered by ``eldr_sglang.patches.register`` when ELDR flags are set):

* AROUND ``ModelRunner.forward``: remembers the running ``ForwardBatch``;
* AFTER ``layers.moe.topk.select_experts``: during prefill (extend) batches,
  writes the top-k ids of the selected layers into the KV-slot table
  (vectorised, on the model's device, no host sync); during decode batches,
  marks the experts each layer activates, for the unique-experts-per-step
  figure;
* AROUND ``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill``:
  for each request whose prefill finished, counts the ids over all its prompt
  slots (cached prefix + new tokens) and hands a signature message to the
  publisher.

Ids are logical expert ids (taken before any EP logical->physical mapping).
Every hook is guarded: an error is logged once and the server carries on as
stock SGLang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eldr_sglang.core.counts_codec import pack_counts
from eldr_sglang.patches.flags import REQUEST_ONLY, SPREAD, EngineConfig, FlagError, check_model_dims
from eldr_sglang.patches.publish import RETURN_ADDRESS_KEY, SignaturePublisher
from eldr_sglang.radix_signature import ExpertSlotTable

logger = logging.getLogger("eldr_sglang.capture")

HEALTH_CHECK_PREFIX = "HEALTH_CHECK"


@dataclass
class DecodeStats:
    """Unique experts per decode step, summed over MoE layers; kept on device
    and read only when the metrics endpoint is scraped."""

    steps: int = 0
    tokens: int = 0
    unique_total: torch.Tensor | None = None
    active: torch.Tensor | None = None  # [num_layers, num_experts] bool for the running step

    def mean_unique_per_step(self) -> float:
        return float(self.unique_total.item()) / self.steps if self.steps and self.unique_total is not None else 0.0


@dataclass
class CaptureState:
    config: EngineConfig
    table: ExpertSlotTable | None = None
    decode: DecodeStats = field(default_factory=DecodeStats)
    forward_batch: object | None = None
    ready: bool = False
    failed: set = field(default_factory=set)
    publisher: object | None = None
    trace_writer: object | None = None
    # trace mode only, indexed by request-pool row: decode expert counts
    # [rows, layers, experts] and prefill gate sums (softmax probs, raw logits)
    decode_acc: torch.Tensor | None = None
    gate_prob: torch.Tensor | None = None
    gate_logit: torch.Tensor | None = None
    publish_layers: list[int] = field(default_factory=list)
    model: dict | None = None  # name, num_layers, num_experts, top_k (sent with signatures)
    publish_columns: torch.Tensor | None = None
    scheduler: object | None = None
    returned: set = field(default_factory=set)  # rids whose signature went into meta_info
    pending: dict = field(default_factory=dict)  # rid -> signature computed as its KV was released

    def fail_once(self, where: str, exc: BaseException) -> None:
        if where not in self.failed:
            self.failed.add(where)
            logger.exception("eldr-sglang: %s failed; continuing without it (%s)", where, exc)


STATE: CaptureState | None = None


def model_dims(model_runner) -> tuple[int, int, int]:
    hf = model_runner.model_config.hf_config
    hf = getattr(hf, "text_config", None) or hf
    num_experts = getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None)
    return hf.num_hidden_layers, num_experts, hf.num_experts_per_tok


def _selected_layers(config: EngineConfig, num_layers: int) -> list[int]:
    """Layers whose counts are published (the artifact's, or --eldr-layers)."""
    if config.calibration:
        from eldr_sglang.core.artifact import load_artifact

        return list(load_artifact(config.calibration).layers)
    if config.layers == "all":
        return list(range(num_layers))
    if config.layers == SPREAD:
        from eldr_sglang.core.layer_selection import spread_layers

        return spread_layers(num_layers)
    return list(config.layers or ())


def _tp_rank() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:
        return 0


def _leads_its_requests() -> bool:
    """Whether this process's scheduler owns requests to publish: the first rank of
    its attention group (``attn_tp_rank == attn_cp_rank == 0``). Without attention
    data parallelism that is TP rank 0 alone; with it, one rank per attention-DP
    group, each publishing its own requests."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return int(getattr(p, "attn_tp_rank", p.tp_rank)) == 0 and int(getattr(p, "attn_cp_rank", 0)) == 0
    except Exception:
        return True


def _init(state: CaptureState, model_runner) -> None:
    num_layers, num_experts, top_k = model_dims(model_runner)
    try:
        check_model_dims(state.config, num_layers, num_experts, top_k)
    except FlagError as exc:
        raise RuntimeError(str(exc)) from None
    device = model_runner.device
    state.publish_layers = _selected_layers(state.config, num_layers)
    state.model = {"name": Path(str(model_runner.model_config.model_path)).name or "unknown",
                   "num_layers": num_layers, "num_experts": num_experts, "top_k": top_k}
    # trace mode keeps every layer (then only the selected ones are published)
    layers = list(range(num_layers)) if state.config.trace_dir else state.publish_layers
    leader = _leads_its_requests()
    if layers and leader:  # only the rank that publishes reads it: no copy on TP/EP followers
        pool = model_runner.token_to_kv_pool
        num_slots = pool.size + getattr(pool, "page_size", 1)
        state.table = ExpertSlotTable(num_slots, layers, num_experts, top_k, device=device)
        state.publish_columns = torch.tensor([layers.index(l) for l in state.publish_layers], device=device)
        logger.info("eldr-sglang: capturing layers %s: %d B per KV slot (%d slots)",
                    layers, state.table.bytes_per_token, num_slots)
    state.decode.unique_total = torch.zeros((), dtype=torch.int64, device=device)
    state.decode.active = torch.zeros((num_layers, num_experts), dtype=torch.bool, device=device)
    if not leader:  # TP/EP followers: their leader publishes and writes traces
        state.ready = True
        return
    if state.config.publish and state.table is not None:
        default = None if state.config.publish == REQUEST_ONLY else state.config.publish
        state.publisher = SignaturePublisher(default, timeout=state.config.publish_timeout)
    if state.config.trace_dir:
        from eldr_sglang.patches.trace_log import TraceLog

        state.trace_writer = TraceLog(state.config.trace_dir)
        rows = model_runner.req_to_token_pool.size + 1
        state.decode_acc = torch.zeros((rows, num_layers, num_experts), dtype=torch.int32, device=device)
        state.gate_prob = torch.zeros((rows, num_layers, num_experts), dtype=torch.float32, device=device)
        state.gate_logit = torch.zeros_like(state.gate_prob)
    state.ready = True


def scheduler_init_after(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.__init__``: the metrics endpoint is up as soon as the
    server is (not only after its first forward); rank 0 only."""
    state = STATE
    if state is not None:
        state.scheduler = scheduler
    if state is not None and state.config.metrics_port and _tp_rank() == 0:
        try:
            from eldr_sglang.patches.metrics import serve_metrics

            serve_metrics(state, state.config.metrics_port)
        except Exception as exc:
            state.fail_once(f"metrics endpoint on port {state.config.metrics_port}", exc)
    return result


def forward_around(original, model_runner, forward_batch, *args, **kwargs):
    state = STATE
    if state is None:
        return original(model_runner, forward_batch, *args, **kwargs)
    try:
        if not state.ready and "initialisation" not in state.failed:  # one try: a failure disables capture
            _init(state, model_runner)
        state.forward_batch = forward_batch
    except Exception as exc:
        state.fail_once("initialisation", exc)
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
                    state.trace_writer.write("steps", {"batch_size": int(forward_batch.batch_size),
                                                       "unique_per_layer": d.active.sum(dim=1).tolist()})
                d.active.zero_()
                d.steps += 1
                d.tokens += int(forward_batch.batch_size)
        except Exception as exc:
            state.fail_once("decode statistics", exc)


def select_experts_after(result, *args, layer_id=None, **kwargs):
    state = STATE
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


def _add_gate_sums(state: CaptureState, fb, layer_id: int, args, kwargs) -> None:
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


def prompt_counts(scheduler, req, table: ExpertSlotTable) -> torch.Tensor:
    """Expert counts over every prompt token of ``req`` (cached + computed)."""
    n = len(req.origin_input_ids)
    slots = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n]
    return table.counts(slots)


def signature_message(req, counts: torch.Tensor, layers: list[int], packed: bool = False,
                      model: dict | None = None) -> dict:
    """The router's message; ``packed`` sends counts as a base64 array (publishing),
    else as lists of rows (traces, ``meta_info``). ``model`` lets a router without an
    artifact (``--online``) name the model of the artifact it fits."""
    msg = {
        "bootstrap_room": req.bootstrap_room,
        "rid": req.rid,
        "prompt_tokens": len(req.origin_input_ids),
        "cached_tokens": int(getattr(req, "cached_tokens", 0) or 0),
        "layers": layers,
        "counts": pack_counts(counts.cpu().numpy()) if packed else counts.cpu().tolist(),
    }
    if model is not None:
        msg["model"] = model
    return msg


def return_address(req) -> str | None:
    """Where the request's router wants its signature (``custom_params[RETURN_ADDRESS_KEY]``,
    set by the router), else None (the ``--eldr-publish`` address); malformed means None."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    dest = params.get(RETURN_ADDRESS_KEY) if isinstance(params, dict) else None
    return dest if isinstance(dest, str) and dest else None


def disagg_prefill_around(original, scheduler, batch, *args, **kwargs):
    """AROUND ``process_batch_result_disagg_prefill``: publish once per request, after
    its LAST chunk. Which requests finish their prefill in this batch is read before
    the call: SGLang decrements ``inflight_middle_chunks`` of a middle chunk inside it,
    so afterwards a middle chunk looks like a last one."""
    state = STATE
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
                _clear_gate_sums(state, req.kv.req_pool_idx)  # the next request in this row starts at 0
                continue
            dest = return_address(req)
            publish = state.publisher is not None and (dest is not None or state.publisher.url is not None)
            if not publish and state.trace_writer is None:
                continue
            counts = prompt_counts(scheduler, req, state.table)
            if publish:
                published = counts.index_select(0, state.publish_columns)
                state.publisher.submit(signature_message(req, published, state.publish_layers, packed=True,
                                                             model=state.model), dest)
            if state.trace_writer is not None:
                _write_prefill_trace(state, req, scheduler, counts)
    except Exception as exc:
        state.fail_once("signature publishing", exc)


def _clear_gate_sums(state: CaptureState, row: int) -> None:
    if state.gate_prob is not None:
        state.gate_prob[row] = 0
        state.gate_logit[row] = 0


def _colocated(state: CaptureState) -> bool:
    """A server that prefills and decodes (no PD disaggregation)."""
    mode = getattr(getattr(state.scheduler, "disaggregation_mode", None), "value", "null")
    return state.scheduler is not None and mode == "null"


def _write_prefill_trace(state: CaptureState, req, scheduler, counts: torch.Tensor | None = None) -> None:
    """Trace mode: the prompt's expert counts (every layer) and gate sums; clears the row."""
    if counts is None:
        counts = prompt_counts(scheduler, req, state.table)
    row = req.kv.req_pool_idx
    state.trace_writer.write("prefill", {
        **signature_message(req, counts, state.table.layers), "gate_prob_sums": state.gate_prob[row].cpu().tolist(),
        "gate_logit_sums": state.gate_logit[row].cpu().tolist()})
    _clear_gate_sums(state, row)


def release_before(req, *args, **kwargs):
    """BEFORE ``mem_cache.common.release_kv_cache`` (the request's KV rows are
    still valid): keep the signature a request asked for until its output is
    streamed; in trace mode, write its decode expert counts (and, on a co-located
    server, its prompt counts) and clear its row."""
    state = STATE
    if state is None or getattr(req, "kv", None) is None or req.kv.req_pool_idx is None:
        return None
    try:
        if wants_signature(req) and req.rid not in state.returned:
            msg = _meta_signature(state, req)
            if msg is not None:
                state.pending[req.rid] = msg
        if state.decode_acc is not None and str(req.rid).startswith(HEALTH_CHECK_PREFIX):
            state.decode_acc[req.kv.req_pool_idx].zero_()  # the row's next request starts at 0
            _clear_gate_sums(state, req.kv.req_pool_idx)
        elif state.decode_acc is not None:
            if _colocated(state) and state.table is not None:
                _write_prefill_trace(state, req, state.scheduler)
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


META_KEY = "eldr_signature"


def wants_signature(req) -> bool:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return isinstance(params, dict) and bool(params.get(META_KEY))


def _meta_signature(state: CaptureState, req) -> dict | None:
    if state.table is None or state.scheduler is None:
        return None
    counts = prompt_counts(state.scheduler, req, state.table).index_select(0, state.publish_columns)
    return signature_message(req, counts, state.publish_layers)


def signature_for_meta_info(req) -> list:
    """``[message]`` the first time a request that asked for it
    (``sampling_params.custom_params.eldr_signature``) outputs, else ``[]``."""
    state = STATE
    if state is None or not wants_signature(req):
        return []
    msg = state.pending.pop(req.rid, None)
    try:
        if msg is None and req.rid not in state.returned and req.kv.req_pool_idx is not None:
            msg = _meta_signature(state, req)
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
    if STATE is None or getattr(getattr(scheduler, "disaggregation_mode", None), "value", None) == "decode":
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
