"""The engine plugin's state in one scheduler process: one typed object, built at the
first forward (``initialise``) and found by every hook through :data:`STATE`.

Set by ``eldr_sglang.patches.register_capture`` when ELDR flags are given; None
otherwise (the hooks then do nothing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eldr_sglang.patches.flags import REQUEST_ONLY, SPREAD, EngineConfig, FlagError, check_model_dims
from eldr_sglang.patches.publish import SignaturePublisher
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


def initialise(state: CaptureState, model_runner) -> None:
    """Tensors, table, publisher and trace writer, sized from the loaded model."""
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
