"""Where each attention-DP rank's tokens sit in the rows the MoE layers see.

Without attention data parallelism the MoE rows are this rank's tokens, in
``out_cache_loc`` order. With it, the MoE layers run on the tokens of every DP
rank gathered into one buffer, rank after rank, each rank's block padded:

* eager forwards and the prefill graph: block widths are
  ``global_num_tokens_padded_cpu`` (set by ``prepare_mlp_sync_batch``: the
  max-length layout pads every rank to the same width, the sum-length layout
  keeps each rank's own count);
* a decode graph replay: every block is the graph's batch size (the decode
  runner pads each rank to it).

Each block starts with the rank's live tokens (``global_num_tokens_cpu``); the
rest is padding. Everything here reads host-side lists of the live batch, after
the forward: nothing runs inside a graph.
"""

from __future__ import annotations

from typing import NamedTuple


class RowBlock(NamedTuple):
    start: int  # first row of the rank's block
    live: int  # its live tokens (rows start .. start + live)


def live_slots(forward_batch):
    """The live batch's KV slots, one per token (``out_cache_loc_virtual`` when
    the attention backend rebound ``out_cache_loc`` to physical slots)."""
    slots = getattr(forward_batch, "out_cache_loc_virtual", None)
    return forward_batch.out_cache_loc if slots is None else slots


def rank_blocks(forward_batch, graph_batch: int | None = None) -> list[RowBlock]:
    """One :class:`RowBlock` per attention-DP rank (one block without DP).

    ``graph_batch``: the decode graph's padded batch size when this forward was a
    decode graph replay, else None."""
    n_local = int(live_slots(forward_batch).shape[0])
    live = getattr(forward_batch, "global_num_tokens_cpu", None)
    if not live or len(live) == 1:
        return [RowBlock(0, n_local)]
    live = [int(n) for n in live]
    if graph_batch is not None:
        widths = [int(graph_batch)] * len(live)
    else:
        padded = getattr(forward_batch, "global_num_tokens_padded_cpu", None)
        widths = [int(n) for n in padded] if padded else live
    if len(widths) != len(live):
        raise ValueError(f"DP layout: {len(widths)} block widths for {len(live)} ranks")
    blocks, start = [], 0
    for width, n in zip(widths, live):
        if n > width:
            raise ValueError(f"DP layout: {n} live tokens in a block of {width} rows")
        blocks.append(RowBlock(start, n))
        start += width
    return blocks


def local_block(blocks: list[RowBlock], dp_rank: int, n_slots: int) -> RowBlock:
    """This rank's block, its live count capped at its KV slots."""
    if len(blocks) == 1:
        return RowBlock(blocks[0].start, min(blocks[0].live, n_slots))
    if not 0 <= dp_rank < len(blocks):
        raise ValueError(f"DP rank {dp_rank} outside the {len(blocks)} gathered blocks")
    block = blocks[dp_rank]
    return RowBlock(block.start, min(block.live, n_slots))


def dp_rank() -> int:
    """This process's block in the DP gather (0 without attention DP)."""
    try:
        from sglang.srt.layers.dp_attention import dp_gather_slot, is_dp_attention_enabled

        return int(dp_gather_slot()) if is_dp_attention_enabled() else 0
    except Exception:
        return 0
