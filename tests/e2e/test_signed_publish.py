"""A real PD prefill server with ``--eldr-signature-key-file`` and ``--eldr-publish-allow``:
the flags reach the scheduler, every line it publishes carries the key's HMAC, and a
return address outside the list is never connected to."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest

from eldr_sglang.core import wire
from eldr_sglang.testing import local_cluster as lc
from tests.helpers import post_ignoring_errors, serving, wait_until

pytestmark = pytest.mark.sglang
KEY = b"e2e-signature-key"


class Listener:
    """A router's TCP signature port: keeps every raw line and counts connections."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.lines: list[bytes] = []
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        for line in conn.makefile("rb"):
            if line.strip():
                self.lines.append(line)


@pytest.fixture(scope="module")
def signing_prefill(fixture_model, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "eldr.key"
    key_file.write_bytes(KEY + b"\n")
    extra = ["--eldr-layers", "0,1", "--eldr-publish", "request", "--eldr-publish-allow", "127.0.0.1/32",
             "--eldr-signature-key-file", str(key_file)]
    spec = lc.ServerSpec(str(fixture_model), role="prefill", extra_args=extra)
    with serving(spec, "signed-publish") as proc:
        yield proc, spec


def test_published_lines_are_signed_and_unlisted_destinations_never_connected(signing_prefill):
    proc, spec = signing_prefill
    allowed, refused = Listener(), Listener()
    rng = np.random.default_rng(0)
    rids = []

    def send(room: int, dest: str) -> None:
        rid = f"signed-{room}"
        rids.append(rid)
        body = {"input_ids": rng.integers(100, 30000, 40).tolist(), "rid": rid,
                "bootstrap_host": "127.0.0.1", "bootstrap_port": spec.bootstrap_port, "bootstrap_room": room,
                "sampling_params": {"max_new_tokens": 2, "temperature": 0,
                                    "custom_params": {wire.RETURN_ADDRESS_KEY: dest}}}
        threading.Thread(target=post_ignoring_errors, args=(proc.url + "/generate", body), daemon=True).start()

    def wait_lines(n: int) -> None:
        wait_until(lambda: len(allowed.lines) >= n, timeout=120, what=f"{n} signature lines", step=0.05)

    send(21, f"tcp://127.0.0.1:{allowed.port}")
    wait_lines(1)
    send(22, f"tcp://localhost:{refused.port}")  # a name outside --eldr-publish-allow
    send(23, f"tcp://127.0.0.1:{allowed.port}")
    wait_lines(2)  # one publisher thread, in order: room 22 was handled before room 23
    split = [wire.split_line(line) for line in allowed.lines]
    assert all(wire.verify(KEY, data, mac) for mac, data in split)
    assert [json.loads(data)["bootstrap_room"] for _, data in split] == [21, 23]
    assert refused.connections == 0 and not refused.lines
    for rid in rids:
        post_ignoring_errors(proc.url + "/abort_request", {"rid": rid})
