"""Signed signature messages: with a shared key (``--signature-key-file``) a router takes
only messages carrying their HMAC, on ``POST /eldr/signature`` and the TCP stream;
anything else is refused, counted and never touches routing state."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from eldr_sglang.core import wire
from eldr_sglang.testing.stub_worker import topic_counts
from tests.integration.helpers import cluster, post, until

KEY = b"k3y-for-tests-0123456789abcdef"


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "signature.key"
    path.write_bytes(KEY + b"\n")  # the trailing newline of `echo KEY > file` is no part of it
    return str(path)


def forged(room: int, topic: int = 3) -> dict:
    """Another request's room, with counts that would send it to decode ``topic``."""
    return wire.build_message(room, "forged", 4, 0, [0, 1], topic_counts(f"topic:{topic}"), packed=True)


async def tcp_send(port: int, data: bytes) -> None:
    _, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    w.close()


async def forge_while_waiting(router, url, prefill, http, key: bytes | None) -> tuple[int, bytes, list[int]]:
    """One request whose prefill never publishes; while the router waits for its room,
    an attacker posts messages for that room (unsigned and, with ``key``, signed with
    it) on HTTP and the TCP stream. (status, answer, HTTP statuses of the posts)."""
    task = asyncio.ensure_future(post(http, f"{url}/generate", {"text": "topic:0 hello"}))
    await until(lambda: prefill.requests and router.board.waiters, what="the request waiting for its room")
    room = prefill.requests[-1]["bootstrap_room"]
    msg = forged(room)
    statuses = []
    body, headers = wire.http_body(msg, key)
    async with http.post(f"{url}/eldr/signature", data=body, headers=headers) as r:
        statuses.append(r.status)
    body, headers = wire.http_body(msg)
    async with http.post(f"{url}/eldr/signature", data=body, headers=headers) as r:
        statuses.append(r.status)
    await tcp_send(router.intake.port, wire.stream_lines([msg], key) + wire.stream_lines([msg]))
    st, raw = await task
    return st, raw, statuses


async def test_forged_messages_for_another_rooms_request_are_refused_counted_and_do_not_steer(key_file):
    async with cluster(prefill_kw={"send_signature": False}, signature_timeout=1.0,
                       signature_timeout_min=1.0, signature_port=0,
                       signature_key_file=key_file) as (router, url, prefill, decodes, http):
        st, raw, statuses = await forge_while_waiting(router, url, prefill, http, b"not-the-key")
        assert st == 200, raw
        assert statuses == [403, 401]
        await until(lambda: router.metrics.value("signature_auth_refused") == 4, what="4 refusals")
        assert router.metrics.value("signature_auth_refused", reason="unsigned") == 2
        assert router.metrics.value("signature_auth_refused", reason="bad_mac") == 2
        # the request waited out its own (missing) signature: none of the forged ones was used
        assert router.metrics.value("fallbacks", reason="timeout") == 1
        assert router.metrics.value("events", event="signatures_used") == 0
        assert router.metrics.value("signature_messages") == 0 and not router.board.buffer


async def test_without_a_key_the_same_forgery_steers_the_request():
    """What the key prevents: an unauthenticated intake lets anyone pick another request's server."""
    async with cluster(prefill_kw={"send_signature": False}, signature_timeout=5.0,
                       signature_port=0) as (router, url, prefill, decodes, http):
        st, raw, statuses = await forge_while_waiting(router, url, prefill, http, None)
        assert st == 200 and orjson.loads(raw)["meta_info"]["server"] == "d3"
        assert statuses[0] == 200 and router.metrics.value("events", event="signatures_used") == 1


@pytest.mark.parametrize("transport", ["http", "tcp"])
async def test_messages_signed_with_the_key_are_accepted_and_route(key_file, transport):
    tcp = {"signature_port": 0, "push_url": False} if transport == "tcp" else {}
    async with cluster(prefill_kw={"signature_key": KEY}, signature_key_file=key_file, **tcp) as (
            router, url, prefill, decodes, http):
        for topic in (2, 1, 2):
            st, raw = await post(http, f"{url}/generate", {"text": f"topic:{topic} x"})
            assert st == 200 and orjson.loads(raw)["meta_info"]["server"] == f"d{topic}", raw
        assert router.metrics.value("events", event="signatures_used") == 3
        assert router.metrics.value("signature_auth_refused") == 0
        assert (router.metrics.value("events", event="signature_streams") > 0) == (transport == "tcp")


async def test_refused_messages_never_reach_the_online_window(key_file):
    async with cluster(policy="eldr", artifact=None, online=True, online_min_signatures=50,
                       prefill_kw={"signature_key": KEY}, signature_key_file=key_file) as (
            router, url, prefill, decodes, http):
        window = router.online.calibrator.window

        def taken():  # in the window, or held until a shape has a majority of the first ones
            return len(window) + len(router.online.pending)
        for i in range(3):
            st, _ = await post(http, f"{url}/generate", {"text": f"topic:{i} x"})
            assert st == 200
        await until(lambda: taken() == 3, what="3 signed signatures taken")
        # another shape, unsigned: refused before parsing, so no reset and no entry
        other = wire.build_message(1, "x", 1, 0, [0, 1, 2], [[1] * 16] * 3)
        for _ in range(5):
            st, _ = await post(http, f"{url}/eldr/signature", other)
            assert st == 401
        assert taken() == 3 and window.resets == 0 and router.online.refused == 0
        assert router.metrics.value("signature_auth_refused", reason="unsigned") == 5


@pytest.mark.parametrize("transport", ["http", "tcp"])
async def test_a_router_without_a_key_takes_signed_messages(transport):
    """Engines can get the key before their routers do."""
    tcp = {"signature_port": 0, "push_url": False} if transport == "tcp" else {}
    async with cluster(prefill_kw={"signature_key": KEY}, **tcp) as (router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "topic:3 x"})
        assert st == 200 and orjson.loads(raw)["meta_info"]["server"] == "d3", raw
        assert router.metrics.value("events", event="signatures_used") == 1
