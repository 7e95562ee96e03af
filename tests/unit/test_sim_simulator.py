"""Discrete-event simulator (simulated): conservation, determinism, textbook queueing."""

import numpy as np
import pytest

from eldr_sglang.core.policies import make_policy
from eldr_sglang.core.synthetic import make_synthetic_traces
from eldr_sglang.core.traces import ModelSpec, TraceSet
from eldr_sglang.sim.calibration import domain_map, oracle_grouping
from eldr_sglang.sim.cost_model import CostParams
from eldr_sglang.sim.simulator import SimConfig, arrival_times, simulate
from eldr_sglang.sim.workload import SimWorkload, build_workload, decode_step_probs


@pytest.fixture(scope="module")
def traces():
    return make_synthetic_traces(1200, num_layers=4, num_experts=32, top_k=4, n_informative=2,
                                 mean_prompt_tokens=300, mean_output_tokens=60, include_gates=False, seed=3).traces


@pytest.fixture(scope="module")
def workload(traces):
    return build_workload(traces, "task")


def small(**kw) -> SimConfig:
    base = dict(num_prefill=2, num_decode=4, rate=20.0, warmup_s=2.0, measure_s=10.0, seed=1)
    base.update(kw)
    return SimConfig(**base)


def test_decode_probabilities_are_per_step_top_k_frequencies():
    """Exact per-step top-k draws: p sums to top_k per layer and matches the draw frequencies."""
    rng = np.random.default_rng(0)
    n, L, E, k, steps = 5, 3, 16, 4, 200
    counts = np.zeros((n, L, E), dtype=np.int32)
    for r in range(n):
        for l in range(L):
            w = rng.dirichlet(np.ones(E) * 0.3)
            for _ in range(steps):
                counts[r, l, rng.choice(E, k, replace=False, p=w)] += 1
    tr = TraceSet(ModelSpec("t", L, E, k), np.array([str(i) for i in range(n)]), counts, counts,
                  np.full(n, 10), np.full(n, steps + 1), {"task": np.full(n, "a")})
    p = decode_step_probs(tr)
    assert p.max() < 1
    assert np.allclose(p.sum(axis=2), k)
    assert np.allclose(p, counts / steps, atol=1e-6)


@pytest.mark.parametrize("policy", ["random", "round_robin", "jsq", "p2c", "domain"])
def test_every_arrival_finishes_exactly_once(workload, policy):
    cfg = small(max_batch=8, kv_capacity_tokens=4000)
    res = simulate(workload, make_policy(policy, 4, domain_map=domain_map(workload.labels, 4)), cfg)
    assert res.arrival.size > 100
    assert (res.finished_count == 1).all() and res.summary["conserved"]
    assert np.isfinite(res.finish).all() and (res.finish >= res.first_token).all()
    assert (res.first_token > res.arrival).all()
    assert set(np.unique(res.server)) <= set(range(4))
    assert res.summary["mean_batch"] <= 8
    assert res.summary["simulated"] is True


def test_same_seed_same_run_other_seed_other_run(workload):
    a = simulate(workload, make_policy("p2c", 4, seed=0), small())
    b = simulate(workload, make_policy("p2c", 4, seed=0), small())
    c = simulate(workload, make_policy("p2c", 4, seed=0), small(seed=2))
    assert np.array_equal(a.finish, b.finish) and np.array_equal(a.server, b.server)
    assert a.summary == b.summary
    assert a.arrival.size != c.arrival.size or not np.array_equal(a.finish, c.finish)


def test_one_server_batch_one_constant_step_is_md1():
    """M/D/1: mean wait = rho * D / (2 (1 - rho)) (Pollaczek-Khinchine)."""
    D, rho = 0.01, 0.7
    const = CostParams("constant", num_moe_layers=1, num_experts=4, top_k=1, bytes_per_expert=0.0,
                       mem_bandwidth=1.0, fixed_s=D, attn_s_per_token=0.0, attn_s_per_ctx_token=0.0, dense_s=0.0)
    n = 16
    wl = SimWorkload("md1", np.full(n, 10), np.full(n, 2), np.log1p(-np.full((n, 1, 4), 0.25)),
                     np.full(n, "x"), num_experts=4, top_k=1)
    cfg = SimConfig(num_prefill=1, num_decode=1, rate=rho / D, warmup_s=20.0, measure_s=600.0, max_batch=1,
                    prefill_fixed_s=0.0, prefill_s_per_token=0.0, kv_transfer_s=0.0, seed=5)
    res = simulate(wl, make_policy("round_robin", 1), cfg, cost=const)
    wait = res.tpot[res.measured] - D
    assert wait.min() >= -1e-12
    assert wait.mean() == pytest.approx(rho * D / (2 * (1 - rho)), rel=0.08)


def test_gamma_arrivals_keep_the_rate_and_are_burstier():
    rng = np.random.default_rng(0)
    pois = np.diff(arrival_times(SimConfig(rate=50.0, warmup_s=0, measure_s=400), rng))
    gam = np.diff(arrival_times(SimConfig(rate=50.0, warmup_s=0, measure_s=400, arrival="gamma", burst_cv=2.0), rng))
    assert pois.mean() == pytest.approx(0.02, rel=0.05) and gam.mean() == pytest.approx(0.02, rel=0.08)
    assert pois.std() / pois.mean() == pytest.approx(1.0, rel=0.1)
    assert gam.std() / gam.mean() == pytest.approx(2.0, rel=0.15)


def test_prefix_caching_shortens_prefill(workload):
    plain = simulate(workload, make_policy("jsq", 4), small(rate=10.0))
    cached = simulate(workload, make_policy("jsq", 4), small(rate=10.0, prefix_cached_fraction=0.8))
    assert cached.summary["ttft_median_ms"] < plain.summary["ttft_median_ms"]


def test_grouping_by_decode_usage_activates_fewer_experts(traces, workload):
    oracle = oracle_grouping(traces, traces, 4, n_init=1)
    cfg = small(rate=40.0)
    rr = simulate(workload, make_policy("round_robin", 4), cfg)
    grouped = simulate(workload, make_policy("eldr", 4, centroids=oracle.centroids, tau=0.0), cfg,
                       oracle.signatures)
    assert grouped.summary["unique_experts_per_step"] < 0.95 * rr.summary["unique_experts_per_step"]


def test_expert_parallel_run_uses_group_maximum(workload):
    ep = CostParams("ep", num_moe_layers=2, num_experts=32, top_k=4, bytes_per_expert=1e6, mem_bandwidth=1e12,
                    fixed_s=1e-3, attn_s_per_token=0.0, attn_s_per_ctx_token=0.0, dense_s=0.0, ep_size=4)
    res = simulate(workload, make_policy("jsq", 4), small(), cost=ep)
    assert res.summary["conserved"] and res.summary["unique_experts_per_step"] > 0
    with pytest.raises(ValueError, match="groups"):
        simulate(workload, make_policy("jsq", 4), small(), cost=ep, placement=np.full(32, 7))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="arrival"):
        SimConfig(arrival="weird")
    with pytest.raises(ValueError, match="num_decode"):
        SimConfig(num_decode=0)


def test_late_binding_pays_the_signature_wait_in_ttft_and_prefill_kv():
    """Late binding (ELDR's flow) holds each prompt's KV on the prefill server for the
    signature wait and adds it to TTFT; early binding (chosen at arrival, no signature)
    does not, and its policy sees no signature."""
    wait = 0.05
    late = simulate(workload_of(), make_policy("jsq", 4), small(signature_wait_s=wait))
    early = simulate(workload_of(), make_policy("jsq", 4), small(binding="early", signature_wait_s=wait))
    base = simulate(workload_of(), make_policy("jsq", 4), small())
    assert late.summary["conserved"] and early.summary["conserved"]
    prefill_end = base.first_token - small().kv_transfer_s  # same arrivals and prefill schedule
    assert np.allclose(late.first_token - prefill_end, small().kv_transfer_s + wait)
    assert np.allclose(early.first_token - prefill_end, small().kv_transfer_s)
    ratio = late.summary["prefill_kv_held_tokens"] / early.summary["prefill_kv_held_tokens"]
    assert ratio == pytest.approx((small().kv_transfer_s + wait) / small().kv_transfer_s)

    class Recorder:
        name, needs_signature = "rec", True
        seen: list = []

        def choose(self, request, loads, allowed=None):
            self.seen.append(request.signature)
            return 0

        def admit(self, i, r):
            return None

        def release(self, token):
            pass

    rec = Recorder()
    simulate(workload_of(), rec, small(binding="early"), signatures=np.ones((len(workload_of()), 3)))
    assert rec.seen and all(s is None for s in rec.seen)
    with pytest.raises(ValueError, match="binding"):
        small(binding="sometimes")


_WL = {}


def workload_of():
    if "w" not in _WL:
        _WL["w"] = build_workload(make_synthetic_traces(300, num_layers=2, num_experts=16, top_k=2, n_informative=1,
                                                        include_gates=False, seed=5).traces, "task")
    return _WL["w"]
