"""The step-time law from recorded decode steps, kept in the calibration artifact
(``eldr-calibrate --step-law``) and priced with by the router's cost-aware policies
until its own engine reports fit one; ``--policy-param`` still wins."""

import json

import numpy as np
import pytest

from eldr_sglang.core import load_artifact, make_synthetic_traces, write_traces
from eldr_sglang.core.step_law import ARTIFACT_KEY, artifact_cost_params, samples_from_step_records
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.pool.workers import WorkerPool
from eldr_sglang.router.state.routing import RoutingState

LAYERS = 10
TRUE = {"base_s": 0.004, "per_seq_s": 0.0005, "per_expert_s": 0.0001}


def trace_steps(n: int = 400, seed: int = 0) -> list[dict]:
    """Trace mode's step lines from a known law (per-layer distinct experts, forward_ms), with noise."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = int(rng.integers(1, 17))
        per_layer = rng.integers(4 * min(b, 4), 32, LAYERS).tolist()
        t = TRUE["base_s"] + TRUE["per_seq_s"] * b + TRUE["per_expert_s"] * sum(per_layer)
        out.append({"batch_size": b, "unique_per_layer": per_layer,
                    "forward_ms": round(1e3 * t * float(rng.normal(1.0, 0.01)), 3)})
    return out


def test_trace_lines_and_engine_samples_become_law_samples():
    got = samples_from_step_records([{"batch_size": 2, "unique_per_layer": [3, 4], "forward_ms": 5.0},
                                     {"batch_size": 1, "unique_experts": 7, "seconds": 0.004}])
    assert got[0] == {"batch_size": 2, "unique_experts": 7.0, "kv_tokens": 0, "seconds": 0.005}
    assert got[1]["seconds"] == 0.004
    with pytest.raises(ValueError, match="step record 1: needs"):
        samples_from_step_records([got[0], {"batch_size": 3, "forward_ms": 2.0}])


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    syn = make_synthetic_traces(300, num_layers=LAYERS, num_experts=32, top_k=4, n_informative=3, seed=4)
    out = tmp_path_factory.mktemp("traces")
    write_traces(syn.traces, out, shard_size=400)
    return out


def test_calibrate_keeps_the_fitted_law_and_the_policy_cost(traces, tmp_path, capsys):
    from eldr_sglang.calibrate import main

    steps = tmp_path / "steps-1.jsonl"
    steps.write_text("".join(json.dumps(r) + "\n" for r in trace_steps()))
    out = tmp_path / "a.json"
    assert main(["--traces", str(traces), "--clusters", "2", "--layers", "1,5", "--out", str(out),
                 "--step-law", str(steps)]) == 0
    assert "step law from 400 steps" in capsys.readouterr().out
    entry = load_artifact(out).extra[ARTIFACT_KEY]
    law = entry["law"]
    for name, value in TRUE.items():
        assert law[name] == pytest.approx(value, rel=0.1), name
    assert entry["expert_factor"] == LAYERS / 2  # the engine counts 10 layers, the policy the 2 published
    cost = artifact_cost_params(load_artifact(out).extra)
    assert cost["per_expert_s"] == pytest.approx(law["per_expert_s"] * LAYERS / 2)
    assert cost["base_s"] == pytest.approx(law["base_s"])


@pytest.mark.parametrize("records, message", [
    ([{"batch_size": 1, "unique_per_layer": [1], "forward_ms": 1.0}] * 3, "3 usable decode steps, the fit needs 16"),
    ([{"batch_size": 1}], "step record 0: needs"),
])
def test_calibrate_refuses_unusable_step_records(traces, tmp_path, capsys, records, message):
    from eldr_sglang.calibrate import main

    steps = tmp_path / "steps.jsonl"
    steps.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(SystemExit) as info:
        main(["--traces", str(traces), "--clusters", "2", "--layers", "1,5", "--out", str(tmp_path / "a.json"),
              "--step-law", str(steps)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--step-law" in err and message in err, err


def test_a_saved_engine_answer_is_read_too(tmp_path):
    from eldr_sglang.calibrate import read_step_records

    saved = tmp_path / "batch.json"
    saved.write_text(json.dumps({"steps": 3, "samples": [{"batch_size": 1, "unique_experts": 4, "seconds": 0.01}]},
                                indent=2))
    assert read_step_records([str(saved)]) == [{"batch_size": 1, "unique_experts": 4, "seconds": 0.01}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"batch_size": 1}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_step_records([str(bad)])


def _routing(artifact, **settings):
    config = RouterConfig.from_dict({"policy": "eldr_balanced", **settings})
    metrics = RouterMetrics()
    pool = WorkerPool([("http://127.0.0.1:9", None)], ["http://127.0.0.1:10", "http://127.0.0.1:11"], config, metrics)
    return RoutingState(config, pool, metrics, artifact).routing


def test_the_router_prices_with_the_artifacts_law_under_policy_params():
    from eldr_sglang.testing.toy_artifact import toy_calibration_artifact

    art = toy_calibration_artifact(2)
    plain = _routing(art).policy.cost
    art.extra[ARTIFACT_KEY] = {"law": {}, "policy_cost": {"base_s": 0.01, "per_seq_s": 0.002, "per_expert_s": 0.0003}}
    priced = _routing(art).policy.cost
    assert (priced.base_s, priced.per_seq_s, priced.per_expert_s) == (0.01, 0.002, 0.0003)
    assert plain.per_expert_s != priced.per_expert_s  # the default law before
    given = _routing(art, policy_param=("per_expert_s=0.005",)).policy.cost
    assert given.per_expert_s == 0.005 and given.base_s == 0.01
