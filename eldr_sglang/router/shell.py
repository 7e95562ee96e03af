"""The server shell every router process is, whatever its request flow.

:class:`RouterShell` owns what does not depend on how a request is routed: the HTTP
conventions (API key, request ids, OpenAI-shaped errors, CORS, the header time
limit), admission and drain, the worker session and upstream client, the routing
state and its lifecycle (calibration reload and ``--calibration-watch``, membership
changes, A/B slices, engine reports), the decision log, status, metrics and the
admin and info routes, and the request wrapper of the work routes (:meth:`handle`: body
read, admission, A/B, duration, error shaping). It holds the request flow behind one
small protocol (:class:`Flow`: ``admit`` then ``serve``; the PD flow
:mod:`~eldr_sglang.router.flow.dispatch`, the co-located flow
:mod:`~eldr_sglang.router.flow.colocated`, both sending through
:class:`~eldr_sglang.router.flow.send.Sender`). The routers that wire a flow in
(:class:`~eldr_sglang.router.app.Router`, :class:`~eldr_sglang.router.colocated.ColocatedRouter`)
add their parts through the hooks below.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Optional, Protocol, Sequence

import aiohttp
import orjson
from aiohttp import web

from eldr_sglang.core.policies import Policy
from eldr_sglang.router.pool import upstream
from eldr_sglang.router.state.ab import ABController
from eldr_sglang.router.api.admin import AdminApi
from eldr_sglang.router.state.admission import Admission
from eldr_sglang.router.http.bodies import BodyError, BodyParser, read_body
from eldr_sglang.router.http.client_guard import ClientGuards
from eldr_sglang.router.http.clients import RequestIds, bearer_matches, unauthorized, with_client_conventions
from eldr_sglang.router.config import WORKER_KEEPALIVE_S, RouterConfig
from eldr_sglang.router.state.decision_log import DecisionLog
from eldr_sglang.router.signals.engine_reports import EngineReports
from eldr_sglang.router.http.http_conventions import install as install_conventions
from eldr_sglang.router.api.info_api import InfoApi
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.state.online import CalibrationWatcher
from eldr_sglang.router.flow.dispatch_parts import Flight
from eldr_sglang.router.flow.relay import Relay
from eldr_sglang.router.http.responses import error_response, json_response
from eldr_sglang.router.state.routing import Routing, RoutingState
from eldr_sglang.router.runtime import Runtime
from eldr_sglang.router.signals.signatures import SignatureEncoder, load_calibration
from eldr_sglang.router.pool.workers import Worker, WorkerPool

logger = logging.getLogger("eldr_sglang.router")
WORK = {"/generate": "generate", "/v1/completions": "v1/completions",
        "/v1/chat/completions": "v1/chat/completions"}
WORK_PATHS = frozenset(WORK)
# what --api-key guards: the work routes and what tells about the model
KEYED_PATHS = WORK_PATHS | {"/v1/models", "/model_info", "/get_model_info", "/server_info",
                            "/get_server_info", "/health_generate", "/eldr/score"}


def _urls(text: Optional[str]) -> list[str]:
    return [u.strip() for u in (text or "").split(",") if u.strip()]


def initial_artifact(config: RouterConfig) -> Any:
    """The ``--calibration`` artifact, or None while an online router or a followed
    file waits for its first one."""
    c = config
    if not c.calibration:
        return None
    if (c.online or c.calibration_watch) and not os.path.exists(c.calibration):
        logger.info("%s does not exist yet: routing by load until a calibration is %s",
                    c.calibration, "fitted" if c.online else "written there")
        return None
    return load_calibration(c.calibration)


class Flow(Protocol):
    """What the shell holds a request flow by (the PD flow, the co-located flow)."""

    async def admit(self, request: web.Request, raw: bytes, endpoint: str, t0: float) -> Flight:
        """The parsed, checked request (BodyError: refused with its status)."""

    async def serve(self, request: web.Request, fl: Flight) -> web.StreamResponse:
        """The admitted request, answered."""


class RouterShell:
    """One router process's shell; ``mode`` names its flow (``pd``, ``colocated``), held
    as ``flow`` (:class:`Flow`)."""

    mode = "pd"
    flow: Flow

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, pool: WorkerPool,
                 artifact: Any = None, domain_map: Optional[dict] = None) -> None:
        self.config = c = config
        self.metrics = m = metrics
        self.pool = pool
        self.runtime = Runtime()
        self.state = state = RoutingState(c, pool, m, artifact, domain_map)
        self.decisions = DecisionLog(c.decisions_kept)
        self.parser = BodyParser()
        self.admission = Admission(c, m, self.runtime)
        self.api_key = c.api_key or os.environ.get("ELDR_API_KEY") or None
        self.worker_api_key = c.worker_api_key or os.environ.get("ELDR_WORKER_API_KEY") or None
        self.upstream = upstream.UpstreamClient(
            c.request_timeout, c.connect_timeout, WORKER_KEEPALIVE_S,
            first_byte_timeout=c.first_byte_timeout, idle_timeout=c.idle_timeout,
            max_per_worker=c.worker_max_connections, api_key=self.worker_api_key)
        self.relay = Relay(c, m, pool, self.runtime)
        self.body_limit = int(c.max_body_mb * (1 << 20))
        self.request_ids = RequestIds(c.request_id_headers)
        self.guards = ClientGuards(c.client_header_timeout,
                                   on_close=lambda: m.errors.labels("header_timeout").inc())
        self._unauthorized = m.errors.labels("unauthorized")  # a labels() lookup costs ~5 us
        self.online: Any = None  # the flows that learn online set these
        self.shadow: Any = None
        engines = _urls(c.engine_metrics)
        self.ab: Optional[ABController] = None
        if c.ab_policies or c.ab_record:
            state.set_arms([p.strip() for p in (c.ab_policies or c.policy).split(",") if p.strip()])
            self.ab = ABController(state, m, lambda: self.runtime.session, c.ab_slice, c.ab_record,
                                   engines, c.ab_label)
        self.engine_reports = (EngineReports(state, m, lambda: self.runtime.session, engines,
                                             c.load_interval, c.health_timeout)
                               if engines and c.load_interval > 0 else None)
        self.watcher = (CalibrationWatcher(self.reload_calibration, m, c.calibration,
                                           c.calibration_watch) if c.calibration_watch else None)
        self.info = InfoApi(c, pool, self.runtime)
        self.admin = AdminApi(c, m, self.decisions, status=self.status,
                              change_servers=self.change_servers, reload=self.reload_calibration,
                              fan_out=self.info.fan_out)

    # ------------------------------------------------------------ the request wrapper
    async def handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """One client request on a work route, whatever the flow: the body read (size
        cap, time limit) and admitted by the flow (parsed, viewed: off the loop when
        big) before an in-flight slot is taken, so slow or bad clients hold none; then
        the flow serves it; duration and A/B accounted on every path."""
        t0 = time.perf_counter()
        try:
            raw = await read_body(request, self.body_limit, self.config.client_body_timeout or None)
            fl = await self.flow.admit(request, raw, endpoint, t0)
        except BodyError as e:
            return self.bad(str(e), e.status)
        refusal = self.admission.refusal()
        if refusal is not None:
            return refusal
        self.admission.enter()
        fl.ab = self.ab.request_started(fl.routing) if self.ab is not None else None
        status = 0
        try:
            resp = await self.flow.serve(request, fl)
            status = resp.status
            return resp
        finally:
            self.admission.leave()
            elapsed = time.perf_counter() - t0
            self.metrics.deferred(self.metrics.request_duration, endpoint).observe(elapsed)
            if self.ab is not None:
                self.ab.request_done(fl.ab, elapsed, status)

    def bad(self, message: str, status: int = 400) -> web.Response:
        """A refused request's answer (JSON), counted by kind; 503 with Retry-After."""
        kind = {408: "body_timeout", 413: "too_large", 503: "busy"}.get(status, "bad_request")
        self.metrics.errors.labels(kind).inc()
        return error_response(status, message, self.config.retry_after if status == 503 else None)

    # ------------------------------------------------------------ what a flow adds

    def flow_status(self) -> dict:
        """The flow's own fields of ``/eldr/status``."""
        return {}

    def adopt(self, art: Any) -> None:
        """A new artifact went live (reload, watch)."""

    def servers_changed(self, added: bool) -> None:
        """Decode servers were added or removed."""

    def flow_routes(self, r: web.UrlDispatcher) -> None:
        """The flow's own routes."""

    async def start_flow(self, host: str) -> None:
        """The flow's listeners and jobs, before the worker session opens."""

    async def stop_flow(self) -> None:
        """The flow's listeners and jobs, closed."""

    def update_gauges(self) -> None:
        """The flow's gauges, before ``/metrics`` renders."""

    # ------------------------------------------------------------ the public API
    @property
    def routing(self) -> Routing:
        return self.state.routing

    @property
    def policy(self) -> Policy:
        return self.state.routing.policy

    @property
    def encoder(self) -> Optional[SignatureEncoder]:
        return self.state.routing.encoder

    @property
    def tau(self) -> Optional[float]:
        return self.state.routing.tau

    @property
    def decodes(self) -> list[Worker]:
        return self.pool.decodes

    @property
    def prefills(self) -> list[Worker]:
        return self.pool.prefills

    @property
    def return_address(self) -> Optional[str]:
        """Where engines send this router's signature messages (PD, ``--signature-port``)."""
        return self.runtime.return_address

    # ------------------------------------------------------------ routing lifecycle

    def reload_calibration(self, path: str) -> dict:
        """Swap in the artifact at ``path`` (validated by ``load_artifact``: format,
        shapes, checksum); ValueError leaves the current one in place."""
        art = load_calibration(path)
        out = self.state.install_artifact(art, str(path))
        self.adopt(art)
        return out

    def change_servers(self, add: Sequence[str] = (), remove: Sequence[str] = (),
                       add_prefill: Sequence[tuple[str, Optional[int]]] = (),
                       remove_prefill: Sequence[str] = ()) -> None:
        """Membership changes (:meth:`RoutingState.change_servers`)."""
        self.state.change_servers(add, remove, add_prefill, remove_prefill)
        if add or remove:
            self.servers_changed(bool(add))

    # ------------------------------------------------------------ status and metrics
    def status(self) -> dict:
        rt, pool = self.routing, self.pool
        return {
            "pid": os.getpid(), "mode": self.mode, "policy": rt.name, "tau": rt.tau,
            "artifact": rt.encoder.describe() if rt.encoder else None,
            "calibration_path": rt.calibration_path,
            "draining": self.runtime.draining, "active_requests": self.admission.active,
            "inflight_limit": self.admission.limit,
            "health_interval": self.config.health_interval,
            "prefill": [s.describe() for s in pool.prefills],
            "decode": [s.describe() for s in pool.decodes],
            "loads": pool.decode_loads(),
            "policy_state": rt.policy.describe(),
            "calibration": self.calibration_info(),
            "ab": self.ab.describe() if self.ab else None,
            "engine_reports": self.engine_reports.describe() if self.engine_reports else None,
            "counters": self.metrics.counters(),
            "upstream": {"open": self.upstream.open_connections,
                         "idle": self.upstream.idle_connections,
                         "waiting": self.upstream.waiting, "queued": self.upstream.queued,
                         "max_per_worker": self.upstream.max_per_worker},
            "client_connections": len(self.guards.live),
            **self.flow_status(),
        }

    def calibration_info(self) -> dict:
        """Where the live calibration came from (offline file or online fit) and the
        online lifecycle's state."""
        rt = self.routing
        art = rt.encoder.artifact if rt.encoder else None
        created = dict(getattr(art, "created", None) or {})
        return {"path": rt.calibration_path, "policy": rt.name, "tau": rt.tau,
                "artifact": rt.encoder.describe() if rt.encoder else None,
                "checksum": art.checksum() if hasattr(art, "checksum") else None,
                "provenance": ({"mode": created.get("mode", "offline"), **created}
                               if art is not None else None),
                "online": self.online.describe() if self.online else None,
                "watch": ({"path": self.watcher.path, "interval_s": self.watcher.interval,
                           "errors": self.watcher.errors} if self.watcher else None)}

    def calibration_summary(self) -> dict:
        """What a non-admin may see of the calibration: where it came from (offline or
        online, not its file), the policy and tau, the checksum and the online state."""
        info = self.calibration_info()
        online = info.get("online")
        return {"policy": info["policy"], "tau": info["tau"], "checksum": info["checksum"],
                "calibrated": info["artifact"] is not None,
                "provenance": ({"mode": info["provenance"].get("mode")}
                               if info["provenance"] else None),
                "online": ({k: online.get(k) for k in ("state", "generation", "fitting", "age_s")}
                           if isinstance(online, dict) else None)}

    async def h_metrics(self, request: web.Request) -> web.Response:
        for s in self.pool.all():
            s.update_gauges()
        self.metrics.draining.set(int(self.runtime.draining))
        self.metrics.client_requests.set(self.admission.active)
        self.update_gauges()
        data, ctype = self.metrics.render()
        return web.Response(body=data, headers={"Content-Type": ctype})

    async def h_status(self, request: web.Request) -> web.Response:
        return json_response(self.status())

    async def h_calibration_get(self, request: web.Request) -> web.Response:
        """Admins (loopback, or ``--admin-token``) see everything; with ``--api-key`` or
        ``--admin-token`` anyone else needs the API key, and sees no file paths, model
        or layers (nor does an anonymous caller of a router without either)."""
        if self.admin.allowed(request):
            return json_response({**self.calibration_info(),
                                  "policy_state": self.routing.policy.describe()})
        if self.api_key and bearer_matches(request, self.api_key):
            return json_response(self.calibration_summary())
        if self.api_key or self.config.admin_token:
            self._unauthorized.inc()
            return unauthorized()
        return json_response(self.calibration_summary())

    # ------------------------------------------------------------ lifecycle
    async def drain(self, timeout: float) -> bool:
        """Refuse new work (503), wait for in-flight requests; True if all finished."""
        return await self.admission.drain(timeout)

    async def start_background(self, host: str) -> None:
        """The flow's listeners, the worker session, health checks, load polls, engine
        reports, the calibration watch and A/B slices."""
        c, rt = self.config, self.runtime
        await self.start_flow(host)  # first: a port in use fails before anything starts
        rt.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300,
                                           keepalive_timeout=WORKER_KEEPALIVE_S),
            json_serialize=lambda o: orjson.dumps(o).decode(),
            headers=({"Authorization": f"Bearer {self.worker_api_key}"}
                     if self.worker_api_key else None))
        self.pool.session = rt.session
        self.admission.bind_loop()
        if c.health_interval > 0:
            rt.spawn(self.pool.run_periodic(c.health_interval, self.pool.check_health))
        if c.load_interval > 0:
            rt.spawn(self.pool.run_periodic(c.load_interval, self.pool.poll_loads))
        if self.engine_reports is not None:
            rt.spawn(self.pool.run_periodic(c.load_interval, self.engine_reports.poll))
        if self.watcher is not None:
            rt.spawn(self.watcher.run())
        if self.ab is not None:
            rt.spawn(self.ab.run())

    async def stop_background(self) -> None:
        await self.stop_flow()
        await self.runtime.cancel_tasks()
        if self.runtime.session is not None:
            await self.runtime.session.close()
        self.upstream.close()
        self.parser.close()

    # ------------------------------------------------------------ HTTP
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._conventions], client_max_size=self.body_limit)
        install_conventions(app, self.config, self.config.request_id_headers)  # CORS, access log
        r, admin, info = app.router, self.admin, self.info
        for path, endpoint in WORK.items():
            r.add_post(path, self._work_handler(endpoint))
        r.add_get("/v1/models", info.h_models)
        for path in ("/health", "/liveness"):
            r.add_get(path, info.h_health)
        for path in ("/ready", "/readiness"):
            r.add_get(path, info.h_ready)
        r.add_get("/health_generate", info.h_health_generate)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, info.h_server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, info.h_model_info)
        r.add_get("/metrics", self.h_metrics)
        r.add_get("/eldr/status", admin.only(self.h_status))
        r.add_get("/eldr/calibration", self.h_calibration_get)
        r.add_post("/eldr/calibration", admin.only(admin.h_calibration))
        r.add_get("/eldr/decisions", admin.only(admin.h_decisions))
        r.add_post("/eldr/servers", admin.only(admin.h_servers))
        r.add_post("/flush_cache", admin.only(admin.h_flush_cache))
        self.flow_routes(r)
        return app

    def _work_handler(self, endpoint: str):
        async def work(request: web.Request) -> web.StreamResponse:
            return await self.handle(request, endpoint)
        return work

    @web.middleware
    async def _conventions(self, request: web.Request, handler) -> web.StreamResponse:
        """The client conventions (API key, request id, OpenAI-shaped errors on /v1/*)
        around :meth:`_guarded`; the header time limit stops once a request starts."""
        return await with_client_conventions(
            request, lambda req: self._guarded(req, handler), keyed_paths=KEYED_PATHS,
            guards=self.guards, request_ids=self.request_ids, api_key=self.api_key,
            unauthorized_counter=self._unauthorized)

    async def _guarded(self, request: web.Request, handler) -> web.StreamResponse:
        """Drain gate, and every error leaves as JSON ``{"error": ...}``; never a traceback."""
        if self.runtime.draining and request.path in WORK_PATHS:
            self.metrics.event("refused_draining")
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
