"""The co-located flow: whole requests to plain (non-PD) SGLang servers, routed by the
signature predicted from the prompt.

``admit``: the bounded view of the body (:mod:`~eldr_sglang.router.http.prompt_view`,
off the loop when big); ``serve``: the prompt tokenised and predicted on the prompt
thread (:mod:`~eldr_sglang.router.signals.prompt_work`), then the one send loop every
flow uses (:class:`~eldr_sglang.router.flow.send.Sender`): the unchanged raw body goes
to the chosen server, a refused connection to the next choice, the answer (streamed or
not) is relayed."""

from __future__ import annotations

from typing import Any, Callable

from aiohttp import web
from prometheus_client import Counter

from eldr_sglang.core.policies import Decision, RouteRequest
from eldr_sglang.router.flow.dispatch_parts import Flight
from eldr_sglang.router.flow.send import Posted, Sender
from eldr_sglang.router.http.bodies import BodyError, BodyParser
from eldr_sglang.router.http.clients import REQUEST_ID_KEY
from eldr_sglang.router.http.prompt_view import prompt_view
from eldr_sglang.router.pool import upstream
from eldr_sglang.router.pool.workers import Worker
from eldr_sglang.router.signals.prompt_work import PromptWork
from eldr_sglang.router.signals.scoring import PredictedRouting, path_of
from eldr_sglang.router.state.decision_log import DecisionLog


class ColocatedFlow:
    """view -> predict -> send, for a co-located router's shell."""

    def __init__(self, sender: Sender, parser: BodyParser, client: upstream.UpstreamClient,
                 decisions: DecisionLog, paths: Counter, work: PromptWork,
                 predicted: Callable[[], PredictedRouting], bad: Callable[[str, int], web.Response]) -> None:
        self.sender, self.parser, self.upstream, self.decisions = sender, parser, client, decisions
        self.paths, self.work, self.predicted, self.bad = paths, work, predicted, bad

    async def admit(self, request: web.Request, raw: bytes, endpoint: str, t0: float) -> Flight:
        """The bounded view (BodyError when refused); the raw body is what goes upstream."""
        out = await self.parser.run(prompt_view, raw, endpoint, self.sender.config.max_batch)
        if out[0] == "error":
            raise BodyError(out[2], out[1])
        view = out[1]
        rid = request.get(REQUEST_ID_KEY)
        return Flight(endpoint, t0, view, None, [], self.sender.state.routing, headers=(rid,) if rid else (),
                      stream=bool(view.get("stream", False)), payload=raw)

    async def serve(self, request: web.Request, fl: Flight) -> web.StreamResponse:
        predicted = self.predicted()
        try:  # tokenised and predicted on the prompt thread
            route, _ = await self.work.run(predicted.predict, fl.body, fl.endpoint)
        except BodyError as e:
            return self.bad(str(e), e.status)
        except ValueError as e:
            if predicted.can_predict or predicted.tokenizer is not None:
                return self.bad(str(e), 400)
            route = None  # nothing to predict with anyway: route by load
        fl.route = route if route is not None else RouteRequest()
        return await self.sender.send(request, fl, self.post, self.note)

    async def post(self, w: Worker, fl: Flight) -> Posted:
        try:
            return await self.upstream.post(w.endpoint(fl.endpoint), fl.payload, headers=fl.headers,
                                            on_sent=fl.on_sent(w))
        except upstream.UpstreamError as e:
            return e

    def note(self, fl: Flight, w: Worker, dec: Decision, loads: list) -> None:
        self.paths.labels("colocated", path_of(fl.routing.policy, fl.route, dec)).inc()
        self.decisions.record([], [], None, [], w, dec, loads, self.sender.pool.decodes)

    def describe(self) -> dict[str, Any]:
        return {"prompt_work": self.work.describe()}
