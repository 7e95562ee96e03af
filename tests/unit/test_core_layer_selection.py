"""Greedy layer selection recovers planted informative layers and stops."""

import numpy as np
import pytest

from eldr_sglang.core import SignatureBuilder, make_synthetic_traces, select_layers, spearman
from eldr_sglang.core.layer_selection import greedy_layer_selection, pair_weighted_jaccard


def test_weighted_jaccard_by_hand():
    counts = np.array([[[3, 0, 1]], [[1, 2, 1]], [[0, 0, 0]], [[0, 0, 0]]])
    out = pair_weighted_jaccard(counts, np.array([0, 2]), np.array([1, 3]))
    np.testing.assert_allclose(out, [(1 + 0 + 1) / (3 + 2 + 1), 0.0])


def test_spearman_matches_scipy():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(1)
    x, y = rng.random(200), rng.random(200)
    y[:50] = x[:50]
    x[::7] = 0.5  # ties
    assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_planted_layers_and_stops(seed):
    syn = make_synthetic_traces(1500, num_layers=12, num_experts=32, top_k=4, n_informative=3, seed=seed)
    tr = syn.traces
    idf = SignatureBuilder("idf").fit(tr).idf_
    result = select_layers(tr.prefill_counts, tr.decode_counts, "idf", idf, n_pairs=10_000, random_state=seed)
    assert sorted(result.layers) == syn.informative_layers
    assert "min_gain" in result.stopped_because
    rhos = [rho for _, rho in result.curve]
    assert rhos == sorted(rhos) and rhos[-1] == pytest.approx(result.rho)
    assert [len(layers) for layers, _ in result.curve] == [1, 2, 3]


def test_greedy_picks_best_layer_first_and_respects_max_layers():
    # layer 1 is the target itself; layer 0 is noise
    rng = np.random.default_rng(0)
    target = rng.random(500)
    dots = np.vstack([rng.random(500), target])
    ones = np.ones_like(dots)
    result = greedy_layer_selection(dots, ones, ones, target, max_layers=1)
    assert result.layers == [1] and result.rho == pytest.approx(1.0)
    assert result.stopped_because == "max_layers reached"
