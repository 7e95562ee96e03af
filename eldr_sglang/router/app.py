"""ELDR router: one process's parts, composed, and its HTTP routes (aiohttp + orjson).

The jobs live in their own modules; this one builds each with only what it uses:

* :mod:`~eldr_sglang.router.routing`: the routing state (policy, encoder, tau, A/B
  arms) and its lifecycle (reloads, membership changes);
* :mod:`~eldr_sglang.router.workers`: worker pool, health checks, breakers, shared load;
* :mod:`~eldr_sglang.router.dispatch`: the PD dispatch flow (late binding), as named steps
  over :class:`~eldr_sglang.router.dispatch_parts.DispatchParts`;
* :mod:`~eldr_sglang.router.intake`: signature intake (HTTP and TCP);
* :mod:`~eldr_sglang.router.admin`, :mod:`~eldr_sglang.router.info_api`: admin API,
  health/readiness and the workers' info routes;
* :mod:`~eldr_sglang.router.decision_log`: the decision log;
* :mod:`~eldr_sglang.router.metrics`: observability (Prometheus, the one record);
* :mod:`~eldr_sglang.router.config`: every setting and its default;
* :mod:`~eldr_sglang.router.serve`: ``start_router`` (runner and site).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import replace
from typing import Any, Optional, Sequence

import aiohttp
import orjson
from aiohttp import web

from eldr_sglang.core.policies import Decision, Policy, PolicySpec
from eldr_sglang.router import upstream
from eldr_sglang.router.ab import ABController, ShadowPolicy
from eldr_sglang.router.engine_reports import EngineReports
from eldr_sglang.router.admin import AdminApi
from eldr_sglang.router.bodies import BodyParser
from eldr_sglang.router.client_guard import ClientGuards
from eldr_sglang.router.clients import (REQUEST_ID_KEY, with_client_conventions, RequestIds, as_openai_error,
                                        bearer_matches, unauthorized)
from eldr_sglang.router.config import WORKER_KEEPALIVE_S, RouterConfig
from eldr_sglang.router.http_conventions import install as install_conventions
from eldr_sglang.router.decision_log import DecisionLog
from eldr_sglang.router.dispatch import Dispatcher
from eldr_sglang.router.dispatch_parts import DispatchParts
from eldr_sglang.router.early import EarlyBinding
from eldr_sglang.router.info_api import InfoApi
from eldr_sglang.router.intake import SignatureIntake
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.online import CalibrationWatcher, OnlineController
from eldr_sglang.router.responses import error_response, json_response
from eldr_sglang.router.routing import Routing, RoutingState
from eldr_sglang.router.runtime import Runtime
from eldr_sglang.router.serve import start_router  # noqa: F401 (its former home)
from eldr_sglang.router.signatures import SignatureBoard, SignatureEncoder, WaitLimit, load_calibration
from eldr_sglang.router.workers import Worker, WorkerPool

logger = logging.getLogger("eldr_sglang.router")
WORK_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
# what --api-key guards: the work routes and what tells about the model
KEYED_PATHS = WORK_PATHS | {"/v1/models", "/model_info", "/get_model_info", "/server_info",
                            "/get_server_info", "/health_generate"}


def _load_json(text: str) -> dict:
    if os.path.exists(text):
        with open(text) as f:
            return json.load(f)
    return json.loads(text)


class Router:
    """The parts of one ELDR router process and its HTTP handlers.

    ``Router(prefill, decode, policy, artifact=..., domain_map=..., **settings)``:
    ``settings`` are :class:`RouterConfig` fields (or pass ``config=``)."""

    def __init__(self, prefill: Sequence[tuple[str, Optional[int]]], decode: Sequence[str],
                 policy: Optional[str] = None, *, artifact: Any = None,
                 domain_map: Optional[dict] = None, config: Optional[RouterConfig] = None,
                 **settings: Any) -> None:
        if config is None:
            config = RouterConfig.from_dict({**settings, **({"policy": policy} if policy else {})})
        elif settings or policy:
            config = replace(config, **settings, **({"policy": policy} if policy else {}))
        self.config = c = config
        self.metrics = m = RouterMetrics()
        self.pool = WorkerPool(prefill, decode, c, m)
        if artifact is None and c.calibration:
            if (c.online or c.calibration_watch) and not os.path.exists(c.calibration):
                logger.info("%s does not exist yet: routing by load until a calibration "
                            "is %s", c.calibration, "fitted" if c.online else "written there")
            else:
                artifact = load_calibration(c.calibration)
        if domain_map is None and c.domain_map:
            domain_map = _load_json(c.domain_map)
        self.state = state = RoutingState(c, self.pool, m, artifact, domain_map)
        self.runtime = Runtime()
        self.board = SignatureBoard(ttl=c.signature_ttl, max_buffered=c.signature_buffer,
                                    max_bytes=int(c.signature_buffer_mb * (1 << 20)))
        self.parser = BodyParser()
        self.intake = SignatureIntake(self.board, m,
                                      int(min(c.signature_max_kb * 1024, c.max_body_mb * (1 << 20))),
                                      encoder=lambda: state.routing.encoder,
                                      buffering=lambda: state.routing.policy.needs_signature,
                                      observer=self._observe if c.online or c.shadow_policy else None,
                                      parser=self.parser, body_timeout=c.client_body_timeout or None,
                                      key=c.signature_key(),
                                      api_key=c.api_key or os.environ.get("ELDR_API_KEY") or None,
                                      max_age=c.signature_max_age, max_streams=c.signature_max_streams,
                                      stream_idle=c.signature_stream_idle,
                                      line_timeout=c.signature_line_timeout)
        self._warn_open_intake(c)
        log = self.intake.log  # one rate-limited warning log for the intake and the flow
        self.online = (OnlineController(c, m, state, self.runtime.spawn, log) if c.online else None)
        self.shadow = ShadowPolicy(state, m, c.shadow_policy) if c.shadow_policy else None
        self.ab: Optional[ABController] = None
        if c.ab_policies or c.ab_record:
            state.set_arms([p.strip() for p in (c.ab_policies or c.policy).split(",") if p.strip()])
            self.ab = ABController(state, m, lambda: self.runtime.session, c.ab_slice, c.ab_record,
                                   [u.strip() for u in (c.engine_metrics or "").split(",") if u.strip()],
                                   c.ab_label)
        engines = [u.strip() for u in (c.engine_metrics or "").split(",") if u.strip()]
        self.engine_reports = (EngineReports(state, m, lambda: self.runtime.session, engines,
                                             c.load_interval, c.health_timeout)
                               if engines and c.load_interval > 0 else None)
        self.watcher = (CalibrationWatcher(self.reload_calibration, m, c.calibration,
                                           c.calibration_watch) if c.calibration_watch else None)
        self.wait_limit = WaitLimit(c.signature_timeout, c.signature_timeout_min,
                                    c.signature_timeout_factor)
        m.signature_wait_limit.set(self.wait_limit.value)
        self.api_key = c.api_key or os.environ.get("ELDR_API_KEY") or None
        self.worker_api_key = c.worker_api_key or os.environ.get("ELDR_WORKER_API_KEY") or None
        self.upstream = upstream.UpstreamClient(
            c.request_timeout, c.connect_timeout, WORKER_KEEPALIVE_S,
            first_byte_timeout=c.first_byte_timeout, idle_timeout=c.idle_timeout,
            max_per_worker=c.worker_max_connections, api_key=self.worker_api_key)
        self.body_limit = int(c.max_body_mb * (1 << 20))
        self.request_ids = RequestIds(c.request_id_headers)
        self.guards = ClientGuards(c.client_header_timeout,
                                   on_close=lambda: m.errors.labels("header_timeout").inc())
        self.inflight_limit = c.inflight_limit
        self.decisions = DecisionLog(c.decisions_kept)
        early = (EarlyBinding(c, m.registry, lambda: state.routing.encoder).route
                 if c.binding != "late" else None)
        self.dispatcher = Dispatcher(DispatchParts(
            c, m, self.pool, self.board, self.parser, self.upstream, self.wait_limit, state,
            self.runtime, self.decisions, log, shadow=self.shadow, early=early,
            learns=self.online is not None,
            on_start=self.ab.request_started if self.ab is not None else None,
            on_done=self.ab.request_done if self.ab is not None else None))
        self.info = InfoApi(c, self.pool, self.runtime)
        self.admin = AdminApi(c, m, self.decisions, status=self.status,
                              change_servers=self.change_servers, reload=self.reload_calibration,
                              fan_out=self.info.fan_out, online=self.online)

    def _warn_open_intake(self, c: RouterConfig) -> None:
        """Say at start who may post signature messages when no signature key is set."""
        if self.intake.bearer is None and self.intake.key is not None:
            return  # a signature key: only signed messages
        where = "POST /eldr/signature" + (f" and the TCP port --signature-port {c.signature_port}"
                                          if c.signature_port is not None else "")
        if self.intake.bearer is not None:
            logger.warning("no --signature-key-file (or ELDR_SIGNATURE_KEY): the signature intake (%s) "
                           "takes messages authenticated with the client API key (Bearer, or "
                           "signed with it as the HMAC key); give routers and engines a signature "
                           "key of their own", where)
        else:
            logger.warning("the signature intake (%s) is OPEN: no --signature-key-file (or "
                           "ELDR_SIGNATURE_KEY) and no --api-key, so anyone who reaches it can "
                           "steer requests to a decode server of their choice; set a shared key "
                           "on routers and engines, or keep the intake on a network only the "
                           "engines reach", where)

    def _observe(self, msg: dict) -> None:
        """Every well-formed signature message: online calibration and shadow decisions."""
        if self.online is not None:
            self.online.observe(msg)
        if self.shadow is not None:
            self.shadow.on_message(msg)

    # ------------------------------------------------------------ views of the parts
    @property
    def routing(self) -> Routing:
        return self.state.routing

    @property
    def spec(self) -> PolicySpec:
        return self.state.spec

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
    def last_layers(self) -> Optional[list[int]]:
        return self.state.last_layers

    @property
    def draining(self) -> bool:
        return self.runtime.draining

    @property
    def session(self) -> Optional[aiohttp.ClientSession]:
        return self.runtime.session

    @property
    def return_address(self) -> Optional[str]:
        return self.runtime.return_address

    def spawn(self, coro) -> asyncio.Task:
        return self.runtime.spawn(coro)

    # ------------------------------------------------------------ routing lifecycle
    def build_routing(self, spec: PolicySpec, encoder: Optional[SignatureEncoder]) -> Routing:
        return self.state.build_routing(spec, encoder)

    def set_routing(self, routing: Routing) -> None:
        self.state.set_routing(routing)

    def install_artifact(self, art: Any, path: str, origin: str = "file") -> dict:
        return self.state.install_artifact(art, path, origin)

    def reload_calibration(self, path: str) -> dict:
        """Swap in the artifact at ``path`` (validated by ``load_artifact``: format,
        shapes, checksum); ValueError leaves the current one in place."""
        art = load_calibration(path)
        out = self.state.install_artifact(art, str(path))
        if self.online is not None:
            self.online.adopt(art)
        return out

    def change_servers(self, add: Sequence[str] = (), remove: Sequence[str] = (),
                       add_prefill: Sequence[tuple[str, Optional[int]]] = (),
                       remove_prefill: Sequence[str] = ()) -> None:
        """Membership changes (:meth:`RoutingState.change_servers`); the shadow policy is
        rebuilt at its next use, an online router refits (K = decode servers again)."""
        self.state.change_servers(add, remove, add_prefill, remove_prefill)
        if self.shadow is not None and (add or remove):
            self.shadow.policy = None
        if self.online is not None and (add or remove):
            self.online.maybe_fit()  # the others' regions kept

    # backwards-compatible shorthands
    def add_decode(self, url: str) -> None:
        self.change_servers(add=[url])

    def remove_decode(self, url: str) -> None:
        self.change_servers(remove=[url])

    def record(self, rids: list[str], rooms: list[int], label: Optional[str],
               waiters: list[asyncio.Future], d: Worker, dec: Decision, loads: list[int],
               shadow: Optional[dict] = None) -> None:
        """One decision into the log (:meth:`DecisionLog.record`) against the live pool."""
        self.decisions.record(rids, rooms, label, waiters, d, dec, loads, self.pool.decodes, shadow)

    # ------------------------------------------------------------ status
    def status(self) -> dict:
        rt, pool = self.routing, self.pool
        return {
            "pid": os.getpid(), "policy": rt.name, "tau": rt.tau,
            "signature_timeout": self.wait_limit.value,
            "signature_port": self.intake.port, "signature_streams": len(self.intake.streams),
            "return_address": self.runtime.return_address,
            "artifact": rt.encoder.describe() if rt.encoder else None,
            "calibration_path": rt.calibration_path,
            "draining": self.runtime.draining, "active_requests": self.dispatcher.active,
            "inflight_limit": self.inflight_limit,
            "health_interval": self.config.health_interval,
            "prefill": [s.describe() for s in pool.prefills],
            "decode": [s.describe() for s in pool.decodes],
            "loads": pool.decode_loads(),
            "policy_state": rt.policy.describe(),
            "calibration": self.calibration_info(),
            "ab": self.ab.describe() if self.ab else None,
            "engine_reports": self.engine_reports.describe() if self.engine_reports else None,
            "shadow_policy": self.shadow.spec.name if self.shadow else None,
            "counters": self.metrics.counters(),
            "upstream": {"open": self.upstream.open_connections,
                         "idle": self.upstream.idle_connections,
                         "waiting": self.upstream.waiting, "queued": self.upstream.queued,
                         "max_per_worker": self.upstream.max_per_worker},
            "client_connections": len(self.guards.live),
            "signature_buffer": {"buffered": len(self.board.buffer),
                                 "buffered_bytes": self.board.buffered_bytes,
                                 "waiting": len(self.board.waiters),
                                 "expired": self.board.expired},
        }

    # ------------------------------------------------------------ handlers
    async def h_generate(self, request: web.Request) -> web.StreamResponse:
        return await self.dispatcher.handle(request, "generate")

    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.dispatcher.handle(request, "v1/completions")

    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        return await self.dispatcher.handle(request, "v1/chat/completions")

    async def h_metrics(self, request: web.Request) -> web.Response:
        for s in self.pool.all():
            s.update_gauges()
        m = self.metrics
        m.board.labels("waiting").set(len(self.board.waiters))
        m.board.labels("buffered").set(len(self.board.buffer))
        m.draining.set(int(self.runtime.draining))
        if self.online is not None:
            self.online.update_gauges()
        data, ctype = m.render()
        return web.Response(body=data, headers={"Content-Type": ctype})

    async def h_status(self, request: web.Request) -> web.Response:
        return json_response(self.status())

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
            self.metrics.errors.labels("unauthorized").inc()
            return unauthorized()
        return json_response(self.calibration_summary())

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

    # ------------------------------------------------------------ lifecycle
    async def drain(self, timeout: float) -> bool:
        """Refuse new work (503), wait for in-flight requests; True if all finished."""
        self.runtime.draining = True
        self.metrics.draining.set(1)
        d = self.dispatcher
        logger.warning("draining: %d request(s) in flight, up to %.1fs", d.active, timeout)
        try:
            await asyncio.wait_for(d.idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            logger.warning("drain timeout: %d request(s) still in flight", d.active)
            return False

    async def start_background(self, host: str) -> None:
        """Signature listener, worker session, health checks, load polls, board sweeps."""
        c = self.config
        if c.signature_port is not None:  # first: a port in use fails before anything starts
            port = await self.intake.start(host, c.signature_port)
            self.runtime.return_address = f"tcp://{c.signature_host_for(host)}:{port}"
        rt = self.runtime
        rt.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300,
                                           keepalive_timeout=WORKER_KEEPALIVE_S),
            json_serialize=lambda o: orjson.dumps(o).decode(),
            headers=({"Authorization": f"Bearer {self.worker_api_key}"}
                     if self.worker_api_key else None))
        self.pool.session = rt.session
        self.dispatcher.idle = asyncio.Event()  # bound to the serving loop
        if self.dispatcher.active == 0:
            self.dispatcher.idle.set()
        if c.health_interval > 0:
            self.spawn(self.pool.run_periodic(c.health_interval, self.pool.check_health))
        if c.load_interval > 0:
            self.spawn(self.pool.run_periodic(c.load_interval, self.pool.poll_loads))
        if self.engine_reports is not None:
            self.spawn(self.pool.run_periodic(c.load_interval, self.engine_reports.poll))
        self.spawn(self._sweep_board())
        if self.watcher is not None:
            self.spawn(self.watcher.run())
        if self.ab is not None:
            self.spawn(self.ab.run())

    async def _sweep_board(self) -> None:
        """Expire unclaimed signature messages even when no traffic comes in."""
        while True:
            await asyncio.sleep(min(1.0, max(self.board.ttl / 4, 0.05)))
            self.board.sweep()

    async def stop_background(self) -> None:
        await self.intake.close()
        if self.online is not None:
            self.online.close()
        await self.runtime.cancel_tasks()
        if self.runtime.session is not None:
            await self.runtime.session.close()
        self.upstream.close()
        self.parser.close()

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._json_errors], client_max_size=self.body_limit)
        install_conventions(app, self.config, self.config.request_id_headers)  # CORS, access log
        r, admin = app.router, self.admin
        r.add_post("/generate", self.h_generate)
        r.add_post("/v1/completions", self.h_completions)
        r.add_post("/v1/chat/completions", self.h_chat)
        info = self.info
        r.add_get("/v1/models", info.h_models)
        r.add_get("/health", info.h_health)
        r.add_get("/liveness", info.h_health)
        r.add_get("/ready", info.h_ready)
        r.add_get("/readiness", info.h_ready)
        r.add_get("/health_generate", info.h_health_generate)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, info.h_server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, info.h_model_info)
        r.add_get("/metrics", self.h_metrics)
        r.add_post("/eldr/signature", self.intake.h_signature)
        r.add_get("/eldr/status", admin.only(self.h_status))
        r.add_get("/eldr/calibration", self.h_calibration_get)
        r.add_post("/flush_cache", admin.only(admin.h_flush_cache))
        r.add_get("/eldr/decisions", admin.only(admin.h_decisions))
        r.add_post("/eldr/servers", admin.only(admin.h_servers))
        r.add_post("/eldr/calibration", admin.only(admin.h_calibration))
        return app

    @web.middleware
    async def _json_errors(self, request: web.Request, handler) -> web.StreamResponse:
        """The client conventions (API key, request id, OpenAI-shaped errors on /v1/*)
        around :meth:`_guarded`; the header time limit stops once a request starts."""
        return await with_client_conventions(
            request, lambda req: self._guarded(req, handler), keyed_paths=KEYED_PATHS,
            guards=self.guards, request_ids=self.request_ids, api_key=self.api_key,
            unauthorized_counter=self.metrics.errors.labels("unauthorized"))

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
