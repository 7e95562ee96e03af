"""The router's read-only HTTP answers about its workers: liveness and readiness,
and what SGLang's own routes tell (``/health_generate``, ``/server_info``,
``/model_info``, ``/v1/models``), asked of the workers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.http.responses import JSON, error_response, json_response
from eldr_sglang.router.runtime import Runtime
from eldr_sglang.router.pool.workers import Worker, WorkerPool

logger = logging.getLogger("eldr_sglang.router")


class InfoApi:
    def __init__(self, config: RouterConfig, pool: WorkerPool, runtime: Runtime) -> None:
        self.config, self.pool, self.runtime = config, pool, runtime

    async def fan_out(self, path: str, method: str = "GET") -> list[tuple[Worker, int, Any]]:
        """``method path`` on every worker: (worker, status or 0, JSON or text or error)."""
        session = self.runtime.session

        async def one(s: Worker):
            try:
                async with session.request(method, s.endpoint(path),
                                           timeout=aiohttp.ClientTimeout(total=30)) as r:
                    raw = await r.read()
                    try:
                        return s, r.status, orjson.loads(raw) if raw else None
                    except orjson.JSONDecodeError:
                        return s, r.status, raw.decode("utf-8", "replace")
            except Exception as e:  # noqa: BLE001
                return s, 0, repr(e)
        return await asyncio.gather(*(one(s) for s in self.pool.all()))

    async def h_health(self, request: web.Request) -> web.Response:
        if self.runtime.draining:
            return error_response(503, "router is draining")
        return web.Response(status=200)

    def readiness(self) -> dict:
        """Ready = not draining and at least one healthy server of each role."""
        roles, draining = self.pool.roles(), self.runtime.draining
        healthy = {role: sum(w.available() for w in ws) for role, ws in roles.items()}
        ready = not draining and all(healthy.values())
        return {"ready": ready, "draining": draining, "healthy": healthy,
                "servers": {role: len(ws) for role, ws in roles.items()}}

    async def h_ready(self, request: web.Request) -> web.Response:
        """Readiness for load balancers: 200 when requests can be served, else 503."""
        state = self.readiness()
        return json_response(state, 200 if state["ready"] else 503)

    async def h_health_generate(self, request: web.Request) -> web.Response:
        res = await self.fan_out("health_generate")
        bad = {s.url: st for s, st, _ in res if st != 200}
        return json_response({"unhealthy": bad}, 503) if bad else web.Response(status=200)

    async def h_server_info(self, request: web.Request) -> web.Response:
        res = await self.fan_out("get_server_info")
        prefill = [b for s, _, b in res if s.role == "prefill"]
        decode = [b for s, _, b in res if s.role != "prefill"]
        states = [x for b in decode if isinstance(b, dict) for x in b.get("internal_states", [])]
        return json_response({
            "internal_states": states or [{"last_gen_throughput": 0.0,
                                           "avg_spec_accept_length": None}],
            "prefill": prefill, "decode": decode})

    async def _proxy_healthy(self, path: str) -> web.Response:
        """``GET path`` from the first healthy worker that answers 200 (prefills first)."""
        pool = self.pool
        workers = [w for w in pool.prefills + pool.decodes if w.available()]
        last = None
        for s in workers:
            try:
                async with self.runtime.session.get(s.endpoint(path),
                                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
                    data = await r.read()
                    if r.status == 200:
                        return web.Response(body=data, status=200, content_type=JSON)
                    last = f"answered HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"unreachable ({type(e).__name__})"
            logger.warning("%s %s/%s %s", s.role, s.url, path, last)
        if last is None:
            return error_response(503, "no healthy worker", self.config.retry_after)
        return error_response(502, f"no healthy worker answered /{path}: last one {last}")

    async def h_model_info(self, request: web.Request) -> web.Response:
        return await self._proxy_healthy("model_info")

    async def h_models(self, request: web.Request) -> web.Response:
        return await self._proxy_healthy("v1/models")
