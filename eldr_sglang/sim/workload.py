"""Turn a TraceSet into SIMULATED requests: lengths, labels and decode expert profiles.

Compression of per-step expert sets (traces store only per-request totals):
``decode_counts[L, E]`` counts the decode steps in which expert ``e`` was in the
request's top-k at layer ``L``. The request's number of decode steps is estimated
as ``decode_counts.sum() / (L * top_k)`` (every step picks exactly ``top_k``
experts per layer), and at least the largest single count and ``p[L, E] = decode_counts / steps`` (clipped below 1) is
the probability that one of its steps uses expert ``e``. A batch's distinct
experts per layer is then the EXPECTED UNION of independent Bernoulli draws,
``sum_e (1 - prod_r (1 - p_re))``; the simulator keeps ``sum_r log(1 - p_re)``
per server, so :data:`SimWorkload.log1mp` stores ``log(1 - p)``.

Replay instead of the approximation: where a trace set was recorded with the expert
set of every decode step (``tools/record_long_decodes.py``: ``steps.npz``),
:attr:`SimWorkload.step_experts` holds them ([N, T, L, top_k] expert ids) and the
simulator takes a batch's TRUE union at every step, request r contributing its
step ``(steps since it joined) mod T``.

Lengths: the trace's own prompt/output lengths, optionally rescaled to target
means (the relative spread of the trace is kept); output lengths are at least 2
so every request has at least one decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.step_sets import P_MAX, STEPS_FILE, decode_step_probs, load_step_experts
from ..core.traces import TraceSet

__all__ = ["SimWorkload", "decode_step_probs", "build_workload", "label_kind_for", "load_step_experts",
           "STEPS_FILE", "P_MAX"]


@dataclass
class SimWorkload:
    """Per-request arrays the simulator draws from (N requests of one split)."""

    name: str
    prompt_tokens: np.ndarray  # [N] int64
    output_tokens: np.ndarray  # [N] int64, >= 2
    log1mp: np.ndarray  # [N, L, E] float64, log(1 - p) per decode step
    labels: np.ndarray  # [N] str, the label the Domain baseline partitions by
    num_experts: int
    top_k: int
    step_experts: np.ndarray | None = None  # [N, T, L, top_k] recorded expert ids per decode step

    def __len__(self) -> int:
        return int(self.prompt_tokens.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.log1mp.shape[1])

    def mean_unique_fraction(self) -> float:
        """Mean over requests and layers of (distinct experts of ONE decode step) / E: top_k / E."""
        return float((1.0 - np.exp(self.log1mp)).sum(axis=2).mean() / self.num_experts)


def label_kind_for(traces: TraceSet, workload: str) -> str:
    """The label kind the Domain baseline uses: "language" for the language workload,
    else "domain" (or "task", the synthetic traces' name for it)."""
    wanted = ("language",) if workload == "language" else ("domain", "task")
    for kind in wanted:
        if kind in traces.labels:
            return kind
    raise ValueError(f"traces have labels {sorted(traces.labels)}; workload {workload!r} needs one of {wanted}")


def _rescale(lengths: np.ndarray, target_mean: float | None, minimum: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.float64)
    if target_mean:
        lengths = lengths * (target_mean / max(lengths.mean(), 1e-9))
    return np.maximum(np.rint(lengths), minimum).astype(np.int64)


def build_workload(traces: TraceSet, label_kind: str, name: str = "",
                   mean_prompt_tokens: float | None = None,
                   mean_output_tokens: float | None = None,
                   step_experts: np.ndarray | None = None) -> SimWorkload:
    """Simulated requests from ``traces`` (lengths rescaled to the given means when set);
    ``step_experts`` ([N, T, L, top_k], :func:`load_step_experts`) switches the simulator
    from the independence approximation to replaying the recorded per-step sets."""
    if label_kind not in traces.labels:
        raise ValueError(f"label kind {label_kind!r} not in the traces' labels {sorted(traces.labels)}")
    return SimWorkload(
        name=name or traces.model.name,
        prompt_tokens=_rescale(traces.prompt_tokens, mean_prompt_tokens, 1),
        output_tokens=_rescale(traces.output_tokens, mean_output_tokens, 2),
        log1mp=np.log1p(-decode_step_probs(traces)),
        labels=np.asarray(traces.labels[label_kind], dtype=str),
        num_experts=traces.model.num_experts,
        top_k=traces.model.top_k,
        step_experts=step_experts,
    )
