"""The committed trained tiny MoE: transformers and a real SGLang CPU server (with
the plugin's trace mode on a plain, co-located server) give the same greedy
tokens, and the server's trace logs hold every request's prefill and decode
expert counts; through the co-located router the official client gets n > 1 and chat."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from eldr_sglang.core import ModelSpec
from eldr_sglang.testing import local_cluster as lc
from tests.helpers import LOG_DIR, ROOT, greedy_generate, serving, started, wait_until

pytestmark = pytest.mark.sglang

MODEL = ROOT / "models" / "eldr-tiny-moe"
PROMPTS = [
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "Patients with type 2 diabetes were randomly assigned to",
    "第一条 为了保护民事主体的合法权益，",
    "Решите уравнение: 3x + 7 = 22.",
    "La présente licence s'applique à",
]
NEW_TOKENS = 10
# Both sides run in float32: bf16 results differ by CPU (AMX and avx512_bf16 kernels
# round differently), float32 ones only in the last bits. A step whose two best
# logits are closer than this is a tie that two correct implementations may break
# differently; the comparison stops there.
TIE = 1e-3


@pytest.fixture(scope="module")
def trained_server(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("trained-trace")
    spec = lc.ServerSpec(str(MODEL), extra_args=["--eldr-trace-dir", str(trace_dir), "--eldr-layers", "all",
                                                 "--dtype", "float32"])
    with serving(spec, "trained") as proc:
        yield proc, trace_dir


@pytest.fixture(scope="module")
def hf_trained():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL), AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)


def test_checkpoint_shape_and_size():
    cfg = json.loads((MODEL / "config.json").read_text())
    spec = ModelSpec.from_hf_config(cfg, MODEL.name)
    assert (spec.num_experts, spec.top_k, cfg["norm_topk_prob"]) == (128, 8, True)
    size = sum(f.stat().st_size for f in MODEL.glob("*.safetensors"))
    assert size <= 50 * 2**20
    log = json.loads((MODEL / "training.json").read_text())
    assert log["steps"] > 0 and log["loss"][-1][2] < log["loss"][0][2]  # it learned


def test_sglang_matches_transformers_greedy(trained_server, hf_trained):
    """Identical greedy tokens in float32 on both sides, compared up to the first step
    whose two best logits are within ``TIE`` (a tie)."""
    import torch

    server, _ = trained_server
    tok, model = hf_trained
    compared = 0
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True)
        expected = out.sequences[0, len(ids):].tolist()
        margins = [float(v[0] - v[1]) for v in (s[0].float().topk(2).values for s in out.scores)]
        n = next((i for i, m in enumerate(margins) if m < TIE), len(margins))
        got = greedy_generate(server.url, prompt, NEW_TOKENS)
        assert got[:n] == expected[:n], (prompt, n)
        compared += n
    assert compared >= 6 * len(PROMPTS)  # in float32, ties within TIE are rare


def test_colocated_trace_mode_logs_prefill_and_decode(trained_server):
    server, trace_dir = trained_server
    rids = [f"trace-{i}" for i in range(len(PROMPTS))]
    lc.http_json(server.url + "/generate", {"text": PROMPTS, "rid": rids, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})

    def records(kind: str) -> dict:
        return {r["rid"]: r for f in Path(trace_dir).glob(f"{kind}-*.jsonl")
                for r in map(json.loads, (ln for ln in f.open() if ln.endswith("\n")))}

    wait_until(lambda: set(rids) <= set(records("prefill")) and set(rids) <= set(records("decode")), timeout=60,
               what="the trace lines (written by a background thread)", step=0.1)
    prefill, decode = records("prefill"), records("decode")
    for rid in rids:
        counts = np.array(prefill[rid]["counts"])
        assert counts.shape == (4, 128)
        assert (counts.sum(axis=1) == 8 * prefill[rid]["prompt_tokens"]).all()
        dec = np.array(decode[rid]["decode_counts"])
        assert decode[rid]["output_tokens"] == 6
        assert (dec.sum(axis=1) == 8 * 5).all() or (dec.sum(axis=1) == 8 * 6).all()


def test_next_turn_counts_the_cached_earlier_output_like_a_cold_run(trained_server, hf_trained):
    """A second turn whose prompt holds the first turn's output hits the cache for it;
    its signature must count those tokens' expert ids as computed when they were
    decoded, i.e. like a cold run of the same prompt (float32: at most a near-tie swap
    per layer), not whatever ids their KV slots held before."""
    server, _ = trained_server
    tokenizer, _ = hf_trained
    first = tokenizer(PROMPTS[1])["input_ids"]
    lc.flush_cache(server.url)
    out = lc.http_json(server.url + "/generate", {"input_ids": first, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})["output_ids"]
    second = first + out + tokenizer(" In summary,")["input_ids"]
    ask = {"input_ids": second, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                     "custom_params": {"eldr_signature": True}}}
    (warm,) = lc.http_json(server.url + "/generate", ask)["meta_info"]["eldr_signature"]
    assert warm["cached_tokens"] > len(first), "the earlier output should come from the cache"
    lc.flush_cache(server.url)
    (cold,) = lc.http_json(server.url + "/generate", ask)["meta_info"]["eldr_signature"]
    assert cold["cached_tokens"] == 0
    diff = np.abs(np.array(warm["counts"]) - np.array(cold["counts"])).sum(axis=1)
    assert (diff <= 2).all(), diff


def test_colocated_router_serves_parallel_sampling_and_chat(trained_server):
    """Through the co-located router (plain servers, no PD) the official client gets
    ``n > 1`` served (SGLang's own parallel sampling), chat through the shipped model's
    chat template, and ``best_of > n`` refused (SGLang would ignore it)."""
    openai = pytest.importorskip("openai")
    server, _ = trained_server
    port = lc.free_port()
    router = lc.ManagedProcess("eldr-colocated", [
        sys.executable, "-m", "eldr_sglang.router", "--mode", "colocated", "--host", "127.0.0.1",
        "--port", str(port), "--policy", "jsq", "--tokenizer", str(MODEL), "--worker", server.url],
        LOG_DIR / "eldr-colocated.log", f"http://127.0.0.1:{port}").start()
    started.append(router)
    try:
        router.wait_ready(timeout=60)
        with openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id
            out = client.completions.create(model=model, prompt=PROMPTS[1], n=2, max_tokens=4, temperature=0.8)
            assert sorted(c.index for c in out.choices) == [0, 1]
            assert all(c.finish_reason == "length" and c.text for c in out.choices)
            assert out.usage.completion_tokens == 8
            chat = client.chat.completions.create(model=model, n=2, max_tokens=4, messages=[
                {"role": "user", "content": PROMPTS[3]}])
            assert sorted(c.index for c in chat.choices) == [0, 1]
            assert all(c.message.role == "assistant" and c.message.content for c in chat.choices)
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model=model, prompt=PROMPTS[1], n=2, best_of=3, max_tokens=4)
            assert "best_of" in err.value.body["message"]
        with urllib.request.urlopen(router.url + "/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        router.stop()
