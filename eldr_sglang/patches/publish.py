"""Send signature messages to the router from a daemon thread.

The scheduler only does ``queue.put_nowait`` (microseconds); the thread
batches whatever is queued into one ``POST`` (a JSON list) to the router's
``/eldr/signature`` endpoint. A router that is down costs dropped messages
(counted, logged once a minute), never a blocked scheduler: the router then
falls back to least-loaded routing for those requests.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.request

logger = logging.getLogger("eldr_sglang.publish")


class SignaturePublisher:
    def __init__(self, url: str, timeout: float = 2.0, max_batch: int = 64, max_queue: int = 10_000):
        self.url = url
        self.timeout = timeout
        self.max_batch = max_batch
        self.queue: queue.Queue[dict] = queue.Queue(max_queue)
        self.sent = 0
        self.dropped = 0
        self.errors = 0
        self._last_error_log = 0.0
        self._thread = threading.Thread(target=self._run, name="eldr-publisher", daemon=True)
        self._thread.start()

    def submit(self, message: dict) -> None:
        try:
            self.queue.put_nowait(message)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._post(batch)

    def _post(self, batch: list[dict]) -> None:
        body = json.dumps(batch).encode()
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                resp.read()
            self.sent += len(batch)
        except Exception as exc:
            self.errors += 1
            self.dropped += len(batch)
            now = time.monotonic()
            if now - self._last_error_log > 60:
                self._last_error_log = now
                logger.warning("eldr-sglang: could not publish %d signature(s) to %s: %s",
                               len(batch), self.url, exc)
