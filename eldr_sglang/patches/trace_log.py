"""Trace mode (``--eldr-trace-dir``): the prefill-side expert counts of every
request, one JSON line each, in ``<dir>/prefill-<pid>.jsonl``.

Lines carry the same fields as the signature message (rid, bootstrap_room,
prompt_tokens, cached_tokens, layers, counts). Writes happen on a daemon
thread; the scheduler only enqueues.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from pathlib import Path


class PrefillTraceLog:
    def __init__(self, directory: str):
        self.path = Path(directory) / f"prefill-{os.getpid()}.jsonl"
        self.queue: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._run, name="eldr-trace", daemon=True).start()

    def prefill(self, message: dict) -> None:
        self.queue.put_nowait(message)

    def _run(self) -> None:
        with open(self.path, "a", buffering=1) as f:
            while True:
                f.write(json.dumps(self.queue.get()) + "\n")
