"""CORS (``--cors-origins``), the access log (``--access-log``) and JSON log lines
(``--log-format json``) of the router, on stub workers."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import orjson
import pytest

from eldr_sglang.router import cli as router_cli
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.http.http_conventions import ACCESS_LOGGER, cors_origins_of
from tests.integration.helpers import cluster, post

pytestmark = pytest.mark.timeout(60)
APP = "https://app.example"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


async def test_cors_preflight_and_answers_for_allowed_origins_only():
    async with cluster(n_decode=2, policy="round_robin", cors_origins=f"{APP}, http://localhost:3000",
                       api_key="ck") as (router, url, prefill, decodes, http):
        # a preflight carries no credentials: answered before the API-key check
        async with http.options(f"{url}/v1/chat/completions", headers=PREFLIGHT) as r:
            assert r.status == 204
            assert r.headers["Access-Control-Allow-Origin"] == APP
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        async with http.options(f"{url}/generate", headers={**PREFLIGHT, "Origin": "https://evil.example"}) as r:
            assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
        ok = {"Authorization": "Bearer ck", "Origin": APP}
        async with http.post(f"{url}/generate", data=orjson.dumps({"text": "topic:0"}), headers=ok) as r:
            assert r.status == 200
            assert r.headers["Access-Control-Allow-Origin"] == APP and r.headers["Vary"] == "Origin"
            assert "x-request-id" in r.headers["Access-Control-Expose-Headers"].lower()
        body = {"text": "topic:1", "stream": True}  # a stream sends its headers before the handler returns
        async with http.post(f"{url}/generate", data=orjson.dumps(body), headers=ok) as r:
            await r.read()
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == APP
        async with http.post(f"{url}/generate", data=orjson.dumps({"text": "topic:0"}),
                             headers={"Origin": APP}) as r:  # refusals carry it too (the browser reads them)
            assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == APP
        async with http.get(f"{url}/health", headers={"Origin": "https://evil.example"}) as r:
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        async with http.get(f"{url}/health") as r:
            assert "Access-Control-Allow-Origin" not in r.headers
    async with cluster(n_decode=2, policy="round_robin") as (router, url, prefill, decodes, http):
        async with http.options(f"{url}/generate", headers=PREFLIGHT) as r:
            assert r.status == 405 and "Access-Control-Allow-Origin" not in r.headers
        async with http.post(f"{url}/generate", data=orjson.dumps({"text": "topic:0"}),
                             headers={"Origin": APP}) as r:
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers


async def test_any_origin_with_a_star():
    async with cluster(n_decode=2, policy="round_robin", cors_origins="*") as (
            router, url, prefill, decodes, http):
        async with http.get(f"{url}/v1/models", headers={"Origin": "https://x.example"}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
            assert "Vary" not in r.headers


async def test_access_log_has_one_line_per_request(caplog):
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        async with cluster(n_decode=2, policy="round_robin", access_log=True) as (
                router, url, prefill, decodes, http):
            st, _ = await post(http, f"{url}/generate", {"text": "topic:0"}, headers={"X-Request-Id": "r-1"})
            assert st == 200
            st, _ = await post(http, f"{url}/generate", b"{bad")
            assert st == 400
            body = {"text": "topic:1", "stream": True}
            async with http.post(f"{url}/generate", data=orjson.dumps(body)) as r:
                streamed = len(await r.read())
    lines = [r for r in caplog.records if r.name == ACCESS_LOGGER and r.path == "/generate"]
    assert any(r.path == "/eldr/signature" for r in caplog.records if r.name == ACCESS_LOGGER)  # the stub's posts
    assert [(r.method, r.path, r.status) for r in lines] == [
        ("POST", "/generate", 200), ("POST", "/generate", 400), ("POST", "/generate", 200)]
    assert lines[0].request_id == "r-1" and "id=r-1" in lines[0].getMessage()
    assert lines[2].bytes >= streamed > 0 and all(r.duration_ms > 0 for r in lines)
    assert lines[0].remote == "127.0.0.1"


async def test_no_access_log_unless_asked(caplog):
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        async with cluster(n_decode=2, policy="round_robin") as (router, url, prefill, decodes, http):
            assert (await post(http, f"{url}/generate", {"text": "topic:0"}))[0] == 200
    assert not [r for r in caplog.records if r.name == ACCESS_LOGGER]


def test_json_log_lines():
    code = ("import logging; from eldr_sglang.router.http.http_conventions import setup_logging; "
            "setup_logging('info', 'json'); "
            "logging.getLogger('eldr_sglang.router.access').info('POST /generate %d', 200, "
            "extra={'status': 200, 'path': '/generate'}); "
            "logging.getLogger('eldr_sglang.router').debug('hidden')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (line,) = done.stderr.strip().splitlines()
    record = json.loads(line)
    assert record["message"] == "POST /generate 200" and record["level"] == "INFO"
    assert record["logger"] == "eldr_sglang.router.access" and record["status"] == 200 and record["time"]


@pytest.mark.parametrize("value,wanted", [
    ("ftp://x.example", "not an origin"), ("https://app.example/path", "not an origin"), (" , ", "at least one"),
    ("https://app.example:99999", "bad port"),
])
def test_bad_cors_origins_name_the_field(value, wanted):
    with pytest.raises(ValueError, match=f"cors_origins: .*{wanted}"):
        RouterConfig(cors_origins=value)
    assert cors_origins_of("https://a.example/, *") == {"https://a.example", "*"}


@pytest.mark.parametrize("extra,wanted", [
    (["--cors-origins", "nope"], "--cors-origins: 'nope' is not an origin"),
    (["--log-format", "xml"], "--log-format"),
])
def test_bad_flags_are_one_line(capsys, extra, wanted):
    argv = ["--prefill", "http://127.0.0.1:30000", "8998", "--decode", "http://127.0.0.1:30001",
            "--policy", "round_robin", *extra]
    with pytest.raises(SystemExit) as e:
        router_cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and wanted in err and len(err.strip().splitlines()) == 1, err


async def test_the_colocated_router_has_them_too(caplog):
    from eldr_sglang.router.colocated import ColocatedRouter
    from eldr_sglang.router.http.serve import start_router
    from eldr_sglang.testing.stub_worker import StubWorker
    from tests.integration.test_colocated import make_artifact, topic_ids

    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        import aiohttp
        workers = [StubWorker("decode", name=f"w{i}") for i in range(4)]
        urls = [await w.start() for w in workers]
        router = ColocatedRouter(urls, artifact=make_artifact(), policy="eldr", health_interval=0, load_interval=0,
                                 cors_origins=APP, access_log=True)
        runner, port = await start_router(router)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.options(f"http://127.0.0.1:{port}/generate", headers=PREFLIGHT) as r:
                    assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == APP
                body = {"input_ids": topic_ids(1), "sampling_params": {"max_new_tokens": 2}}
                async with http.post(f"http://127.0.0.1:{port}/generate", json=body, headers={"Origin": APP}) as r:
                    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == APP
        finally:
            await runner.cleanup()
            for w in workers:
                await w.stop()
    assert [(r.method, r.status) for r in caplog.records if r.name == ACCESS_LOGGER] == [("OPTIONS", 204),
                                                                                         ("POST", 200)]
