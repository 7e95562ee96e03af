"""Trace mode's per-request records, from the plugin's state: a prefill's expert
counts and gate sums (written through its :class:`~eldr_sglang.patches.trace_log.TraceLog`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from eldr_sglang.patches.messages import signature_message
from eldr_sglang.radix_signature import request_counts

if TYPE_CHECKING:
    from eldr_sglang.patches.state import CaptureState


def clear_gate_sums(state: "CaptureState", row: int) -> None:
    """Zero a request-pool row's gate sums (its next request starts at 0)."""
    if state.gate_prob is not None:
        state.gate_prob[row] = 0
        state.gate_logit[row] = 0


def colocated(state: "CaptureState") -> bool:
    """A server that prefills and decodes (no PD disaggregation)."""
    mode = getattr(getattr(state.scheduler, "disaggregation_mode", None), "value", "null")
    return state.scheduler is not None and mode == "null"


def write_prefill_trace(state: "CaptureState", req, scheduler, counts: torch.Tensor | None = None) -> None:
    """Trace mode: the prompt's expert counts (every layer) and gate sums; clears the row."""
    if counts is None:
        counts = request_counts(scheduler.req_to_token_pool, req, state.table)
    row = req.kv.req_pool_idx
    state.trace_writer.write("prefill", {
        **signature_message(req, counts, state.table.layers), "gate_prob_sums": state.gate_prob[row].cpu().tolist(),
        "gate_logit_sums": state.gate_logit[row].cpu().tolist()})
    clear_gate_sums(state, row)
