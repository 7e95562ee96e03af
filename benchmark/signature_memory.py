"""Memory of the KV-slot expert-id table as a fraction of the KV cache.

Per token the table stores top-k expert ids (1 byte each when experts <= 256)
for the selected layers only; the KV cache stores K and V for every layer.
The fixture row is measured from a real ExpertSlotTable; the others are
arithmetic from the models' published configs (bf16 KV cache).

    python benchmark/signature_memory.py
"""

from __future__ import annotations

from eldr_sglang.radix_signature import ExpertSlotTable, kv_bytes_per_token

MODELS = {  # name: (layers, kv_heads, head_dim, experts, top_k)
    "tiny-qwen3-moe (fixture)": (4, 2, 32, 16, 4),
    "Qwen3-30B-A3B": (48, 4, 128, 128, 8),
    "Qwen3-235B-A22B": (94, 4, 128, 128, 8),
}


def main() -> None:
    print(f"{'model':26} {'selected layers':>16} {'B/token ids':>12} {'B/token KV':>11} {'fraction':>9}")
    for name, (layers, kv_heads, head_dim, experts, top_k) in MODELS.items():
        for n_sel in sorted({2, 4, 8, 12, layers}):
            if n_sel > layers:
                continue
            table = ExpertSlotTable(1, list(range(n_sel)), experts, top_k)
            kv = kv_bytes_per_token(layers, kv_heads, head_dim)
            frac = table.bytes_per_token / kv
            print(f"{name:26} {n_sel:>16} {table.bytes_per_token:>12} {kv:>11} {100 * frac:>8.3f}%")


if __name__ == "__main__":
    main()
