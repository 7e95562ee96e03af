"""Trace shards never mix silently: writing into a directory that already holds shards is refused
unless the caller asks to append, and the refusal says how many records are already there."""

import numpy as np
import pytest

from eldr_sglang.core import TraceRecord, TraceWriter, load_traces, make_synthetic_traces, write_traces
from eldr_sglang.core.traces import ModelSpec, TraceDirNotEmpty

MODEL = ModelSpec("m", 4, 8, 2)


def _records(n: int, prefix: str = "r") -> list[TraceRecord]:
    zeros = np.zeros((4, 8), dtype=np.int32)
    return [TraceRecord(f"{prefix}{i}", zeros + i, zeros, 5, 7) for i in range(n)]


def test_write_traces_refuses_a_directory_with_shards(tmp_path):
    syn = make_synthetic_traces(12, 4, 8, 2, seed=1).traces
    write_traces(syn, tmp_path / "t", shard_size=5)
    with pytest.raises(TraceDirNotEmpty, match=r"already holds 3 trace shards \(12 records\).*append"):
        write_traces(syn, tmp_path / "t")
    assert len(load_traces(tmp_path / "t")) == 12  # nothing was added


def test_trace_writer_refuses_before_writing_anything(tmp_path):
    with TraceWriter(tmp_path / "w", MODEL, shard_size=2) as w:
        for r in _records(3):
            w.add(r)
    before = sorted(p.name for p in (tmp_path / "w").iterdir())
    with pytest.raises(TraceDirNotEmpty, match="3 records"):
        TraceWriter(tmp_path / "w", MODEL)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == before


def test_append_is_explicit_and_counts_what_was_there(tmp_path):
    with TraceWriter(tmp_path / "w", MODEL, shard_size=2) as w:
        for r in _records(3):
            w.add(r)
    assert w.existing_records == 0
    with TraceWriter(tmp_path / "w", MODEL, shard_size=2, append=True) as w2:
        assert w2.existing_records == 3 and w2.existing_shards == 2
        for r in _records(2, prefix="s"):
            w2.add(r)
    assert [p.name for p in w2.paths] == ["shard-00002.npz"]
    back = load_traces(tmp_path / "w")
    assert list(back.request_ids) == ["r0", "r1", "r2", "s0", "s1"]


def test_empty_or_meta_only_directory_is_accepted(tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "notes.txt").write_text("not a shard")
    write_traces(make_synthetic_traces(4, 4, 8, 2, seed=2).traces, tmp_path / "e")
    assert len(load_traces(tmp_path / "e")) == 4


def test_a_leftover_temporary_shard_is_not_counted_as_a_shard(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "shard-00000.tmp.npz").write_bytes(b"")  # a write cut short
    with TraceWriter(tmp_path / "x", MODEL) as w:
        w.add(_records(1)[0])
    assert [p.name for p in w.paths] == ["shard-00000.npz"]
    assert len(load_traces(tmp_path / "x")) == 1


def test_collect_traces_refuses_unless_append(tmp_path, capsys):
    import json

    from eldr_sglang.collect_traces import main

    logs = tmp_path / "logs"
    logs.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}))
    counts = np.zeros((4, 8), dtype=int).tolist()
    (logs / "prefill-1.jsonl").write_text("".join(
        json.dumps({"rid": f"r{i}", "prompt_tokens": 3, "layers": [0, 1, 2, 3], "counts": counts}) + "\n"
        for i in range(2)))
    (logs / "decode-1.jsonl").write_text("".join(
        json.dumps({"rid": f"r{i}", "output_tokens": 4, "decode_counts": counts}) + "\n" for i in range(2)))
    out = tmp_path / "traces"
    assert main(["--logs", str(logs), "--model", str(model), "--out", str(out)]) == 0
    with pytest.raises(SystemExit):
        main(["--logs", str(logs), "--model", str(model), "--out", str(out)])
    err = capsys.readouterr().err
    assert "already holds 1 trace shards (2 records)" in err and "--append" in err
    assert len(load_traces(out)) == 2
    assert main(["--logs", str(logs), "--model", str(model), "--out", str(out), "--append"]) == 0
    assert "appended to 2 records already in" in capsys.readouterr().out
    assert len(load_traces(out)) == 4
