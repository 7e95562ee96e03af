"""tools/routing_specialisation.py: leave-one-out nearest-centroid accuracy against brute force."""

import numpy as np

from tools import routing_specialisation


def brute_force_loo(x: np.ndarray, y: list[str]) -> float:
    hits = 0
    for i in range(len(x)):
        cents = {}
        for c in sorted(set(y)):
            rows = [j for j in range(len(x)) if y[j] == c and j != i]
            v = x[rows].mean(axis=0)
            cents[c] = v / np.linalg.norm(v)
        hits += max(cents, key=lambda c: float(cents[c] @ x[i])) == y[i]
    return hits / len(x)


def test_leave_one_out_matches_brute_force():
    tool = routing_specialisation
    rng = np.random.default_rng(0)
    for shift in (0.5, 2.0):
        y = [str(i % 3) for i in range(45)]
        x = rng.normal(size=(45, 6))
        x[:, 0] += shift * np.array([int(v) for v in y])
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        assert tool.loo_accuracy(x, y) == brute_force_loo(x, y)
