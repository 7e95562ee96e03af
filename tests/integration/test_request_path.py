"""One request path for every surface: the PD router, the co-located router,
``POST /eldr/score`` and the pre-router's in-process scorer read a body the same way
(off the loop when big, the fields routing reads as small scalars or a 400 naming the
field, a batch cap, token ids in range) and do the prompt work (tokenising, chat
templates, prediction) on a bounded view of the prompt, off the event loop.

Stub workers, routers in process; a loop watch measures the longest the router's
event loop went without running a 5 ms ticker while one odd body is in flight."""

import asyncio
import contextlib
import logging

import aiohttp
import orjson
import pytest

from eldr_sglang.prompts import load_tokenizer
from eldr_sglang.router import Router
from eldr_sglang.router.colocated import ColocatedRouter
from eldr_sglang.router.http.malformed import MalformedRequests
from eldr_sglang.router.http.serve import start_router
from eldr_sglang.testing.stub_worker import StubWorker
from tests.integration.helpers import cluster, post, until
from tests.integration.test_colocated import TOPICS, make_artifact, topic_ids
from tests.integration.test_colocated import colocated as colocated_router
from tests.integration.test_router_round3 import LoopWatch, sink_worker

TOKENIZER = "models/eldr-tiny-moe"
MB = 1 << 20


def colocated(**settings):
    """The co-located router of test_colocated, with the model's tokenizer."""
    return colocated_router(tokenizer=load_tokenizer(TOKENIZER), **settings)


# ---------------------------------------------------------------- odd bodies
def _junk(n_bytes: int) -> bytes:
    return b"[" + b"[]," * (n_bytes // 3) + b"[]]"


def odd_bodies(route: str) -> dict[str, bytes]:
    """One body of each odd shape for ``route`` (8 MB or a 100,000-item batch)."""
    prompt_key = {"/generate": b"text", "/eldr/score": b"text", "/v1/completions": b"prompt"}.get(route)
    bodies = {
        "unknown_field": b'{"input_ids": [1, 2, 3], "junk": ' + _junk(8 * MB) + b"}",
        "n": b'{"input_ids": [1, 2, 3], "n": ' + _junk(8 * MB) + b"}",
        "model": b'{"input_ids": [1, 2, 3], "model": ' + _junk(8 * MB) + b"}",
        "stream": b'{"input_ids": [1, 2, 3], "stream": ' + _junk(8 * MB) + b"}",
        "big_ids": b'{"input_ids": [' + b"1," * (4 * MB) + b"1]}",
        "batch_of_tiny_ids": b'{"input_ids": [' + b"[1]," * 100_000 + b"[1]]}",
    }
    if prompt_key is not None:
        bodies["big_text"] = b'{"%s": "' % prompt_key + b"a " * (4 * MB) + b'"}'
        bodies["batch_of_tiny_texts"] = b'{"%s": [' % prompt_key + b'"a",' * 100_000 + b'"a"]}'
    if route in ("/v1/chat/completions", "/eldr/score"):
        msg = b'{"role": "user", "content": "hi"},'
        bodies["many_messages"] = b'{"messages": [' + msg * 270_000 + b'{"role": "user", "content": "x"}]}'
        bodies["big_message"] = b'{"messages": [{"role": "user", "content": "' + b"a " * (4 * MB) + b'"}]}'
    if route == "/v1/chat/completions":
        for k in ("unknown_field", "n", "model", "stream"):
            bodies[k] = bodies[k].replace(b'"input_ids": [1, 2, 3]', b'"messages": [{"role": "user", "content": "hi"}]')
        del bodies["big_ids"], bodies["batch_of_tiny_ids"]
    if route == "/v1/completions":
        for k in ("unknown_field", "n", "model", "stream"):
            bodies[k] = bodies[k].replace(b'"input_ids": [1, 2, 3]', b'"prompt": [1, 2, 3]')
        bodies["big_ids"] = bodies["big_ids"].replace(b'"input_ids"', b'"prompt"')
        bodies["batch_of_tiny_ids"] = bodies["batch_of_tiny_ids"].replace(b'"input_ids"', b'"prompt"')
    return bodies


async def _idle_worst(url: str, http: aiohttp.ClientSession) -> float:
    """The loop watch's worst over a few small requests: the control."""
    with LoopWatch() as watch:
        for _ in range(3):
            async with http.get(url + "/health") as r:
                await r.read()
        await asyncio.sleep(0.02)
    return watch.worst


async def _stall(url: str, route: str, body: bytes, http: aiohttp.ClientSession) -> tuple[float, int, bytes]:
    with LoopWatch() as watch:
        async with http.post(url + route, data=body) as r:
            raw = await r.read()
        await asyncio.sleep(0.02)  # the ticker runs once more: a stall at the end is seen
    return watch.worst, r.status, raw


STALL_BUDGET = 0.05  # seconds beyond the idle control


def _check_stall(name: str, worst: float, idle: float, status: int, raw: bytes) -> None:
    print(f"{name}: worst loop stall {worst * 1e3:.1f} ms (idle {idle * 1e3:.1f} ms), HTTP {status}")
    assert status < 500, raw[:300]
    assert worst <= idle + STALL_BUDGET, f"{name}: the event loop stalled {worst:.3f} s"


@contextlib.asynccontextmanager
async def sink_routers():
    """A co-located router (eldr, predictor, tokenizer) and a PD router in front of sink
    workers, which read a body without parsing it (a stub would parse it on this loop)."""
    sinks = [await sink_worker() for _ in range(TOPICS + 2)]
    urls = [u for _, u in sinks]
    colo = ColocatedRouter(urls[:TOPICS], artifact=make_artifact(), tokenizer=load_tokenizer(TOKENIZER),
                           policy="eldr", health_interval=0, load_interval=0)
    pd = Router([(urls[TOPICS], 8998)], [urls[TOPICS + 1]], "round_robin", health_interval=0, load_interval=0)
    runners = [await start_router(r) for r in (colo, pd)]
    http = aiohttp.ClientSession()
    try:
        yield [f"http://127.0.0.1:{port}" for _, port in runners], http
    finally:
        await http.close()
        for runner, _ in runners:
            await runner.cleanup()
        for server, _ in sinks:
            server.close()


COLOCATED_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/eldr/score")
PD_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


async def test_no_body_stalls_any_router():
    """Every odd shape on every route of both routers, one at a time, after a warm-up
    that starts the parser process: the loop never waits 50 ms beyond the control."""
    async with sink_routers() as ((colo, pd), http):
        for url in (colo, pd):
            warm = b'{"input_ids": [1, 2]}' + b" " * (300 << 10)
            assert (await post(http, url + "/generate", warm))[0] == 200
        idle = max([await _idle_worst(url, http) for url in (colo, pd)])
        for kind, url, routes in (("colocated", colo, COLOCATED_ROUTES), ("pd", pd, PD_ROUTES)):
            for route in routes:
                for name, body in odd_bodies(route).items():
                    worst, status, raw = await _stall(url, route, body, http)
                    if worst > idle + STALL_BUDGET:  # once more: a stall of the router's own repeats
                        worst = min(worst, (await _stall(url, route, body, http))[0])
                    _check_stall(f"{kind} {route} {name}", worst, idle, status, raw)


async def test_no_body_stalls_the_prerouter_scorer():
    from eldr_sglang.integrations.scorer import LocalScorer

    scorer = LocalScorer(make_artifact(), tokenizer=load_tokenizer(TOKENIZER), policy="eldr")
    workers = [f"w{i}" for i in range(TOPICS)]
    await scorer.choose({"input_ids": topic_ids(1)}, "generate", workers, {})
    cases = {"big_text": ({"text": "a " * (4 * MB)}, "generate"),
             "big_ids": ({"input_ids": [1] * (4 * MB)}, "generate"),
             "batch_of_ids": ({"input_ids": [[1]] * 100_000}, "generate"),
             "batch_of_texts": ({"prompt": ["a"] * 100_000}, "v1/completions"),
             "many_messages": ({"messages": [{"role": "user", "content": "hi"}] * 270_000}, "v1/chat/completions")}
    with LoopWatch() as watch:
        await asyncio.sleep(0.05)
    idle = watch.worst
    for name, (body, endpoint) in cases.items():
        with LoopWatch() as watch:
            await asyncio.sleep(0.01)
            try:
                choice = await scorer.choose(body, endpoint, workers, {})
            except ValueError:
                choice = None  # the adapter falls back
            if choice is not None:
                scorer.release(choice)
            await asyncio.sleep(0.02)
        _check_stall(f"prerouter {name}", watch.worst, idle, 200, b"")


def _message(raw: bytes) -> str:
    """An error answer's message (OpenAI routes nest it)."""
    err = orjson.loads(raw)["error"]
    return err["message"] if isinstance(err, dict) else err


# ---------------------------------------------------------------- view fields
@pytest.mark.parametrize("field", ["n", "model", "stream", "best_of"])
async def test_view_fields_are_small_scalars_or_400(field):
    """A list, an object or megabytes where the router reads a scalar is a 400 naming
    the field, on both routers; ``stream: [...]`` is never served as a stream."""
    async with colocated() as (router, url, workers, http):
        for value in ([1], {"a": 1}, "x" * (64 << 10) if field == "model" else [[]] * 10):
            body = {"prompt": topic_ids(1), field: value}
            status, raw = await post(http, url + "/v1/completions", body)
            assert status == 400, (field, value, raw[:200])
            assert field in _message(raw), raw
    async with cluster(n_decode=2) as (router, url, prefill, decodes, http):
        for value in ([1], {"a": 1}, [[]] * 10):
            status, raw = await post(http, url + "/v1/completions", {"prompt": "hi", field: value})
            assert status == 400, (field, value, raw[:200])
            assert field in _message(raw), raw
        assert prefill.served == 0


# ---------------------------------------------------------------- n / best_of / ids
SPELLINGS = [2, 1, None, 2.0, "2", " 2", "02", "+2", "2.0", "2_0", "²", "٢", True, False, [2], {"n": 2},
             -1, 0, 2 ** 63, 2 ** 64 - 1, 1e30, 1.9, "", "1", 1.0]


def _n_bodies(route: str, value) -> list[dict]:
    if route == "/generate":
        return [{"text": "hi", "sampling_params": {"n": value, "max_new_tokens": 1}},
                {"text": "hi", "sampling_params": [{"n": value}]}]
    key = {"/v1/completions": {"prompt": "hi"},
           "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}}[route]
    out = [{**key, "n": value}]
    if route == "/v1/completions":
        out += [{**key, "best_of": value}, {**key, "n": 1, "best_of": value}]
    return out


def _served_n_above_one(worker: StubWorker) -> list[dict]:
    bad = []
    for body in worker.requests:
        values = [body.get("n"), body.get("best_of")]
        sp = body.get("sampling_params")
        for params in sp if isinstance(sp, list) else [sp]:
            if isinstance(params, dict):
                values.append(params.get("n"))
        if any(v is not None and v != 1 for v in values):
            bad.append(body)
    return bad


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
async def test_n_and_best_of_spellings(route):
    """Every spelling: never a 500; the PD router lets no n or best_of other than 1
    (or absent) reach a prefill; anything not a plain JSON integer is a 400 naming the
    field on both routers."""
    async with cluster(n_decode=2) as (router, url, prefill, decodes, http):
        for value in SPELLINGS:
            for body in _n_bodies(route, value):
                status, raw = await post(http, url + route, body)
                assert status < 500, (value, body, raw[:200])
                plain = value is None or (type(value) is int and value == 1)
                if not plain:
                    assert status == 400, (value, body, raw[:200])
        assert _served_n_above_one(prefill) == []
    async with colocated() as (router, url, workers, http):
        for value in SPELLINGS:
            for body in _n_bodies(route, value):
                status, raw = await post(http, url + route, body)
                assert status < 500, (value, body, raw[:200])
                integer = value is None or (type(value) is int and 1 <= value < 2 ** 31)
                if not integer:
                    assert status == 400, (value, body, raw[:200])


@pytest.mark.parametrize("route,key", [("/generate", "input_ids"), ("/v1/completions", "prompt"),
                                       ("/eldr/score", "input_ids")])
async def test_token_ids_out_of_range_are_400(route, key):
    async with colocated() as (router, url, workers, http):
        for bad in ([2 ** 63], [2 ** 64 - 1], [1, -1], [[1], [2 ** 63]], [1.5], [True]):
            status, raw = await post(http, url + route, {key: bad})
            assert status == 400, (bad, raw[:200])
            assert key in _message(raw), raw
        assert sum(w.served for w in workers) == 0


@pytest.mark.parametrize("route,key", [("/generate", "text"), ("/generate", "input_ids"),
                                       ("/v1/completions", "prompt"), ("/eldr/score", "input_ids")])
async def test_batch_cap_on_the_colocated_router_and_score(route, key):
    async with colocated(max_batch=8) as (router, url, workers, http):
        items = [topic_ids(1)] * 9 if key != "text" else ["hi"] * 9
        status, raw = await post(http, url + route, {key: items})
        assert status == 413, raw[:200]
        assert "--max-batch" in _message(raw), raw
        status, raw = await post(http, url + route, {key: items[:8]})
        assert status == 200, raw[:200]


# ---------------------------------------------------------------- prompt lists, streams, logs
async def test_openai_prompt_list_waits_for_every_room():
    """A /v1/completions list of prompts is a batch: one room per prompt, the decision
    waits for every room's signature and combines them; no message is left unclaimed."""
    async with cluster(n_decode=2) as (router, url, prefill, decodes, http):
        status, raw = await post(http, url + "/v1/completions", {"prompt": ["topic:0", "topic:1"], "max_tokens": 1})
        assert status == 200, raw
        sent = prefill.requests[-1]
        assert isinstance(sent["bootstrap_room"], list) and len(sent["bootstrap_room"]) == 2
        assert isinstance(sent["bootstrap_host"], list) and len(sent["bootstrap_host"]) == 2
        counters = router.metrics.counters()
        assert counters.get("signatures_used", 0) == 2, counters
        await until(lambda: len(prefill.signatures) >= 2 or True)
        text = router.metrics.render()[0].decode()
        assert 'signature_messages_total{result="unclaimed"}' not in text or \
            'signature_messages_total{result="unclaimed"} 0.0' in text


async def test_a_finished_stream_is_not_aborted():
    """A client that reads a stream to ``[DONE]`` and closes at once (as the openai
    client does) finished it: no disconnect counted, no abort posted."""
    gate = asyncio.Event()  # the decode server ends its stream only after the client closed
    async with cluster(n_decode=2, decode_kw={"eof_gate": gate}) as (router, url, prefill, decodes, http):
        port = int(url.rsplit(":", 1)[1])
        for i in range(3):
            gate.clear()
            body = orjson.dumps({"messages": [{"role": "user", "content": f"topic:{i % 2}"}],
                                 "stream": True, "stream_options": {"include_usage": True}})
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            seen = b""
            while b"[DONE]" not in seen:
                chunk = await reader.read(65536)
                assert chunk, seen
                seen += chunk
            writer.transport.abort()  # closed at [DONE], before the chunked terminator
            await until(lambda: router.admission.active == 0, what="the router saw the client close")
            gate.set()
        await until(lambda: router.admission.active == 0, what="requests ended")
        await asyncio.sleep(0)
        assert router.metrics.counters().get("client_disconnects", 0) == 0
        assert prefill.aborts == [] and all(d.aborts == [] for d in decodes)


async def test_malformed_requests_log_one_rate_limited_warning(caplog):
    async with cluster(n_decode=1) as (router, url, prefill, decodes, http):
        port = int(url.rsplit(":", 1)[1])
        caplog.set_level(logging.DEBUG)
        for f in logging.getLogger("eldr_sglang.router.http").filters:  # a fresh window
            if isinstance(f, MalformedRequests):
                f._last = float("-inf")
        for head in (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
                     b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x7fb\r\n\r\n",
                     b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\rb\r\n\r\n",
                     b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 10) + b"\r\n\r\n") * 3:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            await writer.drain()
            answer = await reader.read(4096)
            writer.close()
            assert answer.startswith(b"HTTP/1.") and answer[9:10] == b"4", answer[:100]
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "malformed" in r.getMessage()]
        assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]
        assert "127.0.0.1" in warnings[0].getMessage()
        assert not any(r.exc_info for r in warnings)
        async with http.get(url + "/health") as r:
            assert r.status == 200


async def test_early_binding_predicts_off_the_loop():
    """``--binding early`` predicts the PD request's signature at arrival: on the prompt
    thread, from the bounded view, never on the event loop."""
    async with cluster(n_decode=TOPICS, artifact=make_artifact(), binding="early",
                       tokenizer=TOKENIZER) as (router, url, prefill, decodes, http):
        status, raw = await post(http, url + "/generate", {"input_ids": topic_ids(2)})
        assert status == 200 and orjson.loads(raw)["meta_info"]["server"] == "d2", raw
        assert router.metrics.value("route_path", mode="early", path="early") == 1
        idle = await _idle_worst(url, http)
        body = orjson.dumps({"text": "a " * (120 << 10)})  # under the parser process's threshold
        worst, status, raw = await _stall(url, "/generate", body, http)
        _check_stall("pd early binding big_text", worst, idle, status, raw)
