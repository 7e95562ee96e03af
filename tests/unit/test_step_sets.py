"""Per-step expert sets: analyze's per-step measure is exact where they were recorded."""

import json

import numpy as np
import pytest

from eldr_sglang.analyze import main as analyze_main
from eldr_sglang.core.step_sets import STEPS_FILE, independent_distinct, load_step_experts, true_distinct
from eldr_sglang.core.traces import ModelSpec, TraceSet, write_traces

L, E, K, T = 2, 16, 2, 10


def two_label_traces(n: int = 40) -> tuple[TraceSet, np.ndarray]:
    """Label a always uses experts {0, 1}, label b {2, 3}, at every step; the counts
    (what a trace without step sets holds) only say "each of 0-3 in half the steps"."""
    labels = np.array(["a", "b"] * (n // 2))
    steps = np.zeros((n, T, L, K), dtype=np.uint8)
    steps[labels == "a"] = [0, 1]
    steps[labels == "b"] = [2, 3]
    decode = np.zeros((n, L, E), dtype=np.int32)
    decode[:, :, :4] = T // 2
    tr = TraceSet(ModelSpec("t", L, E, K), np.array([f"r{i}" for i in range(n)]), decode.copy(), decode,
                  np.full(n, 8), np.full(n, T + 1), {"domain": labels})
    return tr, steps


def test_true_union_and_independence_estimate():
    tr, steps = two_label_traces()
    rows = np.array([0, 2, 4, 6])  # all label a
    assert true_distinct(steps, rows, np.array([0, 3, 5, 9]), E).tolist() == [2, 2]
    p = np.full((len(tr), L, E), 0.0)
    p[:, :, :4] = 0.5
    assert np.allclose(independent_distinct(p, rows), 4 * (1 - 0.5 ** 4))


def test_analyze_per_step_measure_uses_recorded_sets(tmp_path):
    tr, steps = two_label_traces()
    write_traces(tr, tmp_path / "t")
    out = tmp_path / "r.json"
    assert analyze_main(["--traces", str(tmp_path / "t"), "--batch-size", "4", "--batches", "20",
                         "--pairs", "200", "--json", str(out)]) == 0
    est = json.loads(out.read_text())["locality"]["domain"]["per_step"]
    assert est["source"].startswith("estimated") and est["same_label"] > 3.5  # independence: 4 (1 - 1/16)
    np.savez_compressed(tmp_path / "t" / STEPS_FILE, experts=steps, request_id=tr.request_ids)
    assert analyze_main(["--traces", str(tmp_path / "t"), "--batch-size", "4", "--batches", "20",
                         "--pairs", "200", "--json", str(out)]) == 0
    exact = json.loads(out.read_text())["locality"]["domain"]["per_step"]
    assert exact["source"] == "recorded per-step sets"
    assert exact["same_label"] == 2.0 and exact["mixed"] > 2.0 and exact["reduction"] > 0.2


@pytest.mark.parametrize("name", ["task/eval", "language/eval"])
def test_committed_long_decodes_are_consistent(name):
    """benchmark/traces-long: every recorded step has top_k distinct experts per layer and the
    decode counts are exactly the recorded steps; the calibration split of the same model exists."""
    from eldr_sglang.core.traces import load_traces
    from tests.helpers import ROOT

    path = ROOT / "benchmark" / "traces-long" / name
    traces = load_traces(path)
    steps = load_step_experts(path, traces)
    m = traces.model
    assert steps.shape[0] == len(traces) >= 200 and steps.shape[1] >= 256 and steps.shape[2:] == (m.num_layers, m.top_k)
    assert m.num_layers >= 12 and m.num_experts == 128 and m.top_k == 8
    s = np.sort(steps[:20], axis=-1)
    assert (s[..., 1:] != s[..., :-1]).all()
    counts = np.zeros((20, m.num_layers, m.num_experts), dtype=np.int64)
    for r in range(20):
        for layer in range(m.num_layers):
            counts[r, layer] = np.bincount(steps[r, :, layer].ravel(), minlength=m.num_experts)
    assert (counts == traces.decode_counts[:20]).all()
    calib = load_traces(ROOT / "benchmark" / "traces-12l" / name.replace("eval", "calib"))
    assert calib.model.num_layers == m.num_layers and len(calib) >= 500
