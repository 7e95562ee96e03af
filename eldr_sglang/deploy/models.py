"""The MoE dimensions of a description's ``model_path``: its ``config.json`` when the
folder is readable here, else the published dimensions of well-known models by name."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from eldr_sglang.core.traces import ModelSpec

# name prefix (lower case, as in Hugging Face ids) -> (layers, routed experts, top-k)
KNOWN_MODELS = {
    "qwen3-30b-a3b": (48, 128, 8),
    "qwen3-coder-30b-a3b": (48, 128, 8),
    "qwen3-235b-a22b": (94, 128, 8),
    "qwen3-coder-480b-a35b": (62, 160, 8),
    "deepseek-v3": (61, 256, 8),
    "deepseek-r1": (61, 256, 8),
    "mixtral-8x7b": (32, 8, 2),
    "mixtral-8x22b": (56, 8, 2),
}


def target_model(model_path: str) -> ModelSpec | None:
    """The model's identity, or None when neither its config nor its name tells."""
    config = Path(model_path) / "config.json"
    name = PurePosixPath(model_path.rstrip("/")).name
    if config.is_file():
        try:
            return ModelSpec.from_hf_config(json.loads(config.read_text()), name)
        except (OSError, ValueError):
            return None
    lower = name.lower()
    for prefix, (layers, experts, top_k) in sorted(KNOWN_MODELS.items(), key=lambda kv: -len(kv[0])):
        if lower.startswith(prefix):
            return ModelSpec(name, layers, experts, top_k)
    return None
