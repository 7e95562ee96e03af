"""Trace mode (``--eldr-trace-dir``): JSON lines per server process.

* ``prefill-<pid>.jsonl`` (PD prefill servers): the signature message fields
  (rid, bootstrap_room, prompt_tokens, cached_tokens, layers, counts) plus
  ``gate_prob_sums`` and ``gate_logit_sums`` [L, E] over the request's newly
  computed prompt tokens;
* ``decode-<pid>.jsonl`` (decode servers): rid, bootstrap_room, prompt_tokens,
  output_tokens, ``decode_counts`` [L, E];
* ``steps-<pid>.jsonl`` (decode servers): batch size, distinct experts per
  layer and the forward call's host time (``forward_ms``) of every decode step.

``python -m eldr_sglang.collect_traces`` joins them by rid into the calibration
core's trace shards. Writes happen on a daemon thread; the scheduler only
enqueues.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from eldr_sglang.patches.messages import signature_message
from eldr_sglang.radix_signature import request_counts

if TYPE_CHECKING:
    from eldr_sglang.patches.state import CaptureState

KINDS = ("prefill", "decode", "steps")


class TraceLog:
    def __init__(self, directory: str):
        self.directory = Path(directory)
        self.queue: queue.Queue[tuple[str, dict]] = queue.Queue()
        threading.Thread(target=self._run, name="eldr-trace", daemon=True).start()

    def write(self, kind: str, record: dict) -> None:
        self.queue.put_nowait((kind, record))

    def _run(self) -> None:
        files = {k: open(self.directory / f"{k}-{os.getpid()}.jsonl", "a", buffering=1) for k in KINDS}
        while True:
            kind, record = self.queue.get()
            files[kind].write(json.dumps(record) + "\n")


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
