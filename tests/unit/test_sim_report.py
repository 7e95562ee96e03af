"""benchmark/report.py (simulated evaluation report) on its tiny configuration."""

import json

import pytest

from benchmark import bench_default_policy, report, rules


def test_quick_report_writes_results_and_plots(tmp_path):
    rc = report.main(["--quick", "--workloads", "task", "--out-dir", str(tmp_path),
                      "--traces-root", str(tmp_path / "no-traces"), "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "SIMULATED" in text and "SYNTHETIC traces" in text
    assert "-m benchmark.report --quick" in text
    assert "| 8 | eldr |" in text and "oracle" in text
    assert "MEASURED" in text and "linear fit" in text
    assert "## Goodput up to saturation (simulated)" in text and "| task | eldr |" in text
    for png in ("tpot_vs_load.png", "unique_experts.png", "tau_sweep.png", "pool_scaling.png"):
        assert (tmp_path / "results" / png).stat().st_size > 1000
    runs = json.loads((tmp_path / "results" / "runs.json").read_text())
    assert runs["simulated"] is True
    assert all(r["conserved"] for r in runs["runs"])
    assert {r["policy"] for r in runs["runs"]} >= {"random", "round_robin", "jsq", "p2c", "domain", "eldr", "oracle"}
    assert {r["experiment"] for r in runs["runs"]} >= {"load", "goodput"}


def test_seeds_vary_calibration_and_arrivals_and_spread_is_reported(tmp_path):
    rc = report.main(["--quick", "--workloads", "task", "--seeds", "2", "--jobs", "2", "--skip-microbench",
                      "--out-dir", str(tmp_path), "--traces-root", str(tmp_path / "no-traces"),
                      "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    runs = json.loads((tmp_path / "results" / "runs.json").read_text())
    assert {r["seed"] for r in runs["runs"]} == {0, 1}
    assert sorted(p.name for p in (tmp_path / "work" / "artifacts").glob("task-K4-seed*.json")) == \
        ["task-K4-seed0.json", "task-K4-seed1.json"]
    a, b = ((tmp_path / "work" / "artifacts" / f"task-K4-seed{s}.json").read_text() for s in (0, 1))
    assert a != b  # each seed calibrates anew
    text = (tmp_path / "RESULTS.md").read_text()
    assert "mean ± sd over seeds" in text and " ± " in text.split("## TPOT vs load")[1]


def test_goodput_is_the_first_crossing_of_the_p99_target():
    rows = [{"rate": r, "tpot_p99_ms": t} for r, t in ((10, 5.0), (20, 8.0), (30, 12.0), (40, 9.0))]
    assert rules.goodput_of(rows, 10.0) == (25.0, "")  # 8 -> 12 crosses 10 halfway
    assert rules.goodput_of(rows, 20.0) == (40, ">=")
    assert rules.goodput_of(rows, 4.0) == (10, "<")


@pytest.mark.parametrize("argv, flag", [
    (["--cost", "nope"], "--cost"),
    (["--workloads", "chess"], "--workloads"),
    (["--seeds", "0"], "--seeds"),
    (["--mean-output-tokens", "-1"], "--mean-output-tokens"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        report.main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_default_policy_benchmark_quick_applies_every_rule(tmp_path):
    """bench_default_policy --quick: every rule of the decision rule is checked on real
    simulated runs, and a planted regression (a candidate slower than round robin) fails rule 1."""
    bdp = bench_default_policy
    assert bdp.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "default_policy.json").read_text())
    assert {c["rule"] for c in doc["decision"]["checks"]} == {1, 2, 3, 4, 5}
    assert "## Verdict" in (tmp_path / "default_policy.md").read_text()
    slow = [dict(r, tpot_median_ms=r["tpot_median_ms"] * 2) if r["policy"] == bdp.CANDIDATE else r
            for r in doc["runs"]]
    dec = bdp.decide(slow, doc["grid"], doc["grid"]["workloads"])
    assert not dec["default"] and any(c["rule"] == 1 for c in dec["failed"])
