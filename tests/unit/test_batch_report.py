"""The decode batch report an engine serves for the router's load poll: the usage EMA
follows the steps' active experts, samples come back oldest first with their batch,
distinct experts, KV tokens and time, and the engine's metrics port serves it as JSON
beside /metrics."""

import json
import math
import socket
import urllib.request
from types import SimpleNamespace

import pytest
import torch

from eldr_sglang.patches.batch_report import BatchReport
from eldr_sglang.patches.metrics import serve_metrics


def steps(report: BatchReport, actives: list[list[list[bool]]], batch: int = 3) -> None:
    for i, a in enumerate(actives):
        active = torch.tensor(a)
        report.step(active, active.sum(), batch + i, 100 * (i + 1), report.timer())


def test_usage_is_the_ema_of_active_experts_and_samples_keep_order():
    r = BatchReport(2, 4, "cpu", window=3, decay=0.5)
    on = [[True, False, False, False], [False, True, False, False]]
    off = [[False] * 4, [False] * 4]
    steps(r, [on, on, off, on])
    snap = r.snapshot()
    # EMA with decay 0.5 of 1, 1, 0, 1 from 0: 0.5, 0.75, 0.375, 0.6875
    assert snap["usage"][0] == pytest.approx([0.6875, 0.0, 0.0, 0.0])
    assert snap["usage"][1] == pytest.approx([0.0, 0.6875, 0.0, 0.0])
    assert snap["steps"] == 4 and snap["batch_size"] == 6
    s = snap["samples"]
    assert [x["batch_size"] for x in s] == [4, 5, 6]  # the window keeps the last 3, oldest first
    assert [x["unique_experts"] for x in s] == [2, 0, 2] and [x["kv_tokens"] for x in s] == [200, 300, 400]
    assert all(x["seconds"] >= 0 and not math.isnan(x["seconds"]) for x in s)
    assert [x["batch_size"] for x in r.snapshot(last=1)["samples"]] == [6]


def test_the_engine_port_serves_the_report_beside_metrics():
    report = BatchReport(1, 2, "cpu")
    steps(report, [[[True, True]]])
    state = SimpleNamespace(decode=SimpleNamespace(steps=1, tokens=3, unique_total=None, report=report,
                                                   mean_unique_per_step=lambda: 2.0), publisher=None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = serve_metrics(state, port, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/eldr/batch", timeout=10) as resp:
            doc = json.loads(resp.read())
        assert doc["steps"] == 1 and doc["usage"] == [[pytest.approx(1 / 32), pytest.approx(1 / 32)]]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert b"eldr_decode_steps_total 1.0" in resp.read()
        state.decode.report = None  # a server without decode statistics
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/eldr/batch", timeout=10)
        assert e.value.code == 404
    finally:
        server.shutdown()
