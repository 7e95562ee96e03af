"""Early binding in the PD router (``--binding early|auto``): choose the decode server at
arrival from the PREDICTED signature, so prefill and decode are sent together (as
sglang-router does) instead of after the prefill's signature message.

* ``late`` (default): unchanged, the dispatch waits for the signature;
* ``early``: every request with a predictable prompt binds at arrival;
* ``auto``: early when the predicted signature's best region leads the second by at
  least ``binding_margin`` (cosine), late otherwise.

A request falls back to late binding when the live artifact has no predictor or the
prompt has no token ids (e.g. ``input_embeds``). Each request's path is counted in
``eldr_router_route_path_total{mode="early", path="early"|"late"}``. The dispatch
awaits :meth:`EarlyBinding.route` once per request; everything else is this module's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

import numpy as np

from eldr_sglang.core.policies import RouteRequest
from eldr_sglang.prompts import default_tokenizer_path, load_tokenizer
from eldr_sglang.router.http.bodies import BodyError
from eldr_sglang.router.http.prompt_view import bounded_view
from eldr_sglang.router.signals.prompt_work import PromptWork
from eldr_sglang.router.signals.scoring import PredictedRouting, path_counter


class EarlyBinding:
    """Per router: the predicted routing of its live artifact and the path counter.
    ``encoder()``: the router's live signature encoder (it changes on reloads)."""

    def __init__(self, config: Any, registry: Any, encoder: Callable[[], Any]) -> None:
        self.encoder, self.mode, self.margin = encoder, config.binding, float(config.binding_margin)
        self.counter = path_counter(registry)
        self.work, self.max_batch = PromptWork(), int(config.max_batch)
        self._tok_path = config.tokenizer
        self._tokenizer: Any = None
        self._for: Any = None  # the artifact the cached PredictedRouting belongs to
        self._predicted: Optional[PredictedRouting] = None

    def _routing(self) -> Optional[PredictedRouting]:
        art = getattr(self.encoder(), "artifact", None)
        if art is None or getattr(art, "predictor", None) is None:
            return None
        if art is not self._for:  # a reload swapped the artifact
            if self._tokenizer is None:
                path = self._tok_path or default_tokenizer_path(art)
                self._tokenizer = load_tokenizer(path) if path else False
            self._predicted = PredictedRouting(art, self._tokenizer or None)
            self._for = art
        return self._predicted

    async def route(self, body: dict, endpoint: str, label: Optional[str]) -> Optional[RouteRequest]:
        """The predicted route to bind at arrival, or None (bind late). The prompt is
        read through its bounded view and predicted on the prompt thread, never on the
        event loop; a body whose prompt was kept as raw JSON (a big one) binds late."""
        if self.mode == "late":
            return None
        pr = self._routing()
        route = None
        if pr is not None:
            try:
                route = await self.work.run(self._predict, pr, body, endpoint, label)
            except (ValueError, BodyError):  # no prompt the view can read; the prompt thread busy
                route = None
            if route is not None and self.mode == "auto" and not self._confident(route.signature):
                route = None
        self.counter.labels("early", "late" if route is None else "early").inc()
        return route

    def _predict(self, pr: PredictedRouting, body: dict, endpoint: str,
                 label: Optional[str]) -> Optional[RouteRequest]:
        route, _ = pr.predict(bounded_view(body, endpoint, self.max_batch), endpoint)
        return replace(route, label=label) if route is not None else None

    def close(self) -> None:
        self.work.close()

    def _confident(self, signature: np.ndarray) -> bool:
        sims = np.sort(self.encoder().centroids @ signature)
        return sims.size < 2 or float(sims[-1] - sims[-2]) >= self.margin

