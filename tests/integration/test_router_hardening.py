"""Router hardening: admin (calibration reload, auth, config), observability,
reliability (health checks, circuit breaker, retries, drain, bounded state,
body limits) and fault injection, all against stub workers."""

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from eldr_sglang.router import Router, start_router
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.testing.stub_worker import StubWorker, ToyArtifact, topic_counts
from tests.integration.helpers import BOOT_PORT, cluster, free_port, post, save_artifact, until

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parents[2]




async def server_of(http, url, text):
    st, raw = await post(http, f"{url}/generate", {"text": text})
    assert st == 200, raw
    return orjson.loads(raw)["meta_info"]["server"]


# ------------------------------------------------------------------ admin
async def test_reload_calibration_good_bad_and_k_mismatch(tmp_path):
    async with cluster(n_decode=4, artifact=ToyArtifact(num_clusters=4)) as (
            router, url, prefill, decodes, http):
        assert await server_of(http, url, "topic:3") == "d3"
        # bad files: refused with 400 JSON, the old artifact stays
        bad = [str(tmp_path / "missing.json"), save_artifact(tmp_path / "c.json", 4, corrupt=True)]
        (tmp_path / "junk.json").write_text("{not json")
        bad.append(str(tmp_path / "junk.json"))
        for path in bad:
            st, raw = await post(http, f"{url}/eldr/calibration", {"path": path})
            assert st == 400, raw
            assert "previous kept" in orjson.loads(raw)["error"]
        for body in ({}, {"path": 3}, [1]):
            st, raw = await post(http, f"{url}/eldr/calibration", body)
            assert st == 400 and "error" in orjson.loads(raw)
        assert router.encoder.centroids.shape[0] == 4
        assert router.metrics.value("calibration_reloads", outcome="refused") == 6
        assert await server_of(http, url, "topic:3") == "d3"
        # good file with K=2 for 4 decode servers: servers 2, 3 share centroids
        good = save_artifact(tmp_path / "k2.json", 2)
        st, raw = await post(http, f"{url}/eldr/calibration", {"path": good})
        assert st == 200, raw
        out = orjson.loads(raw)
        assert out["artifact"]["num_clusters"] == 2 and out["warnings"]
        own = out["policy_state"]["ownership"]
        assert own == [[0], [1], [0], [1]]  # every server owns one, every centroid owned
        assert router.routing.calibration_path == good
        # topic:1 -> centroid 1, owned by d1 and d3: split by load, never d0/d2
        assert await server_of(http, url, "topic:1") in ("d1", "d3")
        assert await server_of(http, url, "topic:0") in ("d0", "d2")
        # K=6 > N=4: extra centroids go to owners of the nearest ones; all owned
        st, raw = await post(http, f"{url}/eldr/calibration",
                             {"path": save_artifact(tmp_path / "k6.json", 6)})
        own = orjson.loads(raw)["policy_state"]["ownership"]
        assert sorted(k for h in own for k in h) == list(range(6)) and all(own)
        async with http.get(f"{url}/eldr/calibration") as r:
            assert (await r.json())["artifact"]["num_clusters"] == 6
        text = await (await http.get(f"{url}/metrics")).text()
        assert 'eldr_router_calibration_reloads_total{outcome="ok"} 2.0' in text


async def test_admin_auth_token_and_loopback():
    async with cluster(n_decode=2, admin_token="s3cret") as (router, url, prefill, decodes, http):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for ep, body in (("eldr/servers", {"remove": [decodes[1].url]}),
                             ("eldr/calibration", {"path": "/nope"})):
                st, raw = await post(http, f"{url}/{ep}", body, headers=headers)
                assert st == 403, (ep, headers, raw)
                assert "admin" in orjson.loads(raw)["error"]
        assert len(router.decodes) == 2
        st, raw = await post(http, f"{url}/eldr/servers", {"remove": [decodes[1].url]},
                             headers={"Authorization": "Bearer s3cret"})
        assert st == 200 and len(router.decodes) == 1
        st, raw = await post(http, f"{url}/eldr/servers", {"add": "http://x:1"},
                             headers={"Authorization": "Bearer s3cret"})
        assert st == 400  # a string, not a list of URLs
    async with cluster(n_decode=2) as (router, url, prefill, decodes, http):
        st, _ = await post(http, f"{url}/eldr/servers", {})  # loopback, no token: allowed

        class Fake:
            remote, headers = "10.1.2.3", {}
        assert st == 200 and router.admin.allowed(Fake()) is False
        Fake.remote = "::1"
        assert router.admin.allowed(Fake()) is True


def test_config_file_yaml_json_and_cli_override(tmp_path):
    from eldr_sglang.router.cli import build_router, parse_args

    art = save_artifact(tmp_path / "a.json", 2)
    (tmp_path / "r.yaml").write_text(
        "prefill:\n  - http://127.0.0.1:1 8998\n  - [http://127.0.0.1:2, none]\n"
        "decode: [http://127.0.0.1:3, http://127.0.0.1:4]\n"
        f"policy: eldr\ncalibration: {art}\nsignature-timeout: 3\nhealth_interval: 0.5\n"
        "admin-token: tok\nmax-body-mb: 1\nlog-decisions: true\n")
    a = parse_args(["--config", str(tmp_path / "r.yaml"), "--signature-timeout", "7"])
    assert a.prefill == [("http://127.0.0.1:1", 8998), ("http://127.0.0.1:2", None)]
    assert a.decode == ["http://127.0.0.1:3", "http://127.0.0.1:4"]
    assert a.signature_timeout == 7.0 and a.health_interval == 0.5 and a.admin_token == "tok"
    r = build_router(a)
    assert r.config.max_body_mb == 1 and r.dispatcher.decision_level == logging.INFO
    assert r.routing.calibration_path == art
    (tmp_path / "r.json").write_text(json.dumps({"prefill": ["http://p:1"], "decode": ["http://d:1"],
                                                 "policy": "jsq"}))
    a = parse_args(["--config", str(tmp_path / "r.json"), "--decode", "http://other:2"])
    assert a.decode == ["http://other:2"] and a.policy == "jsq" and a.signature_timeout == RouterConfig.signature_timeout
    (tmp_path / "bad.json").write_text(json.dumps({"prefill": ["http://p:1"], "decode": ["x"],
                                                   "no_such_flag": 1}))
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit):  # still needs servers somewhere
        parse_args(["--policy", "jsq"])


# ------------------------------------------------------------------ observability
async def test_metrics_and_decision_log(caplog):
    async with cluster(n_decode=4, log_decisions=True) as (router, url, prefill, decodes, http):
        with caplog.at_level(logging.INFO, logger="eldr_sglang.router.decisions"):
            for t in (0, 1, 2):
                await server_of(http, url, f"topic:{t}")
        lines = [r.getMessage() for r in caplog.records if r.name.endswith("decisions")]
        assert len(lines) == 3
        assert "top3=[('http://" in lines[0] and "band=[0]" in lines[0] and "chosen=0" in lines[0]
        text = await (await http.get(f"{url}/metrics")).text()
        for needle in ('eldr_router_decisions_total{kind="signature",policy="eldr"} 3.0',
                       "eldr_router_band_size_count 3.0", "eldr_router_best_similarity_count 3.0",
                       "eldr_router_added_latency_seconds_count 3.0",
                       'eldr_router_request_duration_seconds_count{endpoint="generate"} 3.0',
                       'eldr_router_worker_requests_total{role="prefill"',
                       'eldr_router_inflight{role="decode"', "eldr_router_signature_wait_seconds_count 3.0",
                       'eldr_router_breaker_state{role="decode"'):
            assert needle in text, needle
        dec = (await (await http.get(f"{url}/eldr/decisions?last=1")).json())[0]
        assert dec["band"] == [decodes[2].url] and dec["reason"] == "band"
        assert len(dec["similarities"]) == 4 and dec["best_similarity"] == pytest.approx(1.0)
        sims = dec["server_similarities"]  # each decode server's region similarity, by URL
        assert list(sims) == [d.url for d in decodes] and max(sims, key=sims.get) == dec["decode"]
        assert sims[dec["decode"]] == pytest.approx(dec["best_similarity"])


# ------------------------------------------------------------------ reliability
async def test_health_checks_take_dead_worker_out_and_back_in():
    async with cluster(n_decode=2, health_interval=0.05, health_failures=2,
                       health_timeout=0.5) as (router, url, prefill, decodes, http):
        d1 = router.decodes[1]
        await until(lambda: decodes[1].health_checks >= 1)
        decodes[1].health_status = 503
        await until(lambda: not d1.alive)
        assert await server_of(http, url, "topic:1") == "d0"  # out
        decodes[1].health_status = 200
        await until(lambda: d1.alive)
        assert await server_of(http, url, "topic:1") == "d1"  # back in
        # a really dead process: port closed, then restarted on the same port
        port = decodes[1].port
        await decodes[1].stop()
        await until(lambda: not d1.alive)
        assert await server_of(http, url, "topic:1") == "d0"
        assert router.metrics.value("upstream_failures", role="decode") == 0  # never even tried
        revived = StubWorker("decode", name="d1b")
        await revived.start(port=port)
        await until(lambda: d1.alive)
        assert await server_of(http, url, "topic:1") == "d1b"
        assert router.metrics.value("events", event="decode_taken_out") == 2 and router.metrics.value("events", event="decode_back_in") == 2
        await revived.stop()
        decodes[1].stop = revived.stop  # already stopped: cluster cleanup is a no-op


async def test_circuit_breaker_opens_half_opens_and_closes():
    async with cluster(n_decode=2, breaker_threshold=3, health_cooldown=0.3,
                       health_interval=0) as (router, url, prefill, decodes, http):
        decodes[0].fail_first = 4
        d0 = router.decodes[0]
        now = [0.0]
        d0.breaker.clock = lambda: now[0]  # the test moves time on, not the machine's load
        for _ in range(3):  # worker 5xx passed through; 3 in a row open the breaker
            st, raw = await post(http, f"{url}/generate", {"text": "topic:0"})
            assert st == 500 and "stub d0 failure" in raw.decode()
        assert d0.breaker.state == "open" and decodes[0].served == 3
        assert await server_of(http, url, "topic:0") == "d1"  # open: skipped
        assert decodes[0].served == 3
        now[0] += 0.35  # past the 0.3 s cooldown
        # half-open: one trial; it fails (4th failure) -> open again
        st, _ = await post(http, f"{url}/generate", {"text": "topic:0"})
        assert st == 500 and d0.breaker.state == "open" and decodes[0].served == 4
        assert await server_of(http, url, "topic:0") == "d1"
        now[0] += 0.35
        assert await server_of(http, url, "topic:0") == "d0"  # trial succeeds -> closed
        assert d0.breaker.state == "closed" and d0.breaker.failures == 0
        assert await server_of(http, url, "topic:0") == "d0"
        # 4xx is the client's fault: passed through, breaker untouched
        decodes[0].fail_first, decodes[0].fail_status, decodes[0].served = 5, 429, 0
        for _ in range(4):
            st, raw = await post(http, f"{url}/generate", {"text": "topic:0"})
            assert st == 429 and "error" in orjson.loads(raw)
        assert d0.breaker.state == "closed"


async def test_prefill_refused_is_retried_on_another_prefill():
    p_live = StubWorker("prefill", name="p1")
    decodes = [StubWorker("decode", name=f"d{i}") for i in range(2)]
    lurl = await p_live.start()
    durls = [await d.start() for d in decodes]
    dead = f"http://127.0.0.1:{free_port()}"
    router = Router([(dead, 7001), (lurl, 7002)], durls, "eldr",
                    artifact=ToyArtifact(num_clusters=2), signature_timeout=5)
    runner, port = await start_router(router)
    url = f"http://127.0.0.1:{port}"
    p_live.signature_url = f"{url}/eldr/signature"
    async with aiohttp.ClientSession() as http:
        for t in (0, 1, 0, 1):
            assert await server_of(http, url, f"topic:{t}") == f"d{t}"
    assert router.metrics.value("retries", role="prefill") >= 1
    assert decodes[0].requests[0]["bootstrap_port"] == 7002  # the live prefill's address
    assert router.prefills[0].breaker.state == "open"
    await runner.cleanup()
    for w in [p_live] + decodes:
        await w.stop()


async def test_oversized_and_malformed_bodies_are_4xx_json():
    async with cluster(n_decode=2, max_body_mb=0.01) as (router, url, prefill, decodes, http):
        big = {"text": "x" * 20_000}
        st, raw = await post(http, f"{url}/generate", big)
        assert st == 413 and "too large" in orjson.loads(raw)["error"]
        st, raw = await post(http, f"{url}/eldr/signature", {"bootstrap_room": 1, "pad": "y" * 20_000})
        assert st == 413
        for body in (b"", b"\xff\xfe", b"null", b'{"text": "a", "input_ids": "zz"}'):
            st, raw = await post(http, f"{url}/generate", body)
            assert 400 <= st < 500 and "error" in orjson.loads(raw), (body, st, raw)
        assert await server_of(http, url, "topic:1") == "d1"  # still serving
        assert router.metrics.value("errors", kind="too_large") == 1
        assert router.metrics.value("errors", kind="signature_too_large") == 1


async def test_bounded_state_waiters_and_early_messages():
    async with cluster(n_decode=2, prefill_kw={"hang": True}, decode_kw={"hang": True},
                       signature_ttl=0.2, signature_buffer=10) as (router, url, prefill, decodes, http):
        # requests that die (client gone) while waiting for a signature leave nothing behind
        for _ in range(5):
            with pytest.raises(asyncio.TimeoutError):
                await post(http, f"{url}/generate", {"text": "topic:1"},
                           timeout=aiohttp.ClientTimeout(total=0.1))
        await until(lambda: not router.board.waiters and router.admission.active == 0)
        # unclaimed messages: capped at signature_buffer, then expire by TTL with no traffic
        msgs = [{"bootstrap_room": 1000 + i, "layers": [0, 1], "counts": topic_counts("topic:0")}
                for i in range(50)]
        st, raw = await post(http, f"{url}/eldr/signature", msgs)
        assert st == 200 and orjson.loads(raw)["buffered"] == 50
        assert len(router.board.buffer) <= 10
        await until(lambda: not router.board.buffer, timeout=3)
        assert router.board.expired >= 50


async def test_drain_on_sigterm_subprocess():
    prefill = StubWorker("prefill", name="p0")
    decode = StubWorker("decode", name="d0", latency=1.5)
    purl, durl = await prefill.start(), await decode.start()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "eldr_sglang.router", "--prefill", purl, str(BOOT_PORT),
         "--decode", durl, "--policy", "jsq", "--host", "127.0.0.1", "--port", str(port),
         "--drain-timeout", "10", "--health-interval", "0", "--log-level", "warning"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async def health(status: int) -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/health") as r:
                        return r.status == status
                return False

            await until(lambda: health(200), 25, "the router to start")
            slow = asyncio.ensure_future(post(http, f"{url}/generate", {"text": "a"}))
            await until(lambda: decode.requests)
            t_term = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await until(lambda: health(503), 5, "the router to drain")
            st, raw = await post(http, f"{url}/generate", {"text": "b"})
            assert st == 503 and "draining" in orjson.loads(raw)["error"]
            async with http.get(f"{url}/health") as r:
                assert r.status == 503
            st, raw = await slow  # the in-flight request finishes normally
            assert st == 200 and orjson.loads(raw)["meta_info"]["server"] == "d0"
        rc = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 10)
        assert rc == 0, proc.stderr.read()
        assert time.monotonic() - t_term < 5
        assert len(decode.requests) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        await prefill.stop()
        await decode.stop()


# ------------------------------------------------------------------ fault injection
async def test_kill_decode_mid_load_every_request_ends_and_routing_recovers():
    async with cluster(n_decode=3, decode_kw={"latency": 0.3}, health_interval=0.2,
                       health_timeout=0.3) as (router, url, prefill, decodes, http):
        decodes[1].crash_on, decodes[1].crash_mode = 4, "stop"  # dies on its 4th request
        sem = asyncio.Semaphore(12)
        results = []

        async def one(i):
            async with sem:
                t0 = time.monotonic()
                st, raw = await post(http, f"{url}/generate", {"text": f"topic:{i % 3} {i}"},
                                     timeout=aiohttp.ClientTimeout(total=10))
                results.append((t0, st, raw))

        await asyncio.gather(*(one(i) for i in range(60)))
        assert len(results) == 60  # none hangs
        codes = [st for _, st, _ in results]
        assert set(codes) <= {200, 502, 503}, codes
        assert 502 in codes and decodes[1].served >= 4  # it really died mid-request
        for _, st, raw in results:
            body = orjson.loads(raw)
            if st != 200:
                assert "decode server" in body["error"], body  # a clear error
        assert codes.count(200) >= 50
        d1 = router.decodes[1]
        assert d1.breaker.state == "open" or not d1.alive
        # recovery: later traffic for region 1 all succeeds elsewhere
        for i in range(6):
            assert await server_of(http, url, f"topic:1 after {i}") in ("d0", "d2")
        assert router.admission.active == 0 and not router.board.waiters
        assert all(d.inflight == 0 for d in router.decodes)


@pytest.mark.parametrize("body_kind", ["detail", "text", "error"])
async def test_worker_error_bodies_always_carry_an_error_key(body_kind):
    """SGLang answers an aborted request with ``{"detail": ...}`` (e.g. a KV transfer
    to a decode server that died): the router keeps status and fields, adds ``error``."""
    async with cluster(n_decode=2, policy="round_robin",
                       prefill_kw={"fail_first": 1, "fail_status": 500, "fail_body": body_kind},
                       decode_kw={"latency": 0.5}) as (router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "topic:0"})
        body = orjson.loads(raw)
        assert st == 500 and "error" in body, body
        assert "stub p0 failure" in json.dumps(body)
        if body_kind == "detail":
            assert body["detail"] == "stub p0 failure"
        decodes[0].fail_first, decodes[0].fail_status, decodes[0].fail_body = 1, 503, body_kind
        decodes[1].fail_first, decodes[1].fail_status, decodes[1].fail_body = 1, 503, body_kind
        decodes[0].served = decodes[1].served = 0
        decodes[0].latency = decodes[1].latency = 0.0
        st, raw = await post(http, f"{url}/generate", {"text": "topic:1"})
        body = orjson.loads(raw)
        assert st == 503 and "error" in body and "stub d" in json.dumps(body), body


def test_ports_in_use_or_clashing_stop_the_cli_with_a_message():
    import socket

    base = [sys.executable, "-m", "eldr_sglang.router", "--prefill", "http://127.0.0.1:1",
            "--decode", "http://127.0.0.1:2", "--policy", "round_robin", "--host", "127.0.0.1"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = str(busy.getsockname()[1])
        for extra, flag in ((["--port", taken], "--port"),
                            (["--port", str(free_port()), "--signature-port", taken], "--signature-port")):
            done = subprocess.run(base + extra, capture_output=True, text=True, timeout=60)
            assert done.returncode == 1, done.stderr
            assert "cannot listen" in done.stderr and flag in done.stderr and "address already in use" in done.stderr
            assert "Traceback" not in done.stderr and "Unclosed client session" not in done.stderr
    done = subprocess.run(base + ["--port", "8123", "--signature-port", "8123"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--signature-port: 8123 is the router's port" in done.stderr
