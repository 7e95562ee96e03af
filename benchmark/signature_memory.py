"""Memory of the KV-slot expert-id table as a fraction of the KV cache, per GPU.

Per token the table stores top-k expert ids (1 byte each when experts <= 256)
for the selected layers only; the KV cache stores K and V for every layer.
The fixture row is measured from a real ExpertSlotTable; the others are
arithmetic from the models' published configs (bf16 KV cache).

Under tensor parallelism the KV cache is split: each GPU holds
``max(1, kv_heads / attention_tp)`` KV heads of every layer (replicated when there
are fewer heads than ranks; with attention data parallelism, attention TP is
TP / DP). The table lives only on the first rank of each attention group (the one
that publishes), so the share below is that GPU's: its table bytes over its KV
bytes per token; the other ranks hold none.

    python -m benchmark.signature_memory
"""

from __future__ import annotations

import argparse

from benchmark.common import parse_with_quick
from eldr_sglang.radix_signature import ExpertSlotTable, kv_bytes_per_token

MODELS = {  # name: (layers, kv_heads, head_dim, experts, top_k)
    "tiny-qwen3-moe (fixture)": (4, 2, 32, 16, 4),
    "Qwen3-30B-A3B": (48, 4, 128, 128, 8),
    "Qwen3-235B-A22B": (94, 4, 128, 128, 8),
}
# the deploy presets: (model, TP, attention DP)
PRESETS = {
    "qwen3-30b-a3b-8p16d-mi300x (TP1)": ("Qwen3-30B-A3B", 1, 1),
    "qwen3-235b-a22b-tp4ep4-mi300x (TP4, EP4, DP attention 4)": ("Qwen3-235B-A22B", 4, 4),
    "Qwen3-235B-A22B TP4 without DP attention": ("Qwen3-235B-A22B", 4, 1),
}


def per_gpu_kv_bytes(layers: int, kv_heads: int, head_dim: int, tp: int, attn_dp: int) -> int:
    """KV bytes per token on one GPU (bf16)."""
    attn_tp = max(1, tp // attn_dp)
    heads = max(1, kv_heads // attn_tp)
    return kv_bytes_per_token(layers, heads, head_dim)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parse_with_quick(ap, argv)  # arithmetic only: the full table is already a smoke run
    print(f"{'model':26} {'selected layers':>16} {'B/token ids':>12} {'B/token KV':>11} {'fraction':>9}")
    for name, (layers, kv_heads, head_dim, experts, top_k) in MODELS.items():
        for n_sel in sorted({2, 4, 8, 12, layers}):
            if n_sel > layers:
                continue
            table = ExpertSlotTable(1, list(range(n_sel)), experts, top_k)
            kv = kv_bytes_per_token(layers, kv_heads, head_dim)
            frac = table.bytes_per_token / kv
            print(f"{name:26} {n_sel:>16} {table.bytes_per_token:>12} {kv:>11} {100 * frac:>8.3f}%")
    print("\nper GPU under the presets' parallelism (4 selected layers; the table on the publishing rank only):")
    print(f"{'preset':58} {'KV B/token/GPU':>15} {'ids B/token':>12} {'share':>8}")
    for preset, (model, tp, dp) in PRESETS.items():
        layers, kv_heads, head_dim, experts, top_k = MODELS[model]
        kv = per_gpu_kv_bytes(layers, kv_heads, head_dim, tp, dp)
        ids = ExpertSlotTable(1, list(range(4)), experts, top_k).bytes_per_token
        print(f"{preset:58} {kv:>15} {ids:>12} {100 * ids / kv:>7.3f}%")


if __name__ == "__main__":
    main()
