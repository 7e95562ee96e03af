"""The default policy, eldr_balanced. Its default pick (bounded load, similarity band, cheapest)
is tested in test_locality_pick.py; here the older rule it keeps as an option (``sim_band=None``:
state-aware cost, a cost band, then the most similar region; bounded load optional). Pure numpy;
the simulator runs the same object."""

import numpy as np
import pytest

from eldr_sglang.core.policies import RouteRequest, build_policy, policy_spec, PolicyContext
from eldr_sglang.core.policies.eldr_balanced import BALANCED_COST, EldrBalancedPolicy
from eldr_sglang.core.policies.state_aware import StepCost
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.sim.cost_model import PARAM_SETS, step_cost

E = 8
COST = StepCost(base_s=1.0, per_seq_s=0.1, per_expert_s=0.01, max_batch=64)
OLD = dict(sim_band=None, load_cap=None)  # the cost-band rule


def act(*hot, layers=2):
    row = np.zeros(E)
    row[list(hot)] = 1.0
    return np.tile(row, layers)


def sig(*hot):
    v = act(*hot)
    return v / np.linalg.norm(v)


CENTROIDS = np.stack([sig(0, 1), sig(2, 3), sig(4, 5)])


def req(*hot):
    return RouteRequest(signature=sig(*hot), activation=act(*hot))


def test_default_cost_is_the_simulators_with_an_average_sequences_kv_read():
    want = step_cost(PARAM_SETS["qwen3-30b-a3b-mi300x"], published_layers=2, context_tokens=750)
    for f in ("base_s", "per_seq_s", "per_expert_s"):
        assert getattr(BALANCED_COST, f) == pytest.approx(getattr(want, f), rel=1e-4), f


def test_is_the_routers_default_and_needs_no_artifact():
    assert RouterConfig().policy == "eldr_balanced"
    spec = policy_spec("balanced")
    assert spec.name == "eldr_balanced" and not spec.needs_artifact and spec.rebuild_on_reload
    pol = build_policy("eldr_balanced", PolicyContext(3))
    assert pol.choose(RouteRequest(activation=act(0)), [2, 0, 1]) == 1  # no artifact: cheapest
    assert pol.choose(RouteRequest(), [2, 1, 3]) == 1  # nothing known: fewest in flight


def test_equal_costs_go_to_the_region_unequal_ones_to_the_cheapest():
    pol = EldrBalancedPolicy(3, cost=COST, centroids=CENTROIDS, cost_band=0.05, **OLD)
    # idle servers cost the same: the request goes to its region, not to server 0
    d = pol.explain(req(4, 5), [0, 0, 0])
    assert d.index == 2 and d.reason == "cost_band" and d.band == (0, 1, 2)
    # its region's server is busier than the band buys: the cheapest wins
    assert pol.choose(req(4, 5), [0, 0, 3]) in (0, 1)
    # with cost_band 0 the region only breaks exact ties
    strict = EldrBalancedPolicy(3, cost=COST, centroids=CENTROIDS, cost_band=0.0, **OLD)
    assert strict.choose(req(4, 5), [0, 0, 0]) == 2 and strict.choose(req(4, 5), [0, 0, 1]) == 0


def test_live_batch_locality_beats_similarity_when_it_is_cheaper():
    pol = EldrBalancedPolicy(2, cost=COST, centroids=CENTROIDS[:2], cost_band=0.01, **OLD)
    tokens = [pol.admit(0, req(6, 7)) for _ in range(3)]  # server 0 already runs experts 6, 7
    tokens += [pol.admit(1, req(2, 3)) for _ in range(3)]
    # a request of experts 6, 7 adds no experts to server 0: cheaper there by more than 1%
    assert pol.choose(req(6, 7), [3, 3]) == 0
    for t in tokens:
        pol.release(t)
    assert [s.live for s in pol.servers] == [0, 0] and np.all(pol.free == 1.0)


def test_a_mix_the_calibration_did_not_expect_does_not_pile_up():
    """Every request resembles region 0 (a calibration/live mix mismatch): the band rule
    sends all of them to server 0; this policy keeps the in-flight counts within 2 of each
    other (12 in flight, finishing in arrival order) and the totals even."""
    def serve(pol):
        loads, live, peak, total = [0, 0, 0], [], 0, [0, 0, 0]
        for _ in range(60):
            r = req(0, 1)
            s = pol.choose(r, loads)
            live.append((s, pol.admit(s, r)))
            loads[s] += 1
            total[s] += 1
            peak = max(peak, max(loads) - min(loads))
            if len(live) >= 12:
                s0, t0 = live.pop(0)
                pol.release(t0)
                loads[s0] -= 1
        return peak, total

    peak, total = serve(EldrBalancedPolicy(3, cost=COST, centroids=CENTROIDS, **OLD))
    assert peak <= 2 and max(total) / (sum(total) / 3) <= 1.1, (peak, total)
    band_peak, band_total = serve(build_policy("eldr", PolicyContext(3, centroids=CENTROIDS, tau=0.1)))
    assert band_total[0] == 60 and band_peak >= 11  # the paper's band rule piles them up


def test_bounded_load_filter():
    pol = EldrBalancedPolicy(3, cost=StepCost(base_s=0.0, per_seq_s=0.0, per_expert_s=0.0),
                             centroids=CENTROIDS, load_cap=1.25, load_slack=0.0, sim_band=None)
    # costs all zero: similarity decides, until server 2 reaches ceil(1.25 * (6 + 1) / 3) = 3
    assert pol.choose(req(4, 5), [2, 2, 2]) == 2
    assert pol.choose(req(4, 5), [1, 2, 3]) in (0, 1)
    with pytest.raises(ValueError, match="load_cap"):
        EldrBalancedPolicy(3, load_cap=0.5)
    with pytest.raises(ValueError, match="cost_band"):
        EldrBalancedPolicy(3, cost_band=-0.1)
    with pytest.raises(ValueError, match="sim_band"):
        EldrBalancedPolicy(3, sim_band=-0.1)
    with pytest.raises(ValueError, match="load_slack"):
        EldrBalancedPolicy(3, load_slack=-1.0)


def test_membership_changes_keep_regions_and_live_state():
    pol = EldrBalancedPolicy(3, cost=COST, centroids=CENTROIDS)
    tok = pol.admit(2, req(4, 5))
    pol.remove_server(0)  # server 2 is index 1 now and still owns region 2
    assert pol.describe()["live"] == [0, 1] and pol.describe()["ownership"] == [[0, 1], [2]]
    assert pol.choose(req(4, 5), [0, 0]) == 1
    pol.add_server()  # takes back the handed-over region
    assert pol.describe()["ownership"] == [[1], [2], [0]]
    pol.release(tok)
    assert pol.describe()["live"] == [0, 0, 0]
    with pytest.raises(ValueError, match="dims"):
        pol.choose(RouteRequest(signature=np.ones(3), activation=act(0)), [0, 0, 0])


def test_allowed_mask_is_respected():
    pol = EldrBalancedPolicy(3, cost=COST, centroids=CENTROIDS)
    assert pol.choose(req(4, 5), [0, 0, 0], [True, True, False]) in (0, 1)
    assert pol.choose(req(4, 5), [0, 0, 0], [False, False, False]) == 2  # none allowed: all
