"""ELDR balanced: locality only while it is cheaper than imbalance (the router's default).

Default rule, filter -> score -> pick:

1. **filter** (bounded load, as in consistent hashing with bounded loads): a server may
   take the request only while it holds fewer than ``ceil(load_cap * mean + load_slack)``
   in flight, ``mean`` over the candidates with the request (never empties the list);
2. **score**: the state-aware marginal cost (:mod:`.state_aware`): how much the total
   token time of a server's batch grows if the request joins it, from the live batch's
   expected distinct experts and the step-time law ``base + per_seq B + per_expert U``
   (per_seq includes the KV read of an average sequence). Balance and locality are
   priced in one unit, seconds;
3. **pick**: among the candidates whose cost is within ``cost_band`` (relative, default 5%)
   of the cheapest, the one whose calibration region (centroids it owns, as in ``eldr``)
   is most similar to the request's signature. While servers cost about the same,
   requests stick to their regions, so batches stay grouped as they turn over; once a
   region's servers get busier than ``cost_band`` buys, requests go elsewhere, so a
   calibration-time mix that differs from the live one cannot pile requests on one
   server. Once the candidates' mean in flight reaches ``max_batch`` (every batch full,
   requests queue) the band is ``cost_band_full`` (default 50%): a step's distinct experts
   then set how fast each server drains its queue, and the marginal cost, dominated by the
   queue wait, would otherwise trade that locality for balance the cap already keeps.
   Without an artifact or a signature: the cheapest candidate.

Chosen by ``benchmark/bench_default_policy.py`` and ``benchmark/bench_locality.py``
(SIMULATED): of the variants screened, the 5% band had the best median TPOT (with 3%)
and more locality than 2-3% at low load; the locality pick below keeps more locality at
20 req/s but costs median and P99 TPOT at every load. The queue band changes nothing
until batches are full and cut the median TPOT at 550 req/s (24P16D) by 7-10%.

The locality pick (``sim_band`` set; :mod:`.locality`): bounded load, then the servers
whose region is within ``sim_band`` of the most similar one (the band widens linearly to
``sim_band_full`` as the mean in flight nears ``max_batch``), then the cheapest by the
state-aware cost.

``cost_band = 0`` is the plain state-aware cost with similarity tie-breaks. The paper's
band rule (similarity band, least loaded) stays available as ``eldr``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

import numpy as np

from eldr_sglang.core.policies.base import Decision, LazyDecision, PolicySpec, _candidates, register_policy
from eldr_sglang.core.policies.eldr import CentroidOwnership
from eldr_sglang.core.policies.locality import band_width, bounded, queue_band, region_band
from eldr_sglang.core.params import Params, param, param_of
from eldr_sglang.core.policies.state_aware import StateAwarePolicy
from eldr_sglang.core.step_law import StepCost

# The default (chosen by benchmark/bench_default_policy.py and bench_locality.py, SIMULATED): a
# server takes the request while it holds fewer than ceil(1.25 x mean + 3) in flight; among those,
# the ones within 5% of the cheapest cost (50% once the mean in flight reaches a full batch); of those, the
# most similar region.
DEFAULT_COST_BAND = 0.05
# The locality pick (sim_band set): the regions within sim_band (cosine) of the most similar one,
# widening to sim_band_full as the mean in flight nears a full batch; of those, the cheapest.
DEFAULT_SIM_BAND: Optional[float] = None
DEFAULT_SIM_BAND_FULL: Optional[float] = 0.15  # the band once the mean in flight reaches max_batch
DEFAULT_COST_BAND_FULL: Optional[float] = 0.5  # the cost band once the mean in flight reaches max_batch (every batch full)
DEFAULT_LOAD_CAP: Optional[float] = 1.25
DEFAULT_LOAD_SLACK = 3.0  # requests a server may hold above load_cap x the mean
# StepCost() plus the KV read of a 750-token sequence (600 prompt + half of 300 output tokens)
# at Qwen3-30B-A3B's 98,304 KV bytes per token on one MI300X (sim.cost_model.step_cost with
# context_tokens=750; a test keeps them equal)
BALANCED_COST = StepCost(per_seq_s=3.5948e-05)


@dataclass(frozen=True)
class BalancedParams(Params):
    """``eldr_balanced``'s parameters, each with its bounds (checked by :class:`Params`), and
    the step-time law (:class:`StepCost`'s fields; default :data:`BALANCED_COST`)."""

    cost_band: float = param(DEFAULT_COST_BAND, 0.0, "cost band, relative to the cheapest candidate")
    cost_band_full: Optional[float] = param(DEFAULT_COST_BAND_FULL, 0.0, "the cost band once the mean in "
                                            "flight reaches max_batch; none: cost_band")
    load_cap: Optional[float] = param(DEFAULT_LOAD_CAP, 1.0, "bounded load: at most ceil(load_cap x mean "
                                      "+ load_slack) in flight; none: no cap")
    load_slack: float = param(DEFAULT_LOAD_SLACK, 0.0, "requests a server may hold above load_cap x the mean")
    sim_band: Optional[float] = param(DEFAULT_SIM_BAND, 0.0, "none: the cost-band rule; a number: the "
                                      "locality pick's similarity band (cosine)")
    sim_band_full: Optional[float] = param(DEFAULT_SIM_BAND_FULL, 0.0, "the locality pick's band once the "
                                           "mean in flight reaches max_batch; none: sim_band")
    base_s: float = param_of(StepCost, "base_s", BALANCED_COST.base_s)
    per_seq_s: float = param_of(StepCost, "per_seq_s", BALANCED_COST.per_seq_s)
    per_expert_s: float = param_of(StepCost, "per_expert_s", BALANCED_COST.per_expert_s)
    max_batch: int = param_of(StepCost, "max_batch", BALANCED_COST.max_batch)

    def step_cost(self) -> StepCost:
        return StepCost(self.base_s, self.per_seq_s, self.per_expert_s, self.max_batch)


_LAW = tuple(f.name for f in fields(StepCost))
_RULE = tuple(f.name for f in fields(BalancedParams) if f.name not in _LAW)  # the rule's own parameters


class EldrBalancedPolicy(StateAwarePolicy):
    """Cheapest-cost band, then the most similar region (see the module docstring).

    Built from its parameters, ``params`` (:class:`BalancedParams`, checked there);
    ``cost`` and keyword fields (``cost_band=0.02``) override them. They read as
    attributes (``policy.cost_band``)."""

    name = "eldr_balanced"
    # a cost band of up to this many servers reads their similarities with one dot per owned
    # centroid (~1 us each at D = 6,144) instead of the [K, D] matvec (~7 us at K = 24)
    BAND_SCAN_MAX = 4

    def __init__(self, num_servers: int, params: Optional[BalancedParams] = None, *, dim: Optional[int] = None,
                 centroids: Optional[np.ndarray] = None, cost: Optional[StepCost] = None, **overrides) -> None:
        prm = params if params is not None else BalancedParams()
        if cost is not None:
            overrides = {**asdict(cost), **overrides}
        if overrides:
            prm = replace(prm, **overrides)
        super().__init__(num_servers, dim, prm.step_cost())
        self.params = prm
        self.ownership = None if centroids is None else CentroidOwnership(centroids, num_servers)
        self.centroids = None if self.ownership is None else self.ownership.centroids

    def __getattr__(self, name: str):  # the rule's parameters as attributes (not on the hot path)
        if name in _RULE and "params" in self.__dict__:
            return getattr(self.__dict__["params"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def add_server(self) -> None:
        super().add_server()
        if self.ownership is not None:
            self.ownership.add()

    def remove_server(self, index: int) -> None:
        super().remove_server(index)
        if self.ownership is not None:
            self.ownership.remove(index)

    def _capped(self, cand: list[int], loads) -> list[int]:
        """Filter step: the candidates below their bounded-load capacity (all if none is)."""
        return bounded(cand, loads, self.params.load_cap, self.params.load_slack)

    def explain(self, request, loads, allowed=None) -> Decision:
        n = len(loads)
        if n != len(self.servers):
            raise ValueError(f"{n} loads for {len(self.servers)} servers")
        prm = self.params
        cand = self._capped(_candidate_list(n, allowed), loads)
        if prm.sim_band is not None and self.ownership is not None and request.signature is not None:
            return self._band_first(request, loads, cand)
        vector = n >= self.VECTOR_MIN and self._inline_score  # _vectorised, without the call
        costs = self._cost_array(request, loads) if vector else self._costs(request, loads)
        if not math.isfinite(costs.sum() if vector else sum(costs)):  # never from this state, nor an exception
            return self._fallback("degenerate_cost", loads, cand)
        whole = len(cand) == n  # every server is a candidate
        if vector:
            cheapest = int(costs.argmin()) if whole else cand[int(costs[cand].argmin())]
        else:
            cheapest = min(cand, key=costs.__getitem__)
        if self.ownership is None or request.signature is None:
            return Decision(cheapest, self.name, "cost" if request.activation is not None else "no_activation",
                            band=(cheapest,), server_similarities=-np.asarray(costs))
        sig = np.asarray(request.signature, dtype=np.float32).reshape(-1)
        if sig.shape[0] != self.centroids.shape[1]:
            raise ValueError(f"signature has {sig.shape[0]} dims, centroids have {self.centroids.shape[1]}")
        # the cost-band rule (sim_band None; the locality pick returned above)
        best = costs[cheapest]
        width = queue_band(prm.cost_band, prm.cost_band_full, loads, cand, self.cost.max_batch)
        limit = best + abs(best) * width  # holds the cheapest whatever its sign
        if vector:
            inside = np.flatnonzero((costs if whole else costs[cand]) <= limit).tolist()
            band = inside if whole else [cand[j] for j in inside]
        else:
            band = [i for i in cand if costs[i] <= limit]
        if len(band) <= self.BAND_SCAN_MAX:  # the band's similarities only; the rest when read
            own = self.ownership
            sims = {i: own.similarity_of(i, sig) for i in band}
            idx = max(band, key=lambda i: (sims[i], -costs[i]))
            return LazyDecision(idx, self.name, "cost_band", tuple(band), sims[idx],
                                own.similarities_later(sig))
        csims = self.centroids @ sig  # the cost band holds more servers than are worth scanning
        server_sims = self.ownership.gather(csims)
        idx = _most_similar(band, server_sims, costs)
        return Decision(idx, self.name, "cost_band", tuple(band), float(server_sims[idx]), server_sims, csims)

    def _band_first(self, request, loads, cand: list[int]) -> Decision:
        """The locality pick pricing only the band (bounded load and the similarity band
        need no cost): the same pick as pricing every server, one short matvec."""
        sig = np.asarray(request.signature, dtype=np.float32).reshape(-1)
        if sig.shape[0] != self.centroids.shape[1]:
            raise ValueError(f"signature has {sig.shape[0]} dims, centroids have {self.centroids.shape[1]}")
        csims = self.centroids @ sig
        server_sims = self.ownership.gather(csims)
        sims = server_sims.tolist()
        prm = self.params
        width = band_width(prm.sim_band, prm.sim_band_full, loads, cand, self.cost.max_batch)
        band = region_band(cand, sims, width)
        costs = self._costs(request, loads, band)
        if not math.isfinite(sum(costs[i] for i in band)):  # never from this state
            return self._fallback("degenerate_cost", loads, cand)
        # min over (cost, -similarity, index) without a key tuple per server
        idx = band[0]
        bc, bs = costs[idx], sims[idx]
        for i in band:
            c = costs[i]
            if c < bc or (c == bc and sims[i] > bs):
                idx, bc, bs = i, c, sims[i]
        return Decision(idx, self.name, "region_band", tuple(band), sims[idx], server_sims, csims)

    def describe(self) -> dict:
        out = super().describe()
        out.update(policy=self.name, **{k: getattr(self.params, k) for k in _RULE},
                   ownership=None if self.ownership is None else self.ownership.as_lists())
        return out


def _most_similar(band: list[int], sims: np.ndarray, costs) -> int:
    """``max(band, key=(similarity, -cost))``: the most similar server of the band, the
    cheaper of equally similar ones, then the first. Python for a band of up to 16 servers
    (measured: half the time of numpy at 6) or where a similarity is not a number (as
    Python's comparisons order those); numpy over a larger band (0.7x Python's time at 24)."""
    if len(band) > 16:
        at = np.asarray(band, dtype=np.intp)
        s = sims[at]
        top = s.max()
        if top == top:
            tied = at[s == top]
            if tied.size == 1:
                return int(tied[0])
            return int(tied[int(np.asarray(costs, dtype=np.float64)[tied].argmin())])
    sl = sims.tolist()
    return max(band, key=lambda i: (sl[i], -costs[i]))


def _candidate_list(n: int, allowed) -> list[int]:
    """:func:`~.base._candidates` as a list, without numpy for the router's mask (a list of
    bools): the allowed indices, all of them if none is."""
    if allowed is None:
        return list(range(n))
    if type(allowed) is list and len(allowed) == n and allowed.count(True) == n:  # all allowed
        return list(range(n))
    return _candidates(n, allowed).tolist()


register_policy(PolicySpec(
    "eldr_balanced",
    lambda ctx, prm: EldrBalancedPolicy(ctx.num_servers, prm, centroids=ctx.centroids),
    aliases=("balanced",), params=BalancedParams, uses_artifact=True, rebuild_on_reload=True, family="cost",
    summary="bounded load, then within 5% of the least decode-time cost the most similar "
            "calibration region (default)"))
