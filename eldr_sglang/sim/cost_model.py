"""Analytic cost model of one MoE decode step (SIMULATED, not measured).

One decode step of a batch of ``B`` sequences holding ``C`` KV tokens in total::

    step = fixed_s
         + attn_s_per_token * B + attn_s_per_ctx_token * C         (attention, per-token work)
         + sum over MoE layers of moe_layer_time(unique experts)    (expert weights read)
         + dense_s                                                  (non-expert weights read)

    moe_layer_time(u) = moe_layer_fixed_s + moe_s_per_token * B + u * bytes_per_expert / mem_bandwidth

Decode is memory-bandwidth bound: each distinct expert the batch activates is read
once per layer, whatever the number of tokens routed to it. With expert
parallelism (``ep_size > 1``) every EP rank reads only its own experts and the
layer waits for the most loaded rank: ``u`` is then the max over ranks.

Parameter sets (effective bandwidth = peak x ``BANDWIDTH_EFFICIENCY``):

* ``qwen3-30b-a3b-mi300x``: Qwen3-30B-A3B (48 MoE layers, 128 experts, top-8,
  hidden 2048, expert FFN 768, bf16) on one MI300X (5.3 TB/s peak). The per-layer
  fixed term is fitted so that 16 -> 128 unique experts makes the MoE layer 4.7x
  slower at batch 32 and batch 32 -> 128 at 128 experts changes it by < 5%, the
  two measurements the paper reports.
* ``qwen3-30b-a3b-h200``: the same model on one H200 (4.8 TB/s peak); the
  bandwidth terms follow from the bandwidth, the fixed (launch) terms are kept.
* ``qwen3-235b-a22b-mi300x-tp4ep4``: Qwen3-235B-A22B (94 MoE layers, 128 experts,
  top-8, hidden 4096, expert FFN 1536) on 4 MI300X with TP4 for attention/dense
  weights and EP4 for experts (each GPU holds 32 whole experts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..core.step_law import StepCost

__all__ = [
    "CostParams",
    "PARAM_SETS",
    "BANDWIDTH_EFFICIENCY",
    "PAPER_EXPERT_RATIO",
    "get_params",
    "moe_layer_time",
    "step_time",
    "per_gpu_unique",
    "contiguous_placement",
    "fit_moe_layer_fixed",
    "fit_to_microbench",
    "layer_ratio",
]

BF16 = 2
BANDWIDTH_EFFICIENCY = 0.75  # achieved / peak HBM bandwidth for decode-sized reads
PAPER_EXPERT_RATIO = 4.7  # MoE layer time, 128 vs 16 unique experts (paper, Qwen3-30B-A3B, MI300X)
ANCHOR_LOW, ANCHOR_HIGH, ANCHOR_BATCH = 16, 128, 32


@dataclass(frozen=True)
class CostParams:
    """Named constants of the step-time model (seconds, bytes, bytes/s)."""

    name: str
    num_moe_layers: int
    num_experts: int
    top_k: int
    bytes_per_expert: float  # bytes of one expert's weights on ONE GPU (after TP split)
    mem_bandwidth: float  # bytes/s per GPU (effective)
    fixed_s: float  # per-step fixed overhead (launch, sampling, comms)
    attn_s_per_token: float  # per sequence in the batch
    attn_s_per_ctx_token: float  # per KV token read
    dense_s: float  # non-expert weights read per step
    tp_size: int = 1
    ep_size: int = 1
    moe_layer_fixed_s: float = 0.0  # per MoE layer: gate, dispatch, kernel launches
    moe_s_per_token: float = 0.0  # per MoE layer and sequence: expert FLOPs, dispatch

    @property
    def expert_read_s(self) -> float:
        """Seconds to read one expert's weights on one GPU."""
        return self.bytes_per_expert / self.mem_bandwidth

    @property
    def experts_per_gpu(self) -> int:
        return self.num_experts // self.ep_size


def fit_moe_layer_fixed(expert_read_s: float, moe_s_per_token: float, ratio: float = PAPER_EXPERT_RATIO,
                        low: int = ANCHOR_LOW, high: int = ANCHOR_HIGH, batch: int = ANCHOR_BATCH) -> float:
    """Per-layer fixed time so that ``layer(high) / layer(low) == ratio`` at ``batch`` sequences.

    Solves ``(a + high*b) / (a + low*b) = ratio`` for ``a = fixed + batch * per_token``.
    """
    if not 1.0 < ratio < high / low:
        raise ValueError(f"ratio {ratio} must lie in (1, {high / low})")
    a = expert_read_s * (high - ratio * low) / (ratio - 1.0)
    fixed = a - batch * moe_s_per_token
    if fixed < 0:
        raise ValueError("moe_s_per_token too large for the anchor ratio")
    return fixed


def _qwen3_30b(name: str, peak_bw: float, moe_layer_fixed_s: float | None = None) -> CostParams:
    hidden, ffn, layers, vocab = 2048, 768, 48, 151_936
    bw = peak_bw * BANDWIDTH_EFFICIENCY
    expert_bytes = 3 * hidden * ffn * BF16  # gate, up, down projections
    attn_params = layers * (hidden * 32 * 128 + 2 * hidden * 4 * 128 + 32 * 128 * hidden)  # q, k, v, o
    dense_bytes = (attn_params + 2 * vocab * hidden) * BF16  # + embedding and lm head
    kv_bytes_per_token = layers * 2 * 4 * 128 * BF16  # K and V, 4 KV heads of 128
    per_token = 0.05e-6
    fixed_layer = moe_layer_fixed_s if moe_layer_fixed_s is not None else fit_moe_layer_fixed(expert_bytes / bw, per_token)
    return CostParams(
        name=name, num_moe_layers=layers, num_experts=128, top_k=8,
        bytes_per_expert=float(expert_bytes), mem_bandwidth=bw,
        fixed_s=4e-3, attn_s_per_token=15e-6, attn_s_per_ctx_token=kv_bytes_per_token / bw,
        dense_s=dense_bytes / bw, moe_layer_fixed_s=fixed_layer, moe_s_per_token=per_token,
    )


def _qwen3_235b_tp4ep4(name: str, peak_bw: float) -> CostParams:
    hidden, ffn, layers, vocab, tp = 4096, 1536, 94, 151_936, 4
    bw = peak_bw * BANDWIDTH_EFFICIENCY
    expert_bytes = 3 * hidden * ffn * BF16  # EP: whole experts, not TP-split
    attn_params = layers * (hidden * 64 * 128 + 2 * hidden * 4 * 128 + 64 * 128 * hidden)
    dense_bytes = (attn_params + 2 * vocab * hidden) * BF16 / tp
    kv_bytes_per_token = layers * 2 * 4 * 128 * BF16 / tp  # 4 KV heads spread over 4 GPUs
    per_token = 0.2e-6
    return CostParams(
        name=name, num_moe_layers=layers, num_experts=128, top_k=8,
        bytes_per_expert=float(expert_bytes), mem_bandwidth=bw,
        fixed_s=6e-3 + layers * 2 * 15e-6,  # + two TP all-reduces per layer
        attn_s_per_token=25e-6, attn_s_per_ctx_token=kv_bytes_per_token / bw,
        dense_s=dense_bytes / bw, tp_size=tp, ep_size=4,
        moe_layer_fixed_s=fit_moe_layer_fixed(expert_bytes / bw, per_token) + 20e-6,  # + all-to-all
        moe_s_per_token=per_token,
    )


#: ``real-cpu-server``: least squares of decode step time on (1, batch size, distinct experts
#: summed over layers) over every step of one real SGLang CPU server on the fat-expert model
#: (``benchmark/results/fat_expert.json``, ``step_time_fit``; rerun with
#: ``flock /tmp/eldr-sglang.lock python -m benchmark.bench_fat_expert --repeats 4 --threads 1``).
REAL_CPU_FIT = {"fixed_s": 15.4457e-3, "per_sequence_s": 2.45912e-3, "per_distinct_expert_s": 0.732446e-3}
FAT_EXPERT_WIDTH = 4096  # tools/make_fat_expert_model.py --width


def _real_cpu_server(name: str, fixed_s: float, per_sequence_s: float, per_distinct_expert_s: float) -> CostParams:
    """The fat-expert testbed (tiny MoE: 4 layers, 128 experts, top-8, hidden 128, expert FFN
    zero-padded to 4096, bf16) on one SGLang CPU server: a measured law, no context term."""
    expert_bytes = 3 * 128 * FAT_EXPERT_WIDTH * BF16
    return CostParams(name=name, num_moe_layers=4, num_experts=128, top_k=8, bytes_per_expert=float(expert_bytes),
                      mem_bandwidth=expert_bytes / per_distinct_expert_s, fixed_s=fixed_s,
                      attn_s_per_token=per_sequence_s, attn_s_per_ctx_token=0.0, dense_s=0.0)


_MI300X = _qwen3_30b("qwen3-30b-a3b-mi300x", 5.3e12)
PARAM_SETS: dict[str, CostParams] = {
    _MI300X.name: _MI300X,
    "qwen3-30b-a3b-h200": _qwen3_30b("qwen3-30b-a3b-h200", 4.8e12, _MI300X.moe_layer_fixed_s),
    "qwen3-235b-a22b-mi300x-tp4ep4": _qwen3_235b_tp4ep4("qwen3-235b-a22b-mi300x-tp4ep4", 5.3e12),
    "real-cpu-server": _real_cpu_server("real-cpu-server", **REAL_CPU_FIT),
}


def get_params(name: str) -> CostParams:
    """Parameter set by name; ValueError lists the valid names."""
    try:
        return PARAM_SETS[name]
    except KeyError:
        raise ValueError(f"unknown cost-model parameter set {name!r}; valid: {', '.join(sorted(PARAM_SETS))}") from None


def moe_layer_time(params: CostParams, unique_experts, batch_size: int = ANCHOR_BATCH) -> float | np.ndarray:
    """Time of one MoE layer for ``unique_experts`` distinct experts (scalar or array).

    ``ep_size == 1``: elementwise over any shape (e.g. [L]). ``ep_size > 1``: the
    last axis holds per-GPU counts [..., G] and the layer waits for the largest.
    """
    u = np.asarray(unique_experts, dtype=np.float64)
    if params.ep_size > 1:
        if u.ndim == 0 or u.shape[-1] != params.ep_size:
            raise ValueError(f"{params.name}: ep_size={params.ep_size} needs per-GPU counts [..., {params.ep_size}], "
                             f"got shape {u.shape}")
        u = u.max(axis=-1)
    t = params.moe_layer_fixed_s + params.moe_s_per_token * batch_size + u * params.expert_read_s
    return float(t) if np.ndim(t) == 0 else t


def step_time(params: CostParams, batch_size: int, context_tokens: int, unique_experts) -> float:
    """Seconds of one decode step.

    ``unique_experts``: [L] distinct experts per MoE layer (``ep_size == 1``) or
    [L, G] per EP rank (``ep_size > 1``). When ``L`` differs from
    ``params.num_moe_layers`` the given layers stand for the model's layers: their
    mean layer time is multiplied by ``num_moe_layers`` (a scalar = every layer).
    """
    if batch_size <= 0:
        return 0.0
    layer_t = np.atleast_1d(moe_layer_time(params, unique_experts, batch_size))
    moe = float(layer_t.mean()) * params.num_moe_layers
    return (params.fixed_s + params.attn_s_per_token * batch_size + params.attn_s_per_ctx_token * context_tokens
            + moe + params.dense_s)


def contiguous_placement(num_experts: int, ep_size: int) -> np.ndarray:
    """Default EP placement: expert e on GPU ``e // (num_experts / ep_size)``; [E] ints."""
    if ep_size <= 0 or num_experts % ep_size:
        raise ValueError(f"{num_experts} experts cannot be split over {ep_size} GPUs")
    return np.arange(num_experts) // (num_experts // ep_size)


def per_gpu_unique(expert_use: np.ndarray, placement: np.ndarray, ep_size: int) -> np.ndarray:
    """[L, E] per-expert use (0/1 or probability of being active) -> [L, G] per-GPU sums.

    ``placement`` is [E] (same for every layer) or [L, E] GPU index per expert.
    """
    use = np.asarray(expert_use, dtype=np.float64)
    place = np.broadcast_to(np.asarray(placement), use.shape)
    out = np.zeros((use.shape[0], ep_size))
    rows = np.broadcast_to(np.arange(use.shape[0])[:, None], use.shape)
    np.add.at(out, (rows, place), use)
    return out


def with_overrides(params: CostParams, **changes) -> CostParams:
    """A copy of ``params`` with some fields changed (e.g. ``fixed_s``)."""
    return replace(params, **changes)


def step_cost(params: CostParams, published_layers: int, expert_scale: float = 1.0, max_batch: int = 256,
              context_tokens: float = 0.0) -> StepCost:
    """The policies' step-time law (:class:`~eldr_sglang.core.step_law.StepCost`) for ``params`` (no EP max):
    ``base + per_seq * B + per_expert * U`` with ``U`` the distinct experts summed over
    ``published_layers`` trace layers, each standing for ``num_moe_layers / published_layers``
    layers of the model, counted in trace experts (``expert_scale`` = model experts per
    trace expert). ``context_tokens``: the KV tokens of an average running sequence, whose
    KV read is added to ``per_seq`` (0: the KV term is left out)."""
    L = params.num_moe_layers
    return StepCost(base_s=params.fixed_s + params.dense_s + params.moe_layer_fixed_s * L,
                    per_seq_s=(params.attn_s_per_token + params.moe_s_per_token * L
                               + params.attn_s_per_ctx_token * context_tokens),
                    per_expert_s=params.expert_read_s * L / published_layers * expert_scale,
                    max_batch=max_batch)


def fit_to_microbench(base: CostParams, rows: list[dict], bytes_per_expert: float, name: str) -> CostParams:
    """``base`` with its MoE-layer terms fitted to a microbenchmark: least squares of
    ``median_ms ~ fixed + per_token * batch + per_expert * unique`` over its rows
    (``{"batch", "unique", "median_ms"}``). The per-expert time becomes the effective
    bandwidth ``bytes_per_expert / per_expert``; the attention and dense terms are kept."""
    a = np.array([[1.0, r["batch"], r["unique"]] for r in rows])
    t = np.array([r["median_ms"] for r in rows]) * 1e-3
    (fixed, per_token, per_expert), *_ = np.linalg.lstsq(a, t, rcond=None)
    if per_expert <= 0 or fixed < 0:
        raise ValueError(f"microbenchmark fit is not physical (fixed {fixed:.3g} s, per expert {per_expert:.3g} s)")
    return replace(base, name=name, moe_layer_fixed_s=float(fixed), moe_s_per_token=float(max(per_token, 0.0)),
                   mem_bandwidth=bytes_per_expert / float(per_expert), bytes_per_expert=float(bytes_per_expert))


def layer_ratio(params: CostParams, low: int = ANCHOR_LOW, high: int = ANCHOR_HIGH, batch: int = ANCHOR_BATCH) -> float:
    """MoE layer time at ``high`` over ``low`` distinct experts (the paper reports 4.7x)."""
    if params.ep_size > 1:
        lo, hi = np.full(params.ep_size, low / params.ep_size), np.full(params.ep_size, high / params.ep_size)
        return float(moe_layer_time(params, hi, batch) / moe_layer_time(params, lo, batch))
    return float(moe_layer_time(params, high, batch) / moe_layer_time(params, low, batch))

