"""Train a tiny Qwen3-MoE (128 experts, top-8) and its own BPE tokenizer on the corpus.

The routing is shaped like Qwen3-30B-A3B (128 experts, top-8, normalised top-k) so
that expert-usage statistics behave like the real model's; depth and widths are
small so it trains on two CPU cores. Only the corpus' ``train`` split is used
(``tools/corpus.py``: ``split_of``); batches are balanced over (domain, language)
cells and each sequence packs documents of one cell. The result is a Hugging Face
checkpoint (bf16 safetensors + tokenizer) that SGLang and transformers load::

    python -m tools.train_tiny_moe --corpus .cache/corpus --out models/eldr-tiny-moe --minutes 40
    python -m tools.train_tiny_moe --corpus .cache/corpus --out models/eldr-moe-12l --layers 12 \
        --expert-ffn 32 --tokenizer models/eldr-tiny-moe --minutes 60       # deeper, same tokenizer
    python -m tools.train_tiny_moe --corpus .cache/corpus --out models/eldr-tiny-moe \
        --resume models/eldr-tiny-moe --minutes 15 --lr 2e-3      # continue (fresh optimizer)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tools.corpus import cell, load_corpus

SPECIAL = ["<pad>", "<s>", "</s>"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, default=Path(".cache/corpus"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=45.0, help="training time budget")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-ffn", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--docs-per-cell", type=int, default=3000, help="training documents per (domain, language)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-only", action="store_true", help="save the untrained model (same architecture)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="reuse this checkpoint's tokenizer (same token ids, so its workloads stay valid)")
    p.add_argument("--resume", type=Path, default=None,
                   help="continue training this checkpoint (its tokenizer and weights; fresh optimizer)")
    args = p.parse_args(argv)
    for name in ("vocab", "layers", "hidden", "experts", "top_k", "expert_ffn", "seq_len", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.top_k > args.experts:
        p.error("--top-k must not exceed --experts")
    return args


def balanced_texts(rows: list[dict], per_cell: int, seed: int) -> dict[str, list[str]]:
    by_cell: dict[str, list[str]] = {}
    for r in rows:
        by_cell.setdefault(cell(r), []).append(r["text"])
    rng = random.Random(seed)
    return {c: rng.sample(t, min(per_cell, len(t))) for c, t in sorted(by_cell.items())}


def train_tokenizer(texts: dict[str, list[str]], vocab: int, out: Path):
    """Byte-level BPE on a cell-balanced sample; saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sample = [t for ts in texts.values() for t in ts[:1500]]
    tok.train_from_iterator(sample, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=4096)
    fast.save_pretrained(out)
    return fast


def build_config(args: argparse.Namespace, vocab_size: int):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.expert_ffn * 4,
        moe_intermediate_size=args.expert_ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        num_experts=args.experts, num_experts_per_tok=args.top_k, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, router_aux_loss_coef=args.aux_coef, output_router_logits=False,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        torch_dtype="bfloat16",
    )
    return cfg


def packed_windows(texts: dict[str, list[str]], tokenizer, seq_len: int) -> dict[str, np.ndarray]:
    """Per cell: the cell's documents (BOS-separated) cut into windows of seq_len tokens."""
    out = {}
    for c, ts in texts.items():
        ids = tokenizer(ts, add_special_tokens=False)["input_ids"]
        flat = np.fromiter((t for doc in ids for t in [tokenizer.bos_token_id, *doc]), dtype=np.int64)
        n = len(flat) // seq_len
        if n:
            out[c] = flat[: n * seq_len].reshape(n, seq_len)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import Qwen3MoeForCausalLM

    t0 = time.time()
    rows = load_corpus(args.corpus, split="train", seed=args.seed)
    texts = balanced_texts(rows, args.docs_per_cell, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    reuse = args.resume or args.tokenizer
    if reuse:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(reuse)
        if reuse.resolve() != args.out.resolve():
            tokenizer.save_pretrained(args.out)
    else:
        tokenizer = train_tokenizer(texts, args.vocab, args.out)
    windows = packed_windows(texts, tokenizer, args.seq_len)
    print(f"tokenizer {len(tokenizer)} tokens; windows per cell: "
          + ", ".join(f"{c}={len(w)}" for c, w in windows.items()) + f" ({time.time() - t0:.0f}s)", flush=True)

    command = "python -m tools.train_tiny_moe " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.resume:
        model = Qwen3MoeForCausalLM.from_pretrained(args.resume, dtype=torch.float32)
        log = json.loads((args.resume / "training.json").read_text())
        log["commands"] = log.get("commands", [log.pop("command", "")]) + [command]
    else:
        model = Qwen3MoeForCausalLM(build_config(args, len(tokenizer)))
        log = {"commands": [command], "cells": {c: len(w) for c, w in windows.items()}, "loss": []}
    model.config.output_router_logits = True
    n_params = sum(p.numel() for p in model.parameters())
    log["parameters"] = n_params
    if not args.init_only:
        train(model, windows, args, log)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    log["wall_s"] = round(log.get("wall_s", 0.0) + time.time() - t0, 1)
    (args.out / "training.json").write_text(json.dumps(log, indent=1))
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors")) / 2**20
    print(f"saved {args.out} ({n_params / 1e6:.1f} M parameters, {size:.1f} MiB) in {log['wall_s']:.0f}s")
    return 0


def train(model, windows: dict[str, np.ndarray], args: argparse.Namespace, log: dict) -> None:
    rng = np.random.default_rng(args.seed)
    cells = sorted(windows)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    budget = args.minutes * 60
    warmup = 100
    start, ema = time.time(), None
    step0 = step = log.get("steps", 0)
    model.train()
    while step - step0 < args.max_steps:
        elapsed = time.time() - start
        if elapsed > budget:
            break
        frac = min(1.0, max((step - step0) / warmup, 0.0)) * 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed / budget)))
        for g in opt.param_groups:
            g["lr"] = args.lr * max(frac, 0.02)
        picks = rng.choice(len(cells), size=args.batch)  # balanced over cells
        batch = np.stack([windows[cells[c]][rng.integers(len(windows[cells[c]]))] for c in picks])
        ids = torch.from_numpy(batch)
        out = model(input_ids=ids, labels=ids)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lm = out.loss.item() - args.aux_coef * out.aux_loss.item()
        ema = lm if ema is None else 0.98 * ema + 0.02 * lm
        if step % 25 == 0:
            log["loss"].append([step, round(elapsed, 1), round(ema, 4), round(out.aux_loss.item(), 4)])
            print(f"step {step} {elapsed / 60:5.1f} min  lm loss {ema:.3f}  aux {out.aux_loss.item():.3f}", flush=True)
    log["steps"] = step
    log["tokens"] = log.get("tokens", 0) + (step - step0) * args.batch * args.seq_len
    model.eval()


if __name__ == "__main__":
    sys.exit(main())
