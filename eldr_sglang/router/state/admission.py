"""Client requests being served, for both request flows: the in-flight limit (429),
the drain gate (503) and the idle event a drain waits on."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from aiohttp import web

from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.http.responses import error_response
from eldr_sglang.router.runtime import Runtime

logger = logging.getLogger("eldr_sglang.router")


class Admission:
    """``refusal()`` -> None or the 503/429 answer; ``enter()``/``leave()`` around
    every admitted request; ``drain(timeout)`` closes the gate and waits for idle.
    The in-flight gauge is set when ``/metrics`` is scraped, not per request."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, runtime: Runtime) -> None:
        self.config, self.metrics, self.runtime = config, metrics, runtime
        self.limit = config.inflight_limit
        self.active = 0  # client requests being served
        self.idle = asyncio.Event()
        self.idle.set()

    def refusal(self) -> Optional[web.Response]:
        """503 while draining, 429 at the in-flight limit; None: may enter."""
        if self.runtime.draining:
            self.metrics.event("refused_draining")
            return error_response(503, "router is draining (shutting down); retry elsewhere",
                                  self.config.retry_after)
        if self.active >= self.limit:
            self.metrics.overloaded.inc()
            return error_response(429, f"router at its in-flight limit ({self.limit} requests); "
                                  "retry later", self.config.retry_after)
        return None

    def enter(self) -> None:
        self.active += 1
        self.idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.idle.set()

    def bind_loop(self) -> None:
        """A fresh idle event on the serving loop (the router may be built outside it)."""
        self.idle = asyncio.Event()
        if self.active == 0:
            self.idle.set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new work (503), wait for in-flight requests; True if all finished."""
        self.runtime.draining = True
        self.metrics.draining.set(1)
        logger.warning("draining: %d request(s) in flight, up to %.1fs", self.active, timeout)
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            logger.warning("drain timeout: %d request(s) still in flight", self.active)
            return False
