"""The one send loop and the one decide every flow uses (the PD flow, the co-located
flow) and ``POST /eldr/score`` (its ``explain``).

:meth:`Sender.send`: choose (:meth:`Sender.decide`) -> note the decision (the flow's
hook) -> enter the worker -> admit into the policy -> post (the flow's hook: PD races
the decode against its prefill) -> a refused connection goes to the next choice (the
worker never saw the request) -> relay -> leave and release on every path."""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable, Optional, Sequence, Union

import numpy as np
from aiohttp import web

from eldr_sglang.core.policies import Decision, Policy, RouteRequest, least_loaded
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.flow.dispatch_parts import Flight, PrefillResult
from eldr_sglang.router.flow.relay import Relay
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.pool import upstream
from eldr_sglang.router.pool.workers import Worker, WorkerPool
from eldr_sglang.router.signals.intake import RateLimitedLog
from eldr_sglang.router.state.routing import Routing, RoutingState

decision_logger = logging.getLogger("eldr_sglang.router.decisions")
Posted = Union[upstream.UpstreamResponse, PrefillResult, upstream.UpstreamError]
Post = Callable[[Worker, Flight], Awaitable[Posted]]
Note = Callable[[Flight, Worker, Decision, list], None]


def route_kind(policy: Policy, req: RouteRequest, dec: Decision) -> str:
    """How a decision was made: ``blind`` (the policy reads no signature), ``signature``
    (by the request's signature or activation), ``fallback`` (it wanted one, had none)."""
    if not policy.needs_signature:
        return "blind"
    has = req.signature is not None or req.activation is not None
    return "signature" if has and dec.fallback is None else "fallback"


class Sender:
    """Decide and send for one router process (its pool, state, relay and log)."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, pool: WorkerPool,
                 state: RoutingState, relay: Relay, log: RateLimitedLog) -> None:
        self.config, self.metrics, self.pool, self.state = config, metrics, pool, state
        self.relay, self.log = relay, log
        self.decision_level = logging.INFO if config.log_decisions else logging.DEBUG
        m = metrics  # request-path histograms: observed in batches (Deferred)
        self._added, self._choose = m.deferred(m.added_latency), m.deferred(m.choose_time)
        self._band, self._best = m.deferred(m.band_size), m.deferred(m.best_similarity)
        self._children: dict[tuple[str, str, str], tuple] = {}
        self._rng = np.random.default_rng(config.seed)

    # ------------------------------------------------------------ decide
    def explain(self, policy: Policy, req: RouteRequest, loads: Sequence[int],
                allowed: Optional[Sequence[bool]] = None) -> Decision:
        """``policy.explain``; a request the policy cannot take (a signature of other
        layers) goes to the least loaded allowed server (``fallback="policy_mismatch"``)."""
        try:
            return policy.explain(req, loads, allowed)
        except (ValueError, IndexError) as e:
            self.log.warn("policy_mismatch", "policy %s cannot route this request (%s); "
                          "least loaded", policy.name, e)
            idx = np.flatnonzero(allowed) if allowed is not None else np.arange(len(loads))
            return Decision(least_loaded(loads, idx, self._rng), policy.name, "policy_error",
                            fallback="policy_mismatch")

    def decide(self, req: RouteRequest, exclude: set[int] = frozenset(), rids: Sequence[str] = (),
               routing: Optional[Routing] = None) -> tuple[Worker, Decision, list[int]]:
        """Pick the server (``policy.explain``: the same pick as ``choose``), counted and
        logged; (server, decision, the loads it saw). ``routing``: the one the request
        arrived under (default: the live one)."""
        routing = routing or self.state.routing
        pool, m = self.pool, self.metrics
        decodes = pool.decodes
        loads = pool.decode_loads()
        allowed = pool.allowed_decodes(exclude)
        t0 = time.perf_counter()
        dec = self.explain(routing.policy, req, loads, allowed)
        if dec.fallback is not None and req.fallback is None:  # at most one per decision
            m.fallbacks.labels(dec.fallback).inc()
        self._choose.observe(time.perf_counter() - t0)
        d = decodes[dec.index]
        key = (routing.name, route_kind(routing.policy, req, dec), d.url)
        children = self._children.get(key)
        if children is None:  # labels() lookups cost microseconds: once per key
            children = self._children[key] = (m.decisions.labels(*key[:2]), m.requests.labels(key[0], d.url))
        for child in children:
            child.inc()
        if dec.band is not None:
            self._band.observe(len(dec.band))
            self._best.observe(dec.best_similarity)  # None (cost-only decisions) is skipped
        if decision_logger.isEnabledFor(self.decision_level):
            decision_logger.log(
                self.decision_level, "decision rids=%s policy=%s reason=%s top3=%s band=%s loads=%s "
                "allowed=%s chosen=%d %s", list(rids)[:4], routing.name, dec.reason,
                [(decodes[i].url, round(v, 4)) for i, v in dec.top(3)],
                list(dec.band) if dec.band is not None else None, loads,
                [i for i, a in enumerate(allowed) if a], dec.index, d.url)
        return d, dec, loads

    def admit_policy(self, policy: Policy, index: int, route: RouteRequest) -> Any:
        """``policy.admit``; a signature it cannot take is a counted fallback (admitted
        without it), never an error."""
        try:
            return policy.admit(index, route)
        except (ValueError, IndexError) as e:
            if route.fallback is None:  # at most one per decision
                self.metrics.fallbacks.labels("policy_mismatch").inc()
            self.log.warn("policy_mismatch", "policy %s cannot take this signature: %s", policy.name, e)
            return policy.admit(index, RouteRequest(label=route.label))

    # ------------------------------------------------------------ send
    async def send(self, request: web.Request, fl: Flight, post: Post, note: Note) -> web.StreamResponse:
        """Choose, post, relay; a refused connection goes to the next choice."""
        pool = self.pool
        tried: set[int] = set()
        while True:
            d, dec, loads = self.decide(fl.route, tried, fl.rids, fl.routing)
            if dec.reason == "policy_error":  # the signature does not fit the policy
                fl.route = RouteRequest(label=fl.label)
            note(fl, d, dec, loads)
            ticket = pool.enter(d)
            admitted = None
            try:  # every step after enter() is inside the release path
                admitted = self.admit_policy(fl.routing.policy, dec.index, fl.route)
                fl.decode_sent = True  # PD: from here on the prefill is never re-sent
                if not tried:
                    self._added.observe(time.perf_counter() - fl.t0 - fl.waited)
                out = await post(d, fl)
                if isinstance(out, PrefillResult):  # prefill failed first: abort the decode
                    self.relay.abort_sent(fl, [d])
                    return self.relay.prefill_error(out)
                if isinstance(out, upstream.ConnectError) and len(tried) + 1 < len(pool.decodes):
                    pool.failure(d, ticket, repr(out), "connect", hard=True)
                    tried.update(i for i, x in enumerate(pool.decodes) if x is d)
                    self.metrics.retries.labels("decode" if fl.prefill_task is not None else "worker").inc()
                    continue  # never reached the server (PD: the room is still unbound)
                if isinstance(out, upstream.UpstreamError):
                    return self.relay.decode_failed(d, ticket, out, fl)
                try:
                    return await self.relay.relay(request, out, d, ticket, fl)
                finally:
                    out.release()
            finally:
                pool.leave(d, ticket)
                fl.routing.policy.release(admitted)
