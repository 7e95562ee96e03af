"""What the capture does after each forward, eagerly, from the live batch.

Inside the forward (graphed or not) the ``select_experts`` hook only copies top-k
ids into the static staging buffer (:mod:`eldr_sglang.radix_signature.staging`).
Everything that needs the live batch runs here, AROUND ``ModelRunner.forward``
after the original returned (where SGLang's own routed-experts capturer reads its
buffer): which staged rows are this rank's tokens (:mod:`.dp_rows`), the KV slots
they go to, physical -> logical ids under EPLB, decode statistics and trace-mode
per-request decode counts. Nothing here waits for the device.
"""

from __future__ import annotations

import logging

import torch

from eldr_sglang.patches.dp_rows import RowBlock, dp_rank, live_slots, local_block, rank_blocks
from eldr_sglang.patches.state import CaptureState
from eldr_sglang.radix_signature.staging import mark_distinct, scatter_rows

logger = logging.getLogger("eldr_sglang.capture")


def graph_batch(model_runner, forward_batch, output) -> int | None:
    """The decode graph's padded batch size when this forward replayed it."""
    if not (forward_batch.forward_mode.is_decode() and getattr(output, "can_run_graph", False)):
        return None
    bs = getattr(getattr(model_runner, "decode_cuda_graph_runner", None), "bs", None)
    return int(bs) if bs else None


def staged_rows(state: CaptureState, block: RowBlock) -> torch.Tensor:
    """The staged ids of one block's live rows ``[n, layers, k]`` as logical ids
    (int64); rows beyond the staging capacity are left out, logged once."""
    stage = state.stage
    end = min(block.start + block.live, stage.rows)
    if end < block.start + block.live and not state.capacity_logged:
        state.capacity_logged = True
        logger.warning("eldr-sglang: a forward had %d MoE rows, more than the %d staged; the rows beyond "
                       "are not captured (their signatures undercount)", block.start + block.live, stage.rows)
    ids = stage.buf[block.start:max(block.start, end)].long()
    if state.physical_ids:
        ids = physical_to_logical(ids, stage.layers, stage.num_ids)
    return ids


def physical_to_logical(ids: torch.Tensor, layers: list[int], num_ids: int) -> torch.Tensor:
    """Map physical expert slots ``[n, layers, k]`` back to logical experts with the
    live expert-location metadata (a rebalance replaces it); invalid ids stay."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    meta = get_global_expert_location_metadata()
    if meta is None or ids.numel() == 0:
        return ids
    p2l = meta.physical_to_logical_map.to(ids.device)[torch.tensor(layers, device=ids.device)].long()  # [L, P]
    n, n_layers, k = ids.shape
    flat = ids.permute(1, 0, 2).reshape(n_layers, n * k)
    valid = (flat >= 0) & (flat < min(num_ids, p2l.shape[1]))
    mapped = p2l.gather(1, flat.clamp(min=0, max=p2l.shape[1] - 1))
    return torch.where(valid, mapped, flat).reshape(n_layers, n, k).permute(1, 0, 2)


def add_decode_step(state: CaptureState, ids: torch.Tensor) -> torch.Tensor:
    """Distinct experts per layer of one decode step over ``ids`` ``[n, L, k]``
    (every layer staged): into ``decode.active`` and the running total; returns the
    step's distinct experts (a device scalar)."""
    unique = mark_distinct(state.decode.hits, ids)
    state.decode.unique_total += unique
    return unique


def add_decode_counts(state: CaptureState, forward_batch, ids: torch.Tensor) -> None:
    """Trace mode: each request's decode expert counts ``decode_acc[row, layer, expert]``."""
    n, n_layers, k = ids.shape
    if n == 0:
        return
    num_experts = state.decode_acc.shape[2]
    rows = forward_batch.req_pool_indices[:n].long().view(n, 1, 1).expand(n, n_layers, k)
    layer = torch.arange(n_layers, device=ids.device).view(1, n_layers, 1).expand(n, n_layers, k)
    valid = (ids >= 0) & (ids < num_experts)
    state.decode_acc.index_put_((rows.flatten(), layer.flatten(), torch.where(valid, ids, 0).flatten()),
                                valid.to(torch.int32).flatten(), accumulate=True)


def after_forward(state: CaptureState, model_runner, forward_batch, output, timer=None) -> None:
    """Scatter this forward's staged ids by the live KV slots; decode statistics (and the
    batch report, timed by ``timer`` from ``BatchReport.timer`` before the forward)."""
    if not state.ready or state.stage is None:
        return
    mode = forward_batch.forward_mode
    decode = mode.is_decode()
    if not (decode or mode.is_extend()):
        return  # idle and dummy forwards: no tokens of this rank
    slots = live_slots(forward_batch)
    blocks = rank_blocks(forward_batch, graph_batch(model_runner, forward_batch, output))
    mine = local_block(blocks, dp_rank(), int(slots.shape[0]))
    if state.table is not None or state.decode_acc is not None:
        ids = staged_rows(state, mine)
        if state.table is not None:
            scatter_rows(state.table.ids, slots, ids, state.table_columns)
        if decode and state.decode_acc is not None:
            add_decode_counts(state, forward_batch, ids)
    if decode and state.decode.hits is not None:
        every = [staged_rows(state, b) for b in blocks]  # the MoE layers ran on every rank's tokens
        ids = every[0] if len(every) == 1 else torch.cat(every)
        unique = add_decode_step(state, ids)
        state.decode.steps += 1
        state.decode.tokens += int(ids.shape[0])
        if state.decode.report is not None and timer is not None:
            kv = getattr(forward_batch, "seq_lens_sum", None)
            state.decode.report.step(state.decode.active, unique, int(ids.shape[0]), int(kv or 0), timer)
