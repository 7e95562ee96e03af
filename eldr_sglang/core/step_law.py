"""The decode step-time law: the one value type the policies price with, and its fit from
the step samples an engine reports.

:class:`StepCost` is the law a policy prices with: ``t = base_s + per_seq_s * B +
per_expert_s * U`` (seconds per decode step; ``B`` the batch size, ``U`` the expected
distinct experts summed over the published layers), and a ``max_batch`` beyond which a
request queues. :func:`marginal_seconds` is the price of joining a batch, the one formula
of the policies (their loop over Python floats and their numpy path both call it; the
simulator's cost model derives its law as a :class:`StepCost`, ``sim.cost_model.step_cost``).

:class:`StepLaw` is a law fitted from an engine's steps, in engine units and with a KV
term: ``t = base_s + per_seq_s * B + per_expert_s * U + per_kv_token_s * KV`` (``U`` over
every MoE layer, ``KV`` the batch's KV tokens), every term >= 0: non-negative
least squares (``scipy.optimize.nnls``), made robust by iteratively reweighting with
Huber weights (a step slowed by something else, a compile, a swap, does not pull the
law). ``r2`` is the weighted fit's coefficient of determination on the samples; a law
that fits badly is worth less than its figures (:meth:`StepLaw.trusted_per_expert`).
:func:`as_step_cost` turns it into the policies' :class:`StepCost`.
Pure numeric; scipy is imported when a fit runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import numpy as np

from eldr_sglang.core.params import Params, param


@dataclass(frozen=True)
class StepCost(Params):
    """Decode step time ``base_s + per_seq_s * B + per_expert_s * U`` (seconds), ``U`` the
    expected distinct experts summed over the published layers. Defaults: Qwen3-30B-A3B
    on one MI300X with 2 published layers, from the simulator's cost model
    (``eldr_sglang.sim.cost_model.step_cost``; a test keeps them equal)."""

    base_s: float = param(0.006318, 0.0, "step-time law: seconds per decode step")
    per_seq_s: float = param(1.74e-05, 0.0, "step-time law: seconds per sequence in the batch")
    per_expert_s: float = param(5.698e-05, 0.0, "step-time law: seconds per distinct expert of the published layers")
    max_batch: int = param(256, 1, "batch size beyond which a request queues")

    def seconds(self, batch: Any, unique: Any) -> Any:
        """One decode step of ``batch`` sequences using ``unique`` distinct experts."""
        return self.base_s + self.per_seq_s * batch + self.per_expert_s * unique

    def marginal(self, batch: Any, unique: Any, added: Any) -> Any:
        """:func:`marginal_seconds` with this law."""
        return marginal_seconds(self.base_s, self.per_seq_s, self.per_expert_s, self.max_batch,
                                batch, unique, added)


def marginal_seconds(base_s: Any, per_seq_s: Any, per_expert_s: Any, max_batch: Any,
                     batch: Any, unique: Any, added: Any) -> Any:
    """How much the total token time of a batch (``batch`` sequences, ``unique`` distinct
    experts) grows if a request that adds ``added`` distinct experts joins it:
    ``(B + 1) t(B + 1, U + dU) - B t(B, U) = t(B, U) + (B + 1)(per_seq + per_expert dU)``,
    plus, when the batch is full (``B >= max_batch``), the wait of about ``B - max_batch + 1``
    steps. Python numbers, or numpy arrays (one entry per server: the same floats, elementwise)."""
    t0 = base_s + per_seq_s * batch + per_expert_s * unique
    score = t0 + (batch + 1) * (per_seq_s + per_expert_s * added)
    queued = batch >= max_batch
    if queued is False:  # Python numbers, the batch not full
        return score
    if isinstance(queued, np.ndarray):
        if queued.any():
            score = np.where(queued, score + (batch - max_batch + 1) * (t0 + per_seq_s + per_expert_s * added),
                             score)
    elif queued:
        score += (batch - max_batch + 1) * (t0 + per_seq_s + per_expert_s * added)
    return score


MIN_SAMPLES = 16  # fewer steps than this: no law
HUBER_K = 1.345  # Huber's tuning constant (95% efficiency under normal noise)
TRUST_R2 = 0.5  # below: the per-expert term is shrunk toward 0 (pricing toward balance)


@dataclass(frozen=True)
class StepLaw:
    base_s: float
    per_seq_s: float
    per_expert_s: float
    per_kv_token_s: float
    r2: float
    samples: int

    def seconds(self, batch: float, unique: float, kv_tokens: float = 0.0) -> float:
        return self.base_s + self.per_seq_s * batch + self.per_expert_s * unique + self.per_kv_token_s * kv_tokens

    def trusted_per_expert(self) -> float:
        """The per-expert term as far as the fit supports it: whole at ``r2 >= TRUST_R2``,
        scaled by ``r2 / TRUST_R2`` below (0 for a law that explains nothing): a bad fit
        widens the choice toward balance instead of misleading it."""
        return self.per_expert_s * min(1.0, max(0.0, self.r2) / TRUST_R2)

    def to_dict(self) -> dict:
        return asdict(self)


def _design(samples: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    rows = [(1.0, s["batch_size"], s["unique_experts"], s.get("kv_tokens", 0) or 0, s["seconds"])
            for s in samples
            if s.get("seconds") is not None and np.isfinite(s["seconds"]) and s["seconds"] > 0
            and s.get("batch_size", 0) > 0]
    if not rows:
        return np.zeros((0, 4)), np.zeros(0)
    a = np.asarray(rows, dtype=np.float64)
    return a[:, :4], a[:, 4]


def fit_step_law(samples: Sequence[dict], rounds: int = 5) -> Optional[StepLaw]:
    """The law of ``samples`` (dicts with ``batch_size``, ``unique_experts``,
    ``kv_tokens``, ``seconds``); None with fewer than :data:`MIN_SAMPLES` usable ones."""
    from scipy.optimize import nnls

    x, y = _design(samples)
    if len(y) < MIN_SAMPLES:
        return None
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns of similar size for nnls
    xs = x / scale
    w = np.ones_like(y)
    coef = np.zeros(4)
    for _ in range(rounds):
        sw = np.sqrt(w)
        coef, _ = nnls(xs * sw[:, None], y * sw)
        resid = y - xs @ coef
        mad = np.median(np.abs(resid - np.median(resid))) * 1.4826
        if mad <= 0:
            break
        u = np.abs(resid) / (HUBER_K * mad)
        w = np.where(u <= 1.0, 1.0, 1.0 / np.maximum(u, 1e-12))
    pred = xs @ coef
    mean = np.average(y, weights=w)
    ss_tot = float(np.sum(w * (y - mean) ** 2))
    r2 = 1.0 - float(np.sum(w * (y - pred) ** 2)) / ss_tot if ss_tot > 0 else 0.0
    c = coef / scale
    return StepLaw(float(c[0]), float(c[1]), float(c[2]), float(c[3]), r2, int(len(y)))


def as_step_cost(law: StepLaw, expert_factor: float, samples: Sequence[dict], default: StepCost) -> StepCost:
    """``law`` (engine units) as a policy's :class:`StepCost`. ``expert_factor``: the
    engine's distinct experts per distinct expert the policy counts (the engine sums
    every MoE layer, the policy the published ones: layers / published). The KV term is
    folded into the per-sequence one at the samples' mean KV tokens per sequence; the
    per-expert term is the trusted one (:meth:`StepLaw.trusted_per_expert`)."""
    kv = [s.get("kv_tokens", 0) / s["batch_size"] for s in samples if s.get("batch_size")]
    per_seq = law.per_seq_s + law.per_kv_token_s * (float(np.mean(kv)) if kv else 0.0)
    return StepCost(base_s=law.base_s, per_seq_s=per_seq, per_expert_s=law.trusted_per_expert() * expert_factor,
                    max_batch=default.max_batch)


def pooled_laws(per_server: Sequence[Sequence[dict]], tolerance: float = 0.2) -> list[Optional[StepLaw]]:
    """One law per server: the law fitted on every server's samples together, except for a
    server whose own law predicts its samples' mean step more than ``tolerance`` (relative)
    away from the pooled law's prediction (another kind of hardware, a slower node). A
    per-server fit from a few hundred noisy steps differs from its neighbours' by noise;
    pricing servers with laws that differ only by noise steers requests for nothing."""
    pooled = fit_step_law([s for samples in per_server for s in samples])
    out: list[Optional[StepLaw]] = []
    for samples in per_server:
        own = fit_step_law(samples)
        if own is None or pooled is None:
            out.append(own or (pooled if samples else None))
            continue
        x, _ = _design(samples)
        if not len(x):
            out.append(pooled)
            continue
        b, u, kv = x[:, 1].mean(), x[:, 2].mean(), x[:, 3].mean()
        mine, theirs = own.seconds(b, u, kv), pooled.seconds(b, u, kv)
        out.append(own if abs(mine - theirs) > tolerance * theirs else pooled)
    return out


ARTIFACT_KEY = "step_law"  # CalibrationArtifact.extra[ARTIFACT_KEY]: the law and the policy's cost


def samples_from_step_records(records: Sequence[dict]) -> list[dict]:
    """Step records as :func:`fit_step_law` takes them: trace mode's ``steps-*.jsonl``
    lines (``batch_size``, ``unique_per_layer``, ``forward_ms``) or samples already in
    the law's units (``unique_experts``, ``seconds``, optional ``kv_tokens``).
    ValueError names the first record that is neither."""
    out = []
    for i, r in enumerate(records):
        if not isinstance(r, dict) or "batch_size" not in r:
            raise ValueError(f"step record {i}: expected an object with batch_size, got {str(r)[:80]!r}")
        if "unique_per_layer" in r and "forward_ms" in r:
            out.append({"batch_size": r["batch_size"], "unique_experts": float(sum(r["unique_per_layer"])),
                        "kv_tokens": r.get("kv_tokens", 0), "seconds": float(r["forward_ms"]) / 1e3})
        elif "unique_experts" in r and "seconds" in r:
            out.append(r)
        else:
            raise ValueError(f"step record {i}: needs unique_per_layer and forward_ms (trace mode) or "
                             "unique_experts and seconds")
    return out


def artifact_entry(law: StepLaw, samples: Sequence[dict], expert_factor: float, source: str) -> dict:
    """What an artifact keeps of a fitted law: the law in engine units, and the cost a
    policy prices with (:func:`as_step_cost`: distinct experts of the published layers)."""
    cost = as_step_cost(law, expert_factor, samples, StepCost())
    return {"law": law.to_dict(), "expert_factor": float(expert_factor), "source": source,
            "policy_cost": {"base_s": cost.base_s, "per_seq_s": cost.per_seq_s, "per_expert_s": cost.per_expert_s}}


def artifact_cost_params(extra: Optional[dict]) -> dict[str, float]:
    """The policy cost an artifact's ``extra`` carries (``base_s``, ``per_seq_s``,
    ``per_expert_s``), or {} without one."""
    entry = (extra or {}).get(ARTIFACT_KEY)
    cost = entry.get("policy_cost") if isinstance(entry, dict) else None
    if not isinstance(cost, dict):
        return {}
    return {k: float(cost[k]) for k in ("base_s", "per_seq_s", "per_expert_s") if k in cost}
