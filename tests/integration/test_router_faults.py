"""The router's fault matrix, against stub workers with failure knobs.

For every request the client gets a complete answer or a clear error (JSON
``{"error": ...}`` with a 4xx/5xx status, or a final SSE error event) within the
configured bounds; nothing hangs; a request whose prefill failed never gets 200;
afterwards nothing is left in flight and memory stays bounded.
"""

import asyncio
import contextlib
import time

import aiohttp
import orjson
import pytest

from eldr_sglang.router.pool import upstream
from eldr_sglang.router import Router, start_router
from eldr_sglang.testing.stub_worker import KvHandoff, StubWorker, ToyArtifact
from tests.integration.helpers import BOOT_PORT, free_port, post, until

pytestmark = pytest.mark.timeout(60)
# short bounds so faults end quickly, loose enough for a loaded 2-core machine
FAST = dict(health_interval=0.1, health_timeout=1.0, health_cooldown=0.3, connect_timeout=5.0,
            first_byte_timeout=3.0, idle_timeout=2.0, signature_timeout=0.5, load_interval=0)


@contextlib.asynccontextmanager
async def fleet(n_decode=3, policy="eldr", prefill_kw=None, decode_kw=None, kv=False,
                dead_decodes=(), **router_kw):
    """1 prefill + n_decode stubs (optionally SGLang's PD order) and a router."""
    handoff = KvHandoff(timeout=3.0) if kv else None
    prefill = StubWorker("prefill", name="p0", kv=handoff, **(prefill_kw or {}))
    decodes = [StubWorker("decode", name=f"d{i}", kv=handoff, **(decode_kw or {}))
               for i in range(n_decode)]
    purl = await prefill.start()
    durls = [await d.start() for d in decodes]
    for i in dead_decodes:
        await decodes[i].stop()
        durls[i] = f"http://127.0.0.1:{free_port()}"
    art = router_kw.pop("artifact", ToyArtifact(num_clusters=n_decode) if policy == "eldr" else None)
    router = Router([(purl, BOOT_PORT)], durls, policy, artifact=art,
                    **{"signature_port": 0, **FAST, **router_kw})
    runner, port = await start_router(router)
    http = aiohttp.ClientSession()
    try:
        yield router, f"http://127.0.0.1:{port}", prefill, decodes, http
    finally:
        await http.close()
        await runner.cleanup()
        for w in [prefill] + decodes:
            w.thaw()
            await w.stop()


async def one(http, url, i, stream, topic=None):
    """(rid, status, body, seconds, headers) of one request; the client waits at most 30 s."""
    rid = f"r{i}"
    body = {"text": f"topic:{i % 3 if topic is None else topic} request {i}", "rid": rid,
            "stream": stream}
    t0 = time.monotonic()
    async with http.post(f"{url}/generate", data=orjson.dumps(body),
                         timeout=aiohttp.ClientTimeout(total=30)) as r:
        data = await r.read()
        return rid, r.status, data, time.monotonic() - t0, dict(r.headers)


def verdict(status: int, data: bytes, stream: bool) -> str:
    """"ok" (complete answer) or "error" (clear error); anything else fails the test."""
    if status != 200:
        assert 400 <= status < 600, status
        assert "error" in orjson.loads(data), data
        return "error"
    if not stream:
        out = orjson.loads(data)
        assert "meta_info" in out and "error" not in out, data
        return "ok"
    events = [ln[6:] for ln in data.split(b"\n") if ln.startswith(b"data: ")]
    assert events, data
    if events[-1] == b"[DONE]":
        assert all("error" not in orjson.loads(e) for e in events[:-1]), data
        return "ok"
    assert "error" in orjson.loads(events[-1]), data  # a final SSE error event
    return "error"


async def drive(router, url, http, n=24, bound=20.0, topic=None):
    """n concurrent requests (half streamed; topics i % 3 unless given); checks every
    outcome; returns them by rid."""
    results = await asyncio.wait_for(asyncio.gather(
        *(one(http, url, i, stream=i % 2 == 1, topic=topic) for i in range(n))), bound)
    out = {}
    for i, (rid, st, data, secs, headers) in enumerate(results):
        out[rid] = (verdict(st, data, i % 2 == 1), st, secs, headers)
    await settled(router)
    return out


async def settled(router, timeout=10.0):
    """Nothing left in flight in the router (waits on the condition)."""
    await until(lambda: not (router.admission.active or router.board.waiters
                             or any(w.inflight for w in router.pool.all())), timeout, "the router to hold no request")


def failed_rids(worker: StubWorker) -> set[str]:
    return set(worker.failed)


# ------------------------------------------------------------------ prefill faults
@pytest.mark.parametrize("knobs, kv, decode_kw", [
    ({"fail_rate": 0.3}, False, {}),                                 # 5xx after its signature
    ({"fail_rate": 0.3, "signature_on_failure": False}, False, {}),  # 5xx before any signature
    ({"fail_after_kv": 0.3}, True, {"latency": 0.3}),                # 5xx while the decode runs
    ({"fail_after_kv": 0.3, "latency": 0.3}, True, {}),              # 5xx after the decode answered
    ({"fail_rate": 0.3, "fail_body": "detail"}, True, {}),           # SGLang's abort body, PD order
], ids=["after-signature", "before-signature", "during-decode", "after-decode",
        "detail-body-pd-order"])
async def test_failed_prefill_is_never_a_200(knobs, kv, decode_kw):
    async with fleet(prefill_kw={"seed": 3, **knobs}, kv=kv, decode_kw=decode_kw) as (
            router, url, prefill, decodes, http):
        out = await drive(router, url, http, n=40)
        failed = failed_rids(prefill)
        assert 4 <= len(failed) <= 30, failed  # the knob did fail some
        for rid in failed:
            assert out[rid][0] == "error", (rid, out[rid])
        assert sum(v[0] == "ok" for v in out.values()) == 40 - len(failed)
        if decode_kw:  # the decode was still running: aborted there
            await until(lambda: sum(len(d.aborts) for d in decodes) >= len(failed))


async def test_prefill_disconnects_and_frozen_prefill_end_in_clear_errors():
    async with fleet(prefill_kw={"crash_on": 6, "crash_mode": "drop"}) as (
            router, url, prefill, decodes, http):
        out = await drive(router, url, http, n=12)
        assert sum(v[0] == "error" for v in out.values()) >= 6
    async with fleet() as (router, url, prefill, decodes, http):
        prefill.freeze()
        out = await drive(router, url, http, n=6)
        assert all(v[0] == "error" and v[1] in (502, 503, 504) for v in out.values()), out
        assert max(v[2] for v in out.values()) < 20  # first-byte timeout 3 s, not 1800 s


# ------------------------------------------------------------------ decode faults
async def test_frozen_decode_times_out_and_the_others_serve():
    async with fleet(policy="round_robin", kv=False) as (router, url, prefill, decodes, http):
        decodes[1].freeze()
        out = await drive(router, url, http, n=12)
        bad = [rid for rid, v in out.items() if v[0] == "error"]
        assert bad and all(out[rid][1] == 504 or out[rid][0] == "error" for rid in bad)
        assert max(v[2] for v in out.values()) < 15
        # health checks time out too: taken out, later requests avoid it
        await until(lambda: not router.pool.decodes[1].available(), 10, "decode 1 taken out")
        out = await drive(router, url, http, n=6)
        assert all(v[0] == "ok" for v in out.values()), out


async def test_decode_killed_mid_load_and_all_decodes_down():
    async with fleet(decode_kw={"latency": 0.2}, kv=True) as (router, url, prefill, decodes, http):
        decodes[1].crash_on, decodes[1].crash_mode = 3, "stop"
        out = await drive(router, url, http, n=30)
        assert sum(v[0] == "ok" for v in out.values()) >= 20
    async with fleet(dead_decodes=(0, 1, 2)) as (router, url, prefill, decodes, http):
        out = await drive(router, url, http, n=6)
        assert all(v[1] == 503 for v in out.values()), out
        assert max(v[2] for v in out.values()) < 10
        await until(lambda: prefill.aborts)  # the prefill's held KV is released


async def test_slow_first_byte_within_bounds_succeeds():
    async with fleet(decode_kw={"latency": 0.5}, prefill_kw={"latency": 0.3}) as (
            router, url, prefill, decodes, http):
        out = await drive(router, url, http, n=12)
        assert all(v[0] == "ok" for v in out.values()), out


# ------------------------------------------------------------------ signature faults
@pytest.mark.parametrize("knobs", [{"send_signature": False}, {"signature_delay": 1.0}],
                         ids=["lost", "late"])
async def test_lost_and_late_signatures_fall_back_and_stay_bounded(knobs):
    async with fleet(prefill_kw=knobs, signature_timeout=0.2, signature_timeout_min=0.1) as (
            router, url, prefill, decodes, http):
        out = await drive(router, url, http, n=12)
        assert all(v[0] == "ok" for v in out.values()), out
        assert router.metrics.value("fallbacks", reason="timeout") == 12
        if "signature_delay" in knobs:  # late messages are kept only for the TTL
            await until(lambda: len(prefill.signatures) >= 12, 10, "the late signatures")
        router.board.clock = lambda: time.monotonic() + 3600
        router.board.sweep()
        assert not router.board.buffer and router.board.buffered_bytes == 0


# ------------------------------------------------------------------ overload and input
async def test_overload_answers_429_with_retry_after_and_blames_nobody():
    async with fleet(decode_kw={"latency": 0.3}, max_inflight=4) as (router, url, prefill, decodes, http):
        out = await drive(router, url, http, n=30)
        codes = [v[1] for v in out.values()]
        assert codes.count(429) >= 10 and codes.count(200) >= 4, codes
        assert all(v[3].get("Retry-After") for v in out.values() if v[1] == 429)
        assert router.metrics.value("overloaded") == codes.count(429)
        assert all(w.breaker.state == "closed" for w in router.pool.all())
        assert router.metrics.value("upstream_failures") == 0


async def test_router_out_of_file_descriptors_is_not_the_workers_fault():
    async with fleet() as (router, url, prefill, decodes, http):
        real = router.upstream._connect

        async def emfile(*a, **kw):
            raise upstream.LocalResourceError("router out of file descriptors (EMFILE)")
        router.upstream._connect = emfile
        out = await drive(router, url, http, n=6)
        assert all(v[1] == 503 and v[3].get("Retry-After") for v in out.values()), out
        assert all(w.breaker.state == "closed" and w.failures == 0 for w in router.pool.all())
        router.upstream._connect = real
        out = await drive(router, url, http, n=6)
        assert all(v[0] == "ok" for v in out.values())


async def test_malformed_input_and_oversized_batches_are_4xx_json():
    async with fleet(max_batch=8) as (router, url, prefill, decodes, http):
        cases = [b"{not json", b"[]", b'{"text": 5}', b'{"text": []}',
                 b'{"input_ids": [[1], "x"]}', b'{"text": "a", "rid": 7}',
                 orjson.dumps({"text": ["x"] * 9}), orjson.dumps({"input_ids": [[1]] * 20000})]
        for body in cases:
            st, raw = await post(http, f"{url}/generate", body)
            assert 400 <= st < 500 and "error" in orjson.loads(raw), (body[:40], st, raw)
        st, raw = await post(http, f"{url}/generate", {"text": ["x"] * 9})
        assert st == 413 and "--max-batch" in orjson.loads(raw)["error"]
        assert not prefill.requests  # nothing reached a worker
        st, raw = await post(http, f"{url}/generate", {"text": ["topic:1"] * 8})
        assert st == 200


# ------------------------------------------------------------------ breaker
async def test_half_open_trial_ending_in_4xx_or_client_disconnect_unlocks_the_server():
    async with fleet(n_decode=2, decode_kw={"fail_first": 3}, breaker_threshold=3,
                     health_interval=0, health_cooldown=0.2) as (router, url, prefill, decodes, http):
        d0 = router.pool.decodes[0]
        for _ in range(3):
            st, _ = await post(http, f"{url}/generate", {"text": "topic:0"})
        assert d0.breaker.state == "open"
        # trial 1 ends in a client disconnect: the server is not locked out
        await until(d0.breaker.allows)
        decodes[0].hang = True
        with pytest.raises(asyncio.TimeoutError):
            await post(http, f"{url}/generate", {"text": "topic:0"},
                       timeout=aiohttp.ClientTimeout(total=0.3))
        await settled(router)
        assert d0.breaker.allows(), d0.breaker.describe()
        # trial 2 ends in a 4xx (the server answered): the breaker closes
        decodes[0].hang = False
        decodes[0].fail_first, decodes[0].fail_status = 10**6, 400
        st, raw = await post(http, f"{url}/generate", {"text": "topic:0"})
        assert st == 400 and d0.breaker.state == "closed"


# ------------------------------------------------------------------ bounded memory
async def test_signature_intake_is_bounded_by_bytes_and_shape():
    async with fleet(signature_buffer_mb=0.02, signature_max_kb=64) as (
            router, url, prefill, decodes, http):
        port = router.intake.port
        _, w = await asyncio.open_connection("127.0.0.1", port)
        big = {"bootstrap_room": 1, "layers": [0, 1], "counts": [[1] * 8] * 2, "pad": "x" * 200_000}
        w.write(orjson.dumps(big) + b"\n")  # over the line limit: refused, stream closed
        _, w = await asyncio.open_connection("127.0.0.1", port)
        wrong = {"bootstrap_room": 2, "layers": [0, 1], "counts": [[1] * 4000] * 2}
        w.write(orjson.dumps(wrong) + b"\n")  # not the artifact's layers x experts
        for room in range(100, 400):  # valid messages for rooms nobody waits for
            w.write(orjson.dumps({"bootstrap_room": room, "layers": [0, 1],
                                  "counts": [[1] * 8] * 2}) + b"\n")
        await w.drain()
        await until(lambda: router.metrics.value("signature_messages", outcome="unclaimed") >= 300, 10,
                    "300 unclaimed signature messages")
        assert router.metrics.value("errors", kind="signature_too_large") == 1
        assert router.metrics.value("errors", kind="signature_bad_counts") == 1
        assert router.board.buffered_bytes <= 0.02 * (1 << 20)
        assert len(router.board.buffer) < 300
        w.close()


async def test_decision_log_is_bounded_and_admin_only():
    async with fleet(decisions_kept=5, admin_token="s3cret") as (router, url, prefill, decodes, http):
        await drive(router, url, http, n=12)
        assert len(router.decisions) == 5
        for path, method in (("/eldr/decisions", "GET"), ("/flush_cache", "POST")):
            async with http.request(method, url + path) as r:
                assert r.status == 403 and "error" in await r.json()
        auth = {"Authorization": "Bearer s3cret"}
        async with http.get(url + "/eldr/decisions?last=100000", headers=auth) as r:
            got = await r.json()
        assert r.status == 200 and len(got) == 5
        assert len(got[-1]["messages"][0]["counts"]) == 2  # the counts, rendered as rows
        async with http.get(url + "/eldr/decisions?last=-1", headers=auth) as r:
            assert r.status == 400


async def test_idle_worker_connections_are_closed_by_the_timer():
    async with fleet() as (router, url, prefill, decodes, http):
        await drive(router, url, http, n=24)
        assert router.upstream.open_connections > 0
        await until(lambda: not router.upstream.open_connections, 20, "idle worker connections closed")


# ------------------------------------------------------------------ configuration
async def test_worker_urls_are_validated_on_the_admin_api():
    async with fleet() as (router, url, prefill, decodes, http):
        for bad in ("ftp://x", "http://", "http://h:99999", "http://h:1/path", "x"):
            st, raw = await post(http, f"{url}/eldr/servers", {"add": [bad]})
            assert st == 400 and "error" in orjson.loads(raw), bad
        st, raw = await post(http, f"{url}/eldr/servers", {"add_prefill": ["http://h:1 notaport"]})
        assert st == 400
        assert len(router.pool.decodes) == 3 and len(router.pool.prefills) == 1
        out = await drive(router, url, http, n=6)
        assert all(v[0] == "ok" for v in out.values())


async def test_artifact_tau_zero_is_kept_and_strict_under_concurrent_load():
    art = ToyArtifact(num_clusters=3, tau=0.0)
    async with fleet(artifact=art, decode_kw={"latency": 0.1}) as (router, url, prefill, decodes, http):
        assert router.tau == 0.0
        await drive(router, url, http, n=30, topic=1)
        # strict affinity: every topic-1 request on server 1, however loaded
        assert [len(d.requests) for d in decodes] == [0, 30, 0]
    async with fleet(artifact=art, tau=1.0, decode_kw={"latency": 0.1}) as (
            router, url, prefill, decodes, http):
        assert router.tau == 1.0  # --tau overrides the artifact
        await drive(router, url, http, n=30, topic=1)
        assert all(len(d.requests) >= 5 for d in decodes)  # the band is every server
