"""The MEASURED sections of benchmark/RESULTS.md come from the committed traces and results."""

import json

from benchmark import bench_real_cpu as bench
from benchmark import measured
from tests.helpers import ROOT


def test_trace_section_is_computed_from_the_traces(tmp_path):
    lines = measured.trace_section(ROOT / "benchmark" / "traces", ["task"])
    (row,) = [line for line in lines if line.startswith("| task |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "1000" and -1 <= float(cells[2]) <= 1
    assert "python -m eldr_sglang.analyze --traces benchmark/traces/task/eval" in cells[-1]
    assert measured.trace_section(tmp_path, ["task"]) == []  # no traces, no section


def test_real_cpu_section_reads_the_benchmark_json(tmp_path):
    # two rounds of two paths; every step: [batch size, distinct experts, forward ms]
    rows = []
    for rnd in range(2):
        for name, extra in (("eldr-router/round_robin", 0), ("eldr-router/eldr", -10)):
            steps = [[b, 40 + 10 * b + extra, 5.0 + 2.0 * b + 0.1 * (40 + 10 * b + extra)] for b in (1, 2, 3) * 5]
            rows.append({"router": name, "round": rnd, "completed": 8, "median_ttft_ms": 300.0 + rnd,
                         "p99_ttft_ms": 400.0, "median_tpot_ms": 50.0 + rnd, "p99_tpot_ms": 90.0,
                         "output_throughput": 7.0, "distinct_experts_per_step": 60.0 + extra, "mean_batch": 2.0,
                         "token_max_over_mean": 1.1, "steps": steps})
    base = "eldr-router/round_robin"
    result = {"command": "python -m benchmark.bench_real_cpu", "decodes": 3, "dataset": "d.jsonl", "num_prompts": 8,
              "output_len": 24, "request_rate": 4.0, "repeats": 2, "measured": "real servers",
              "summary": bench.summarise(rows), "equal_batch_base": base, "equal_batch": bench.equal_batch(rows, base),
              "step_time_fit": bench.step_time_fit(rows), "runs": rows}
    (tmp_path / "real_cpu.json").write_text(json.dumps(result))
    text = "\n".join(measured.real_cpu_section(tmp_path))
    assert "| eldr-router/eldr | 50 (50-51) | 90 (90-90) | 300 (300-301) | 7.0 (7.0-7.0) | 50.0 (50.0-50.0) |" in text
    eb = result["equal_batch"]["vs_eldr-router_round_robin"]
    # 10 fewer experts at every batch size: at b=1,2,3 against 50,60,70 -> mean of -20%, -16.7%, -14.3%
    assert abs(eb["eldr-router/eldr"] - 100 * (-10 / 50 - 10 / 60 - 10 / 70) / 3) < 1e-9
    fit = result["step_time_fit"]
    assert abs(fit["ms_per_sequence"] - 2.0) < 1e-6 and abs(fit["ms_per_distinct_expert"] - 0.1) < 1e-6
    assert "2.00 ms per sequence" in text
    assert measured.real_cpu_section(tmp_path / "none") == []


def test_specialisation_section_lists_each_model_per_layer(tmp_path):
    for name, n in (("a", 2), ("b", 3)):
        (tmp_path / name).mkdir()
        res = {k: {"accuracy_language": 0.5, "accuracy_domain": 0.4, "accuracy_cell": 0.3, "eval_docs": 10,
                   "prefill_decode_pearson": 0.7, "per_layer": {"language": [0.1] * n, "domain": [0.2] * n}}
               for k in ("trained", "untrained")}
        res.update(command=f"python -m tools.routing_specialisation --model {name}",
                   chance={"language": 0.25, "domain": 0.2, "cell": 0.1})
        (tmp_path / name / "specialisation.json").write_text(json.dumps(res))
    text = "\n".join(measured.specialisation_section([tmp_path / "a", tmp_path / "b"]))
    assert "| a | 2 | language | 0.500 | 0.500 | 0.250 |" in text and "| b | 3 | domain |" in text
    assert "| b | language | 0.10 / 0.10 | 0.10 / 0.10 | 0.10 / 0.10 |" in text
    assert "| L0 | L1 | L2 |" in text


def test_real_cpu_core_lists_are_checked_before_anything_starts(capsys):
    import pytest

    assert bench.cpu_list_ok("0", 2) and bench.cpu_list_ok("0-1", 2) and bench.cpu_list_ok("1,0", 2)
    for bad in ("2", "1-0", "a", "", "0,,1", "-1"):
        assert not bench.cpu_list_ok(bad, 2), bad
    with pytest.raises(SystemExit):
        bench.parse_args(["--decode-cpus", "0", "99"])
    assert "--decode-cpus: '99'" in capsys.readouterr().err


def test_fat_pd_reading_says_when_the_fit_does_not_explain_step_time():
    runs = [{"router": "a", "steps": [[1, 10, 100.0], [2, 20, 300.0]]}, {"router": "b", "steps": [[1, 10, None]]}]
    low = measured.forward_time_reading({"runs": runs, "step_time_fit": {"r2": 0.06}})
    assert low[0] == "Decode forward time per step, all rounds: a mean 200 ms, P99 100 ms."
    assert "R^2 0.06" in low[1] and "cannot be credited to expert locality" in low[1]
    assert len(measured.forward_time_reading({"runs": runs, "step_time_fit": {"r2": 0.9}})) == 1
    assert measured.forward_time_reading({"runs": [], "step_time_fit": None}) == []
