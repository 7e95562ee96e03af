"""ELDR router: late-binding prefill/decode dispatch for SGLang (aiohttp + orjson).

One request, in the spirit of sglang_router's MiniLoadBalancer but late-binding:

1. pick a prefill server (least in-flight, ties round robin); add ``bootstrap_host``,
   ``bootstrap_port`` and a random 63-bit ``bootstrap_room`` (lists for a batch) and
   a ``rid`` if the client gave none; POST the body to the prefill server in the
   background (its response only arrives after decode bound and KV moved);
2. if the policy needs a signature, wait (``--signature-timeout``) for the prefill
   plugin's message for that room on ``POST /eldr/signature`` (or the TCP stream of
   ``--signature-port``: one JSON message per line, no answers); a prefill error
   arriving first is returned to the client; a timeout or bad message falls back
   to JSQ (counted);
3. ``policy.choose(RouteRequest(signature, label), loads, healthy)`` picks the
   decode server; the same body goes there; its response (or SSE stream) goes back
   to the client. A room binds once, so a decode is re-tried elsewhere only when
   the connection was refused (the request never reached it).

Policies that need no signature take the same path and pick at once (no wait).
A batch is routed as a whole by the normalised sum of its items' signatures.
Client disconnect aborts the rid(s) on both servers (``/abort_request``).

Reliability: active health checks (``GET /health`` every ``health_interval`` s;
``health_failures`` misses take a worker out, one success brings it back); a
per-worker circuit breaker (a refused connection, or ``breaker_threshold``
consecutive failures, opens it for ``health_cooldown`` s; then half-open: one
trial request closes or re-opens it); retries only for refused connections (the
worker never saw the request): prefill when the decode has not been sent yet,
decode never after a decode server received the request (a room binds once);
graceful drain (``drain()``: new work gets 503, in-flight requests finish).
Admin endpoints (``POST /eldr/servers``, ``POST /eldr/calibration``) are
loopback-only, or need ``Authorization: Bearer <admin_token>`` when one is set.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import random
import time
import urllib.parse
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Optional, Sequence

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from eldr_sglang.core.policies import Decision, RouteRequest, least_loaded, make_policy
from eldr_sglang.router import upstream
from eldr_sglang.router.metrics import BREAKER_STATES, RouterMetrics
from eldr_sglang.router.signatures import (SignatureBoard, SignatureEncoder, SignatureError,
                                           combine, load_calibration, parse_message)

# SGLang's HTTP server (uvicorn) closes idle keep-alive connections after 5 s
# (SGLANG_TIMEOUT_KEEP_ALIVE); the router must drop them first, else reusing one
# races with its close and a request fails ("Server disconnected", "Can not write
# request body").
WORKER_KEEPALIVE_S = 3.0
logger = logging.getLogger("eldr_sglang.router")
decision_logger = logging.getLogger("eldr_sglang.router.decisions")
WORK_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})

JSON = "application/json"


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY),
                        status=status, content_type=JSON)


def error_response(status: int, message: str) -> web.Response:
    return json_response({"error": message}, status)


def worker_error_response(status: int, body: bytes, url: str) -> web.Response:
    """A worker's error answer with its status code, always carrying an ``error`` key.

    SGLang answers an aborted request with FastAPI's ``{"detail": ...}`` and its
    OpenAI routes with ``{"object": "error", "message": ...}``; clients of the router
    get those fields unchanged plus ``error`` naming the worker."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and "error" in obj:
        return json_response(obj, status)
    if isinstance(obj, dict):
        message = obj.get("message") or obj.get("detail") or f"HTTP {status}"
        return json_response({**obj, "error": f"worker {url}: {message}"}, status)
    text = body.decode("utf-8", "replace")[:2000].strip() or f"HTTP {status}"
    return error_response(status, f"worker {url}: {text}")


def _host_of(url: str) -> str:
    host = urllib.parse.urlparse(url).hostname or ""
    try:
        ipaddress.IPv6Address(host)
        return f"[{host}]"
    except ValueError:
        return host


@dataclass(eq=False)
class Server:
    """One upstream SGLang server: load, active-health and circuit-breaker state."""

    url: str
    role: str
    bootstrap_port: Optional[int] = None
    inflight: int = 0
    requests: int = 0
    failures: int = 0
    alive: bool = True  # verdict of the active health checks
    health_misses: int = 0  # consecutive failed health checks
    consecutive_failures: int = 0  # consecutive failed requests (breaker input)
    breaker: str = "closed"  # closed | open | half_open
    open_until: float = 0.0
    trial: bool = False  # half-open: the one trial request is in flight
    host: str = field(init=False)
    m: Any = field(default=None, repr=False)  # cached Prometheus children (hot path)
    _endpoints: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.host = _host_of(self.url)

    def endpoint(self, path: str) -> str:
        """``url/path``, built once (the hot path posts to the same few endpoints)."""
        u = self._endpoints.get(path)
        if u is None:
            u = self._endpoints[path] = f"{self.url}/{path}"
        return u

    def healthy(self, now: float) -> bool:
        """May be picked now: health checks pass and the breaker lets a request through."""
        if not self.alive:
            return False
        if self.breaker == "closed":
            return True
        if self.breaker == "open" and now < self.open_until:
            return False
        return not self.trial  # half-open (or open past its cooldown): one trial at a time

    def describe(self, now: float) -> dict:
        return {"url": self.url, "inflight": self.inflight, "requests": self.requests,
                "failures": self.failures, "healthy": self.healthy(now), "alive": self.alive,
                "breaker": self.breaker, "consecutive_failures": self.consecutive_failures,
                **({"bootstrap_port": self.bootstrap_port} if self.role == "prefill" else {})}


@dataclass
class PrefillResult:
    status: int  # HTTP status; 0 when the call itself failed
    body: bytes
    error: str = ""
    url: str = ""  # the prefill server that answered

    @property
    def ok(self) -> bool:
        return self.status == 200


class _Flight:
    """One client request on its way: body, chosen prefill, the bytes sent upstream."""

    __slots__ = ("body", "n", "prefill", "payload", "decode_sent")

    def __init__(self, body: dict, n: Optional[int]) -> None:
        self.body, self.n = body, n
        self.decode_sent = False

    def set_prefill(self, p: "Server") -> None:
        n, body = self.n, self.body
        self.prefill = p
        body["bootstrap_host"] = [p.host] * n if n else p.host
        body["bootstrap_port"] = [p.bootstrap_port] * n if n else p.bootstrap_port
        self.payload = orjson.dumps(body)


class _NoSignature(Exception):
    """Ends a wait for a room's signature message without one (timeout, failed prefill)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _delivered(w: asyncio.Future) -> bool:
    """The room's signature message arrived (the future holds it)."""
    return w.done() and not w.cancelled() and w.exception() is None


def batch_size(body: dict) -> Optional[int]:
    """None for a single /generate request, else the batch length; ValueError if malformed."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise ValueError("give only one of 'text' and 'input_ids'")  # as SGLang does
    if text is not None:
        if isinstance(text, str):
            return None
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return len(text)
        raise ValueError("'text' must be a string or a non-empty list of strings")
    if ids is not None:
        if isinstance(ids, list) and ids:
            if all(isinstance(t, int) for t in ids):
                return None
            if all(isinstance(t, list) and t and all(isinstance(x, int) for x in t) for t in ids):
                return len(ids)
        raise ValueError("'input_ids' must be a non-empty list of ints or of int lists")
    if body.get("input_embeds") is None:
        raise ValueError("request needs 'text', 'input_ids' or 'input_embeds'")
    return None


def _validate_openai(endpoint: str, body: dict) -> None:
    if endpoint == "v1/completions" and not isinstance(body.get("prompt"), (str, list)):
        raise ValueError("'prompt' must be a string or a list")
    if endpoint == "v1/chat/completions" and not (
            isinstance(body.get("messages"), list) and body["messages"]):
        raise ValueError("'messages' must be a non-empty list")


class Router:
    """State and handlers of one ELDR router process."""

    def __init__(
        self,
        prefill: Sequence[tuple[str, Optional[int]]],
        decode: Sequence[str],
        policy: str = "eldr",
        *,
        artifact: Any = None,
        tau: Optional[float] = None,
        domain_map: Optional[dict] = None,
        label_field: Optional[str] = None,
        label_header: Optional[str] = None,
        signature_timeout: float = 30.0,
        signature_ttl: float = 30.0,
        signature_buffer: int = 4096,
        health_cooldown: float = 10.0,
        health_interval: float = 10.0,
        health_timeout: float = 5.0,
        health_failures: int = 2,
        breaker_threshold: int = 5,
        request_timeout: float = 1800.0,
        connect_timeout: float = 5.0,
        max_body_mb: float = 32.0,
        admin_token: Optional[str] = None,
        log_decisions: bool = False,
        calibration_path: Optional[str] = None,
        seed: Optional[int] = 0,
        signature_listen: Optional[tuple[str, int]] = None,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode server")
        self.prefills = [Server(u, "prefill", p) for u, p in prefill]
        self.decodes = [Server(u, "decode") for u in decode]
        self.encoder = SignatureEncoder(artifact) if artifact is not None else None
        self.tau_override = tau
        self.tau = tau if tau is not None else (self.encoder.tau if self.encoder else 0.1)
        self.seed = seed
        self.calibration_path = calibration_path
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.health_failures = max(1, int(health_failures))
        self.breaker_threshold = max(1, int(breaker_threshold))
        self.max_body = int(max_body_mb * 1024 * 1024)
        self.admin_token = admin_token or None
        self.decision_level = logging.INFO if log_decisions else logging.DEBUG
        self.draining = False
        self.active = 0  # client requests being served
        self._idle = asyncio.Event()
        self._idle.set()
        self.last_layers: Optional[list[int]] = None  # layers of the last signature message
        self.policy_name = policy
        self.policy = make_policy(
            policy, len(self.decodes), tau=self.tau, seed=seed,
            centroids=self.encoder.centroids if self.encoder else None,
            domain_map=self._domain_indices(domain_map or {}))
        self.label_field, self.label_header = label_field, label_header
        self.signature_timeout = signature_timeout
        self.health_cooldown = health_cooldown
        self.timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout)
        # the prefill and decode posts of every request (the hot path); aiohttp for the rest
        self.upstream = upstream.UpstreamClient(request_timeout, connect_timeout, WORKER_KEEPALIVE_S)
        self.board = SignatureBoard(ttl=signature_ttl, max_buffered=signature_buffer)
        self.decisions: deque[tuple] = deque(maxlen=256)  # recent routing decisions, for /eldr/decisions
        self.metrics = RouterMetrics()
        self.counters: Counter[str] = Counter()
        self.session: Optional[aiohttp.ClientSession] = None
        self._rr = 0
        self._bg: set[asyncio.Task] = set()
        self.signature_listen = signature_listen  # (host, port) of the TCP signature stream
        self.signature_port: Optional[int] = None  # bound port once started
        self._signature_server: Optional[asyncio.AbstractServer] = None
        self._streams: set[asyncio.StreamWriter] = set()
        self._fallback_rng = np.random.default_rng(seed)
        self._decision_children: dict[str, Any] = {}
        self._duration_children: dict[str, Any] = {}
        for s in chain(self.prefills, self.decodes):
            self._gauge(s)

    # ---------------------------------------------------------------- helpers
    def _domain_indices(self, domain_map: dict) -> dict[str, list[int]]:
        """Domain map values may be decode indices or decode URLs."""
        urls = [d.url for d in self.decodes]
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

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] += n

    def _m(self, s: Server) -> tuple:
        """Per-server metric children, looked up once (``labels()`` costs ~5 us)."""
        if s.m is None:
            m, lab = self.metrics, (s.role, s.url)
            s.m = (m.inflight.labels(*lab), m.healthy.labels(*lab), m.breaker.labels(*lab),
                   m.worker_requests.labels(*lab), m.requests.labels(self.policy_name, s.url))
        return s.m

    def _gauge(self, s: Server) -> None:
        inflight, healthy, breaker = self._m(s)[:3]
        inflight.set(s.inflight)
        healthy.set(int(s.healthy(time.monotonic())))
        breaker.set(BREAKER_STATES[s.breaker])

    def _enter(self, s: Server) -> None:
        s.inflight += 1
        s.requests += 1
        m = self._m(s)
        m[3].inc()
        if s.breaker != "closed":  # past its cooldown: this request is the half-open trial
            s.breaker, s.trial = "half_open", True
            self._gauge(s)
        else:
            m[0].set(s.inflight)

    def _leave(self, s: Server) -> None:
        s.inflight -= 1
        self._m(s)[0].set(s.inflight)

    def _open_breaker(self, s: Server, why: str) -> None:
        if s.breaker != "open":
            self._count(f"{s.role}_breaker_opened")
            logger.warning("%s %s: circuit breaker open for %.1fs (%s)", s.role, s.url,
                           self.health_cooldown, why)
        s.breaker, s.trial = "open", False
        s.open_until = time.monotonic() + self.health_cooldown

    def _failed(self, s: Server, why: str, down: bool, kind: str = "http_5xx") -> None:
        """Count a worker failure. ``down`` (connection-level) opens the breaker at
        once; otherwise ``breaker_threshold`` consecutive failures (or a failed
        half-open trial) do."""
        s.failures += 1
        s.consecutive_failures += 1
        self._count(f"{s.role}_failures")
        self.metrics.upstream_failures.labels(s.role, s.url).inc()
        self.metrics.worker_errors.labels(s.role, s.url, kind).inc()
        if down:
            self._count(f"{s.role}_marked_unhealthy")
        if down or s.breaker != "closed" or s.consecutive_failures >= self.breaker_threshold:
            self._open_breaker(s, why)
        self._gauge(s)
        logger.warning("%s %s failed: %s", s.role, s.url, why)

    def _success(self, s: Server) -> None:
        s.consecutive_failures = 0
        if s.breaker != "closed":
            logger.info("%s %s: circuit breaker closed", s.role, s.url)
            s.breaker, s.trial = "closed", False
            self._gauge(s)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    def _label(self, request: web.Request, body: dict) -> Optional[str]:
        if self.label_header and self.label_header in request.headers:
            return request.headers[self.label_header]
        if self.label_field and self.label_field in body:
            return str(body.pop(self.label_field))
        return None

    # ---------------------------------------------------------------- selection
    def pick_prefill(self, exclude: set[int] = frozenset()) -> Optional[Server]:
        """Least in-flight healthy prefill; ties go round robin. ``exclude``: ids of
        servers already tried (then None when none is left)."""
        now = time.monotonic()
        n = len(self.prefills)
        order = [self.prefills[(self._rr + i) % n] for i in range(n)]
        self._rr = (self._rr + 1) % n
        if exclude:
            order = [s for s in order if id(s) not in exclude]
            if not order:
                return None
        pool = [s for s in order if s.healthy(now)] or order
        return min(pool, key=lambda s: s.inflight)

    def pick_decode(self, req: RouteRequest, exclude: set[int] = frozenset()) -> Server:
        return self.decide(req, exclude)[0]

    def decide(self, req: RouteRequest, exclude: set[int] = frozenset(),
               rids: Sequence[str] = ()) -> tuple[Server, Decision]:
        """Pick the decode server with ``policy.explain`` (same pick as ``choose``)."""
        now = time.monotonic()
        decodes = self.decodes
        loads = [d.inflight for d in decodes]
        allowed = [d.healthy(now) and i not in exclude for i, d in enumerate(decodes)]
        if not any(allowed):
            allowed = [i not in exclude for i in range(len(decodes))]
        t0 = time.perf_counter()
        try:
            dec = self.policy.explain(req, loads, allowed)
        except (ValueError, IndexError) as e:
            logger.error("policy %s failed (%s); using least in-flight", self.policy_name, e)
            self._count("policy_errors")
            self.metrics.errors.labels("policy").inc()
            dec = Decision(least_loaded(loads, np.flatnonzero(allowed), self._fallback_rng),
                           self.policy_name, "policy_error")
        self.metrics.choose_time.observe(time.perf_counter() - t0)
        d = decodes[dec.index]
        m = self.metrics
        self._m(d)[4].inc()
        if not self.policy.needs_signature:
            kind = "blind"
        else:
            kind = "signature" if req.signature is not None else "fallback"
        child = self._decision_children.get(kind)
        if child is None:
            child = self._decision_children[kind] = m.decisions.labels(self.policy_name, kind)
        child.inc()
        if dec.band is not None:
            m.band_size.observe(len(dec.band))
            m.best_similarity.observe(dec.best_similarity)
        if decision_logger.isEnabledFor(self.decision_level):
            decision_logger.log(
                self.decision_level,
                "decision rids=%s policy=%s reason=%s top3=%s band=%s loads=%s allowed=%s chosen=%d %s",
                list(rids)[:4], self.policy_name, dec.reason,
                [(decodes[i].url, round(v, 4)) for i, v in dec.top(3)],
                list(dec.band) if dec.band is not None else None, loads,
                [i for i, a in enumerate(allowed) if a], dec.index, d.url)
        return d, dec

    # ---------------------------------------------------------------- signature
    @staticmethod
    async def _await_rooms(waiters: list[asyncio.Future], prefill_task: asyncio.Task,
                           deadline: float) -> Optional[PrefillResult]:
        """Wait on the rooms' own futures (one wake-up per message) until all hold
        their message, the deadline passes or the prefill fails (its result is then
        returned); the futures left without a message then hold :class:`_NoSignature`."""
        loop = asyncio.get_running_loop()

        def end(reason: str) -> None:
            for w in waiters:
                if not w.done():
                    w.set_exception(_NoSignature(reason))

        def on_prefill(t: asyncio.Task) -> None:
            if not t.cancelled() and (t.exception() is not None or not t.result().ok):
                end("prefill_failed")  # a raising prefill task re-raises below, as before

        timer = loop.call_at(deadline, end, "timeout")
        prefill_task.add_done_callback(on_prefill)
        try:
            for w in waiters:
                await w
        except _NoSignature as e:
            if e.reason == "prefill_failed":
                return prefill_task.result()
        finally:
            timer.cancel()
            prefill_task.remove_done_callback(on_prefill)
            for w in waiters:
                if w.done() and not w.cancelled():
                    w.exception()  # retrieved (also when this task was cancelled meanwhile)
        return None

    async def _await_signature(self, waiters: list[asyncio.Future], prefill_task: asyncio.Task,
                               ) -> tuple[Optional[np.ndarray], Optional[PrefillResult], float]:
        """Wait for the room(s)' signatures: (vector or None, failed prefill or None, wait s)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        failed = await self._await_rooms(waiters, prefill_task, t0 + self.signature_timeout)
        if failed is not None:
            return None, failed, loop.time() - t0
        waited = loop.time() - t0
        self.metrics.signature_wait.observe(waited)
        vectors, reasons = [], []
        for w in waiters:
            if not _delivered(w):
                reasons.append("timeout")
                continue
            self._count("signatures_used")
            self.last_layers = w.result().get("layers")
            if self.encoder is None:
                reasons.append("no_artifact")
                continue
            try:
                vectors.append(self.encoder.encode(w.result()))
            except SignatureError as e:
                reasons.append(e.reason)
                self._count(f"signature_{e.reason}")
                self.metrics.errors.labels(e.reason).inc()
                logger.warning("room %s: %s", w.result().get("bootstrap_room"), e)
        for r in reasons:
            self._count(f"fallback_{r}")
            self.metrics.fallbacks.labels(r).inc()
        if not vectors:
            self._count("fallbacks")
        return combine(vectors), None, waited

    # ---------------------------------------------------------------- upstream calls
    async def _call_prefill(self, fl: "_Flight", endpoint: str) -> PrefillResult:
        """POST to prefill and read the whole answer (late binding: arrives after decode).

        A refused connection (the server never saw the request) is retried on another
        prefill server, with that server's bootstrap host/port, as long as the decode
        request has not been sent (it names the prefill's bootstrap address)."""
        tried: set[int] = set()
        while True:
            s = fl.prefill
            self._enter(s)
            try:
                resp = await self.upstream.post(s.endpoint(endpoint), fl.payload)
                try:
                    body = await resp.read()
                finally:
                    resp.release()
                if resp.status == 200:
                    self._success(s)
                elif resp.status >= 500:
                    self._failed(s, f"HTTP {resp.status}: {body[:200]!r}", down=False)
                else:
                    self.metrics.worker_errors.labels(s.role, s.url, "http_4xx").inc()
                return PrefillResult(resp.status, body, url=s.url)
            except upstream.ConnectError as e:
                self._failed(s, repr(e), down=True, kind="connect")
                tried.add(id(s))
                alt = None if fl.decode_sent else self.pick_prefill(exclude=tried)
                if alt is not None:
                    self._count("prefill_retries")
                    self.metrics.retries.labels("prefill").inc()
                    fl.set_prefill(alt)
                    continue
                return PrefillResult(0, b"", f"prefill server {s.url} unreachable: {type(e).__name__}")
            except upstream.UpstreamError as e:  # Timeout, Disconnected
                kind = "timeout" if isinstance(e, upstream.Timeout) else "disconnect"
                self._failed(s, repr(e), down=True, kind=kind)
                return PrefillResult(0, b"", f"prefill server {s.url} unreachable: {type(e).__name__}")
            finally:
                self._leave(s)

    async def _abort(self, rids: list[str], servers: list[Server]) -> None:
        """Best-effort ``/abort_request`` for every rid on every server."""
        self._count("aborts")
        timeout = aiohttp.ClientTimeout(total=5)

        async def one(s: Server, rid: str) -> None:
            try:
                async with self.session.post(f"{s.url}/abort_request", json={"rid": rid},
                                             timeout=timeout) as r:
                    await r.read()
            except Exception as e:  # noqa: BLE001 - best effort
                logger.info("abort %s on %s failed: %r", rid, s.url, e)

        await asyncio.gather(*(one(s, r) for s in servers for r in rids))

    def _prefill_error(self, res: PrefillResult) -> web.Response:
        self._count("prefill_errors_returned")
        if res.status == 0:
            return error_response(503, res.error)
        return worker_error_response(res.status, res.body, res.url)

    async def _open_decode(self, d: Server, endpoint: str, payload: bytes,
                           prefill_task: asyncio.Task):
        """POST to decode; returns its response, a failed PrefillResult, or an exception."""
        post = asyncio.ensure_future(self.upstream.post(d.endpoint(endpoint), payload))
        watch = {post} if prefill_task.done() else {post, prefill_task}
        try:
            while True:
                done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
                if post in done:
                    try:
                        return post.result()
                    except upstream.UpstreamError as e:
                        return e
                res = prefill_task.result()
                if not res.ok:
                    post.cancel()
                    return res
                watch = {post}
        except BaseException:
            post.cancel()
            raise

    # ---------------------------------------------------------------- dispatch
    async def dispatch(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        self.active += 1
        self._idle.clear()
        self.metrics.client_requests.set(self.active)
        try:
            return await self._dispatch(request, endpoint, t0)
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()
            self.metrics.client_requests.set(self.active)
            child = self._duration_children.get(endpoint)
            if child is None:
                child = self._duration_children[endpoint] = self.metrics.request_duration.labels(endpoint)
            child.observe(time.perf_counter() - t0)

    async def _dispatch(self, request: web.Request, endpoint: str, t0: float) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            return self._bad(f"invalid JSON body: {e}")
        if not isinstance(body, dict):
            return self._bad("request body must be a JSON object")
        try:
            n = batch_size(body) if endpoint == "generate" else None
            if endpoint != "generate":
                _validate_openai(endpoint, body)
            rids = self._set_rid(body, n)
        except ValueError as e:
            return self._bad(str(e))
        label = self._label(request, body)
        stream = bool(body.get("stream", False))

        rooms = [random.getrandbits(63) for _ in range(n or 1)]
        body["bootstrap_room"] = rooms if n else rooms[0]
        fl = _Flight(body, n)
        fl.set_prefill(self.pick_prefill())
        self._count("requests")

        waiters = [self.board.expect(r) for r in rooms]
        prefill_task = self._spawn(self._call_prefill(fl, endpoint))
        prefill_task.add_done_callback(self._log_prefill)
        d: Optional[Server] = None
        try:
            sig, waited = None, 0.0
            if self.policy.needs_signature:
                sig, failed, waited = await self._await_signature(waiters, prefill_task)
                if failed is not None:
                    return self._prefill_error(failed)
            tried: set[int] = set()
            while True:
                d, dec = self.decide(RouteRequest(signature=sig, label=label), tried, rids)
                self._record(rids, rooms, label, sig, waiters, d, dec)
                self._enter(d)
                try:
                    fl.decode_sent = True  # from here on the prefill is never re-sent
                    if not tried:
                        self.metrics.added_latency.observe(time.perf_counter() - t0 - waited)
                    resp = await self._open_decode(d, endpoint, fl.payload, prefill_task)
                    if isinstance(resp, PrefillResult):  # prefill failed before decode answered
                        self._spawn(self._abort(rids, [d]))
                        return self._prefill_error(resp)
                    if isinstance(resp, Exception):
                        refused = isinstance(resp, upstream.ConnectError)
                        kind = ("connect" if refused else "timeout"
                                if isinstance(resp, upstream.Timeout) else "disconnect")
                        self._failed(d, repr(resp), down=True, kind=kind)
                        tried.update(i for i, x in enumerate(self.decodes) if x is d)
                        if refused and len(tried) < len(self.decodes):
                            self._count("decode_retries")
                            self.metrics.retries.labels("decode").inc()
                            continue  # never reached the server: the room is still unbound
                        self._spawn(self._abort(rids, [fl.prefill]))
                        return error_response(
                            503 if refused else 502,
                            f"decode server {d.url} unavailable: {type(resp).__name__}")
                    try:
                        return await self._relay(request, resp, d, stream, rids, fl.prefill)
                    finally:
                        resp.release()
                finally:
                    self._leave(d)
        except asyncio.CancelledError:  # client went away
            self._count("client_disconnects")
            prefill_task.cancel()
            self._spawn(self._abort(rids, [fl.prefill] + ([d] if d is not None else [])))
            raise
        finally:
            for r in rooms:
                self.board.discard(r)

    def _record(self, rids: list[str], rooms: list[int], label: Optional[str],
                sig: Optional[np.ndarray], waiters: list[asyncio.Future], d: Server,
                dec: Optional[Decision] = None) -> None:
        """Keep the decision and the signature messages it used (``GET /eldr/decisions``).

        Stored as taken (cheap on the request path), rendered when read."""
        messages = [w.result() for w in waiters if _delivered(w)]
        self.decisions.append((time.time(), rids, rooms, label, self.policy_name, d.url,
                               [(x.url, x.inflight) for x in self.decodes], messages, dec, sig,
                               self.encoder))

    def _render_decision(self, rec: tuple) -> dict:
        when, rids, rooms, label, policy, url, loads, messages, dec, sig, encoder = rec
        decision = {"time": when, "rids": rids, "rooms": rooms, "label": label,
                    "policy": policy, "decode": url, "loads": dict(loads), "messages": messages}
        if dec is not None:
            decision["reason"] = dec.reason
            if dec.band is not None:
                decision["band"] = [loads[i][0] for i in dec.band]
                decision["best_similarity"] = dec.best_similarity
        if dec is not None and dec.centroid_similarities is not None:
            decision["similarities"] = dec.centroid_similarities.tolist()
        elif sig is not None and encoder is not None:
            try:
                decision["similarities"] = [float(v) for v in encoder.centroids @ sig]
            except ValueError:  # calibration reloaded mid-request with another dimension
                pass
        return decision

    async def _relay(self, request: web.Request, resp: upstream.UpstreamResponse, d: Server,
                     stream: bool, rids: list[str], p: Server) -> web.StreamResponse:
        """Return the decode answer; stream SSE chunks through when the client streams.

        Worker error statuses pass through (JSON bodies as they are). A decode server
        that dies mid-answer gives 502 JSON (non-stream) or a final SSE error event."""
        if resp.status != 200:
            try:
                data = await resp.read()
            except upstream.UpstreamError as e:
                data = repr(e).encode()
            if resp.status >= 500:
                self._failed(d, f"HTTP {resp.status}: {data[:200]!r}", down=False)
            else:
                self.metrics.worker_errors.labels(d.role, d.url, "http_4xx").inc()
                self._count("decode_client_errors")
            self._spawn(self._abort(rids, [p]))
            return worker_error_response(resp.status, data, d.url)
        if not stream:
            try:
                data = await resp.read()
            except upstream.UpstreamError as e:
                self._failed(d, f"response broken: {e!r}", down=False, kind="disconnect")
                self._spawn(self._abort(rids, [p]))
                return error_response(502, f"decode server {d.url} failed mid-response: "
                                      f"{type(e).__name__}")
            self._success(d)
            return web.Response(body=data, status=200, content_type=JSON)
        self._success(d)
        out = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        try:
            async for chunk in resp.iter_chunks():
                await out.write(chunk)
            await out.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self._count("client_disconnects")
            self._spawn(self._abort(rids, [p, d]))
        except upstream.UpstreamError as e:
            self._failed(d, f"stream broken: {e!r}", down=False, kind="stream")
            self._spawn(self._abort(rids, [p]))
            err = {"error": {"message": f"decode server {d.url} failed mid-stream: "
                             f"{type(e).__name__}", "type": "upstream_error", "code": 502}}
            try:
                await out.write(b"data: " + orjson.dumps(err) + b"\n\n")
                await out.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError):
                pass
        return out

    def _log_prefill(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:  # the request's handler reports it
            return
        res = task.result()
        if not res.ok:
            logger.warning("prefill answered %s %s", res.status, res.error or res.body[:200])

    def _bad(self, message: str) -> web.Response:
        self._count("bad_requests")
        self.metrics.errors.labels("bad_request").inc()
        return error_response(400, message)

    @staticmethod
    def _set_rid(body: dict, n: Optional[int]) -> list[str]:
        rid = body.get("rid")
        if rid is None:
            rids = [os.urandom(16).hex() for _ in range(n or 1)]  # uuid4().hex's form, cheaper
            body["rid"] = rids if n else rids[0]
            return rids
        if isinstance(rid, str):
            return [rid]  # SGLang expands a batch's str rid to f"{rid}_{i}"; abort matches prefixes
        if isinstance(rid, list) and all(isinstance(r, str) for r in rid) and len(rid) == (n or 1):
            return list(rid)
        raise ValueError("'rid' must be a string or a list of strings (one per batch item)")

    # ---------------------------------------------------------------- handlers
    async def h_generate(self, request: web.Request) -> web.StreamResponse:
        return await self.dispatch(request, "generate")

    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.dispatch(request, "v1/completions")

    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        return await self.dispatch(request, "v1/chat/completions")

    def _invalid_signatures(self, n: int = 1) -> None:
        """Count ``n`` signature messages refused (bad JSON, bad fields, too long)."""
        if n:
            self.metrics.signatures.labels("invalid").inc(n)
            self._count("signature_invalid", n)

    def accept_signatures(self, data: Any) -> tuple[int, int, list[str]]:
        """Validate and deliver one message or a list; (delivered, buffered, errors)."""
        msgs = data if isinstance(data, list) else [data]
        delivered = buffered = 0
        errors = []
        for m in msgs:
            try:
                parse_message(m)
            except ValueError as e:
                errors.append(str(e))
                continue
            if self.board.post(m):
                delivered += 1
                self.metrics.signatures.labels("delivered").inc()
            else:
                buffered += 1
                self.metrics.signatures.labels("buffered").inc()
        self._count("signature_messages", delivered + buffered)
        self._invalid_signatures(len(errors))
        return delivered, buffered, errors

    async def h_signature(self, request: web.Request) -> web.Response:
        try:
            data = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            self._invalid_signatures()
            return error_response(400, f"invalid JSON body: {e}")
        delivered, buffered, errors = self.accept_signatures(data)
        out = {"accepted": delivered + buffered, "delivered": delivered,
               "buffered": buffered, "rejected": len(errors), "errors": errors[:10]}
        if errors and not (delivered + buffered):
            return json_response({"error": errors[0], **out}, 400)
        return json_response(out)

    async def signature_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """``--signature-port``: newline-delimited JSON messages on a kept-open TCP
        connection (the engine's ``--eldr-publish tcp://router:PORT``); nothing is
        answered. A bad line is counted and logged; a line over the body limit
        closes the connection."""
        peer = writer.get_extra_info("peername")
        self._streams.add(writer)
        self._count("signature_streams")
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # longer than the limit
                    self._invalid_signatures()
                    logger.warning("signature stream from %s: line over %d bytes; closing", peer, self.max_body)
                    break
                if not line:
                    break
                if line.isspace():
                    continue
                try:
                    data = orjson.loads(line)
                except orjson.JSONDecodeError as e:
                    self._invalid_signatures()
                    logger.warning("signature stream from %s: invalid JSON: %s", peer, e)
                    continue
                errors = self.accept_signatures(data)[2]
                if errors:
                    logger.warning("signature stream from %s: %s", peer, errors[0])
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._streams.discard(writer)
            writer.close()

    async def h_health(self, request: web.Request) -> web.Response:
        if self.draining:
            return error_response(503, "router is draining")
        return web.Response(status=200)

    async def _get_all(self, path: str, method: str = "GET") -> list[tuple[Server, int, Any]]:
        async def one(s: Server):
            try:
                async with self.session.request(method, f"{s.url}/{path}",
                                                timeout=aiohttp.ClientTimeout(total=30)) as r:
                    raw = await r.read()
                    try:
                        return s, r.status, orjson.loads(raw) if raw else None
                    except orjson.JSONDecodeError:
                        return s, r.status, raw.decode("utf-8", "replace")
            except Exception as e:  # noqa: BLE001
                return s, 0, repr(e)
        return await asyncio.gather(*(one(s) for s in chain(self.prefills, self.decodes)))

    async def h_health_generate(self, request: web.Request) -> web.Response:
        res = await self._get_all("health_generate")
        bad = {s.url: st for s, st, _ in res if st != 200}
        return json_response({"unhealthy": bad}, 503) if bad else web.Response(status=200)

    async def h_flush_cache(self, request: web.Request) -> web.Response:
        res = await self._get_all("flush_cache", "POST")
        bad = {s.url: st for s, st, _ in res if st != 200}
        return json_response({"failed": bad}, 500) if bad else web.Response(status=200)

    async def h_server_info(self, request: web.Request) -> web.Response:
        res = await self._get_all("get_server_info")
        prefill = [b for s, _, b in res if s.role == "prefill"]
        decode = [b for s, _, b in res if s.role == "decode"]
        states = [x for b in decode if isinstance(b, dict) for x in b.get("internal_states", [])]
        return json_response({
            "internal_states": states or [{"last_gen_throughput": 0.0,
                                           "avg_spec_accept_length": None}],
            "prefill": prefill, "decode": decode})

    async def _proxy_first_prefill(self, path: str) -> web.Response:
        s = self.prefills[0]
        try:
            async with self.session.get(f"{s.url}/{path}",
                                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                data = await r.read()
                if r.status != 200:
                    return error_response(502, f"{s.url}/{path} answered {r.status}")
                return web.Response(body=data, status=200, content_type=JSON)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return error_response(503, f"{s.url}/{path} unreachable: {type(e).__name__}")

    async def h_model_info(self, request: web.Request) -> web.Response:
        return await self._proxy_first_prefill("model_info")

    async def h_models(self, request: web.Request) -> web.Response:
        return await self._proxy_first_prefill("v1/models")

    async def h_metrics(self, request: web.Request) -> web.Response:
        for s in chain(self.prefills, self.decodes):
            self._gauge(s)
        self.metrics.board.labels("waiting").set(len(self.board.waiters))
        self.metrics.board.labels("buffered").set(len(self.board.buffer))
        self.metrics.draining.set(int(self.draining))
        data, ctype = self.metrics.render()
        return web.Response(body=data, headers={"Content-Type": ctype})

    def status(self) -> dict:
        now = time.monotonic()
        return {
            "policy": self.policy_name, "tau": self.tau,
            "signature_timeout": self.signature_timeout,
            "signature_port": self.signature_port, "signature_streams": len(self._streams),
            "artifact": self.encoder.describe() if self.encoder else None,
            "calibration_path": self.calibration_path,
            "draining": self.draining, "active_requests": self.active,
            "health_interval": self.health_interval,
            "prefill": [s.describe(now) for s in self.prefills],
            "decode": [s.describe(now) for s in self.decodes],
            "loads": [s.inflight for s in self.decodes],
            "policy_state": self.policy.describe(),
            "counters": dict(self.counters),
            "signature_buffer": {"buffered": len(self.board.buffer),
                                 "waiting": len(self.board.waiters),
                                 "expired": self.board.expired},
        }

    async def h_decisions(self, request: web.Request) -> web.Response:
        """The last ``?last=N`` routing decisions (default 20), newest last."""
        try:
            last = int(request.query.get("last", "20"))
        except ValueError:
            return self._bad("'last' must be an integer")
        recent = list(self.decisions)[-max(last, 0):] if last else []
        return json_response([self._render_decision(r) for r in recent])

    async def h_status(self, request: web.Request) -> web.Response:
        return json_response(self.status())

    def add_decode(self, url: str) -> None:
        if url.rstrip("/") in [d.url for d in self.decodes]:
            raise ValueError(f"decode server {url} already present")
        self.decodes.append(Server(url, "decode"))
        self.policy.add_server()
        self._gauge(self.decodes[-1])

    def remove_decode(self, url: str) -> None:
        urls = [d.url for d in self.decodes]
        if url.rstrip("/") not in urls:
            raise ValueError(f"unknown decode server {url}")
        if len(urls) == 1:
            raise ValueError("cannot remove the last decode server")
        i = urls.index(url.rstrip("/"))
        self.policy.remove_server(i)
        self.decodes.pop(i)  # requests in flight keep their Server object

    def admin_allowed(self, request: web.Request) -> bool:
        """Loopback peers only; with an admin token, exactly ``Bearer <token>`` instead."""
        if self.admin_token:
            got = request.headers.get("Authorization", "")
            return hmac.compare_digest(got.encode(), f"Bearer {self.admin_token}".encode())
        try:
            return ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
        except ValueError:
            return False

    def _forbidden(self) -> web.Response:
        self._count("admin_forbidden")
        self.metrics.errors.labels("admin_forbidden").inc()
        return error_response(403, "admin endpoint: loopback only, or 'Authorization: Bearer "
                                   "<token>' when the router runs with --admin-token")

    async def _admin_body(self, request: web.Request) -> dict:
        data = orjson.loads(await request.read() or b"{}")
        if not isinstance(data, dict):
            raise ValueError("body must be a JSON object")
        return data

    async def h_servers(self, request: web.Request) -> web.Response:
        """Admin: ``{"add": [url, ...], "remove": [url, ...]}`` for decode servers."""
        if not self.admin_allowed(request):
            return self._forbidden()
        try:
            data = await self._admin_body(request)
            for key in ("add", "remove"):
                v = data.get(key, [])
                if not isinstance(v, list) or not all(isinstance(u, str) for u in v):
                    raise ValueError(f"'{key}' must be a list of URLs")
            for url in data.get("remove", []):
                self.remove_decode(url)
            for url in data.get("add", []):
                self.add_decode(url)
        except (orjson.JSONDecodeError, ValueError, TypeError) as e:
            return self._bad(str(e))
        return json_response(self.status())

    def reload_calibration(self, path: str) -> dict:
        """Swap in the artifact at ``path`` (validated by ``load_artifact``: format,
        shapes, checksum); ValueError leaves the current one in place.

        Ownership restarts from the decode order (server i owns centroid i), whatever
        K is: with K > N the extra centroids go to the owners of their nearest
        centroids, with K < N the extra servers share the least-shared centroids
        (``CentroidOwnership``). ``--tau`` given at start-up stays; otherwise the new
        artifact's tau is used. The swap is one synchronous step (no await), so a
        request sees either the old encoder+policy or the new pair."""
        art = load_calibration(path)
        enc = SignatureEncoder(art)
        tau = self.tau_override if self.tau_override is not None else enc.tau
        policy = self.policy
        if self.policy.name == "eldr":
            policy = make_policy("eldr", len(self.decodes), centroids=enc.centroids, tau=tau,
                                 seed=self.seed)
        warnings = []
        k, n = int(enc.centroids.shape[0]), len(self.decodes)
        if k != n:
            warnings.append(f"{k} centroids for {n} decode servers: "
                            + ("several centroids per server" if k > n else "servers share centroids"))
        if self.last_layers is not None and [int(x) for x in self.last_layers] != enc.layers:
            warnings.append(f"prefill plugin last sent layers {self.last_layers}, artifact has "
                            f"{enc.layers}: signatures will fall back until the plugin matches")
        old = self.encoder.describe() if self.encoder else None
        self.encoder, self.policy = enc, policy
        if self.policy.name == "eldr" or self.tau_override is None:
            self.tau = tau
        self.calibration_path = str(path)
        self._count("calibration_reloads")
        self.metrics.reloads.labels("ok").inc()
        logger.info("calibration reloaded from %s: K=%d dim=%d tau=%s%s", path, k,
                    enc.centroids.shape[1], self.tau, f" ({'; '.join(warnings)})" if warnings else "")
        return {"ok": True, "path": str(path), "previous": old, "artifact": enc.describe(),
                "warnings": warnings, "policy_state": self.policy.describe()}

    async def h_calibration(self, request: web.Request) -> web.Response:
        """Admin: ``POST {"path": "artifact.json"}`` reloads the calibration."""
        if not self.admin_allowed(request):
            return self._forbidden()
        try:
            data = await self._admin_body(request)
            path = data.get("path")
            if not isinstance(path, str) or not path:
                raise ValueError("'path' (string) is required")
            out = self.reload_calibration(path)
        except (orjson.JSONDecodeError, ValueError, TypeError) as e:
            self.metrics.reloads.labels("refused").inc()
            self._count("calibration_refused")
            logger.warning("calibration reload refused: %s", e)
            return self._bad(f"calibration refused, previous kept: {e}")
        return json_response(out)

    async def h_calibration_get(self, request: web.Request) -> web.Response:
        return json_response({"path": self.calibration_path,
                              "artifact": self.encoder.describe() if self.encoder else None,
                              "policy_state": self.policy.describe()})

    # ---------------------------------------------------------------- health / drain
    async def check_health(self) -> None:
        """One round of ``GET /health`` on every worker."""
        timeout = aiohttp.ClientTimeout(total=self.health_timeout)

        async def one(s: Server) -> None:
            try:
                async with self.session.get(f"{s.url}/health", timeout=timeout) as r:
                    await r.read()
                    ok = r.status == 200
            except Exception:  # noqa: BLE001 - any failure is a miss
                ok = False
            self.metrics.health_checks.labels(s.role, s.url, "ok" if ok else "fail").inc()
            if ok:
                s.health_misses = 0
                if not s.alive:
                    s.alive = True
                    self._count(f"{s.role}_back_in")
                    logger.warning("%s %s passes health checks again: back in", s.role, s.url)
                if s.breaker == "open":  # let a trial request through now
                    s.open_until = 0.0
            else:
                s.health_misses += 1
                if s.alive and s.health_misses >= self.health_failures:
                    s.alive = False
                    self._count(f"{s.role}_taken_out")
                    logger.warning("%s %s failed %d health checks: taken out", s.role, s.url,
                                   s.health_misses)
            self._gauge(s)

        await asyncio.gather(*(one(s) for s in list(chain(self.prefills, self.decodes))))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 - never let the loop die
                logger.exception("health check round failed")

    async def _housekeeping(self) -> None:
        """Expire unclaimed signature messages even when no traffic comes in."""
        while True:
            await asyncio.sleep(min(1.0, max(self.board.ttl / 4, 0.05)))
            self.board.sweep()

    async def drain(self, timeout: float) -> bool:
        """Refuse new work (503), wait for in-flight requests; True if all finished."""
        self.draining = True
        self.metrics.draining.set(1)
        logger.warning("draining: %d request(s) in flight, up to %.1fs", self.active, timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            logger.warning("drain timeout: %d request(s) still in flight", self.active)
            return False

    # ---------------------------------------------------------------- app
    async def _startup(self, app: web.Application) -> None:
        if self.signature_listen is not None:  # first: a port in use fails before anything starts
            host, port = self.signature_listen
            self._signature_server = await asyncio.start_server(
                self.signature_stream, host, port, limit=self.max_body)
            self.signature_port = self._signature_server.sockets[0].getsockname()[1]
            logger.info("signature stream on %s:%d", host, self.signature_port)
        self.session = aiohttp.ClientSession(
            timeout=self.timeout, connector=aiohttp.TCPConnector(
                limit=0, ttl_dns_cache=300, keepalive_timeout=WORKER_KEEPALIVE_S),
            json_serialize=lambda o: orjson.dumps(o).decode())
        self._idle = asyncio.Event()  # bound to the serving loop
        if self.active == 0:
            self._idle.set()
        if self.health_interval and self.health_interval > 0:
            self._spawn(self._health_loop())
        self._spawn(self._housekeeping())

    async def _cleanup(self, app: web.Application) -> None:
        if self._signature_server is not None:
            self._signature_server.close()
            for w in list(self._streams):
                w.close()
            await self._signature_server.wait_closed()
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        self.upstream.close()

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._json_errors], client_max_size=self.max_body)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        r = app.router
        r.add_post("/generate", self.h_generate)
        r.add_post("/v1/completions", self.h_completions)
        r.add_post("/v1/chat/completions", self.h_chat)
        r.add_get("/v1/models", self.h_models)
        r.add_get("/health", self.h_health)
        r.add_get("/health_generate", self.h_health_generate)
        r.add_post("/flush_cache", self.h_flush_cache)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.h_server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.h_model_info)
        r.add_get("/metrics", self.h_metrics)
        r.add_post("/eldr/signature", self.h_signature)
        r.add_get("/eldr/status", self.h_status)
        r.add_get("/eldr/decisions", self.h_decisions)
        r.add_post("/eldr/servers", self.h_servers)
        r.add_post("/eldr/calibration", self.h_calibration)
        r.add_get("/eldr/calibration", self.h_calibration_get)
        return app

    @web.middleware
    async def _json_errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Drain gate, and every error leaves as JSON ``{"error": ...}``; never a traceback."""
        if self.draining and request.path in WORK_PATHS:
            self._count("refused_draining")
            return error_response(503, "router is draining (shutting down); retry elsewhere")
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            if e.status == 413:
                self._count("too_large")
                self.metrics.errors.labels("too_large").inc()
                return error_response(413, f"request body too large: {e.text}")
            return error_response(e.status, e.reason)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            logger.exception("unhandled error on %s", request.path)
            return error_response(500, f"internal router error: {type(e).__name__}")


async def start_router(router: Router, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Start ``router`` on host:port (0 = any free port); returns (runner, port)."""
    runner = web.AppRunner(router.build_app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()  # close the worker session and the signature stream
        raise
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    return runner, sock.getsockname()[1]
