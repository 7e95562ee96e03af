"""The engine's signature publisher: one kept-alive connection, packed counts,
drop-and-count (never block) when the router is away."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pytest

from eldr_sglang.core.counts_codec import pack_counts
from eldr_sglang.patches.publish import SignaturePublisher
from eldr_sglang.router.signals.signatures import parse_message
from tests.integration.helpers import until, wait_until


class Receiver(ThreadingHTTPServer):
    """A router stand-in: records each POSTed batch and the client port it came from."""

    daemon_threads = True

    def __init__(self, close_after_each: bool = False) -> None:
        self.batches: list[list[dict]] = []
        self.client_ports: list[int] = []
        self.close_after_each = close_after_each
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.batches.append(orjson.loads(body))
                receiver.client_ports.append(self.client_address[1])
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                # a silent close, as an idle keep-alive timeout does: the client
                # only learns of it when it sends on the dead connection
                self.close_connection = receiver.close_after_each

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/eldr/signature"
        threading.Thread(target=self.serve_forever, daemon=True).start()


def message(room: int) -> dict:
    return {"bootstrap_room": room, "rid": f"r{room}", "layers": [0, 1],
            "counts": pack_counts([[room, 1, 0], [0, 2, room]])}


@pytest.mark.parametrize("close_after_each", [False, True])
def test_messages_arrive_exactly_once_over_a_kept_alive_connection(close_after_each):
    rx = Receiver(close_after_each=close_after_each)
    pub = SignaturePublisher(rx.url)
    for room in range(1, 6):
        pub.submit(message(room))
        wait_until(lambda: pub.sent == room)
    got = [parse_message(m) for batch in rx.batches for m in batch]
    assert [m["bootstrap_room"] for m in got] == [1, 2, 3, 4, 5]
    assert got[2]["counts"].tolist() == [[3, 1, 0], [0, 2, 3]]
    assert pub.dropped == 0 and pub.errors == 0
    # kept alive: one connection for all five posts; reopened when the router closed it
    assert pub.connections == (5 if close_after_each else 1)
    assert len(set(rx.client_ports)) == pub.connections
    rx.shutdown()


def test_unreachable_router_drops_and_counts_without_blocking():
    rx = Receiver()
    url = rx.url
    rx.shutdown()
    rx.server_close()  # nothing listens on that port any more
    pub = SignaturePublisher(url, timeout=0.5, max_queue=4)
    t0 = time.perf_counter()
    for room in range(100):
        pub.submit(message(room))
    assert time.perf_counter() - t0 < 0.5  # submit never waits for the network
    wait_until(lambda: pub.sent + pub.dropped == 100)
    assert pub.sent == 0 and pub.errors >= 1


def test_bad_publish_url_is_refused():
    with pytest.raises(ValueError, match="publish URL"):
        SignaturePublisher("router:8000/eldr/signature")


async def test_tcp_stream_to_the_real_router_and_reconnect_after_it_closes():
    """The router's own return address (no default address configured): its TCP
    signature stream receives the messages, and a dropped connection is reopened."""
    import asyncio

    from eldr_sglang.router import Router, start_router

    router = Router([("http://127.0.0.1:1", None)], ["http://127.0.0.1:2"], "round_robin",
                    health_interval=0, signature_port=0)
    runner, _ = await start_router(router)
    pub = SignaturePublisher()  # no default: each message names the router
    waits = {room: router.board.expect(room) for room in (11, 12, 13, 14)}

    async def arrived(rooms) -> None:
        await asyncio.wait_for(asyncio.gather(*(waits[r] for r in rooms)), 5)

    try:
        for room in (11, 12, 13):
            pub.submit(message(room), router.return_address)
        await arrived([11, 12, 13])
        assert parse_message(waits[12].result())["counts"].tolist() == [[12, 1, 0], [0, 2, 12]]
        assert pub.connections == 1 and len(router.intake.streams) == 1
        for w in list(router.intake.streams):  # the router drops the connection
            w.close()
        await until(lambda: not router.intake.streams, 10, "the router to let go of the stream")
        pub.submit(message(14), router.return_address)
        await arrived([14])
        await until(lambda: pub.sent == 4, 10, "the publisher thread to count its 4th send")  # after send returns
        assert pub.connections == 2 and pub.dropped == 0 and pub.sent == 4
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("timeout", [0, -0.5])
def test_non_positive_publish_timeout_is_refused(timeout):
    with pytest.raises(ValueError, match="--eldr-publish-timeout"):
        SignaturePublisher("tcp://127.0.0.1:1", timeout=timeout)
