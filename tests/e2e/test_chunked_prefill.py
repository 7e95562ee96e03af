"""Chunked prefill on a real PD prefill server: ONE signature message per request,
after the last chunk, with the whole prompt's counts (overlap scheduling on and off)."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest

from eldr_sglang.core.counts_codec import unpack_counts
from eldr_sglang.testing import local_cluster as lc
from tests.helpers import post_ignoring_errors, serving, wait_until

pytestmark = pytest.mark.sglang
PROMPT_TOKENS, CHUNK, TOP_K = 300, 64, 4  # the fixture model routes each token to 4 of 16 experts


class Listener:
    """A router's TCP signature port: collects every JSON line it is sent."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.messages: list[dict] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        for line in conn.makefile("rb"):
            if line.strip():
                self.messages.append(json.loads(line))

    def for_room(self, room: int) -> list[dict]:
        return [m for m in self.messages if m["bootstrap_room"] == room]


@pytest.fixture(scope="module", params=["overlap", "no-overlap"])
def chunked_prefill(request, fixture_model):
    listener = Listener()
    extra = ["--eldr-layers", "all", "--eldr-publish", f"tcp://127.0.0.1:{listener.port}",
             "--chunked-prefill-size", str(CHUNK)]
    if request.param == "no-overlap":
        extra.append("--disable-overlap-schedule")
    spec = lc.ServerSpec(str(fixture_model), role="prefill", extra_args=extra)
    with serving(spec, f"chunked-prefill-{request.param}") as proc:
        yield proc, spec, listener


def test_one_message_after_the_last_chunk_with_the_whole_prompt(chunked_prefill):
    """Request A (5 chunks) then request B: B's first message comes after every message
    A's chunks could have caused (one publisher, FIFO; B's prefill follows A's last
    chunk), so by then A must have exactly one."""
    proc, spec, listener = chunked_prefill
    rng = np.random.default_rng(0)

    def send(room: int) -> str:
        rid = f"chunked-{room}"
        body = {"input_ids": rng.integers(100, 30000, PROMPT_TOKENS).tolist(), "rid": rid,
                "bootstrap_host": "127.0.0.1", "bootstrap_port": spec.bootstrap_port,
                "bootstrap_room": room, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        threading.Thread(target=post_ignoring_errors, args=(proc.url + "/generate", body), daemon=True).start()
        return rid

    def first_message(room: int) -> dict:
        wait_until(lambda: listener.for_room(room), timeout=120, what=f"a message for room {room}", step=0.05)
        return listener.for_room(room)[0]

    base = 100 if chunked_prefill[1].extra_args[-1] == "--disable-overlap-schedule" else 0
    a, b = base + 11, base + 12
    rids = [send(a)]
    first_message(a)
    rids.append(send(b))
    first_message(b)
    msgs = listener.for_room(a)
    assert len(msgs) == 1, len(msgs)  # not one per chunk
    counts = unpack_counts(msgs[0]["counts"])
    assert counts.shape == (4, 16) and msgs[0]["prompt_tokens"] == PROMPT_TOKENS
    assert (counts.sum(axis=1) == TOP_K * PROMPT_TOKENS).all(), counts.sum(axis=1)
    for rid in rids:
        post_ignoring_errors(proc.url + "/abort_request", {"rid": rid})
