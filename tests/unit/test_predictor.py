"""Signature predictor: recovers a planted per-token table, backs off for unseen tokens,
round-trips through the artifact (format 2), and version-1 artifacts still load."""

import hashlib
import json

import numpy as np
import pytest

from eldr_sglang.core import CalibrationArtifact, ModelSpec, load_artifact
from eldr_sglang.core.predictor import SignaturePredictor, table_bytes

MODEL = ModelSpec("tiny-moe", num_layers=4, num_experts=8, top_k=2)
V, L, E, K = 120, 2, 8, 2


def planted(seed=0, n=1500, unseen=10):
    """A per-token table (each token picks top-2 experts per layer) and prompts built from
    it; the last ``unseen`` token ids never occur."""
    rng = np.random.default_rng(seed)
    table = np.zeros((V, L, E))
    for t in range(V):
        for layer in range(L):
            table[t, layer, rng.choice(E, K, replace=False)] = 1.0
    prompts = [rng.integers(0, V - unseen, rng.integers(10, 50)) for _ in range(n)]
    counts = np.stack([table[p].sum(axis=0) for p in prompts])
    return table, prompts, counts


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("float16", 5e-3), ("int8", 2e-2)])
def test_ridge_recovers_planted_table(dtype, tol):
    table, prompts, counts = planted()
    p = SignaturePredictor("ridge", alpha=1e-4, dtype=dtype).fit(prompts, counts)
    assert p.tokens_.tolist() == list(range(V - 10))
    for t in (0, 7, 55, V - 11):
        np.testing.assert_allclose(p.predict([t]), table[t], atol=tol)
    probe = np.array([3, 3, 9, 40, 41])
    np.testing.assert_allclose(p.predict(probe), table[probe].sum(axis=0), atol=5 * tol)


def test_mean_method_correlates_with_planted_table():
    table, prompts, counts = planted(seed=1)
    p = SignaturePredictor("mean", alpha=1.0, dtype="float32").fit(prompts, counts)
    seen = p.tokens_
    pred = np.stack([p.predict([t]) for t in seen]).reshape(len(seen), -1)
    dev = pred - pred.mean(axis=0)
    true = table[seen].reshape(len(seen), -1)
    assert np.corrcoef(dev.ravel(), (true - true.mean(axis=0)).ravel())[0, 1] > 0.8


def test_unseen_tokens_back_off_to_global_mean():
    _, prompts, counts = planted()
    p = SignaturePredictor(alpha=1e-4, dtype="float32").fit(prompts, counts)
    mean = counts.reshape(len(counts), -1).sum(axis=0) / sum(len(x) for x in prompts)
    np.testing.assert_allclose(p.predict([V - 1, V - 2, 10_000]).ravel(), 3 * mean, rtol=1e-5)
    assert p.coverage([V - 1, 0]) == 0.5 and p.coverage([10_000]) == 0.0
    assert (p.predict([5]) >= 0).all()


def test_fit_refuses_bad_input():
    _, prompts, counts = planted(n=20)
    with pytest.raises(ValueError, match=r"counts must be \[N, n_sel, E\]"):
        SignaturePredictor().fit(prompts, counts[:5])
    with pytest.raises(ValueError, match="at least one token"):
        SignaturePredictor().fit([[]] + prompts[1:], counts)
    with pytest.raises(ValueError, match="unknown method"):
        SignaturePredictor("lasso").fit(prompts, counts)
    with pytest.raises(RuntimeError, match="not fitted"):
        SignaturePredictor().predict([1])


def test_memory_is_bounded_by_seen_tokens():
    _, prompts, counts = planted()
    p = SignaturePredictor(dtype="int8").fit(prompts, counts)
    assert p.nbytes == table_bytes(len(p.tokens_), L, E, "int8")
    assert table_bytes(150_000, 2, 128, "int8") < 40 * 2**20  # 150k vocabulary x 2 layers x 128 experts


def _artifact(predictor=None, **kw):
    rng = np.random.default_rng(0)
    c = rng.normal(size=(3, L * E)).astype(np.float32)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    return CalibrationArtifact(model=MODEL, variant="idf", layers=[2, 0], idf=np.ones((L, E), np.float32),
                               centroids=c, predictor=predictor, **kw)


def test_artifact_round_trip_with_and_without_predictor(tmp_path):
    _, prompts, counts = planted()
    p = SignaturePredictor().fit(prompts, counts)
    back = load_artifact(_artifact(p).save(tmp_path / "with.json"))
    assert back.format_version == 2 and back.predictor is not None
    np.testing.assert_array_equal(back.predicted_counts(prompts[0]), p.predict(prompts[0]))
    plain = load_artifact(_artifact().save(tmp_path / "without.json"))
    assert plain.predictor is None
    with pytest.raises(ValueError, match="no signature predictor"):
        plain.predicted_counts([1, 2])


def test_predictor_is_checksummed_and_validated(tmp_path):
    _, prompts, counts = planted()
    path = _artifact(SignaturePredictor().fit(prompts, counts)).save(tmp_path / "a.json")
    doc = json.loads(path.read_text())
    doc["predictor"]["alpha"] = 7.0
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_artifact(path)
    doc["predictor"]["shape"] = [3, 8]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="predictor"):
        load_artifact(path)


def test_version_1_artifact_still_loads(tmp_path):
    art = _artifact(format_version=1)
    doc = art.to_dict()
    assert doc["format_version"] == 1 and "predictor" not in doc
    # the version-1 checksum, computed as version-1 code did
    head = json.dumps({"format_version": 1, "model": MODEL.to_dict(), "variant": "idf", "layers": [2, 0],
                       "tau": 0.1}, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(head)
    digest.update(art.idf.astype("<f4").tobytes())
    digest.update(art.centroids.astype("<f4").tobytes())
    assert doc["checksum"] == "sha256:" + digest.hexdigest()
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(doc))
    back = load_artifact(path)
    assert back.format_version == 1 and back.predictor is None
    np.testing.assert_array_equal(back.centroids, art.centroids)
    with pytest.raises(ValueError, match="needs format_version >= 2"):
        _artifact(SignaturePredictor().fit(*planted(n=30)[1:]), format_version=1)


def _calib_inputs(tmp_path, n=300):
    from eldr_sglang.core import TraceSet, write_traces

    rng = np.random.default_rng(5)
    table = np.zeros((V, 4, E))
    for t in range(V):
        for layer in range(4):
            table[t, layer, rng.choice(E, K, replace=False)] = 1.0
    prompts = [rng.integers(0, V, rng.integers(10, 40)) for _ in range(n)]
    counts = np.stack([table[p].sum(axis=0) for p in prompts]).astype(np.int32)
    ids = np.array([f"r{i}" for i in range(n)])
    traces = TraceSet(model=MODEL, request_ids=ids, prefill_counts=counts, decode_counts=counts,
                      prompt_tokens=np.array([len(p) for p in prompts]), output_tokens=np.full(n, 8),
                      labels={"domain": np.array(["a", "b"] * (n // 2))})
    write_traces(traces, tmp_path / "traces")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"id": f"r{i}", "input_ids": p.tolist()}) + "\n"
                             for i, p in enumerate(prompts)))
    return table, jsonl


def test_calibrate_fits_and_saves_the_predictor(tmp_path):
    from eldr_sglang import calibrate

    table, jsonl = _calib_inputs(tmp_path)
    out = tmp_path / "artifact.json"
    rc = calibrate.main(["--traces", str(tmp_path / "traces"), "--clusters", "3", "--out", str(out),
                         "--layers", "2,0", "--pairs", "500", "--n-init", "1", "--predictor-prompts", str(jsonl),
                         "--predictor-alpha", "0.001"])
    assert rc == 0
    art = load_artifact(out)
    assert art.predictor is not None and art.extra["predictor"]["requests"] == 300
    probe = [4, 4, 17, 60]
    np.testing.assert_allclose(art.predicted_counts(probe), table[probe][:, [2, 0]].sum(axis=0), atol=0.3)


def test_calibrate_refuses_prompts_that_join_no_trace(tmp_path, capsys):
    from eldr_sglang import calibrate

    _, jsonl = _calib_inputs(tmp_path)
    jsonl.write_text(json.dumps({"id": "elsewhere", "input_ids": [1, 2]}) + "\n")
    with pytest.raises(SystemExit) as exc:
        calibrate.main(["--traces", str(tmp_path / "traces"), "--clusters", "3", "--out", str(tmp_path / "a.json"),
                        "--layers", "0", "--pairs", "500", "--n-init", "1", "--predictor-prompts", str(jsonl)])
    assert exc.value.code == 2 and "joined by request id" in capsys.readouterr().err
