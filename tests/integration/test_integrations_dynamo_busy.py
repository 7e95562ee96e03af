"""Dynamo's admission control (a busy worker) is not a refused worker, and the
decode-only pin: against an in-process model of the Dynamo 1.6.1 frontend (``/health``
instances, the two pin headers, 400 for an unknown instance or a decode header alone in
disaggregated mode, loopback only). The busy answer is the real 1.6.1 frontend's, as it
answered over ``dynamo.mocker`` workers with ``--active-decode-blocks-threshold``: 529
``Service temporarily overloaded`` by default, the same body under 503 with
``DYN_HTTP_OVERLOAD_STATUS_CODE=503`` (see eldr_sglang.integrations.dynamo)."""

from __future__ import annotations

import contextlib

import orjson
import pytest
from aiohttp import web

from eldr_sglang.integrations import Choice, DynamoPreRouter
from eldr_sglang.integrations.dynamo import DECODE_HEADER, PREFILL_HEADER
from tests.helpers import until
from tests.integration.integrations_helpers import adapter


def busy_answer(status: int) -> web.Response:  # the body the 1.6.1 frontend sent
    return web.json_response({"message": "Service temporarily overloaded", "type": "Overloaded", "code": status},
                             status=status)


class FakeFrontend:
    """Decode instances 11, 12, prefill 21; ``busy`` decode ids answer ``busy_status`` (529 or 503) when pinned."""

    def __init__(self, decode_only_ok: bool = False, token: str | None = None, busy_status: int = 529) -> None:
        self.busy: set[str] = set()
        self.busy_status = busy_status
        self.decode_only_ok, self.token = decode_only_ok, token
        self.seen: list[tuple[str | None, str | None]] = []

    async def health(self, request: web.Request) -> web.Response:
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": "unauthorized"}, status=401)
        inst = [{"component": c, "endpoint": "generate", "namespace": "dynamo", "instance_id": i}
                for c, i in (("backend", 11), ("backend", 12), ("prefill", 21))]
        return web.json_response({"status": "healthy", "instances": inst})

    async def completions(self, request: web.Request) -> web.Response:
        await request.read()
        dec, pre = request.headers.get(DECODE_HEADER), request.headers.get(PREFILL_HEADER)
        self.seen.append((dec, pre))
        if dec is not None:
            if dec not in ("11", "12"):
                return web.json_response({"error": {"message": f"instance {dec} not found"}}, status=400)
            if pre is None and not self.decode_only_ok:
                return web.json_response({"error": {"message": "disaggregated: both instance ids needed"}},
                                         status=400)
            if dec in self.busy:
                return busy_answer(self.busy_status)
            served = dec
        else:
            free = [d for d in ("11", "12") if d not in self.busy]
            if not free:
                return busy_answer(self.busy_status)
            served = free[0]
        return web.Response(body=orjson.dumps({"choices": [{"text": "ok"}],
                                               "nvext": {"worker_id": {"decode_worker_id": int(served)}}}),
                            content_type="application/json")


@contextlib.asynccontextmanager
async def frontend(**kw):
    fe = FakeFrontend(**kw)
    app = web.Application()
    app.router.add_get("/health", fe.health)
    app.router.add_post("/v1/completions", fe.completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield fe, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


class Pick:
    def __init__(self, worker: str) -> None:
        self.worker = worker

    async def choose(self, body, endpoint, workers, loads):
        return Choice(self.worker, 0)

    def release(self, choice):
        pass


async def post(http, url):
    async with http.post(url + "/v1/completions", data=b'{"model": "m", "prompt": "x"}',
                         headers={"Content-Type": "application/json"}) as r:
        doc = orjson.loads(await r.read())
        return r.status, r.headers.get("X-ELDR-Path"), (doc.get("nvext") or {}).get("worker_id", {})


@pytest.mark.parametrize("busy_status", [529, 503])  # 1.6.1's default; DYN_HTTP_OVERLOAD_STATUS_CODE=503
async def test_a_busy_worker_is_not_quarantined(busy_status):
    async with frontend(busy_status=busy_status) as (fe, furl):
        pre = DynamoPreRouter(furl, Pick("11"), refresh_s=0.1, quarantine_s=60)
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.workers) == 2 and pre.prefills, 10, "instances mapped")
            fe.busy = {"11"}
            status, path, wid = await post(http, aurl)
            assert status == 200 and path == "retried_busy" and wid["decode_worker_id"] == 12
            assert not pre.quarantined, "a busy worker was quarantined"
            assert pre.counters["pinned_busy"] == 1
            fe.busy = set()
            status, path, wid = await post(http, aurl)  # pinned again at once
            assert (status, path, wid["decode_worker_id"]) == (200, "pinned", 11)
            fe.busy = {"11", "12"}  # all busy: the client gets Dynamo's own answer
            status, path, _ = await post(http, aurl)
            assert status == busy_status and path == "retried_busy" and not pre.quarantined
        # an unknown instance is still a refused worker: quarantined
        pre = DynamoPreRouter(furl, Pick("99"), refresh_s=0.1, quarantine_s=60)
        pre.set_workers = lambda ws, _s=pre.set_workers: _s([*ws, "99"])
        fe.busy = set()
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.workers) == 3, 10, "instances mapped")
            status, path, _ = await post(http, aurl)
            assert status == 200 and path == "retried_unpinned" and "99" in pre.quarantined


async def test_decode_only_pin_where_the_frontend_takes_it():
    async with frontend(decode_only_ok=True) as (fe, furl):
        pre = DynamoPreRouter(furl, Pick("12"), refresh_s=0.1, pin_prefill=False)
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.workers) == 2 and pre.prefills, 10, "instances mapped")
            status, path, wid = await post(http, aurl)
            assert (status, path, wid["decode_worker_id"]) == (200, "pinned", 12)
            assert fe.seen[-1] == ("12", None)  # the frontend keeps its own prefill choice
    async with frontend(decode_only_ok=False) as (fe, furl):  # 1.6.1 disaggregated: refused
        pre = DynamoPreRouter(furl, Pick("12"), refresh_s=0.1, pin_prefill=False)
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.workers) == 2 and pre.prefills, 10, "instances mapped")
            status, path, _ = await post(http, aurl)
            assert status == 200 and path == "retried_decode_only" and not pre.quarantined
            status, path, wid = await post(http, aurl)
            assert (status, path, wid["decode_worker_id"]) == (200, "pinned", 12)
            assert fe.seen[-1] == ("12", "21") and pre.counters["decode_only_refused"] == 1


async def test_control_token_reaches_the_frontend():
    async with frontend(token="t0k") as (fe, furl):
        pre = DynamoPreRouter(furl, Pick("11"), refresh_s=0.1, control_token="t0k")
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.workers) == 2, 10, "instances listed with the token")
            status, path, wid = await post(http, aurl)
            assert (status, path) == (200, "pinned")
