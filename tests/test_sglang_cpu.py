"""Real SGLang on CPU: a single server and a PD pair behind sglang-router give
exactly Hugging Face transformers' greedy tokens; bench_serving runs clean."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eldr_sglang.local_cluster import http_json

pytestmark = pytest.mark.sglang

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Aspirin is used to treat",
    "Москва — столица",
]
MAX_NEW = 12


@pytest.fixture(scope="module")
def hf_greedy(fixture_model):
    """Greedy continuations from transformers' own Qwen3-MoE implementation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixture_model)
    model = AutoModelForCausalLM.from_pretrained(fixture_model, dtype=torch.bfloat16)
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                             min_new_tokens=MAX_NEW)
        out[prompt] = gen[0, len(ids):].tolist()
    return out


def _generate(url: str, prompt: str) -> list[int]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                                "ignore_eos": True}}
    return http_json(url + "/generate", body, timeout=120)["output_ids"]


def test_single_server_matches_hf_generate(single_server, hf_greedy):
    for prompt in PROMPTS:
        assert _generate(single_server.url, prompt) == hf_greedy[prompt], prompt


def test_pd_pair_behind_sglang_router_matches_hf(sglang_router, hf_greedy):
    for prompt in PROMPTS:
        assert _generate(sglang_router.url, prompt) == hf_greedy[prompt], prompt


def test_bench_serving_random_ids_against_router(sglang_router, fixture_model, tmp_path):
    out = tmp_path / "bench.jsonl"
    cmd = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
        "--base-url", sglang_router.url, "--model", str(fixture_model),
        "--tokenizer", str(fixture_model), "--dataset-name", "random-ids",
        "--random-input-len", "64", "--random-output-len", "16", "--num-prompts", "12",
        "--request-rate", "inf", "--max-concurrency", "4", "--output-file", str(out),
        "--disable-tqdm",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == 12, result
    assert result.get("failed", 0) in (0, None), result
    assert result["median_tpot_ms"] > 0
