"""Signature builders: IDF and normalisation against hand-computed values."""

import math

import numpy as np
import pytest

from eldr_sglang.core import SignatureBuilder, l2_normalize, signature_from_counts, smoothed_idf
from eldr_sglang.core.traces import ModelSpec, TraceSet

# 3 requests, 2 layers, 2 experts
COUNTS = np.array(
    [
        [[2, 0], [1, 1]],
        [[1, 0], [0, 3]],
        [[0, 0], [4, 0]],
    ],
    dtype=np.int32,
)


def test_smoothed_idf_formula_by_hand():
    # df per (layer, expert): [[2, 0], [2, 2]], N = 3
    builder = SignatureBuilder("idf").fit(COUNTS)
    rare = math.log(4 / 3) + 1  # df = 2
    never = math.log(4 / 1) + 1  # df = 0: finite, no division by zero
    np.testing.assert_allclose(builder.idf_, [[rare, never], [rare, rare]], rtol=1e-6)
    assert builder.idf_.dtype == np.float32
    np.testing.assert_allclose(smoothed_idf(np.array([3]), 3), [1.0])  # df = N -> exactly 1


def test_idf_signature_by_hand():
    builder = SignatureBuilder("idf").fit(COUNTS)
    w = math.log(4 / 3) + 1
    first = np.array([2 * w, 0, 1 * w, 1 * w])
    expected = first / np.linalg.norm(first)
    out = builder.transform(COUNTS)
    assert out.shape == (3, 4) and out.dtype == np.float32
    np.testing.assert_allclose(out[0], expected, rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-6)


def test_layer_subset_and_variants():
    sig = SignatureBuilder("raw", layers=[1]).fit(COUNTS).transform(COUNTS)
    np.testing.assert_allclose(sig[1], [0.0, 1.0])
    np.testing.assert_allclose(sig[0], [1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-6)
    sq = SignatureBuilder("sqrt", layers=[1]).fit(COUNTS).transform(COUNTS)
    np.testing.assert_allclose(sq[1], [0.0, 1.0])
    binary = SignatureBuilder("binary").fit(COUNTS).transform(COUNTS)
    np.testing.assert_allclose(binary[0], np.array([1, 0, 1, 1]) / math.sqrt(3), rtol=1e-6)


def test_zero_vector_stays_zero_without_nan():
    zeros = np.zeros((2, 2, 2), dtype=np.int32)
    out = SignatureBuilder("idf").fit(COUNTS).transform(zeros)
    assert np.all(out == 0) and not np.isnan(out).any()
    assert np.all(l2_normalize(np.zeros((3, 5))) == 0)


def test_single_request_router_path_matches_builder():
    builder = SignatureBuilder("idf", layers=[1, 0]).fit(COUNTS)
    batch = builder.transform(COUNTS)
    one = signature_from_counts(COUNTS[2][[1, 0]], builder.selected_idf())
    np.testing.assert_allclose(one, batch[2], rtol=1e-6)
    many = signature_from_counts(COUNTS[:, [1, 0]], builder.selected_idf())
    np.testing.assert_allclose(many, batch, rtol=1e-6)
    with pytest.raises(ValueError, match="does not match"):
        signature_from_counts(COUNTS[0], np.ones((3, 2), np.float32))


def test_gate_variants_read_gate_fields_and_refuse_when_absent():
    traces = TraceSet(
        model=ModelSpec("m", 2, 2, 1),
        request_ids=np.array(["a", "b", "c"]),
        prefill_counts=COUNTS,
        decode_counts=COUNTS,
        prompt_tokens=np.array([1, 1, 1]),
        output_tokens=np.array([1, 1, 1]),
        gate_prob_sums=np.full((3, 2, 2), 0.25, np.float32),
    )
    out = SignatureBuilder("gate_prob").fit_transform(traces)
    np.testing.assert_allclose(out, 0.5, rtol=1e-6)
    with pytest.raises(ValueError, match="gate_logit_sums"):
        SignatureBuilder("gate_logit").fit(traces)
    with pytest.raises(ValueError, match="unknown variant"):
        SignatureBuilder("tfidf").fit(COUNTS)


def test_transform_10k_requests_is_fast():
    import time

    rng = np.random.default_rng(0)
    counts = rng.poisson(0.5, size=(10_000, 8, 64)).astype(np.int32)
    builder = SignatureBuilder("idf").fit(counts)
    start = time.perf_counter()
    out = builder.transform(counts)
    assert out.shape == (10_000, 512)
    assert time.perf_counter() - start < 1.0
