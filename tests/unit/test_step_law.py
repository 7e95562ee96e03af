"""The step-time law fitted from engine step samples: it recovers a planted law under
noise and outliers, keeps every term non-negative, says how well it fits, and trusts
its per-expert term only as far as the fit supports it."""

import numpy as np
import pytest

from eldr_sglang.core.step_law import MIN_SAMPLES, StepLaw, fit_step_law

LAW = dict(base_s=0.0154, per_seq_s=0.00246, per_expert_s=0.000732, per_kv_token_s=0.0)


def samples(n=300, noise=0.03, outliers=0.05, seed=0, law=LAW):
    rng = np.random.default_rng(seed)
    b = rng.integers(1, 17, n)
    u = np.minimum(b * rng.uniform(8, 20, n), 400)  # distinct experts grow with the batch, sub-linearly
    kv = b * rng.uniform(200, 800, n)
    t = law["base_s"] + law["per_seq_s"] * b + law["per_expert_s"] * u + law["per_kv_token_s"] * kv
    t = t * (1 + noise * rng.standard_normal(n))
    bad = rng.random(n) < outliers
    t[bad] *= rng.uniform(3, 10, bad.sum())  # a compile, a swap: steps slowed by something else
    return [{"batch_size": int(x), "unique_experts": float(y), "kv_tokens": float(z), "seconds": float(s)}
            for x, y, z, s in zip(b, u, kv, t)]


def test_recovers_a_planted_law_despite_outliers():
    law = fit_step_law(samples())
    assert law.per_expert_s == pytest.approx(LAW["per_expert_s"], rel=0.2)
    assert law.per_seq_s == pytest.approx(LAW["per_seq_s"], rel=0.3)
    assert law.base_s == pytest.approx(LAW["base_s"], rel=0.3)
    assert law.r2 > 0.8 and law.samples == 300
    assert min(law.base_s, law.per_seq_s, law.per_expert_s, law.per_kv_token_s) >= 0.0


def test_terms_stay_non_negative_when_the_data_pull_one_below_zero():
    law = fit_step_law(samples(law=dict(LAW, per_seq_s=0.0, per_expert_s=0.001)))
    assert law.per_seq_s >= 0.0 and law.per_expert_s == pytest.approx(0.001, rel=0.25)


def test_noise_alone_fits_badly_and_is_not_trusted():
    rng = np.random.default_rng(1)
    noise = [{"batch_size": int(rng.integers(1, 17)), "unique_experts": float(rng.uniform(10, 300)),
              "kv_tokens": 0.0, "seconds": float(rng.uniform(0.01, 0.1))} for _ in range(200)]
    law = fit_step_law(noise)
    assert law.r2 < 0.3
    assert law.trusted_per_expert() <= 0.6 * law.per_expert_s  # shrunk toward balance


def test_too_few_or_unusable_samples_give_no_law():
    assert fit_step_law(samples(n=MIN_SAMPLES - 1)) is None
    bad = [{"batch_size": 0, "unique_experts": 1, "kv_tokens": 0, "seconds": 0.1}] * 50  # idle steps
    bad += [{"batch_size": 2, "unique_experts": 1, "kv_tokens": 0, "seconds": float("nan")}] * 50
    assert fit_step_law(bad) is None


def test_trust_scales_with_r2():
    law = StepLaw(0.01, 0.001, 0.002, 0.0, r2=0.25, samples=100)
    assert law.trusted_per_expert() == pytest.approx(0.001)
    assert StepLaw(0.01, 0.001, 0.002, 0.0, r2=0.9, samples=100).trusted_per_expert() == 0.002
    assert StepLaw(0.01, 0.001, 0.002, 0.0, r2=-1.0, samples=100).trusted_per_expert() == 0.0


def test_pooled_laws_share_one_law_unless_a_server_really_differs():
    from eldr_sglang.core.step_law import pooled_laws

    same = [samples(n=200, seed=s) for s in range(3)]
    laws = pooled_laws(same)
    assert laws[0] is laws[1] is laws[2]  # noise alone: one law for all
    slow = dict(LAW, base_s=3 * LAW["base_s"], per_expert_s=2 * LAW["per_expert_s"])
    laws = pooled_laws(same[:2] + [samples(n=200, seed=9, law=slow)])
    assert laws[0] is laws[1] and laws[2] is not laws[0]
    assert laws[2].per_expert_s == pytest.approx(slow["per_expert_s"], rel=0.25)
    assert pooled_laws([samples(n=5), []]) == [None, None]
