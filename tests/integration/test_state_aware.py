"""The state-aware policy: prices each server's live batch; same object in the router
and the simulator."""

import asyncio

import numpy as np
import orjson
import pytest

from eldr_sglang.core.policies import RouteRequest, StateAwarePolicy, StepCost, make_policy, policy_spec
from eldr_sglang.sim.cost_model import PARAM_SETS, step_cost

E = 8


def act(*hot, cold=0.0, layers=2):
    """A request's per-step expert probabilities: 1 on ``hot`` experts, ``cold`` elsewhere."""
    row = np.full(E, cold)
    row[list(hot)] = 1.0
    return np.tile(row, layers)


def test_default_cost_is_the_simulators_for_qwen3_30b_on_mi300x():
    want = step_cost(PARAM_SETS["qwen3-30b-a3b-mi300x"], published_layers=2)
    got = StepCost()
    for f in ("base_s", "per_seq_s", "per_expert_s"):
        assert getattr(got, f) == pytest.approx(getattr(want, f), rel=1e-3), f


def test_spreads_when_idle_groups_when_busy():
    pol = StateAwarePolicy(3)
    tokens = []
    for i, hot in enumerate([(0, 1), (2, 3), (4, 5)]):  # idle servers: the cheapest is an empty one
        req = RouteRequest(activation=act(*hot))
        loads = [len([t for t in tokens if t[0] == s]) for s in range(3)]
        s = pol.choose(req, loads)
        assert s == i
        tokens.append((s, pol.admit(s, req)))
    # every server busy with one request: a request like server 1's joins server 1
    assert pol.choose(RouteRequest(activation=act(2, 3)), [1, 1, 1]) == 1
    assert pol.choose(RouteRequest(activation=act(5, 4)), [1, 1, 1]) == 2
    # ... unless that server is much more loaded
    assert pol.choose(RouteRequest(activation=act(2, 3)), [1, 40, 1]) in (0, 2)
    # release restores the idle state exactly
    for _, t in tokens:
        pol.release(t)
    assert np.all(pol.free == 1.0) and [s.live for s in pol.servers] == [0, 0, 0]


def test_score_is_the_increase_of_total_token_time():
    c = StepCost(base_s=1.0, per_seq_s=0.1, per_expert_s=0.01, max_batch=4)
    pol = StateAwarePolicy(2, cost=c)
    t = pol.admit(0, RouteRequest(activation=act(0, 1)))
    sc = pol.scores(RouteRequest(activation=act(0, 2)), [1, 0])
    # server 0: B=1, U=4 (2 layers x 2 experts), dU=2 (expert 2 on both layers)
    t0, t1 = 1.0 + 0.1 + 0.04, 1.0 + 0.2 + 0.06
    assert sc[0] == pytest.approx(2 * t1 - t0)
    assert sc[1] == pytest.approx(1.0 + 0.1 + 0.04)  # empty: dU = 4
    full = pol.scores(RouteRequest(activation=act(0, 2)), [4, 0])
    t0, t1 = 1.0 + 0.4 + 0.04, 1.0 + 0.5 + 0.06
    assert full[0] == pytest.approx(5 * t1 - 4 * t0 + t1)  # a full batch: the request waits a step
    pol.release(t)


def test_allowed_mask_membership_and_no_activation():
    pol = make_policy("state_aware", 3)
    assert policy_spec("cost").name == "state_aware" and not policy_spec("state_aware").needs_artifact
    req = RouteRequest(activation=act(0))
    assert pol.choose(req, [0, 0, 0], [False, True, True]) == 1
    tok = pol.admit(2, req)
    pol.remove_server(0)  # server 2 is now index 1; its live request is kept
    assert pol.describe()["live"] == [0, 1]
    pol.add_server()
    assert pol.free.shape == (3, 2 * E)
    pol.release(tok)
    assert pol.describe()["live"] == [0, 0, 0]
    assert pol.choose(RouteRequest(), [3, 1, 2]) == 1  # no activation: fewest in flight


def test_simulator_runs_it_and_it_groups_experts(tmp_path):
    from eldr_sglang.core.synthetic import make_synthetic_traces
    from eldr_sglang.sim.calibration import prefill_activations
    from eldr_sglang.sim.simulator import SimConfig, simulate
    from eldr_sglang.sim.workload import build_workload

    traces = make_synthetic_traces(600, include_gates=False, seed=0, num_layers=4, num_experts=32, top_k=4,
                                   n_informative=2, task_strength=2.0, language_strength=0.5).traces
    wl = build_workload(traces, "task", "task")
    acts = prefill_activations(traces, [0, 1, 2, 3])
    cfg = SimConfig(num_prefill=2, num_decode=4, rate=40.0, warmup_s=2.0, measure_s=10.0, seed=1)
    pol = make_policy("state_aware", 4)
    res = simulate(wl, pol, cfg, activations=acts)
    rr = simulate(wl, make_policy("round_robin", 4), cfg)
    assert res.summary["conserved"] and res.summary["policy"] == "state_aware"
    assert all(s.live == 0 for s in pol.servers)  # every admit was released
    assert res.summary["unique_experts_per_step"] < rr.summary["unique_experts_per_step"]


async def test_router_routes_by_live_batches_without_an_artifact():
    from eldr_sglang.router import Router, start_router
    from eldr_sglang.testing.stub_worker import StubWorker
    from tests.integration.helpers import BOOT_PORT, post, until

    prefill = StubWorker("prefill", name="p0")
    decodes = [StubWorker("decode", name=f"d{i}", hang=True) for i in range(3)]
    purl = await prefill.start()
    durls = [await d.start() for d in decodes]
    router = Router([(purl, BOOT_PORT)], durls, "state_aware", signature_port=0,
                    health_interval=0, load_interval=0)
    runner, port = await start_router(router)
    url = f"http://127.0.0.1:{port}"
    import aiohttp
    http = aiohttp.ClientSession()
    try:
        held = []
        for topic in (0, 1, 2):  # idle servers: one each
            held.append(asyncio.ensure_future(post(http, f"{url}/generate", {"text": f"topic:{topic} a b"})))
            await until(lambda: sum(len(d.requests) for d in decodes) >= len(held), 10, "the request on a server")
        assert [len(d.requests) for d in decodes] == [1, 1, 1]
        where = {d.requests[0]["text"].split()[0]: i for i, d in enumerate(decodes)}
        held.append(asyncio.ensure_future(post(http, f"{url}/generate", {"text": "topic:1 c d"})))
        await until(lambda: sum(len(d.requests) for d in decodes) >= 4, 10, "the fourth request on a server")
        assert len(decodes[where["topic:1"]].requests) == 2  # joined the batch using its experts
        assert router.metrics.value("fallbacks") == 0
        live = router.policy.describe()["live"]
        assert sum(live) == 4 and live[where["topic:1"]] == 2
        for d in decodes:
            d.hang = False
        for rid in [r["rid"] for d in decodes for r in d.requests]:
            await http.post(f"{durls[0]}/abort_request", data=orjson.dumps({"rid": rid}))
        for h in held:
            h.cancel()
        await until(lambda: not sum(router.policy.describe()["live"]), 10, "every live request released")
    finally:
        await http.close()
        await runner.cleanup()
        for w in [prefill] + decodes:
            await w.stop()
