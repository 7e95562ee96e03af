"""The engine plugin's state in one scheduler process: one typed object, found by
every hook through :data:`STATE`, its tensors built by :func:`initialise` before
SGLang captures its CUDA graphs (``ModelRunner.init_cuda_graphs``) and never
reallocated afterwards (a graph bakes their addresses in).

Set by ``eldr_sglang.patches.register_capture`` when ELDR flags are given; None
otherwise (the hooks then do nothing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eldr_sglang.patches.flags import SPREAD, EngineConfig, FlagError, check_model_dims
from eldr_sglang.radix_signature import ExpertSlotTable
from eldr_sglang.radix_signature.staging import ExpertStage

logger = logging.getLogger("eldr_sglang.capture")

HEALTH_CHECK_PREFIX = "HEALTH_CHECK"


@dataclass
class DecodeStats:
    """Unique experts per decode step, summed over MoE layers; kept on device
    and read only when the metrics endpoint is scraped."""

    steps: int = 0
    tokens: int = 0
    unique_total: torch.Tensor | None = None
    active: torch.Tensor | None = None  # [num_layers, num_experts] bool for the last step (a view of hits)
    hits: torch.Tensor | None = None  # [num_layers, num_experts + 1]: the last column takes invalid ids
    report: object | None = None  # BatchReport: the live batch for the router's load poll

    def mean_unique_per_step(self) -> float:
        return float(self.unique_total.item()) / self.steps if self.steps and self.unique_total is not None else 0.0


@dataclass
class CaptureState:
    config: EngineConfig
    table: ExpertSlotTable | None = None
    stage: ExpertStage | None = None  # written inside the forward (graph-safe), read after it
    table_columns: torch.Tensor | None = None  # stage column of each table layer (None: the same layers)
    physical_ids: bool = False  # select_experts returned physical expert slots (EPLB dispatch)
    cursor: dict | None = None  # two-batch overlap (eager only): next stage row per layer
    capacity_logged: bool = False
    decode: DecodeStats = field(default_factory=DecodeStats)
    forward_batch: object | None = None  # the live batch: read by trace-mode gate sums only (eager)
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


def publisher_for(config):
    """The signature publisher of ``config`` (:func:`eldr_sglang.patches.publish.publisher_for`),
    imported when a server publishes: the wire format needs numpy and orjson, the
    staging and after-forward paths need torch alone."""
    from eldr_sglang.patches.publish import publisher_for as build

    return build(config)


def model_dims(model_runner) -> tuple[int, int, int]:
    hf = model_runner.model_config.hf_config
    hf = getattr(hf, "text_config", None) or hf
    num_experts = getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None)
    return hf.num_hidden_layers, num_experts, hf.num_experts_per_tok


def selected_layers(config: EngineConfig, num_layers: int) -> list[int]:
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


def tp_rank() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:
        return 0


def leads_its_requests() -> bool:
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


def staging_rows(model_runner) -> int:
    """Rows one forward can hand the MoE layers: the larger of a prefill chunk and
    the running requests (the running requests alone on a PD decode server), times
    the attention-DP ranks gathered (SGLang's own routed-experts capturer sizes its
    device buffer the same way)."""
    args = getattr(model_runner, "server_args", None)
    chunk = int(getattr(args, "chunked_prefill_size", 0) or 0)
    if chunk <= 0:  # chunked prefill off: one prefill takes up to max_prefill_tokens
        chunk = int(getattr(args, "max_prefill_tokens", 0) or 16384)
    running = int(getattr(model_runner, "max_running_requests", 0) or 0)
    if str(getattr(args, "disaggregation_mode", "null")) == "decode" and running > 0:
        chunk = 0  # a PD decode server runs decode batches only (more rows: skipped, logged once)
    dp = 1
    try:
        from sglang.srt.runtime_context import get_parallel

        dp = max(1, int(getattr(get_parallel(), "num_dp_ranks", 1) or 1))
    except Exception:
        pass
    return max(chunk, running, 1) * dp


def num_expert_ids(model_runner, num_experts: int) -> int:
    """Range of the ids ``select_experts`` returns: logical experts plus redundant
    physical slots under EPLB."""
    try:
        from sglang.srt.runtime_context import get_exec

        return num_experts + int(get_exec().moe.ep_num_redundant_experts or 0)
    except Exception:
        return num_experts


def two_batch_overlap(model_runner) -> bool:
    return bool(getattr(getattr(model_runner, "server_args", None), "enable_two_batch_overlap", False))


def initialise(state: CaptureState, model_runner) -> None:
    """Tensors, table, staging, publisher and trace writer, sized from the loaded
    model. Called once, before SGLang captures its graphs; draft workers (a
    speculative decoding's draft model) are never passed here."""
    num_layers, num_experts, top_k = model_dims(model_runner)
    try:
        check_model_dims(state.config, num_layers, num_experts, top_k)
    except FlagError as exc:
        raise RuntimeError(str(exc)) from None
    device = model_runner.device
    state.publish_layers = selected_layers(state.config, num_layers)
    state.model = {"name": Path(str(model_runner.model_config.model_path)).name or "unknown",
                   "num_layers": num_layers, "num_experts": num_experts, "top_k": top_k}
    # trace mode keeps every layer (then only the selected ones are published)
    layers = list(range(num_layers)) if state.config.trace_dir else state.publish_layers
    leader = leads_its_requests()
    if layers and leader:  # only the rank that publishes reads it: no copy on TP/EP followers
        pool = model_runner.token_to_kv_pool
        num_slots = pool.size + getattr(pool, "page_size", 1)
        state.table = ExpertSlotTable(num_slots, layers, num_experts, top_k, device=device)
        state.publish_columns = torch.tensor([layers.index(l) for l in state.publish_layers], device=device)
        logger.info("eldr-sglang: capturing layers %s: %d B per KV slot (%d slots)",
                    layers, state.table.bytes_per_token, num_slots)
    # decode statistics are served by TP rank 0 (the metrics endpoint) and traced by leaders
    decode_stats = bool(state.config.metrics_port and tp_rank() == 0) or bool(state.config.trace_dir and leader)
    staged = list(range(num_layers)) if decode_stats else (layers if state.table is not None else [])
    if staged:
        state.stage = ExpertStage(staging_rows(model_runner), staged, num_expert_ids(model_runner, num_experts),
                                  top_k, device=device)
        if state.table is not None and state.table.layers != staged:
            state.table_columns = torch.tensor([staged.index(l) for l in state.table.layers], device=device)
        logger.info("eldr-sglang: staging %d rows x %d layers (%d B) before the CUDA graphs are captured",
                    state.stage.rows, len(staged), state.stage.nbytes)
    if two_batch_overlap(model_runner):
        state.cursor = {}  # the graphs are off (graph_safe_argv): micro-batches stage one after another
    if decode_stats:
        d = state.decode
        d.unique_total = torch.zeros((), dtype=torch.int64, device=device)
        d.hits = torch.zeros((num_layers, num_experts + 1), dtype=torch.bool, device=device)
        d.active = d.hits[:, :num_experts]
        if state.config.metrics_port:
            from eldr_sglang.patches.batch_report import BatchReport

            d.report = BatchReport(num_layers, num_experts, device)
    if not leader:  # TP/EP followers: their leader publishes and writes traces
        state.ready = True
        return
    if state.config.publish and state.table is not None:
        state.publisher = publisher_for(state.config)
    if state.config.trace_dir:
        from eldr_sglang.patches.trace_log import TraceLog

        state.trace_writer = TraceLog(state.config.trace_dir)
        rows = model_runner.req_to_token_pool.size + 1
        state.decode_acc = torch.zeros((rows, num_layers, num_experts), dtype=torch.int32, device=device)
        state.gate_prob = torch.zeros((rows, num_layers, num_experts), dtype=torch.float32, device=device)
        state.gate_logit = torch.zeros_like(state.gate_prob)
    state.ready = True
