"""A/B on live traffic: time-sliced policy alternation, per-slice records, shadow decisions.

Distinct experts per decode step is measured inside each decode server, so a
per-request split cannot attribute it. What can:

* **time-sliced** (``--ab-policies eldr,jsq --ab-slice 600``): the router routes
  every request of a slice with one policy, alternating; a request keeps the
  policy of the slice it arrived in.
* **pool-split**: two routers, one per decode pool, each with its own policy and
  ``--ab-record`` (slices of one policy); the verdict CLI reads both files.
* **shadow** (``--shadow-policy eldr``): routing by the configured policy, and per
  request what the shadow policy would have chosen (agreement counted, kept in
  the decision log), from the same signature and loads. Nothing is sent by it.

``--ab-record FILE`` appends one JSON line per slice: the arm, router-side
requests, errors, throughput and latency, and, from each decode server's engine
metrics (``--engine-metrics``: the plugin's ``--eldr-metrics-port`` endpoints in
decode order), the slice's decode steps, tokens and distinct experts, plus
SGLang's own TPOT/TTFT histograms when the decode servers run with
``--enable-metrics``. ``python -m eldr_sglang.ab RECORDS`` turns them into a verdict.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from eldr_sglang.core.policies import RouteRequest, policy_spec
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.state.routing import Routing, RoutingState

logger = logging.getLogger("eldr_sglang.router")

ENGINE_COUNTERS = ("eldr_decode_unique_experts_total", "eldr_decode_steps_total", "eldr_decode_tokens_total")
SGLANG_HISTOGRAMS = ("sglang:request_time_per_output_token_seconds", "sglang:time_to_first_token_seconds")


def parse_prometheus(text: str, names: Optional[tuple[str, ...]] = None) -> dict[str, float]:
    """Sum over label sets of each sample name in ``names`` (default: every sample), from
    Prometheus text (``prometheus_client``'s parser: timestamps, escapes, exemplars); {}
    for text it cannot parse."""
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if names is None or s.name in names:
                    out[s.name] = out.get(s.name, 0.0) + s.value
    except ValueError as e:
        logger.warning("unparsable metrics text (%s)", e)
        return {}
    return out


@dataclass
class SliceStats:
    arm: str
    index: int
    start: float
    requests: int = 0
    errors: int = 0
    durations: list[float] = field(default_factory=list)
    engines: dict[str, dict[str, float]] = field(default_factory=dict)  # url -> counters at start
    end: Optional[float] = None  # set when the slice closes
    engines_end: dict[str, dict[str, float]] = field(default_factory=dict)
    inflight: int = 0  # requests that arrived in it and have not ended


class ABController:
    """Alternates the routing state's arms on a schedule and writes one record per
    slice; ``session()``: the router's worker session (engine metrics are read with it)."""

    def __init__(self, state: RoutingState, metrics: RouterMetrics,
                 session: Callable[[], Optional[aiohttp.ClientSession]], slice_s: float,
                 record: Optional[str], engine_metrics: list[str], label: Optional[str] = None) -> None:
        self.state, self.metrics, self.session, self.slice_s = state, metrics, session, slice_s
        self.record, self.label = record, label
        self.engine_metrics = engine_metrics
        self.current: Optional[SliceStats] = None
        self.closed: list[SliceStats] = []  # closed, written once their last request ended
        self.count = 0
        self.written: list[dict] = []

    @property
    def routings(self) -> list[Routing]:
        return self.state.arms

    def arm_name(self, routing: Routing) -> str:
        return (self.label or routing.name) if len(self.routings) == 1 else routing.name

    def owns(self, routing: Routing) -> bool:
        return self.current is not None and routing is self.routings[self.current.index % len(self.routings)]

    def request_started(self, routing: Routing) -> Optional[SliceStats]:
        """A client request arrived under ``routing``: the slice it belongs to (its token)."""
        cur = self.current
        if cur is None or not self.owns(routing):
            return None
        cur.inflight += 1
        return cur

    def request_done(self, token: Optional[SliceStats], seconds: float, status: int) -> None:
        """A client request ended (any way): it counts in the slice it arrived in, also
        when it ends after that slice closed (a closed slice is written once its last
        request ended, or at shutdown)."""
        if token is None:
            return
        token.inflight -= 1
        token.requests += 1
        token.errors += status >= 400 or status == 0
        token.durations.append(seconds)
        if token.end is not None and token.inflight <= 0 and token in self.closed:
            self.closed.remove(token)
            self._write(self._record(token))

    async def _engines(self) -> dict[str, dict[str, float]]:
        """Engine counters now, per decode server (plugin endpoint and SGLang /metrics)."""
        session = self.session()
        out: dict[str, dict[str, float]] = {}

        async def get(url: str, names: tuple[str, ...]) -> dict[str, float]:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    return parse_prometheus(await resp.text(), names) if resp.status == 200 else {}
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return {}

        hist = tuple(f"{h}_{s}" for h in SGLANG_HISTOGRAMS for s in ("sum", "count"))
        decodes = [d.url for d in self.state.pool.decodes]
        jobs = [get(u, ENGINE_COUNTERS) for u in self.engine_metrics]
        jobs += [get(u + "/metrics", hist) for u in decodes]
        res = await asyncio.gather(*jobs)
        for i, url in enumerate(decodes):
            out[url] = {**(res[i] if i < len(self.engine_metrics) else {}), **res[len(self.engine_metrics) + i]}
        return out

    def _start(self, index: int, engines: dict) -> None:
        routing = self.state.use_arm(index)
        self.current = SliceStats(self.arm_name(routing), index, time.time(), engines=engines)
        logger.info("A/B slice %d: policy %s for %.0f s", index, routing.name, self.slice_s)

    def _close(self, engines: dict) -> None:
        """Close the current slice at ``engines``' counters; written now, or when its last
        request ends."""
        cur = self.current
        cur.end, cur.engines_end = time.time(), engines
        if cur.inflight <= 0:
            self._write(self._record(cur))
        else:
            self.closed.append(cur)

    def _flush(self) -> None:
        """Write every closed slice, requests still in flight or not (shutdown)."""
        for old in self.closed:
            self._write(self._record(old))
        self.closed = []

    @staticmethod
    def _record(cur: SliceStats) -> dict:
        end, engines = cur.end, cur.engines_end
        d = np.asarray(cur.durations) if cur.durations else np.zeros(0)
        rec: dict[str, Any] = {
            "slice": cur.index, "arm": cur.arm, "start": cur.start, "end": end,
            "requests": cur.requests, "errors": cur.errors,
            "throughput_rps": cur.requests / max(end - cur.start, 1e-9),
            "latency_mean_s": float(d.mean()) if d.size else None,
            "latency_p50_s": float(np.percentile(d, 50)) if d.size else None,
            "latency_p99_s": float(np.percentile(d, 99)) if d.size else None,
            "decode": {},
        }
        tot: dict[str, float] = {}
        for url, now in engines.items():
            before = cur.engines.get(url)
            if not before:  # the server did not answer at the slice's start: no baseline
                continue
            # a series absent at the start was created during the slice (a labelled histogram
            # has no samples before its first observation): it started at 0
            delta = {k: now[k] - before.get(k, 0.0) for k in now}
            rec["decode"][url] = delta
            for k, v in delta.items():
                tot[k] = tot.get(k, 0.0) + v
        steps = tot.get("eldr_decode_steps_total", 0.0)
        rec["decode_steps"] = steps
        unique = tot.get("eldr_decode_unique_experts_total")
        rec["unique_per_step"] = unique / steps if steps and unique is not None else None
        rec["mean_batch"] = tot.get("eldr_decode_tokens_total", 0.0) / steps if steps else None
        for key, hname in (("tpot_mean_s", SGLANG_HISTOGRAMS[0]), ("ttft_mean_s", SGLANG_HISTOGRAMS[1])):
            n = tot.get(f"{hname}_count", 0.0)
            rec[key] = tot[f"{hname}_sum"] / n if n else None
        return rec

    def _write(self, rec: dict) -> None:
        self.written.append(rec)
        self.metrics.event("ab_slices")
        if self.record:
            with open(self.record, "a") as f:
                f.write(json.dumps(rec) + "\n")

    async def run(self) -> None:
        """Slice after slice until cancelled (the last, partial slice is written too)."""
        self._start(0, await self._engines())
        index = 0
        try:
            while True:
                await asyncio.sleep(self.slice_s)
                engines = await self._engines()
                self._close(engines)
                index += 1
                self._start(index, engines)
        except asyncio.CancelledError:
            if self.current is not None and (self.current.requests or self.current.inflight):
                self._close(await asyncio.shield(self._engines()))
            self._flush()
            raise

    def describe(self) -> dict:
        cur = self.current
        return {"arms": [r.name for r in self.routings], "slice_s": self.slice_s, "record": self.record,
                "current": None if cur is None else {"slice": cur.index, "arm": cur.arm,
                                                     "requests": cur.requests},
                "slices_written": len(self.written)}


class ShadowPolicy:
    """What another policy would have picked, from the same request and loads."""

    PENDING_MAX = 4096  # requests whose signature has not come yet (oldest dropped)

    def __init__(self, state: RoutingState, metrics: RouterMetrics, name: str) -> None:
        self.state, self.metrics, self.spec = state, metrics, policy_spec(name)
        self._built_for: Any = None
        self.policy = None
        self.pending: "OrderedDict[int, tuple[list[int], int, dict]]" = OrderedDict()

    def expect(self, room: int, loads: list[int], chosen: int) -> dict:
        """Evaluate when the signature of ``room`` arrives (:meth:`on_message`); the
        returned dict (kept in the decision log) is filled in then."""
        out = {"policy": self.spec.name, "outcome": "pending"}
        self.pending[room] = (list(loads), chosen, out)
        while len(self.pending) > self.PENDING_MAX:
            _, (_, _, lost) = self.pending.popitem(last=False)
            lost["outcome"] = "no_signature"
            self.metrics.shadow.labels(self.spec.name, "no_signature").inc()
        return out

    def on_message(self, msg: dict) -> None:
        """Every accepted signature message (intake)."""
        entry = self.pending.pop(msg["bootstrap_room"], None)
        if entry is not None:
            loads, chosen, out = entry
            out.update(self.evaluate_message(msg, loads, chosen))

    def evaluate_message(self, msg: dict, loads: list[int], chosen: int) -> dict:
        enc = self.state.routing.encoder
        try:
            sig = enc.encode(msg) if enc is not None else None
        except ValueError:
            sig = None
        return self.evaluate(RouteRequest(signature=sig), loads, chosen)

    def _policy(self):
        enc = self.state.routing.encoder
        if self.policy is None or self._built_for is not enc:
            self.policy = self.state.build_routing(self.spec, enc).policy
            self._built_for = enc
        return self.policy

    def evaluate(self, route: RouteRequest, loads: list[int], chosen: int) -> dict:
        m = self.metrics
        if route.signature is None and self.spec.needs_artifact:
            m.shadow.labels(self.spec.name, "no_signature").inc()
            return {"policy": self.spec.name, "outcome": "no_signature"}
        try:
            dec = self._policy().explain(route, loads)
        except ValueError as e:  # e.g. no artifact yet
            m.shadow.labels(self.spec.name, "error").inc()
            return {"policy": self.spec.name, "outcome": "error", "error": str(e)}
        outcome = "same" if dec.index == chosen else "different"
        m.shadow.labels(self.spec.name, outcome).inc()
        out = {"policy": self.spec.name, "outcome": outcome, "decode": self.state.pool.decodes[dec.index].url}
        if dec.server_similarities is not None:
            gap = float(dec.server_similarities.max() - dec.server_similarities[chosen])
            out["similarity_gap"] = gap
            m.shadow_gap.observe(gap)
        return out
