"""The PD dispatch flow's steps (admit -> prepare -> prefill -> signature -> decide ->
decode -> relay), each on its own, on parts built here: no Router, no cluster.
Worker calls go to small in-process aiohttp servers."""

import asyncio
import contextlib
import socket
import time
from dataclasses import replace

import orjson
import pytest
from aiohttp import web

from eldr_sglang.core.policies import RouteRequest
from eldr_sglang.core.wire import RETURN_ADDRESS_KEY
from eldr_sglang.router.state.admission import Admission
from eldr_sglang.router.http.bodies import BodyParser
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.state.decision_log import DecisionLog
from eldr_sglang.router.flow.dispatch import Dispatcher
from eldr_sglang.router.flow.dispatch_parts import DispatchParts, Flight, PrefillResult
from eldr_sglang.router.signals.intake import RateLimitedLog
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.state.routing import RoutingState
from eldr_sglang.router.runtime import Runtime
from eldr_sglang.router.signals.signatures import SignatureBoard, WaitLimit
from eldr_sglang.router.pool.upstream import UpstreamClient
from eldr_sglang.router.pool.workers import WorkerPool
from eldr_sglang.testing.stub_worker import topic_counts
from eldr_sglang.testing.toy_artifact import toy_calibration_artifact

pytestmark = pytest.mark.timeout(60)


def make_parts(prefill="http://127.0.0.1:9", decodes=("http://127.0.0.1:10", "http://127.0.0.1:11"),
               artifact=None, **settings) -> DispatchParts:
    config = RouterConfig.from_dict({"policy": "jsq", **settings})
    metrics = RouterMetrics()
    pool = WorkerPool([(prefill, 8998)], list(decodes), config, metrics)
    runtime = Runtime()
    return DispatchParts(
        config, metrics, pool, SignatureBoard(), BodyParser(),
        UpstreamClient(config.request_timeout, config.connect_timeout), WaitLimit(2.0),
        RoutingState(config, pool, metrics, artifact), runtime, DecisionLog(8), RateLimitedLog(),
        Admission(config, metrics, runtime))


def flight(parts: DispatchParts, body=None, n=None) -> Flight:
    body = {"text": "topic:1 hi", "rid": "r1"} if body is None else body
    return Flight("generate", time.perf_counter(), body, n, ["r1"], parts.state.routing)


@contextlib.asynccontextmanager
async def worker(handler):
    """An HTTP server on a free local port answering POST /generate with ``handler``."""
    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------ admit
def test_admit_refuses_while_draining_and_at_the_inflight_limit():
    d = Dispatcher(make_parts(max_inflight=1))
    gate = d.p.admission
    assert gate.refusal() is None
    gate.enter()
    resp = gate.refusal()
    assert resp.status == 429 and b"in-flight limit (1 requests)" in resp.body
    gate.leave()
    assert gate.idle.is_set()
    d.p.runtime.draining = True
    resp = gate.refusal()
    assert resp.status == 503 and "Retry-After" in resp.headers
    assert d.p.metrics.value("events", event="refused_draining") == 1


# ------------------------------------------------------------ prepare
def test_prepare_sets_bootstrap_fields_prefill_and_label():
    parts = make_parts(label_header="X-Topic", label_field="topic")
    d = Dispatcher(parts)
    fl = flight(parts, {"text": "a", "rid": "r1", "topic": "from-body"})
    d.prepare(fl, {"X-Topic": "from-header"}, ("X-Request-Id", "abc"))
    assert fl.label == "from-header" and "topic" in fl.body  # the header wins; the field stays
    prefill = parts.pool.prefills[0]
    assert fl.prefill is prefill and fl.body["bootstrap_host"] == prefill.host
    assert fl.body["bootstrap_port"] == 8998 and isinstance(fl.body["bootstrap_room"], int)
    assert fl.rooms == [fl.body["bootstrap_room"]] and fl.headers == (("X-Request-Id", "abc"),)
    assert orjson.loads(fl.payload) == fl.body
    assert fl.waiters == []  # jsq needs no signature: nothing waits on the board
    assert "sampling_params" not in fl.body  # and no return address is asked for


async def test_prepare_of_a_batch_and_a_signature_policy():
    seen = []

    async def answer(request):
        seen.append(await request.json())
        return web.json_response({"ok": True})

    async with worker(answer) as url:
        parts = make_parts(prefill=url)
        d = Dispatcher(parts)
        fl = flight(parts)
        d.prepare(fl, {})
        res = await d.prefill(fl)
        assert res.ok and res.url == url and orjson.loads(res.body) == {"ok": True}
        assert seen[0]["bootstrap_room"] == fl.rooms[0] and seen[0]["rid"] == "r1"
        assert fl.sent == {id(fl.prefill)}
        parts.upstream.close()


async def test_prefill_to_a_refused_port_is_an_unreachable_result():
    parts = make_parts(prefill=f"http://127.0.0.1:{closed_port()}")
    d = Dispatcher(parts)
    fl = flight(parts)
    d.prepare(fl, {})
    res = await d.prefill(fl)
    assert res.status == 0 and "unreachable" in res.error and not res.ok
    assert d.relay.prefill_error(res).status == 503  # retryable: Retry-After
    assert not fl.sent


# ------------------------------------------------------------ signature
async def test_signature_step_routes_by_the_rooms_message():
    parts = make_parts(artifact=toy_calibration_artifact(2), policy="eldr")
    d = Dispatcher(parts)
    fl = flight(parts)
    d.prepare(fl, {})
    fl.prefill_task = asyncio.get_running_loop().create_future()  # still running
    counts = topic_counts("topic:1 hi")
    parts.board.post({"bootstrap_room": fl.rooms[0], "layers": [0, 1], "counts": counts})
    assert await d.signature(fl) is None
    want = parts.state.routing.encoder.encode({"layers": [0, 1], "counts": counts})
    assert fl.route.signature == pytest.approx(want)
    assert parts.state.last_layers == [0, 1]
    assert parts.metrics.value("events", event="signatures_used") == 1


async def test_signature_step_ends_with_the_failed_prefill():
    parts = make_parts(artifact=toy_calibration_artifact(2), policy="eldr")
    d = Dispatcher(parts)
    fl = flight(parts)
    d.prepare(fl, {})
    failed = PrefillResult(500, b'{"error": "boom"}', url="p")
    fl.prefill_task = asyncio.get_running_loop().create_future()
    fl.prefill_task.set_result(failed)
    assert await d.signature(fl) is failed
    assert fl.route.signature is None


async def test_signature_step_takes_an_early_route_without_waiting():
    early = RouteRequest(label="early")
    parts = make_parts(artifact=toy_calibration_artifact(2), policy="eldr")
    async def bind_early(body, endpoint, label):
        return early

    parts = replace(parts, early=bind_early)
    d = Dispatcher(parts)
    fl = flight(parts)
    d.prepare(fl, {})
    fl.prefill_task = asyncio.get_running_loop().create_future()  # would never end
    assert await asyncio.wait_for(d.signature(fl), 5) is None and fl.route is early


async def test_no_signature_policy_routes_by_label_only():
    parts = make_parts()
    d = Dispatcher(parts)
    fl = flight(parts)
    fl.label = "lab"
    assert await d.signature(fl) is None
    assert fl.route.label == "lab" and fl.route.signature is None


# ------------------------------------------------------------ decide
def test_decide_picks_the_least_loaded_and_note_logs_a_typed_record():
    parts = make_parts()
    d = Dispatcher(parts)
    first = parts.pool.decodes[0]
    ticket = parts.pool.enter(first)  # one request on decode 0
    w, dec, loads = d.decide(RouteRequest())
    assert w is parts.pool.decodes[1] and loads == [1, 0] and dec.reason
    fl = flight(parts)
    fl.rooms = [7]
    d.note(fl, w, dec, loads)
    (rec,) = list(parts.decisions)
    assert rec.decode == w.url and rec.rooms == [7] and rec.policy == "jsq"
    out = parts.decisions.recent(5)[0]
    assert out["decode"] == w.url and out["loads"] == {first.url: 1, w.url: 0}
    parts.pool.leave(first, ticket)
    w, _, _ = d.decide(RouteRequest(), exclude={1})
    assert w is first  # decode 1 excluded (a refused connection)


# ------------------------------------------------------------ decode and relay
async def test_decode_then_relay_returns_the_decode_answer_after_the_prefill():
    async def answer(request):
        body = await request.json()
        return web.json_response({"text": "done", "room": body["bootstrap_room"]})

    async with worker(answer) as url:
        parts = make_parts(decodes=(url,))
        d = Dispatcher(parts)
        fl = flight(parts)
        d.prepare(fl, {})
        fl.prefill_task = asyncio.get_running_loop().create_future()
        fl.prefill_task.set_result(PrefillResult(200, b"{}"))
        dw = parts.pool.decodes[0]
        ticket = parts.pool.enter(dw)
        resp = await d.decode(dw, fl)
        try:
            out = await d.relay.relay(None, resp, dw, ticket, fl)
        finally:
            resp.release()
            parts.pool.leave(dw, ticket)
        assert out.status == 200 and orjson.loads(out.body) == {"text": "done", "room": fl.rooms[0]}
        parts.upstream.close()


async def test_decode_is_never_sent_after_a_failed_prefill():
    parts = make_parts()
    d = Dispatcher(parts)
    fl = flight(parts)
    d.prepare(fl, {})
    failed = PrefillResult(0, b"", "prefill server unreachable: refused")
    fl.prefill_task = asyncio.get_running_loop().create_future()
    fl.prefill_task.set_result(failed)
    assert await d.decode(parts.pool.decodes[0], fl) is failed
    assert not fl.sent
