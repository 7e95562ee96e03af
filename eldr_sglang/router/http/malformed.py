"""Malformed client requests (a NUL, DEL or bare CR in a header, a header line over
aiohttp's limit, a broken request line) logged as one WARNING line naming the peer and
the reason, at most one per :data:`WINDOW_S` (with the count of those held back), never
an ERROR with a traceback per bad request. aiohttp answers them 400 itself."""

from __future__ import annotations

import logging
import time

from aiohttp.http_exceptions import HttpProcessingError

WINDOW_S = 10.0


class MalformedRequests(logging.Filter):
    """On the router's HTTP server logger: a parse error's record becomes a WARNING
    line (or is held back within the window); every other record passes unchanged."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        super().__init__()
        self.window_s = window_s
        self.seen = 0  # malformed requests, all of them
        self._held = 0
        self._last = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.seen += 1
        now = time.monotonic()
        if now - self._last < self.window_s:
            self._held += 1
            return False
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        reason = " ".join(str(getattr(exc, "message", "") or exc).split())[:200]
        held, self._held, self._last = self._held, 0, now
        record.msg = "malformed request from %s answered 400: %s%s"
        record.args = (peer, reason, f" ({held} more in the last {self.window_s:g} s)" if held else "")
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True


def server_logger() -> logging.Logger:
    """The logger a router's HTTP server reports through (``eldr_sglang.router.http``)."""
    log = logging.getLogger("eldr_sglang.router.http")
    if not any(isinstance(f, MalformedRequests) for f in log.filters):
        log.addFilter(MalformedRequests())
    return log
