"""Co-located mode: whole requests across plain (non-PD) SGLang servers, routed by the
signature predicted from the prompt.

    python -m eldr_sglang.router --mode colocated --worker http://s0:30000 --worker http://s1:30000 \\
        --calibration artifact.json [--tokenizer MODEL_DIR] --port 8000

Each request: parse -> token ids (``input_ids`` as sent, else the model's tokenizer;
the chat template for ``/v1/chat/completions``) -> predicted counts (the artifact's
predictor) -> the same policy objects as the PD router choose a server given its
load -> the unchanged body goes there and its answer (streamed or not) is relayed.
A refused connection (the server never saw the request) is retried on the next
choice. No prefill/decode split, so none of late binding's requirements apply.

Metrics: the router's registry (``/metrics``) plus ``eldr_router_route_path_total
{mode="colocated", path}`` (predicted / fallback / blind). ``POST /eldr/score`` ranks
the servers for a prompt without sending it (:mod:`~eldr_sglang.router.scoring`).

The client conventions are the PD router's (same settings, same modules): ``--api-key``
on the work routes, ``/eldr/score`` and the model routes; ``--worker-api-key`` sent to
the servers; the request id header read, forwarded and echoed; OpenAI-shaped errors on
``/v1/*``; the body cap and time limits (``--max-body-mb``, ``--client-body-timeout``,
``--client-header-timeout``); ``--worker-max-connections``; ``/ready`` (a server
available, not draining); ``/eldr/status`` admin only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Optional, Sequence

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from eldr_sglang.core.policies import PolicyContext, build_policy, least_loaded
from eldr_sglang.prompts import Tokenizer, default_tokenizer_path, load_tokenizer
from eldr_sglang.router import sampling, upstream
from eldr_sglang.router.admin import AdminGate
from eldr_sglang.router.bodies import BodyError, BodyParser, read_body, routing_view
from eldr_sglang.router.client_guard import ClientGuards
from eldr_sglang.router.clients import REQUEST_ID_KEY, RequestIds, with_client_conventions, as_openai_error, bearer_matches, unauthorized
from eldr_sglang.router.config import WORKER_KEEPALIVE_S, RouterConfig
from eldr_sglang.router.http_conventions import install as install_conventions
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.responses import JSON, error_response, json_response, worker_error_response
from eldr_sglang.router.scoring import PredictedRouting, ScoreEndpoint, decide, path_counter
from eldr_sglang.router.signatures import load_calibration
from eldr_sglang.router.workers import Worker, WorkerPool

logger = logging.getLogger("eldr_sglang.router")
WORK = {"/generate": "generate", "/v1/completions": "v1/completions",
        "/v1/chat/completions": "v1/chat/completions"}
# what --api-key guards (as the PD router): the work routes, scoring and what tells about the model
KEYED_PATHS = frozenset(WORK) | {"/eldr/score", "/v1/models", "/model_info", "/get_model_info"}


class ColocatedPool(WorkerPool):
    """The worker pool with plain servers only (kept as ``decodes``: each runs whole requests)."""

    def __init__(self, workers: Sequence[str], config: RouterConfig, metrics: RouterMetrics) -> None:
        if not workers:
            raise ValueError("need at least one --worker")
        self.config, self.metrics, self.session = config, metrics, None
        self.prefills: list[Worker] = []
        self.decodes: list[Worker] = []
        self._rr = 0
        for url in workers:
            self._add(self.decodes, "worker", url)


class ColocatedRouter:
    """State and handlers of one co-located router process (serve with ``start_router``)."""

    def __init__(self, workers: Sequence[str], *, artifact: Any = None, tokenizer: Optional[Tokenizer] = None,
                 config: Optional[RouterConfig] = None, **settings: Any) -> None:
        self.config = c = config or RouterConfig.from_dict(settings)
        self.metrics = RouterMetrics()
        self.pool = ColocatedPool(workers, c, self.metrics)
        if artifact is None and c.calibration:
            artifact = load_calibration(c.calibration)
        if tokenizer is None:
            path = getattr(c, "tokenizer", None) or default_tokenizer_path(artifact)
            tokenizer = load_tokenizer(path) if path else None
        self.artifact, self.tokenizer = artifact, tokenizer
        self.predicted = PredictedRouting(artifact, tokenizer)
        centroids = np.asarray(artifact.centroids, dtype=np.float32) if artifact is not None else None
        art_tau = getattr(artifact, "tau", None)
        for line in c.ignored_settings():
            logger.warning("%s", line)
        ctx = PolicyContext(len(self.pool.decodes), seed=c.seed, tau=c.tau, centroids=centroids,
                            artifact_tau=None if art_tau is None else float(art_tau),
                            params=c.policy_params())
        self.policy = build_policy(c.policy, ctx)
        self.tau = getattr(self.policy, "tau", ctx.effective_tau) if centroids is not None else None
        self.paths = path_counter(self.metrics.registry)
        self.body_limit = int(c.max_body_mb * (1 << 20))
        self.score = ScoreEndpoint(self.predicted, lambda: self.policy, lambda: [w.url for w in self.pool.decodes],
                                   self.pool.decode_loads, self.paths, body_limit=self.body_limit,
                                   body_timeout=c.client_body_timeout or None)
        self.api_key = c.api_key or os.environ.get("ELDR_API_KEY") or None
        self.worker_api_key = c.worker_api_key or os.environ.get("ELDR_WORKER_API_KEY") or None
        self.parser = BodyParser()
        self.upstream = upstream.UpstreamClient(c.request_timeout, c.connect_timeout, WORKER_KEEPALIVE_S,
                                                first_byte_timeout=c.first_byte_timeout,
                                                idle_timeout=c.idle_timeout,
                                                max_per_worker=c.worker_max_connections,
                                                api_key=self.worker_api_key)
        self.request_ids = RequestIds(c.request_id_headers)
        self.guards = ClientGuards(c.client_header_timeout,
                                   on_close=lambda: self.metrics.errors.labels("header_timeout").inc())
        self.admin = AdminGate(c, self.metrics)
        self.inflight_limit = c.inflight_limit
        self.session: Optional[aiohttp.ClientSession] = None
        self.return_address: Optional[str] = None
        self.active, self.draining = 0, False
        self.idle = asyncio.Event()
        self.idle.set()
        self._rng = np.random.default_rng(c.seed)
        self._bg: set[asyncio.Task] = set()
        if not self.predicted.can_predict and getattr(self.policy, "needs_signature", False):
            logger.warning("policy %s needs signatures and the artifact has no predictor: every request "
                           "falls back to least loaded", c.policy)

    # ------------------------------------------------------------ what cli.serve reads
    @property
    def prefills(self) -> list[Worker]:
        return []

    @property
    def decodes(self) -> list[Worker]:
        return self.pool.decodes

    # ------------------------------------------------------------ request path
    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Read the body first (size cap, time limit), only then take an in-flight slot."""
        endpoint = WORK[request.path]
        try:
            raw = await read_body(request, self.body_limit, self.config.client_body_timeout or None)
        except BodyError as e:
            return self._bad(str(e), e.status)
        if self.active >= self.inflight_limit:
            self.metrics.overloaded.inc()
            return error_response(429, f"router at its in-flight limit ({self.inflight_limit})",
                                  self.config.retry_after)
        t0 = time.perf_counter()
        self.active += 1
        self.idle.clear()
        try:
            return await self._handle(request, endpoint, t0, raw)
        finally:
            self.active -= 1
            if self.active == 0:
                self.idle.set()
            self.metrics.deferred(self.metrics.request_duration, endpoint).observe(time.perf_counter() - t0)

    def _bad(self, message: str, status: int = 400) -> web.Response:
        kind = {408: "body_timeout", 413: "too_large"}.get(status, "bad_request")
        self.metrics.errors.labels(kind).inc()
        return error_response(status, message)

    async def _handle(self, request: web.Request, endpoint: str, t0: float, raw: bytes) -> web.StreamResponse:
        # parsed in the parser process when big; only the fields routing reads come back
        out = await self.parser.run(routing_view, raw, endpoint)
        if out[0] == "error":
            return self._bad(out[2], out[1])
        body = out[1]
        refused = sampling.refusal(body, endpoint, pd=False)  # n > 1 passes; best_of > n does not
        if refused:
            return self._bad(refused)
        policy = self.policy
        try:
            items = self.predicted.token_ids(body, endpoint)
        except ValueError as e:
            if self.predicted.can_predict or self.tokenizer is not None:
                return self._bad(str(e))
            items = []  # nothing to predict with anyway: route by load
        route, _ = self.predicted.route(items) if items else (None, {})
        stream = bool(body.get("stream", False))
        rid = request.get(REQUEST_ID_KEY)
        headers = (rid,) if rid else ()
        tried: set[int] = set()
        while True:
            w, index, path = self._choose(policy, route, tried)
            self.paths.labels("colocated", path).inc()
            ticket = self.pool.enter(w)
            admitted = policy.admit(index, route) if route is not None else None
            try:
                if not tried:
                    self.metrics.added_latency.observe(time.perf_counter() - t0)
                try:
                    resp = await self.upstream.post(w.endpoint(endpoint), raw, headers=headers)
                except upstream.ConnectError as e:
                    self.pool.failure(w, ticket, repr(e), "connect", hard=True)
                    tried.add(index)
                    if len(tried) < len(self.pool.decodes):
                        self.metrics.retries.labels("worker").inc()
                        continue
                    return error_response(503, f"no worker reachable: {e}")
                except upstream.UpstreamError as e:
                    timeout = isinstance(e, upstream.Timeout)
                    self.pool.failure(w, ticket, repr(e), "timeout" if timeout else "disconnect", hard=True)
                    return error_response(504 if timeout else 502, f"worker {w.url} failed: {e}")
                try:
                    return await self._relay(request, resp, w, ticket, stream, headers)
                finally:
                    resp.release()
            finally:
                self.pool.leave(w, ticket)
                if route is not None:
                    policy.release(admitted)

    def _choose(self, policy, route, tried: set[int]) -> tuple[Worker, int, str]:
        loads = self.pool.decode_loads()
        allowed = self.pool.allowed_decodes(tried)
        t0 = time.perf_counter()
        if route is None:
            index, path = least_loaded(loads, np.flatnonzero(allowed), self._rng), "fallback"
        else:
            try:
                dec, path = decide(policy, route, loads, allowed)
                index = dec.index
            except (ValueError, IndexError) as e:
                logger.error("policy %s failed (%s); using least loaded", policy.name, e)
                self.metrics.errors.labels("policy").inc()
                index, path = least_loaded(loads, np.flatnonzero(allowed), self._rng), "fallback"
        self.metrics.choose_time.observe(time.perf_counter() - t0)
        w = self.pool.decodes[index]
        self.metrics.requests.labels(policy.name, w.url).inc()
        return w, index, path

    async def _relay(self, request: web.Request, resp: upstream.UpstreamResponse, w: Worker, ticket,
                     stream: bool, headers: tuple = ()) -> web.StreamResponse:
        pool = self.pool
        if resp.status != 200 or not stream:
            try:
                data = await resp.read()
            except upstream.UpstreamError as e:
                pool.failure(w, ticket, repr(e), "stream")
                return error_response(502, f"worker {w.url} failed: {e}")
            if resp.status >= 500:
                pool.failure(w, ticket, f"HTTP {resp.status}: {data[:200]!r}", "http_5xx")
            else:
                pool.success(w, ticket)
            if resp.status != 200:
                return worker_error_response(resp.status, data, w.url)
            return web.Response(body=data, status=200, content_type=JSON)
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                      "Cache-Control": "no-cache", **dict(headers)})
        await out.prepare(request)
        try:
            async for chunk in resp.iter_chunks():
                await out.write(chunk)
            await out.write_eof()
            pool.success(w, ticket)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self.metrics.event("client_disconnects")
        except upstream.UpstreamError as e:
            pool.failure(w, ticket, f"stream broken: {e!r}", "stream")
            err = {"error": {"message": f"worker {w.url} failed mid-stream: {e}", "type": "upstream_error"}}
            try:
                await out.write(b"data: " + orjson.dumps(err) + b"\n\n")
                await out.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError):
                pass
        return out

    # ------------------------------------------------------------ other endpoints
    async def h_health(self, request: web.Request) -> web.Response:
        return error_response(503, "router is draining") if self.draining else web.Response(status=200)

    def readiness(self) -> dict:
        """Ready = not draining and at least one server available (healthy, breaker closed)."""
        healthy = sum(w.available() for w in self.pool.decodes)
        return {"ready": not self.draining and healthy > 0, "draining": self.draining,
                "healthy": {"worker": healthy}, "servers": {"worker": len(self.pool.decodes)}}

    async def h_ready(self, request: web.Request) -> web.Response:
        state = self.readiness()
        return json_response(state, 200 if state["ready"] else 503)

    async def h_metrics(self, request: web.Request) -> web.Response:
        for w in self.pool.decodes:
            w.update_gauges()
        data, ctype = self.metrics.render()
        return web.Response(body=data, headers={"Content-Type": ctype})

    def status(self) -> dict:
        return {"pid": os.getpid(), "mode": "colocated", "policy": self.policy.name, "tau": self.tau,
                "predictor": self.predicted.can_predict,
                "tokenizer": getattr(self.tokenizer, "path", None),
                "workers": [w.describe() for w in self.pool.decodes], "loads": self.pool.decode_loads(),
                "active_requests": self.active, "draining": self.draining,
                "counters": self.metrics.counters()}

    async def h_status(self, request: web.Request) -> web.Response:
        return json_response(self.status())

    async def h_models(self, request: web.Request) -> web.Response:
        w = self.pool.decodes[0]
        try:
            async with self.session.get(w.endpoint(request.path.lstrip("/")),
                                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                return web.Response(body=await r.read(), status=r.status, content_type=JSON)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return error_response(503, f"{w.url} unreachable: {type(e).__name__}")

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=int(self.config.max_body_mb * (1 << 20)))
        install_conventions(app, self.config, self.config.request_id_headers)  # CORS, access log
        r = app.router
        for path in WORK:
            r.add_post(path, self.handle)
        r.add_post("/eldr/score", self.score.handle)
        r.add_get("/health", self.h_health)
        r.add_get("/liveness", self.h_health)
        r.add_get("/ready", self.h_ready)
        r.add_get("/readiness", self.h_ready)
        r.add_get("/metrics", self.h_metrics)
        r.add_get("/eldr/status", self.admin.only(self.h_status))
        for path in ("/v1/models", "/model_info", "/get_model_info"):
            r.add_get(path, self.h_models)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """The PD router's client conventions around :meth:`_guarded`: API key, request id
        (echoed), OpenAI-shaped errors on ``/v1/*``; the header limit stops once a request starts."""
        return await with_client_conventions(
            request, lambda req: self._guarded(req, handler), keyed_paths=KEYED_PATHS,
            guards=self.guards, request_ids=self.request_ids, api_key=self.api_key,
            unauthorized_counter=self.metrics.errors.labels("unauthorized"))

    async def _guarded(self, request: web.Request, handler) -> web.StreamResponse:
        if self.draining and request.path in WORK:
            return error_response(503, "router is draining (shutting down); retry elsewhere",
                                  self.config.retry_after)
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            if e.status == 413:
                self.metrics.errors.labels("too_large").inc()
                return error_response(413, f"request body too large: {e.text}")
            return error_response(e.status, e.reason)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            logger.exception("unhandled error on %s", request.path)
            return error_response(500, f"internal router error: {type(e).__name__}")

    # ------------------------------------------------------------ lifecycle (start_router calls these)
    async def start_background(self, host: str) -> None:
        c = self.config
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=0, keepalive_timeout=WORKER_KEEPALIVE_S),
            headers={"Authorization": f"Bearer {self.worker_api_key}"} if self.worker_api_key else None)
        self.pool.session = self.session
        self.idle = asyncio.Event()
        if self.active == 0:
            self.idle.set()
        for interval, job in ((c.health_interval, self.pool.check_health), (c.load_interval, self.pool.poll_loads)):
            if interval > 0:
                task = asyncio.get_running_loop().create_task(self.pool.run_periodic(interval, job))
                self._bg.add(task)

    async def stop_background(self) -> None:
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        self.upstream.close()
        self.parser.close()

    async def drain(self, timeout: float) -> bool:
        self.draining = True
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


def build_colocated_router(args: Any) -> ColocatedRouter:
    """From the CLI's parsed arguments (``--worker`` URLs and the RouterConfig)."""
    return ColocatedRouter(args.worker, config=args.router_config)
