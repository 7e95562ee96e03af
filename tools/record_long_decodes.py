"""Record long greedy decodes with the expert set of EVERY decode step.

For requests of a workload set (``benchmark/workloads/<set>.jsonl``) the model
decodes ``--decode-steps`` tokens greedily (EOS ignored), in float32 with
transformers on the CPU. The routing of every position is read back by one
teacher-forced pass over prompt + continuation (the same router inputs the decode
steps saw). Output, per set, under ``--out/<set>/``:

* the usual trace shards (``eldr_sglang.core.traces``: prefill and decode counts,
  lengths, labels), so calibration, the simulator and ``analyze`` read them as they are;
* ``steps.npz``: ``experts`` uint8 ``[n, T, L, top_k]`` (the top-k expert ids of every
  decode step, every layer), ``request_id`` ``[n]``; 12 layers x 8 experts is 96 bytes
  a step, about 29 KB a 300-step request before compression;
* ``repetition.json``: how much the small model's outputs repeat themselves (share of
  4-grams already seen earlier in the same output; share of outputs whose last 64
  tokens are a loop of period <= 16).

::

    python -m tools.record_long_decodes --model models/eldr-moe-12l --sets task/eval language/eval \\
        --limit 192 --decode-steps 300 --out benchmark/traces-long
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

STEPS_FILE = "steps.npz"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--workloads", type=Path, default=Path("benchmark/workloads"))
    p.add_argument("--sets", nargs="+", default=["task/eval", "language/eval"])
    p.add_argument("--limit", type=int, default=192, help="requests per set (the first N of the set)")
    p.add_argument("--decode-steps", type=int, default=300)
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="prompts are cut to this many tokens")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("benchmark/traces-long"))
    p.add_argument("--append", action="store_true",
                   help="add to trace shards already in --out/<set> (refused without it: two runs would mix)")
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        p.error(f"--model: no config.json in {args.model}")
    for s in args.sets:
        if not (args.workloads / f"{s}.jsonl").exists():
            p.error(f"--sets: {args.workloads / (s + '.jsonl')} not found (build it: make workloads)")
    if args.decode_steps < 2 or args.limit < 1 or args.batch < 1:
        p.error("--decode-steps must be >= 2, --limit and --batch >= 1")
    for s in args.sets:  # refused before the recording, not after it
        shards, records = existing_shards(args.out / s)
        if shards and not args.append:
            p.error(f"--out: {args.out / s} already holds {len(shards)} trace shards ({records} records); "
                    f"use an empty --out, or --append to add to them")
    return args


def repeated_ngram_share(tokens: list[int], n: int = 4) -> float:
    """Share of the output's n-grams that already occurred earlier in it."""
    seen, repeats, total = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i:i + n])
        repeats += g in seen
        total += 1
        seen.add(g)
    return repeats / max(total, 1)


def ends_in_loop(tokens: list[int], tail: int = 64, max_period: int = 16) -> bool:
    end = tokens[-tail:]
    return any(all(end[i] == end[i - p] for i in range(p, len(end))) for p in range(1, max_period + 1))


@torch.no_grad()
def record_batch(model, prompts: list[list[int]], steps: int, top_k: int, pad: int):
    """Left-padded greedy decode; returns per request (prefill [L, E], step ids [T, L, k], output ids)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    full = model.generate(ids, attention_mask=mask, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                          do_sample=False, pad_token_id=pad, eos_token_id=None)
    seq = full[:, :-1]  # the last token is sampled, never fed back
    seq_mask = torch.cat([mask, torch.ones(len(prompts), steps, dtype=torch.long)], dim=1)
    pos = (seq_mask.cumsum(1) - 1).clamp(min=0)
    res = model(input_ids=seq, attention_mask=seq_mask, position_ids=pos, output_router_logits=True)
    b, n = seq.shape
    top = torch.stack([lg.float().topk(top_k, dim=-1).indices.view(b, n, top_k) for lg in res.router_logits],
                      dim=2)  # [b, n, L, k]
    E = res.router_logits[0].shape[-1]
    out = []
    for i, p in enumerate(prompts):
        pre = top[i, width - len(p):width]  # [P, L, k]
        counts = torch.zeros(pre.shape[1], E, dtype=torch.int64)
        counts.scatter_add_(1, pre.permute(1, 0, 2).reshape(pre.shape[1], -1),
                            torch.ones(pre.shape[1], pre.shape[0] * top_k, dtype=torch.int64))
        out.append((counts.numpy(), top[i, width:].numpy().astype(np.uint8), full[i, width:].tolist()))
    return out


def record_set(model, tokenizer, reqs: list[dict], args, spec: ModelSpec, out: Path) -> dict:
    from tqdm import tqdm

    top_k = spec.top_k
    pad = tokenizer.pad_token_id or 0
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][:args.max_prompt_tokens] for r in reqs]
    order = np.argsort([len(p) for p in prompts])  # similar lengths share a batch: little padding
    step_ids = np.zeros((len(reqs), args.decode_steps, spec.num_layers, top_k), dtype=np.uint8)
    rep, loops = np.zeros(len(reqs)), np.zeros(len(reqs), dtype=bool)
    records: list[TraceRecord | None] = [None] * len(reqs)
    for s in tqdm(range(0, len(reqs), args.batch), unit="batch"):
        rows = order[s:s + args.batch]
        for r, (pre, steps, toks) in zip(rows, record_batch(model, [prompts[i] for i in rows],
                                                            args.decode_steps, top_k, pad)):
            step_ids[r] = steps
            dec = np.zeros((spec.num_layers, spec.num_experts), dtype=np.int64)
            for layer in range(spec.num_layers):
                dec[layer] = np.bincount(steps[:, layer].ravel(), minlength=spec.num_experts)
            rep[r], loops[r] = repeated_ngram_share(toks), ends_in_loop(toks)
            records[r] = TraceRecord(request_id=reqs[r]["id"], prefill_counts=pre, decode_counts=dec,
                                     prompt_tokens=len(prompts[r]), output_tokens=args.decode_steps + 1,
                                     labels=dict(reqs[r]["labels"]))
    with TraceWriter(out, spec, append=args.append) as writer:
        for rec in records:
            writer.add(rec)
    np.savez_compressed(out / STEPS_FILE, experts=step_ids, request_id=np.array([r["id"] for r in reqs]))
    repetition = {"repeated_4gram_share_mean": round(float(rep.mean()), 4),
                  "repeated_4gram_share_p90": round(float(np.quantile(rep, 0.9)), 4),
                  "ends_in_loop_share": round(float(loops.mean()), 4), "requests": len(reqs)}
    (out / "repetition.json").write_text(json.dumps(repetition, indent=1))
    return repetition


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = Qwen3MoeForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    cfg = model.config
    spec = ModelSpec(name=args.model.name, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts,
                     top_k=cfg.num_experts_per_tok)
    info = {"command": "python -m tools.record_long_decodes " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": str(args.model), "decode_steps": args.decode_steps, "sets": {}}
    for name in args.sets:
        with open(args.workloads / f"{name}.jsonl", encoding="utf-8") as f:
            reqs = [json.loads(line) for _, line in zip(range(args.limit), f)]
        t0 = time.time()
        rep = record_set(model, tokenizer, reqs, args, spec, args.out / name)
        info["sets"][name] = {**rep, "seconds": round(time.time() - t0, 1)}
        print(f"{name}: {len(reqs)} requests x {args.decode_steps} steps -> {args.out / name} "
              f"({info['sets'][name]['seconds']} s); repetition {rep}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "collection.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
