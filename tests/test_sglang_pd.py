"""A real 1 prefill + 1 decode SGLang CPU pair behind sglang-router: same
greedy tokens as transformers, and bench_serving completes without failures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import greedy_generate

pytestmark = pytest.mark.sglang


def test_pd_pair_behind_sglang_router_matches_hf(sglang_router, hf_greedy):
    for prompt, expected in hf_greedy.items():
        assert greedy_generate(sglang_router.url, prompt) == expected, prompt


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
