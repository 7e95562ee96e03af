"""benchmark/common.py: the furniture every benchmark script shares."""

import argparse
import json
import socket

import pytest

from benchmark import common


def test_mean_sd_is_the_sample_sd_and_zero_for_one_value():
    assert common.mean_sd([1.0, 2.0, 4.0]) == pytest.approx((7 / 3, 1.5275252316519468))
    assert common.mean_sd([5.0]) == (5.0, 0.0)
    with pytest.raises(ValueError):
        common.mean_sd([])
    assert common.fmt_mean_sd([0.1, 0.3], digits=0, scale=100) == "20 ± 14"


def test_markdown_table_and_a_ragged_row():
    assert common.markdown_table(["a", "b"], [[1, "x"], [2.5, None]]) == (
        "| a | b |\n|---|---|\n| 1 | x |\n| 2.5 | None |")
    with pytest.raises(ValueError, match="row of 1 cells under 2 headers"):
        common.markdown_table(["a", "b"], [[1]])


def test_write_record_puts_command_time_and_machine_first(tmp_path):
    path = tmp_path / "sub" / "r.json"
    common.write_record(path, {"rows": [1], "recorded_at": "old"}, ["--seeds", "2", "a b"], script="bench_x.py")
    doc = json.loads(path.read_text())
    assert list(doc)[:3] == ["command", "recorded_at", "machine"] and doc["rows"] == [1]
    assert doc["command"] == "python -m benchmark.bench_x --seeds 2 'a b'" and doc["recorded_at"] != "old"
    assert doc["machine"]["cpus"] >= 1
    common.write_record(path, {"command": "python -m benchmark.bench_y", "x": path})
    doc = json.loads(path.read_text())
    assert doc["command"] == "python -m benchmark.bench_y" and doc["x"] == str(path)
    assert not list(tmp_path.glob("sub/*.tmp"))


def test_parse_with_quick_sets_defaults_that_explicit_flags_beat():
    def parser():
        ap = argparse.ArgumentParser()
        ap.add_argument("--seeds", type=int, default=5)
        ap.add_argument("--rate", type=float, default=80.0)
        return ap
    assert vars(common.parse_with_quick(parser(), [], seeds=1)) == {"seeds": 5, "rate": 80.0, "quick": False}
    assert vars(common.parse_with_quick(parser(), ["--quick"], seeds=1)) == {"seeds": 1, "rate": 80.0, "quick": True}
    assert common.parse_with_quick(parser(), ["--quick", "--seeds", "3"], seeds=1).seeds == 3


def test_timing_and_a_free_port():
    with common.Stopwatch() as t:
        sum(range(10000))
    assert t.seconds > 0 and t.cpu_seconds >= 0
    calls = []
    assert common.seconds_per_call(lambda: calls.append(1), 7) >= 0 and len(calls) == 7
    with socket.socket() as s:
        s.bind(("127.0.0.1", common.free_port()))
