"""Corpus builder, workload builder and the committed workload/trace files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tools import build_corpus, build_workloads
from tools.corpus import cell, load_corpus, split_of

ROOT = Path(__file__).resolve().parents[2]

MODEL = ROOT / "models" / "eldr-tiny-moe"


def test_clean_chunks_and_roff():
    text = build_corpus.clean("a\u00a0\u00a0b\x07c\r\n\n\n\n    indented   line  ")
    assert text == "a bc\n\n    indented line"
    pieces = list(build_corpus.chunks("\n\n".join(["x" * 150] * 30), lo=200, hi=700))
    assert pieces and all(200 <= len(p) <= 700 for p in pieces)
    roff = '.\\" comment\n.TH LS 1\n.SH NAME\nls \\- list \\fBdirectory\\fP contents\n.PP\n'
    assert build_corpus.roff_to_text(roff).split("\n") == ["LS 1", "NAME", "ls - list directory contents"]
    assert build_corpus.detect_latin("Le titulaire de la licence est dans le fichier") == "fr"
    assert build_corpus.detect_latin("The licensee of the software is in the file") == "en"


def test_corpus_slice_is_labelled_deduplicated_and_deterministic(tmp_path):
    """Two builds of a small slice (the local standard library source) agree byte for byte."""
    manifests = []
    for name in ("a", "b"):
        out = tmp_path / name
        manifests.append(build_corpus.build(out, seed=3, max_docs=60, only=["python-stdlib"], math_per_module=1))
    rows = load_corpus(tmp_path / "a")
    assert len(rows) == 60 == manifests[0]["documents"]
    assert manifests[0]["sha256"] == manifests[1]["sha256"]
    assert {cell(r) for r in rows} == {"code/en"}
    keys = [re.sub(r"\W+", "", r["text"].lower()) for r in rows]
    assert len(set(keys)) == len(keys)
    src = manifests[0]["sources"][0]
    assert src["name"] == "python-stdlib" and src["licence"] and src["documents"] == 60
    assert all(200 <= len(r["text"]) <= 1400 for r in rows)
    assert any(line.startswith("    ") for r in rows for line in r["text"].split("\n"))  # indentation kept


def test_split_is_by_document_group_and_roughly_80_10_10():
    groups = [f"src/doc{i}" for i in range(5000)]
    counts = Counter(split_of(g) for g in groups)
    assert abs(counts["train"] / 5000 - 0.8) < 0.03 and abs(counts["eval"] / 5000 - 0.1) < 0.02
    assert all(split_of(g) == split_of(g) for g in groups[:50])
    assert split_of("x", seed=0) != split_of("x", seed=1) or split_of("y", seed=0) != split_of("y", seed=1)


def _fake_corpus(path: Path) -> None:
    """Documents for every cell the workloads use, across many groups (so every split has some)."""
    words = {"en": "the patient code law number", "zh": "法律 患者 代码 数字", "ru": "закон пациент код число",
             "fr": "la loi le patient le code"}
    cells = [("code", "en"), ("math", "en"), ("medical", "en"), ("legal", "en"), ("general", "zh"),
             ("manual", "ru"), ("manual", "fr"), ("legal", "zh")]
    rows, rng = [], np.random.default_rng(0)
    for d, lang in cells:
        vocab = words[lang].split()
        for i in range(120):
            text = " ".join([f"{d}{i}"] + [vocab[j] + str(int(rng.integers(100))) for j in rng.integers(len(vocab), size=160)])
            rows.append({"id": f"{d}-{lang}-{i}", "group": f"{d}/{lang}/{i}", "source": "test", "domain": d,
                         "language": lang, "synthetic": False, "text": text})
    rows += [{"id": f"sys{i}", "group": f"sys/{i}", "source": "dataset-build", "domain": "general", "language": "en",
              "synthetic": True, "text": f"You are assistant number {i}. " * 20} for i in range(40)]
    path.mkdir(parents=True)
    with open(path / "docs.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


@pytest.fixture(scope="module")
def built_workloads(tmp_path_factory):
    if not (MODEL / "tokenizer.json").exists():
        pytest.fail(f"{MODEL} is missing: the trained model is committed with the repository")
    base = tmp_path_factory.mktemp("wl")
    _fake_corpus(base / "corpus")
    out = base / "workloads"
    assert build_workloads.main(["--corpus", str(base / "corpus"), "--tokenizer", str(MODEL), "--out", str(out),
                                 "--requests", "400", "--demo-requests", "20"]) == 0
    return out


def test_workload_class_ratios_and_disjoint_splits(built_workloads):
    sets = {f"{w}/{s}": build_workloads.load_workload(built_workloads / w / f"{s}.jsonl")
            for w in ("task", "language") for s in ("calib", "eval")}
    for s in ("calib", "eval"):
        task = Counter(r["labels"]["domain"] for r in sets[f"task/{s}"])
        assert len(sets[f"task/{s}"]) == 400 and set(task) == {"code", "math", "medical", "legal"}
        assert max(task.values()) / min(task.values()) == pytest.approx(1.41, abs=0.03)
        lang = Counter(r["labels"]["language"] for r in sets[f"language/{s}"])
        assert (lang["en"] + lang["zh"]) / 400 == pytest.approx(0.75, abs=0.01)
    for w in ("task", "language"):
        calib_docs = {r["group"] for r in sets[f"{w}/calib"]}
        eval_docs = {r["group"] for r in sets[f"{w}/eval"]}
        assert calib_docs and eval_docs and not calib_docs & eval_docs
    shared = build_workloads.load_workload(built_workloads / "task-shared" / "eval.jsonl")
    starts = Counter(r["prompt"][:60] for r in shared)
    assert len(starts) <= build_workloads.SHARED_PROMPTS and sum(starts.values()) == 400


def test_bench_serving_reads_the_custom_format(built_workloads):
    """``sglang.bench_serving --dataset-name custom`` loader, called as bench_serving calls it."""
    pytest.importorskip("sglang")
    from transformers import AutoTokenizer

    from sglang.benchmark.datasets.custom import sample_custom_requests

    tok = AutoTokenizer.from_pretrained(MODEL)
    ours = build_workloads.load_workload(built_workloads / "language" / "eval.jsonl")
    rows = sample_custom_requests(str(built_workloads / "language" / "eval.bench.jsonl"), 50, tok)
    assert len(rows) == 50
    by_prompt = {r["prompt"]: r for r in ours}
    for row in rows:
        assert row.prompt in by_prompt
        want = by_prompt[row.prompt]["output_len"]
        assert abs(row.output_len - want) <= max(3, 0.1 * want)  # the completion, re-tokenised


def test_committed_demo_mix_has_both_workloads():
    rows = build_workloads.load_workload(ROOT / "benchmark" / "workloads" / "demo.jsonl")
    cells = Counter(cell(r["labels"]) for r in rows)
    assert len(rows) >= 48 and len(cells) >= 6
    assert {"zh", "ru", "fr", "en"} <= {c.split("/")[1] for c in cells}
    assert {"code", "math", "medical", "legal"} <= {c.split("/")[0] for c in cells}


TRACE_SETS = ["task/calib", "task/eval", "language/calib", "language/eval"]


@pytest.mark.parametrize("name", TRACE_SETS)
def test_committed_traces_load_with_consistent_shapes(name):
    from eldr_sglang.core import ModelSpec, load_traces

    spec = ModelSpec.from_hf_config(json.loads((MODEL / "config.json").read_text()), MODEL.name)
    traces = load_traces(ROOT / "benchmark" / "traces" / name)
    n, L, E, k = len(traces), spec.num_layers, spec.num_experts, spec.top_k
    assert n >= 500
    assert traces.prefill_counts.shape == traces.decode_counts.shape == (n, L, E)
    assert (traces.prefill_counts.sum(axis=2) == k * traces.prompt_tokens[:, None]).all()
    steps = traces.decode_counts.sum(axis=2) // k
    assert ((steps == traces.output_tokens[:, None] - 1) | (steps == traces.output_tokens[:, None])).all()
    key = "domain" if name.startswith("task") else "language"
    assert set(np.unique(traces.labels[key])) >= ({"code", "math", "medical", "legal"} if key == "domain"
                                                  else {"en", "zh", "ru", "fr"})


def test_trainer_cli_rejects_bad_flags():
    proc = subprocess.run([sys.executable, "-m", "tools.train_tiny_moe", "--out", "/tmp/x",
                           "--top-k", "9", "--experts", "8"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "--top-k" in proc.stderr and "Traceback" not in proc.stderr
