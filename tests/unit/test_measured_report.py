"""The MEASURED sections of benchmark/RESULTS.md come from the committed traces and results."""

import json

from tests.helpers import ROOT, load_script


def load_measured():
    return load_script("benchmark/measured.py", "eldr_measured")


def test_trace_section_is_computed_from_the_traces(tmp_path):
    measured = load_measured()
    lines = measured.trace_section(ROOT / "benchmark" / "traces", ["task"])
    (row,) = [line for line in lines if line.startswith("| task |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "1000" and -1 <= float(cells[2]) <= 1
    assert "python -m eldr_sglang.analyze --traces benchmark/traces/task/eval" in cells[-1]
    assert measured.trace_section(tmp_path, ["task"]) == []  # no traces, no section


def test_real_cpu_section_reads_the_benchmark_json(tmp_path):
    measured = load_measured()
    run = {"router": "eldr-router/eldr", "completed": 8, "median_tpot_ms": 51.5, "p99_tpot_ms": 90.0,
           "median_ttft_ms": 300.0, "distinct_experts_per_step": 123.4, "decode_steps": 42.0}
    (tmp_path / "real_cpu.json").write_text(json.dumps({
        "command": "python benchmark/bench_real_cpu.py", "decodes": 3, "dataset": "d.jsonl", "num_prompts": 8,
        "output_len": 24, "request_rate": 4.0, "measured": "real servers", "runs": [run]}))
    text = "\n".join(measured.real_cpu_section(tmp_path))
    assert "| eldr-router/eldr | 8 | 51.5 | 90.0 | 300 | 123.4 | 42 |" in text
    assert measured.real_cpu_section(tmp_path / "none") == []
