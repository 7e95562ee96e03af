"""The prompt work of routers that choose before prefill (tokenising, chat templates,
prediction), off the event loop and bounded.

It runs on one worker thread: the view it works on is bounded
(:mod:`~eldr_sglang.router.http.prompt_view`), and the Rust tokenizer and numpy let the
event loop run between their steps (the GIL is handed over every few milliseconds).
At most ``max_queued`` requests wait for it; the next one is refused at once with
503 and Retry-After instead of queueing without end."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, Optional

from eldr_sglang.router.http.bodies import BodyError

MAX_QUEUED = 64


class PromptWork:
    """``await run(fn, *args)``: ``fn(*args)`` on the prompt thread; BodyError (503)
    when ``max_queued`` calls already wait."""

    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self.max_queued = max_queued
        self.pending = 0
        self.refused = 0
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.pending >= self.max_queued:
            self.refused += 1
            raise BodyError(f"router busy: {self.pending} prompts wait to be tokenised; retry", 503)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eldr-prompt")
        loop = asyncio.get_running_loop()
        self.pending += 1  # until the work itself ends (a caller that gave up does not free it)
        job = self._executor.submit(fn, *args)
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        return await asyncio.wrap_future(job)

    def _done(self) -> None:
        self.pending -= 1

    def describe(self) -> dict:
        return {"pending": self.pending, "max_queued": self.max_queued, "refused": self.refused}

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
