"""The live-batch state of the batch-pricing policies (state_aware, eldr_balanced) stays
equal to a from-scratch recompute over any admit/release sequence, and a policy never
raises on a valid request."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eldr_sglang.core.policies import RouteRequest, StateAwarePolicy, StepCost
from eldr_sglang.core.policies.eldr_balanced import EldrBalancedPolicy
from eldr_sglang.core.policies.state_aware import P_MAX

LAYERS, E = 2, 8
D = LAYERS * E
COST = StepCost(base_s=1.0, per_seq_s=0.1, per_expert_s=0.01, max_batch=64)


def recompute(live: list[tuple[int, np.ndarray]], n: int) -> np.ndarray:
    """[n] expected distinct experts of each server's live requests, from scratch (float64):
    sum over experts of 1 - prod over requests of (1 - p), p clamped as the policy clamps it."""
    out = np.zeros(n)
    for s in range(n):
        free = np.ones(D)
        for server, p in live:
            if server == s:
                q = np.clip(np.nan_to_num(p.astype(np.float32).astype(np.float64), nan=0.0), 0.0, P_MAX)
                free *= 1.0 - q
        out[s] = float(np.sum(1.0 - free))
    return out


def check(pol, live, n):
    got, want = np.asarray(pol.expected_unique(), dtype=np.float64), recompute(live, n)
    assert np.all(got >= 0.0), got
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def label_activation(rng: np.random.Generator, label: int, kind: str) -> np.ndarray:
    """A request of ``label``: its two hot experts per layer used by (almost) every token."""
    p = np.zeros(D)
    for layer in range(LAYERS):
        hot = [(label * 2 + j) % E + layer * E for j in range(2)]
        p[hot] = {"one": 1.0, "near_one": 1.0 - 1e-9, "mixed": rng.uniform(0.9, 1.0)}[kind]
    cold = rng.random(D) < 0.3
    p[cold] = np.maximum(p[cold], rng.uniform(0.0, 0.5, int(cold.sum())))
    return p


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), servers=st.integers(1, 4), hot=st.floats(0.5, 1.0),
       admit_share=st.floats(0.35, 0.8), kind=st.sampled_from(["one", "near_one", "mixed"]),
       balanced=st.booleans())
def test_tracked_state_equals_a_recompute_over_thousands_of_steps(seed, servers, hot, admit_share,
                                                                  kind, balanced):
    """Random admit/release sequences (3,000 steps, a share ``hot`` of requests of one label,
    probabilities at or near one) keep every server's expected distinct experts equal to a
    from-scratch recompute and never negative; a decision never raises on the way."""
    rng = np.random.default_rng(seed)
    pol = (EldrBalancedPolicy(servers, cost=COST) if balanced else StateAwarePolicy(servers, cost=COST))
    live: list[tuple[int, np.ndarray, object]] = []
    for step in range(3000):
        if live and rng.random() > admit_share:
            s, p, tok = live.pop(int(rng.integers(len(live))))
            pol.release(tok)
        else:
            label = 0 if rng.random() < hot else int(rng.integers(1, 4))
            p = label_activation(rng, label, kind)
            loads = [sum(1 for x in live if x[0] == i) for i in range(servers)]
            req = RouteRequest(activation=p)
            s = pol.choose(req, loads) if rng.random() < 0.5 else int(rng.integers(servers))
            live.append((s, p, pol.admit(s, req)))
        if step % 100 == 0:
            check(pol, [(s, p) for s, p, _ in live], servers)
    check(pol, [(s, p) for s, p, _ in live], servers)
    for _, _, tok in live:
        pol.release(tok)
    assert np.all(np.asarray(pol.expected_unique()) == 0.0)


def test_near_one_probabilities_do_not_drift_after_many_admits_and_releases():
    """The float32 product underflowed and could not be divided back: one long request on
    expert 2 (p = 0.5), 60 short ones using experts 0-1 with p = 1 join and leave; the
    server never empties, so the tracked state must come back to the long request alone
    (it stayed at 5 distinct experts instead of 1, the server looked busier than it is)."""
    pol = StateAwarePolicy(2, cost=COST)
    long = np.zeros(D)
    long[[2, E + 2]] = 0.5
    short = np.zeros(D)
    short[[0, 1, E, E + 1]] = 1.0
    short[[3, E + 3]] = 1.0 - 1e-7
    keep = pol.admit(0, RouteRequest(activation=long))
    tokens = [pol.admit(0, RouteRequest(activation=short)) for _ in range(60)]
    check(pol, [(0, long)] + [(0, short)] * 60, 2)
    for t in tokens:
        pol.release(t)
    check(pol, [(0, long)], 2)
    assert pol.expected_unique()[0] == pytest.approx(1.0, rel=1e-6)
    costs = pol.scores(RouteRequest(activation=short), [1, 0])
    assert np.all(np.isfinite(costs)) and costs.min() > 0
    pol.release(keep)
    assert np.all(np.asarray(pol.expected_unique()) == 0.0)


def test_a_degenerate_state_is_a_counted_fallback_never_an_exception():
    """Costs that are negative (a drifted state) or not numbers must not empty the band:
    the decision is made, and a non-number cost is a fallback with its reason."""
    cents = np.eye(3, D)
    pol = EldrBalancedPolicy(3, cost=COST, centroids=cents, sim_band=None, load_cap=None)  # the cost-band rule
    req = RouteRequest(signature=cents[1], activation=np.full(D, 0.5))
    pol._costs = lambda request, loads, rows=None: [-9.6, -9.0, 1.0]  # the drifted server
    dec = pol.explain(req, [262, 133, 133])
    assert dec.index in (0, 1) and dec.band and 0 in dec.band
    default = EldrBalancedPolicy(3, cost=COST, centroids=cents)  # bounded load keeps the pile-up out
    default._costs = pol._costs
    dec = default.explain(req, [262, 133, 133])
    assert dec.index == 1 and dec.band and 0 not in dec.band
    pol._costs = lambda request, loads, rows=None: [math.nan, 1.0, math.inf]
    dec = pol.explain(req, [3, 1, 2])
    assert dec.index == 1 and dec.fallback == "degenerate_cost"
    assert pol.describe()["fallbacks"] == {"degenerate_cost": 1}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, 7.0])
def test_a_request_with_bad_probabilities_never_raises_or_poisons_the_state(bad):
    for pol in (StateAwarePolicy(2, cost=COST),
                EldrBalancedPolicy(2, cost=COST, centroids=np.eye(2, D))):
        good = np.full(D, 0.25)
        t0 = pol.admit(0, RouteRequest(activation=good))
        p = good.copy()
        p[3] = bad
        req = RouteRequest(signature=np.eye(2, D)[0], activation=p)
        dec = pol.explain(req, [1, 0])
        assert dec.index in (0, 1)
        tok = pol.admit(dec.index, req)
        u = np.asarray(pol.expected_unique())
        assert np.all(np.isfinite(u)) and np.all(u >= 0) and np.all(u <= D)
        pol.release(tok)
        check(pol, [(0, good)], 2)
        pol.release(t0)
        assert np.all(np.asarray(pol.expected_unique()) == 0.0)


def test_a_busy_server_is_recomputed_from_its_live_requests_every_reset_every_releases(monkeypatch):
    """A server that never empties gets its sums rebuilt from its live requests (no rounding
    carried over) every RESET_EVERY releases; an emptied server is exactly zero."""
    from eldr_sglang.core.policies import state_aware

    monkeypatch.setattr(state_aware, "RESET_EVERY", 5)
    rng = np.random.default_rng(3)
    pol = StateAwarePolicy(1, cost=COST)
    keep = [pol.admit(0, RouteRequest(activation=rng.random(D))) for _ in range(3)]
    for step in range(12):
        pol.release(pol.admit(0, RouteRequest(activation=rng.random(D))))
        if (step + 1) % 5 == 0:
            assert pol.servers[0].releases == 0  # just rebuilt
            exact = np.sum([t.log_q for t in keep], axis=0)
            np.testing.assert_allclose(pol.log_free[0], exact, rtol=1e-14, atol=0)
        else:
            assert pol.servers[0].releases == (step + 1) % 5
    for t in keep:
        pol.release(t)
    assert np.all(pol.log_free == 0.0) and pol.expected_unique()[0] == 0.0 and np.all(pol.free == 1.0)
