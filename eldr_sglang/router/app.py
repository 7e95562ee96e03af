"""ELDR router: late-binding prefill/decode dispatch for SGLang (aiohttp + orjson).

One request, in the spirit of sglang_router's MiniLoadBalancer but late-binding:

1. pick a prefill server (least in-flight, ties round robin); add ``bootstrap_host``,
   ``bootstrap_port`` and a random 63-bit ``bootstrap_room`` (lists for a batch) and
   a ``rid`` if the client gave none; POST the body to the prefill server in the
   background (its response only arrives after decode bound and KV moved);
2. if the policy needs a signature, wait (``--signature-timeout``) for the prefill
   plugin's message for that room on ``POST /eldr/signature``; a prefill error
   arriving first is returned to the client; a timeout or bad message falls back
   to JSQ (counted);
3. ``policy.choose(RouteRequest(signature, label), loads, healthy)`` picks the
   decode server; the same body goes there; its response (or SSE stream) goes back
   to the client. A room binds once, so a decode is re-tried elsewhere only when
   the connection was refused (the request never reached it).

Policies that need no signature take the same path and pick at once (no wait).
A batch is routed as a whole by the normalised sum of its items' signatures.
Client disconnect aborts the rid(s) on both servers (``/abort_request``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import time
import urllib.parse
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Optional, Sequence

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from eldr_sglang.core.policies import RouteRequest, least_loaded, make_policy
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.signatures import (SignatureBoard, SignatureEncoder, SignatureError,
                                           combine, parse_message)

logger = logging.getLogger("eldr_sglang.router")

CHUNK = 64 * 1024
JSON = "application/json"


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY),
                        status=status, content_type=JSON)


def error_response(status: int, message: str) -> web.Response:
    return json_response({"error": message}, status)


def _host_of(url: str) -> str:
    host = urllib.parse.urlparse(url).hostname or ""
    try:
        ipaddress.IPv6Address(host)
        return f"[{host}]"
    except ValueError:
        return host


@dataclass(eq=False)
class Server:
    """One upstream SGLang server and its passive-health / load state."""

    url: str
    role: str
    bootstrap_port: Optional[int] = None
    inflight: int = 0
    requests: int = 0
    failures: int = 0
    unhealthy_until: float = 0.0
    host: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.host = _host_of(self.url)

    def healthy(self, now: float) -> bool:
        return now >= self.unhealthy_until

    def describe(self, now: float) -> dict:
        return {"url": self.url, "inflight": self.inflight, "requests": self.requests,
                "failures": self.failures, "healthy": self.healthy(now),
                **({"bootstrap_port": self.bootstrap_port} if self.role == "prefill" else {})}


@dataclass
class PrefillResult:
    status: int  # HTTP status; 0 when the call itself failed
    body: bytes
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


def batch_size(body: dict) -> Optional[int]:
    """None for a single /generate request, else the batch length; ValueError if malformed."""
    text, ids = body.get("text"), body.get("input_ids")
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
        health_cooldown: float = 10.0,
        request_timeout: float = 1800.0,
        connect_timeout: float = 5.0,
        seed: Optional[int] = 0,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode server")
        self.prefills = [Server(u, "prefill", p) for u, p in prefill]
        self.decodes = [Server(u, "decode") for u in decode]
        self.encoder = SignatureEncoder(artifact) if artifact is not None else None
        self.tau = tau if tau is not None else (self.encoder.tau if self.encoder else 0.1)
        self.policy_name = policy
        self.policy = make_policy(
            policy, len(self.decodes), tau=self.tau, seed=seed,
            centroids=self.encoder.centroids if self.encoder else None,
            domain_map=self._domain_indices(domain_map or {}))
        self.label_field, self.label_header = label_field, label_header
        self.signature_timeout = signature_timeout
        self.health_cooldown = health_cooldown
        self.timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout)
        self.board = SignatureBoard(ttl=signature_ttl)
        self.decisions: deque[dict] = deque(maxlen=256)  # recent routing decisions, for /eldr/decisions
        self.metrics = RouterMetrics()
        self.counters: Counter[str] = Counter()
        self.session: Optional[aiohttp.ClientSession] = None
        self._rr = 0
        self._bg: set[asyncio.Task] = set()
        self._fallback_rng = np.random.default_rng(seed)
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

    def _gauge(self, s: Server) -> None:
        self.metrics.inflight.labels(s.role, s.url).set(s.inflight)
        self.metrics.healthy.labels(s.role, s.url).set(int(s.healthy(time.monotonic())))

    def _enter(self, s: Server) -> None:
        s.inflight += 1
        s.requests += 1
        self._gauge(s)

    def _leave(self, s: Server) -> None:
        s.inflight -= 1
        self._gauge(s)

    def _failed(self, s: Server, why: str, down: bool) -> None:
        """Count a failure; ``down`` (connection-level) also starts a health cooldown."""
        s.failures += 1
        self._count(f"{s.role}_failures")
        self.metrics.upstream_failures.labels(s.role, s.url).inc()
        if down:
            s.unhealthy_until = time.monotonic() + self.health_cooldown
            self._count(f"{s.role}_marked_unhealthy")
        self._gauge(s)
        logger.warning("%s %s failed: %s", s.role, s.url, why)

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
    def pick_prefill(self) -> Server:
        """Least in-flight healthy prefill; ties go round robin."""
        now = time.monotonic()
        n = len(self.prefills)
        order = [self.prefills[(self._rr + i) % n] for i in range(n)]
        self._rr = (self._rr + 1) % n
        pool = [s for s in order if s.healthy(now)] or order
        return min(pool, key=lambda s: s.inflight)

    def pick_decode(self, req: RouteRequest, exclude: set[int] = frozenset()) -> Server:
        now = time.monotonic()
        loads = [d.inflight for d in self.decodes]
        allowed = [d.healthy(now) and i not in exclude for i, d in enumerate(self.decodes)]
        if not any(allowed):
            allowed = [i not in exclude for i in range(len(self.decodes))]
        t0 = time.perf_counter()
        try:
            idx = self.policy.choose(req, loads, allowed)
        except (ValueError, IndexError) as e:
            logger.error("policy %s failed (%s); using least in-flight", self.policy_name, e)
            self._count("policy_errors")
            self.metrics.errors.labels("policy").inc()
            idx = least_loaded(loads, np.flatnonzero(allowed), self._fallback_rng)
        self.metrics.choose_time.observe(time.perf_counter() - t0)
        d = self.decodes[idx]
        self.metrics.requests.labels(self.policy_name, d.url).inc()
        return d

    # ---------------------------------------------------------------- signature
    async def _await_signature(self, waiters: list[asyncio.Future],
                               prefill_task: asyncio.Task) -> tuple[Optional[np.ndarray], Optional[PrefillResult]]:
        """Wait for the room(s)' signatures; returns (vector or None, failed prefill or None)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + self.signature_timeout
        all_in = asyncio.ensure_future(asyncio.wait(waiters))
        watch = {all_in, prefill_task}
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                done, _ = await asyncio.wait(watch, timeout=remaining,
                                             return_when=asyncio.FIRST_COMPLETED)
                if all_in in done or not done:
                    break
                if prefill_task in done:
                    res = prefill_task.result()
                    if not res.ok:
                        return None, res
                    watch.discard(prefill_task)  # finished fine: keep waiting
        finally:
            all_in.cancel()
        self.metrics.signature_wait.observe(loop.time() - t0)
        vectors, reasons = [], []
        for w in waiters:
            if not w.done() or w.cancelled():
                reasons.append("timeout")
                continue
            self._count("signatures_used")
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
        return combine(vectors), None

    # ---------------------------------------------------------------- upstream calls
    async def _call_prefill(self, s: Server, endpoint: str, payload: bytes) -> PrefillResult:
        """POST to prefill and read the whole answer (late binding: arrives after decode)."""
        self._enter(s)
        try:
            async with self.session.post(f"{s.url}/{endpoint}", data=payload,
                                         headers={"Content-Type": JSON}) as resp:
                body = await resp.read()
                if resp.status != 200:
                    self._failed(s, f"HTTP {resp.status}: {body[:200]!r}", down=False)
                return PrefillResult(resp.status, body)
        except (aiohttp.ClientConnectorError, asyncio.TimeoutError, aiohttp.ServerDisconnectedError) as e:
            self._failed(s, repr(e), down=True)
            return PrefillResult(0, b"", f"prefill server {s.url} unreachable: {type(e).__name__}")
        except aiohttp.ClientError as e:
            self._failed(s, repr(e), down=False)
            return PrefillResult(0, b"", f"prefill server {s.url} failed: {type(e).__name__}")
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
        try:
            return json_response(orjson.loads(res.body), res.status)
        except orjson.JSONDecodeError:
            return error_response(res.status, res.body.decode("utf-8", "replace")[:2000])

    async def _open_decode(self, d: Server, endpoint: str, payload: bytes,
                           prefill_task: asyncio.Task):
        """POST to decode; returns ClientResponse, a failed PrefillResult, or an exception."""
        async def send() -> aiohttp.ClientResponse:
            return await self.session.post(f"{d.url}/{endpoint}", data=payload,
                                           headers={"Content-Type": JSON})

        post = asyncio.ensure_future(send())
        watch = {post} if prefill_task.done() else {post, prefill_task}
        try:
            while True:
                done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
                if post in done:
                    try:
                        return post.result()
                    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
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

        p = self.pick_prefill()
        rooms = [random.getrandbits(63) for _ in range(n or 1)]
        body["bootstrap_host"] = [p.host] * n if n else p.host
        body["bootstrap_port"] = [p.bootstrap_port] * n if n else p.bootstrap_port
        body["bootstrap_room"] = rooms if n else rooms[0]
        payload = orjson.dumps(body)
        self._count("requests")

        waiters = [self.board.expect(r) for r in rooms]
        prefill_task = self._spawn(self._call_prefill(p, endpoint, payload))
        prefill_task.add_done_callback(self._log_prefill)
        d: Optional[Server] = None
        try:
            sig = None
            if self.policy.needs_signature:
                sig, failed = await self._await_signature(waiters, prefill_task)
                if failed is not None:
                    return self._prefill_error(failed)
            tried: set[int] = set()
            while True:
                d = self.pick_decode(RouteRequest(signature=sig, label=label), tried)
                self._record(rids, rooms, label, sig, waiters, d)
                self._enter(d)
                try:
                    resp = await self._open_decode(d, endpoint, payload, prefill_task)
                    if isinstance(resp, PrefillResult):  # prefill failed before decode answered
                        self._spawn(self._abort(rids, [d]))
                        return self._prefill_error(resp)
                    if isinstance(resp, Exception):
                        refused = isinstance(resp, aiohttp.ClientConnectorError)
                        self._failed(d, repr(resp), down=True)
                        tried.update(i for i, x in enumerate(self.decodes) if x is d)
                        if refused and len(tried) < len(self.decodes):
                            self._count("decode_retries")
                            continue  # never reached the server: the room is still unbound
                        self._spawn(self._abort(rids, [p]))
                        return error_response(
                            503 if refused else 502,
                            f"decode server {d.url} unavailable: {type(resp).__name__}")
                    try:
                        return await self._relay(request, resp, d, stream, rids, p)
                    finally:
                        resp.release()
                finally:
                    self._leave(d)
        except asyncio.CancelledError:  # client went away
            self._count("client_disconnects")
            prefill_task.cancel()
            self._spawn(self._abort(rids, [p] + ([d] if d is not None else [])))
            raise
        finally:
            for r in rooms:
                self.board.discard(r)

    def _record(self, rids: list[str], rooms: list[int], label: Optional[str],
                sig: Optional[np.ndarray], waiters: list[asyncio.Future], d: Server) -> None:
        """Keep the decision and the signature messages it used (``GET /eldr/decisions``)."""
        messages = [w.result() for w in waiters if w.done() and not w.cancelled()]
        decision = {"time": time.time(), "rids": rids, "rooms": rooms, "label": label,
                    "policy": self.policy_name, "decode": d.url,
                    "loads": {x.url: x.inflight for x in self.decodes}, "messages": messages}
        if sig is not None and self.encoder is not None:
            decision["similarities"] = [float(v) for v in self.encoder.centroids @ sig]
        self.decisions.append(decision)

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse, d: Server,
                     stream: bool, rids: list[str], p: Server) -> web.StreamResponse:
        """Return the decode answer; stream SSE chunks through when the client streams."""
        if resp.status != 200:
            data = await resp.read()
            self._failed(d, f"HTTP {resp.status}: {data[:200]!r}", down=False)
            self._spawn(self._abort(rids, [p]))
            ctype = resp.headers.get("Content-Type", JSON)
            if ctype.startswith(JSON):
                return web.Response(body=data, status=resp.status, content_type=JSON)
            return error_response(resp.status, data.decode("utf-8", "replace")[:2000])
        if not stream:
            data = await resp.read()
            return web.Response(body=data, status=200, content_type=JSON)
        out = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        try:
            async for chunk in resp.content.iter_chunked(CHUNK):
                await out.write(chunk)
            await out.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self._count("client_disconnects")
            self._spawn(self._abort(rids, [p, d]))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._failed(d, f"stream broken: {e!r}", down=False)
            self._spawn(self._abort(rids, [p]))
        return out

    def _log_prefill(self, task: asyncio.Task) -> None:
        if task.cancelled():
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
            rids = [uuid.uuid4().hex for _ in range(n or 1)]
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

    async def h_signature(self, request: web.Request) -> web.Response:
        try:
            data = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            self.metrics.signatures.labels("invalid").inc()
            return error_response(400, f"invalid JSON body: {e}")
        msgs = data if isinstance(data, list) else [data]
        delivered = buffered = 0
        errors = []
        for m in msgs:
            try:
                parse_message(m)
            except ValueError as e:
                errors.append(str(e))
                self.metrics.signatures.labels("invalid").inc()
                continue
            if self.board.post(m):
                delivered += 1
                self.metrics.signatures.labels("delivered").inc()
            else:
                buffered += 1
                self.metrics.signatures.labels("buffered").inc()
        self._count("signature_messages", delivered + buffered)
        self._count("signature_invalid", len(errors))
        out = {"accepted": delivered + buffered, "delivered": delivered,
               "buffered": buffered, "rejected": len(errors), "errors": errors[:10]}
        if errors and not (delivered + buffered):
            return json_response({"error": errors[0], **out}, 400)
        return json_response(out)

    async def h_health(self, request: web.Request) -> web.Response:
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
        data, ctype = self.metrics.render()
        return web.Response(body=data, headers={"Content-Type": ctype})

    def status(self) -> dict:
        now = time.monotonic()
        return {
            "policy": self.policy_name, "tau": self.tau,
            "signature_timeout": self.signature_timeout,
            "artifact": self.encoder.describe() if self.encoder else None,
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
        return json_response(list(self.decisions)[-max(last, 0):] if last else [])

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

    async def h_servers(self, request: web.Request) -> web.Response:
        """Admin: ``{"add": [url, ...], "remove": [url, ...]}`` for decode servers."""
        try:
            data = orjson.loads(await request.read())
            if not isinstance(data, dict):
                raise ValueError("body must be a JSON object")
            for url in data.get("remove", []):
                self.remove_decode(str(url))
            for url in data.get("add", []):
                self.add_decode(str(url))
        except (orjson.JSONDecodeError, ValueError, TypeError) as e:
            return self._bad(str(e))
        return json_response(self.status())

    # ---------------------------------------------------------------- app
    async def _startup(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            json_serialize=lambda o: orjson.dumps(o).decode())

    async def _cleanup(self, app: web.Application) -> None:
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[_json_errors], client_max_size=256 * 1024**2)
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
        return app


@web.middleware
async def _json_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as JSON ``{"error": ...}``; never a traceback."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, e.reason)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001
        logger.exception("unhandled error on %s", request.path)
        return error_response(500, f"internal router error: {type(e).__name__}")


async def start_router(router: Router, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Start ``router`` on host:port (0 = any free port); returns (runner, port)."""
    runner = web.AppRunner(router.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    return runner, sock.getsockname()[1]
