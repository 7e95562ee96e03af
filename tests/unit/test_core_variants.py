"""Signature variants scored on held-out requests; calibrate's --variant auto."""

import json

import numpy as np
import pytest

from eldr_sglang.core import load_artifact, make_synthetic_traces, write_traces
from eldr_sglang.core.layer_selection import pair_cosine, pair_weighted_jaccard, spearman
from eldr_sglang.core.signature import VARIANTS, SignatureBuilder
from eldr_sglang.core.variants import (best_count_variant, best_gate_over, holdout_pairs, score_variants,
                                       variant_rho_table)

LAYERS = [0, 2]
N, PAIRS, SEED = 400, 4000, 3


@pytest.fixture(scope="module")
def syn():
    return make_synthetic_traces(N, num_layers=4, num_experts=16, top_k=4, informative_layers=LAYERS, seed=5)


@pytest.fixture(scope="module")
def trace_dir(syn, tmp_path_factory):
    out = tmp_path_factory.mktemp("variant-traces")
    write_traces(syn.traces, out)
    return out


def reference_idf_rho(traces, fit_rows, i, j) -> float:
    """Held-out rho of "idf" computed the long way, IDF fitted on ``fit_rows``."""
    builder = SignatureBuilder("idf", LAYERS).fit(traces.prefill_counts[fit_rows])
    signatures = builder.transform(traces.prefill_counts)
    return spearman(pair_cosine(signatures, i, j), pair_weighted_jaccard(traces.decode_counts, i, j, profile=True))


def test_pairs_are_drawn_among_held_out_requests_only():
    fit, i, j = holdout_pairs(N, PAIRS, 0.25, SEED)
    assert len(fit) == N - 100
    assert not set(fit) & (set(i) | set(j))
    assert np.all(i != j)
    again = holdout_pairs(N, PAIRS, 0.25, SEED)
    assert all(np.array_equal(a, b) for a, b in zip((fit, i, j), again))


def test_idf_is_fitted_without_the_held_out_requests(syn):
    """Held-out requests alone use a marker expert: an IDF that saw them weighs it
    ~2.4, one fitted on the other requests ~7.6; the score must match the latter."""
    traces = syn.traces.subset(slice(None))
    traces.prefill_counts = traces.prefill_counts.copy()
    fit, i, j = holdout_pairs(N, PAIRS, 0.25, SEED)
    held = np.setdiff1d(np.arange(N), fit)
    traces.prefill_counts[:, LAYERS[0], 0] = 0
    traces.prefill_counts[held, LAYERS[0], 0] = np.random.default_rng(0).integers(0, 120, len(held))

    honest, leaky = reference_idf_rho(traces, fit, i, j), reference_idf_rho(traces, np.arange(N), i, j)
    assert abs(honest - leaky) > 0.02  # the two fits are told apart
    assert score_variants(traces, LAYERS, PAIRS, SEED)["idf"] == pytest.approx(honest, abs=1e-4)


def test_all_variants_share_pairs_and_gates_are_none_without_gate_sums(syn):
    scores = score_variants(syn.traces, LAYERS, PAIRS, SEED)
    assert set(scores) == set(VARIANTS) and all(isinstance(v, float) for v in scores.values())
    no_gates = make_synthetic_traces(200, num_layers=4, num_experts=16, informative_layers=LAYERS,
                                     include_gates=False, seed=1).traces
    scores = score_variants(no_gates, LAYERS, 1000, SEED)
    assert scores["gate_prob"] is None and scores["gate_logit"] is None and scores["raw"] is not None
    fit, i, j = holdout_pairs(len(no_gates), 1000, 0.25, SEED)
    expected = spearman(pair_cosine(SignatureBuilder("binary", LAYERS).fit(no_gates).transform(no_gates), i, j),
                        pair_weighted_jaccard(no_gates.decode_counts, i, j, profile=True))
    assert scores["binary"] == pytest.approx(expected, abs=1e-4)


def test_holdout_zero_is_the_in_sample_table(syn):
    from eldr_sglang.analyze import variant_table

    table = variant_rho_table(syn.traces, None, PAIRS, SEED, holdout=0.0)
    assert table == variant_table(syn.traces, None, PAIRS, SEED)
    assert set(table["idf"]) == {"counts", "profile"}
    with pytest.raises(ValueError, match="holdout must be in"):
        score_variants(syn.traces, LAYERS, PAIRS, SEED, holdout=1.0)


def test_best_count_variant_ignores_gates():
    scores = {"raw": 0.5, "idf": 0.6, "sqrt": 0.7, "binary": None, "gate_prob": 0.95, "gate_logit": 0.9}
    assert best_count_variant(scores) == "sqrt"
    assert best_gate_over(scores, "sqrt") == "gate_prob"
    assert best_gate_over({**scores, "gate_prob": None, "gate_logit": 0.1}, "sqrt") is None


def run_calibrate(trace_dir, out, *extra: str) -> int:
    from eldr_sglang.calibrate import main

    return main(["--traces", str(trace_dir), "--clusters", "3", "--out", str(out), "--n-init", "1",
                 "--pairs", "4000", *extra])


def test_auto_builds_the_artifact_with_the_best_count_variant(trace_dir, tmp_path, capsys):
    assert run_calibrate(trace_dir, tmp_path / "a.json") == 0
    art = load_artifact(tmp_path / "a.json")
    scores = art.extra["variant_scores"]
    assert set(scores) == set(VARIANTS) and art.extra["variant_choice"] == "auto"
    assert art.variant == best_count_variant(scores)
    assert sorted(art.layers) == LAYERS
    out = capsys.readouterr().out
    assert "held-out requests" in out and f"{art.variant:<11s}" in out and "<- used (best count variant)" in out


def test_auto_never_deploys_a_gate_variant(trace_dir, tmp_path, capsys, monkeypatch):
    from eldr_sglang import calibrate

    fake = {"raw": 0.61, "idf": 0.62, "sqrt": 0.64, "binary": 0.3, "gate_prob": 0.7, "gate_logit": 0.8}
    monkeypatch.setattr(calibrate, "score_variants", lambda *a, **k: dict(fake))
    assert run_calibrate(trace_dir, tmp_path / "a.json") == 0
    art = load_artifact(tmp_path / "a.json")
    assert art.variant == "sqrt" and art.extra["variant_scores"] == fake
    assert "gate_logit 0.800 > sqrt 0.640, but the router receives counts only" in capsys.readouterr().out


def test_given_variant_is_kept_and_the_table_still_printed(trace_dir, tmp_path, capsys):
    assert run_calibrate(trace_dir, tmp_path / "a.json", "--variant", "binary", "--layers", "0,2") == 0
    art = load_artifact(tmp_path / "a.json")
    assert art.variant == "binary" and art.extra["variant_choice"] == "given"
    scores = art.extra["variant_scores"]
    best = best_count_variant(scores)
    assert best != "binary"  # binary scores worst here: kept anyway
    out = capsys.readouterr().out
    assert "<- used (--variant)" in out and f"{best} {scores[best]:.3f} > binary" in out
    assert json.loads((tmp_path / "a.json").read_text())["variant"] == "binary"


@pytest.mark.parametrize("value, message", [
    ("gate_logit", "argument --variant: invalid choice 'gate_logit' (the router receives counts only"),
    ("tfidf", "argument --variant: invalid choice 'tfidf'; choose from auto, raw, idf, sqrt, binary"),
])
def test_bad_variant_is_an_argparse_error(trace_dir, tmp_path, capsys, value, message):
    with pytest.raises(SystemExit) as exit_info:
        run_calibrate(trace_dir, tmp_path / "a.json", "--variant", value)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "a.json").exists()
