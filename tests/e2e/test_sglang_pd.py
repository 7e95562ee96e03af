"""A real 1 prefill + N decode SGLang CPU cluster behind sglang-router: same
greedy tokens as transformers, and bench_serving completes without failures."""

import pytest

from tests.helpers import greedy_generate, run_bench_serving

pytestmark = pytest.mark.sglang


def test_pd_pair_behind_sglang_router_matches_hf(sglang_router, hf_greedy):
    for prompt, expected in hf_greedy.items():
        assert greedy_generate(sglang_router.url, prompt) == expected, prompt


def test_bench_serving_random_ids_against_sglang_router(sglang_router, fixture_model, tmp_path):
    result = run_bench_serving(sglang_router.url, fixture_model, tmp_path / "bench.jsonl", 12)
    assert result["completed"] == 12, result
    assert result.get("failed", 0) in (0, None), result
    assert result["median_tpot_ms"] > 0
