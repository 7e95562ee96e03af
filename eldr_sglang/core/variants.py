"""Which signature variant predicts decode overlap best, scored on held-out requests.

The requests are split (seeded) into a fitting part and a held-out part. Each
variant's weights (the IDF for "idf"; the other variants have none) are fitted on
the fitting part only; every variant is then scored on the SAME pairs sampled
among held-out requests: Spearman rho between the cosine of the two signatures
(restricted to the given layers) and the weighted Jaccard overlap of their decode
counts, as in :mod:`.layer_selection`. Gate variants are scored when the traces
carry gate sums (else ``None``) but can never be deployed: the router receives
prefill counts only, so :func:`best_count_variant` only picks among
``COUNT_VARIANTS``.

``holdout=0`` fits and scores on all requests (the in-sample table of
``python -m eldr_sglang.analyze``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from .layer_selection import _rank_scores, pair_weighted_jaccard, per_layer_pair_stats, sample_pairs
from .signature import COUNT_VARIANTS, GATE_VARIANTS, VARIANTS, SignatureBuilder, variant_input
from .traces import TraceSet

OVERLAPS = ("counts", "profile")


def holdout_size(n: int, holdout: float) -> int:
    """Held-out requests out of ``n``: ``round(holdout * n)``, at least 2 (all when ``holdout`` is 0)."""
    return n if holdout == 0.0 else max(2, int(round(holdout * n)))


def holdout_split(n: int, holdout: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (fit, held-out) request indices, :func:`holdout_size` of them held out.

    ``holdout=0`` returns all requests for both and draws nothing from ``rng``.
    """
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    everything = np.arange(n)
    if holdout == 0.0:
        return everything, everything
    n_held = holdout_size(n, holdout)
    if n - n_held < 1:
        raise ValueError(f"{n} requests are too few to hold out {n_held} and fit on the rest")
    held = np.sort(rng.choice(n, size=n_held, replace=False))
    return np.setdiff1d(everything, held), held


def holdout_pairs(n: int, n_pairs: int, holdout: float, seed: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fit indices, pair ends i, pair ends j): a seeded :func:`holdout_split`, then
    ``n_pairs`` pairs sampled among the held-out requests (indices into all ``n``)."""
    rng = np.random.default_rng(seed)
    fit, held = holdout_split(n, holdout, rng)
    i, j = sample_pairs(len(held), n_pairs, rng)
    return fit, held[i], held[j]


def layer_set_cosine(values: np.ndarray, i: np.ndarray, j: np.ndarray, variant: str,
                     idf: np.ndarray | None) -> np.ndarray:
    """Cosine of pairs (i, j) of the variant's signatures over all layers of ``values`` [N, L, E]."""
    dots, sq_i, sq_j = per_layer_pair_stats(values, i, j, variant, idf)
    denom = np.sqrt(sq_i.sum(axis=0) * sq_j.sum(axis=0))
    return np.divide(dots.sum(axis=0), denom, out=np.zeros(len(i)), where=denom > 0)


def variant_rho_table(
    traces: TraceSet,
    layers: Sequence[int] | None,
    n_pairs: int,
    seed: int | None,
    holdout: float = 0.25,
    overlaps: Sequence[str] = OVERLAPS,
) -> dict[str, dict[str, float] | None]:
    """{variant: {overlap: rho}} for the six variants (None: gate sums not traced).

    ``overlaps``: "counts" (weighted Jaccard of raw decode counts) and/or
    "profile" (of counts scaled to sum 1). ``layers=None``: all layers.
    """
    bad = [o for o in overlaps if o not in OVERLAPS]
    if bad or not overlaps:
        raise ValueError(f"overlaps must be a non-empty subset of {OVERLAPS}, got {list(overlaps)}")
    fit, i, j = holdout_pairs(len(traces), n_pairs, holdout, seed)
    targets = {o: _rank_scores(pair_weighted_jaccard(traces.decode_counts, i, j, profile=o == "profile")[None])[0]
               for o in overlaps}
    keep = slice(None) if layers is None else list(layers)
    table: dict[str, dict[str, float] | None] = {}
    for variant in VARIANTS:
        try:
            values = variant_input(traces, variant)
        except ValueError:
            table[variant] = None
            continue
        idf = SignatureBuilder(variant).fit(values[fit]).idf_[keep] if variant == "idf" else None
        scores = _rank_scores(layer_set_cosine(values[:, keep], i, j, variant, idf)[None])[0]
        table[variant] = {o: float(scores @ t) for o, t in targets.items()}
    return table


def score_variants(
    traces: TraceSet,
    layers: Sequence[int] | None,
    n_pairs: int,
    seed: int | None,
    holdout: float = 0.25,
    overlap: str = "profile",
) -> dict[str, float | None]:
    """{variant: held-out rho} on one decode overlap (see :func:`variant_rho_table`)."""
    table = variant_rho_table(traces, layers, n_pairs, seed, holdout, (overlap,))
    return {v: None if row is None else row[overlap] for v, row in table.items()}


def best_count_variant(scores: Mapping[str, float | None]) -> str:
    """The count variant with the highest score (ties: earlier in ``COUNT_VARIANTS``)."""
    scored = [v for v in COUNT_VARIANTS if scores.get(v) is not None]
    if not scored:
        raise ValueError("no count variant was scored")
    return max(scored, key=lambda v: scores[v])


def best_gate_over(scores: Mapping[str, float | None], variant: str) -> str | None:
    """The best gate variant scoring above ``variant``, if any."""
    gates = [g for g in GATE_VARIANTS if scores.get(g) is not None and scores[g] > scores[variant]]
    return max(gates, key=lambda g: scores[g]) if gates else None
