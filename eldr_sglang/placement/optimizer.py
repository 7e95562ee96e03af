"""Expert-to-EP-rank placement for one MoE layer: replicas, packing, local search, bound.

Physical slot ``p`` lives on EP rank ``p // slots_per_rank`` (SGLang's layout), with
``num_physical = num_experts + num_redundant`` slots and the same number per rank.
Tokens of a replicated expert are split evenly over its replicas (SGLang's
``dynamic`` dispatch, the default with ``--init-expert-location`` and no a2a
backend), so a slot of expert ``e`` with ``r_e`` replicas carries ``w_e / r_e``.

Objective, lexicographic: (1) the largest per-rank load; (2) the largest expected
number of distinct experts a rank reads per decode step. Method: replicas by
greedy min-max (optimal for the per-replica maximum), longest-processing-time
packing under "equal slots, no expert twice on a rank", then best-improvement
swaps. The lower bound ``max(total / G, max_e w_e / r_e)`` holds for every
placement (``r_e`` being the optimal min-max replica counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_REL_TOL = 1e-9


@dataclass(frozen=True)
class LayerPlacement:
    """One layer's physical-to-logical map and its figures."""

    physical_to_logical: np.ndarray  # [num_physical] logical expert id per slot
    rank_load: np.ndarray  # [G] share of the layer's expert hits per rank
    rank_distinct: np.ndarray  # [G] expected distinct experts read per step (0 if no step model)
    lower_bound: float  # no placement has a max rank load below this

    @property
    def max_load(self) -> float:
        return float(self.rank_load.max())

    @property
    def gap(self) -> float:
        """Relative distance of the max rank load to the lower bound."""
        return self.max_load / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0


def slots_per_rank(num_experts: int, ep_size: int, num_redundant: int = 0) -> int:
    """Physical slots per EP rank; ValueError when they cannot be equal."""
    physical = num_experts + num_redundant
    if ep_size < 1 or num_redundant < 0 or physical % ep_size:
        raise ValueError(f"num_experts + num_redundant = {physical} is not divisible by ep_size {ep_size}")
    return physical // ep_size


def default_map(num_experts: int, ep_size: int, num_redundant: int = 0) -> np.ndarray:
    """SGLang's trivial layout: physical slot p holds logical expert p % num_experts."""
    slots_per_rank(num_experts, ep_size, num_redundant)
    return np.arange(num_experts + num_redundant) % num_experts


def replica_counts(load: np.ndarray, num_redundant: int, ep_size: int) -> np.ndarray:
    """Replicas per expert minimising max_e load_e / r_e (greedy; at most one per rank)."""
    counts = np.ones(len(load), dtype=np.int64)
    for _ in range(num_redundant):
        per_replica = np.where(counts < ep_size, load / counts, -np.inf)
        counts[int(np.argmax(per_replica))] += 1
    return counts


def lower_bound(load: np.ndarray, ep_size: int, num_redundant: int = 0) -> float:
    """max(total / G, min over replica choices of max_e load_e / r_e)."""
    load = np.asarray(load, dtype=np.float64)
    counts = replica_counts(load, num_redundant, ep_size)
    return float(max(load.sum() / ep_size, (load / counts).max(initial=0.0)))


def step_activation(token_prob: np.ndarray, replicas: np.ndarray, batch_size: int) -> np.ndarray:
    """P(a replica is read in a decode step of ``batch_size`` tokens) = 1 - (1 - p / r)^B."""
    p = np.clip(np.asarray(token_prob, dtype=np.float64) / replicas, 0.0, 1.0)
    return 1.0 - (1.0 - p) ** batch_size


def evaluate(physical_to_logical: np.ndarray, load: np.ndarray, ep_size: int,
             token_prob: np.ndarray | None = None, batch_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank load [G] and expected distinct experts per step [G] of a map."""
    p2l = np.asarray(physical_to_logical, dtype=np.int64)
    replicas = np.bincount(p2l, minlength=len(load))
    if (replicas[: len(load)] == 0).any():
        raise ValueError("every logical expert needs at least one physical slot")
    rank = np.arange(len(p2l)) // (len(p2l) // ep_size)
    slot_load = np.asarray(load, dtype=np.float64)[p2l] / replicas[p2l]
    rank_load = np.bincount(rank, weights=slot_load, minlength=ep_size)
    if token_prob is None:
        return rank_load, np.zeros(ep_size)
    act = step_activation(np.asarray(token_prob)[p2l], replicas[p2l], batch_size)
    return rank_load, np.bincount(rank, weights=act, minlength=ep_size)


def optimize_layer(load: np.ndarray, ep_size: int, num_redundant: int = 0,
                   token_prob: np.ndarray | None = None, batch_size: int = 32,
                   max_swaps: int = 500) -> LayerPlacement:
    """Place one layer's experts: ``load`` [E] expected hits, ``token_prob`` [E] per-token P(e)."""
    load = np.asarray(load, dtype=np.float64)
    num_experts = len(load)
    slots = slots_per_rank(num_experts, ep_size, num_redundant)
    counts = replica_counts(load, num_redundant, ep_size)
    expert = np.repeat(np.arange(num_experts), counts)  # one item per physical slot
    weight = load[expert] / counts[expert]
    act = (step_activation(np.asarray(token_prob)[expert], counts[expert], batch_size)
           if token_prob is not None else np.zeros(len(expert)))
    bins = _pack(expert, weight, act, ep_size, slots)
    bins = _improve(bins, expert, weight, act, max_swaps)
    p2l = expert[bins.ravel()]
    rank_load, rank_distinct = evaluate(p2l, load, ep_size, token_prob, batch_size)
    return LayerPlacement(p2l, rank_load, rank_distinct, lower_bound(load, ep_size, num_redundant))


def _pack(expert: np.ndarray, weight: np.ndarray, act: np.ndarray, ep_size: int, slots: int) -> np.ndarray:
    """Longest processing time first into the least-loaded rank with room and without that expert."""
    bins = np.full((ep_size, slots), -1, dtype=np.int64)
    fill = np.zeros(ep_size, dtype=np.int64)
    bin_load = np.zeros(ep_size)
    bin_act = np.zeros(ep_size)
    holds: list[set[int]] = [set() for _ in range(ep_size)]
    for item in np.lexsort((-act, -weight)):
        open_bins = [g for g in range(ep_size) if fill[g] < slots and expert[item] not in holds[g]]
        g = min(open_bins, key=lambda b: (bin_load[b], bin_act[b], b))
        bins[g, fill[g]] = item
        fill[g] += 1
        bin_load[g] += weight[item]
        bin_act[g] += act[item]
        holds[g].add(int(expert[item]))
    return bins


def _improve(bins: np.ndarray, expert: np.ndarray, weight: np.ndarray, act: np.ndarray,
             max_swaps: int) -> np.ndarray:
    """Best-improvement pairwise swaps from the worst rank until (max load, max distinct) stops falling."""
    bins = bins.copy()
    ep_size = bins.shape[0]
    if ep_size < 2:
        return bins
    tol = _REL_TOL * max(weight.sum(), 1e-12)
    for _ in range(max_swaps):
        loads, acts = weight[bins].sum(1), act[bins].sum(1)
        current = (loads.max(), acts.max())
        best = None
        for a in {int(loads.argmax()), int(acts.argmax())}:
            for b in range(ep_size):
                if b == a:
                    continue
                others = np.delete(np.arange(ep_size), [a, b])
                rest_load = loads[others].max(initial=-np.inf)
                rest_act = acts[others].max(initial=-np.inf)
                ia, ib = bins[a][:, None], bins[b][None, :]
                d_load = weight[ib] - weight[ia]  # [S, S]: a gains item j, loses item i
                d_act = act[ib] - act[ia]
                new_load = np.maximum(np.maximum(loads[a] + d_load, loads[b] - d_load), rest_load)
                new_act = np.maximum(np.maximum(acts[a] + d_act, acts[b] - d_act), rest_act)
                ok = ~np.isin(expert[ib], expert[bins[a]]) & ~np.isin(expert[ia], expert[bins[b]])
                better = ok & ((new_load < current[0] - tol)
                               | ((new_load <= current[0] + tol) & (new_act < current[1] - 1e-12)))
                if not better.any():
                    continue
                key_load = np.where(better, np.round(new_load / tol), np.inf)
                key_act = np.where(better, new_act, np.inf)
                i, j = np.unravel_index(np.lexsort((key_act.ravel(), key_load.ravel()))[0], key_load.shape)
                cand = (float(key_load[i, j]), float(key_act[i, j]), a, b, int(i), int(j))
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is None:
            break
        _, _, a, b, i, j = best
        bins[a, i], bins[b, j] = bins[b, j], bins[a, i]
    return bins
