"""End-to-end tests of the ELDR router against in-process stub PD workers."""

import asyncio
import logging
import time

import aiohttp
import orjson
import pytest

from eldr_sglang.core.policies import RouteRequest
from eldr_sglang.router.http.serve import start_router
from eldr_sglang.testing.stub_worker import KvHandoff, StubWorker, ToyArtifact, topic_counts
from tests.integration.helpers import BOOT_PORT, cluster, post, until

pytestmark = pytest.mark.timeout(30)


async def test_late_binding_flow_routes_by_signature():
    async with cluster() as (router, url, prefill, decodes, http):
        for topic in (2, 0, 3):
            st, raw = await post(http, f"{url}/generate",
                                 {"text": f"topic:{topic} hello", "sampling_params": {}})
            assert st == 200, raw
            out = orjson.loads(raw)
            # the chosen decode is the one the policy picks for the posted counts
            counts = topic_counts(f"topic:{topic} hello")
            sig = router.encoder.encode({"layers": [0, 1], "counts": counts})
            assert out["meta_info"]["server"] == f"d{router.policy.choose(RouteRequest(sig), [0] * 4)}"
            assert out["meta_info"]["server"] == f"d{topic}"
            pbody = prefill.requests[-1]
            dbody = decodes[topic].requests[-1]
            for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid"):
                assert pbody[k] == dbody[k]
            assert pbody["bootstrap_host"] == "127.0.0.1"
            assert pbody["bootstrap_port"] == BOOT_PORT
            assert 0 <= pbody["bootstrap_room"] < 2**63
            assert out["meta_info"]["bootstrap_room"] == pbody["bootstrap_room"]
        assert sum(len(d.requests) for d in decodes) == 3
        assert router.metrics.value("fallbacks") == 0
        async with http.get(f"{url}/eldr/status") as r:
            status = await r.json()
        assert status["policy"] == "eldr" and status["loads"] == [0, 0, 0, 0]
        assert status["counters"]["signatures_used"] == 3
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        assert 'eldr_router_requests_total{decode="' in text
        assert "eldr_router_signature_wait_seconds_count 3.0" in text


async def test_kv_handoff_stubs_keep_sglang_pd_order():
    """Stub fidelity: a decode answers only after its prefill, a prefill only once a
    decode took its room; a side left alone times out with 500; no entry is kept."""
    kv = KvHandoff(timeout=0.5)
    p, d = StubWorker("prefill", kv=kv, send_signature=False), StubWorker("decode", kv=kv)
    purl, durl = await p.start(), await d.start()
    try:
        async with aiohttp.ClientSession() as http:
            body = {"text": "x", "bootstrap_room": 7}
            dec = asyncio.ensure_future(post(http, f"{durl}/generate", body))
            await until(lambda: d.requests, 10, "the decode stub to take the request")
            assert not dec.done()  # waits for the prefill of room 7
            (pst, _), (dst, raw) = await asyncio.gather(post(http, f"{purl}/generate", body), dec)
            assert pst == dst == 200 and orjson.loads(raw)["meta_info"]["bootstrap_room"] == 7
            assert len(kv) == 0
            t0 = time.monotonic()
            st, raw = await post(http, f"{purl}/generate", {"text": "x", "bootstrap_room": 8})
            assert st == 500 and b"KV transfer" in raw and time.monotonic() - t0 >= 0.45
            assert len(kv) == 0
    finally:
        await p.stop()
        await d.stop()


async def test_late_binding_under_the_pd_dependency():
    """ELDR's order (prefill, signature, then decode) and a blind policy's (both at
    once) both complete against workers that keep SGLang's PD dependency."""
    for policy in ("eldr", "round_robin"):
        kv = KvHandoff(timeout=5)
        async with cluster(policy=policy, prefill_kw={"kv": kv}, decode_kw={"kv": kv}) as (
                router, url, prefill, decodes, http):
            outs = await asyncio.gather(*(post(http, f"{url}/generate", {"text": f"topic:{i % 4} q"})
                                          for i in range(16)))
            assert all(st == 200 for st, _ in outs), outs
            if policy == "eldr":
                assert [orjson.loads(raw)["meta_info"]["server"] for _, raw in outs[:4]] == \
                    ["d0", "d1", "d2", "d3"]
            assert len(kv) == 0 and router.metrics.value("fallbacks") == 0


async def test_batch_gets_list_fields_and_one_decode():
    async with cluster() as (router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": ["topic:1 a", "topic:1 b"]})
        assert st == 200, raw
        out = orjson.loads(raw)
        assert [o["meta_info"]["server"] for o in out] == ["d1", "d1"]
        body = prefill.requests[-1]
        assert body["bootstrap_host"] == ["127.0.0.1"] * 2
        assert body["bootstrap_port"] == [BOOT_PORT] * 2
        assert len(set(body["bootstrap_room"])) == 2 and len(body["rid"]) == 2
        assert decodes[1].requests[-1]["bootstrap_room"] == body["bootstrap_room"]
        assert router.metrics.value("events", event="signatures_used") == 2
        st, raw = await post(http, f"{url}/generate", {"input_ids": [[1, 2], [3, 4], [5]]})
        assert st == 200 and len(orjson.loads(raw)) == 3
        assert len(set(prefill.requests[-1]["bootstrap_room"])) == 3


async def test_batch_with_one_signature_missing_uses_the_other_and_counts_the_gap():
    """A batch waits for every room up to the timeout; a room whose message never
    comes falls back (counted) and the batch routes by the signatures that came."""
    def counts(text):  # "lost" items get an unusable message (wrong layer count)
        return topic_counts(text) if "lost" not in text else [[1] * 8]
    async with cluster(prefill_kw={"counts_fn": counts}, signature_timeout=0.5) as (
            router, url, prefill, decodes, http):
        t0 = time.monotonic()
        st, raw = await post(http, f"{url}/generate", {"text": ["topic:2 a", "lost b"]})
        assert st == 200, raw
        assert 0.45 < time.monotonic() - t0 < 5  # waited for the missing room, then went on
        assert [o["meta_info"]["server"] for o in orjson.loads(raw)] == ["d2", "d2"]
        assert router.metrics.value("events", event="signatures_used") == 1
        assert router.metrics.value("fallbacks", reason="timeout") == 1 and not router.board.waiters


async def test_streaming_passes_through():
    async with cluster(decode_kw={"stream_chunks": 4, "stream_delay": 0.02}) as (
            router, url, prefill, decodes, http):
        for ep, body in (("generate", {"text": "topic:3 x", "stream": True}),
                         ("v1/chat/completions", {"messages": [{"role": "user", "content": "topic:3"}],
                                                  "stream": True})):
            async with http.post(f"{url}/{ep}", json=body) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events = [line async for line in r.content if line.strip()]
            assert events[-1] == b"data: [DONE]\n"
            data = [orjson.loads(e[6:]) for e in events[:-1]]
            assert [d["chunk"] for d in data] == [0, 1, 2, 3]
            assert {d["meta_info"]["server"] for d in data} == {"d3"}
        assert router.decodes[3].inflight == 0


async def test_signature_timeout_falls_back_without_hanging():
    async with cluster(prefill_kw={"send_signature": False}, signature_timeout=0.3) as (
            router, url, prefill, decodes, http):
        t0 = time.perf_counter()
        st, raw = await post(http, f"{url}/generate", {"text": "topic:2 y"})
        dt = time.perf_counter() - t0
        assert st == 200, raw
        assert 0.25 < dt < 2.0
        assert router.metrics.value("fallbacks", reason="timeout") == 1
        assert router.metrics.value("fallbacks") == 1


async def test_layer_mismatch_counts_error_and_falls_back():
    async with cluster(prefill_kw={"layers": [0, 5]}) as (router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "topic:2 y"})
        assert st == 200, raw
        assert router.metrics.value("errors", kind="signature_layer_mismatch") == 1
        assert router.metrics.value("fallbacks", reason="layer_mismatch") == 1


async def test_early_signature_is_buffered_then_claimed():
    async with cluster() as (router, url, prefill, decodes, http):
        msg = {"bootstrap_room": 12345, "rid": "r", "prompt_tokens": 3, "cached_tokens": 0,
               "layers": [0, 1], "counts": topic_counts("topic:1")}
        st, raw = await post(http, f"{url}/eldr/signature", [msg])
        assert st == 200 and orjson.loads(raw)["buffered"] == 1
        fut = router.board.expect(12345)  # waiter registered after the message
        assert fut.done() and fut.result()["rid"] == "r"
        router.board.discard(12345)
        # bad messages are rejected with 400
        st, raw = await post(http, f"{url}/eldr/signature", {"bootstrap_room": -1})
        assert st == 400 and "error" in orjson.loads(raw)


async def test_early_signature_end_to_end():
    """Signature delivered to the board before the request registers its waiter."""
    async with cluster() as (router, url, prefill, decodes, http):
        orig_expect = router.board.expect

        def late_expect(room):  # the message for `room` arrives first
            router.board.post({"bootstrap_room": room, "layers": [0, 1],
                               "counts": topic_counts("topic:3")})
            return orig_expect(room)

        router.board.expect = late_expect
        prefill.send_signature = False
        st, raw = await post(http, f"{url}/generate", {"text": "no topic here"})
        assert st == 200 and orjson.loads(raw)["meta_info"]["server"] == "d3"
        assert router.metrics.value("fallbacks") == 0


async def test_bad_input_is_400_json():
    async with cluster() as (router, url, prefill, decodes, http):
        for ep, body in (("generate", b"{not json"), ("generate", b"[1, 2]"),
                         ("generate", orjson.dumps({"sampling_params": {}})),
                         ("generate", orjson.dumps({"text": []})),
                         ("generate", orjson.dumps({"text": "a", "rid": 5})),
                         ("v1/completions", orjson.dumps({"model": "m"})),
                         ("v1/chat/completions", orjson.dumps({"messages": "hi"}))):
            st, raw = await post(http, f"{url}/{ep}", body)
            assert st == 400, (ep, body, raw)
            assert "error" in orjson.loads(raw)
        async with http.get(f"{url}/nope") as r:
            assert r.status == 404 and "error" in await r.json()
        assert router.metrics.value("errors", kind="bad_request") == 7
        assert not prefill.requests


async def test_down_decode_returns_json_error_and_is_marked():
    async with cluster(n_decode=1, dead_decodes=(0,)) as (router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "topic:0"})
        assert st == 503 and "unavailable" in orjson.loads(raw)["error"]
        assert router.metrics.value("upstream_failures", role="decode") == 1
        assert not router.decodes[0].available()
        await until(lambda: prefill.aborts, 10, "the held prefill to be released")


async def test_down_decode_is_retried_elsewhere_and_avoided():
    async with cluster(n_decode=2, dead_decodes=(1,)) as (router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "topic:1"})
        assert st == 200 and orjson.loads(raw)["meta_info"]["server"] == "d0"
        assert router.metrics.value("retries", role="decode") == 1
        st, raw = await post(http, f"{url}/generate", {"text": "topic:1"})
        assert st == 200 and router.metrics.value("upstream_failures", role="decode") == 1  # skipped while unhealthy


async def test_prefill_error_before_decode_is_returned():
    async with cluster(prefill_kw={"fail_rate": 1.0, "send_signature": False}) as (
            router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "topic:1"})
        assert st == 500 and "failure" in orjson.loads(raw)["error"]["message"]
        assert not any(d.requests for d in decodes)
    async with cluster(policy="jsq", prefill_kw={"fail_rate": 1.0},
                       decode_kw={"hang": True}) as (router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "topic:1"})
        assert st == 500  # decode was pending; prefill failed -> error returned, decode aborted
        await until(lambda: any(d.aborts for d in decodes), 10, "the pending decode's abort")
        assert sum(len(d.aborts) for d in decodes) == 1


async def test_prefill_task_that_raises_ends_the_signature_wait():
    """A bug in the prefill call (an exception, not a worker error) gives a 500 JSON
    error at once, not after the signature timeout; nothing is left waiting."""
    async with cluster(prefill_kw={"send_signature": False}, signature_timeout=20) as (
            router, url, prefill, decodes, http):
        async def broken(fl):
            raise RuntimeError("boom")
        router.dispatcher.prefill = broken
        t0 = time.monotonic()
        st, raw = await post(http, f"{url}/generate", {"text": "topic:1"})
        assert st == 500 and "RuntimeError" in orjson.loads(raw)["error"]
        assert time.monotonic() - t0 < 5 and not router.board.waiters
        assert not any(d.requests for d in decodes)


async def test_client_disconnect_aborts_both_servers():
    async with cluster(decode_kw={"hang": True}, prefill_kw={"hang": True}) as (
            router, url, prefill, decodes, http):
        with pytest.raises(asyncio.TimeoutError):
            await post(http, f"{url}/generate", {"text": "topic:2", "rid": "abc"},
                       timeout=aiohttp.ClientTimeout(total=0.5))
        await until(lambda: prefill.aborts and decodes[2].aborts, 10, "both aborts")
        assert prefill.aborts == ["abc"] and decodes[2].aborts == ["abc"]
        assert router.metrics.value("events", event="client_disconnects") == 1
        await until(lambda: router.decodes[2].inflight == 0, 10, "decode 2 to hold nothing")


async def test_stream_disconnect_aborts_both_servers():
    async with cluster(decode_kw={"stream_chunks": 100, "stream_delay": 0.05}) as (
            router, url, prefill, decodes, http):
        r = await http.post(f"{url}/generate", json={"text": "topic:0", "stream": True})
        await r.content.readline()
        r.close()  # drop the connection mid-stream
        await until(lambda: prefill.aborts and decodes[0].aborts, 10, "both aborts")
        rid = prefill.requests[-1]["rid"]
        assert prefill.aborts == [rid] and decodes[0].aborts == [rid]


async def test_signature_free_policies_and_domain_label():
    async with cluster(policy="round_robin") as (router, url, prefill, decodes, http):
        servers = []
        for _ in range(4):
            st, raw = await post(http, f"{url}/generate", {"text": "x"})
            servers.append(orjson.loads(raw)["meta_info"]["server"])
        assert servers == ["d0", "d1", "d2", "d3"]
        assert router.metrics.value("signature_wait_seconds_count") == 0
    async with cluster(policy="domain", domain_map={"math": [2]}, label_header="X-Label",
                       label_field="eldr_label") as (router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "x"}, headers={"X-Label": "math"})
        assert orjson.loads(raw)["meta_info"]["server"] == "d2"
        st, raw = await post(http, f"{url}/generate", {"text": "x", "eldr_label": "math"})
        assert orjson.loads(raw)["meta_info"]["server"] == "d2"
        assert "eldr_label" not in decodes[2].requests[-1]


async def test_admin_servers_and_proxies():
    async with cluster() as (router, url, prefill, decodes, http):
        extra = StubWorker("decode", name="d4")
        eurl = await extra.start()
        st, raw = await post(http, f"{url}/eldr/servers", {"remove": [decodes[1].url]})
        assert st == 200 and orjson.loads(raw)["policy_state"]["ownership"] == [[0, 1], [2], [3]]
        st, raw = await post(http, f"{url}/generate", {"text": "topic:1"})
        assert orjson.loads(raw)["meta_info"]["server"] == "d0"  # region 1 -> nearest owner
        st, raw = await post(http, f"{url}/eldr/servers", {"add": [eurl]})
        assert orjson.loads(raw)["policy_state"]["ownership"] == [[0], [2], [3], [1]]
        st, raw = await post(http, f"{url}/generate", {"text": "topic:1"})
        assert orjson.loads(raw)["meta_info"]["server"] == "d4"
        st, raw = await post(http, f"{url}/eldr/servers", {"remove": ["http://nowhere:1"]})
        assert st == 400
        for path in ("v1/models", "get_model_info", "get_server_info", "server_info",
                     "health", "health_generate"):
            async with http.get(f"{url}/{path}") as r:
                assert r.status == 200, path
        async with http.get(f"{url}/get_server_info") as r:
            assert len((await r.json())["decode"]) == 4
        await extra.stop()


async def test_cli_with_real_calibration_artifact(tmp_path):
    art_mod = pytest.importorskip("eldr_sglang.core.artifact")
    from eldr_sglang.core.traces import ModelSpec
    from eldr_sglang.router.cli import build_router, parse_args

    toy = ToyArtifact(num_clusters=3)
    art = art_mod.CalibrationArtifact(model=ModelSpec("toy-moe", 4, 8, 2), variant="idf",
                                      layers=[0, 1], idf=toy.idf, centroids=toy.centroids, tau=0.1)
    path = art.save(tmp_path / "artifact.json")

    workers = [StubWorker("prefill", name="p0")] + [StubWorker("decode", name=f"d{i}")
                                                     for i in range(3)]
    urls = [await w.start() for w in workers]
    args = parse_args(["--prefill", urls[0], str(BOOT_PORT), "--prefill", urls[0], "none",
                       *sum((["--decode", u] for u in urls[1:]), []),
                       "--policy", "eldr", "--calibration", str(path), "--signature-timeout", "1"])
    router = build_router(args)
    assert router.tau == pytest.approx(0.1) and router.prefills[1].bootstrap_port is None
    runner, port = await start_router(router)
    workers[0].signature_url = f"http://127.0.0.1:{port}/eldr/signature"
    async with aiohttp.ClientSession() as http:
        for topic in (1, 2, 0):
            st, raw = await post(http, f"http://127.0.0.1:{port}/generate",
                                 {"text": f"topic:{topic}"})
            assert st == 200 and orjson.loads(raw)["meta_info"]["server"] == f"d{topic}"
    assert router.metrics.value("fallbacks") == 0
    await runner.cleanup()
    for w in workers:
        await w.stop()


async def test_parse_message_validation_and_board_ttl():
    from eldr_sglang.router.signals.signatures import SignatureBoard, parse_message

    ok = parse_message({"bootstrap_room": 1, "layers": [0, 1], "counts": [[1, 2], [3, 4]]})
    assert ok["counts"].shape == (2, 2)
    for bad in ({"bootstrap_room": True, "layers": [0], "counts": [[1]]},
                {"bootstrap_room": 1, "layers": [0, 1], "counts": [[1, 2], [3]]},
                {"bootstrap_room": 1, "layers": [0], "counts": [["a"]]},
                {"bootstrap_room": 1, "layers": [0], "counts": [[True]]},
                {"bootstrap_room": 1, "layers": [0, 1], "counts": [[1, 2]]},
                {"bootstrap_room": 1, "layers": [0], "counts": [[1]], "rid": 3}, [1]):
        with pytest.raises(ValueError):
            parse_message(bad)

    now = [0.0]
    board = SignatureBoard(ttl=5.0, clock=lambda: now[0])
    assert board.post({"bootstrap_room": 7}) is False
    now[0] = 10.0
    board.post({"bootstrap_room": 8})  # sweeps the expired room 7
    assert not board.expect(7).done() and board.expect(8).done() and board.expired == 1


async def test_signatures_over_the_tcp_stream_route_like_http_ones(caplog):
    with caplog.at_level(logging.WARNING, logger="eldr_sglang.router"):
        async with cluster(signature_port=0, signature_max_kb=1) as (
                router, url, prefill, decodes, http):
            assert router.intake.port
            prefill.signature_url = f"tcp://127.0.0.1:{router.intake.port}"
            for topic in (3, 1, 2, 0):
                st, raw = await post(http, f"{url}/generate", {"text": f"topic:{topic} hi"})
                assert st == 200 and orjson.loads(raw)["meta_info"]["server"] == f"d{topic}", raw
            assert router.metrics.value("fallbacks") == 0
            assert router.metrics.value("events", event="signatures_used") == 4
            assert router.metrics.value("events", event="signature_streams") == 1  # one kept-open connection
            # a bad line is counted and skipped; the stream stays usable
            _, w = await asyncio.open_connection("127.0.0.1", router.intake.port)
            w.write(b"{not json\n" + orjson.dumps({"bootstrap_room": 5, "layers": [0]}) + b"\n"
                    + orjson.dumps({"bootstrap_room": 6, "layers": [0, 1],
                                    "counts": [[1] * 8, [2] * 8]}) + b"\n")
            await w.drain()
            await until(lambda: 6 in router.board.buffer, 10, "room 6 on the board")
            assert 6 in router.board.buffer and 5 not in router.board.buffer
            assert router.metrics.value("signature_messages", outcome="invalid") == 2
            # a line over the body limit closes that connection (and only that one)
            w.write(b"[" + b"1," * 2000 + b"1]\n")
            await w.drain()
            await until(lambda: router.metrics.value("signature_messages", outcome="invalid") == 3, 10,
                        "the third invalid line")
            assert router.metrics.value("signature_messages", outcome="invalid") == 3
            w.close()
            st, raw = await post(http, f"{url}/generate", {"text": "topic:2 again"})
            assert st == 200 and orjson.loads(raw)["meta_info"]["server"] == "d2"
    assert "refused (bad_json)" in caplog.text and "over 1024 bytes" in caplog.text
