"""A remote scorer's answer is never trusted: types, ranges, sizes, header safety and
the time limit over the whole answer (the pre-router in front of the in-process SMG
model of :mod:`tests.integration.fake_smg`, loopback only). Every client request
answers 200; a bad answer goes to SMG's own choice, a good one is pinned."""

from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web

from eldr_sglang.integrations import RemoteScorer, SmgPreRouter
from tests.helpers import until
from tests.integration.fake_smg import FakeSmg
from tests.integration.integrations_helpers import adapter

OK = {"server": "", "index": 0, "region": 1, "path": "predicted"}
BAD = "fallback_scorer_invalid"
BIG = (BAD, "fallback_scorer_timeout")  # past the size cap, or past the limit while it is sent (a loaded box)
# (answer: a dict/list to send as JSON, or (status, raw bytes), or "slow"), expected path(s)
CASES: list[tuple[object, str]] = [
    (OK, "pinned"),
    ({**OK, "region": "1\r\nX-Evil: 1"}, BAD),
    ({**OK, "region": "\x00"}, BAD),
    ({**OK, "region": list(range(200_000))}, BIG),  # 1.3 MB
    ({**OK, "region": 1e30}, BAD),
    ({**OK, "region": -1}, BAD),
    ({**OK, "region": True}, BAD),
    ({**OK, "region": "1"}, BAD),
    ({**OK, "index": -7}, BAD),
    ({**OK, "index": 1e30}, BAD),
    ({**OK, "index": 1.9}, BAD),
    ({**OK, "index": True}, BAD),
    ({**OK, "index": "0"}, BAD),
    ({**OK, "index": None}, BAD),
    ({**OK, "index": 2}, BAD),  # two workers
    ({k: v for k, v in OK.items() if k != "index"}, BAD),
    ({**OK, "server": "http://x\r\nX-Evil: 1"}, "pinned"),  # not a worker URL: the valid index decides
    ({**OK, "server": {"a": 1}}, "pinned"),
    ({**OK, "path": "a\r\nb"}, "pinned"),  # recorded as "remote", never a header
    ({**OK, "region": None}, "fallback_no_pin"),  # region mode: nothing to pin
    ([1, 2], BAD),
    ((200, b"<html>"), BAD),
    ((500, orjson.dumps(OK)), BAD),
    ((200, b"[" + b"1," * 30_000_000 + b"1]"), BIG),  # 60 MB
    ("slow", "fallback_scorer_timeout"),  # headers at once, the body trickles for 2 s
]


async def scorer_app(request: web.Request) -> web.StreamResponse:
    doc = orjson.loads(await request.read())
    answer = CASES[int(doc["text"].split(":")[1])][0]
    if answer == "slow":
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        try:
            for part in (b'{"index": 0, ', b'"region": 1, ', b'"server": ""}'):
                await resp.write(part)
                await asyncio.sleep(0.7)
        except ConnectionError:  # the pre-router gave up on the answer: as it should
            pass
        return resp
    status, raw = answer if isinstance(answer, tuple) else (200, orjson.dumps(answer))
    try:
        return web.Response(body=raw, status=status, content_type="application/json")
    except ConnectionResetError:
        return web.Response(status=499)


async def test_scorer_answers_are_validated_and_no_client_request_fails():
    smg = FakeSmg(2, serve_s=0.0)
    await smg.start()
    app = web.Application()
    app.router.add_post("/eldr/score", scorer_app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    surl = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    pre = SmgPreRouter(smg.url, RemoteScorer(surl, timeout_s=0.25), key_mode="region", refresh_s=0.1)
    try:
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.workers) == 2, 20, "decode workers discovered")
            seen = []
            for rnd in range(2):
                for i, (_, want) in enumerate(CASES):
                    t0 = time.perf_counter()
                    async with http.post(aurl + "/generate", data=orjson.dumps({"text": f"fuzz:{i}"}),
                                         headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        seen.append((i, r.status, r.headers.get("X-ELDR-Path"), time.perf_counter() - t0))
            assert [s for s in seen if s[1] != 200] == [], "a scorer answer failed a client request"
            wrong = [(i, path, CASES[i][1]) for i, _, path, _ in seen
                     if path not in (CASES[i][1] if isinstance(CASES[i][1], tuple) else (CASES[i][1],))]
            assert wrong == [], wrong
            slowest = max(dt for i, _, _, dt in seen if CASES[i][0] == "slow" or isinstance(CASES[i][0], tuple))
            assert slowest < 1.0, f"the scorer's limit was not enforced over the whole answer ({slowest:.2f} s)"
            assert all(k.startswith("eldr-region-") and "\r" not in k for k in smg.keys)
    finally:
        await runner.cleanup()
        await smg.stop()

