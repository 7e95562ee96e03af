"""Per-request signature destinations: each router puts its own return address in
``custom_params``; the publisher keeps one connection per destination and falls
back to the configured address."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import orjson
import pytest

from eldr_sglang.core.counts_codec import pack_counts
from eldr_sglang.patches.publish import RETURN_ADDRESS_KEY, SignaturePublisher
from tests.integration.helpers import wait_until


def message(room: int) -> dict:
    return {"bootstrap_room": room, "rid": f"r{room}", "layers": [0], "counts": pack_counts([[room, 1]])}


class Receiver(ThreadingHTTPServer):
    """A router's ``POST /eldr/signature`` stand-in (keep-alive): records the rooms posted."""

    daemon_threads = True

    def __init__(self) -> None:
        self.rooms: list[int] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.rooms.extend(m["bootstrap_room"] for m in orjson.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/eldr/signature"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class TcpListener:
    """A router's ``--signature-port`` stand-in: records each line's room, per accepted connection."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.rooms: list[int] = []
        self.conns: list[dict] = []  # {"rooms": [...], "closed": bool} per accepted connection
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.server.accept()
            rec = {"rooms": [], "closed": False}
            self.conns.append(rec)
            threading.Thread(target=self._read, args=(conn, rec), daemon=True).start()

    def _read(self, conn: socket.socket, rec: dict) -> None:
        with conn, conn.makefile("rb") as f:
            for line in f:
                room = orjson.loads(line)["bootstrap_room"]
                rec["rooms"].append(room)
                self.rooms.append(room)
        rec["closed"] = True


class SilentListener:
    """Accepts connections and reads, never answers: a hung router."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/eldr/signature"
        self.accepted = 0
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.server.accept()
            self._held.append(conn)
            self.accepted += 1


def closed_port_url() -> str:
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there any more: connections are refused
    return f"tcp://127.0.0.1:{port}"


def test_each_message_reaches_its_destination_in_order():
    a, b, default = TcpListener(), TcpListener(), Receiver()
    pub = SignaturePublisher(default.url)
    for room in range(30):
        pub.submit(message(room), [a.url, b.url, None][room % 3])
    wait_until(lambda: pub.sent == 30)
    assert a.rooms == list(range(0, 30, 3))
    assert b.rooms == list(range(1, 30, 3))
    assert default.rooms == list(range(2, 30, 3))
    assert pub.connections == 3 and pub.dropped == pub.errors == pub.invalid_destinations == 0
    assert sorted(pub.destinations) == sorted([a.url, b.url])
    # an HTTP return address works too; naming the default address shares its connection
    pub.submit(message(30), default.url)
    wait_until(lambda: pub.sent == 31)
    assert default.rooms[-1] == 30 and pub.connections == 3
    default.shutdown()


def test_unreachable_destination_drops_only_its_own_messages():
    a, default = TcpListener(), Receiver()
    dead = closed_port_url()
    pub = SignaturePublisher(default.url, timeout=0.5)
    for room in range(30):
        pub.submit(message(room), [a.url, dead, None][room % 3])
    wait_until(lambda: pub.sent + pub.dropped == 30)
    assert pub.dropped == 10 and pub.errors >= 1
    assert a.rooms == list(range(0, 30, 3))
    assert default.rooms == list(range(2, 30, 3))
    default.shutdown()


def test_a_hung_destination_is_skipped_after_its_timeout():
    a, hung = TcpListener(), SilentListener()
    pub = SignaturePublisher(timeout=0.3)
    pub.submit(message(1), hung.url)
    wait_until(lambda: pub.dropped == 1)  # answered nothing within the timeout
    for room in range(2, 7):
        pub.submit(message(room), hung.url)
    pub.submit(message(7), a.url)
    wait_until(lambda: pub.dropped == 6 and a.rooms == [7], timeout=3.0)
    assert hung.accepted == 1 and pub.errors == 1  # skipped, not tried again for each batch


@pytest.mark.parametrize("bad", ["router:8000", "ftp://r/x", "tcp://r", "tcp://r:99999", "http:///x", ""])
def test_invalid_destination_goes_to_the_default_and_is_counted(bad):
    default = Receiver()
    pub = SignaturePublisher(default.url)
    pub.submit(message(1), bad)
    pub.submit(message(2))
    wait_until(lambda: pub.sent == 2)
    assert default.rooms == [1, 2]
    assert pub.invalid_destinations == 1 and pub.dropped == 0 and pub.destinations == []
    default.shutdown()


def test_without_a_default_address_only_return_addresses_are_served():
    a = TcpListener()
    pub = SignaturePublisher()
    assert pub.url is None
    for room, dest in [(1, None), (2, a.url), (3, "not a url"), (4, a.url)]:
        pub.submit(message(room), dest)
    wait_until(lambda: pub.sent + pub.dropped == 4)
    assert a.rooms == [2, 4] and pub.sent == 2 and pub.dropped == 2 and pub.invalid_destinations == 1


def test_least_recently_used_connection_is_closed_beyond_the_bound():
    a, b, c = TcpListener(), TcpListener(), TcpListener()
    pub = SignaturePublisher(max_destinations=2)
    for room, dest in [(1, a.url), (2, b.url), (3, a.url), (4, c.url)]:
        pub.submit(message(room), dest)
        wait_until(lambda: pub.sent == room)  # one at a time: a fixed use order
    wait_until(lambda: b.conns and b.conns[0]["closed"])  # b was least recently used
    assert pub.destinations == [a.url, c.url]
    assert not a.conns[0]["closed"] and not c.conns[0]["closed"]
    pub.submit(message(5), a.url)  # still on its first connection
    wait_until(lambda: pub.sent == 5)
    wait_until(lambda: a.rooms == [1, 3, 5])
    assert len(a.conns) == 1 and pub.connections == 3
    pub.submit(message(6), b.url)  # reopened; now c is least recently used
    wait_until(lambda: len(b.conns) == 2 and b.conns[1]["rooms"] == [6] and c.conns[0]["closed"])
    assert pub.connections == 4 and pub.destinations == [a.url, b.url]


@pytest.mark.parametrize("timeout", [0, -1, 0.0, float("nan"), float("inf")])
def test_non_positive_timeout_is_refused(timeout):
    with pytest.raises(ValueError, match="--eldr-publish-timeout"):
        SignaturePublisher("tcp://127.0.0.1:1", timeout=timeout)


# ------------------------------------------------------------ capture side
def fake_req(custom_params=..., sampling_params=...) -> SimpleNamespace:
    if sampling_params is ...:
        sampling_params = SimpleNamespace(custom_params=custom_params) if custom_params is not ... \
            else SimpleNamespace()
    return SimpleNamespace(sampling_params=sampling_params)


@pytest.mark.parametrize("req, expected", [
    (fake_req({RETURN_ADDRESS_KEY: "tcp://r1:9000"}), "tcp://r1:9000"),
    (fake_req({RETURN_ADDRESS_KEY: "http://r2:8000/eldr/signature", "eldr_signature": True}),
     "http://r2:8000/eldr/signature"),
    (fake_req({"thinking_budget": 5}), None),
    (fake_req(None), None),
    (fake_req({}), None),
    (fake_req([RETURN_ADDRESS_KEY]), None),
    (fake_req("tcp://r1:9000"), None),
    (fake_req({RETURN_ADDRESS_KEY: 9000}), None),
    (fake_req({RETURN_ADDRESS_KEY: ["tcp://r1:9000"]}), None),
    (fake_req({RETURN_ADDRESS_KEY: ""}), None),
    (fake_req(), None),  # sampling params without custom_params
    (fake_req(sampling_params=None), None),
    (SimpleNamespace(), None),  # no sampling params at all
])
def test_return_address_from_the_request(req, expected):
    from eldr_sglang.patches.messages import return_address

    assert return_address(req) == expected


def test_publish_module_needs_neither_sglang_nor_torch():
    import subprocess
    import sys

    code = ("import sys; import eldr_sglang.patches.publish as p; "
            "assert p.RETURN_ADDRESS_KEY == 'eldr_signature_to'; "
            "bad = [m for m in ('sglang', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
