"""Balanced spherical K-means with an exact capacity-constrained assignment step.

Assignment problem (a transportation problem): given costs c[p, k] (cosine distance
of point p to centroid k) and capacities cap[k] with sum(cap) >= N, choose
x[p, k] in {0, 1} with sum_k x[p, k] = 1 and sum_p x[p, k] <= cap[k], minimising
sum c[p, k] x[p, k]. Its constraint matrix is totally unimodular, so the LP
relaxation has an integral optimum; LP duality gives a cheap optimality
certificate: prices lambda[k] >= 0 such that every point sits at a cluster that
minimises c[p, k] + lambda[k], no cluster exceeds its capacity, and every cluster
with lambda[k] > 0 is exactly full. Any (x, lambda) passing that check is optimal.

``balanced_assignment`` finds such prices in two exact-preserving phases:

1. price search (auction-like): each round every over-full cluster raises its
   price so exactly cap[k] members keep preferring it. This removes most of the
   excess in a few O(N K) rounds but can stall in "price wars".
2. successive shortest paths on the K-node cluster graph: each step moves one
   unit of excess along the cheapest chain of point moves to a cluster with room
   (Dijkstra over reduced costs) and raises prices by the distances, the standard
   min-cost-flow step, so every point stays at an argmin of cost + prices.

Both phases keep "every point at an argmin of cost + prices" and "a cluster with a
positive price holds >= cap[k] points", so when no excess is left the certificate
holds; it is checked explicitly. Were it ever to fail, the transportation LP is
solved with HiGHS dual simplex (``scipy.optimize.linprog``; a simplex vertex of a
totally unimodular system is integral). Nothing N x N is built: the graph has K
nodes, the LP N*K variables and N+K rows.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
from scipy import sparse
from scipy.optimize import linprog
from sklearn.base import BaseEstimator, ClusterMixin, TransformerMixin
from sklearn.cluster import kmeans_plusplus
from sklearn.utils.validation import check_is_fitted

from .signature import l2_normalize

_TOL = 1e-9


def _capacities(capacity: int | np.ndarray, n_points: int, n_clusters: int) -> np.ndarray:
    cap = np.broadcast_to(np.asarray(capacity, dtype=np.int64), (n_clusters,)).copy()
    if cap.min() < 0 or cap.sum() < n_points:
        raise ValueError(f"capacities {cap.tolist()} cannot hold {n_points} points")
    return cap


def is_optimal_assignment(cost: np.ndarray, labels: np.ndarray, prices: np.ndarray, capacity) -> bool:
    """LP-duality certificate for a capacity-constrained assignment (see module doc)."""
    n, k = cost.shape
    cap = _capacities(capacity, n, k)
    counts = np.bincount(labels, minlength=k)
    if (counts > cap).any() or (prices < 0).any():
        return False
    if ((prices > 0) & (counts != cap)).any():
        return False
    reduced = cost + prices
    chosen = reduced[np.arange(n), labels]
    return bool((chosen <= reduced.min(axis=1) + _TOL * (1.0 + np.abs(chosen))).all())


def _assign_by_prices(
    cost: np.ndarray, cap: np.ndarray, max_rounds: int, stop_excess: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Price search from zero prices; returns (labels, prices) with the invariants.

    Invariants: every point sits at an argmin of cost + prices, and a cluster with
    a positive price holds >= cap[k] points. Each round every over-full cluster
    raises its price to the midpoint between the margins of its cap[k]-th and
    (cap[k]+1)-th most attached members, so exactly cap[k] keep preferring it.
    Stops when total excess <= ``stop_excess``, on an exact tie at a boundary, or
    after ``max_rounds`` (price wars), leaving the rest to the shortest-path repair.
    """
    n, k = cost.shape
    prices = np.zeros(k)
    for _ in range(max_rounds):
        labels = (cost + prices).argmin(axis=1)
        counts = np.bincount(labels, minlength=k)
        if np.maximum(counts - cap, 0).sum() <= stop_excess:
            break
        reduced = cost + prices
        for c in np.flatnonzero(counts > cap):
            rows = reduced[labels == c]
            own = rows[:, c].copy()
            rows[:, c] = np.inf
            margins = np.sort(rows.min(axis=1) - own)[::-1]  # how strongly each member prefers c
            keep = int(cap[c])
            if keep == 0:
                prices[c] += margins[0] + 1.0
            elif margins[keep - 1] > margins[keep]:
                prices[c] += 0.5 * (margins[keep - 1] + margins[keep])
            # else: exact tie at the capacity boundary; leave it to the repair
    return (cost + prices).argmin(axis=1), prices


def _repair_by_shortest_paths(
    cost: np.ndarray, cap: np.ndarray, labels: np.ndarray, prices: np.ndarray, max_moves: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Successive shortest paths on the K-node cluster graph, one unit of excess each.

    Edge u -> v costs the cheapest reduced cost of moving a member of u to v,
    ``prices[v] - prices[u] + min_{p in u} (cost[p, v] - cost[p, u])`` (>= 0 by the
    argmin invariant; the min term depends only on membership and is updated for
    the clusters a move touches). A Dijkstra from all over-full clusters finds the
    cheapest chain of moves to a cluster with room (distance D); moving those
    points and raising prices by max(0, D - dist) keeps both invariants, so when no
    excess is left the optimality certificate holds. None past ``max_moves``.
    """
    n, k = cost.shape
    labels, prices = labels.copy(), prices.copy()
    counts = np.bincount(labels, minlength=k)
    best_gap = np.full((k, k), np.inf)  # min over members of u of cost[p, v] - cost[p, u]
    mover = np.zeros((k, k), dtype=np.int64)

    def refresh(u: int) -> None:
        members = np.flatnonzero(labels == u)
        best_gap[u] = np.inf
        if members.size:
            gaps = cost[members] - cost[members, u][:, None]
            pick = gaps.argmin(axis=0)
            best_gap[u] = gaps[pick, np.arange(k)]
            mover[u] = members[pick]
        best_gap[u, u] = np.inf

    for u in range(k):
        refresh(u)
    for _ in range(max_moves):
        if (counts <= cap).all():
            return labels, prices
        weight = np.maximum(best_gap + prices[None, :] - prices[:, None], 0.0)
        dist = np.where(counts > cap, 0.0, np.inf)
        prev = np.full(k, -1)
        done = np.zeros(k, dtype=bool)
        while True:
            u = int(np.argmin(np.where(done, np.inf, dist)))
            if done[u] or not np.isfinite(dist[u]):
                return None  # no cluster with room is reachable (cannot happen when sum(cap) >= N)
            done[u] = True
            if counts[u] < cap[u]:
                target = u
                break
            relaxed = dist[u] + weight[u]
            better = (relaxed < dist) & ~done
            dist[better], prev[better] = relaxed[better], u
        reach = dist[target]
        prices += np.maximum(0.0, reach - np.where(done, dist, reach))
        v, touched = target, {target}
        while prev[v] >= 0:
            u = int(prev[v])
            labels[mover[u, v]] = v
            touched.add(u)
            v = u
        counts[v] -= 1
        counts[target] += 1
        for u in touched:
            refresh(u)
    return None


def _assign_by_lp(cost: np.ndarray, cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact transportation LP (HiGHS dual simplex): labels and cluster prices."""
    n, k = cost.shape
    cols = np.arange(n * k)
    a_eq = sparse.csr_matrix((np.ones(n * k), (cols // k, cols)), shape=(n, n * k))
    a_ub = sparse.csr_matrix((np.ones(n * k), (cols % k, cols)), shape=(k, n * k))
    res = linprog(cost.ravel(), A_ub=a_ub, b_ub=cap, A_eq=a_eq, b_eq=np.ones(n), bounds=(0, None),
                  method="highs-ds")
    if res.status != 0:
        raise RuntimeError(f"balanced assignment LP failed: {res.message}")
    x = res.x.reshape(n, k)
    labels = x.argmax(axis=1)
    if not np.allclose(x[np.arange(n), labels], 1.0, atol=1e-6):
        raise RuntimeError("balanced assignment LP returned a fractional solution")
    return labels, np.maximum(-np.asarray(res.ineqlin.marginals), 0.0)


def balanced_assignment(
    cost: np.ndarray, capacity: int | np.ndarray, method: str = "auto", max_rounds: int = 50
) -> np.ndarray:
    """Exact min-cost assignment of N points to K clusters with at most capacity[k] each.

    ``method``: "auto" (price search + shortest-path repair, certified; the LP
    only if the certificate ever failed) or "lp" (HiGHS transportation LP).
    Returns labels [N].
    """
    return _balanced_assignment(cost, capacity, method, max_rounds)[0]


def _balanced_assignment(
    cost: np.ndarray, capacity, method: str = "auto", max_rounds: int = 50
) -> tuple[np.ndarray, np.ndarray]:
    cost = np.asarray(cost, dtype=np.float64)
    n, k = cost.shape
    cap = _capacities(capacity, n, k)
    if method == "auto":
        labels, prices = _assign_by_prices(cost, cap, max_rounds, stop_excess=max(1, n // 200))
        repaired = _repair_by_shortest_paths(cost, cap, labels, prices, max_moves=n)
        if repaired is not None and is_optimal_assignment(cost, *repaired, cap):
            return repaired
    elif method != "lp":
        raise ValueError(f"unknown method {method!r}")
    labels, prices = _assign_by_lp(cost, cap)  # optimal by the solver (duals may be degenerate)
    if (np.bincount(labels, minlength=k) > cap).any():
        raise RuntimeError("balanced assignment LP exceeded a capacity")
    return labels, prices


def _single_blas_thread():
    """BLAS limited to one thread during fit, as sklearn's KMeans does: the GEMMs are
    thin ([N, D] x [D, K]) and multi-threaded BLAS spins badly on a busy machine.
    threadpoolctl ships with scikit-learn; without it this is a no-op."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


class BalancedKMeans(ClusterMixin, TransformerMixin, BaseEstimator):
    """Spherical K-means where every cluster holds at most ceil(N / K) points.

    Rows are L2-normalised; the distance is cosine distance ``1 - <x, c>``;
    centroids are unit vectors (normalised member means). Seeds come from
    ``sklearn.cluster.kmeans_plusplus`` on a random ``seed_sample`` of the points
    (Euclidean k-means++ on unit vectors = cosine geometry); each assignment step
    is solved exactly by
    ``balanced_assignment``. ``labels_`` is the balanced assignment of the
    training points; ``predict`` (new points) is the nearest centroid, unconstrained.
    ``init``: "k-means++" or a [K, D] array of starting centroids (a warm start from
    an earlier fit; then one run, whatever ``n_init``). ``slack`` lets a cluster
    hold up to ``ceil(N / K * (1 + slack))`` points (0: strictly balanced).
    """

    def __init__(
        self,
        n_clusters: int = 8,
        n_init: int = 3,
        max_iter: int = 50,
        tol: float = 1e-4,
        random_state: int | None = None,
        assignment: str = "auto",
        seed_sample: int = 1024,
        init: str | np.ndarray = "k-means++",
        slack: float = 0.0,
    ):
        self.n_clusters = n_clusters
        self.n_init = n_init
        self.max_iter = max_iter
        self.tol = tol
        self.random_state = random_state
        self.assignment = assignment
        self.seed_sample = seed_sample
        self.init = init
        self.slack = slack

    def fit(self, X: np.ndarray, y=None) -> "BalancedKMeans":
        with _single_blas_thread():
            return self._fit(X)

    def _fit(self, X: np.ndarray) -> "BalancedKMeans":
        X = l2_normalize(np.asarray(X))
        n, k = X.shape[0], self.n_clusters
        if not 1 <= k <= n:
            raise ValueError(f"n_clusters={k} must be in [1, {n}] (number of points)")
        self.capacity_ = math.ceil(n / k * (1.0 + self.slack))
        rng = np.random.default_rng(self.random_state)
        start = None
        if not isinstance(self.init, str):
            start = l2_normalize(np.asarray(self.init, dtype=np.float32))
            if start.shape != (k, X.shape[1]):
                raise ValueError(f"init has shape {start.shape}, expected ({k}, {X.shape[1]})")
        elif self.init != "k-means++":
            raise ValueError(f"init must be 'k-means++' or a [K, D] array, got {self.init!r}")
        best = None
        for _ in range(1 if start is not None else max(1, self.n_init)):
            run = self._single_run(X, int(rng.integers(2**31 - 1)), start)
            if best is None or run[2] < best[2]:
                best = run
        self.cluster_centers_, self.labels_, self.inertia_, self.n_iter_ = best
        return self

    def _single_run(self, X: np.ndarray, seed: int,
                    start: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float, int]:
        n, k = X.shape[0], self.n_clusters
        if start is not None:
            centers = start
        else:  # seed on a float64 sample: kmeans_plusplus upcasts float32 chunk by chunk (slow)
            rng = np.random.default_rng(seed)
            size = max(self.seed_sample, k)
            sample = X if n <= size else X[rng.choice(n, size, replace=False)]
            centers, _ = kmeans_plusplus(sample.astype(np.float64), k, random_state=seed)
            centers = l2_normalize(centers)
        labels = np.full(n, -1)
        inertia = np.inf
        n_iter = 0
        for n_iter in range(1, self.max_iter + 1):
            cost = 1.0 - (X @ centers.T).astype(np.float64)
            new_labels, _ = _balanced_assignment(cost, self.capacity_, self.assignment)
            new_inertia = float(cost[np.arange(n), new_labels].sum())
            converged = np.array_equal(new_labels, labels) or inertia - new_inertia <= self.tol * n
            labels, inertia = new_labels, new_inertia
            centers = self._centers(X, labels, cost)
            if converged:
                break
        return centers, labels, inertia, n_iter

    def _centers(self, X: np.ndarray, labels: np.ndarray, cost: np.ndarray) -> np.ndarray:
        k = self.n_clusters
        onehot = sparse.csr_matrix((np.ones(len(labels), dtype=np.float32), (labels, np.arange(len(labels)))), shape=(k, len(labels)))
        centers = np.asarray(onehot @ X, dtype=np.float32)
        empty = np.flatnonzero(np.bincount(labels, minlength=k) == 0)
        if empty.size:  # reseed empty clusters at the worst-served points
            worst = np.argsort(cost[np.arange(len(labels)), labels])[::-1][: empty.size]
            centers[empty] = X[worst]
        return l2_normalize(centers)

    def predict(self, X: np.ndarray) -> np.ndarray:
        check_is_fitted(self, "cluster_centers_")
        return (l2_normalize(np.asarray(X)) @ self.cluster_centers_.T).argmax(axis=1)

    def transform(self, X: np.ndarray) -> np.ndarray:
        """Cosine distance of each row to each centroid, [N, K]."""
        check_is_fitted(self, "cluster_centers_")
        return 1.0 - l2_normalize(np.asarray(X)) @ self.cluster_centers_.T

    def fit_predict(self, X: np.ndarray, y=None) -> np.ndarray:
        return self.fit(X).labels_
