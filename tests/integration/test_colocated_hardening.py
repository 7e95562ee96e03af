"""Co-located mode has the PD router's client conventions and limits: API keys (client
and worker), request ids read, forwarded and echoed, OpenAI-shaped errors on /v1/*, body
cap and body/header time limits, a first-byte timeout, connections per worker capped,
readiness, and /eldr/status admin only. Stub workers, one in-process router."""

import asyncio
import contextlib

import aiohttp
import orjson

from eldr_sglang.router.http.serve import start_router
from eldr_sglang.router.colocated import ColocatedRouter
from eldr_sglang.testing.stub_worker import StubWorker
from tests.integration.helpers import post, until
from tests.integration.test_colocated import TOPICS, make_artifact, topic_ids


@contextlib.asynccontextmanager
async def colocated(worker_kw=None, **settings):
    workers = [StubWorker("decode", name=f"w{i}", **(worker_kw or {})) for i in range(TOPICS)]
    urls = [await w.start() for w in workers]
    settings = {"health_interval": 0, "load_interval": 0, **settings}
    router = ColocatedRouter(urls, artifact=make_artifact(), **settings)
    runner, port = await start_router(router)
    http = aiohttp.ClientSession()
    try:
        yield router, f"http://127.0.0.1:{port}", workers, http
    finally:
        await http.close()
        await runner.cleanup()
        for w in workers:
            await w.stop()


def gen(k=1, **extra):
    return {"input_ids": topic_ids(k), "sampling_params": {"max_new_tokens": 2}, **extra}


async def test_client_and_worker_api_keys():
    async with colocated(worker_kw={"api_key": "wk"}, api_key="secret", worker_api_key="wk") as (
            router, url, workers, http):
        for path in ("/generate", "/eldr/score"):
            status, raw = await post(http, url + path, gen())
            assert status == 401 and "API key" in orjson.loads(raw)["error"]
        status, raw = await post(http, url + "/v1/completions", {"prompt": [1, 2, 3]})
        assert status == 401 and orjson.loads(raw)["error"]["type"] == "authentication_error"
        wrong = {"Authorization": "Bearer wk"}  # the worker's key is not the client's
        assert (await post(http, url + "/generate", gen(), headers=wrong))[0] == 401
        assert sum(w.served for w in workers) == 0
        for path in ("/health", "/ready"):  # probes need no key
            async with http.get(url + path) as r:
                assert r.status == 200
        auth = {"Authorization": "Bearer secret"}
        status, raw = await post(http, url + "/generate", gen(2), headers=auth)
        assert status == 200, raw  # the stub answers 401 without the worker key
        assert workers[2].headers[-1]["authorization"] == "Bearer wk"
        async with http.get(url + "/v1/models", headers=auth) as r:
            assert r.status == 200


async def test_request_id_read_forwarded_and_echoed():
    async with colocated() as (router, url, workers, http):
        for stream in (False, True):
            async with http.post(url + "/generate", data=orjson.dumps(gen(3, stream=stream)),
                                 headers={"X-Request-Id": f"abc-{stream}"}) as r:
                await r.read()
                assert r.status == 200 and r.headers["X-Request-Id"] == f"abc-{stream}"
            assert workers[3].headers[-1]["x-request-id"] == f"abc-{stream}"
        async with http.post(url + "/generate", data=orjson.dumps(gen(0))) as r:
            await r.read()
            made = r.headers["X-Request-Id"]
        assert len(made) == 32 and workers[0].headers[-1]["x-request-id"] == made
        status, raw = await post(http, url + "/v1/chat/completions", {"messages": []},
                                 headers={"X-Request-Id": "bad-1"})
        err = orjson.loads(raw)["error"]
        assert status == 400 and err["type"] == "invalid_request_error" and "messages" in err["message"]


async def test_body_cap_and_body_time_limit():
    async with colocated(max_body_mb=0.001, client_body_timeout=0.3) as (router, url, workers, http):
        big = gen(1)
        big["input_ids"] = list(range(3000))
        for path in ("/generate", "/eldr/score"):
            status, raw = await post(http, url + path, big)
            assert status == 413 and "too large" in orjson.loads(raw)["error"]
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 500\r\n\r\n{\"input_ids\"")  # the rest never comes
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), 30)
        writer.close()
        assert head.startswith(b"HTTP/1.1 408") and b"not received within" in head
        assert sum(w.served for w in workers) == 0


async def test_slow_headers_are_closed():
    async with colocated(client_header_timeout=0.3) as (router, url, workers, http):
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by the router
        writer.close()
        assert router.guards.closed == 1


async def test_first_byte_timeout_is_504_json():
    async with colocated(worker_kw={"hang": True}, first_byte_timeout=0.3) as (router, url, workers, http):
        status, raw = await post(http, url + "/generate", gen(1))
        assert status == 504 and "failed" in orjson.loads(raw)["error"]


async def test_connections_per_worker_capped():
    async with colocated(worker_kw={"latency": 0.2}, worker_max_connections=1, policy="round_robin") as (
            router, url, workers, http):
        n = 3 * TOPICS
        results = await asyncio.gather(*(post(http, url + "/generate", gen(k % TOPICS)) for k in range(n)))
        assert [s for s, _ in results] == [200] * n
        assert sum(w.served for w in workers) == n
        assert max(w.max_active for w in workers) == 1


async def test_readiness_follows_workers_and_draining():
    async with colocated(health_failures=1) as (router, url, workers, http):
        async with http.get(url + "/ready") as r:
            state = await r.json()
            assert r.status == 200 and state["ready"] and state["healthy"]["worker"] == TOPICS
        for w in workers:
            w.health_status = 503
        await router.pool.check_health()
        await until(lambda: not any(w.available() for w in router.pool.decodes), what="workers out")
        async with http.get(url + "/readiness") as r:
            assert r.status == 503 and (await r.json())["healthy"]["worker"] == 0
        for w in workers:
            w.health_status = 200
        await router.pool.check_health()
        router.runtime.draining = True
        async with http.get(url + "/ready") as r:
            assert r.status == 503 and (await r.json())["draining"]
        async with http.get(url + "/liveness") as r:
            assert r.status == 503


async def test_status_is_admin_only():
    async with colocated(admin_token="adm") as (router, url, workers, http):
        async with http.get(url + "/eldr/status") as r:
            assert r.status == 403
        async with http.get(url + "/eldr/status", headers={"Authorization": "Bearer adm"}) as r:
            assert r.status == 200 and (await r.json())["mode"] == "colocated"
