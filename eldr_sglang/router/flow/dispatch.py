"""The PD dispatch flow with late binding, in the spirit of sglang_router's mini_lb.

One client request goes through named steps, each a method of :class:`Dispatcher`
that works on the request's :class:`~eldr_sglang.router.flow.dispatch_parts.Flight`:

1. ``admit``: the body is parsed and valid (the shell read it and, after this step,
   takes an in-flight slot: :class:`~eldr_sglang.router.shell.RouterShell`);
2. ``prepare``: pick a prefill server (least loaded); add ``bootstrap_host/port/room``
   (lists for a batch), a ``rid`` if none, and this router's signature return address
   (``custom_params.eldr_signature_to``, so each replica gets its own signatures);
3. ``prefill``: POST to prefill in the background (its answer arrives after decode
   took the KV);
4. ``signature``: if the policy needs a signature, a predicted one at arrival
   (``--binding``) or the room's message (adaptive limit); a prefill failure ends the
   wait and is the client's answer; no message in time falls back to least loaded
   (counted);
5. ``decide`` and 6. ``decode``: the one send loop every flow uses
   (:class:`~eldr_sglang.router.flow.send.Sender`): the policy picks the decode server
   (kept in the decision log), the same body goes there (racing the prefill). A room
   binds once, so a decode is re-sent elsewhere only when the connection was refused;
7. ``relay`` (:mod:`~eldr_sglang.router.flow.relay`): the client gets the decode answer
   only if the prefill succeeded too: a prefill failing at any point (before or after
   its signature, before or after the decode was posted) is the client's error, and
   the decode is aborted.

Every worker request holds a breaker ticket that ends on every path
(:mod:`eldr_sglang.router.pool.breaker`). Client disconnect aborts the rid(s) on both
servers. Errors the router causes itself (out of file descriptors) are never
counted against a worker.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Mapping, Optional, Sequence

from aiohttp import web

from eldr_sglang.core.policies import Decision, RouteRequest
from eldr_sglang.router.pool import upstream
from eldr_sglang.router.http.body_rules import label_of, set_return_address, set_rid
from eldr_sglang.router.http.clients import REQUEST_ID_KEY
from eldr_sglang.router.flow.dispatch_parts import DispatchParts, Flight, PrefillResult
from eldr_sglang.router.flow.relay import Relay
from eldr_sglang.router.flow.send import Sender
from eldr_sglang.router.http.responses import error_in_body
from eldr_sglang.router.state.routing import Routing
from eldr_sglang.router.signals.signatures import activation, combine, union
from eldr_sglang.router.pool.workers import Worker

logger = logging.getLogger("eldr_sglang.router")


class _NoSignature(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _delivered(w: asyncio.Future) -> bool:
    return w.done() and not w.cancelled() and w.exception() is None


class Dispatcher:
    """Client request -> prefill -> signature -> decode -> client."""

    def __init__(self, parts: DispatchParts) -> None:
        self.p = parts
        self.relay = Relay(parts.config, parts.metrics, parts.pool, parts.runtime)
        self.sender = Sender(parts.config, parts.metrics, parts.pool, parts.state, self.relay, parts.log)
        self._wait = parts.metrics.deferred(parts.metrics.signature_wait)

    @property
    def decision_level(self) -> int:
        return self.sender.decision_level

    # ------------------------------------------------------------ the flow
    async def admit(self, request: web.Request, raw: bytes, endpoint: str, t0: float) -> Flight:
        """The body parsed and checked (off the loop when big), a rid set: the flight
        (the shell admits it); BodyError (4xx, 503) when the request is refused."""
        p = self.p
        body, n = await p.parser.request(raw, endpoint, p.config.max_batch)
        rids = set_rid(body, n)
        return Flight(endpoint, t0, body, n, rids, p.state.routing)  # the A/B arm: the routing it arrived under

    async def serve(self, request: web.Request, fl: Flight) -> web.StreamResponse:
        """prepare -> prefill -> signature -> decide -> decode -> relay."""
        p = self.p
        self.prepare(fl, request.headers, request.get(REQUEST_ID_KEY))
        fl.prefill_task = p.runtime.spawn(self.prefill(fl))
        try:
            failed = await self.signature(fl)
            if failed is not None:
                return self.relay.prefill_error(failed)
            return await self.sender.send(request, fl, self.decode, self.note)
        except asyncio.CancelledError:  # client went away (unless it had the whole answer)
            if not fl.finished:
                p.metrics.event("client_disconnects")
                self._abandon(fl)
            raise
        except Exception:  # a router bug: nothing may stay held on the workers
            self._abandon(fl)
            raise
        finally:
            for room in fl.rooms:
                p.board.discard(room)

    def _abandon(self, fl: Flight) -> None:
        fl.prefill_task.cancel()
        self.relay.abort_sent(fl, [fl.prefill] + list(self.p.pool.decodes))  # only those it was sent to

    # ------------------------------------------------------------ prepare
    def prepare(self, fl: Flight, headers: Mapping[str, str],
                rid_header: Optional[tuple[str, str]] = None) -> None:
        """Label, return address, bootstrap rooms, prefill server, signature waiters."""
        p = self.p
        fl.label = label_of(headers, fl.body, p.config.label_header, p.config.label_field)
        fl.stream = bool(fl.body.get("stream", False))
        needs_signature = fl.routing.policy.needs_signature
        # an --online router learns from every signature, even while it routes by load;
        # a shadow policy is evaluated on it
        watch = needs_signature or p.learns or p.shadow is not None
        set_return_address(fl.body, fl.endpoint, p.runtime.return_address if watch else None)
        fl.rooms = [random.getrandbits(63) for _ in range(fl.n or 1)]
        fl.body["bootstrap_room"] = fl.rooms if fl.n else fl.rooms[0]
        fl.headers = (rid_header,) if rid_header else ()
        fl.set_prefill(p.pool.pick_prefill())
        fl.waiters = ([p.board.expect(room) for room in fl.rooms]
                      if needs_signature or p.shadow else [])

    # ------------------------------------------------------------ prefill
    async def prefill(self, fl: Flight) -> PrefillResult:
        """POST to prefill and read the whole answer (late binding: arrives after decode).

        A refused connection (the server never saw the request) is retried on another
        prefill server as long as the decode has not been sent (it names the prefill's
        bootstrap address)."""
        pool, m = self.p.pool, self.p.metrics
        tried: set[int] = set()
        while True:
            s = fl.prefill
            ticket = pool.enter(s)
            try:
                resp = await self.p.upstream.post(s.endpoint(fl.endpoint), fl.payload,
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
                self.relay.abort_sent(fl, [s])
                return PrefillResult(0, b"", f"prefill server failed: {e.public}", s.url)
            finally:
                pool.leave(s, ticket)

    # ------------------------------------------------------------ signature
    async def signature(self, fl: Flight) -> Optional[PrefillResult]:
        """Set what the policy routes by (``fl.route``); the failed prefill that ended
        the wait, or None."""
        p = self.p
        fl.route = RouteRequest(label=fl.label)
        if not fl.routing.policy.needs_signature:
            return None
        early = await p.early(fl.body, fl.endpoint, fl.label) if p.early is not None else None
        if early is not None:  # --binding: bound at arrival
            fl.route = early
            return None
        fl.route, failed, fl.waited = await self._await_signature(fl.waiters, fl.prefill_task,
                                                                  fl.label)
        return failed

    async def _await_signature(self, waiters: list[asyncio.Future], prefill_task: asyncio.Task,
                               label: Optional[str],
                               ) -> tuple[RouteRequest, Optional[PrefillResult], float]:
        """(what the policy routes by, failed prefill or None, seconds waited): the unit
        signature (with an artifact) and, for policies that price live batches, the
        per-step expert activation."""
        p = self.p
        t0 = time.perf_counter()  # uvloop's loop.time() moves in 1 ms steps
        failed = await self._await_rooms(waiters, prefill_task,
                                         asyncio.get_running_loop().time() + p.wait_limit.value)
        waited = time.perf_counter() - t0
        if failed is not None:
            return RouteRequest(label=label), failed, waited
        self._wait.observe(waited)
        live = p.state.routing
        encoder, wants_activation = live.encoder, live.policy.uses_activation
        vectors, activations, reasons = [], [], []
        for w in waiters:
            if not _delivered(w):
                reasons.append("timeout")
                continue
            p.wait_limit.observe(waited)
            p.metrics.event("signatures_used")
            p.state.last_layers = w.result().get("layers")
            if encoder is None:
                if wants_activation:
                    activations.append(activation(w.result()))
                else:
                    reasons.append("no_artifact")
                continue
            try:
                vectors.append(encoder.encode(w.result()))
            except ValueError as e:  # SignatureError: reason is its metric label
                # its activation is of the same (rejected) layers: not used either
                reason = getattr(e, "reason", "bad_counts")
                reasons.append(reason)
                p.metrics.errors.labels(f"signature_{reason}").inc()
                p.log.warn(reason, "room %s: %s", w.result().get("bootstrap_room"), e)
                continue
            if wants_activation:
                activations.append(activation(w.result()))
        if reasons:  # one decision, one fallback (a batch's rooms share it)
            p.metrics.fallbacks.labels(reasons[0]).inc()
        p.metrics.signature_wait_limit.set(p.wait_limit.value)
        return (RouteRequest(combine(vectors), label, union(activations),
                             fallback=reasons[0] if reasons else None), None, waited)

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

    # ------------------------------------------------------------ decide
    def decide(self, req: RouteRequest, exclude: set[int] = frozenset(),
               rids: Sequence[str] = (), routing: Optional[Routing] = None,
               ) -> tuple[Worker, Decision, list[int]]:
        """:meth:`Sender.decide <eldr_sglang.router.flow.send.Sender.decide>`."""
        return self.sender.decide(req, exclude, rids, routing)

    def note(self, fl: Flight, d: Worker, dec: Decision, loads: list[int]) -> None:
        """The decision into the log, with the shadow policy's pick."""
        p = self.p
        shadow = (self._shadow(fl.route, fl.waiters, fl.rooms[0], loads, dec.index)
                  if p.shadow is not None else None)
        p.decisions.record(fl.rids, fl.rooms, fl.label, fl.waiters, d, dec, loads,
                           p.pool.decodes, shadow)

    def _shadow(self, route: RouteRequest, waiters: list[asyncio.Future], room: int,
                loads: list[int], chosen: int) -> dict:
        """The shadow policy's pick for this request: now if the route has its signature,
        else when the signature arrives (filled into the returned dict)."""
        shadow = self.p.shadow
        if route.signature is not None or not waiters:
            return shadow.evaluate(route, loads, chosen)
        if _delivered(waiters[0]):  # it came before the decision
            return shadow.evaluate_message(waiters[0].result(), loads, chosen)
        # it comes later, maybe after the request ended: the intake hands it over
        return shadow.expect(room, loads, chosen)

    # ------------------------------------------------------------ decode
    async def decode(self, d: Worker, fl: Flight):
        """POST to decode; its response, a failed PrefillResult, or an UpstreamError."""
        prefill_task = fl.prefill_task
        if prefill_task.done() and not prefill_task.result().ok:
            return prefill_task.result()  # already failed: never send the decode
        post = asyncio.ensure_future(self.p.upstream.post(
            d.endpoint(fl.endpoint), fl.payload, headers=fl.headers, on_sent=fl.on_sent(d)))
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
