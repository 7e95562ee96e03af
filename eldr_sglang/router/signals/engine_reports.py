"""Engine-reported decode batches and step laws, read with the load poll.

Each decode server's engine plugin serves ``GET /eldr/batch`` on its
``--eldr-metrics-port`` (:mod:`eldr_sglang.patches.batch_report`): the per-expert
usage of its live batch (every router replica's requests) and its last steps'
samples. With ``--engine-metrics URL,...`` (the plugin endpoints, in ``--decode``
order) the router reads it every ``--load-interval`` and

* hands each policy that prices live batches (``observe_engine``) the batch's
  ``log(1 - usage)`` on the artifact's layers: the true batch at the report, to which
  the policy adds its own admits and releases since;
* fits the servers' step law (:mod:`eldr_sglang.core.step_law`) from the samples,
  off the event loop, every ``FIT_EVERY_S``: one law on every server's samples
  together, and a server's own law only where it differs from that one by more than
  noise (:func:`~eldr_sglang.core.step_law.pooled_laws`; per-server fits that differ
  by noise alone would steer requests for nothing), handed to the policy
  (``set_step_law``) as a
  :class:`~eldr_sglang.core.policies.StepCost` on the published layers: the engine's
  ``U`` counts every MoE layer, the policy's the published ones, so the per-expert
  term is scaled by ``layers / published``, and the KV term is folded into the
  per-sequence one at the samples' mean KV tokens per sequence. A law that fits
  badly contributes its per-expert term only as far as its R^2 supports it.

The laws and their R^2 are on ``/metrics`` (``eldr_router_step_law_seconds{server,
term}``, ``eldr_router_step_law_r2{server}``) and ``/eldr/status``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import aiohttp
import numpy as np

from eldr_sglang.core.policies.state_aware import P_MAX
from eldr_sglang.core.step_law import MIN_SAMPLES, StepLaw, as_step_cost, pooled_laws

logger = logging.getLogger("eldr_sglang.router")

SAMPLES_KEPT = 1024  # step samples per server the law is fitted on
STALE_POLLS = 4  # a server idle this many poll intervals runs no batch
FIT_EVERY_S = 5.0  # seconds between two fits of the step laws


def batch_url(metrics_url: str) -> str:
    """``http://h:p/metrics`` (or ``http://h:p``) -> ``http://h:p/eldr/batch``."""
    base = metrics_url.rstrip("/")
    return (base[: -len("/metrics")] if base.endswith("/metrics") else base) + "/eldr/batch"


@dataclass
class ServerReport:
    """What the router knows of one decode server's engine."""

    url: str  # the engine's /eldr/batch
    steps: int = 0  # the engine's step count at the last report
    batch_size: int = 0
    samples: deque = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))
    law: Optional[StepLaw] = None
    errors: int = 0
    num_layers: int = 0

    def describe(self) -> dict:
        return {"url": self.url, "steps": self.steps, "batch_size": self.batch_size,
                "samples": len(self.samples), "errors": self.errors,
                "law": self.law.to_dict() if self.law else None}


class EngineReports:
    """Polls the decode servers' engine reports and feeds the live policies."""

    def __init__(self, state: Any, metrics: Any, session: Callable[[], Optional[aiohttp.ClientSession]],
                 engine_urls: list[str], interval: float, timeout: float) -> None:
        self.state, self.metrics, self.session = state, metrics, session
        self.interval, self.timeout = interval, timeout
        decodes = [d.url for d in state.pool.decodes]
        # by decode URL: membership changes keep each server's engine
        self.servers: dict[str, ServerReport] = {u: ServerReport(batch_url(e)) for u, e in zip(decodes, engine_urls)}
        self._fitting = False
        self._last_fit = -FIT_EVERY_S

    def policies(self) -> list:
        st = self.state
        return list({id(r.policy): r.policy for r in [st.routing, *st.arms]}.values())

    async def poll(self) -> None:
        """One round: every decode server with an engine URL."""
        decodes = [d.url for d in self.state.pool.decodes]
        await asyncio.gather(*(self._poll(i, u) for i, u in enumerate(decodes) if u in self.servers))
        loop = asyncio.get_running_loop()
        if (not self._fitting and loop.time() - self._last_fit >= FIT_EVERY_S
                and any(len(r.samples) >= MIN_SAMPLES for r in self.servers.values())):
            self._fitting, self._last_fit = True, loop.time()
            loop.create_task(self._fit({u: list(r.samples) for u, r in self.servers.items()}))

    async def _poll(self, index: int, url: str) -> None:
        rep = self.servers[url]
        session = self.session()
        if session is None:
            return
        try:
            async with session.get(rep.url, timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                doc = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
            doc = None
        if not isinstance(doc, dict) or "usage" not in doc:
            rep.errors += 1
            self._observe(index, None)  # unknown: own state only until the next report
            return
        self._take(index, url, rep, doc)

    def _take(self, index: int, url: str, rep: ServerReport, doc: dict) -> None:
        usage = np.asarray(doc["usage"], dtype=np.float64)
        rep.num_layers = usage.shape[0]
        steps = int(doc.get("steps", 0))
        new = steps - rep.steps if steps >= rep.steps else steps  # fewer: the engine restarted
        fresh = doc.get("samples", [])[-new:] if new else []
        rep.samples.extend(fresh)
        rep.steps, rep.batch_size = steps, int(doc.get("batch_size", 0))
        enc = self.state.routing.encoder
        if enc is not None and max(enc.layers) < usage.shape[0]:
            idle = float(doc.get("idle_s", 0.0)) > STALE_POLLS * self.interval
            used = np.zeros_like(usage[enc.layers]) if idle else usage[enc.layers]
            self._observe(index, np.log1p(-np.clip(used, 0.0, P_MAX)).reshape(-1))

    def _observe(self, index: int, log_free: Optional[np.ndarray]) -> None:
        for policy in self.policies():
            observe = getattr(policy, "observe_engine", None)
            if observe is not None and index < len(getattr(policy, "servers", ())):
                try:
                    observe(index, log_free)
                except ValueError as e:  # another width than the policy tracks (layers changed)
                    logger.warning("engine report of decode %d not used: %s", index, e)

    async def _fit(self, samples: dict[str, list[dict]]) -> None:
        """Every server's law (:func:`pooled_laws`), off the loop; metrics and policies."""
        urls = list(samples)
        try:
            laws = await asyncio.to_thread(pooled_laws, [samples[u] for u in urls])
        except Exception:  # noqa: BLE001 - a failed fit keeps the previous laws
            logger.exception("step law fit failed")
            return
        finally:
            self._fitting = False
        m = self.metrics
        decodes = [d.url for d in self.state.pool.decodes]
        enc = self.state.routing.encoder
        for url, law in zip(urls, laws):
            rep = self.servers[url]
            if law is None:
                continue
            rep.law = law
            for term in ("base_s", "per_seq_s", "per_expert_s", "per_kv_token_s"):
                m.step_law.labels(url, term).set(getattr(law, term))
            m.step_law_r2.labels(url).set(law.r2)
            if url not in decodes or enc is None or not rep.num_layers:
                continue
            index = decodes.index(url)
            for policy in self.policies():
                setter = getattr(policy, "set_step_law", None)
                if setter is not None:
                    setter(index, as_step_cost(law, rep.num_layers / len(enc.layers), samples[url], policy.cost))

    def describe(self) -> dict:
        return {url: rep.describe() for url, rep in self.servers.items()}
