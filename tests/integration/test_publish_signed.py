"""The engine's publisher signs what it sends (HTTP header, TCP line prefix) and never
connects to a return address outside ``--eldr-publish-allow``; a router with the
same key takes its messages, one with another key refuses them."""

from __future__ import annotations

import socket
import threading

import orjson
import pytest

from eldr_sglang.core import wire
from eldr_sglang.patches.publish import SignaturePublisher
from eldr_sglang.patches.publish_allow import DestinationAllowList
from eldr_sglang.testing.stub_worker import topic_counts
from tests.integration.helpers import cluster, until, wait_until
from tests.integration.test_publisher import Receiver, message

KEY = b"publisher-test-key"


class LineReceiver:
    """A TCP signature stream stand-in: records every line and every connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.lines: list[bytes] = []
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            for line in f:
                self.lines.append(line)


class SignedReceiver(Receiver):
    """The HTTP receiver, also keeping each POST's MAC header."""

    def __init__(self) -> None:
        super().__init__()
        self.macs: list[str | None] = []
        self.bodies: list[bytes] = []
        handler = self.RequestHandlerClass
        receiver = self

        class Handler(handler):
            def do_POST(self) -> None:
                receiver.macs.append(self.headers.get(wire.MAC_HEADER))
                length = int(self.headers["Content-Length"])
                body = self.rfile.read(length)
                receiver.bodies.append(body)
                receiver.batches.append(orjson.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.RequestHandlerClass = Handler


def test_http_posts_carry_the_hmac_of_their_body():
    rx = SignedReceiver()
    pub = SignaturePublisher(rx.url, key=KEY)
    for room in (1, 2):
        pub.submit(message(room))
        wait_until(lambda: pub.sent == room)
    assert len(rx.macs) == 2
    assert all(wire.verify(KEY, body, mac) for body, mac in zip(rx.bodies, rx.macs))
    assert not wire.verify(b"other", rx.bodies[0], rx.macs[0])
    rx.shutdown()


def test_tcp_lines_carry_the_hmac_of_their_message():
    rx = LineReceiver()
    pub = SignaturePublisher(rx.url, key=KEY)
    for room in (1, 2, 3):
        pub.submit(message(room))
    wait_until(lambda: len(rx.lines) == 3)
    split = [wire.split_line(line) for line in rx.lines]
    assert all(wire.verify(KEY, data, mac) for mac, data in split)
    assert [orjson.loads(data)["bootstrap_room"] for _, data in split] == [1, 2, 3]


def test_unsigned_without_a_key():
    rx = LineReceiver()
    pub = SignaturePublisher(rx.url)
    pub.submit(message(1))
    wait_until(lambda: len(rx.lines) == 1)
    assert wire.split_line(rx.lines[0])[0] is None


def test_a_return_address_outside_the_allow_list_is_never_connected_to():
    refused, allowed = LineReceiver(), LineReceiver()
    # "localhost" allowed by its name only (its addresses resolved to none here)
    allow = DestinationAllowList(["10.0.0.0/8", "localhost"], resolve=lambda name: set())
    pub = SignaturePublisher(None, allow=allow)
    pub.submit(message(1), refused.url)  # tcp://127.0.0.1:PORT: an address outside 10.0.0.0/8
    pub.submit(message(2), refused.url)
    pub.submit(message(3), allowed.url.replace("127.0.0.1", "localhost"))  # listed by name
    wait_until(lambda: len(allowed.lines) == 1)  # sent after the refused ones (one thread, in order)
    assert refused.connections == 0 and not refused.lines
    assert pub.refused_destinations == 2 and pub.dropped == 2  # no default address to send them to
    assert orjson.loads(wire.split_line(allowed.lines[0])[1])["bootstrap_room"] == 3


def fitting(room: int) -> dict:
    """A message the router's toy artifact takes (2 layers x 8 experts)."""
    return wire.build_message(room, f"r{room}", 4, 0, [0, 1], topic_counts("topic:1"), packed=True)


@pytest.mark.parametrize("transport", ["http", "tcp"])
async def test_a_router_takes_the_publishers_signed_messages_and_refuses_another_key(tmp_path, transport):
    path = tmp_path / "key"
    path.write_bytes(KEY)

    async with cluster(signature_port=0, signature_key_file=str(path)) as (router, url, prefill, decodes, http):
        dest = f"tcp://127.0.0.1:{router.intake.port}" if transport == "tcp" else f"{url}/eldr/signature"
        good, bad = SignaturePublisher(dest, key=KEY), SignaturePublisher(dest, key=b"wrong")
        for room in (11, 12):
            good.submit(fitting(room))
        await until(lambda: router.metrics.value("signature_messages", outcome="unclaimed") == 2,
                    what="two signed messages taken")
        bad.submit(fitting(13))
        await until(lambda: router.metrics.value("signature_auth_refused", reason="bad_mac") == 1,
                    what="the wrongly signed message refused")
        assert 13 not in router.board.buffer and set(router.board.buffer) == {11, 12}
        if transport == "http":
            await until(lambda: bad.errors == 1, what="the publisher told of the 403")
