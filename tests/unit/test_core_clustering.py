"""Balanced assignment (exact, capacity-bounded) and balanced K-means."""

import itertools
import math

import numpy as np
import pytest

from eldr_sglang.core import BalancedKMeans, balanced_assignment, is_optimal_assignment


def brute_force_optimum(cost: np.ndarray, cap: int) -> float:
    """Best total cost over all assignments with every cluster <= cap, via slot permutations."""
    n, k = cost.shape
    slots = [c for c in range(k) for _ in range(cap)]
    return min(cost[np.arange(n), list(p)].sum() for p in set(itertools.permutations(slots, n)))


@pytest.mark.parametrize("method", ["auto", "lp"])
def test_assignment_matches_brute_force_and_respects_capacity(method):
    rng = np.random.default_rng(0)
    for trial in range(40):
        n, k = int(rng.integers(3, 8)), int(rng.integers(2, 4))
        cap = math.ceil(n / k)
        cost = rng.random((n, k))
        if trial % 3 == 0:
            cost = np.round(cost, 1)  # exact ties
        if trial % 4 == 0:
            cost[:, 0] -= 0.5  # everyone wants cluster 0
        labels = balanced_assignment(cost, cap, method=method)
        assert np.bincount(labels, minlength=k).max() <= cap
        assert cost[np.arange(n), labels].sum() == pytest.approx(brute_force_optimum(cost, cap), abs=1e-9)


def test_large_skewed_assignment_is_capacity_bounded_and_certified():
    rng = np.random.default_rng(1)
    n, k = 3000, 12
    cost = rng.random((n, k))
    cost[:, :3] -= 0.4  # three popular clusters would take most points unconstrained
    cap = math.ceil(n / k)
    assert np.bincount(cost.argmin(axis=1), minlength=k).max() > cap
    labels = balanced_assignment(cost, cap)
    assert np.bincount(labels, minlength=k).max() <= cap
    lp = balanced_assignment(cost, cap, method="lp")
    assert cost[np.arange(n), labels].sum() == pytest.approx(cost[np.arange(n), lp].sum(), abs=1e-7)


def test_certificate_rejects_suboptimal_and_overfull():
    cost = np.array([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    assert is_optimal_assignment(cost, np.array([0, 0, 1]), np.zeros(2), 2)
    assert not is_optimal_assignment(cost, np.array([0, 1, 0]), np.zeros(2), 2)  # not at argmin
    assert not is_optimal_assignment(cost, np.array([0, 0, 0]), np.zeros(2), 2)  # over capacity
    with pytest.raises(ValueError, match="cannot hold"):
        balanced_assignment(cost, 1)


def test_balanced_kmeans_on_skewed_blobs():
    rng = np.random.default_rng(2)
    dim, k = 32, 4
    means = rng.normal(size=(2, dim))
    sizes = [700, 100]  # heavily skewed: plain K-means would give one cluster most points
    X = np.vstack([m + 0.3 * rng.normal(size=(s, dim)) for m, s in zip(means, sizes)])
    km = BalancedKMeans(n_clusters=k, n_init=2, random_state=0).fit(X)
    assert km.capacity_ == 200
    counts = np.bincount(km.labels_, minlength=k)
    assert counts.max() <= 200 and counts.sum() == 800
    np.testing.assert_allclose(np.linalg.norm(km.cluster_centers_, axis=1), 1.0, rtol=1e-5)
    assert km.transform(X).shape == (800, k)
    assert set(km.predict(X[:5])) <= set(range(k))
    # the small blob gets a cluster of its own
    small = km.labels_[700:]
    assert np.bincount(small).max() >= 95
    assert km.fit_predict(X).shape == (800,)


def test_balanced_kmeans_is_deterministic_with_seed():
    X = np.random.default_rng(3).normal(size=(300, 16))
    a = BalancedKMeans(5, random_state=7).fit(X)
    b = BalancedKMeans(5, random_state=7).fit(X)
    np.testing.assert_array_equal(a.labels_, b.labels_)
    with pytest.raises(ValueError, match="n_clusters"):
        BalancedKMeans(500).fit(X)
