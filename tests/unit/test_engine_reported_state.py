"""Engine-reported batches in the state-aware price: a server's batch is what its
engine reported plus this router's admits and releases since, and a per-server step
law fitted from its engine replaces the default law for that server only."""

import numpy as np
import pytest

from eldr_sglang.core.policies import RouteRequest, StateAwarePolicy, StepCost

D = 8


def req(p):
    return RouteRequest(activation=np.asarray(p, dtype=np.float32))


def union(*ps):
    free = np.ones(D)
    for p in ps:
        free *= 1 - np.asarray(p, dtype=np.float64)
    return D - free.sum()


def test_the_true_batch_plus_own_requests_since_the_report():
    pol = StateAwarePolicy(2, dim=D)
    mine = [0.5] * 2 + [0.0] * 6
    other = [0.0] * 4 + [0.9] * 4  # another replica's request on server 0
    tok = pol.admit(0, req(mine))
    # the engine sees both requests: its report's log(1 - usage)
    engine = np.log1p(-np.asarray(mine)) + np.log1p(-np.asarray(other))
    pol.observe_engine(0, engine)
    assert pol.expected_unique()[0] == pytest.approx(union(mine, other))
    late = [0.0] * 2 + [0.7] * 2 + [0.0] * 4
    tok2 = pol.admit(0, req(late))  # after the report: added on top
    assert pol.expected_unique()[0] == pytest.approx(union(mine, other, late))
    pol.release(tok)
    pol.release(tok2)  # all own requests gone: the other replica's request is still there
    assert pol.expected_unique()[0] == pytest.approx(union(other))
    assert pol.expected_unique()[1] == 0.0
    pol.observe_engine(0, None)  # report forgotten: own state only (empty)
    assert pol.expected_unique()[0] == pytest.approx(0.0)


def test_a_report_moves_the_choice():
    pol = StateAwarePolicy(2, dim=D)
    heavy = np.log1p(-np.full(D, 0.99))  # server 0 runs a big batch of another replica's requests
    assert pol.choose(req([0.5] * D), [0, 0]) == 0  # a tie goes to the first
    pol.observe_engine(0, heavy)
    costs = pol.scores(req([0.5] * D), [0, 0])
    assert costs[0] > costs[1] and pol.choose(req([0.5] * D), [0, 0]) == 1


def test_a_report_never_makes_an_expert_more_than_free():
    pol = StateAwarePolicy(1, dim=D)
    pol.observe_engine(0, np.full(D, 3.0))  # positive log: nonsense, clamped at 0
    assert pol.expected_unique()[0] == pytest.approx(0.0)


def test_a_per_server_step_law_replaces_the_default_for_that_server_only():
    pol = StateAwarePolicy(3, dim=D)
    r = req([0.1] * D)
    before = pol.scores(r, [2, 2, 2])
    pol.set_step_law(1, StepCost(base_s=1.0, per_seq_s=0.0, per_expert_s=0.0))
    after = pol.scores(r, [2, 2, 2])
    assert after[0] == pytest.approx(before[0]) and after[2] == pytest.approx(before[2])
    assert after[1] > before[1] and pol.choose(r, [2, 2, 2]) != 1
    pol.remove_server(0)  # the laws follow membership
    assert pol.laws[0] is not None and len(pol.laws) == 2
    pol.add_server()
    assert pol.laws == [pol.laws[0], None, None]
