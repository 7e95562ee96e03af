"""Cost model (simulated): fitted anchor points and the expert-parallel max rule."""

import numpy as np
import pytest

from eldr_sglang.sim.cost_model import (PAPER_EXPERT_RATIO, PARAM_SETS, contiguous_placement, get_params,
                                        moe_layer_time, per_gpu_unique, step_time)

MI300X = "qwen3-30b-a3b-mi300x"


def test_16_to_128_experts_is_4_7x_on_the_moe_layer():
    p = get_params(MI300X)
    ratio = moe_layer_time(p, 128, batch_size=32) / moe_layer_time(p, 16, batch_size=32)
    assert ratio == pytest.approx(PAPER_EXPERT_RATIO, rel=1e-6)
    assert PAPER_EXPERT_RATIO == 4.7


def test_batch_32_to_128_at_fixed_experts_barely_changes_the_moe_layer():
    p = get_params(MI300X)
    for experts in (16, 64, 128):
        change = moe_layer_time(p, experts, batch_size=128) / moe_layer_time(p, experts, batch_size=32) - 1
        assert 0 <= change < 0.10
    assert moe_layer_time(p, 128, 128) / moe_layer_time(p, 128, 32) - 1 < 0.05


def test_h200_follows_its_bandwidth():
    h200, mi = get_params("qwen3-30b-a3b-h200"), get_params(MI300X)
    assert h200.mem_bandwidth == pytest.approx(4.8e12 * 0.75)
    assert h200.expert_read_s / mi.expert_read_s == pytest.approx(5.3 / 4.8)
    assert h200.bytes_per_expert == mi.bytes_per_expert == 3 * 2048 * 768 * 2


def test_expert_parallel_layer_waits_for_the_most_loaded_gpu():
    p = get_params("qwen3-235b-a22b-mi300x-tp4ep4")
    assert (p.tp_size, p.ep_size) == (4, 4)
    skewed = moe_layer_time(p, np.array([30, 2, 2, 2]))
    balanced = moe_layer_time(p, np.array([9, 9, 9, 9]))
    assert skewed == pytest.approx(moe_layer_time(p, np.array([30, 30, 30, 30])))
    assert skewed > balanced
    L = p.num_moe_layers
    one = step_time(p, 32, 10_000, np.tile([30, 2, 2, 2], (L, 1)))
    assert one > step_time(p, 32, 10_000, np.tile([9, 9, 9, 9], (L, 1)))
    with pytest.raises(ValueError, match="per-GPU"):
        moe_layer_time(p, 36)


def test_per_gpu_unique_counts_by_placement():
    place = contiguous_placement(8, 4)
    assert place.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    use = np.array([[1, 1, 0, 0, 0, 0, 0, 1.0]])
    assert per_gpu_unique(use, place, 4).tolist() == [[2, 0, 0, 1]]


def test_step_time_adds_its_terms_and_grows_with_experts_and_context():
    p = get_params(MI300X)
    u = np.full(p.num_moe_layers, 40.0)
    t = step_time(p, 32, 20_000, u)
    expected = (p.fixed_s + 32 * p.attn_s_per_token + 20_000 * p.attn_s_per_ctx_token + p.dense_s
                + p.num_moe_layers * moe_layer_time(p, 40, 32))
    assert t == pytest.approx(expected)
    assert step_time(p, 32, 20_000, u + 10) > t
    assert step_time(p, 32, 40_000, u) > t
    # fewer given layers stand for all layers (mean layer time x num_moe_layers)
    assert step_time(p, 32, 20_000, np.full(4, 40.0)) == pytest.approx(t)
    assert step_time(p, 0, 0, u) == 0.0


def test_unknown_parameter_set_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_params("nope")
    for name in PARAM_SETS:
        assert name in str(err.value)


def test_microbenchmark_layer_computes_the_moe_output():
    """The measured layer (gathered experts, batched SwiGLU, combine) equals a plain
    per-token loop over each token's top-k experts, and hits exactly ``unique`` experts."""
    import torch

    from benchmark import microbench_moe_layer as mb
    gen = torch.Generator().manual_seed(0)
    experts, top_k, hidden, ffn, batch = 12, 3, 16, 8, 5
    w13 = torch.randn(experts, 2 * ffn, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, ffn, generator=gen)
    x = torch.randn(batch, hidden, generator=gen)
    ids, weights = mb.routing(batch, 6, top_k, experts, gen)
    assert ids.unique().numel() == 6
    got = mb.moe_layer(x, ids, weights, w13, w2, torch.empty_like(w13), torch.empty_like(w2))
    want = torch.zeros_like(x)
    for t in range(batch):
        for j in range(top_k):
            e = int(ids[t, j])
            g, u = (w13[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(g) * u))
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_fit_to_microbench_recovers_the_layer_terms_and_the_ratio():
    from eldr_sglang.sim.cost_model import fit_to_microbench, get_params, layer_ratio

    base = get_params("qwen3-30b-a3b-h200")
    fixed, per_token, per_expert = 150e-6, 0.4e-6, 5e-6
    rows = [{"batch": b, "unique": u, "median_ms": 1e3 * (fixed + per_token * b + per_expert * u)}
            for b in (32, 128, 256) for u in (8, 16, 32, 64, 128)]
    fit = fit_to_microbench(base, rows, base.bytes_per_expert, "fit")
    assert fit.moe_layer_fixed_s == pytest.approx(fixed, rel=1e-6)
    assert fit.moe_s_per_token == pytest.approx(per_token, rel=1e-6)
    assert fit.expert_read_s == pytest.approx(per_expert, rel=1e-6)
    assert fit.dense_s == base.dense_s  # only the MoE-layer terms change
    want = (fixed + 32 * per_token + 128 * per_expert) / (fixed + 32 * per_token + 16 * per_expert)
    assert layer_ratio(fit) == pytest.approx(want)
    assert layer_ratio(get_params("qwen3-30b-a3b-mi300x")) == pytest.approx(4.7)
    with pytest.raises(ValueError, match="not physical"):
        fit_to_microbench(base, [{**r, "median_ms": 1.0 - 0.001 * r["unique"]} for r in rows], 1.0, "bad")
