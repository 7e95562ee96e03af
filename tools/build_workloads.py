"""Build the "task" and "language" workloads from the corpus (paper's two workloads).

* task: code, math, medical, legal (English); class shares 0.29/0.24/0.26/0.205, so
  largest/smallest = 1.41 as in the paper;
* language: en, zh, ru, fr with en + zh = 75% of requests (0.45/0.30/0.13/0.12);
  each language drawn evenly from the domains the corpus has for it.

Each workload has a calibration and an evaluation set drawn from the corpus'
``calib`` and ``eval`` splits (no shared document), a ``-shared`` variant where
every prompt starts with one of a few shared system prompts (prefix caching), and
is written twice: our format (``<set>.jsonl``: id, prompt, output_len, labels) and
``sglang.bench_serving --dataset-name custom`` format (``<set>.bench.jsonl``: a
user turn and an assistant turn of ``output_len`` tokens, the document's own
continuation)::

    python -m tools.build_workloads --corpus .cache/corpus --tokenizer models/eldr-tiny-moe \
        --out benchmark/workloads --requests 3000
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from tools.corpus import cell, load_corpus

TASK_SHARES = {"code": 0.29, "medical": 0.26, "math": 0.24, "legal": 0.205}
LANGUAGE_SHARES = {"en": 0.45, "zh": 0.30, "ru": 0.13, "fr": 0.12}
SHARED_PROMPTS = 4  # distinct shared system prompts in the "-shared" variant


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, default=Path(".cache/corpus"))
    p.add_argument("--tokenizer", type=Path, required=True, help="model folder with the tokenizer")
    p.add_argument("--out", type=Path, default=Path("benchmark/workloads"))
    p.add_argument("--requests", type=int, default=3000, help="requests per set (calibration and evaluation each)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=(48, 320), metavar=("MIN", "MAX"))
    p.add_argument("--output-median", type=int, default=96, help="median output length (log-normal)")
    p.add_argument("--output-max", type=int, default=384)
    p.add_argument("--demo-requests", type=int, default=96,
                   help="size of demo.jsonl: a mix of both workloads' evaluation sets (make demo)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.requests < 10:
        p.error("--requests must be >= 10")
    if not 2 <= args.prompt_tokens[0] < args.prompt_tokens[1]:
        p.error("--prompt-tokens: need 2 <= MIN < MAX")
    if not 4 <= args.output_median <= args.output_max:
        p.error("--output-median must be >= 4 and <= --output-max")
    return args


def class_counts(shares: dict[str, float], n: int) -> dict[str, int]:
    """Largest-remainder rounding of ``shares`` (normalised) to ``n`` requests."""
    total = sum(shares.values())
    raw = {k: n * v / total for k, v in shares.items()}
    counts = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: raw[k] - counts[k], reverse=True)[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def pools(rows: list[dict], workload: str) -> dict[str, dict[str, list[dict]]]:
    """class -> domain (or language) -> documents."""
    out: dict[str, dict[str, list[dict]]] = {}
    for r in rows:
        if workload == "task":
            if r["domain"] in TASK_SHARES and r["language"] == "en":
                out.setdefault(r["domain"], {}).setdefault(r["language"], []).append(r)
        elif r["language"] in LANGUAGE_SHARES:
            out.setdefault(r["language"], {}).setdefault(r["domain"], []).append(r)
    return out


def make_requests(rows: list[dict], workload: str, n: int, tokenizer, args, rng: np.random.Generator,
                  set_name: str) -> list[dict]:
    shares = TASK_SHARES if workload == "task" else LANGUAGE_SHARES
    by_class = pools(rows, workload)
    missing = [c for c in shares if c not in by_class]
    if missing:
        raise SystemExit(f"build_workloads: corpus has no {set_name} documents for {missing}")
    out: list[dict] = []
    used: dict[str, int] = {}  # a document drawn again starts at another offset (no shared prefix)
    for cls, count in class_counts(shares, n).items():
        subs = sorted(by_class[cls])
        for i in range(count):
            docs = by_class[cls][subs[i % len(subs)]]  # even over the class' domains/languages
            doc = docs[rng.integers(len(docs))]
            reuse = used.get(doc["id"], 0)
            used[doc["id"]] = reuse + 1
            out.append(request(doc, tokenizer, args, rng, f"{workload}-{set_name}-{len(out):05d}", reuse))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def request(doc: dict, tokenizer, args, rng: np.random.Generator, rid: str, reuse: int = 0) -> dict:
    ids = tokenizer(doc["text"], add_special_tokens=False)["input_ids"]
    lo, hi = args.prompt_tokens
    if reuse:
        ids = ids[int(rng.integers(1, max(2, len(ids) - lo))):]
    n_prompt = int(min(len(ids), rng.integers(lo, hi + 1)))
    out_len = int(np.clip(rng.lognormal(np.log(args.output_median), 0.6), 4, args.output_max))
    completion = tokenizer.decode(continuation(ids, n_prompt, out_len))
    out_len = max(4, len(tokenizer(completion, add_special_tokens=False)["input_ids"]))  # as bench_serving counts
    return {
        "id": rid, "prompt": tokenizer.decode(ids[:n_prompt]), "prompt_tokens": n_prompt, "output_len": out_len,
        "completion": completion,
        "labels": {"domain": doc["domain"], "language": doc["language"]}, "doc": doc["id"], "group": doc["group"],
    }


def continuation(ids: list[int], start: int, n: int) -> list[int]:
    """``n`` tokens following ``start`` (wrapping to the document's start when it is
    shorter): bench_serving takes the output length from the assistant turn."""
    out = list(ids[start:start + n])
    while len(out) < n:
        out += ids[: n - len(out)]
    return out


def with_system_prompts(reqs: list[dict], system_prompts: list[str], rng: np.random.Generator) -> list[dict]:
    out = []
    for r in reqs:
        k = int(rng.integers(len(system_prompts)))
        out.append({**r, "id": r["id"] + "-s", "prompt": system_prompts[k] + "\n\n" + r["prompt"],
                    "system_prompt": k})
    return out


def write_set(reqs: list[dict], path: Path) -> None:
    with open(path.with_suffix(".jsonl"), "w", encoding="utf-8") as f:
        for r in reqs:
            f.write(json.dumps({k: v for k, v in r.items() if k != "completion"}, ensure_ascii=False) + "\n")
    with open(path.with_suffix(".bench.jsonl"), "w", encoding="utf-8") as f:
        for r in reqs:
            conv = [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]
            f.write(json.dumps({"conversations": conv}, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rng = np.random.default_rng(args.seed)
    splits = {name: load_corpus(args.corpus, split=name, seed=args.seed) for name in ("calib", "eval")}
    system_prompts = [r["text"] for r in load_corpus(args.corpus, split="train", seed=args.seed)
                      if r["source"] == "dataset-build" and r["language"] == "en"][:SHARED_PROMPTS]
    manifest: dict = {"command": "python -m tools.build_workloads " + " ".join(argv if argv is not None else sys.argv[1:]),
                      "shares": {"task": TASK_SHARES, "language": LANGUAGE_SHARES}, "sets": {}}
    eval_sets: dict[str, list[dict]] = {}
    for workload in ("task", "language"):
        for variant in ("", "-shared"):
            (args.out / (workload + variant)).mkdir(parents=True, exist_ok=True)
        for set_name, rows in splits.items():
            reqs = make_requests(rows, workload, args.requests, tokenizer, args, rng, set_name)
            if set_name == "eval":
                eval_sets[workload] = reqs
            write_set(reqs, args.out / workload / set_name)
            write_set(with_system_prompts(reqs, system_prompts, rng), args.out / f"{workload}-shared" / set_name)
            key = "domain" if workload == "task" else "language"
            counts = Counter(r["labels"][key] for r in reqs)
            manifest["sets"][f"{workload}/{set_name}"] = {
                "requests": len(reqs), "classes": dict(counts.most_common()),
                "largest_over_smallest": round(max(counts.values()) / min(counts.values()), 3),
                "unique_documents": len({r["doc"] for r in reqs}),
                "unique_prompt_starts": len({r["prompt"][:64] for r in reqs}),
                "prompt_tokens_mean": round(float(np.mean([r["prompt_tokens"] for r in reqs])), 1),
                "output_len_mean": round(float(np.mean([r["output_len"] for r in reqs])), 1)}
            print(f"{workload}/{set_name}: {manifest['sets'][f'{workload}/{set_name}']}")
    demo = demo_mix([eval_sets[w] for w in ("task", "language")], args.demo_requests, rng)
    write_set(demo, args.out / "demo")
    manifest["sets"]["demo"] = {"requests": len(demo), "cells": dict(Counter(cell(r["labels"]) for r in demo))}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return 0


def demo_mix(sets: list[list[dict]], n: int, rng: np.random.Generator) -> list[dict]:
    """``n`` requests alternating between the sets (random picks from each)."""
    per = [list(rng.permutation(len(s))[: n // len(sets) + 1]) for s in sets]
    return [sets[i % len(sets)][per[i % len(sets)][i // len(sets)]] for i in range(n)]


def load_workload(path: str | Path) -> list[dict]:
    """Requests of one set in our format (``benchmark/workloads/<workload>/<set>.jsonl``)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


if __name__ == "__main__":
    sys.exit(main())
