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
enqueues (the records come from :mod:`~eldr_sglang.patches.trace_records`).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from pathlib import Path

KINDS = ("prefill", "decode", "steps")


class TraceLog:
    def __init__(self, directory: str):
        self.directory = Path(directory)
        self.queue: queue.Queue[tuple[str, dict]] = queue.Queue()
        threading.Thread(target=self._run, name="eldr-trace", daemon=True).start()

    def write(self, kind: str, record: dict) -> None:
        self.queue.put_nowait((kind, record))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every record written so far is in its file (True), at most ``timeout`` s (False)."""
        q = self.queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    def _run(self) -> None:
        files = {k: open(self.directory / f"{k}-{os.getpid()}.jsonl", "a", buffering=1) for k in KINDS}
        while True:
            kind, record = self.queue.get()
            try:
                files[kind].write(json.dumps(record) + "\n")  # line-buffered: in the file once written
            finally:
                self.queue.task_done()

