"""Replaying recorded per-step expert sets in the simulator (simulated) and reading them."""

import numpy as np
import pytest

from eldr_sglang.core.policies import make_policy
from eldr_sglang.core.traces import ModelSpec, TraceSet, write_traces
from eldr_sglang.sim.simulator import SimConfig, simulate
from eldr_sglang.sim.workload import STEPS_FILE, build_workload, load_step_experts

L, E, K, T = 2, 16, 2, 40
SCALE = 128 / E  # the default cost model maps trace experts onto 128


def traces(n: int, output_tokens: int = T + 1) -> TraceSet:
    """Decode counts that say: experts 0-3, each in half of the steps (p = 1/2)."""
    decode = np.zeros((n, L, E), dtype=np.int32)
    decode[:, :, :4] = T // 2
    return TraceSet(ModelSpec("t", L, E, K), np.array([f"r{i}" for i in range(n)]), decode.copy(), decode,
                    np.full(n, 8), np.full(n, output_tokens), {"task": np.full(n, "a")})


def test_replay_takes_the_true_union_where_independence_overcounts():
    """Every recorded step of every request is {0, 1}: the true union is 2 experts per layer
    whatever the batch; independence (p = 1/2 on four experts) expects almost 4 in a big batch."""
    tr = traces(8)
    steps = np.zeros((8, T, L, K), dtype=np.uint8)
    steps[..., 1] = 1
    cfg = SimConfig(num_prefill=1, num_decode=1, rate=2000.0, warmup_s=0.0, measure_s=0.02,
                    prefill_fixed_s=0.0, prefill_s_per_token=0.0, seed=0)
    indep = simulate(build_workload(tr, "task"), make_policy("round_robin", 1), cfg).summary
    replay = simulate(build_workload(tr, "task", step_experts=steps), make_policy("round_robin", 1), cfg).summary
    assert replay["mean_batch"] > 4 and replay["conserved"]
    assert replay["unique_experts_per_step"] == pytest.approx(K * SCALE)
    assert indep["unique_experts_per_step"] > 1.3 * K * SCALE
    assert replay["tpot_median_ms"] < indep["tpot_median_ms"]


def test_replay_starts_each_request_at_its_own_first_step():
    """Step 0 of every request repeats one expert ([0, 0]: 1 distinct), later steps use {2, 3}.
    Requests never share a server (round robin over 16, sparse arrivals), and each decodes
    T/2 steps: exactly one 1-expert step per request only if the replay counts steps from
    the request's own join (a server-global index would hit step 0 in about half of them)."""
    n_steps = T // 2
    tr = traces(4, output_tokens=n_steps + 1)
    steps = np.full((4, T, L, K), [2, 3], dtype=np.uint8)
    steps[:, 0] = 0
    cfg = SimConfig(num_prefill=1, num_decode=16, rate=2.0, warmup_s=0.0, measure_s=20.0,
                    prefill_fixed_s=0.0, prefill_s_per_token=0.0, seed=3)
    s = simulate(build_workload(tr, "task", step_experts=steps), make_policy("round_robin", 16), cfg).summary
    assert s["mean_batch"] == 1.0
    assert s["unique_experts_per_step"] == pytest.approx((1 + 2 * (n_steps - 1)) / n_steps * SCALE)


def test_step_sets_are_read_in_trace_order_and_checked(tmp_path):
    tr = traces(3)
    steps = np.zeros((3, T, L, K), dtype=np.uint8)
    steps[1, 0, 0] = [5, 6]  # mark row r1
    write_traces(tr, tmp_path)
    np.savez_compressed(tmp_path / STEPS_FILE, experts=steps[::-1], request_id=np.array(["r2", "r1", "r0"]))
    got = load_step_experts(tmp_path, tr)
    assert (got[1, 0, 0] == [5, 6]).all() and (got[0] == steps[0]).all()
    np.savez_compressed(tmp_path / STEPS_FILE, experts=steps[:2], request_id=np.array(["r0", "r1"]))
    with pytest.raises(ValueError, match="no step sets for 1"):
        load_step_experts(tmp_path, tr)
    np.savez_compressed(tmp_path / STEPS_FILE, experts=steps[:, :, :1], request_id=np.array(["r0", "r1", "r2"]))
    with pytest.raises(ValueError, match="shape"):
        load_step_experts(tmp_path, tr)
    (tmp_path / STEPS_FILE).unlink()
    assert load_step_experts(tmp_path, tr) is None
