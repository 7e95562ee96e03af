"""Does the model's expert routing specialise by language and domain, and is it learned?

For held-out corpus documents, the per-document expert-usage vector (top-k counts
over all layers, IDF-weighted, L2-normalised: the ELDR signature over every
layer) is classified by nearest centroid (centroids from the ``calib`` split,
tested on the ``eval`` split) by language, by domain and by (domain, language),
for the trained model and for the same architecture with untrained weights; and
leave-one-out over both splits together (each document against centroids
computed without it), over all layers and for every layer alone. Also
the paper's Pearson correlation between a request's prefill and decode expert
activation (greedy decode of ``--decode-tokens`` tokens)::

    python -m tools.routing_specialisation --model models/eldr-tiny-moe --corpus .cache/corpus
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from tools.corpus import cell, load_corpus
from eldr_sglang.core.signature import SignatureBuilder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--corpus", type=Path, default=Path(".cache/corpus"))
    p.add_argument("--docs-per-cell", type=int, default=50, help="documents per (domain, language) and split")
    p.add_argument("--tokens", type=int, default=128, help="prompt tokens per document")
    p.add_argument("--decode-docs", type=int, default=48, help="documents for the prefill/decode correlation")
    p.add_argument("--decode-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON results (default: <model>/specialisation.json)")
    return p.parse_args(argv)


def sample_docs(corpus: Path, split: str, per_cell: int, seed: int) -> list[dict]:
    by_cell: dict[str, list[dict]] = {}
    for r in load_corpus(corpus, split=split, seed=seed):
        by_cell.setdefault(cell(r), []).append(r)
    rng = random.Random(f"{seed}:{split}")
    return [d for c in sorted(by_cell) for d in rng.sample(by_cell[c], min(per_cell, len(by_cell[c])))]


def token_batch(docs: list[dict], tokenizer, n: int) -> tuple[torch.Tensor, list[dict]]:
    """Documents with at least ``n`` tokens, cut to ``n`` (no padding needed)."""
    ids, kept = [], []
    for d in docs:
        t = tokenizer(d["text"], add_special_tokens=False)["input_ids"]
        if len(t) >= n:
            ids.append(t[:n])
            kept.append(d)
    return torch.tensor(ids), kept


@torch.no_grad()
def expert_counts(model, ids: torch.Tensor, top_k: int, batch: int = 16) -> np.ndarray:
    """[docs, layers, experts] top-k counts over every position."""
    out = []
    for i in range(0, len(ids), batch):
        res = model(input_ids=ids[i:i + batch], output_router_logits=True)
        per_layer = []
        for logits in res.router_logits:  # [batch * seq, experts]
            top = logits.float().topk(top_k, dim=-1).indices.view(ids[i:i + batch].shape[0], -1, top_k)
            counts = torch.zeros(top.shape[0], logits.shape[-1])
            counts.scatter_add_(1, top.flatten(1), torch.ones(top.flatten(1).shape))
            per_layer.append(counts)
        out.append(torch.stack(per_layer, dim=1))
    return torch.cat(out).numpy()


def nearest_centroid_accuracy(train_x: np.ndarray, train_y: list[str], test_x: np.ndarray, test_y: list[str]) -> float:
    classes = sorted(set(train_y))
    ty = np.array(train_y)
    cents = np.stack([train_x[ty == c].mean(axis=0) for c in classes])
    cents /= np.linalg.norm(cents, axis=1, keepdims=True) + 1e-12
    pred = np.array(classes)[np.argmax(test_x @ cents.T, axis=1)]
    return float(np.mean(pred == np.array(test_y)))


@torch.no_grad()
def prefill_decode_pearson(model, ids: torch.Tensor, top_k: int, new_tokens: int) -> float:
    """Mean over requests of Pearson(prefill counts, decode counts), all layers flattened.
    Decode activations come from re-running the greedy continuation (teacher forcing
    reproduces the decode steps' router inputs)."""
    full = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                          pad_token_id=0, eos_token_id=None)
    n = ids.shape[1]
    prefill = expert_counts(model, ids, top_k)
    # decode steps process the generated tokens except the last (position n onwards); the
    # last prompt token (n - 1) was processed by the prefill
    whole = expert_counts_positions(model, full[:, :-1], top_k, start=n)
    r = [np.corrcoef(p.ravel(), d.ravel())[0, 1] for p, d in zip(prefill, whole)]
    return float(np.nanmean(r))


@torch.no_grad()
def expert_counts_positions(model, ids: torch.Tensor, top_k: int, start: int) -> np.ndarray:
    """Counts over positions >= start only (the decode steps)."""
    res = model(input_ids=ids, output_router_logits=True)
    b = ids.shape[0]
    per_layer = []
    for logits in res.router_logits:
        top = logits.float().topk(top_k, dim=-1).indices.view(b, -1, top_k)[:, start:]
        counts = torch.zeros(b, logits.shape[-1])
        counts.scatter_add_(1, top.flatten(1), torch.ones(top.flatten(1).shape))
        per_layer.append(counts)
    return torch.stack(per_layer, dim=1).numpy()


def loo_accuracy(x: np.ndarray, labels: list[str]) -> float:
    """Leave-one-out nearest-centroid accuracy: each unit row ``x[i]`` against the class
    centroids, its own class's centroid computed without it (cosine)."""
    y = np.array(labels)
    classes = sorted(set(labels))
    idx = np.searchsorted(classes, y)
    sums = np.stack([x[y == c].sum(axis=0) for c in classes])  # [k, D]
    counts = np.bincount(idx, minlength=len(classes)).astype(float)
    cent = sums / counts[:, None]
    scores = x @ (cent / (np.linalg.norm(cent, axis=1, keepdims=True) + 1e-12)).T  # [n, k]
    own = (sums[idx] - x) / np.maximum(counts[idx] - 1, 1)[:, None]  # own class without the row
    own_norm = np.linalg.norm(own, axis=1) + 1e-12
    scores[np.arange(len(x)), idx] = np.where(counts[idx] > 1, (x * own).sum(axis=1) / own_norm, -np.inf)
    return float(np.mean(scores.argmax(axis=1) == idx))


def per_layer_accuracy(counts: np.ndarray, docs: list[dict]) -> dict[str, list[float]]:
    """Leave-one-out accuracy by language and by domain from one layer's signature alone
    (IDF fitted on the same documents: it sees no labels)."""
    out: dict[str, list[float]] = {"language": [], "domain": []}
    for layer in range(counts.shape[1]):
        x = SignatureBuilder("idf").fit(counts[:, layer:layer + 1]).transform(counts[:, layer:layer + 1])
        for name in out:
            out[name].append(round(loo_accuracy(x, [d[name] for d in docs]), 4))
    return out


def evaluate(model, tokenizer, calib: list[dict], evalset: list[dict], args) -> dict:
    top_k = model.config.num_experts_per_tok
    c_ids, c_docs = token_batch(calib, tokenizer, args.tokens)
    e_ids, e_docs = token_batch(evalset, tokenizer, args.tokens)
    c_counts, e_counts = expert_counts(model, c_ids, top_k), expert_counts(model, e_ids, top_k)
    builder = SignatureBuilder("idf").fit(c_counts)
    cx, ex = builder.transform(c_counts), builder.transform(e_counts)
    res = {"calib_docs": len(c_docs), "eval_docs": len(e_docs)}
    for name, key in (("language", lambda d: d["language"]), ("domain", lambda d: d["domain"]), ("cell", cell)):
        res[f"accuracy_{name}"] = round(nearest_centroid_accuracy(cx, [key(d) for d in c_docs], ex,
                                                                  [key(d) for d in e_docs]), 4)
    pooled, pooled_docs = np.concatenate([c_counts, e_counts]), c_docs + e_docs
    x = SignatureBuilder("idf").fit(pooled).transform(pooled)
    for name in ("language", "domain"):
        res[f"loo_{name}"] = round(loo_accuracy(x, [d[name] for d in pooled_docs]), 4)
    res["per_layer"] = per_layer_accuracy(pooled, pooled_docs)
    rng = np.random.default_rng(args.seed)
    pick = rng.choice(len(e_ids), size=min(args.decode_docs, len(e_ids)), replace=False)
    res["prefill_decode_pearson"] = round(prefill_decode_pearson(model, e_ids[pick], top_k, args.decode_tokens), 4)
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer, Qwen3MoeForCausalLM

    if not (args.model / "config.json").exists():
        raise SystemExit(f"routing_specialisation: --model: no config.json in {args.model}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    calib = sample_docs(args.corpus, "calib", args.docs_per_cell, args.seed)
    evalset = sample_docs(args.corpus, "eval", args.docs_per_cell, args.seed)
    trained = Qwen3MoeForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    untrained = Qwen3MoeForCausalLM(AutoConfig.from_pretrained(args.model)).float().eval()
    results = {"command": "python -m tools.routing_specialisation " + " ".join(argv if argv is not None else sys.argv[1:]),
               "trained": evaluate(trained, tokenizer, calib, evalset, args),
               "untrained": evaluate(untrained, tokenizer, calib, evalset, args),
               "chance": {"language": 1 / len({d["language"] for d in calib}),
                          "domain": 1 / len({d["domain"] for d in calib}), "cell": 1 / len({cell(d) for d in calib})}}
    out = args.out or args.model / "specialisation.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"{'':22s}{'trained':>10s}{'untrained':>11s}{'chance':>8s}")
    for key in ("language", "domain", "cell"):
        print(f"nearest-centroid {key:8s}{results['trained'][f'accuracy_{key}']:10.3f}"
              f"{results['untrained'][f'accuracy_{key}']:11.3f}{results['chance'][key]:8.3f}")
    print(f"prefill/decode Pearson {results['trained']['prefill_decode_pearson']:10.3f}"
          f"{results['untrained']['prefill_decode_pearson']:11.3f}")
    for key in ("language", "domain"):
        print(f"leave-one-out {key:11s}{results['trained'][f'loo_{key}']:10.3f}{results['untrained'][f'loo_{key}']:11.3f}")
    for kind in ("trained", "untrained"):
        for name, accs in results[kind]["per_layer"].items():
            print(f"per layer (leave-one-out), {kind:9s} {name:8s} " + " ".join(f"{a:.2f}" for a in accs))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
