"""local_cluster's start-up retry: a server that lost one of its ports to another
process before binding it is started again with fresh ports (no SGLang needed:
the "server" is a tiny script)."""

from __future__ import annotations

import sys

import pytest

from eldr_sglang.testing import local_cluster as lc

# argv: port, nccl port, taken port. It dies like SGLang when its torch.distributed
# port is the taken one, crashes on a model it cannot load, else serves /health.
FAKE = r"""
import sys, http.server
port, nccl, taken = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if nccl == taken:
    print("torch.distributed.DistNetworkError: ... port: %d ... EADDRINUSE, message: address already in use" % nccl)
    sys.exit(1)
if sys.argv[4] == "broken":
    print("OSError: model weights not found")
    sys.exit(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def fake_sglang(monkeypatch):
    bad = lc.free_port()
    calls = []

    def argv(self, host="127.0.0.1"):
        calls.append((self.port, self.nccl_port))
        return [sys.executable, "-c", FAKE, str(self.port), str(self.nccl_port), str(bad), self.model_path]

    monkeypatch.setattr(lc.ServerSpec, "argv", argv)
    return bad, calls


def test_port_clash_is_retried_with_fresh_ports(tmp_path, fake_sglang):
    bad, calls = fake_sglang
    spec = lc.ServerSpec("model", nccl_port=bad)
    proc = lc.start_server_ready(spec, tmp_path, "fake", timeout=30)
    try:
        assert proc.alive() and len(calls) == 2
        assert calls[0][1] == bad and calls[1][1] != bad and calls[1][0] != calls[0][0]
    finally:
        proc.stop()
    assert not proc.alive()


def test_other_start_failures_are_not_retried(tmp_path, fake_sglang):
    _, calls = fake_sglang
    spec = lc.ServerSpec("broken")
    with pytest.raises(RuntimeError, match="exited with code 1 before it was ready"):
        lc.start_server_ready(spec, tmp_path, "fake", timeout=30)
    assert len(calls) == 1


def test_pinned_server_runs_under_taskset_and_unpinned_does_not():
    pinned = lc.ServerSpec("m", "decode", port=1, nccl_port=2, cpus="0").argv()
    assert pinned[:3] == ["taskset", "-c", "0"] and pinned[3:6] == [sys.executable, "-m", "sglang.launch_server"]
    assert lc.ServerSpec("m", "decode", port=1, nccl_port=2).argv()[0] == sys.executable


def test_decode_cpus_cycle_over_the_decode_servers(monkeypatch, tmp_path):
    started = []

    def fake_ready(spec, log_dir, name, timeout, progress):
        started.append((name, spec.cpus))
        return object()

    monkeypatch.setattr(lc, "start_server_ready", fake_ready)
    lc.start_pd_cluster("m", tmp_path, n_prefill=1, n_decode=3, prefill_cpus="0-1", decode_cpus=["0", "1"])
    assert started == [("prefill-0", "0-1"), ("decode-0", "0"), ("decode-1", "1"), ("decode-2", "0")]
