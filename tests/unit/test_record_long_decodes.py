"""tools/record_long_decodes.py on the tiny fixture model (transformers, CPU, seconds)."""

import json

import numpy as np
import pytest

from eldr_sglang.core.step_sets import load_step_experts
from eldr_sglang.core.traces import load_traces
from tools import record_long_decodes

PROMPTS = ["def add(a, b):\n    return a + b\n", "The patient was given", "Article 3. The contract",
           "Integrate x squared from zero to one"]


@pytest.fixture(scope="module")
def tool():
    return record_long_decodes


def record(tool, model, tmp_path, batch: int) -> tuple:
    wl = tmp_path / "wl"
    (wl / "task").mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"r{i}", "prompt": p, "labels": {"domain": f"d{i % 2}", "language": "en"}}
            for i, p in enumerate(PROMPTS)]
    (wl / "task" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"out-b{batch}"
    assert tool.main(["--model", str(model), "--workloads", str(wl), "--sets", "task/eval", "--limit", "4",
                      "--decode-steps", "6", "--batch", str(batch), "--out", str(out)]) == 0
    traces = load_traces(out / "task" / "eval")
    return traces, load_step_experts(out / "task" / "eval", traces), out


def test_recorded_steps_match_the_counts_and_padding_changes_nothing(tool, fixture_model, tmp_path):
    traces, steps, out = record(tool, fixture_model, tmp_path, batch=4)  # prompts of different lengths: padded
    m = traces.model
    assert steps.shape == (4, 6, m.num_layers, m.top_k)
    assert list(traces.request_ids) == ["r0", "r1", "r2", "r3"] and traces.labels["domain"][1] == "d1"
    for r in range(4):  # decode counts are the recorded steps; prefill counts cover every prompt token
        for layer in range(m.num_layers):
            assert (np.bincount(steps[r, :, layer].ravel(), minlength=m.num_experts)
                    == traces.decode_counts[r, layer]).all()
        assert (traces.prefill_counts[r].sum(axis=1) == traces.prompt_tokens[r] * m.top_k).all()
        assert (np.sort(steps[r], axis=-1)[:, :, 1:] != np.sort(steps[r], axis=-1)[:, :, :-1]).all()  # distinct top-k
    alone, steps1, _ = record(tool, fixture_model, tmp_path, batch=1)
    assert (np.sort(steps1, -1) == np.sort(steps, -1)).all()
    assert (alone.prefill_counts == traces.prefill_counts).all()
    rep = json.loads((out / "task" / "eval" / "repetition.json").read_text())
    assert rep["requests"] == 4 and 0.0 <= rep["repeated_4gram_share_mean"] <= 1.0


def test_repetition_measures(tool):
    assert tool.repeated_ngram_share([1, 2, 3, 4, 5, 6]) == 0.0
    assert tool.repeated_ngram_share([7, 8] * 10) == pytest.approx(15 / 17)
    assert tool.ends_in_loop(list(range(50)) + [1, 2, 3] * 30) and not tool.ends_in_loop(list(range(100)))
