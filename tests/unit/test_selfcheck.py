"""``eldr-selfcheck`` against planted signatures and a stub PD prefill server."""

from __future__ import annotations

import base64
import json
import socket
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from eldr_sglang import selfcheck
from eldr_sglang.core.counts_codec import pack_counts
from eldr_sglang.patches.publish import RETURN_ADDRESS_KEY

ROOT = Path(__file__).resolve().parents[2]
N_EXP, TOP_K = 16, 4


def sig(counts, tokens, cached=0, routed=None, layers=(1, 3)):
    return selfcheck.Signature(list(layers), np.asarray(counts), tokens, cached, routed)


def planted(rng, tokens, n_layers=4):
    ids = np.stack([[rng.permutation(N_EXP)[:TOP_K] for _ in range(n_layers)] for _ in range(tokens)])
    counts = np.stack([np.bincount(ids[:, l].flatten(), minlength=N_EXP) for l in (1, 3)])
    return ids.astype(np.int32), counts


def test_a_good_pair_passes_and_each_defect_is_named():
    rng = np.random.default_rng(0)
    ids, counts = planted(rng, 10)
    assert selfcheck.check_one(sig(counts, 10), sig(counts, 10, cached=9)) is None
    assert selfcheck.check_one(sig(counts, 10, routed=ids.flatten()), sig(counts, 10, 9)) is None
    empty = np.zeros_like(counts)
    assert "cold signature empty" in selfcheck.check_one(sig(empty, 10), sig(counts, 10))
    short = counts.copy()
    short[0, short[0].argmax()] -= 1
    assert "top-k times" in selfcheck.check_one(sig(counts, 10), sig(short, 10))
    moved = counts.copy()
    moved[:, :] = np.roll(counts, 3, axis=1)  # the same totals, other experts
    assert "differs from the cold one" in selfcheck.check_one(sig(counts, 10), sig(moved, 10, cached=9))
    swap = counts.copy()
    i = int(np.flatnonzero(swap[0])[0])
    j = (i + 1) % N_EXP
    swap[0, i] -= 1
    swap[0, j] += 1  # one near-tie swap of the recomputed token: accepted
    assert selfcheck.check_one(sig(counts, 10), sig(swap, 10, cached=9)) is None
    other = ids.copy()
    other[:, 3] = (other[:, 3] + 1) % N_EXP
    assert "layer 3 differs from SGLang's return_routed_experts" in selfcheck.check_one(
        sig(counts, 10, routed=other.flatten()), sig(counts, 10, 9))


class _StubPrefill(BaseHTTPRequestHandler):
    """A PD prefill server: publishes a signature to the request's return address."""

    counts: np.ndarray
    aborted: list

    def log_message(self, *args):
        pass

    def _json(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._json({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 8998,
                    "enable_return_routed_experts": False})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/abort_request":
            self.aborted.append(body["rid"])
            return self._json({})
        assert body["bootstrap_port"] == 8998 and body["bootstrap_room"] > 0
        host, port = body["sampling_params"]["custom_params"][RETURN_ADDRESS_KEY][len("tcp://"):].split(":")
        cached = 9 if body["text"] in self.seen else 0
        self.seen.add(body["text"])
        msg = {"bootstrap_room": body["bootstrap_room"], "rid": body["rid"], "prompt_tokens": 10,
               "cached_tokens": cached, "layers": [1, 3], "counts": pack_counts(self.counts)}
        with socket.create_connection((host, int(port))) as s:
            s.sendall(json.dumps(msg).encode() + b"\n")
        self._json({"error": "no decode server"}, 500)


@pytest.fixture
def stub_prefill():
    _, counts = planted(np.random.default_rng(1), 10)
    handler = type("H", (_StubPrefill,), {"counts": counts, "aborted": [], "seen": set()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()


def test_a_pd_prefill_server_is_checked_through_its_published_signatures(stub_prefill, capsys):
    url, handler = stub_prefill
    assert selfcheck.main([url, "--prompts", "2", "--timeout", "20"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("eldr-selfcheck: OK: 2 prompts x 2 on a prefill server") and "9-9 cached" in out
    assert len(out.splitlines()) == 1 and len(handler.aborted) == 4  # every request aborted after its signature
    handler.counts = np.zeros_like(handler.counts)
    assert selfcheck.main([url, "--prompts", "1", "--timeout", "20"]) == 1
    assert capsys.readouterr().out.startswith("eldr-selfcheck: FAIL: cold signature empty")


def test_unreachable_server_and_bad_arguments():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    assert selfcheck.main([f"http://127.0.0.1:{port}", "--timeout", "2"]) == 1
    with pytest.raises(SystemExit) as exc:
        selfcheck.main(["prefill-0:30000"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        selfcheck.main(["http://h:1", "--prompts", "0"])


def test_routed_experts_are_decoded_from_base64():
    raw = base64.b64encode(np.arange(6, dtype=np.int32).tobytes()).decode()
    assert selfcheck.decode_routed({"routed_experts": raw}).tolist() == list(range(6))
    assert selfcheck.decode_routed({}) is None


def test_the_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["eldr-selfcheck"] == "eldr_sglang.selfcheck:main"
