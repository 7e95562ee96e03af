"""ELDR router: one process's state and HTTP routes (aiohttp + orjson).

The jobs live in their own modules; this one composes them:

* :mod:`~eldr_sglang.router.workers`: worker pool, health checks, breakers, shared load;
* :mod:`~eldr_sglang.router.dispatch`: the PD dispatch flow (late binding);
* :mod:`~eldr_sglang.router.intake`: signature intake (HTTP and TCP);
* :mod:`~eldr_sglang.router.admin`: admin API;
* :mod:`~eldr_sglang.router.metrics`: observability (Prometheus, the one record);
* :mod:`~eldr_sglang.router.config`: every setting and its default.

The routing state (policy, encoder, tau, artifact path) is one immutable
:class:`Routing` value swapped in one step on a calibration reload, so a request
sees either the old pair or the new one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from eldr_sglang.core.policies import Decision, Policy, PolicyContext, PolicySpec, build_policy, policy_spec
from eldr_sglang.router import upstream
from eldr_sglang.router.ab import ABController, ShadowPolicy
from eldr_sglang.router.admin import AdminApi
from eldr_sglang.router.bodies import BodyParser
from eldr_sglang.router.client_guard import ClientGuards, GuardedSite
from eldr_sglang.router.clients import (REQUEST_ID_KEY, RequestIds, as_openai_error,
                                        bearer_matches, unauthorized)
from eldr_sglang.router.config import WORKER_KEEPALIVE_S, RouterConfig
from eldr_sglang.router.http_conventions import install as install_conventions
from eldr_sglang.router.dispatch import Dispatcher
from eldr_sglang.router.intake import SignatureIntake
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.online import CalibrationWatcher, OnlineController
from eldr_sglang.router.responses import JSON, error_response, json_response
from eldr_sglang.router.signatures import SignatureBoard, SignatureEncoder, WaitLimit, load_calibration
from eldr_sglang.router.workers import Worker, WorkerPool

logger = logging.getLogger("eldr_sglang.router")
WORK_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
# what --api-key guards: the work routes and what tells about the model
KEYED_PATHS = WORK_PATHS | {"/v1/models", "/model_info", "/get_model_info", "/server_info",
                            "/get_server_info", "/health_generate"}
CLIENT_KEEPALIVE_S = 75.0  # idle keep-alive client connections (aiohttp's default: an hour)


DECISION_COUNTS_MAX = 64 << 10  # bytes of counts a decision log entry keeps per message


def _counts_bytes(msg: dict) -> int:
    counts = msg.get("counts")
    return counts.nbytes if isinstance(counts, np.ndarray) else 0


@dataclass(frozen=True)
class Routing:
    """The policy and what it was built from; replaced whole, never mutated."""

    spec: PolicySpec
    policy: Policy
    encoder: Optional[SignatureEncoder]
    tau: Optional[float]  # the tau in force for band policies (None: not used)
    calibration_path: Optional[str]

    @property
    def name(self) -> str:
        return self.spec.name


def _load_json(text: str) -> dict:
    if os.path.exists(text):
        with open(text) as f:
            return json.load(f)
    return json.loads(text)


class Router:
    """State and handlers of one ELDR router process.

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
        self.metrics = RouterMetrics()
        self.pool = WorkerPool(prefill, decode, c, self.metrics)
        if artifact is None and c.calibration:
            if (c.online or c.calibration_watch) and not os.path.exists(c.calibration):
                logger.info("%s does not exist yet: routing by load until a calibration "
                            "is %s", c.calibration, "fitted" if c.online else "written there")
            else:
                artifact = load_calibration(c.calibration)
        if domain_map is None and c.domain_map:
            domain_map = _load_json(c.domain_map)
        self.domain_map = domain_map or {}
        self.spec = policy_spec(c.policy)  # the configured policy
        self.routing = self._routing(self.spec,
                                     SignatureEncoder(artifact) if artifact is not None else None,
                                     c.calibration if artifact is not None else None)
        self.board = SignatureBoard(ttl=c.signature_ttl, max_buffered=c.signature_buffer,
                                    max_bytes=int(c.signature_buffer_mb * (1 << 20)))
        self.online = OnlineController(self) if c.online else None
        self.shadow = ShadowPolicy(self, c.shadow_policy) if c.shadow_policy else None
        self.ab: Optional[ABController] = None
        if c.ab_policies or c.ab_record:
            names = [p.strip() for p in (c.ab_policies or c.policy).split(",") if p.strip()]
            arms = [self.build_routing(policy_spec(p), self.routing.encoder) for p in names]
            self.ab = ABController(self, arms, c.ab_slice, c.ab_record,
                                   [u.strip() for u in (c.engine_metrics or "").split(",") if u.strip()],
                                   c.ab_label)
            self.routing = arms[0]
        self.watcher = (CalibrationWatcher(self, c.calibration, c.calibration_watch)
                        if c.calibration_watch else None)
        self.parser = BodyParser()
        self.intake = SignatureIntake(self.board, self.metrics,
                                      int(min(c.signature_max_kb * 1024, c.max_body_mb * (1 << 20))),
                                      encoder=lambda: self.routing.encoder,
                                      buffering=lambda: self.routing.policy.needs_signature,
                                      observer=self._observe if self.online or self.shadow else None,
                                      parser=self.parser, body_timeout=c.client_body_timeout or None)
        self.wait_limit = WaitLimit(c.signature_timeout, c.signature_timeout_min,
                                    c.signature_timeout_factor)
        self.metrics.signature_wait_limit.set(self.wait_limit.value)
        self.api_key = c.api_key or os.environ.get("ELDR_API_KEY") or None
        self.worker_api_key = c.worker_api_key or os.environ.get("ELDR_WORKER_API_KEY") or None
        self.upstream = upstream.UpstreamClient(
            c.request_timeout, c.connect_timeout, WORKER_KEEPALIVE_S,
            first_byte_timeout=c.first_byte_timeout, idle_timeout=c.idle_timeout,
            max_per_worker=c.worker_max_connections, api_key=self.worker_api_key)
        self.body_limit = int(c.max_body_mb * (1 << 20))
        self.request_ids = RequestIds(c.request_id_headers)
        self.guards = ClientGuards(c.client_header_timeout,
                                   on_close=lambda: self.metrics.errors.labels("header_timeout").inc())
        self.inflight_limit = c.inflight_limit
        self.decisions: deque[tuple] = deque(maxlen=c.decisions_kept)
        self.decision_level = logging.INFO if c.log_decisions else logging.DEBUG
        self.dispatcher = Dispatcher(self)
        self.admin = AdminApi(self)
        self.session: Optional[aiohttp.ClientSession] = None
        self.return_address: Optional[str] = None  # tcp://host:port once the stream listens
        self.last_layers: Optional[list[int]] = None  # layers of the last signature message
        self.draining = False
        self._bg: set[asyncio.Task] = set()

    def _observe(self, msg: dict) -> None:
        """Every well-formed signature message: online calibration and shadow decisions."""
        if self.online is not None:
            self.online.observe(msg)
        if self.shadow is not None:
            self.shadow.on_message(msg)

    # ------------------------------------------------------------ routing state
    def _routing(self, spec: PolicySpec, encoder: Optional[SignatureEncoder],
                 path: Optional[str]) -> Routing:
        """The configured policy; while an artifact policy waits for its first artifact
        (``--online`` warming up, a followed file not written yet), least loaded."""
        c = self.config
        if spec.needs_artifact and encoder is None and (c.online or c.calibration_watch):
            spec = policy_spec("jsq")
        ctx = PolicyContext(
            len(self.pool.decodes), seed=c.seed, tau=c.tau,
            centroids=encoder.centroids if encoder is not None else None,
            artifact_tau=encoder.tau if encoder is not None else None,
            domain_map=self._domain_indices(self.domain_map))
        if spec.needs_domain_map and not self.domain_map:
            raise ValueError(f"{spec.name} policy needs a domain map (--domain-map)")
        policy = build_policy(spec.name, ctx)
        return Routing(spec, policy, encoder, ctx.effective_tau if spec.needs_artifact else None, path)

    def _domain_indices(self, domain_map: dict) -> dict[str, list[int]]:
        """Domain map values may be decode indices or decode URLs."""
        urls = [d.url for d in self.pool.decodes]
        out = {}
        for label, servers in domain_map.items():
            idx = []
            for s in servers if isinstance(servers, list) else [servers]:
                if isinstance(s, int) and 0 <= s < len(urls):
                    idx.append(s)
                elif isinstance(s, str) and s.rstrip("/") in urls:
                    idx.append(urls.index(s.rstrip("/")))
                else:
                    raise ValueError(f"domain map: unknown decode server {s!r} for {label!r}")
            out[str(label)] = idx
        return out

    def build_routing(self, spec: PolicySpec, encoder: Optional[SignatureEncoder]) -> Routing:
        """A routing for ``spec`` on the live pool (shadow policies, A/B arms)."""
        return self._routing(spec, encoder, self.routing.calibration_path)

    def set_routing(self, routing: Routing) -> None:
        """Swap the live routing (A/B slices): requests in flight keep theirs."""
        self.routing = routing

    @property
    def policy(self) -> Policy:
        return self.routing.policy

    @property
    def encoder(self) -> Optional[SignatureEncoder]:
        return self.routing.encoder

    @property
    def tau(self) -> Optional[float]:
        return self.routing.tau

    @property
    def decodes(self) -> list[Worker]:
        return self.pool.decodes

    @property
    def prefills(self) -> list[Worker]:
        return self.pool.prefills

    def reload_calibration(self, path: str) -> dict:
        """Swap in the artifact at ``path`` (validated by ``load_artifact``: format,
        shapes, checksum); ValueError leaves the current one in place.

        Policies that declare ``rebuild_on_reload`` are built again from it (server i
        owns centroid i; K != N handled by ``CentroidOwnership``); ``--tau`` given at
        start-up stays, otherwise the new artifact's tau is used (0 included)."""
        art = load_calibration(path)
        out = self.install_artifact(art, str(path))
        if self.online is not None:
            self.online.adopt(art)
        return out

    def install_artifact(self, art: Any, path: str, origin: str = "file") -> dict:
        """Make ``art`` the live calibration in one step (a reload, an online fit)."""
        enc = SignatureEncoder(art)
        old = self.routing
        if self.spec.rebuild_on_reload or old.spec is not self.spec:
            new = self._routing(self.spec, enc, path)
        else:
            new = replace(old, encoder=enc, calibration_path=path)
        warnings = []
        k, n = int(enc.centroids.shape[0]), len(self.pool.decodes)
        if k != n:
            warnings.append(f"{k} centroids for {n} decode servers: "
                            + ("several centroids per server" if k > n else "servers share centroids"))
        if self.last_layers is not None and [int(x) for x in self.last_layers] != enc.layers:
            warnings.append(f"prefill plugin last sent layers {self.last_layers}, artifact has "
                            f"{enc.layers}: signatures will fall back until the plugin matches")
        self.routing = new  # one step: requests see the old pair or the new one
        if self.ab is not None:  # every arm moves to the new artifact
            self.ab.routings = [self._routing(a.spec, enc, path) for a in self.ab.routings]
            if self.ab.current is not None:
                self.routing = self.ab.routings[self.ab.current.index % len(self.ab.routings)]
        if origin == "file":
            self.metrics.reloads.labels("ok").inc()
        logger.info("calibration reloaded from %s: K=%d dim=%d tau=%s%s", path, k,
                    enc.centroids.shape[1], new.tau, f" ({'; '.join(warnings)})" if warnings else "")
        return {"ok": True, "path": str(path),
                "previous": old.encoder.describe() if old.encoder else None,
                "artifact": enc.describe(), "tau": new.tau, "warnings": warnings,
                "policy_state": new.policy.describe()}

    def change_servers(self, add: Sequence[str] = (), remove: Sequence[str] = (),
                       add_prefill: Sequence[tuple[str, Optional[int]]] = (),
                       remove_prefill: Sequence[str] = ()) -> None:
        """Membership changes; in-flight requests keep the worker objects they hold.
        Every policy that follows the pool (the live one, the other A/B arms) is told;
        the shadow policy is rebuilt at its next use."""
        pool = self.pool
        routings = [self.routing] + (self.ab.routings if self.ab is not None else [])
        policies = list({id(r.policy): r.policy for r in routings}.values())
        for url in remove:
            i = pool.decode_index(url)
            pool.remove_decode(i)
            for policy in policies:
                policy.remove_server(i)
        for url in add:
            pool.add_decode(url)
            for policy in policies:
                policy.add_server()
        if self.shadow is not None and (add or remove):
            self.shadow.policy = None
        for url in remove_prefill:
            pool.remove_prefill(url)
        for url, port in add_prefill:
            pool.add_prefill(url, port)
        if self.online is not None and (add or remove):
            self.online.maybe_fit()  # K = decode servers again, the others' regions kept

    # backwards-compatible shorthands
    def add_decode(self, url: str) -> None:
        self.change_servers(add=[url])

    def remove_decode(self, url: str) -> None:
        self.change_servers(remove=[url])

    # ------------------------------------------------------------ helpers
    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    def label_of(self, request: web.Request, body: dict) -> Optional[str]:
        c = self.config
        if c.label_header and c.label_header in request.headers:
            return request.headers[c.label_header]
        if c.label_field and c.label_field in body:
            return str(body.pop(c.label_field))
        return None

    def record(self, rids: list[str], rooms: list[int], label: Optional[str],
               waiters: list[asyncio.Future], d: Worker, dec: Decision, loads: list[int],
               shadow: Optional[dict] = None) -> None:
        """Keep the decision for ``GET /eldr/decisions`` (rendered when read): O(K + N)
        numbers (similarities, loads) and the signature messages, whose counts are kept
        (a reference, no copy) up to ``DECISION_COUNTS_MAX`` bytes each, so the log holds at
        most ``decisions_kept`` x 64 KiB of counts."""
        messages = [m if _counts_bytes(m) <= DECISION_COUNTS_MAX else
                    {k: v for k, v in m.items() if k != "counts"}
                    for m in (w.result() for w in waiters
                              if w.done() and not w.cancelled() and w.exception() is None)]
        self.decisions.append((time.time(), rids, rooms, label, dec.policy, d.url,
                               self.pool.decodes.copy(), loads, messages, dec, shadow))

    @staticmethod
    def render_decision(rec: tuple) -> dict:
        when, rids, rooms, label, policy, url, decodes, load_list, messages, dec, shadow = rec
        loads = [(x.url, n) for x, n in zip(decodes, load_list)]
        messages = [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in m.items()}
                    for m in messages]
        out = {"time": when, "rids": rids, "rooms": rooms, "label": label, "policy": policy,
               "decode": url, "loads": dict(loads), "messages": messages, "reason": dec.reason}
        if shadow is not None:
            out["shadow"] = dict(shadow)
        if dec.band is not None:
            out["band"] = [loads[i][0] for i in dec.band if i < len(loads)]
            out["best_similarity"] = dec.best_similarity
        if dec.centroid_similarities is not None:
            out["similarities"] = dec.centroid_similarities.tolist()
        return out

    async def fan_out(self, path: str, method: str = "GET") -> list[tuple[Worker, int, Any]]:
        async def one(s: Worker):
            try:
                async with self.session.request(method, s.endpoint(path),
                                                timeout=aiohttp.ClientTimeout(total=30)) as r:
                    raw = await r.read()
                    try:
                        return s, r.status, orjson.loads(raw) if raw else None
                    except orjson.JSONDecodeError:
                        return s, r.status, raw.decode("utf-8", "replace")
            except Exception as e:  # noqa: BLE001
                return s, 0, repr(e)
        return await asyncio.gather(*(one(s) for s in self.pool.all()))

    def status(self) -> dict:
        rt, pool = self.routing, self.pool
        return {
            "pid": os.getpid(), "policy": rt.name, "tau": rt.tau,
            "signature_timeout": self.wait_limit.value,
            "signature_port": self.intake.port, "signature_streams": len(self.intake.streams),
            "return_address": self.return_address,
            "artifact": rt.encoder.describe() if rt.encoder else None,
            "calibration_path": rt.calibration_path,
            "draining": self.draining, "active_requests": self.dispatcher.active,
            "inflight_limit": self.inflight_limit,
            "health_interval": self.config.health_interval,
            "prefill": [s.describe() for s in pool.prefills],
            "decode": [s.describe() for s in pool.decodes],
            "loads": pool.decode_loads(),
            "policy_state": rt.policy.describe(),
            "calibration": self.calibration_info(),
            "ab": self.ab.describe() if self.ab else None,
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

    async def h_health(self, request: web.Request) -> web.Response:
        if self.draining:
            return error_response(503, "router is draining")
        return web.Response(status=200)

    def readiness(self) -> dict:
        """Ready = at least one healthy prefill and one healthy decode server."""
        pool = self.pool
        healthy = {"prefill": sum(w.available() for w in pool.prefills),
                   "decode": sum(w.available() for w in pool.decodes)}
        ready = not self.draining and healthy["prefill"] > 0 and healthy["decode"] > 0
        return {"ready": ready, "draining": self.draining, "healthy": healthy,
                "servers": {"prefill": len(pool.prefills), "decode": len(pool.decodes)}}

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
        decode = [b for s, _, b in res if s.role == "decode"]
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
                async with self.session.get(s.endpoint(path),
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

    async def h_metrics(self, request: web.Request) -> web.Response:
        for s in self.pool.all():
            s.update_gauges()
        m = self.metrics
        m.board.labels("waiting").set(len(self.board.waiters))
        m.board.labels("buffered").set(len(self.board.buffer))
        m.draining.set(int(self.draining))
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
        return json_response({**self.calibration_info(),
                              "policy_state": self.routing.policy.describe()})

    # ------------------------------------------------------------ lifecycle
    async def drain(self, timeout: float) -> bool:
        """Refuse new work (503), wait for in-flight requests; True if all finished."""
        self.draining = True
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
            self.return_address = f"tcp://{c.signature_host_for(host)}:{port}"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300,
                                           keepalive_timeout=WORKER_KEEPALIVE_S),
            json_serialize=lambda o: orjson.dumps(o).decode(),
            headers=({"Authorization": f"Bearer {self.worker_api_key}"}
                     if self.worker_api_key else None))
        self.pool.session = self.session
        self.dispatcher.idle = asyncio.Event()  # bound to the serving loop
        if self.dispatcher.active == 0:
            self.dispatcher.idle.set()
        if c.health_interval > 0:
            self.spawn(self.pool.run_periodic(c.health_interval, self.pool.check_health))
        if c.load_interval > 0:
            self.spawn(self.pool.run_periodic(c.load_interval, self.pool.poll_loads))
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
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        self.upstream.close()
        self.parser.close()

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._json_errors], client_max_size=self.body_limit)
        install_conventions(app, self.config, self.config.request_id_headers)  # CORS, access log
        r, admin = app.router, self.admin
        r.add_post("/generate", self.h_generate)
        r.add_post("/v1/completions", self.h_completions)
        r.add_post("/v1/chat/completions", self.h_chat)
        r.add_get("/v1/models", self.h_models)
        r.add_get("/health", self.h_health)
        r.add_get("/liveness", self.h_health)
        r.add_get("/ready", self.h_ready)
        r.add_get("/readiness", self.h_ready)
        r.add_get("/health_generate", self.h_health_generate)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.h_server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.h_model_info)
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
        self.guards.started(request)
        try:
            path = request.path
            if path not in KEYED_PATHS and not path.startswith("/v1/"):
                return await self._guarded(request, handler)
            rid = request[REQUEST_ID_KEY] = self.request_ids.of(request)
            if self.api_key and not bearer_matches(request, self.api_key):
                self.metrics.errors.labels("unauthorized").inc()
                resp = unauthorized()
            else:
                resp = await self._guarded(request, handler)
            if not resp.prepared:  # a stream sets the header itself before its first byte
                resp.headers[rid[0]] = rid[1]
                if path.startswith("/v1/") and resp.status >= 400 and isinstance(resp, web.Response):
                    resp = as_openai_error(resp)
            return resp
        finally:
            self.guards.ended(request)

    async def _guarded(self, request: web.Request, handler) -> web.StreamResponse:
        """Drain gate, and every error leaves as JSON ``{"error": ...}``; never a traceback."""
        if self.draining and request.path in WORK_PATHS:
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


async def start_router(router: Any, host: str = "127.0.0.1", port: int = 0,
                       reuse_port: bool = False) -> tuple[web.AppRunner, int]:
    """Start ``router`` on host:port (0 = any free port); returns (runner, port).

    ``router``: a :class:`Router`, or any object with ``build_app`` and
    ``start_background``/``stop_background`` (the co-located router); connections go
    through its ``guards`` (header time limit) when it has them."""
    app = router.build_app()

    async def on_startup(_: web.Application) -> None:
        await router.start_background(host)

    async def on_cleanup(_: web.Application) -> None:
        await router.stop_background()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                           keepalive_timeout=CLIENT_KEEPALIVE_S)
    await runner.setup()
    guards = getattr(router, "guards", None)
    site = (GuardedSite(runner, guards, host, port, reuse_port=reuse_port) if guards is not None
            else web.TCPSite(runner, host, port, reuse_port=reuse_port or None))
    try:
        await site.start()
    except OSError:
        await runner.cleanup()  # close the worker session and the signature stream
        raise
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
