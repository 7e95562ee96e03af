"""Parallel sampling (n > 1, best_of) on stub workers.

The PD router refuses ``n > 1`` (one prompt or a list, every route) and ``best_of``
other than ``n`` at once with a 400 (OpenAI-shaped on ``/v1/*``) and sends nothing
upstream: SGLang 0.5.23 gives the n samples one bootstrap room, which a PD pair binds
once (the real servers hung 60 s, then answered 500). The co-located router passes
``n > 1`` on unchanged, routed by the predicted signature; it refuses ``best_of > n``
(SGLang ignores ``best_of``)."""

import time

import orjson
import pytest

from eldr_sglang.router.http.sampling import refusal, samples
from tests.integration.helpers import cluster, post
from tests.integration.test_colocated import colocated, topic_ids

PROMPT_IDS = [5, 6, 7, 8]

PD_REFUSED = [
    ("/v1/completions", {"model": "m", "prompt": "hello", "n": 2}),
    ("/v1/completions", {"model": "m", "prompt": "hello", "n": 3, "stream": True}),
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "n": 2}),
    ("/v1/completions", {"model": "m", "prompt": "hello", "n": "2"}),  # not a plain integer
    ("/v1/completions", {"model": "m", "prompt": "hello", "best_of": 3}),
    ("/v1/completions", {"model": "m", "prompt": "hello", "n": 2, "best_of": 2}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ("/generate", {"text": "hello", "sampling_params": {"n": 2, "max_new_tokens": 4}}),
    ("/generate", {"text": ["a", "b"], "sampling_params": {"n": 2}}),
    ("/generate", {"input_ids": PROMPT_IDS, "sampling_params": [{"n": 2}]}),
]


@pytest.mark.parametrize("path,body", PD_REFUSED)
async def test_pd_router_refuses_parallel_sampling_at_once(path, body):
    async with cluster(n_decode=2) as (router, url, prefill, decodes, http):
        t0 = time.perf_counter()
        status, raw = await post(http, url + path, body)
        assert time.perf_counter() - t0 < 5
        assert status == 400, raw
        err = orjson.loads(raw)["error"]
        message = err["message"] if path.startswith("/v1/") else err
        if path.startswith("/v1/"):
            assert err["type"] == "invalid_request_error" and err["code"] == 400
        assert ("bootstrap room" in message) or ("best_of" in message) or ("must be an integer" in message), message
        assert prefill.served == 0 and all(d.served == 0 for d in decodes)  # nothing went upstream
        assert router.metrics.value("errors", kind="bad_request") == 1


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "m", "prompt": "hello", "n": 1, "best_of": 1, "max_tokens": 2}),
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1}),
    ("/generate", {"text": ["hello", "hello"], "sampling_params": {"max_new_tokens": 2}}),
])
async def test_pd_router_serves_one_sample_per_prompt(path, body):
    async with cluster(n_decode=2) as (router, url, prefill, decodes, http):
        status, raw = await post(http, url + path, body)
        assert status == 200, raw
        assert prefill.served == 1 and sum(d.served for d in decodes) == 1


async def test_colocated_router_passes_n_on_routed_by_the_predicted_signature():
    async with colocated() as (router, url, workers, http):
        body = {"model": "m", "prompt": topic_ids(2), "n": 3, "max_tokens": 2}
        status, raw = await post(http, url + "/v1/completions", body)
        assert status == 200, raw
        assert workers[2].served == 1 and workers[2].requests[-1]["n"] == 3  # unchanged, one request
        status, raw = await post(http, url + "/generate", {"input_ids": [topic_ids(1), topic_ids(1, seed=5)],
                                                           "sampling_params": {"n": 2}})
        assert status == 200, raw
        assert workers[1].served == 1 and workers[1].requests[-1]["sampling_params"]["n"] == 2
        assert router.metrics.value("route_path", mode="colocated", path="predicted") == 2


async def test_colocated_router_refuses_best_of_above_n():
    async with colocated() as (router, url, workers, http):
        status, raw = await post(http, url + "/v1/completions",
                                 {"model": "m", "prompt": topic_ids(2), "n": 2, "best_of": 4})
        assert status == 400, raw
        err = orjson.loads(raw)["error"]
        assert "best_of" in err["message"] and err["type"] == "invalid_request_error"
        assert sum(w.served for w in workers) == 0


def test_samples_and_refusal_rules():
    assert samples({"prompt": "x"}, "v1/completions") == 1
    assert samples({"prompt": "x", "n": 4}, "v1/completions") == 4
    for spelled in (True, "2", 2.0, "+2", "²", [2]):  # only a plain JSON integer is a count
        with pytest.raises(ValueError, match="'n' must be an integer"):
            samples({"prompt": "x", "n": spelled}, "v1/completions")
        assert "'n' must be an integer" in refusal({"prompt": "x", "n": spelled}, "v1/completions", pd=False)
    assert samples({"text": "x", "sampling_params": [{"n": 1}, {"n": 3}]}, "generate") == 3
    assert samples({"text": "x", "n": 3}, "generate") == 1  # /generate reads sampling_params only
    assert samples({"text": "x", "sampling_params": {"n": 3, "beam_width": 3}}, "generate") == 1  # beams
    assert refusal({"prompt": "x", "n": 2}, "v1/completions", pd=False) is None
    assert "greater than or equal" in refusal({"prompt": "x", "n": 3, "best_of": 2}, "v1/completions", pd=False)
    assert refusal({"messages": [], "best_of": 3}, "v1/chat/completions", pd=True) is None  # no best_of in chat
    assert "batch of n copies" in refusal({"text": "x", "sampling_params": {"n": 2}}, "generate", pd=True)
