"""Predicted signatures for routers that choose before prefill, and ``POST /eldr/score``.

:class:`PredictedRouting` turns a request body into the :class:`RouteRequest` the
policies take, from the prompt alone: token ids (the model's tokenizer, or the
client's ``input_ids``) -> the artifact's predictor -> predicted raw counts of the
selected layers -> ``signature`` (IDF-weighted, L2-normalised, as the router does
with a prefill signature message) and ``activation`` (counts / prompt tokens, as
:func:`~eldr_sglang.router.signals.signatures.activation`). A batch combines its items as
the PD router does.

``POST /eldr/score`` answers which servers a request should go to, for a router
that keeps its own dispatch (sglang-router/smg, llm-d, a gateway)::

    {"text": "..."} | {"input_ids": [...]} | {"prompt": ...} | {"messages": [...]}
    (optional "endpoint": "generate" | "v1/completions" | "v1/chat/completions")
    -> {"server": URL, "index": i, "region": k, "ranked": [{"url", "index",
        "similarity"}, ...], "similarities": [per centroid], "prompt_tokens": n,
        "coverage": share of tokens the predictor has seen, "routing_key": "eldr-<k>"}

``ranked`` is by predicted similarity, best first; ``server`` is what the policy
picks given the loads this router knows (its own in-flight counts), so a caller
without load information can take it, and one with its own can take ``ranked`` or
``routing_key`` (stable per region: a consistent-hash key).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import numpy as np
from aiohttp import web
from prometheus_client import Counter

from eldr_sglang.core.policies import Decision, Policy, RouteRequest
from eldr_sglang.prompts import PieceTokenizer, Tokenizer, request_token_ids
from eldr_sglang.router.http.bodies import BodyError, BodyParser, read_body
from eldr_sglang.router.http.prompt_view import prompt_view
from eldr_sglang.router.http.responses import error_response, json_response
from eldr_sglang.router.signals.prompt_work import PromptWork
from eldr_sglang.router.signals.signatures import combine, union

# which path each request took: predicted (routed by its predicted signature), fallback
# (the policy wanted a signature, the prompt gave none: no predictor, no tokens), blind
# (the policy routes without one)
PATHS = ("predicted", "fallback", "blind")


def path_counter(registry: Any) -> Counter:
    """``eldr_router_route_path_total{mode, path}`` on the router's metrics registry."""
    return Counter("eldr_router_route_path", "Requests routed before prefill, by path "
                   "(predicted signature, fallback without one, blind policy) and mode "
                   "(colocated, score, early)", ["mode", "path"], registry=registry)


class PredictedRouting:
    """Request body -> predicted :class:`RouteRequest` (no I/O; the policy is the caller's)."""

    def __init__(self, artifact: Any, tokenizer: Optional[Tokenizer]) -> None:
        self.artifact, self.tokenizer = artifact, tokenizer
        self._pieces = PieceTokenizer(tokenizer) if isinstance(tokenizer, Tokenizer) else tokenizer
        self.predictor = getattr(artifact, "predictor", None) if artifact is not None else None

    @property
    def can_predict(self) -> bool:
        return self.predictor is not None

    def token_ids(self, body: dict, endpoint: str) -> list[list[int]]:
        """Token ids per item; ValueError for a malformed body (answered 400)."""
        return request_token_ids(body, endpoint, self._pieces)

    def predict(self, view: dict, endpoint: str) -> tuple[Optional[RouteRequest], dict]:
        """A bounded view (:func:`~eldr_sglang.router.http.prompt_view.bounded_view`) ->
        (RouteRequest, facts), or (None, {}) when it has no prompt (``input_embeds``);
        ValueError when it cannot be tokenised. Runs on the prompt thread."""
        items = self.token_ids(view, endpoint) if any(
            k in view for k in ("text", "input_ids", "prompt", "messages")) else []
        return self.route(items) if items else (None, {})

    def route(self, items: Sequence[Sequence[int]], label: Optional[str] = None) -> tuple[RouteRequest, dict]:
        """(RouteRequest with predicted signature and activation, facts for the caller)."""
        if not self.can_predict:
            return RouteRequest(label=label), {"prompt_tokens": sum(len(t) for t in items)}
        sigs, acts, cover = [], [], []
        for ids in items:
            counts = self.predictor.predict(ids)
            sigs.append(self.artifact.signature(counts))
            n = max(float(len(ids)), float(counts.max(initial=0)), 1.0)
            acts.append((counts.reshape(-1) / np.float32(n)).astype(np.float32))
            cover.append(self.predictor.coverage(ids))
        facts = {"prompt_tokens": sum(len(t) for t in items), "coverage": float(np.mean(cover))}
        return RouteRequest(signature=combine(sigs), label=label, activation=union(acts)), facts


def path_of(policy: Policy, route: RouteRequest, dec: Decision) -> str:
    """The path a decision took (one of :data:`PATHS`)."""
    if dec.fallback is not None:  # the policy could not use its own rule (e.g. degenerate_cost)
        return "fallback"
    if not getattr(policy, "needs_signature", False) and not getattr(policy, "uses_activation", False):
        return "blind"
    return "predicted" if route.signature is not None else "fallback"


def decide(policy: Policy, route: RouteRequest, loads: Sequence[int],
           allowed: Optional[Sequence[bool]] = None, explain=None) -> tuple[Decision, str]:
    """The policy's decision and the path it took. ``explain``: the routers' own
    (:meth:`~eldr_sglang.router.flow.send.Sender.explain`: a request the policy cannot
    take goes to the least loaded server), default ``policy.explain``."""
    dec = explain(policy, route, loads, allowed) if explain is not None else policy.explain(route, loads, allowed)
    return dec, path_of(policy, route, dec)


class ScoreEndpoint:
    """``POST /eldr/score`` over a :class:`PredictedRouting`, a policy and a server list.

    ``routing()`` -> the live :class:`PredictedRouting`, ``policy()`` the live policy
    (both read per request: a reload may swap them); ``servers()`` -> URLs in policy
    order, ``loads()`` -> their loads. The body goes the co-located flow's way: read
    under the cap, viewed off the loop when big (:func:`prompt_view`), the prompt work
    on the bounded prompt thread (``work``)."""

    def __init__(self, routing, policy, servers, loads, counter: Counter, *, parser: BodyParser,
                 work: PromptWork, max_batch: int, body_limit: int = 32 << 20,
                 body_timeout: Optional[float] = None, retry_after: Optional[int] = None,
                 explain=None) -> None:
        self.routing, self.policy, self.servers, self.loads = routing, policy, servers, loads
        self.counter, self.explain = counter, explain
        self.parser, self.work, self.max_batch = parser, work, max_batch
        self.body_limit, self.body_timeout, self.retry_after = body_limit, body_timeout, retry_after

    async def handle(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        try:
            raw = await read_body(request, self.body_limit, self.body_timeout)
            out = await self.parser.run(prompt_view, raw, None, self.max_batch)
            if out[0] == "error":
                return error_response(out[1], out[2])
            _, view, endpoint = out
            predicted = self.routing()
            route, facts = await self.work.run(predicted.predict, view, endpoint)
        except BodyError as e:
            return error_response(e.status, str(e), self.retry_after if e.status == 503 else None)
        except ValueError as e:
            return error_response(400, str(e))
        if not predicted.can_predict:
            return error_response(409, "the calibration artifact has no signature predictor "
                                  "(calibrate with --predictor-prompts)")
        if route is None:
            return error_response(400, "the request has no prompt to score")
        policy = self.policy()
        urls = self.servers()
        dec, path = decide(policy, route, self.loads(), explain=self.explain)
        self.counter.labels("score", path).inc()
        sims = np.asarray(predicted.artifact.centroids, dtype=np.float32) @ route.signature
        server_sims = dec.server_similarities
        if server_sims is None:  # a policy that does not score servers: server i ~ centroid i
            server_sims = np.array([sims[i % len(sims)] for i in range(len(urls))], dtype=np.float32)
        order = np.argsort(-server_sims, kind="stable")
        region = int(np.argmax(sims))
        return json_response({
            "server": urls[dec.index], "index": dec.index, "region": region, "routing_key": f"eldr-{region}",
            "policy": dec.policy, "reason": dec.reason, "path": path,
            "ranked": [{"url": urls[i], "index": int(i), "similarity": round(float(server_sims[i]), 6)}
                       for i in order],
            "similarities": [round(float(s), 6) for s in sims],
            **facts, "elapsed_ms": round(1e3 * (time.perf_counter() - t0), 3)})
