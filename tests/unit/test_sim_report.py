"""benchmark/report.py (simulated evaluation report) on its tiny configuration."""

import json

import pytest

from tests.helpers import load_script


def load_report():
    return load_script("benchmark/report.py", "eldr_report")


def test_quick_report_writes_results_and_plots(tmp_path):
    report = load_report()
    rc = report.main(["--quick", "--workloads", "task", "--out-dir", str(tmp_path),
                      "--traces-root", str(tmp_path / "no-traces"), "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "SIMULATED" in text and "SYNTHETIC traces" in text
    assert "benchmark/report.py --quick" in text
    assert "| 8 | eldr |" in text and "oracle" in text
    assert "MEASURED" in text and "linear fit" in text
    for png in ("tpot_vs_load.png", "unique_experts.png", "tau_sweep.png", "pool_scaling.png"):
        assert (tmp_path / "results" / png).stat().st_size > 1000
    runs = json.loads((tmp_path / "results" / "runs.json").read_text())
    assert runs["simulated"] is True
    assert all(r["conserved"] for r in runs["runs"])
    assert {r["policy"] for r in runs["runs"]} >= {"random", "round_robin", "jsq", "p2c", "domain", "eldr", "oracle"}


@pytest.mark.parametrize("argv, flag", [
    (["--cost", "nope"], "--cost"),
    (["--workloads", "chess"], "--workloads"),
    (["--seeds", "0"], "--seeds"),
    (["--mean-output-tokens", "-1"], "--mean-output-tokens"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    report = load_report()
    with pytest.raises(SystemExit) as exc:
        report.main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
