"""The PD dispatch flow with late binding, in the spirit of sglang_router's mini_lb.

One client request:

1. admission: above ``max_inflight`` client requests answer 429 + Retry-After at
   once (nothing is opened upstream);
2. pick a prefill server (least loaded); add ``bootstrap_host/port/room`` (lists for
   a batch), a ``rid`` if none, and this router's signature return address
   (``custom_params.eldr_signature_to``, so each replica gets its own signatures);
   POST to prefill in the background (its answer arrives after decode took the KV);
3. if the policy needs a signature, wait for the room's message (adaptive limit);
   a prefill failure ends the wait and is the client's answer; no message in time
   falls back to least loaded (counted);
4. the policy picks the decode server; the same body goes there. A room binds once,
   so a decode is re-sent elsewhere only when the connection was refused;
5. the client gets the decode answer only if the prefill succeeded too: a prefill
   failing at any point (before or after its signature, before or after the decode
   was posted) is the client's error, and the decode is aborted.

Every worker request holds a breaker ticket that ends on every path
(:mod:`eldr_sglang.router.breaker`). Client disconnect aborts the rid(s) on both
servers. Errors the router causes itself (out of file descriptors) are never
counted against a worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from eldr_sglang.core.policies import Decision, RouteRequest, least_loaded
from eldr_sglang.patches.publish import RETURN_ADDRESS_KEY
from eldr_sglang.router import upstream
from eldr_sglang.router.bodies import BadRequest, BodyError, batch_size, read_body, validate_openai
from eldr_sglang.router.clients import REQUEST_ID_KEY
from eldr_sglang.router.responses import (JSON, error_in_body, error_response,
                                          worker_error_response)
from eldr_sglang.router.signatures import activation, combine, union
from eldr_sglang.router.early import early_route
from eldr_sglang.router.workers import Worker

if TYPE_CHECKING:
    from eldr_sglang.router.app import Router

logger = logging.getLogger("eldr_sglang.router")
decision_logger = logging.getLogger("eldr_sglang.router.decisions")
ABORT_TIMEOUT = 5.0


@dataclass
class PrefillResult:
    status: int  # HTTP status; 0 when the call itself failed
    body: bytes
    error: str = ""
    url: str = ""  # the prefill server that answered
    local: bool = False  # the router's own failure (resources), not the worker's

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


class _Flight:
    """One client request on its way: body, chosen prefill, the bytes sent upstream, the
    headers that go with them and the workers that got the request (the only ones an
    abort goes to)."""

    __slots__ = ("body", "n", "prefill", "payload", "decode_sent", "headers", "sent")

    def __init__(self, body: dict, n: Optional[int], headers: tuple = ()) -> None:
        self.body, self.n = body, n
        self.decode_sent = False
        self.headers = headers
        self.sent: set[int] = set()  # ids of the workers the request was written to

    def on_sent(self, w: Worker):
        return lambda: self.sent.add(id(w))

    def set_prefill(self, p: Worker) -> None:
        n, body = self.n, self.body
        self.prefill = p
        body["bootstrap_host"] = [p.host] * n if n else p.host
        body["bootstrap_port"] = [p.bootstrap_port] * n if n else p.bootstrap_port
        self.payload = orjson.dumps(body)


class _NoSignature(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _delivered(w: asyncio.Future) -> bool:
    return w.done() and not w.cancelled() and w.exception() is None


def set_rid(body: dict, n: Optional[int]) -> list[str]:
    rid = body.get("rid")
    if rid is None:
        rids = [os.urandom(16).hex() for _ in range(n or 1)]  # uuid4().hex's form, cheaper
        body["rid"] = rids if n else rids[0]
        return rids
    if isinstance(rid, str):
        return [rid]  # SGLang expands a batch's str rid to f"{rid}_{i}"; abort matches prefixes
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid) and len(rid) == (n or 1):
        return list(rid)
    raise BadRequest("'rid' must be a string or a list of strings (one per batch item)")


def _with_address(cp: Any, address: Optional[str]) -> Optional[dict]:
    cp = {k: v for k, v in cp.items() if k != RETURN_ADDRESS_KEY} if isinstance(cp, dict) else {}
    if address:
        cp[RETURN_ADDRESS_KEY] = address
    return cp or None


def set_return_address(body: dict, endpoint: str, address: Optional[str]) -> None:
    """Where the prefill engine sends this request's signature. A client's own value is
    always removed: only the router names where prefill servers connect to."""
    if endpoint != "generate":  # OpenAI routes: SGLang copies custom_params into sampling params
        if address or "custom_params" in body:
            body["custom_params"] = _with_address(body.get("custom_params"), address)
        return
    sp = body.get("sampling_params")
    if sp is None:
        if not address:
            return
        sp = body["sampling_params"] = {}
    for params in (sp if isinstance(sp, list) else [sp]):
        if isinstance(params, dict) and (address or "custom_params" in params):
            params["custom_params"] = _with_address(params.get("custom_params"), address)


class Dispatcher:
    """Client request -> prefill -> signature -> decode -> client."""

    def __init__(self, router: "Router") -> None:
        self.r = router
        self.active = 0  # client requests being served
        self.idle = asyncio.Event()
        self.idle.set()
        m = router.metrics  # request-path histograms: observed in batches (Deferred)
        self._added, self._choose = m.deferred(m.added_latency), m.deferred(m.choose_time)
        self._band, self._best = m.deferred(m.band_size), m.deferred(m.best_similarity)
        self._wait = m.deferred(m.signature_wait)
        self._decision_children: dict[tuple[str, str, str], tuple] = {}
        self._fallback_rng = np.random.default_rng(router.config.seed)

    # ------------------------------------------------------------ entry
    async def handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """Read and validate the body first (size cap, time limit, off the loop when big);
        only then take an admission slot, so slow or bad clients hold none."""
        r = self.r
        t0 = time.perf_counter()
        try:
            raw = await read_body(request, r.body_limit, r.config.client_body_timeout or None)
            body, n = await r.parser.request(raw, endpoint, r.config.max_batch)
            rids = set_rid(body, n)
        except BodyError as e:
            return self._bad(str(e), e.status)
        if r.draining:
            r.metrics.event("refused_draining")
            return error_response(503, "router is draining (shutting down); retry elsewhere",
                                  r.config.retry_after)
        if self.active >= r.inflight_limit:
            r.metrics.overloaded.inc()
            return error_response(429, f"router at its in-flight limit ({r.inflight_limit} "
                                  "requests); retry later", r.config.retry_after)
        self.active += 1
        self.idle.clear()
        r.metrics.client_requests.set(self.active)
        routing, status = r.routing, 0  # the A/B arm is the policy a request arrived under
        try:
            resp = await self._handle(request, endpoint, t0, body, n, rids)
            status = resp.status
            return resp
        finally:
            self.active -= 1
            if self.active == 0:
                self.idle.set()
            r.metrics.client_requests.set(self.active)
            elapsed = time.perf_counter() - t0
            r.metrics.deferred(r.metrics.request_duration, endpoint).observe(elapsed)
            if r.ab is not None:
                r.ab.request_done(routing, elapsed, status)

    def _bad(self, message: str, status: int = 400) -> web.Response:
        kind = {400: "bad_request", 408: "body_timeout", 413: "too_large"}.get(status, "bad_request")
        self.r.metrics.errors.labels(kind).inc()
        return error_response(status, message)

    async def _handle(self, request: web.Request, endpoint: str, t0: float, body: dict,
                      n: Optional[int], rids: list[str]) -> web.StreamResponse:
        r = self.r
        label = r.label_of(request, body)
        stream = bool(body.get("stream", False))
        routing = r.routing
        needs_signature = routing.policy.needs_signature
        # an --online router learns from every signature, even while it routes by load;
        # a shadow policy is evaluated on it
        watch = needs_signature or r.online is not None or r.shadow is not None
        set_return_address(body, endpoint, r.return_address if watch else None)

        rooms = [random.getrandbits(63) for _ in range(n or 1)]
        body["bootstrap_room"] = rooms if n else rooms[0]
        rid_header = request.get(REQUEST_ID_KEY)
        fl = _Flight(body, n, (rid_header,) if rid_header else ())
        fl.set_prefill(r.pool.pick_prefill())

        waiters = [r.board.expect(room) for room in rooms] if needs_signature or r.shadow else []
        prefill_task = r.spawn(self._prefill(fl, endpoint))
        d: Optional[Worker] = None
        try:
            route, waited = RouteRequest(label=label), 0.0
            early = early_route(r, body, endpoint, label) if needs_signature else None  # --binding
            if early is not None:
                route = early
            elif needs_signature:
                route, failed, waited = await self._await_signature(waiters, prefill_task, label)
                if failed is not None:
                    return self._prefill_error(failed)
            tried: set[int] = set()
            while True:
                d, dec, loads = self.decide(route, tried, rids, routing)
                if dec.reason == "policy_error":  # the signature does not fit the policy
                    route = RouteRequest(label=label)
                shadow = self._shadow(route, waiters, rooms[0], loads, dec.index) if r.shadow else None
                r.record(rids, rooms, label, waiters, d, dec, loads, shadow)
                ticket = r.pool.enter(d)
                admitted = None
                try:  # every step after enter() is inside the release path
                    admitted = self._admit(routing.policy, dec.index, route)
                    fl.decode_sent = True  # from here on the prefill is never re-sent
                    if not tried:
                        self._added.observe(time.perf_counter() - t0 - waited)
                    out = await self._open_decode(d, endpoint, fl, prefill_task)
                    if isinstance(out, PrefillResult):  # prefill failed first: abort the decode
                        self._abort(fl, rids, [d])
                        return self._prefill_error(out)
                    if isinstance(out, upstream.ConnectError) and len(tried) + 1 < len(r.pool.decodes):
                        r.pool.failure(d, ticket, repr(out), "connect", hard=True)
                        tried.update(i for i, x in enumerate(r.pool.decodes) if x is d)
                        r.metrics.retries.labels("decode").inc()
                        continue  # never reached the server: the room is still unbound
                    if isinstance(out, upstream.UpstreamError):
                        return self._decode_failed(d, ticket, out, rids, fl)
                    try:
                        return await self._relay(request, out, d, ticket, stream, rids, fl,
                                                 prefill_task)
                    finally:
                        out.release()
                finally:
                    r.pool.leave(d, ticket)
                    routing.policy.release(admitted)
        except asyncio.CancelledError:  # client went away
            r.metrics.event("client_disconnects")
            prefill_task.cancel()
            self._abort(fl, rids, [fl.prefill] + ([d] if d is not None else []))
            raise
        except Exception:  # a router bug: nothing may stay held on the workers
            prefill_task.cancel()
            self._abort(fl, rids, [fl.prefill] + ([d] if d is not None else []))
            raise
        finally:
            for room in rooms:
                r.board.discard(room)

    # ------------------------------------------------------------ decision
    def _admit(self, policy: Any, index: int, route: RouteRequest) -> Any:
        """``policy.admit``; a signature it cannot take is a counted fallback (admitted
        without it), never an error."""
        try:
            return policy.admit(index, route)
        except (ValueError, IndexError) as e:
            self.r.metrics.fallbacks.labels("policy_mismatch").inc()
            self.r.intake.log.warn("policy_mismatch", "policy %s cannot take this signature: %s",
                                   policy.name, e)
            return policy.admit(index, RouteRequest(label=route.label))

    def _shadow(self, route: RouteRequest, waiters: list[asyncio.Future], room: int,
                loads: list[int], chosen: int) -> dict:
        """The shadow policy's pick for this request: now if the route has its signature,
        else when the signature arrives (filled into the returned dict)."""
        r = self.r
        if route.signature is not None or not waiters:
            return r.shadow.evaluate(route, loads, chosen)
        if _delivered(waiters[0]):  # it came before the decision
            return r.shadow.evaluate_message(waiters[0].result(), loads, chosen)
        # it comes later, maybe after the request ended: the intake hands it over
        return r.shadow.expect(room, loads, chosen)

    def decide(self, req: RouteRequest, exclude: set[int] = frozenset(),
               rids: Sequence[str] = (), routing: Any = None) -> tuple[Worker, Decision, list[int]]:
        """Pick the decode server with ``policy.explain`` (same pick as ``choose``);
        (server, decision, the loads it saw). ``routing``: the one the request arrived
        under (default: the live one)."""
        r = self.r
        routing = routing or r.routing
        pool = r.pool
        decodes = pool.decodes
        loads = pool.decode_loads()
        allowed = pool.allowed_decodes(exclude)
        t0 = time.perf_counter()
        try:
            dec = routing.policy.explain(req, loads, allowed)
        except (ValueError, IndexError) as e:  # e.g. a signature of other layers
            r.intake.log.warn("policy_mismatch", "policy %s cannot route this request (%s); "
                              "least loaded", routing.name, e)
            r.metrics.fallbacks.labels("policy_mismatch").inc()
            dec = Decision(least_loaded(loads, np.flatnonzero(allowed), self._fallback_rng),
                           routing.name, "policy_error")
        m = r.metrics
        self._choose.observe(time.perf_counter() - t0)
        d = decodes[dec.index]
        if not routing.policy.needs_signature:
            kind = "blind"
        else:
            kind = ("signature" if (req.signature is not None or req.activation is not None)
                    and dec.reason != "policy_error" else "fallback")
        key = (routing.name, kind, d.url)
        children = self._decision_children.get(key)
        if children is None:  # labels() lookups cost microseconds: once per key
            children = self._decision_children[key] = (
                m.decisions.labels(routing.name, kind), m.requests.labels(routing.name, d.url))
        for child in children:
            child.inc()
        if dec.band is not None:
            self._band.observe(len(dec.band))
            self._best.observe(dec.best_similarity)
        level = r.decision_level
        if decision_logger.isEnabledFor(level):
            decision_logger.log(
                level, "decision rids=%s policy=%s reason=%s top3=%s band=%s loads=%s allowed=%s "
                "chosen=%d %s", list(rids)[:4], routing.name, dec.reason,
                [(decodes[i].url, round(v, 4)) for i, v in dec.top(3)],
                list(dec.band) if dec.band is not None else None, loads,
                [i for i, a in enumerate(allowed) if a], dec.index, d.url)
        return d, dec, loads

    # ------------------------------------------------------------ signature
    async def _await_signature(self, waiters: list[asyncio.Future], prefill_task: asyncio.Task,
                               label: Optional[str],
                               ) -> tuple[RouteRequest, Optional[PrefillResult], float]:
        """(what the policy routes by, failed prefill or None, seconds waited): the unit
        signature (with an artifact) and, for policies that price live batches, the
        per-step expert activation."""
        r = self.r
        t0 = time.perf_counter()  # uvloop's loop.time() moves in 1 ms steps
        failed = await self._await_rooms(waiters, prefill_task,
                                         asyncio.get_running_loop().time() + r.wait_limit.value)
        waited = time.perf_counter() - t0
        if failed is not None:
            return RouteRequest(label=label), failed, waited
        self._wait.observe(waited)
        encoder = r.routing.encoder
        wants_activation = r.routing.policy.uses_activation
        vectors, activations, reasons = [], [], []
        for w in waiters:
            if not _delivered(w):
                reasons.append("timeout")
                continue
            r.wait_limit.observe(waited)
            r.metrics.event("signatures_used")
            r.last_layers = w.result().get("layers")
            if wants_activation:
                activations.append(activation(w.result()))
            if encoder is None:
                if not wants_activation:
                    reasons.append("no_artifact")
                continue
            try:
                vectors.append(encoder.encode(w.result()))
            except ValueError as e:  # SignatureError: reason is its metric label
                reason = getattr(e, "reason", "bad_counts")
                reasons.append(reason)
                r.metrics.errors.labels(f"signature_{reason}").inc()
                r.intake.log.warn(reason, "room %s: %s", w.result().get("bootstrap_room"), e)
        for reason in reasons:
            r.metrics.fallbacks.labels(reason).inc()
        r.metrics.signature_wait_limit.set(r.wait_limit.value)
        return RouteRequest(combine(vectors), label, union(activations)), None, waited

    @staticmethod
    async def _await_rooms(waiters: list[asyncio.Future], prefill_task: asyncio.Task,
                           deadline: float) -> Optional[PrefillResult]:
        """Wait on the rooms' own futures until all hold their message, the deadline
        passes or the prefill fails (its result is then returned)."""
        loop = asyncio.get_running_loop()

        def end(reason: str) -> None:
            for w in waiters:
                if not w.done():
                    w.set_exception(_NoSignature(reason))

        def on_prefill(t: asyncio.Task) -> None:
            if not t.cancelled() and (t.exception() is not None or not t.result().ok):
                end("prefill_failed")

        timer = loop.call_at(deadline, end, "timeout")
        prefill_task.add_done_callback(on_prefill)
        if prefill_task.done():
            on_prefill(prefill_task)
        try:
            for w in waiters:
                await w
        except _NoSignature as e:
            if e.reason == "prefill_failed":
                return prefill_task.result()  # a raising prefill task re-raises here
        finally:
            timer.cancel()
            prefill_task.remove_done_callback(on_prefill)
            for w in waiters:
                if w.done() and not w.cancelled():
                    w.exception()  # retrieved (also when this task was cancelled meanwhile)
        return None

    # ------------------------------------------------------------ prefill
    async def _prefill(self, fl: _Flight, endpoint: str) -> PrefillResult:
        """POST to prefill and read the whole answer (late binding: arrives after decode).

        A refused connection (the server never saw the request) is retried on another
        prefill server as long as the decode has not been sent (it names the prefill's
        bootstrap address)."""
        pool, m = self.r.pool, self.r.metrics
        tried: set[int] = set()
        while True:
            s = fl.prefill
            ticket = pool.enter(s)
            try:
                resp = await self.r.upstream.post(s.endpoint(endpoint), fl.payload,
                                                  headers=fl.headers, on_sent=fl.on_sent(s))
                try:
                    body = await resp.read()
                finally:
                    resp.release()
                error = error_in_body(body) if resp.status == 200 else ""
                if resp.status >= 500 or error:
                    pool.failure(s, ticket, f"HTTP {resp.status}: {(error or body[:200])!r}",
                                 "http_5xx" if resp.status >= 500 else "stream")
                else:
                    pool.success(s, ticket)  # it answered (a 4xx is the request's fault)
                    if resp.status != 200:
                        m.worker_errors.labels(s.role, s.url, "http_4xx").inc()
                return PrefillResult(resp.status, body, error or "", url=s.url)
            except upstream.LocalResourceError as e:
                m.errors.labels("local_resources").inc()
                logger.warning("prefill %s: %s", s.url, e)
                return PrefillResult(0, b"", f"router out of resources: {e.public}", s.url, local=True)
            except upstream.ConnectError as e:
                pool.failure(s, ticket, repr(e), "connect", hard=True)
                tried.add(id(s))
                alt = None if fl.decode_sent else pool.pick_prefill(exclude=tried)
                if alt is not None:
                    m.retries.labels("prefill").inc()
                    fl.set_prefill(alt)
                    continue
                return PrefillResult(0, b"", f"prefill server unreachable: {e.public}", s.url)
            except upstream.UpstreamError as e:  # Timeout, Disconnected
                kind = "timeout" if isinstance(e, upstream.Timeout) else "disconnect"
                pool.failure(s, ticket, repr(e), kind, hard=True)
                self._abort(fl, _rids_of(fl.body), [s])
                return PrefillResult(0, b"", f"prefill server failed: {e.public}", s.url)
            finally:
                pool.leave(s, ticket)

    def _prefill_error(self, res: PrefillResult) -> web.Response:
        self.r.metrics.event("prefill_errors_returned")
        if res.status == 0:
            unavailable = res.local or "unreachable" in res.error
            return error_response(503 if unavailable else 502, res.error,
                                  self.r.config.retry_after if unavailable else None)
        if res.status == 200:  # an error inside a 200 stream
            return error_response(502, f"prefill server failed: {res.error}")
        return worker_error_response(res.status, res.body, "prefill")

    async def _prefill_outcome(self, prefill_task: asyncio.Task) -> PrefillResult:
        """The prefill's result (it ends on its own: worker timeouts bound it)."""
        return await asyncio.shield(prefill_task)

    # ------------------------------------------------------------ decode
    async def _open_decode(self, d: Worker, endpoint: str, fl: _Flight,
                           prefill_task: asyncio.Task):
        """POST to decode; its response, a failed PrefillResult, or an UpstreamError."""
        if prefill_task.done() and not prefill_task.result().ok:
            return prefill_task.result()  # already failed: never send the decode
        post = asyncio.ensure_future(self.r.upstream.post(
            d.endpoint(endpoint), fl.payload, headers=fl.headers, on_sent=fl.on_sent(d)))
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

    def _decode_failed(self, d: Worker, ticket, e: upstream.UpstreamError, rids: list[str],
                       fl: _Flight) -> web.Response:
        r = self.r
        self._abort(fl, rids, [fl.prefill] + ([] if isinstance(e, upstream.ConnectError) else [d]))
        if isinstance(e, upstream.LocalResourceError):
            r.metrics.errors.labels("saturated" if isinstance(e, upstream.Saturated)
                                    else "local_resources").inc()
            logger.warning("decode %s: %s", d.url, e)
            return error_response(503, f"router out of resources: {e.public}", r.config.retry_after)
        if isinstance(e, upstream.ConnectError):
            r.pool.failure(d, ticket, repr(e), "connect", hard=True)
            return error_response(503, f"decode server unavailable: {e.public}", r.config.retry_after)
        timeout = isinstance(e, upstream.Timeout)
        r.pool.failure(d, ticket, repr(e), "timeout" if timeout else "disconnect", hard=True)
        return error_response(504 if timeout else 502, f"decode server failed: {e.public}")

    async def _relay(self, request: web.Request, resp: upstream.UpstreamResponse, d: Worker,
                     ticket, stream: bool, rids: list[str], fl: _Flight,
                     prefill_task: asyncio.Task) -> web.StreamResponse:
        """The decode answer, once the prefill is known to have succeeded.

        Worker error statuses pass through (JSON bodies as they are); a decode server
        that fails mid-answer gives 502/504 JSON (non-stream) or a final SSE error event."""
        r, pool = self.r, self.r.pool
        if resp.status != 200:
            try:
                data = await resp.read()
            except upstream.UpstreamError as e:
                data = e.public.encode()
            if resp.status >= 500:
                pool.failure(d, ticket, f"HTTP {resp.status}: {data[:200]!r}", "http_5xx")
            else:
                pool.success(d, ticket)
                r.metrics.worker_errors.labels(d.role, d.url, "http_4xx").inc()
            self._abort(fl, rids, [fl.prefill])
            return worker_error_response(resp.status, data, "decode")
        if not stream:
            read = asyncio.ensure_future(resp.read())
            try:
                if not prefill_task.done():  # a prefill failing meanwhile stops the decode
                    await asyncio.wait({read, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task.done() and not read.done() and not prefill_task.result().ok:
                    self._abort(fl, rids, [d])
                    return self._prefill_error(prefill_task.result())
                data = await read
            except upstream.UpstreamError as e:
                return self._decode_failed(d, ticket, e, rids, fl)
            finally:
                read.cancel()
            pool.success(d, ticket)
            res = await self._prefill_outcome(prefill_task)
            if not res.ok:
                return self._prefill_error(res)
            return web.Response(body=data, status=200, content_type=JSON)
        res = await self._prefill_outcome(prefill_task)  # before the first byte goes out
        if not res.ok:
            self._abort(fl, rids, [d])
            return self._prefill_error(res)
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if fl.headers:
            headers.update(fl.headers)  # the request id, echoed
        out = web.StreamResponse(status=200, headers=headers)
        await out.prepare(request)
        try:
            async for chunk in resp.iter_chunks():
                await out.write(chunk)
            await out.write_eof()
            pool.success(d, ticket)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            r.metrics.event("client_disconnects")
            self._abort(fl, rids, [fl.prefill, d])
        except upstream.UpstreamError as e:
            timeout = isinstance(e, upstream.Timeout)
            pool.failure(d, ticket, f"stream broken: {e!r}", "timeout" if timeout else "stream",
                         hard=timeout)
            self._abort(fl, rids, [d])
            err = {"error": {"message": f"decode server failed mid-stream: {e.public}",
                             "type": "upstream_error", "code": 504 if timeout else 502}}
            try:
                await out.write(b"data: " + orjson.dumps(err) + b"\n\n")
                await out.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError):
                pass
        return out

    # ------------------------------------------------------------ aborts
    def _abort(self, fl: _Flight, rids: list[str], servers: list[Worker]) -> None:
        """Abort ``rids`` on those of ``servers`` the request was written to."""
        sent = [s for s in servers if id(s) in fl.sent]
        if sent:
            self.r.spawn(self.abort(rids, sent))

    async def abort(self, rids: list[str], servers: list[Worker]) -> None:
        """Best-effort ``/abort_request`` for every rid on every server."""
        r = self.r
        r.metrics.event("aborts")
        timeout = aiohttp.ClientTimeout(total=ABORT_TIMEOUT)

        async def one(s: Worker, rid: str) -> None:
            try:
                async with r.session.post(s.endpoint("abort_request"), json={"rid": rid},
                                          timeout=timeout) as resp:
                    await resp.read()
            except Exception as e:  # noqa: BLE001 - best effort
                logger.info("abort %s on %s failed: %r", rid, s.url, e)

        await asyncio.gather(*(one(s, rid) for s in servers for rid in rids))


def _rids_of(body: dict) -> list[str]:
    rid = body.get("rid")
    return rid if isinstance(rid, list) else [rid]
