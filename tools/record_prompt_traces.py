"""Record expert traces WITH the prompts' token ids (for the signature predictor).

The committed traces (``benchmark/traces``, SGLang trace mode) store counts per
request but not the prompt, and a rebuilt corpus does not reproduce their prompts,
so the predictor's evidence needs traces recorded together with their token ids.
For each request of a workload set (``<workloads>/<set>.jsonl`` and its
``.bench.jsonl`` twin, whose assistant turn is the document's own continuation) one
teacher-forced forward pass (transformers, float32, CPU) over prompt + the first
``--decode-steps`` continuation tokens gives the top-k experts of every position:
prompt positions make the prefill counts, continuation positions the decode steps
(the continuation stands in for generated text: no greedy decode, whose loops a
small model falls into, and one pass instead of one per step).

Output per set under ``--out/<set>/``: trace shards (``eldr_sglang.core.traces``),
``steps.npz`` (per-step expert ids, as ``tools/record_long_decodes.py``) and
``prompts.jsonl`` (``id``, ``input_ids``)::

    python -m tools.record_prompt_traces --model models/eldr-tiny-moe --workloads .cache/workloads \\
        --sets task/calib task/eval language/calib language/eval --limit 1000 --out .cache/prompt-traces
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eldr_sglang.core.traces import ModelSpec, TraceRecord, TraceWriter, existing_shards


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--workloads", type=Path, required=True)
    p.add_argument("--sets", nargs="+", default=["task/calib", "task/eval", "language/calib", "language/eval"])
    p.add_argument("--limit", type=int, default=1000, help="requests per set (the first N)")
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--max-prompt-tokens", type=int, default=320)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--append", action="store_true",
                   help="add to trace shards already in --out/<set> (refused without it: two runs would mix)")
    args = p.parse_args(argv)
    for s in args.sets:
        for suffix in (".jsonl", ".bench.jsonl"):
            if not (args.workloads / f"{s}{suffix}").exists():
                p.error(f"--sets: {args.workloads / (s + suffix)} not found (python -m tools.build_workloads)")
    for s in args.sets:  # refused before the recording, not after it
        shards, records = existing_shards(args.out / s)
        if shards and not args.append:
            p.error(f"--out: {args.out / s} already holds {len(shards)} trace shards ({records} records); "
                    f"use an empty --out, or --append to add to them")
    return args


@torch.no_grad()
def route_batch(model, seqs: list[list[int]], top_k: int, pad: int) -> list[np.ndarray]:
    """Right-padded causal pass; per sequence the top-k expert ids [n, L, k] of its positions."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    res = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    b = len(seqs)
    top = torch.stack([lg.float().view(b, width, -1).topk(top_k, dim=-1).indices for lg in res.router_logits],
                      dim=2)  # [b, width, L, k]
    return [top[i, :len(s)].numpy().astype(np.uint8) for i, s in enumerate(seqs)]


def record_set(model, tokenizer, name: str, args, spec: ModelSpec) -> dict:
    from tqdm import tqdm

    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    with open(args.workloads / f"{name}.jsonl", encoding="utf-8") as f:
        reqs = [json.loads(line) for _, line in zip(range(args.limit), f)]
    with open(args.workloads / f"{name}.bench.jsonl", encoding="utf-8") as f:
        bench = [json.loads(line) for _, line in zip(range(args.limit), f)]
    prompts, conts = [], []
    for r, b in zip(reqs, bench):
        user, assistant = b["conversations"][0]["content"], b["conversations"][1]["content"]
        if user != r["prompt"]:
            raise SystemExit(f"{name}: {r['id']}: .jsonl and .bench.jsonl are not in the same order")
        prompts.append(enc(r["prompt"])[:args.max_prompt_tokens])
        conts.append(enc(assistant)[:args.decode_steps])
    T, L, E, k = args.decode_steps, spec.num_layers, spec.num_experts, spec.top_k
    step_ids = np.zeros((len(reqs), T, L, k), dtype=np.uint8)
    records: list[TraceRecord | None] = [None] * len(reqs)
    order = np.argsort([len(p) + len(c) for p, c in zip(prompts, conts)])
    pad = tokenizer.pad_token_id or 0
    for s in tqdm(range(0, len(reqs), args.batch), unit="batch", desc=name, file=sys.stderr):
        rows = order[s:s + args.batch]
        for r, top in zip(rows, route_batch(model, [prompts[i] + conts[i] for i in rows], k, pad)):
            n_p, n_c = len(prompts[r]), len(conts[r])
            pre = np.zeros((L, E), dtype=np.int64)
            dec = np.zeros((L, E), dtype=np.int64)
            for layer in range(L):
                pre[layer] = np.bincount(top[:n_p, layer].ravel(), minlength=E)
                dec[layer] = np.bincount(top[n_p:, layer].ravel(), minlength=E)
            step_ids[r, :n_c] = top[n_p:]
            if n_c:  # a short continuation repeats its steps (replay cycles over T steps)
                step_ids[r, n_c:] = top[n_p:][np.arange(T - n_c) % n_c]
            records[r] = TraceRecord(request_id=reqs[r]["id"], prefill_counts=pre, decode_counts=dec,
                                     prompt_tokens=n_p, output_tokens=n_c + 1, labels=dict(reqs[r]["labels"]))
    out = args.out / name
    with TraceWriter(out, spec, append=args.append) as writer:
        for rec in records:
            writer.add(rec)
    np.savez_compressed(out / "steps.npz", experts=step_ids, request_id=np.array([r["id"] for r in reqs]))
    with open(out / "prompts.jsonl", "w", encoding="utf-8") as f:
        for r, ids in zip(reqs, prompts):
            f.write(json.dumps({"id": r["id"], "input_ids": ids}) + "\n")
    return {"requests": len(reqs), "prompt_tokens_mean": round(float(np.mean([len(p) for p in prompts])), 1),
            "decode_steps_mean": round(float(np.mean([len(c) for c in conts])), 1)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = Qwen3MoeForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    cfg = model.config
    spec = ModelSpec(name=args.model.name, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts,
                     top_k=cfg.num_experts_per_tok)
    info = {"command": "python -m tools.record_prompt_traces " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": str(args.model), "decode_steps": args.decode_steps, "sets": {}}
    for name in args.sets:
        t0 = time.time()
        info["sets"][name] = {**record_set(model, tokenizer, name, args, spec), "seconds": round(time.time() - t0, 1)}
        print(f"{name}: {info['sets'][name]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "collection.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
