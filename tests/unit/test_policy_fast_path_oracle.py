"""The fast decision path of ``eldr_balanced`` / ``state_aware`` decides exactly as the plain
code: a seeded random sequence of explain / admit / release / engine reports / step laws /
server churn runs through the package's policy and through ``_Reference*`` below (the
logic without the fast paths: every changed server's free row refreshed at each decision,
every server priced, no lazy similarities), and every decision, every similarity and
cost, and the whole live-batch state (float64 log-domain sums, and the float32 free rows
and expected distinct experts of every server that neither side holds stale) must be
equal, bit for bit (NaN equal to NaN). The oracle keeps its own state; it shares only the
unchanged pieces (centroid ownership, the locality helpers, Decision)."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pytest

from eldr_sglang.core.policies import RouteRequest, StateAwarePolicy, StepCost
from eldr_sglang.core.policies import state_aware as sa_module
from eldr_sglang.core.policies.base import Decision, LazyDecision, _candidates, least_loaded
from eldr_sglang.core.policies.eldr import CentroidOwnership
from eldr_sglang.core.policies.eldr_balanced import (BALANCED_COST, DEFAULT_COST_BAND, DEFAULT_LOAD_CAP,
                                                     DEFAULT_LOAD_SLACK, DEFAULT_SIM_BAND, DEFAULT_SIM_BAND_FULL,
                                                     DEFAULT_COST_BAND_FULL,
                                                     EldrBalancedPolicy)
from eldr_sglang.core.policies.locality import band_width, bounded, queue_band, region_band

_P_MAX32 = np.float32(1.0 - 1e-6)
_LOG_FREE_MIN = -80.0
# NaN activations are part of the sequence (priced as 0 after numpy's warning)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
_RESET_EVERY = 3  # both sides (the package's is monkeypatched to it): recomputes happen in the run


# ---------------------------------------------------------------- the oracle: the pre-change code
def _reference_unused_log(p: np.ndarray) -> np.ndarray:
    q = np.fmax(p, np.float32(0.0))  # NaN: 0
    np.fmin(q, _P_MAX32, out=q)
    np.negative(q, out=q)
    np.log1p(q, out=q)
    return q.astype(np.float64)


class _RefLive:
    __slots__ = ("server", "log_q")

    def __init__(self, server, log_q):
        self.server, self.log_q = server, log_q


class _RefServer:
    __slots__ = ("live", "tokens", "releases")

    def __init__(self):
        self.live, self.tokens, self.releases = 0, set(), 0


class _ReferenceStateAware:
    """state_aware.StateAwarePolicy before the per-request cost work (logic copied)."""

    name = "state_aware"

    def __init__(self, num_servers, cost=StepCost(), centroids=None):
        self.cost, self.dim = cost, None
        self.servers = [_RefServer() for _ in range(num_servers)]
        self.log_free = self.free = self.unique = self.offset = None
        self._stale: set[int] = set()
        self._reported: set[int] = set()
        self.laws: list[Optional[StepCost]] = [None] * num_servers
        self.fallbacks: dict[str, int] = {}
        self.centroids = None
        if centroids is not None:
            c = np.asarray(centroids, dtype=np.float32)
            self.centroids = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)

    def _ensure(self, dim):
        if self.log_free is None:
            n = len(self.servers)
            self.dim = dim
            self.log_free = np.zeros((n, dim))
            self.free = np.ones((n, dim), dtype=np.float32)
            self.unique = np.zeros(n)
            self.offset = np.zeros((n, dim))
        elif dim != self.dim:
            raise ValueError("dims")

    @staticmethod
    def _vector(p):
        v = np.asarray(p).reshape(-1)
        return v if v.dtype == np.float32 else v.astype(np.float32)

    def admit(self, index, request):
        if request.activation is None:
            return None
        p = self._vector(request.activation)
        self._ensure(p.size)
        s = self.servers[index]
        tok = _RefLive(s, _reference_unused_log(p))
        self.log_free[index] += tok.log_q
        s.tokens.add(tok)
        s.live += 1
        self._stale.add(index)
        return tok

    def release(self, token):
        if token is None:
            return
        s = token.server
        if token not in s.tokens:
            return
        s.tokens.discard(token)
        s.live -= 1
        try:
            i = self.servers.index(s)
        except ValueError:
            return
        s.releases += 1
        if not s.tokens and i not in self._reported:
            self.log_free[i] = 0.0
            self.free[i] = 1.0
            self.unique[i] = 0.0
            s.releases = 0
            self._stale.discard(i)
            return
        if not s.tokens:
            self.log_free[i] = 0.0
            s.releases = 0
        elif s.releases >= _RESET_EVERY:
            self.log_free[i] = self._recomputed(s)
            s.releases = 0
        else:
            self.log_free[i] -= token.log_q
        self._stale.add(i)

    @staticmethod
    def _recomputed(s):
        total = None
        for t in s.tokens:
            total = t.log_q.copy() if total is None else np.add(total, t.log_q, out=total)
        return total

    def _refresh(self):
        rows = list(self._stale)
        self._stale.clear()
        for i in rows:
            lf = self.log_free[i] + self.offset[i] if i in self._reported else self.log_free[i]
            f = lf.astype(np.float32)
            if i in self._reported:
                f = np.minimum(f, np.float32(0.0))
            f = np.exp(np.maximum(f, np.float32(_LOG_FREE_MIN)))
            self.free[i] = f
            self.unique[i] = self.dim - float(f.sum())

    def observe_engine(self, index, log_free):
        if log_free is None:
            if self.offset is not None:
                self.offset[index] = 0.0
            self._reported.discard(index)
        else:
            v = np.asarray(log_free, dtype=np.float64).reshape(-1)
            self._ensure(v.size)
            self.offset[index] = np.fmin(np.nan_to_num(v, nan=0.0), 0.0) - self.log_free[index]
            self._reported.add(index)
        self._stale.add(index)

    def set_step_law(self, index, law):
        self.laws[index] = law

    def expected_unique(self):
        if self.log_free is None:
            return np.zeros(len(self.servers))
        self._refresh()
        return self.unique.copy()

    def add_server(self):
        self.servers.append(_RefServer())
        self.laws.append(None)
        if self.log_free is not None:
            self.offset = np.vstack([self.offset, np.zeros((1, self.dim))])
            self.log_free = np.vstack([self.log_free, np.zeros((1, self.dim))])
            self.free = np.vstack([self.free, np.ones((1, self.dim), dtype=np.float32)])
            self.unique = np.append(self.unique, 0.0)

    def remove_server(self, index):
        self.servers.pop(index)
        self.laws.pop(index)
        self._reported = {i - (i > index) for i in self._reported if i != index}
        if self.log_free is not None:
            self.offset = np.delete(self.offset, index, axis=0)
            self.log_free = np.delete(self.log_free, index, axis=0)
            self.free = np.delete(self.free, index, axis=0)
            self.unique = np.delete(self.unique, index)
            self._stale = {i - (i > index) for i in self._stale if i != index}

    def _added_experts(self, p):
        du = np.dot(self.free, p).tolist()
        if not math.isfinite(sum(du)):
            p = np.nan_to_num(p, nan=0.0, posinf=1.0, neginf=0.0)
            du = np.dot(self.free, p).tolist()
        return du

    def _costs(self, request, loads, rows=None):
        n = len(loads)
        if rows is None or len(rows) >= n:
            rows = None
        if request.activation is None or self.log_free is None:
            du = [0.0] * n
            if self.log_free is None:
                u = [0.0] * n
            else:
                self._refresh()
                u = self.unique.tolist()
        else:
            p = self._vector(request.activation)
            self._ensure(p.size)
            self._refresh()
            u = self.unique.tolist()
            if rows is not None:
                du = [0.0] * n
                part = [float(np.dot(self.free[i], p)) for i in rows]
                if not math.isfinite(sum(part)):
                    q = np.nan_to_num(p, nan=0.0, posinf=1.0, neginf=0.0)
                    part = [float(np.dot(self.free[i], q)) for i in rows]
                for i, d in zip(rows, part):
                    du[i] = d
            else:
                du = self._added_experts(p)
        if rows is None:
            return [self._score(k, loads[k], u[k], du[k]) for k in range(n)]
        out = [math.inf] * n
        for k in rows:
            out[k] = self._score(k, loads[k], u[k], du[k])
        return out

    def _score(self, k, b, ui, dui):
        c = self.laws[k] or self.cost
        ps, pe = c.per_seq_s, c.per_expert_s
        t0 = c.base_s + ps * b + pe * ui
        score = t0 + (b + 1) * (ps + pe * dui)
        if b >= c.max_batch:
            score += (b - c.max_batch + 1) * (t0 + ps + pe * dui)
        return score

    def scores(self, request, loads):
        return np.asarray(self._costs(request, loads))

    def _fallback(self, reason, loads, cand, sims=None):
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        idx = least_loaded(loads, np.asarray(cand, dtype=np.intp))
        return Decision(idx, self.name, "fallback", fallback=reason, centroid_similarities=sims)

    def explain(self, request, loads, allowed=None):
        n = len(loads)
        if n != len(self.servers):
            raise ValueError("loads")
        cand = _candidates(n, allowed).tolist()
        costs = self._costs(request, loads)
        if not math.isfinite(sum(costs)):
            return self._fallback("degenerate_cost", loads, cand)
        sims = None
        if self.centroids is not None and request.signature is not None:
            sims = self.centroids @ np.asarray(request.signature, dtype=np.float32).reshape(-1)
            if sims.shape[0] == n:
                sl = sims.tolist()
                costs = [x - 1e-9 * v for x, v in zip(costs, sl)]
        idx = min(cand, key=costs.__getitem__)
        return Decision(idx, self.name, "cost" if request.activation is not None else "no_activation",
                        server_similarities=-np.asarray(costs), centroid_similarities=sims)


class _ReferenceBalanced(_ReferenceStateAware):
    """eldr_balanced.EldrBalancedPolicy before the per-request cost work (logic copied)."""

    name = "eldr_balanced"
    BAND_SCAN_MAX = 4

    def __init__(self, num_servers, cost=BALANCED_COST, centroids=None, cost_band=DEFAULT_COST_BAND,
                 load_cap=DEFAULT_LOAD_CAP, sim_band=DEFAULT_SIM_BAND, sim_band_full=DEFAULT_SIM_BAND_FULL,
                 load_slack=DEFAULT_LOAD_SLACK, cost_band_full=DEFAULT_COST_BAND_FULL):
        super().__init__(num_servers, cost)
        self.cost_band, self.load_cap, self.load_slack = cost_band, load_cap, load_slack
        self.cost_band_full = cost_band_full
        self.sim_band, self.sim_band_full = sim_band, sim_band_full
        self.ownership = None if centroids is None else CentroidOwnership(centroids, num_servers)
        self.centroids = None if self.ownership is None else self.ownership.centroids

    def add_server(self):
        super().add_server()
        if self.ownership is not None:
            self.ownership.add()

    def remove_server(self, index):
        super().remove_server(index)
        if self.ownership is not None:
            self.ownership.remove(index)

    def explain(self, request, loads, allowed=None):
        n = len(loads)
        if n != len(self.servers):
            raise ValueError("loads")
        cand = bounded(_candidates(n, allowed).tolist(), loads, self.load_cap, self.load_slack)
        if self.sim_band is not None and self.ownership is not None and request.signature is not None:
            return self._band_first(request, loads, cand)
        costs = self._costs(request, loads)
        if not math.isfinite(sum(costs)):
            return self._fallback("degenerate_cost", loads, cand)
        cheapest = min(cand, key=costs.__getitem__)
        if self.ownership is None or request.signature is None:
            return Decision(cheapest, self.name, "cost" if request.activation is not None else "no_activation",
                            band=(cheapest,), server_similarities=-np.asarray(costs))
        sig = np.asarray(request.signature, dtype=np.float32).reshape(-1)
        best = costs[cheapest]
        limit = best + abs(best) * queue_band(self.cost_band, self.cost_band_full, loads, cand, self.cost.max_batch)
        band = [i for i in cand if costs[i] <= limit]
        if len(band) <= self.BAND_SCAN_MAX:
            own = self.ownership
            sims = {i: own.similarity_of(i, sig) for i in band}
            idx = max(band, key=lambda i: (sims[i], -costs[i]))
            return LazyDecision(idx, self.name, "cost_band", tuple(band), sims[idx],
                                own.similarities_later(sig))
        csims = self.centroids @ sig
        server_sims = self.ownership.gather(csims)
        sims = server_sims.tolist()
        idx = max(band, key=lambda i: (sims[i], -costs[i]))
        return Decision(idx, self.name, "cost_band", tuple(band), sims[idx], server_sims, csims)

    def _band_first(self, request, loads, cand):
        sig = np.asarray(request.signature, dtype=np.float32).reshape(-1)
        csims = self.centroids @ sig
        server_sims = self.ownership.gather(csims)
        sims = server_sims.tolist()
        width = band_width(self.sim_band, self.sim_band_full, loads, cand, self.cost.max_batch)
        band = region_band(cand, sims, width)
        costs = self._costs(request, loads, band)
        if not math.isfinite(sum(costs[i] for i in band)):
            return self._fallback("degenerate_cost", loads, cand)
        idx = min(band, key=lambda i: (costs[i], -sims[i], i))
        return Decision(idx, self.name, "region_band", tuple(band), sims[idx], server_sims, csims)


# ---------------------------------------------------------------- the comparison
def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))


def _check_decision(got: Decision, want: Decision) -> None:
    assert (got.index, got.policy, got.reason, got.band, got.fallback) == \
        (want.index, want.policy, want.reason, want.band, want.fallback)
    assert got.best_similarity == want.best_similarity or (
        got.best_similarity != got.best_similarity and want.best_similarity != want.best_similarity)
    assert _same(got.server_similarities, want.server_similarities)
    assert _same(got.centroid_similarities, want.centroid_similarities)


def _check_state(pol, ref) -> None:
    for name in ("log_free", "offset"):
        assert _same(getattr(pol, name), getattr(ref, name)), name
    fresh = [i for i in range(len(pol.servers)) if i not in pol._stale | ref._stale]
    for name in ("free", "unique"):  # a stale row is refreshed when a decision reads it
        assert _same(getattr(pol, name)[fresh], getattr(ref, name)[fresh]), name
    assert pol._stale >= ref._stale and pol._reported == ref._reported
    assert [s.live for s in pol.servers] == [s.live for s in ref.servers]
    assert [s.releases for s in pol.servers] == [s.releases for s in ref.servers]
    assert pol.fallbacks == ref.fallbacks and pol.laws == ref.laws


CONFIGS = {
    "default": dict(),  # the router's default (bounded load, cost band, most similar)
    "cost_band_2pct": dict(cost_band=0.02, load_cap=None),
    "fixed_band": dict(cost_band_full=None),  # the 5% band at every load
    "locality_pick": dict(sim_band=0.05, sim_band_full=0.15),  # the band-first pick
    "no_cap": dict(load_cap=None, sim_band=0.05, sim_band_full=None),
    "no_artifact": dict(centroids=False),
    "fewer_centroids": dict(centroids=3),  # servers own several centroids
    "state_aware": dict(plain=True),
}


def _activation(rng, dim, kind):
    if kind == "dense":  # a prompt: prefill counts / prompt tokens
        counts = rng.poisson(rng.choice([0.3, 3.0]), dim)
        return (counts / max(float(counts.max(initial=0)), 1.0)).astype(np.float32)
    if kind == "sparse":
        p = np.zeros(dim, dtype=np.float32)
        p[rng.integers(0, dim, 4)] = rng.random(4).astype(np.float32)
        return p
    if kind == "hostile":  # out of range, infinities, NaN: clamped or repaired the same way
        p = rng.random(dim).astype(np.float32) * np.float32(1.5)
        p[rng.integers(0, dim, 3)] = rng.choice([np.nan, np.inf, -np.inf, -0.5, 1.0, 2.0], 3)
        return p
    return rng.random(dim)  # float64 (cast to float32 by the policy)


@pytest.mark.parametrize("vector", [False, True], ids=["loop", "numpy"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dim", [24, 384])
def test_decisions_and_state_equal_the_reference(monkeypatch, seed, config, dim, vector):
    monkeypatch.setattr(sa_module, "RESET_EVERY", _RESET_EVERY)
    # every server priced by the Python loop, or with numpy (_cost_array) at any size
    monkeypatch.setattr(StateAwarePolicy, "VECTOR_MIN", 1 if vector else 10 ** 9)
    rng = np.random.default_rng(1000 * seed + dim)
    n = int(rng.integers(3, 9))
    opts = dict(CONFIGS[config])
    plain = opts.pop("plain", False)
    k = opts.pop("centroids", n)
    centroids = None if k is False else rng.random((k, dim)).astype(np.float32)
    if centroids is not None and rng.random() < 0.5:  # clustered regions: bands narrower than every server
        centroids[: max(1, k // 2)] += 2.0 * rng.random(dim).astype(np.float32)
    cost = StepCost(base_s=0.006, per_seq_s=3.6e-05, per_expert_s=5.7e-05, max_batch=int(rng.choice([4, 256])))
    if plain:
        pol, ref = StateAwarePolicy(n, cost=cost, centroids=centroids), _ReferenceStateAware(n, cost, centroids)
    else:
        pol = EldrBalancedPolicy(n, cost=cost, centroids=centroids, **opts)
        ref = _ReferenceBalanced(n, cost, centroids, **opts)
    live: list[tuple[Any, Any]] = []
    kinds = ["dense", "dense", "dense", "sparse", "float64", "hostile"]
    decisions = 0
    for _ in range(400):
        n = len(pol.servers)
        op = rng.random()
        if op < 0.45:  # a request: decide, then (mostly) admit where it went
            sig = None
            if centroids is not None and rng.random() < 0.9:
                sig = centroids[rng.integers(0, len(centroids))] + 0.3 * rng.random(dim).astype(np.float32)
                sig = (sig / np.linalg.norm(sig)).astype(np.float32)
            act = _activation(rng, dim, kinds[int(rng.integers(0, len(kinds)))]) if rng.random() < 0.95 else None
            req = RouteRequest(sig, activation=act)
            loads = [int(x) for x in rng.integers(0, 2 * cost.max_batch if rng.random() < 0.2 else 12, n)]
            r = rng.random()
            allowed = (None if r < 0.3 else [True] * n if r < 0.6 else [bool(x) for x in rng.random(n) < 0.6]
                       if r < 0.85 else np.asarray(rng.random(n) < 0.5) if r < 0.95 else [False] * n)
            got, want = pol.explain(req, loads, allowed), ref.explain(req, loads, allowed)
            _check_decision(got, want)
            decisions += 1
            if rng.random() < 0.85:
                live.append((pol.admit(got.index, req), ref.admit(want.index, req)))
        elif op < 0.80 and live:  # a request leaves (now and then twice)
            j = int(rng.integers(0, len(live)))
            a, b = live[j] if rng.random() < 0.05 else live.pop(j)
            pol.release(a)
            ref.release(b)
        elif op < 0.86:  # an engine reports its batch, or stops reporting
            i = int(rng.integers(0, n))
            v = None if rng.random() < 0.3 else -rng.random(dim) * rng.choice([0.1, 3.0, 200.0])
            if v is not None and rng.random() < 0.1:
                v[0] = 1.0  # a positive log: clamped at 0
            pol.observe_engine(i, v)
            ref.observe_engine(i, v)
        elif op < 0.90:  # a step law fitted for a server, or dropped
            i = int(rng.integers(0, n))
            law = None if rng.random() < 0.3 else StepCost(float(rng.uniform(0.001, 0.01)),
                                                           float(rng.uniform(0, 1e-4)),
                                                           float(rng.uniform(0, 1e-4)), int(rng.choice([4, 64])))
            pol.set_step_law(i, law)
            ref.set_step_law(i, law)
        elif op < 0.93 and n < 10:
            pol.add_server()
            ref.add_server()
        elif op < 0.96 and n > 2:
            i = int(rng.integers(0, n))
            pol.remove_server(i)
            ref.remove_server(i)
        else:  # a status read between decisions
            assert _same(pol.expected_unique(), ref.expected_unique())
        if pol.log_free is not None or ref.log_free is not None:
            _check_state(pol, ref)
    assert decisions > 100
    req = RouteRequest(activation=_activation(rng, dim, "dense"))
    loads = [int(x) for x in rng.integers(0, 12, len(pol.servers))]
    assert _same(pol.scores(req, loads), ref.scores(req, loads))


def test_unused_log_equals_the_reference_on_any_input():
    """The clamps against constant rows give the scalar clamps' values, NaN and infinities
    included, for float32 vectors (the fast path) and anything else."""
    from eldr_sglang.core.policies.state_aware import unused_log

    rng = np.random.default_rng(7)
    for trial in range(50):
        p = (rng.random(int(rng.integers(1, 7000))) * rng.choice([1e-3, 1.0, 3.0])).astype(np.float32)
        p[rng.integers(0, p.size, 5)] = rng.choice([np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0, -1.0, 2.0], 5)
        for x in (p, p.astype(np.float64), p.reshape(1, -1), p[::2]):
            assert _same(unused_log(x), _reference_unused_log(x)), trial


def test_the_most_similar_of_a_large_band_equals_the_reference_pick():
    """eldr_balanced's numpy pick over a band of more than 16 servers (the sequences above stay
    below): the reference's ``max(band, key=(similarity, -cost))``, ties and NaN included."""
    from eldr_sglang.core.policies.eldr_balanced import _most_similar

    rng = np.random.default_rng(11)
    for trial in range(2000):
        n = int(rng.integers(17, 160))
        sims = rng.choice([0.1, 0.2, 0.3], n).astype(np.float32) if trial % 3 == 0 else \
            rng.random(n).astype(np.float32)
        if trial % 17 == 0:
            sims[rng.integers(0, n)] = np.nan
        costs = rng.choice([1.0, 2.0], n) if trial % 2 else rng.random(n)
        band = sorted(rng.choice(n, int(rng.integers(1, n + 1)), replace=False).tolist())
        sl = sims.tolist()
        want = max(band, key=lambda i: (sl[i], -costs[i]))
        assert _most_similar(band, sims, list(costs)) == want == _most_similar(band, sims, costs), trial
