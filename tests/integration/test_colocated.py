"""Co-located mode and POST /eldr/score on stub workers: requests go to the server whose
region the PREDICTED signature is nearest, bodies and streams pass unchanged, the path
each request took is counted, bad input gets 4xx JSON."""

import contextlib

import aiohttp
import numpy as np
import orjson
import pytest

from eldr_sglang.core import CalibrationArtifact, ModelSpec
from eldr_sglang.core.predictor import SignaturePredictor
from eldr_sglang.prompts import load_tokenizer
from eldr_sglang.router.http.serve import start_router
from eldr_sglang.router.cli import parse_args
from eldr_sglang.router.colocated import ColocatedRouter
from eldr_sglang.testing.stub_worker import StubWorker
from tests.integration.helpers import post

TOPICS, PER_TOPIC, E = 4, 10, 8  # token t belongs to topic t // PER_TOPIC, which owns experts 2k, 2k + 1


def topic_table() -> np.ndarray:
    table = np.zeros((TOPICS * PER_TOPIC, 2, E))
    for t in range(len(table)):
        k = t // PER_TOPIC
        table[t, :, 2 * k:2 * k + 2] = 1.0
    return table


def topic_ids(k: int, n: int = 30, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed + k)
    return [int(x) for x in rng.integers(k * PER_TOPIC, (k + 1) * PER_TOPIC, n)]


def make_artifact(with_predictor: bool = True) -> CalibrationArtifact:
    table = topic_table()
    rng = np.random.default_rng(1)
    prompts, counts = [], []
    for _ in range(400):  # mostly one topic, a little of another
        k, j = rng.integers(TOPICS, size=2)
        ids = list(rng.integers(k * PER_TOPIC, (k + 1) * PER_TOPIC, 25)) + \
            list(rng.integers(j * PER_TOPIC, (j + 1) * PER_TOPIC, 3))
        prompts.append(ids)
        counts.append(table[ids].sum(axis=0))
    pred = SignaturePredictor(alpha=1e-3).fit(prompts, np.stack(counts)) if with_predictor else None
    idf = np.ones((2, E), np.float32)
    cents = np.stack([table[topic_ids(k)].sum(axis=0).ravel() for k in range(TOPICS)]).astype(np.float32)
    cents /= np.linalg.norm(cents, axis=1, keepdims=True)
    return CalibrationArtifact(model=ModelSpec("toy-moe", 4, E, 2), variant="idf", layers=[0, 1], idf=idf,
                               centroids=cents, tau=0.1, predictor=pred)


@contextlib.asynccontextmanager
async def colocated(n=TOPICS, artifact=None, tokenizer=None, policy="eldr", worker_kw=None, **settings):
    workers = [StubWorker("decode", name=f"w{i}", **(worker_kw or {})) for i in range(n)]
    urls = [await w.start() for w in workers]
    router = ColocatedRouter(urls, artifact=artifact if artifact is not None else make_artifact(),
                             tokenizer=tokenizer, policy=policy,
                             **{"health_interval": 0, "load_interval": 0, **settings})
    runner, port = await start_router(router)
    http = aiohttp.ClientSession()
    try:
        yield router, f"http://127.0.0.1:{port}", workers, http
    finally:
        await http.close()
        await runner.cleanup()
        for w in workers:
            await w.stop()


async def test_routes_by_predicted_signature_and_forwards_body_unchanged():
    async with colocated() as (router, url, workers, http):
        for k in (2, 0, 3, 1):
            body = {"input_ids": topic_ids(k, seed=9), "sampling_params": {"max_new_tokens": 4}, "rid": f"r{k}"}
            status, raw = await post(http, f"{url}/generate", body)
            assert status == 200, raw
            assert orjson.loads(raw)["meta_info"]["server"] == f"w{k}"
            assert workers[k].requests[-1] == {"endpoint": "generate", **body}
        assert router.metrics.value("route_path", mode="colocated", path="predicted") == 4
        status, text = await _get(http, f"{url}/metrics")
        assert 'eldr_router_route_path_total{mode="colocated",path="predicted"} 4.0' in text


async def test_streaming_and_openai_completions_relayed():
    async with colocated(worker_kw={"stream_chunks": 3}) as (router, url, workers, http):
        async with http.post(f"{url}/v1/completions",
                             json={"prompt": topic_ids(1), "stream": True, "max_tokens": 3}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            text = (await r.read()).decode()
        events = [ln for ln in text.split("\n") if ln.startswith("data: ")]
        assert len(events) == 4 and events[-1] == "data: [DONE]"
        assert orjson.loads(events[0][6:])["meta_info"]["server"] == "w1"
        assert workers[1].requests[-1]["endpoint"] == "v1/completions"


async def test_chat_and_text_use_the_models_tokenizer():
    tok = load_tokenizer("models/eldr-tiny-moe")
    words = "def parse(self, value): return value.strip()"
    ids = tok.encode(words)
    table = np.zeros((8192, 2, E))
    table[:, :, 0:2] = 1.0
    table[ids, :, :] = 0.0
    table[ids, :, 6:8] = 1.0  # this prompt's tokens are topic 3's; every other token topic 0's
    rng = np.random.default_rng(0)
    prompts = [ids] * 5 + [list(rng.integers(100, 8000, 30)) for _ in range(200)]
    counts = np.stack([table[p].sum(axis=0) for p in prompts])
    base = make_artifact(with_predictor=False)
    art = CalibrationArtifact(model=base.model, variant="idf", layers=[0, 1], idf=base.idf, centroids=base.centroids,
                              tau=0.1, predictor=SignaturePredictor(alpha=1e-3).fit(prompts, counts))

    async with colocated(artifact=art, tokenizer=tok) as (router, url, workers, http):
        status, raw = await post(http, f"{url}/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": words}], "max_tokens": 2})
        assert status == 200 and orjson.loads(raw)["meta_info"]["server"] == "w3"
        status, raw = await post(http, f"{url}/generate", {"text": "plain words of another kind"})
        assert status == 200 and orjson.loads(raw)["meta_info"]["server"] == "w0"


async def test_score_endpoint_ranks_servers():
    async with colocated() as (router, url, workers, http):
        status, raw = await post(http, f"{url}/eldr/score", {"input_ids": topic_ids(2)})
        assert status == 200, raw
        doc = orjson.loads(raw)
        assert doc["server"] == workers[2].url and doc["region"] == 2 and doc["routing_key"] == "eldr-2"
        assert [r["index"] for r in doc["ranked"]][0] == 2 and len(doc["ranked"]) == TOPICS
        sims = [r["similarity"] for r in doc["ranked"]]
        assert sims == sorted(sims, reverse=True) and doc["prompt_tokens"] == 30
        assert workers[2].served == 0  # scoring sends nothing
        assert router.metrics.value("route_path", mode="score", path="predicted") == 1


@pytest.mark.parametrize("path,body,status,needle", [
    ("/generate", b"{not json", 400, "invalid JSON"),
    ("/generate", b"[1, 2]", 400, "JSON object"),
    ("/generate", {"input_ids": [1, -2]}, 400, "input_ids"),
    ("/generate", {"text": "words"}, 400, "no tokenizer"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/eldr/score", {"input_ids": "abc"}, 400, "input_ids"),
    ("/eldr/score", {"input_ids": [1], "endpoint": "nope"}, 400, "endpoint"),
])
async def test_bad_input_gets_4xx_json(path, body, status, needle):
    async with colocated() as (router, url, workers, http):
        got, raw = await post(http, f"{url}{path}", body)
        err = orjson.loads(raw)["error"]  # OpenAI-shaped on /v1/*, as the PD router answers
        assert got == status and needle in (err["message"] if path.startswith("/v1/") else err)
        assert sum(w.served for w in workers) == 0


async def test_without_predictor_routes_by_load_and_score_says_why():
    async with colocated(artifact=make_artifact(with_predictor=False)) as (router, url, workers, http):
        status, raw = await post(http, f"{url}/generate", {"input_ids": topic_ids(2)})
        assert status == 200
        assert router.metrics.value("route_path", mode="colocated", path="fallback") == 1
        status, raw = await post(http, f"{url}/eldr/score", {"input_ids": topic_ids(2)})
        assert status == 409 and "no signature predictor" in orjson.loads(raw)["error"]


async def test_refused_connection_goes_to_the_next_choice():
    async with colocated() as (router, url, workers, http):
        await workers[2].stop()
        status, raw = await post(http, f"{url}/generate", {"input_ids": topic_ids(2)})
        assert status == 200 and orjson.loads(raw)["meta_info"]["server"] != "w2"
        assert router.metrics.value("retries", role="worker") == 1


def test_cli_mode_colocated():
    args = parse_args(["--mode", "colocated", "--worker", "http://127.0.0.1:1", "--worker", "http://127.0.0.1:2",
                       "--policy", "jsq"])
    assert args.worker == ["http://127.0.0.1:1", "http://127.0.0.1:2"] and args.router_config.mode == "colocated"
    with pytest.raises(SystemExit):
        parse_args(["--mode", "colocated", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"])


async def _get(http, url):
    async with http.get(url) as r:
        return r.status, (await r.read()).decode()


# -- PD router, --binding early|auto ---------------------------------------------------------------------
def _pd(binding, **kw):
    from tests.integration.helpers import cluster

    # the prefill never publishes a signature: late binding could only fall back
    return cluster(n_decode=TOPICS, policy="eldr", artifact=make_artifact(), binding=binding,
                   prefill_kw={"send_signature": False}, signature_timeout=0.3, signature_timeout_min=0.3,
                   health_interval=0, load_interval=0, **kw)


async def test_pd_early_binding_chooses_decode_from_predicted_signature():
    async with _pd("early") as (router, url, prefill, decodes, http):
        for k in (3, 1):
            status, raw = await post(http, f"{url}/generate", {"input_ids": topic_ids(k, seed=4)})
            assert status == 200, raw
            assert orjson.loads(raw)["meta_info"]["server"] == f"d{k}"
        assert router.metrics.value("route_path", mode="early", path="early") == 2
        assert router.metrics.value("fallbacks") == 0  # no signature was waited for


async def test_pd_auto_binding_binds_late_when_unsure():
    async with _pd("auto", binding_margin=0.05) as (router, url, prefill, decodes, http):
        sure = topic_ids(2)
        torn = topic_ids(0, n=15) + topic_ids(1, n=15)  # two regions alike: margin ~ 0
        assert (await post(http, f"{url}/generate", {"input_ids": sure}))[0] == 200
        assert (await post(http, f"{url}/generate", {"input_ids": torn}))[0] == 200
        assert router.metrics.value("route_path", mode="early", path="early") == 1
        assert router.metrics.value("route_path", mode="early", path="late") == 1
        assert router.metrics.value("fallbacks", reason="timeout") == 1  # the late one waited


async def test_pd_late_binding_is_unchanged():
    async with _pd("late") as (router, url, prefill, decodes, http):
        assert (await post(http, f"{url}/generate", {"input_ids": topic_ids(2)}))[0] == 200
        assert router.metrics.value("route_path", mode="early", path="early") == 0
        assert router.metrics.value("fallbacks", reason="timeout") == 1


@pytest.mark.parametrize("kw,needle", [({"binding": "soon"}, "binding"), ({"binding_margin": -0.1}, "binding_margin"),
                                       ({"mode": "mixed"}, "mode")])
def test_binding_and_mode_settings_are_checked(kw, needle):
    from eldr_sglang.router.config import RouterConfig

    with pytest.raises(ValueError, match=needle):
        RouterConfig(**kw)
