"""Persisted formats: calibration artifact (round trip, refusals) and trace shards."""

import json

import numpy as np
import pytest

from eldr_sglang.core import (
    CalibrationArtifact,
    ModelSpec,
    SignatureBuilder,
    TraceRecord,
    TraceWriter,
    creation_info,
    iter_traces,
    load_artifact,
    load_traces,
    make_synthetic_traces,
    write_traces,
)

MODEL = ModelSpec("tiny-moe", num_layers=4, num_experts=8, top_k=2)


def make_artifact() -> CalibrationArtifact:
    rng = np.random.default_rng(0)
    centroids = rng.normal(size=(3, 2 * 8)).astype(np.float32)
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return CalibrationArtifact(
        model=MODEL, variant="idf", layers=[2, 0], idf=1 + rng.random((2, 8)).astype(np.float32),
        centroids=centroids, created=creation_info(100),
    )


def test_round_trip(tmp_path):
    art = make_artifact()
    path = art.save(tmp_path / "a.json")
    back = load_artifact(path, expect_model=MODEL)
    assert back.layers == [2, 0] and back.tau == 0.1 and back.num_clusters == 3 and back.model == MODEL
    np.testing.assert_array_equal(back.idf, art.idf)
    np.testing.assert_array_equal(back.centroids, art.centroids)
    counts = np.array([[1, 0, 0, 2, 0, 0, 0, 0], [0, 0, 3, 0, 0, 0, 0, 1]])
    sig = back.signature(counts)
    assert sig.shape == (16,) and sig.dtype == np.float32
    assert np.linalg.norm(sig) == pytest.approx(1.0, rel=1e-6)
    assert back.signature(np.stack([counts, counts * 0])).shape == (2, 16)
    assert back.similarities(sig).shape == (3,)
    assert back.created["n_requests"] == 100


def test_signature_matches_builder():
    traces = make_synthetic_traces(50, 4, 8, 2, seed=3).traces
    builder = SignatureBuilder("idf", layers=[3, 1]).fit(traces)
    art = CalibrationArtifact(model=traces.model, variant="idf", layers=[3, 1], idf=builder.selected_idf(),
                              centroids=np.eye(2, 16, dtype=np.float32))
    np.testing.assert_allclose(art.signature(traces.prefill_counts[:, [3, 1]]), builder.transform(traces), rtol=1e-6)


def _tamper(path, edit):
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(tau=0.2), "checksum mismatch"),
        (lambda d: d["idf"].update(data=d["centroids"]["data"]), "field 'idf' holds"),
        (lambda d: d.pop("centroids"), r"missing field\(s\) \['centroids'\]"),
        (lambda d: d.update(layers=[2, 9]), r"layers \[9\] out of range"),
        (lambda d: d["centroids"].update(shape=[16, 3]), r"centroids shape \[16, 3\] != \[K, 16\]"),
        (lambda d: d.update(format_version=99), "format_version 99 unsupported"),
        (lambda d: d["model"].pop("top_k"), "missing model field"),
    ],
)
def test_refuses_corrupt(tmp_path, edit, message):
    path = make_artifact().save(tmp_path / "a.json")
    _tamper(path, edit)
    with pytest.raises(ValueError, match=message):
        load_artifact(path)


def test_refuses_flipped_byte_and_garbage(tmp_path):
    path = make_artifact().save(tmp_path / "a.json")
    doc = json.loads(path.read_text())
    data = bytearray(doc["centroids"]["data"], "ascii")
    data[10] = ord("A") if data[10] != ord("A") else ord("B")
    doc["centroids"]["data"] = data.decode()
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_artifact(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read artifact JSON"):
        load_artifact(path)


def test_refuses_mismatched_model(tmp_path):
    path = make_artifact().save(tmp_path / "a.json")
    with pytest.raises(ValueError, match="num_experts is 8, expected 128; top_k is 2, expected 8"):
        load_artifact(path, expect_model={"num_layers": 4, "num_experts": 128, "top_k": 8})
    with pytest.raises(ValueError, match="name is 'tiny-moe', expected 'other'"):
        load_artifact(path, expect_model=ModelSpec("other", 4, 8, 2))
    with pytest.raises(ValueError, match="layers"):
        load_artifact(path, expect_layers=[0, 2])
    with pytest.raises(ValueError, match="3 clusters, expected 4"):
        load_artifact(path, expect_clusters=4)
    with pytest.raises(ValueError, match="idf shape"):
        CalibrationArtifact(model=MODEL, variant="idf", layers=[0], idf=np.ones((2, 8)), centroids=np.ones((1, 8)))


def test_trace_shards_round_trip(tmp_path):
    syn = make_synthetic_traces(25, 4, 8, 2, seed=1).traces
    paths = write_traces(syn, tmp_path / "tr", shard_size=10)
    assert [p.name for p in paths] == ["shard-00000.npz", "shard-00001.npz", "shard-00002.npz"]
    assert json.loads((tmp_path / "tr" / "meta.json").read_text())["num_experts"] == 8
    assert [len(part) for part in iter_traces(tmp_path / "tr")] == [10, 10, 5]
    back = load_traces(tmp_path / "tr")
    np.testing.assert_array_equal(back.prefill_counts, syn.prefill_counts)
    np.testing.assert_array_equal(back.decode_counts, syn.decode_counts)
    np.testing.assert_array_equal(back.labels["task"], syn.labels["task"])
    np.testing.assert_array_equal(back.gate_logit_sums, syn.gate_logit_sums)
    assert back.model == syn.model and back.prefill_counts.dtype == np.int32


def test_trace_writer_records_and_bad_shards(tmp_path):
    zeros = np.zeros((4, 8), dtype=np.int32)
    with TraceWriter(tmp_path / "w", MODEL, shard_size=2) as writer:
        for i in range(3):
            writer.add(TraceRecord(f"r{i}", zeros + i, zeros, 5, 7, labels={"task": "code"}))
        with pytest.raises(ValueError, match="field 'decode_counts' has shape"):
            writer.add(TraceRecord("bad", zeros, np.zeros((3, 8)), 1, 1))
    back = load_traces(tmp_path / "w")
    assert list(back.request_ids) == ["r0", "r1", "r2"] and back.prefill_counts[2].max() == 2
    shard = tmp_path / "w" / "shard-00001.npz"
    cols = dict(np.load(shard))
    cols["decode_counts"] = np.zeros((1, 4, 9), dtype=np.int32)
    np.savez(shard, **cols)
    with pytest.raises(ValueError, match=r"shard-00001.npz: field 'decode_counts' has shape \(1, 4, 9\)"):
        load_traces(tmp_path / "w")
    cols.pop("decode_counts")
    np.savez(shard, **cols)
    with pytest.raises(ValueError, match=r"shard-00001.npz: missing field 'decode_counts'"):
        load_traces(tmp_path / "w")
    cols["decode_counts"] = np.zeros((1, 4, 8), dtype=np.float32)
    np.savez(shard, **cols)
    with pytest.raises(ValueError, match="field 'decode_counts' has dtype float32"):
        load_traces(tmp_path / "w")
    shard.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable npz shard"):
        load_traces(tmp_path / "w")
    with pytest.raises(ValueError, match="no such trace file"):
        load_traces(tmp_path / "missing")
