"""What an operator expects from a router next to sglang-router: readiness apart
from liveness, worker and client API keys, request ids, OpenAI-shaped errors and
/v1/models from a healthy worker (stub workers)."""


import aiohttp
import orjson
import pytest

from eldr_sglang.router import Router, start_router
from eldr_sglang.testing.stub_worker import StubWorker
from tests.integration.helpers import BOOT_PORT, cluster, free_port, post, until

pytestmark = pytest.mark.timeout(60)


async def test_ready_needs_a_healthy_prefill_and_decode_while_health_stays_live():
    async with cluster(n_decode=2, health_interval=0.05, health_failures=1,
                       health_timeout=0.5) as (router, url, prefill, decodes, http):
        async with http.get(f"{url}/ready") as r:
            assert r.status == 200 and (await r.json())["ready"] is True
        prefill.health_status = 503
        await until(lambda: not router.pool.prefills[0].alive, what="prefill taken out")
        for path in ("/ready", "/readiness"):
            async with http.get(url + path) as r:
                state = await r.json()
                assert r.status == 503 and state["healthy"] == {"prefill": 0, "decode": 2}
        for path in ("/health", "/liveness"):
            async with http.get(url + path) as r:
                assert r.status == 200
        prefill.health_status = 200
        await until(lambda: router.pool.prefills[0].alive, what="prefill back")
        async with http.get(f"{url}/ready") as r:
            assert r.status == 200


async def test_worker_api_key_is_sent_to_every_worker():
    async with cluster(n_decode=2, prefill_kw={"api_key": "wk"}, decode_kw={"api_key": "wk"},
                       worker_api_key="wk") as (router, url, prefill, decodes, http):
        for t in (0, 1):
            st, raw = await post(http, f"{url}/generate", {"text": f"topic:{t}"})
            assert st == 200, raw
        assert all(h.get("authorization") == "Bearer wk"
                   for w in [prefill] + decodes for h in w.headers)
        async with http.get(f"{url}/v1/models") as r:
            assert r.status == 200
    async with cluster(n_decode=2, prefill_kw={"api_key": "wk"}) as (
            router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "topic:0"})
        assert st == 401 and b"127.0.0.1" not in raw  # the worker's refusal, no address


def test_worker_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("ELDR_WORKER_API_KEY", "from-env")
    router = Router([("http://127.0.0.1:1", BOOT_PORT)], ["http://127.0.0.1:2"], "jsq")
    assert router.worker_api_key == "from-env"


async def test_client_api_key_guards_the_generate_routes():
    # no signature key: the intake takes the API key, so the engine signs with it
    async with cluster(n_decode=2, api_key="ck", prefill_kw={"signature_key": b"ck"}) as (
            router, url, prefill, decodes, http):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "ck"}):
            st, raw = await post(http, f"{url}/generate", {"text": "topic:0"}, headers=headers)
            assert st == 401 and "API key" in orjson.loads(raw)["error"]
            st, raw = await post(http, f"{url}/v1/completions", {"prompt": "a"}, headers=headers)
            err = orjson.loads(raw)["error"]
            assert st == 401 and err["type"] == "authentication_error" and err["code"] == 401
        assert not prefill.requests
        ok = {"Authorization": "Bearer ck"}
        st, raw = await post(http, f"{url}/generate", {"text": "topic:0"}, headers=ok)
        assert st == 200, raw
        assert "authorization" not in prefill.headers[-1]  # the client's key stays here
        async with http.get(f"{url}/health") as r:
            assert r.status == 200  # probes need no key


async def test_request_ids_are_read_forwarded_and_echoed():
    async with cluster(n_decode=2) as (router, url, prefill, decodes, http):
        async with http.post(f"{url}/generate", data=orjson.dumps({"text": "topic:1"}),
                             headers={"X-Request-Id": "abc-123"}) as r:
            assert r.status == 200 and r.headers["x-request-id"] == "abc-123"
        assert prefill.headers[-1].get("x-request-id") == "abc-123"
        assert decodes[1].headers[-1].get("x-request-id") == "abc-123"
        body = {"text": "topic:0", "stream": True}
        async with http.post(f"{url}/generate", data=orjson.dumps(body),
                             headers={"x-correlation-id": "corr-9"}) as r:
            await r.read()
            assert r.headers["x-correlation-id"] == "corr-9"
        async with http.post(f"{url}/generate", data=orjson.dumps({"text": "topic:0"})) as r:
            made = r.headers["x-request-id"]
            assert len(made) == 32
        assert decodes[0].headers[-1].get("x-request-id") == made
        async with http.post(f"{url}/generate", data=b"{bad",
                             headers={"x-request-id": "e1"}) as r:
            assert r.status == 400 and r.headers["x-request-id"] == "e1"
    async with cluster(n_decode=2, request_id_headers="x-trace-id") as (
            router, url, prefill, decodes, http):
        async with http.post(f"{url}/generate", data=orjson.dumps({"text": "topic:1"}),
                             headers={"x-trace-id": "t-1", "x-request-id": "ignored"}) as r:
            assert r.headers["x-trace-id"] == "t-1" and "x-request-id" not in r.headers


async def test_openai_routes_answer_openai_error_objects():
    async with cluster(n_decode=2, max_inflight=1) as (router, url, prefill, decodes, http):
        for path, body, status in (("/v1/chat/completions", {"messages": []}, 400),
                                   ("/v1/completions", b"{bad", 400),
                                   ("/v1/completions", {"prompt": ["a"] * 300}, 413)):
            st, raw = await post(http, url + path, body)
            err = orjson.loads(raw)["error"]
            assert st == status and set(err) >= {"message", "type", "code"}, raw
            assert err["code"] == status and err["type"] == "invalid_request_error"
        decodes[0].fail_first = decodes[1].fail_first = 1
        st, raw = await post(http, f"{url}/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "topic:0"}]})
        err = orjson.loads(raw)["error"]
        assert st == 500 and err["type"] == "server_error" and "stub d" in err["message"]
        st, raw = await post(http, f"{url}/generate", b"{bad")  # /generate keeps its form
        assert st == 400 and isinstance(orjson.loads(raw)["error"], str)


async def test_models_come_from_a_healthy_worker_not_the_first_prefill():
    live = StubWorker("prefill", name="p1", model="served-model")
    decode = StubWorker("decode", name="d0", model="served-model")
    lurl, durl = await live.start(), await decode.start()
    dead = f"http://127.0.0.1:{free_port()}"
    router = Router([(dead, 7001), (lurl, 7002)], [durl], "jsq", health_interval=0.05,
                    health_failures=1, health_timeout=0.5)
    runner, port = await start_router(router)
    try:
        await until(lambda: not router.pool.prefills[0].alive, what="dead prefill out")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/v1/models") as r:
                assert r.status == 200
                assert (await r.json())["data"][0]["id"] == "served-model"
    finally:
        await runner.cleanup()
        await live.stop()
        await decode.stop()
