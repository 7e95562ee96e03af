"""Co-located mode: whole requests across plain (non-PD) SGLang servers, routed by the
signature predicted from the prompt.

    python -m eldr_sglang.router --mode colocated --worker http://s0:30000 --worker http://s1:30000 \\
        --calibration artifact.json [--tokenizer MODEL_DIR] --port 8000

Each request (:mod:`~eldr_sglang.router.flow.colocated`): the bounded view -> token ids
(``input_ids`` as sent, else the model's tokenizer; the chat template for
``/v1/chat/completions``) -> predicted counts (the artifact's predictor) -> the same
policy objects and send loop as the PD router choose a server given its load -> the
unchanged body goes there and its answer (streamed or not) is relayed. A refused
connection (the server never saw the request) is retried on the next choice. No
prefill/decode split, so none of late binding's requirements apply.

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
from typing import Any, Optional, Sequence

from aiohttp import web

from eldr_sglang.prompts import Tokenizer, default_tokenizer_path, load_tokenizer
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.flow.colocated import ColocatedFlow
from eldr_sglang.router.flow.send import Sender
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.signals.intake import RateLimitedLog
from eldr_sglang.router.signals.prompt_work import PromptWork
from eldr_sglang.router.signals.scoring import PredictedRouting, ScoreEndpoint, path_counter
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
        self.sender = Sender(c, m, self.pool, self.state, self.relay, RateLimitedLog())
        self.score = ScoreEndpoint(lambda: self.predicted, lambda: self.routing.policy,
                                   lambda: [w.url for w in self.pool.decodes],
                                   self.pool.decode_loads, self.paths, parser=self.parser,
                                   work=self.work, max_batch=c.max_batch, body_limit=self.body_limit,
                                   body_timeout=c.client_body_timeout or None,
                                   retry_after=c.retry_after, explain=self.sender.explain)
        self.flow = ColocatedFlow(self.sender, self.parser, self.upstream, self.decisions, self.paths,
                                  self.work, lambda: self.predicted, self.bad)
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
                **self.flow.describe(),
                "workers": [w.describe() for w in self.pool.decodes]}

    async def stop_flow(self) -> None:
        self.work.close()


def build_colocated_router(args: Any) -> ColocatedRouter:
    """From the CLI's parsed arguments (``--worker`` URLs and the RouterConfig)."""
    return ColocatedRouter(args.worker, config=args.router_config)
