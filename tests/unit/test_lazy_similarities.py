"""eldr_balanced reads only the cost band's similarities when the band is small (one dot
per owned centroid) and fills the per-server / per-centroid arrays when a reader asks:
same picks, same arrays, fixed at decision time."""

import numpy as np
import pytest

from eldr_sglang.core.policies import RouteRequest
from eldr_sglang.core.policies.base import LazyDecision
from eldr_sglang.core.policies.eldr_balanced import EldrBalancedPolicy
from eldr_sglang.core.policies.state_aware import StepCost

D = 64
COST = StepCost(base_s=1.0, per_seq_s=0.1, per_expert_s=0.01, max_batch=64)


@pytest.mark.parametrize("k", [3, 5, 9])  # centroids per 5 servers: fewer, equal, more
def test_small_band_picks_like_the_full_matvec_and_fills_the_same_arrays(k):
    rng = np.random.default_rng(k)
    cents = rng.random((k, D)).astype(np.float32)
    lazy = EldrBalancedPolicy(5, cost=COST, centroids=cents, sim_band=None)  # the cost-band rule
    full = EldrBalancedPolicy(5, cost=COST, centroids=cents, sim_band=None)
    full.BAND_SCAN_MAX = -1  # always the matvec
    for step in range(200):
        sig = rng.random(D).astype(np.float32)
        sig /= np.linalg.norm(sig)
        req = RouteRequest(signature=sig, activation=rng.random(D) * 0.2)
        loads = rng.integers(0, 4, 5).tolist()
        a, b = lazy.explain(req, loads), full.explain(req, loads)
        assert (a.index, a.band, a.reason) == (b.index, b.band, b.reason)
        assert a.best_similarity == pytest.approx(b.best_similarity, abs=1e-6)
        if len(a.band) <= lazy.BAND_SCAN_MAX:
            assert isinstance(a, LazyDecision)
        np.testing.assert_allclose(a.server_similarities, b.server_similarities, atol=1e-6)
        np.testing.assert_allclose(a.centroid_similarities, b.centroid_similarities, atol=1e-6)
        assert a.top(2) == [(i, pytest.approx(v, abs=1e-6)) for i, v in b.top(2)]
        for pol in (lazy, full):
            pol.release(pol.admit(a.index, req)) if step % 3 else pol.admit(a.index, req)


def test_the_arrays_are_those_of_the_ownership_at_decision_time():
    cents = np.eye(3, D, dtype=np.float32)
    pol = EldrBalancedPolicy(3, cost=COST, centroids=cents, sim_band=None)
    dec = pol.explain(RouteRequest(signature=cents[2], activation=np.full(D, 0.1)), [0, 0, 0])
    assert isinstance(dec, LazyDecision) and dec.index == 2 and dec.best_similarity == pytest.approx(1.0)
    pol.remove_server(0)  # read after a membership change: still 3 servers, as decided
    np.testing.assert_allclose(dec.server_similarities, [0.0, 0.0, 1.0])
    np.testing.assert_allclose(dec.centroid_similarities, [0.0, 0.0, 1.0])
    dec.server_similarities = None  # a plain field for writers
    assert dec.server_similarities is None
