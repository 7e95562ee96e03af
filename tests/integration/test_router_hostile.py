"""The router under hostile load: mismatched signatures, memory the byte cap must
count, big bodies, bursts, slow clients, foreign signature shapes (stub workers)."""

import asyncio
import functools

import aiohttp
import orjson
import pytest

from eldr_sglang.router.signals.signatures import SignatureBoard, parse_message
from eldr_sglang.testing.stub_worker import topic_counts
from tests.integration.helpers import cluster, post, until

pytestmark = pytest.mark.timeout(60)


def three_layer_counts(text):
    return topic_counts(text, layers=(0, 1, 2))


# ------------------------------------------------------------------ 1. mismatched signatures
async def test_signature_that_does_not_fit_the_policy_is_a_counted_fallback_never_a_500():
    async with cluster(n_decode=2, policy="state_aware") as (router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "topic:0"})
        assert st == 200, raw
        # the plugin restarts with another layer set: 3 layers instead of 2
        prefill.layers, prefill.counts_fn = [0, 1, 2], three_layer_counts
        for i in range(5):
            st, raw = await post(http, f"{url}/generate", {"text": f"topic:{i % 2} {i}"})
            assert st == 200, raw
        assert all(d.inflight == 0 for d in router.pool.decodes)
        assert router.policy.describe()["live"] == [0, 0]
        assert router.metrics.value("fallbacks", reason="policy_mismatch") == 5
        assert all(d.breaker.state == "closed" for d in router.pool.decodes)


async def test_a_failing_admit_releases_the_decode_and_aborts_the_prefill():
    async with cluster(n_decode=2, policy="state_aware") as (router, url, prefill, decodes, http):
        def broken_admit(index, request):
            raise RuntimeError("policy bug")
        router.routing.policy.admit = broken_admit
        st, raw = await post(http, f"{url}/generate", {"text": "topic:0", "rid": "bad-admit"})
        assert st == 500 and "error" in orjson.loads(raw)
        assert all(d.inflight == 0 for d in router.pool.decodes)
        assert all(d.breaker.state == "closed" and not d.breaker.trial_out
                   for d in router.pool.decodes)
        await until(lambda: "bad-admit" in prefill.aborts, what="abort to the prefill")


# ------------------------------------------------------------------ 2. byte cap
async def test_signature_fields_are_bounded_and_the_whole_message_is_counted():
    async with cluster(n_decode=2, signature_buffer=1000) as (router, url, prefill, decodes, http):
        counts = topic_counts("topic:0")
        long_rid = {"bootstrap_room": 7, "rid": "r" * 100_000, "layers": [0, 1], "counts": counts}
        st, raw = await post(http, f"{url}/eldr/signature", long_rid)
        assert st == 400 and "rid" in orjson.loads(raw)["error"]
        many_layers = {"bootstrap_room": 8, "layers": list(range(5000)), "counts": [[1]] * 5000}
        st, raw = await post(http, f"{url}/eldr/signature", many_layers)
        assert st == 400 and "layers" in orjson.loads(raw)["error"]
        padded = [{"bootstrap_room": 100 + i, "rid": f"r{i}", "layers": [0, 1], "counts": counts,
                   "pad": "x" * 50_000} for i in range(20)]
        st, raw = await post(http, f"{url}/eldr/signature", padded)
        assert st == 200 and orjson.loads(raw)["buffered"] == 20
        for _, msg, size in router.board.buffer.values():
            assert "pad" not in msg  # only the contract's fields are kept
            assert size >= SignatureBoard.size_of(msg) >= len(msg["rid"]) + msg["counts"].nbytes
        assert router.board.buffered_bytes == sum(s for _, _, s in router.board.buffer.values())


def test_size_of_counts_rid_and_layers():
    base = parse_message({"bootstrap_room": 1, "layers": [0, 1], "counts": [[1] * 8] * 2})
    with_rid = parse_message({"bootstrap_room": 1, "layers": [0, 1], "counts": [[1] * 8] * 2,
                              "rid": "x" * 200})
    assert SignatureBoard.size_of(with_rid) - SignatureBoard.size_of(base) >= 200


# ------------------------------------------------------------------ 6. online window
async def test_foreign_signature_shape_never_resets_the_online_window():
    async with cluster(n_decode=2, policy="eldr", artifact=None, online=True,
                       online_min_signatures=10_000, online_fit_in="thread") as (
            router, url, prefill, decodes, http):
        for i in range(12):
            st, raw = await post(http, f"{url}/generate", {"text": f"topic:{i % 2} {i}"})
            assert st == 200, raw
        window = router.online.calibrator.window
        await until(lambda: len(window) == 12, what="12 signatures in the window")
        foreign = {"bootstrap_room": 5, "layers": [3, 4, 5], "counts": [[1] * 16] * 3}
        st, raw = await post(http, f"{url}/eldr/signature", foreign)
        assert len(window) == 12 and window.resets == 0
        assert router.metrics.value("errors", kind="signature_online_mismatch") == 1
        for room in (6, 7, 8):  # one message per room (a second one is a replay)
            same = {"bootstrap_room": room, "layers": [0, 1], "counts": [[1] * 8] * 2}
            await post(http, f"{url}/eldr/signature", same)
        assert len(window) == 15  # same shape: taken


# ------------------------------------------------------------------ 3. body sizes, parsing
async def test_admin_bodies_are_capped_to_what_an_admin_request_needs():
    async with cluster(n_decode=2) as (router, url, prefill, decodes, http):
        big = {"add": ["http://127.0.0.1:1"] * 20_000}  # ~400 KB, far over any real list
        for path in ("/eldr/servers", "/eldr/calibration"):
            st, raw = await post(http, url + path, big)
            assert st == 413 and "too large" in orjson.loads(raw)["error"], (path, st, raw)
        assert len(router.pool.decodes) == 2


async def test_big_bodies_are_parsed_off_the_loop_and_forwarded_unchanged():
    async with cluster(n_decode=2) as (router, url, prefill, decodes, http):
        router.parser.off_loop_bytes = 10_000
        text = "topic:1 " + "word " * 20_000
        st, raw = await post(http, f"{url}/generate", {"text": text, "rid": "big"})
        assert st == 200, raw
        assert router.parser.off_loop == 1
        assert prefill.requests[-1]["text"] == text and decodes[1].requests[-1]["text"] == text
        ids = {"input_ids": [[]] * 100, "pad": "x" * 20_000}  # malformed and big: refused there
        st, raw = await post(http, f"{url}/generate", ids)
        assert st == 400 and "input_ids" in orjson.loads(raw)["error"]
        st, raw = await post(http, f"{url}/v1/completions", {"prompt": ["x"] * 300})
        assert st == 413 and "--max-batch" in orjson.loads(raw)["error"]["message"]


def wait_for_file(path: str, raw: bytes) -> bool:
    """A parse that lasts until ``path`` exists (at most 20 s): run in the parser process."""
    import os
    import time

    end = time.monotonic() + 20
    while not os.path.exists(path):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


async def test_health_answers_while_a_big_body_is_parsed(tmp_path):
    async with cluster(n_decode=2) as (router, url, prefill, decodes, http):
        flag = str(tmp_path / "health-answered")
        parse = asyncio.ensure_future(router.parser.run(
            functools.partial(wait_for_file, flag), b"x" * router.parser.off_loop_bytes))
        async with http.get(f"{url}/health") as r:  # the loop is free meanwhile
            assert r.status == 200
        open(flag, "w").close()
        assert await asyncio.wait_for(parse, 30) is True


# ------------------------------------------------------------------ 4. bursts
async def test_connections_per_worker_are_capped_and_a_burst_queues():
    async with cluster(n_decode=1, policy="round_robin", decode_kw={"latency": 0.1},
                       worker_max_connections=3) as (router, url, prefill, decodes, http):
        results = await asyncio.gather(*(post(http, f"{url}/generate", {"text": f"t {i}"})
                                         for i in range(40)))
        assert [st for st, _ in results] == [200] * 40
        assert decodes[0].max_active <= 3 and prefill.max_active <= 3
        assert router.upstream.queued > 0 and router.upstream.waiting == 0
        assert router.metrics.value("upstream_failures") == 0
        assert all(w.breaker.state == "closed" for w in router.pool.all())


async def test_a_request_queued_for_a_connection_is_never_aborted_on_that_worker():
    async with cluster(n_decode=1, policy="round_robin", decode_kw={"hang": True},
                       worker_max_connections=1) as (router, url, prefill, decodes, http):
        first = asyncio.ensure_future(post(http, f"{url}/generate", {"text": "a", "rid": "held"}))
        await until(lambda: decodes[0].requests, what="first request on the decode")
        with pytest.raises(asyncio.TimeoutError):
            await post(http, f"{url}/generate", {"text": "b", "rid": "queued"},
                       timeout=aiohttp.ClientTimeout(total=0.5))
        await until(lambda: "queued" in prefill.aborts, what="abort on the prefill")
        first.cancel()
        await until(lambda: "held" in decodes[0].aborts, what="abort of the held request")
        assert [r["rid"] for r in decodes[0].requests] == ["held"]
        assert "queued" not in decodes[0].aborts
        await until(lambda: router.upstream.waiting == 0 and router.admission.active == 0)


# ------------------------------------------------------------------ 5. slow clients
async def raw_connection(url):
    host, port = url.split("//")[1].split(":")
    return await asyncio.open_connection(host, int(port))


async def test_half_sent_headers_and_silent_connections_are_closed():
    async with cluster(n_decode=2, client_header_timeout=0.3) as (router, url, prefill, decodes, http):
        conns = [await raw_connection(url) for _ in range(6)]
        for reader, writer in conns[:3]:
            writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Ty")
        for reader, writer in conns:
            assert await asyncio.wait_for(reader.read(), 20) == b""  # closed by the router
        assert router.metrics.value("errors", kind="header_timeout") == 6
        # a keep-alive connection stays usable between requests
        for i in range(2):
            st, raw = await post(http, f"{url}/generate", {"text": f"topic:1 {i}"})
            assert st == 200, raw


async def test_slow_bodies_take_no_admission_slot_and_end_in_408():
    async with cluster(n_decode=2, max_inflight=2, client_body_timeout=0.5) as (
            router, url, prefill, decodes, http):
        slow = []
        for _ in range(5):
            reader, writer = await raw_connection(url)
            writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nContent-Length: 100\r\n\r\n{\"text\": ")
            slow.append((reader, writer))
        await until(lambda: len(router.guards.live) >= 5 and all(
            g.busy for g in router.guards.live.values()), what="slow bodies being read")
        for i in range(4):
            st, raw = await post(http, f"{url}/generate", {"text": f"topic:0 {i}"})
            assert st == 200, raw
        for reader, writer in slow:
            head = await asyncio.wait_for(reader.read(), 20)
            assert head.startswith(b"HTTP/1.1 408"), head[:80]
            writer.close()
        assert router.metrics.value("errors", kind="body_timeout") == 5
        assert router.metrics.value("overloaded") == 0


# ------------------------------------------------------------------ minor items
async def test_client_errors_name_no_worker_address_and_all_decodes_down_says_when_to_retry():
    async with cluster(n_decode=2, dead_decodes=(0, 1), policy="round_robin",
                       health_interval=0) as (router, url, prefill, decodes, http):
        async with http.post(f"{url}/generate", data=orjson.dumps({"text": "a"})) as r:
            body = await r.read()
            assert r.status == 503 and r.headers.get("Retry-After"), body
        assert b"127.0.0.1" not in body and b"decode server" in body
        await until(lambda: prefill.aborts, what="the prefill's abort")
    async with cluster(n_decode=2, policy="round_robin",
                       prefill_kw={"fail_first": 1, "fail_body": "text"}) as (
            router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "a"})
        assert st == 500 and b"127.0.0.1" not in raw and b"stub p0 failure" in raw
        # the decode was never sent: no abort goes there
        assert not any(d.aborts for d in decodes) or any(d.requests for d in decodes)


async def test_status_is_an_admin_endpoint():
    async with cluster(n_decode=2, admin_token="s3cret") as (router, url, prefill, decodes, http):
        async with http.get(f"{url}/eldr/status") as r:
            assert r.status == 403
        async with http.get(f"{url}/eldr/status", headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 200 and "decode" in await r.json()
