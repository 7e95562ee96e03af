"""eldr_sglang.integrations without a host router process: the scorer follows the worker
list, SMG's counters parse, and the pre-router over a fake host (in process, loopback)
pins, relays streams, retries a refused pin unpinned, and falls back on its own failure."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import orjson
from aiohttp import web

from eldr_sglang.integrations import Choice, LocalScorer, PreRouter, RemoteScorer, serve
from eldr_sglang.integrations.smg import parse_outcomes
from eldr_sglang.testing.local_cluster import free_port
from eldr_sglang.testing.topic_words import tokenizer, topic_artifact, topic_prompt


def choose(scorer, k, workers, loads=None, seed=0):
    c = asyncio.run(scorer.choose({"prompt": topic_prompt(k, seed)}, "v1/completions", workers, loads or {}))
    scorer.release(c)
    return c


def test_local_scorer_follows_the_worker_list():
    sc = LocalScorer(topic_artifact(), tokenizer())
    first = {k: choose(sc, k, ["a", "b"]).worker for k in (0, 1)}
    assert first[0] != first[1] and choose(sc, 0, ["a", "b"]).region == 0
    gone = first[1]
    left = [w for w in ("a", "b") if w != gone]
    assert all(choose(sc, k, left, seed=s).worker == left[0] for k in (0, 1) for s in range(3))
    assert sc.order == left  # the policy dropped the server
    assert choose(sc, 1, ["a", "b"]).worker in ("a", "b") and len(sc.order) == 2  # and took it back
    assert asyncio.run(sc.choose({"prompt": "x"}, "v1/completions", [], {})) is None


def test_local_scorer_weighs_the_loads_it_is_given():
    """eldr_balanced keeps locality while it is cheap and leaves a piled-up worker."""
    sc = LocalScorer(topic_artifact(), tokenizer())
    home = choose(sc, 0, ["a", "b"]).worker
    other = "b" if home == "a" else "a"
    assert choose(sc, 0, ["a", "b"], {home: 1}).worker == home
    assert choose(sc, 0, ["a", "b"], {home: 20}).worker == other


def test_parse_smg_outcomes():
    text = ('# TYPE smg_worker_cb_outcomes_total counter\n'
            'smg_worker_cb_outcomes_total{worker="http://127.0.0.1:1",outcome="success"} 13\n'
            'smg_worker_cb_outcomes_total{worker="http://127.0.0.1:1",outcome="failure"} 2\n'
            'smg_worker_cb_outcomes_total{worker="http://127.0.0.1:2/",outcome="success"} 6\n'
            'smg_worker_health{worker="http://127.0.0.1:2"} 1\n')
    assert parse_outcomes(text) == {"http://127.0.0.1:1": 15.0, "http://127.0.0.1:2": 6.0}


class FakeHost:
    """Answers /generate with the pin header it saw; refuses pins to 'dead' with 503."""

    def __init__(self):
        self.seen = []

    async def generate(self, request):
        body = await request.read()
        pin = request.headers.get("X-Pin")
        self.seen.append((pin, request.headers.get("Content-Type"), body))
        if pin == "dead":
            return web.json_response({"error": "unavailable"}, status=503)
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return web.json_response({"error": "bad json"}, status=400)
        if doc.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i in range(3):
                await out.write(f"data: {i}\n\n".encode())
            await out.write_eof()
            return out
        return web.json_response({"pin": pin})

    async def models(self, request):
        return web.json_response({"data": [{"id": "m"}]})


class FakePreRouter(PreRouter):
    kind = "fake"
    repin_statuses = frozenset({503})

    async def discover(self):
        self.set_workers(["w0", "w1", "dead"])

    def pin_headers(self, choice):
        return {"X-Pin": choice.worker}


class FixedScorer:
    def __init__(self, worker):
        self.worker = worker

    async def choose(self, body, endpoint, workers, loads):
        return Choice(self.worker if self.worker in workers else workers[0], 0) if self.worker else None

    def release(self, choice):
        pass


class SlowScorer(RemoteScorer):
    async def choose(self, *a):
        await asyncio.sleep(5)


@contextlib.asynccontextmanager
async def rig(scorer):
    host = FakeHost()
    app = web.Application()
    app.router.add_post("/generate", host.generate)
    app.router.add_get("/v1/models", host.models)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    pre = FakePreRouter(f"http://127.0.0.1:{port}", scorer, refresh_s=0.05, scorer_timeout=0.1)
    prunner, pport = await serve(pre, "127.0.0.1", 0)
    http = aiohttp.ClientSession()
    try:
        await asyncio.wait_for(pre.discovered.wait(), 5)
        yield host, pre, f"http://127.0.0.1:{pport}", http
    finally:
        await http.close()
        await prunner.cleanup()
        await runner.cleanup()


async def post(http, url, body, **kw):
    async with http.post(url + "/generate", data=orjson.dumps(body), **kw) as r:
        return r.status, await r.read(), r.headers


async def test_pins_relays_and_proxies():
    async with rig(FixedScorer("w1")) as (host, pre, url, http):
        status, raw, h = await post(http, url, {"text": "a"})
        assert status == 200 and orjson.loads(raw) == {"pin": "w1"}
        assert h["X-ELDR-Worker"] == "w1" and h["X-ELDR-Path"] == "pinned"
        status, raw, h = await post(http, url, {"text": "a", "stream": True})
        assert status == 200 and raw.decode().count("data: ") == 3
        async with http.get(url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "m"
        async with http.get(url + "/eldr/adapter/status") as r:
            st = await r.json()
        assert st["counters"]["pinned"] == 2 and st["decision_ms"]["n"] == 2


async def test_concurrent_requests_count_and_release_loads():
    async with rig(LocalScorer(topic_artifact(), tokenizer())) as (host, pre, url, http):
        pre.set_workers = lambda ws, _s=pre.set_workers: _s([w for w in ws if w != "dead"])
        await asyncio.sleep(0.2)
        results = await asyncio.gather(*[post(http, url, {"text": topic_prompt(i % 2, i), "stream": i % 3 == 0},
                                              headers={"Content-Type": "application/json"}) for i in range(24)])
        assert all(status == 200 for status, _, _ in results)
        assert {h["X-ELDR-Path"] for _, _, h in results} == {"pinned"}
        assert all(v == 0 for v in pre.inflight.values())


async def test_refused_pin_goes_unpinned_and_is_quarantined():
    async with rig(FixedScorer("dead")) as (host, pre, url, http):
        status, raw, h = await post(http, url, {"text": "a"})
        assert status == 200 and orjson.loads(raw) == {"pin": None}
        assert h["X-ELDR-Path"] == "retried_unpinned" and h["X-ELDR-Worker"] == "-"
        assert "dead" in pre.quarantined and pre.inflight["dead"] == 0
        status, raw, h = await post(http, url, {"text": "b"})  # the scorer no longer gets 'dead'
        assert orjson.loads(raw) == {"pin": "w0"} and h["X-ELDR-Path"] == "pinned"


async def test_own_failure_falls_back_to_the_host():
    for scorer, path in ((FixedScorer(None), "fallback_no_prediction"),
                         (SlowScorer("http://127.0.0.1:1"), "fallback_scorer_timeout"),
                         (RemoteScorer(f"http://127.0.0.1:{free_port()}"), "fallback_scorer_error")):
        async with rig(scorer) as (host, pre, url, http):
            status, raw, h = await post(http, url, {"text": "a"})
            assert status == 200 and orjson.loads(raw) == {"pin": None}, (path, raw)
            assert h["X-ELDR-Path"] == path
        async with rig(scorer) as (host, pre, url, http):  # not JSON: forwarded as is, the host answers
            async with http.post(url + "/generate", data=b'{"text": "a"',
                                 headers={"Content-Type": "application/json"}) as r:
                await r.read()
                assert r.status == 400 and r.headers["X-ELDR-Path"] == "fallback_body"
            assert host.seen[-1] == (None, "application/json", b'{"text": "a"')
