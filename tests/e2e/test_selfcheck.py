"""``eldr-selfcheck`` against a real SGLang CPU server that also runs SGLang's own
routed-experts capture, so the signatures are compared with it exactly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eldr_sglang.testing import local_cluster as lc
from tests.helpers import TEST_ARTIFACT_LAYERS, serving

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def single_server(fixture_model):
    """This module's plain server (overrides the shared fixture of the same name, so it
    runs with the other module-scoped servers): layers 1 and 3 captured, SGLang's
    ``--enable-return-routed-experts`` on."""
    spec = lc.ServerSpec(str(fixture_model), extra_args=[
        "--eldr-layers", ",".join(map(str, TEST_ARTIFACT_LAYERS)), "--enable-return-routed-experts"])
    with serving(spec, "selfcheck") as proc:
        yield proc


def selfcheck(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eldr_sglang.selfcheck", *argv],
                          capture_output=True, text=True, timeout=600)


def test_selfcheck_passes_on_a_capturing_server(single_server):
    proc = selfcheck(single_server.url, "--prompts", "2", "--timeout", "120")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    line = proc.stdout.strip()
    assert len(line.splitlines()) == 1 and line.startswith("eldr-selfcheck: OK: 2 prompts x 2 on a plain server")
    assert f"layers {TEST_ARTIFACT_LAYERS}" in line and "equal to SGLang's return_routed_experts" in line
    assert "cached tokens" in line  # the second send hit the prefix cache


def test_selfcheck_fails_with_one_line_where_nothing_listens():
    proc = selfcheck(f"http://127.0.0.1:{lc.free_port()}", "--timeout", "5")
    assert proc.returncode == 1 and proc.stdout.startswith("eldr-selfcheck: FAIL: ")
    assert len(proc.stdout.strip().splitlines()) == 1
