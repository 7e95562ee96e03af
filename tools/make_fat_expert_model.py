"""Build a "fat-expert" copy of a Qwen3-MoE checkpoint: every expert FFN zero-padded to width W.

Each expert's ``gate_proj``/``up_proj`` get ``W - I`` extra rows of zeros and its
``down_proj`` ``W - I`` extra columns of zeros (I: the checkpoint's
``moe_intermediate_size``); ``config.json`` gets ``moe_intermediate_size = W``.
The padded units compute ``silu(0) * 0 = 0`` and are multiplied by zero columns,
so the model's function (logits, routed experts) is unchanged while every expert's
weights grow by ``W / I``: a decode step then reads ``3 * hidden * W`` weights per
distinct expert per layer, as on a GPU serving a large MoE. Written outside git
and rebuilt in seconds::

    python -m tools.make_fat_expert_model --model models/eldr-tiny-moe --width 4096 \\
        --out .cache/models/eldr-tiny-moe-fat4096
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DEFAULT_MODEL = Path("models/eldr-tiny-moe")
DEFAULT_WIDTH = 4096
WEIGHTS = "model.safetensors"
EXPERT_KEY = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def default_out(model: Path, width: int) -> Path:
    return Path(".cache/models") / f"{model.name}-fat{width}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="Qwen3-MoE checkpoint directory")
    p.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="new expert intermediate size W")
    p.add_argument("--out", type=Path, default=None, help="output directory (default .cache/models/<name>-fat<W>)")
    args = p.parse_args(argv)
    try:
        config = read_config(args.model)
    except ValueError as e:
        p.error(f"--model: {e}")
    if args.width < config["moe_intermediate_size"]:
        p.error(f"--width: must be >= the model's moe_intermediate_size ({config['moe_intermediate_size']}),"
                f" got {args.width}")
    args.out = args.out or default_out(args.model, args.width)
    if args.out.resolve() == args.model.resolve():
        p.error("--out: must differ from --model")
    return args


def read_config(model: Path) -> dict:
    """The checkpoint's config; a ValueError names what is missing."""
    path = model / "config.json"
    if not path.is_file() or not (model / WEIGHTS).is_file():
        raise ValueError(f"no {WEIGHTS} + config.json checkpoint at {model}")
    config = json.loads(path.read_text())
    if config.get("model_type") != "qwen3_moe" or "moe_intermediate_size" not in config:
        raise ValueError(f"{path} is not a Qwen3-MoE config (model_type {config.get('model_type')!r})")
    return config


def pad_expert(name: str, weight: torch.Tensor, width: int) -> torch.Tensor:
    """``gate/up_proj`` [I, H] -> [W, H] (zero rows); ``down_proj`` [H, I] -> [H, W] (zero columns)."""
    if name.endswith("down_proj.weight"):
        out = weight.new_zeros(weight.shape[0], width)
        out[:, : weight.shape[1]] = weight
    else:
        out = weight.new_zeros(width, weight.shape[1])
        out[: weight.shape[0]] = weight
    return out


def widen_experts(tensors: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """Every routed expert's FFN zero-padded to ``width``; other tensors unchanged."""
    out = {}
    for name, w in tensors.items():
        out[name] = pad_expert(name, w, width) if EXPERT_KEY.search(name) else w
    if not any(EXPERT_KEY.search(n) for n in tensors):
        raise ValueError("no per-expert gate_proj/up_proj/down_proj weights found")
    return out


def expert_bytes(config: dict, width: int, dtype_bytes: int = 2) -> int:
    """Bytes of all routed expert weights at expert width ``width``."""
    experts = config.get("num_experts", config.get("num_local_experts"))
    return 3 * config["hidden_size"] * width * experts * config["num_hidden_layers"] * dtype_bytes


def build(model: Path, out: Path, width: int) -> dict:
    """Write the fat copy of ``model`` to ``out``; return its provenance record."""
    config = read_config(model)
    started = time.perf_counter()
    tensors = widen_experts(load_file(str(model / WEIGHTS)), width)
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():  # tokenizer, generation config, calibration artifacts ...
        if f.is_file() and f.name not in (WEIGHTS, "config.json"):
            shutil.copy2(f, out / f.name)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": width}, indent=2) + "\n")
    record = {"source": str(model), "original_moe_intermediate_size": config["moe_intermediate_size"],
              "moe_intermediate_size": width, "expert_weight_bytes": expert_bytes(config, width),
              "per_expert_layer_bytes": expert_bytes(config, width) // (
                  config.get("num_experts", config.get("num_local_experts")) * config["num_hidden_layers"]),
              "build_s": round(time.perf_counter() - started, 2)}
    (out / "fat_expert.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rec = build(args.model, args.out, args.width)
    print(f"{args.out}: expert FFN {rec['original_moe_intermediate_size']} -> {rec['moe_intermediate_size']}, "
          f"expert weights {rec['expert_weight_bytes'] / 2**20:.0f} MiB "
          f"({rec['per_expert_layer_bytes'] / 2**20:.2f} MiB per expert per layer), {rec['build_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
