"""Router replicas in the simulator (SIMULATED): each arrival is routed and released by
one replica, a one-element list is the one-router run, and with engine reports every
replica is told each server's true batch (its own requests and the other replicas')."""

import numpy as np
import pytest

from eldr_sglang.core.policies import StateAwarePolicy
from eldr_sglang.core.synthetic import make_synthetic_traces
from eldr_sglang.sim.calibration import prefill_activations
from eldr_sglang.sim.simulator import SimConfig, simulate
from eldr_sglang.sim.workload import build_workload


@pytest.fixture(scope="module")
def data():
    traces = make_synthetic_traces(600, num_layers=4, num_experts=16, top_k=2, n_informative=2,
                                   mean_prompt_tokens=200, mean_output_tokens=40, include_gates=False, seed=5).traces
    return build_workload(traces, "task"), prefill_activations(traces, [1, 2])


def config(**kw):
    return SimConfig(**{**dict(num_prefill=2, num_decode=4, rate=30.0, warmup_s=2.0, measure_s=8.0, seed=2), **kw})


class Spy(StateAwarePolicy):
    """A replica that checks each engine report against the true batch it can see."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.admits, self.reports = 0, 0

    def admit(self, index, request):
        self.admits += 1
        return super().admit(index, request)

    def observe_engine(self, index, log_free):
        self.reports += 1
        assert np.all(log_free <= 1e-9)
        super().observe_engine(index, log_free)


def test_a_one_replica_list_is_the_one_router_run(data):
    wl, act = data
    a = simulate(wl, StateAwarePolicy(4), config(), activations=act)
    b = simulate(wl, [StateAwarePolicy(4)], config(), activations=act)
    assert np.array_equal(a.server, b.server) and np.allclose(a.finish, b.finish, equal_nan=True)


def test_each_arrival_is_routed_by_one_replica_and_reports_reach_all(data):
    wl, act = data
    spies = [Spy(4) for _ in range(3)]
    res = simulate(wl, spies, config(), activations=act, engine_report_s=0.5)
    assert sum(s.admits for s in spies) == len(res.arrival) and all(s.admits > 0 for s in spies)
    assert all(s.reports > 0 for s in spies)
    assert (res.finished_count == 1).all()  # conservation with releases by the owning replica
    # after the run every request is gone: each replica's priced batch is empty again
    for s in spies:
        s.observe_engine(0, np.zeros(act.shape[1]))
        assert s.expected_unique()[0] == pytest.approx(0.0, abs=1e-9)


def test_engine_reports_let_a_replica_price_the_others_requests(data):
    """With reports, a replica's priced batch of a server includes requests other replicas
    sent there: its expected distinct experts exceed what its own requests alone give."""
    wl, act = data
    seen = []

    class Probe(StateAwarePolicy):
        def choose(self, request, loads, allowed=None):
            if self.log_free is not None and self._reported:
                seen.append((self.expected_unique().sum(), np.exp(np.minimum(self.log_free, 0)).sum()))
            return super().choose(request, loads, allowed)

    simulate(wl, [Probe(4), StateAwarePolicy(4)], config(rate=60.0), activations=act, engine_report_s=0.25)
    priced = np.array([u for u, _ in seen])
    own_only = np.array([4 * act.shape[1] - f for _, f in seen])
    assert len(seen) > 50 and priced.mean() > own_only.mean()


def test_laws_fitted_online_from_noisy_steps_approach_the_simulators_law(data):
    """The policy is not told the simulator's law: it fits one per server from noisy step
    samples, and the fitted per-expert term is close to what the true law gives."""
    from eldr_sglang.sim.cost_model import get_params, step_cost

    wl, act = data
    pol = StateAwarePolicy(4)
    simulate(wl, pol, config(rate=60.0, measure_s=20.0), activations=act, engine_report_s=0.5, fit_law_s=2.0,
             sample_noise=0.1)
    params = get_params(config().cost)
    n_sel = act.shape[1] // wl.num_experts
    true = step_cost(params, n_sel, expert_scale=params.num_experts / wl.num_experts)
    assert all(law is not None for law in pol.laws)
    fitted = np.array([law.per_expert_s for law in pol.laws])
    assert np.all(np.abs(fitted / true.per_expert_s - 1) < 0.25), (fitted, true.per_expert_s)
