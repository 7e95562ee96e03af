"""The generated start and stop scripts, run for real with a stand-in interpreter whose
"servers" are plain HTTP servers on loopback (``/health`` answers 200): start-up waits
are bounded, a server that exits is named, and SIGINT, the stop script or a crash
leave no process behind. The same scripts over real SGLang servers:
tests/e2e/test_generated_deployment.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from eldr_sglang.deploy.__main__ import main as deploy_main
from eldr_sglang.deploy.presets import load_description
from eldr_sglang.testing.local_cluster import free_port
from tests.helpers import processes_marked, wait_until

pytestmark = pytest.mark.timeout(120)
MARK = "ELDR_TEST_DEPLOY_SCRIPT"

FAKE_PYTHON = r"""#!/usr/bin/env bash
port=""; prev=""
for a in "$@"; do [ "$prev" = "--port" ] && port="$a"; prev="$a"; done
if [ "$port" = "${FAIL_PORT:-}" ]; then
  case "$FAIL_MODE" in
    exit) echo "error: the artifact is for another model" >&2; exit 3;;
    hang) exec sleep 1000;;
  esac
fi
cd "$FAKE_ROOT" && exec "$REAL_PYTHON" -m http.server "$port" --bind 127.0.0.1
"""


def marked(marker: str) -> set[int]:
    return processes_marked(MARK, marker)


@pytest.fixture
def deployment(tmp_path):
    """(start, stop, env, ports, marker, tmp) of the CPU preset, 1P1D, with a stand-in python."""
    root = tmp_path / "www"
    root.mkdir()
    (root / "health").write_text("ok")
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    doc = load_description(preset="cpu-1p2d-loopback")
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port()}
    doc.update(python=str(fake), log_dir=str(tmp_path / "logs"))
    doc["prefill"].update(port=ports["prefill"], bootstrap_port=free_port(), metrics_port=free_port())
    doc["decode"].update(count=1, port=ports["decode"], metrics_port=free_port())
    doc["router"].update(port=ports["router"], signature_port=free_port())
    doc["calibration"] = str(Path(__file__).resolve().parents[2] / doc["calibration"])
    doc["model_path"] = str(Path(__file__).resolve().parents[2] / doc["model_path"])
    desc = tmp_path / "cluster.yaml"
    desc.write_text(yaml.safe_dump(doc))
    assert deploy_main(["scripts", str(desc), "--out", str(tmp_path / "out"), "--skip-files"]) == 0
    marker = uuid.uuid4().hex
    env = {**os.environ, MARK: marker, "FAKE_ROOT": str(root), "REAL_PYTHON": sys.executable}
    yield tmp_path / "out" / "local.sh", tmp_path / "out" / "local-stop.sh", env, ports, marker, tmp_path
    for pid in marked(marker):  # never leave a process behind, even when a test fails
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def terminal_signals() -> None:
    """SIGINT and SIGTERM as a terminal leaves them: a shell cannot trap a signal that was
    ignored when it started, and this process may have inherited (or been left) SIGINT
    ignored or blocked by what ran before it in the session."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def start(script: Path, env: dict, tmp: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(script)], env={**env, **kw}, stdout=open(tmp / "out.txt", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=terminal_signals)


def output(tmp: Path) -> str:
    return (tmp / "out.txt").read_text()


@pytest.mark.parametrize("how", ["stop_script", "sigint"])
def test_start_until_up_then_stop_leaves_nothing(deployment, how):
    script, stop, env, ports, marker, tmp = deployment
    proc = start(script, env, tmp)
    wait_until(lambda: "is up" in output(tmp) or proc.poll() is not None, 60, "the node up")
    assert "local is up (3 processes)" in output(tmp), output(tmp)
    assert len(marked(marker)) >= 3
    if how == "stop_script":
        done = subprocess.run(["bash", str(stop)], env=env, capture_output=True, text=True, timeout=90)
        assert done.returncode == 0 and done.stdout.count("stopping ") == 3, done.stdout + done.stderr
    else:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal that runs it
    rc = proc.wait(90)
    assert rc == (0 if how == "stop_script" else 130), output(tmp)  # stopped, not crashed
    wait_until(lambda: not marked(marker), 30, "every process of the node gone")
    assert not (tmp / "logs" / "local.pids").exists()


def test_a_server_that_exits_is_named_and_the_node_stops(deployment):
    script, stop, env, ports, marker, tmp = deployment
    proc = start(script, env, tmp, FAIL_PORT=str(ports["prefill"]), FAIL_MODE="exit")
    assert proc.wait(60) == 1
    out = output(tmp)
    assert "error: prefill-0 exited during start-up" in out and "another model" in out, out
    assert "started router" not in out  # it never started
    wait_until(lambda: not marked(marker), 30, "the other servers stopped")


def test_start_up_wait_is_bounded(deployment):
    script, stop, env, ports, marker, tmp = deployment
    proc = start(script, env, tmp, FAIL_PORT=str(ports["decode"]), FAIL_MODE="hang", ELDR_START_TIMEOUT="3")
    assert proc.wait(60) == 1
    assert f"error: http://127.0.0.1:{ports['decode']}/health did not answer within 3 s" in output(tmp)
    wait_until(lambda: not marked(marker), 30, "every process stopped")


def test_a_second_start_over_a_running_node_is_refused(deployment):
    script, stop, env, ports, marker, tmp = deployment
    proc = start(script, env, tmp)
    wait_until(lambda: "is up" in output(tmp) or proc.poll() is not None, 60, "the node up")
    again = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert again.returncode == 1 and "run " in again.stderr and "local-stop.sh first" in again.stderr
    subprocess.run(["bash", str(stop)], env=env, capture_output=True, timeout=90)
    proc.wait(90)
    wait_until(lambda: not marked(marker), 30, "every process gone")


def test_a_server_that_dies_later_stops_the_node(deployment):
    script, stop, env, ports, marker, tmp = deployment
    proc = start(script, env, tmp)
    wait_until(lambda: "is up" in output(tmp) or proc.poll() is not None, 60, "the node up")
    pids = dict(line.split() for line in (tmp / "logs" / "local.pids").read_text().splitlines())
    os.kill(int(pids["decode-0"]), signal.SIGKILL)
    assert proc.wait(90) == 1
    assert "error: a process of local exited; stopping the others" in output(tmp)
    wait_until(lambda: not marked(marker), 30, "every process of the node gone")
