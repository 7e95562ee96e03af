"""bench_colocated_real's document split: the predictor is never fitted on a document the
request stream holds, and every request is on one side."""

import json
from pathlib import Path

from benchmark.bench_colocated_real import split_workload


def write_workload(tmp_path: Path, docs: list[str]) -> Path:
    path = tmp_path / "w.jsonl"
    rows = [{"id": f"r{i}", "prompt": f"p{i}", "doc": d} for i, d in enumerate(docs)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = [{"conversations": [{"role": "user", "content": r["prompt"]},
                                {"role": "assistant", "content": f"c{i}"}]} for i, r in enumerate(rows)]
    path.with_suffix(".bench.jsonl").write_text("".join(json.dumps(b) + "\n" for b in bench))
    return path


def test_split_keeps_documents_whole_and_loses_nothing(tmp_path):
    docs = [f"d{i % 7}" for i in range(40)]  # several requests per document
    fit, stream = split_workload(write_workload(tmp_path, docs), seed=3)
    assert {r["doc"] for r in fit}.isdisjoint({r["doc"] for r in stream})
    assert sorted(r["id"] for r in fit + stream) == sorted(f"r{i}" for i in range(40))
    assert fit and stream
    assert all(r["continuation"] == f"c{r['id'][1:]}" for r in fit + stream)  # the twin line, same order
