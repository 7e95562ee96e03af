"""Write a tiny random-weight Qwen3-MoE checkpoint in Hugging Face format.

SGLang loads it on CPU. The tokenizer is the SentencePiece model that ships in
the ``mistral_common`` wheel (32k vocab), so nothing is downloaded.
Deterministic for a seed: the same arguments give byte-identical weights.

    python -m tools.make_fixture_model --out .cache/models/tiny-qwen3-moe
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

TOKENIZER_SOURCE = ("mistral_common", "data/tokenizer.model.v1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (all MoE)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--experts", type=int, default=16, help="routed experts per layer")
    p.add_argument("--top-k", type=int, default=4, help="experts per token")
    p.add_argument("--expert-ffn", type=int, default=64, help="expert intermediate size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite an existing model")
    args = p.parse_args(argv)
    for name in ("layers", "hidden", "experts", "top_k", "expert_ffn", "heads", "kv_heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.top_k > args.experts:
        p.error("--top-k must not exceed --experts")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be divisible by --heads, and --heads by --kv-heads")
    return args


def tokenizer_model_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(TOKENIZER_SOURCE[0])
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("make_fixture_model: the 'mistral_common' package is needed for the tokenizer")
    path = Path(list(spec.submodule_search_locations)[0]) / TOKENIZER_SOURCE[1]
    if not path.exists():
        raise SystemExit(f"make_fixture_model: tokenizer file missing: {path}")
    return path


def build_config(args: argparse.Namespace, vocab_size: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.expert_ffn * 2,
        moe_intermediate_size=args.expert_ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="bfloat16",
    )


def write_tokenizer(out: Path) -> int:
    shutil.copyfile(tokenizer_model_path(), out / "tokenizer.model")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "model_max_length": 4096,
                "legacy": True,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2)
    )
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model")).get_piece_size()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    if (out / "model.safetensors").exists() and not args.force:
        print(f"fixture model already present: {out}")
        return 0
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import Qwen3MoeForCausalLM

    vocab = write_tokenizer(out)
    config = build_config(args, vocab)
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()[:16]
    params = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {out}: {args.layers} layers x {args.experts} experts (top-{args.top_k}), "
        f"hidden {args.hidden}, {params / 1e6:.1f}M params, weights sha256 {digest}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
