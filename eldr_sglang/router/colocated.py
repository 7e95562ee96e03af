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
the servers for a prompt without sending it (:mod:`~eldr_sglang.router.signals.scoring`).

It is the PD router's server shell (:mod:`~eldr_sglang.router.shell`) with another
flow: the same client conventions, admission and drain, relay, status, metrics, admin
API (membership, calibration reload, ``--calibration-watch``, decision log), A/B
slices and engine reports. What needs measured signature messages (``--online``,
``--shadow-policy``) is the PD flow's only.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import numpy as np
from aiohttp import web

from eldr_sglang.core.policies import least_loaded
from eldr_sglang.prompts import Tokenizer, default_tokenizer_path, load_tokenizer
from eldr_sglang.router.pool import upstream
from eldr_sglang.router.http.bodies import BodyError, read_body
from eldr_sglang.router.http.prompt_view import prompt_view
from eldr_sglang.router.http.clients import REQUEST_ID_KEY
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.flow.dispatch_parts import Flight
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.http.responses import error_response
from eldr_sglang.router.state.routing import Routing
from eldr_sglang.router.signals.prompt_work import PromptWork
from eldr_sglang.router.signals.scoring import PredictedRouting, ScoreEndpoint, decide, path_counter
from eldr_sglang.router.shell import RouterShell, initial_artifact
from eldr_sglang.router.pool.workers import Worker, WorkerPool

logger = logging.getLogger("eldr_sglang.router")


class ColocatedPool(WorkerPool):
    """The worker pool with plain servers only (kept as ``decodes``: each runs whole requests)."""

    decode_role = "worker"
    needs_prefill = False
    missing = "need at least one --worker"

    def __init__(self, workers: Sequence[str], config: RouterConfig, metrics: RouterMetrics) -> None:
        super().__init__([], workers, config, metrics)

    def add_prefill(self, url: str, bootstrap_port: Optional[int]) -> Worker:
        raise ValueError("a co-located router has no prefill servers")

    def remove_prefill(self, url: str) -> Worker:
        raise ValueError("a co-located router has no prefill servers")


class ColocatedRouter(RouterShell):
    """One co-located router process: the shell and the predict -> decide -> send flow
    (serve with ``start_router``)."""

    mode = "colocated"

    def __init__(self, workers: Sequence[str], *, artifact: Any = None, tokenizer: Optional[Tokenizer] = None,
                 config: Optional[RouterConfig] = None, **settings: Any) -> None:
        c = config or RouterConfig.from_dict(settings)
        m = RouterMetrics()
        if artifact is None:
            artifact = initial_artifact(c)
        super().__init__(c, m, ColocatedPool(workers, c, m), artifact)
        if tokenizer is None:
            path = getattr(c, "tokenizer", None) or default_tokenizer_path(artifact)
            tokenizer = load_tokenizer(path) if path else None
        self.tokenizer = tokenizer
        self.predicted = PredictedRouting(artifact, tokenizer)
        self.paths = path_counter(m.registry)
        self.work = PromptWork()
        self.score = ScoreEndpoint(lambda: self.predicted, lambda: self.routing.policy,
                                   lambda: [w.url for w in self.pool.decodes],
                                   self.pool.decode_loads, self.paths, parser=self.parser,
                                   work=self.work, max_batch=c.max_batch, body_limit=self.body_limit,
                                   body_timeout=c.client_body_timeout or None,
                                   retry_after=c.retry_after)
        self._rng = np.random.default_rng(c.seed)
        if not self.predicted.can_predict and self.routing.policy.needs_signature:
            logger.warning("policy %s needs signatures and the artifact has no predictor: every request "
                           "falls back to least loaded", c.policy)

    # ------------------------------------------------------------ the public API
    @property
    def artifact(self) -> Any:
        return self.predicted.artifact

    # ------------------------------------------------------------ the shell's hooks
    def adopt(self, art: Any) -> None:
        self.predicted = PredictedRouting(art, self.tokenizer)

    def flow_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/eldr/score", self.score.handle)

    def flow_status(self) -> dict:
        return {"predictor": self.predicted.can_predict, "tokenizer": getattr(self.tokenizer, "path", None),
                "prompt_work": self.work.describe(),
                "workers": [w.describe() for w in self.pool.decodes]}

    async def stop_flow(self) -> None:
        self.work.close()

    # ------------------------------------------------------------ the flow
    async def handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """Read the body first (size cap, time limit), only then take an in-flight slot."""
        t0 = time.perf_counter()
        try:
            raw = await read_body(request, self.body_limit, self.config.client_body_timeout or None)
        except BodyError as e:
            return self._bad(str(e), e.status)
        refusal = self.admission.refusal()
        if refusal is not None:
            return refusal
        self.admission.enter()
        routing, status = self.routing, 0  # the A/B arm is the policy a request arrived under
        token = self.ab.request_started(routing) if self.ab is not None else None
        try:
            resp = await self._serve(request, endpoint, t0, raw, routing)
            status = resp.status
            return resp
        finally:
            self.admission.leave()
            elapsed = time.perf_counter() - t0
            self.metrics.deferred(self.metrics.request_duration, endpoint).observe(elapsed)
            if self.ab is not None:
                self.ab.request_done(token, elapsed, status)

    def _bad(self, message: str, status: int = 400) -> web.Response:
        kind = {408: "body_timeout", 413: "too_large", 503: "busy"}.get(status, "bad_request")
        self.metrics.errors.labels(kind).inc()
        return error_response(status, message, self.config.retry_after if status == 503 else None)

    async def _serve(self, request: web.Request, endpoint: str, t0: float, raw: bytes,
                     routing: Routing) -> web.StreamResponse:
        # viewed in the parser process when big: only the bounded view comes back
        out = await self.parser.run(prompt_view, raw, endpoint, self.config.max_batch)
        if out[0] == "error":
            return self._bad(out[2], out[1])
        view = out[1]
        predicted = self.predicted
        try:  # tokenised and predicted on the prompt thread
            route, _ = await self.work.run(predicted.predict, view, endpoint)
        except BodyError as e:
            return self._bad(str(e), e.status)
        except ValueError as e:
            if predicted.can_predict or self.tokenizer is not None:
                return self._bad(str(e))
            route = None  # nothing to predict with anyway: route by load
        body = view
        rid = request.get(REQUEST_ID_KEY)
        fl = Flight(endpoint, t0, body, None, [], routing, headers=(rid,) if rid else (),
                    stream=bool(body.get("stream", False)), payload=raw)
        return await self._send(request, fl, route)

    async def _send(self, request: web.Request, fl: Flight, route) -> web.StreamResponse:
        """Choose, send, relay; a refused connection goes to the next choice."""
        policy, tried = fl.routing.policy, set()
        while True:
            w, index, path, dec, loads = self._choose(policy, route, tried)
            self.paths.labels("colocated", path).inc()
            if dec is not None:
                self.decisions.record([], [], None, [], w, dec, loads, self.pool.decodes)
            ticket = self.pool.enter(w)
            admitted = policy.admit(index, route) if route is not None else None
            try:
                if not tried:
                    self.metrics.added_latency.observe(time.perf_counter() - fl.t0)
                try:
                    resp = await self.upstream.post(w.endpoint(fl.endpoint), fl.payload,
                                                    headers=fl.headers, on_sent=fl.on_sent(w))
                except upstream.ConnectError as e:
                    tried.add(index)
                    if len(tried) < len(self.pool.decodes):
                        self.pool.failure(w, ticket, repr(e), "connect", hard=True)
                        self.metrics.retries.labels("worker").inc()
                        continue
                    return self.relay.decode_failed(w, ticket, e, fl)
                except upstream.UpstreamError as e:
                    return self.relay.decode_failed(w, ticket, e, fl)
                try:
                    return await self.relay.relay(request, resp, w, ticket, fl)
                finally:
                    resp.release()
            finally:
                self.pool.leave(w, ticket)
                if route is not None:
                    policy.release(admitted)

    def _choose(self, policy, route, tried: set[int]):
        """(worker, index, path, decision or None, loads)."""
        loads = self.pool.decode_loads()
        allowed = self.pool.allowed_decodes(tried)
        t0 = time.perf_counter()
        dec = None
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
                dec = None
        self.metrics.choose_time.observe(time.perf_counter() - t0)
        w = self.pool.decodes[index]
        self.metrics.requests.labels(policy.name, w.url).inc()
        return w, index, path, dec, loads


def build_colocated_router(args: Any) -> ColocatedRouter:
    """From the CLI's parsed arguments (``--worker`` URLs and the RouterConfig)."""
    return ColocatedRouter(args.worker, config=args.router_config)
