"""A fast variant of ``make demo`` (2 decode servers, 32 requests), run first so no
other SGLang server shares the machine: each decode server gets requests, ELDR's
label mix per server is more concentrated than round robin's, nothing is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from eldr_sglang.demo import label_entropy
from tests.helpers import processes_marked

pytestmark = [pytest.mark.sglang, pytest.mark.exclusive]
ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 32
MARKER_VAR = "ELDR_TEST_DEMO_RUN"


def test_label_entropy_is_measured_not_assumed():
    from collections import Counter

    assert label_entropy({"a": Counter(x=4), "b": Counter(y=4)}) == 0.0
    assert label_entropy({"a": Counter(x=2, y=2), "b": Counter(x=2, y=2)}) == pytest.approx(1.0)
    assert label_entropy({"a": Counter(x=3, y=1), "b": Counter()}) == pytest.approx(0.8113, abs=1e-4)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    marker = uuid.uuid4().hex
    done = subprocess.run(
        [sys.executable, "-m", "eldr_sglang.demo", "--decodes", "2", "--requests", str(REQUESTS),
         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1500,
        env={**os.environ, "PYTHONUNBUFFERED": "1", MARKER_VAR: marker})
    left = processes_marked(MARKER_VAR, marker)
    return done, out, left


def test_fast_demo_runs_and_reports(demo_run):
    done, out, _ = demo_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for text in ("Verdict:", "label entropy/server", "does not stand for GPU latency", "All servers stopped."):
        assert text in done.stdout
    assert (out / "demo.png").stat().st_size > 10_000 and (out / "report.txt").is_file()


def test_fast_demo_eldr_concentrates_labels(demo_run):
    done, out, _ = demo_run
    report = json.loads((out / "report.json").read_text())
    rr, eldr = report["policies"]["round_robin"], report["policies"]["eldr"]
    for phase in (rr, eldr):
        got = {u: sum(m.values()) for u, m in phase["label_mix"].items()}
        assert len(got) == 2 and all(n > 0 for n in got.values()), got  # each decode server got requests
        assert sum(got.values()) == REQUESTS
        assert phase["latency"]["completed"] >= REQUESTS - 1, phase["latency"]
        assert all(s > 0 for s in phase["decode_steps"].values()), phase["decode_steps"]
    # the prefill server published every signature over the TCP stream, and the router used them
    assert eldr["router_counters"].get("signature_streams", 0) >= 1, eldr["router_counters"]
    assert eldr["router_counters"]["signatures_used"] >= REQUESTS, eldr["router_counters"]
    assert eldr["router_counters"].get("fallbacks", 0) == 0, eldr["router_counters"]
    assert eldr["label_entropy_bits"] < rr["label_entropy_bits"], (eldr["label_mix"], rr["label_mix"])


def test_fast_demo_default_policy_balances_and_groups(demo_run):
    """The default policy: every request served, signatures used, at most 1.25x the mean
    requests on a decode server, and whenever its rule left a choice (a cost band of both
    servers) the request went to the band's most similar region, judged on the router's own
    decision records (signature similarities of each server).

    How many requests go to their most similar region overall is reported, not asserted: at
    this load the default's cost decides most requests alone: one run sent 14 of 32 there
    (a signature-blind balancer: 16 on average), another 25 (11 decisions with a band of
    both servers, all to the more similar); the demo's 3-server runs 46% and 67% (README).
    A run whose bands never held both servers checks the balance only. Labels are not
    used: on 32 requests over 8 labels any policy's label entropy is within noise of round
    robin's."""
    done, out, _ = demo_run
    report = json.loads((out / "report.json").read_text())
    bal = report["policies"]["eldr_balanced"]
    assert sum(bal["requests_per_server"]) == REQUESTS and bal["latency"]["completed"] >= REQUESTS - 1
    assert bal["router_counters"]["signatures_used"] >= REQUESTS, bal["router_counters"]
    assert bal["requests_max_over_mean"] <= 1.25, bal["requests_per_server"]
    assert bal["home_share"] is not None, bal  # every decision was scored on signatures
    if bal["band_decisions"]:
        assert bal["band_home_share"] == 1.0, (bal["band_decisions"], bal["band_home_share"])


def test_fast_demo_leaves_no_process_behind(demo_run):
    _, _, left = demo_run
    assert not left, f"still running after the demo: {sorted(left)}"
