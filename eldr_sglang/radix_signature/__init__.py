"""Per-token expert ids that live as long as their KV cache entries.

``ExpertSlotTable`` is a side table indexed by KV-cache slot: row ``s`` holds
the top-k expert ids (selected layers only, as small integers) of the token
whose key/value sit in KV slot ``s``. RadixAttention tree nodes store their
tokens' KV slot indices (``TreeNode.value``), so a node's expert ids are
``table[node.value]``: splitting a node slices ``value`` and therefore the ids,
evicting a node frees its slots and the next prefill that reuses a slot
overwrites its row. A prefix-cache hit thus reconstitutes the full-prompt
signature from ``table[req_to_token[req, :prompt_len]]``: cached rows written
when those tokens were first computed, new rows written by this forward.
Nothing in the tree changes, so it works with every radix cache backend
SGLang ships (the Rust unified core included) and with chunked prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ExpertSlotTable:
    """Expert ids per KV slot: ``[num_slots, num_layers, top_k]`` small ints."""

    def __init__(self, num_slots: int, layers: Sequence[int], num_experts: int, top_k: int,
                 device: torch.device | str = "cpu"):
        self.layers = list(layers)
        self.num_experts = num_experts
        self.top_k = top_k
        dtype = torch.uint8 if num_experts <= 256 else torch.int16
        self.ids = torch.zeros((num_slots, len(self.layers), top_k), dtype=dtype, device=device)
        self._column = {layer: i for i, layer in enumerate(self.layers)}

    def column(self, layer_id: int) -> int | None:
        return self._column.get(layer_id)

    @property
    def bytes_per_token(self) -> int:
        return self.ids[0].numel() * self.ids.element_size()

    def write(self, slots: torch.Tensor, layer_id: int, topk_ids: torch.Tensor) -> bool:
        """Store one layer's top-k ids for the tokens in ``slots`` (no host sync)."""
        col = self._column.get(layer_id)
        if col is None or topk_ids.shape[0] != slots.shape[0]:
            return False
        self.ids[slots, col] = topk_ids[:, : self.top_k].to(self.ids.dtype)
        return True

    def counts(self, slots: torch.Tensor) -> torch.Tensor:
        """Per-layer expert counts ``[num_layers, num_experts]`` over ``slots``."""
        n_layers, n_exp = len(self.layers), self.num_experts
        ids = self.ids[slots.long()].long()  # [T, L, k]
        offsets = torch.arange(n_layers, device=ids.device).view(1, -1, 1) * n_exp
        flat = (ids + offsets).flatten()
        return torch.bincount(flat, minlength=n_layers * n_exp).view(n_layers, n_exp)


def request_counts(req_to_token_pool, req, table: ExpertSlotTable) -> torch.Tensor:
    """Expert counts ``[num_layers, num_experts]`` over every prompt token of ``req``
    (cached + computed): its KV slots are ``req_to_token[req's row, :prompt length]``."""
    n = len(req.origin_input_ids)
    slots = req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n]
    return table.counts(slots)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_bytes: int = 2) -> int:
    """K and V of every layer for one token."""
    return num_layers * 2 * num_kv_heads * head_dim * kv_bytes


def kv_cache_fraction(bytes_per_token_ids: int, num_layers: int, num_kv_heads: int, head_dim: int,
                      kv_bytes: int = 2) -> float:
    """Expert-id bytes per token as a fraction of the KV-cache bytes per token."""
    return bytes_per_token_ids / kv_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_bytes)
