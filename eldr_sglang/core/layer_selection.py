"""Greedy layer selection on sampled request pairs (never N x N).

Score of a layer set S: Spearman rank correlation, over P sampled pairs (i, j),
between the cosine similarity of the signatures of i and j restricted to S and the
weighted Jaccard overlap of their decode counts (all layers),
``sum(min(d_i, d_j)) / sum(max(d_i, d_j))``.

The signature of S is the concatenation of per-layer weighted vectors x_l, L2
normalised as a whole, so

    cos_S(i, j) = sum_{l in S} <x_il, x_jl> / sqrt(sum_{l in S} |x_il|^2 * sum_{l in S} |x_jl|^2).

Per-layer pair dot products [L, P] and squared norms [L, N] are computed once
(O(L * P * E)); afterwards a candidate layer costs O(P) to score plus one ranking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from scipy.stats import rankdata

from .signature import weigh


@dataclass
class LayerSelection:
    """Result: chosen layers (in order added), their score, and the whole curve."""

    layers: list[int]
    rho: float
    curve: list[tuple[list[int], float]] = field(default_factory=list)
    stopped_because: str = ""


def sample_pairs(n: int, n_pairs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n_pairs`` random pairs (i, j) with i != j (repeats possible, harmless)."""
    if n < 2:
        raise ValueError("need at least 2 requests to sample pairs")
    i = rng.integers(0, n, size=n_pairs)
    j = (i + rng.integers(1, n, size=n_pairs)) % n
    return i, j


def pair_weighted_jaccard(
    counts: np.ndarray, i: np.ndarray, j: np.ndarray, profile: bool = False, chunk: int = 2048
) -> np.ndarray:
    """Weighted Jaccard ``sum(min) / sum(max)`` of counts[i] vs counts[j] (0 when both empty).

    ``profile=True`` first scales each request's counts to sum 1, so the overlap
    compares expert *distributions* and not output lengths.
    """
    out = np.empty(len(i), dtype=np.float64)
    flat = counts.reshape(counts.shape[0], -1)
    if profile:
        total = flat.sum(axis=1, dtype=np.float64)[:, None]
        flat = np.divide(flat, total, out=np.zeros(flat.shape, dtype=np.float32), where=total > 0)
    for s in range(0, len(i), chunk):
        a, b = flat[i[s:s + chunk]], flat[j[s:s + chunk]]
        num = np.minimum(a, b).sum(axis=1, dtype=np.float64)
        den = np.maximum(a, b).sum(axis=1, dtype=np.float64)
        out[s:s + chunk] = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
    return out


def pair_cosine(signatures: np.ndarray, i: np.ndarray, j: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """Cosine of L2-normalised signature rows i and j (a plain dot product)."""
    out = np.empty(len(i), dtype=np.float64)
    for s in range(0, len(i), chunk):
        out[s:s + chunk] = np.einsum("pd,pd->p", signatures[i[s:s + chunk]], signatures[j[s:s + chunk]])
    return out


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rho (average ranks for ties); 0 when either side is constant."""
    return float(_rank_scores(np.asarray(x)[None, :])[0] @ _rank_scores(np.asarray(y)[None, :])[0])


def _rank_scores(values: np.ndarray) -> np.ndarray:
    """Rows -> centred, unit-norm average ranks, so a dot product is Spearman's rho."""
    ranks = rankdata(values, axis=1)
    ranks -= ranks.mean(axis=1, keepdims=True)
    norm = np.linalg.norm(ranks, axis=1, keepdims=True)
    return np.divide(ranks, norm, out=np.zeros_like(ranks), where=norm > 0)


def per_layer_pair_stats(
    values: np.ndarray,
    i: np.ndarray,
    j: np.ndarray,
    variant: str = "raw",
    idf: np.ndarray | None = None,
    chunk: int = 4096,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-layer pair dots [L, P] and squared norms of both ends [L, P], [L, P].

    ``values`` is the variant's [N, L, E] input; each layer is weighed with the
    variant (``idf`` [L, E] for "idf") one at a time, so no [N, L, E] float copy.
    """
    num_layers = values.shape[1]
    dots = np.empty((num_layers, len(i)))
    sq_i, sq_j = np.empty_like(dots), np.empty_like(dots)
    for layer in range(num_layers):
        layer_idf = None if idf is None else idf[layer:layer + 1]
        x = weigh(values[:, layer:layer + 1, :], variant, layer_idf)[:, 0, :]
        sq = np.einsum("ne,ne->n", x, x, dtype=np.float64)
        sq_i[layer], sq_j[layer] = sq[i], sq[j]
        for s in range(0, len(i), chunk):
            dots[layer, s:s + chunk] = np.einsum("pe,pe->p", x[i[s:s + chunk]], x[j[s:s + chunk]], dtype=np.float64)
    return dots, sq_i, sq_j


def greedy_layer_selection(
    dots: np.ndarray,
    sq_i: np.ndarray,
    sq_j: np.ndarray,
    target: np.ndarray,
    max_layers: int | None = None,
    min_gain: float = 1e-3,
    on_step: Callable[[list[int], float], None] | None = None,
) -> LayerSelection:
    """Add, one at a time, the layer that most raises Spearman(cos_S, target).

    Stops when the best gain is below ``min_gain`` (the rejected step is not
    added), or at ``max_layers``. The score of the empty set is 0. ``curve`` lists
    (layers, rho) after every accepted step.
    """
    num_layers = dots.shape[0]
    max_layers = num_layers if max_layers is None else min(max_layers, num_layers)
    target_scores = _rank_scores(np.asarray(target, dtype=np.float64)[None, :])[0]
    acc_dot = np.zeros(dots.shape[1])
    acc_i, acc_j = np.zeros_like(acc_dot), np.zeros_like(acc_dot)
    chosen: list[int] = []
    rho = 0.0
    curve: list[tuple[list[int], float]] = []
    reason = "max_layers reached"
    while len(chosen) < max_layers:
        candidates = np.array([l for l in range(num_layers) if l not in chosen])
        cand_dot = acc_dot + dots[candidates]
        denom = np.sqrt((acc_i + sq_i[candidates]) * (acc_j + sq_j[candidates]))
        cos = np.divide(cand_dot, denom, out=np.zeros_like(cand_dot), where=denom > 0)
        scores = _rank_scores(cos) @ target_scores
        best = int(np.argmax(scores))
        if scores[best] - rho < min_gain:
            reason = f"gain {scores[best] - rho:.4g} < min_gain {min_gain:g} (best next layer {int(candidates[best])})"
            break
        layer = int(candidates[best])
        chosen.append(layer)
        rho = float(scores[best])
        acc_dot += dots[layer]
        acc_i += sq_i[layer]
        acc_j += sq_j[layer]
        curve.append((list(chosen), rho))
        if on_step is not None:
            on_step(list(chosen), rho)
    return LayerSelection(layers=chosen, rho=rho, curve=curve, stopped_because=reason)


def select_layers(
    values: np.ndarray,
    decode_counts: np.ndarray,
    variant: str = "idf",
    idf: np.ndarray | None = None,
    n_pairs: int = 20_000,
    max_layers: int | None = None,
    min_gain: float = 1e-3,
    random_state: int | None = 0,
    on_step: Callable[[list[int], float], None] | None = None,
    decode_profile: bool = False,
) -> LayerSelection:
    """End to end: sample pairs, decode-overlap target, per-layer stats, greedy.

    ``values`` is the variant's [N, L, E] input (prefill counts, or gate sums);
    ``idf`` [L, E] (from ``SignatureBuilder(variant="idf").fit``) for "idf".
    ``decode_profile``: compare decode count distributions (see ``pair_weighted_jaccard``).
    """
    rng = np.random.default_rng(random_state)
    i, j = sample_pairs(values.shape[0], n_pairs, rng)
    target = pair_weighted_jaccard(decode_counts, i, j, profile=decode_profile)
    dots, sq_i, sq_j = per_layer_pair_stats(values, i, j, variant, idf)
    return greedy_layer_selection(dots, sq_i, sq_j, target, max_layers, min_gain, on_step)


def spread_layers(num_layers: int, count: int = 4) -> list[int]:
    """``count`` evenly spread layers, first and last excluded (all layers when there are
    at most ``count``): what an engine publishes before any calibration chose layers."""
    if num_layers <= count:
        return list(range(num_layers))
    return sorted({int(round(x)) for x in np.linspace(0, num_layers - 1, count + 2)[1:-1]})
