"""The official ``openai`` client against the ELDR router (default policy, the shipped
k2 artifact) over 1 prefill + 2 decode real SGLang CPU servers with the shipped model
(``models/eldr-tiny-moe``, whose chat template makes ``/v1/chat/completions`` work):
models, completions, chat (plain, and streamed with ``include_usage``), ``n > 1``
(refused at once: SGLang 0.5.23 cannot run it under PD), a bad model name, a bad body
and a client that leaves mid-stream. Every answer is checked for shape (ids, usage,
finish reasons) and the router's ``/metrics`` answers 200 after each."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from eldr_sglang.testing import local_cluster as lc
from tests.helpers import LOG_DIR, ROOT, progress, started, wait_until

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.sglang

MODEL = ROOT / "models" / "eldr-tiny-moe"
ARTIFACT = MODEL / "calibration-k2.json"
PROMPT = "def binary_search(items, target):\n"
MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Patients with type 2 diabetes were"}]
TOKENS = 6


@pytest.fixture(scope="module")
def openai_router():
    """The ELDR router (its default policy) in front of 1P2D servers of the shipped model;
    module scope: stopped before the shared PD cluster starts (at most three servers)."""
    cluster = lc.start_pd_cluster(str(MODEL), LOG_DIR, n_prefill=1, n_decode=2, progress=progress,
                                  prefill_args=["--eldr-calibration", str(ARTIFACT), "--eldr-publish", "request"])
    started.extend(cluster.processes)
    try:
        router = lc.start_eldr_router_ready(cluster, LOG_DIR, policy="eldr_balanced", artifact=ARTIFACT,
                                            extra_args=["--signature-port", "0"])
        started.append(router)
        try:
            yield router
        finally:
            router.stop()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def client(openai_router):
    with openai.OpenAI(base_url=openai_router.url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def router_metrics(router) -> dict[str, dict[tuple, float]]:
    """The router's ``/metrics`` (asserted 200): sample name -> {sorted labels: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def metric(router, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for k, v in router_metrics(router).get(name, {}).items() if want <= set(k))


def check_usage(usage, completion_tokens: int = TOKENS) -> None:
    assert usage.prompt_tokens > 0 and usage.completion_tokens == completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_models_list(client, openai_router):
    models = client.models.list()
    assert models.data and all(m.object == "model" and m.id for m in models.data)
    assert any(m.id.endswith("eldr-tiny-moe") for m in models.data), [m.id for m in models.data]
    router_metrics(openai_router)


def test_completion(client, model, openai_router):
    before = metric(openai_router, "eldr_router_requests_total")
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    assert out.object == "text_completion" and out.id and out.model
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    check_usage(out.usage)
    assert metric(openai_router, "eldr_router_requests_total") == before + 1  # routed to one decode server
    assert metric(openai_router, "eldr_router_decisions_total", kind="signature") >= 1  # by its signature


def test_completion_of_a_prompt_list(client, model, openai_router):
    """A list of prompts (n = 1) passes through PD: one choice per prompt, usage summed."""
    out = client.completions.create(model=model, prompt=[PROMPT, "Solve 3x + 7 = 22."], max_tokens=TOKENS,
                                    temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in out.choices)
    check_usage(out.usage, 2 * TOKENS)
    router_metrics(openai_router)


def test_chat(client, model, openai_router):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=TOKENS, temperature=0)
    assert out.object == "chat.completion" and out.id
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and choice.message.content
    check_usage(out.usage)
    router_metrics(openai_router)


def test_chat_streamed_with_usage(client, model, openai_router):
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks and all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id
    *body, last = chunks
    assert last.choices == [] and last.usage is not None  # the usage chunk comes last
    check_usage(last.usage)
    assert all(c.usage is None for c in body)
    finishes = [ch.finish_reason for c in body for ch in c.choices if ch.finish_reason]
    assert finishes == ["length"]
    assert "".join(ch.delta.content or "" for c in body for ch in c.choices)
    router_metrics(openai_router)


@pytest.mark.parametrize("kind", ["completion", "chat", "best_of"])
def test_parallel_sampling_is_refused_at_once(client, model, openai_router, kind):
    """SGLang 0.5.23 gives the n samples one bootstrap room, which a PD pair binds once:
    it hung 60 s, then answered 500. Now a 400 before anything goes upstream."""
    before = metric(openai_router, "eldr_router_worker_requests_total")
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        if kind == "completion":
            client.completions.create(model=model, prompt=[PROMPT, PROMPT + "x"], n=2, max_tokens=TOKENS)
        elif kind == "chat":
            client.chat.completions.create(model=model, messages=MESSAGES, n=3, max_tokens=TOKENS)
        else:
            client.completions.create(model=model, prompt=PROMPT, best_of=2, max_tokens=TOKENS)
    assert time.monotonic() - t0 < 5
    assert err.value.status_code == 400
    body = err.value.body  # the client hands over the "error" object
    assert body["type"] == "invalid_request_error" and body["code"] == 400
    assert ("bootstrap room" in body["message"]) if kind != "best_of" else ("best_of" in body["message"])
    assert metric(openai_router, "eldr_router_worker_requests_total") == before  # nothing sent upstream


def test_bad_model_name(client, openai_router):
    """SGLang reads ``base:adapter`` as a LoRA adapter; these servers have none: a 400 from
    the prefill server, OpenAI-shaped, at once, and no decode is sent."""
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="no-such-model:adapter", prompt=PROMPT, max_tokens=TOKENS)
    assert time.monotonic() - t0 < 30
    assert err.value.status_code == 400 and err.value.body["message"]
    router_metrics(openai_router)


@pytest.mark.parametrize("kind", ["no_messages", "bad_field"])
def test_bad_body(client, model, openai_router, kind):
    with pytest.raises(openai.BadRequestError) as err:
        if kind == "no_messages":
            client.chat.completions.create(model=model, messages=[], max_tokens=TOKENS)
        else:
            client.completions.create(model=model, prompt=PROMPT, max_tokens="many")
    assert err.value.status_code == 400
    assert err.value.body["type"] and err.value.body["message"]
    router_metrics(openai_router)


def test_client_leaves_mid_stream(client, model, openai_router):
    """The router sees the disconnect, aborts the request on both servers and frees its
    slot; the next request is served."""
    before = metric(openai_router, "eldr_router_events_total", event="client_disconnects")
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=400, temperature=0,
                                       stream=True)
    first = next(iter(stream))
    assert first.object == "text_completion" and first.id
    stream.close()
    wait_until(lambda: metric(openai_router, "eldr_router_events_total", event="client_disconnects") > before
               and metric(openai_router, "eldr_router_client_requests_inflight") == 0,
               timeout=60, what="the router to count the disconnect and free the request", step=0.2)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    assert out.choices[0].finish_reason == "length"
    check_usage(out.usage)
    router_metrics(openai_router)


def test_readme_example_runs_as_written(openai_router, capsys):
    """The README's client example, with only the router's address replaced."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "from openai import OpenAI" in b]
    assert code.count('"http://localhost:8000/v1"') == 1
    exec(compile(code.replace("http://localhost:8000", openai_router.url), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "CompletionUsage(completion_tokens=16," in out, out
    router_metrics(openai_router)
