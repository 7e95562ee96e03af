"""The static staging buffer that the in-graph capture writes.

``ExpertStage`` holds one forward's top-k ids, ``[capacity rows, layers, top_k]``
small ints, in the row order the MoE layers see them (the gathered rows under
attention data parallelism). It is allocated once, before SGLang captures its
CUDA graphs, and never reallocated: a graph bakes its address in.

:meth:`ExpertStage.write` is the only code that runs inside a forward (and so
inside a captured graph): one slice copy whose extent depends on tensor shapes
only, never on tensor values, and that reads nothing of the live batch. Which
of those rows belong to which KV slot is decided after the forward, eagerly
(:mod:`eldr_sglang.patches.after_forward`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def id_dtype(num_ids: int) -> torch.dtype:
    """The smallest dtype holding expert ids ``0 .. num_ids - 1``."""
    return torch.uint8 if num_ids <= 256 else torch.int16


class ExpertStage:
    """One forward's top-k ids of the staged layers: ``[rows, len(layers), top_k]``."""

    def __init__(self, rows: int, layers: Sequence[int], num_ids: int, top_k: int,
                 device: torch.device | str = "cpu"):
        if rows <= 0 or top_k <= 0 or num_ids <= 0 or not layers:
            raise ValueError(f"staging needs rows, layers, ids and top_k > 0 "
                             f"(rows={rows}, layers={list(layers)}, num_ids={num_ids}, top_k={top_k})")
        self.layers = list(layers)
        self.num_ids = num_ids
        self.top_k = top_k
        self.buf = torch.zeros((rows, len(self.layers), top_k), dtype=id_dtype(num_ids), device=device)
        self._column = {layer: i for i, layer in enumerate(self.layers)}

    @property
    def rows(self) -> int:
        return self.buf.shape[0]

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    def column(self, layer_id: int) -> int | None:
        return self._column.get(layer_id)

    def write(self, layer_id: int, topk_ids: torch.Tensor, offset: int = 0) -> int:
        """Copy one layer's ids of ``topk_ids`` (``[rows, >= top_k]``) into rows
        ``offset ..``; rows beyond the capacity are left out. Returns the number of
        rows the call covers (written or not), a function of shapes only."""
        col = self._column.get(layer_id)
        rows = topk_ids.shape[0]
        if col is None:
            return rows
        n = max(0, min(rows, self.rows - offset))
        if n:
            self.buf[offset:offset + n, col].copy_(topk_ids[:n, : self.top_k])
        return rows


def scatter_rows(table_ids: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                 columns: torch.Tensor | None = None) -> None:
    """After the forward: ``table_ids[slots] = rows`` (``rows``: ``[n, staged layers, >= k]``
    ids of the live tokens; ``columns``: the staged column of each table layer, None
    when the table holds the staged layers themselves)."""
    if rows.shape[0] == 0:
        return
    if columns is not None:
        rows = rows.index_select(1, columns)
    table_ids[slots[: rows.shape[0]].long()] = rows[:, :, : table_ids.shape[2]].to(table_ids.dtype)


def mark_distinct(hits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """After a decode step: ``hits[layer, expert]`` set for every expert ``ids``
    (``[n, layers, k]``) names; ``hits`` has one column more than there are experts,
    where invalid ids (padding, -1) land. Returns the distinct experts summed over
    layers (a device scalar: no host sync)."""
    num_experts = hits.shape[1] - 1
    hits.zero_()
    if ids.shape[0]:
        n, n_layers, k = ids.shape
        cols = ids.long().permute(1, 0, 2).reshape(n_layers, n * k)
        cols = torch.where((cols >= 0) & (cols < num_experts), cols, num_experts)
        hits.scatter_(1, cols, True)
    return hits[:, :num_experts].sum()
