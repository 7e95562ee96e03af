"""Prometheus metrics of the ELDR router (one registry per router instance).

Latency definitions (seconds):

- ``eldr_router_request_duration_seconds``: end to end, from the router's handler
  entry to the last byte of the response handed to the client (stream included).
- ``eldr_router_added_latency_seconds``: router-added latency, from handler entry
  to the moment the decode POST is issued, MINUS the signature wait. It is the
  router's own work on the critical path (body parse + validation, prefill pick,
  payload encode, signature encode, policy choice). Excluded: the signature wait
  (``eldr_router_signature_wait_seconds``: bounded by prefill compute, not by the
  router), the upstream HTTP round trips and the response relay, which an
  external benchmark measures (``benchmark/bench_serving_routers.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from numbers import Real

from dataclasses import dataclass
import logging
from typing import Any, Optional

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

logger = logging.getLogger("eldr_sglang.router")

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
         0.25, 0.5, 1.0, 2.0, 5.0)
_MICRO = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
          0.01, 0.025, 0.05, 0.1)
_E2E = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        30.0, 60.0, 120.0, 300.0)
_BAND = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 128)
_SIM = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 1.0)



class Deferred:
    """A histogram (child) whose observations on the request path are a list append;
    they reach Prometheus at the next :meth:`flush` (every scrape, status read, and
    every ``FLUSH_AT`` observations), so a scrape always sees all of them."""

    FLUSH_AT = 4096
    __slots__ = ("target", "pending")

    def __init__(self, target: Any) -> None:
        self.target, self.pending = target, []

    def observe(self, value: Optional[float]) -> None:
        """Queue ``value``; ``None`` (no value, e.g. a decision without a similarity)
        is skipped here, so it can never break a later scrape."""
        if value is None:
            return
        self.pending.append(value)
        if len(self.pending) >= self.FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        """Into the histogram as ``observe`` would put them (each number in the first
        bucket whose bound is >= it, the sum added in order), with one increment per
        bucket; anything else goes through ``observe`` (and is dropped if it fails)."""
        pending, self.pending = self.pending, []
        t = self.target
        bounds = getattr(t, "_upper_bounds", None)
        counts: dict[int, int] = {}
        others = []
        total = t._sum.get() if bounds is not None else 0.0
        for v in pending:
            if bounds is not None and isinstance(v, Real) and not isinstance(v, bool) and v == v:
                i = bisect_left(bounds, v)
                counts[i] = counts.get(i, 0) + 1
                total += v
            else:
                others.append(v)
        if counts:
            t._sum.set(float(total))
            for i, n in counts.items():
                t._buckets[i].inc(n)
        for v in others:
            try:
                t.observe(v)
            except (TypeError, ValueError):  # one bad value never costs the others or the scrape
                logger.error("dropped a non-numeric histogram observation %r", v)


@dataclass(slots=True)
class WorkerMetrics:
    """One worker's metric children, looked up once (``labels()`` costs ~5 us)."""

    inflight: Any
    healthy: Any
    breaker: Any
    requests: Any
    reported_load: Any


class RouterMetrics:
    """The router's only record of what happened: ``status()`` and tests read these."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._deferred: dict[tuple, Deferred] = {}
        self.events = Counter("eldr_router_events", "Router events without a metric of their "
                              "own (requests, aborts, client disconnects, refusals, reloads, ...)",
                              ["event"], registry=r)
        self._events: dict[str, Any] = {}
        self.signature_wait_limit = Gauge("eldr_router_signature_wait_limit_seconds",
                                          "Current (adaptive) signature wait limit", registry=r)
        self.reported_load = Gauge("eldr_router_reported_load",
                                   "Requests a decode server reports running + waiting "
                                   "(GET /v1/loads), all routers together", ["role", "server"],
                                   registry=r)
        self.step_law = Gauge("eldr_router_step_law_seconds",
                              "Decode step law fitted from the engine's step samples (--engine-metrics): "
                              "seconds per step, per sequence, per distinct expert (all MoE layers), per KV token",
                              ["server", "term"], registry=r)
        self.step_law_r2 = Gauge("eldr_router_step_law_r2", "R^2 of the fitted decode step law",
                                 ["server"], registry=r)
        self.overloaded = Counter("eldr_router_overloaded", "Client requests refused with 429: "
                                  "in-flight limit reached", registry=r)
        self.requests = Counter("eldr_router_requests", "Requests routed to a decode server",
                                ["policy", "decode"], registry=r)
        self.decisions = Counter("eldr_router_decisions",
                                 "Decode decisions per policy; kind = signature (used one), "
                                 "fallback (needed one, had none), blind (policy needs none)",
                                 ["policy", "kind"], registry=r)
        self.band_size = Histogram("eldr_router_band_size",
                                   "Candidates in the eldr locality band (s* - tau)",
                                   buckets=_BAND, registry=r)
        self.best_similarity = Histogram("eldr_router_best_similarity",
                                         "s*: best server cosine similarity of a signature",
                                         buckets=_SIM, registry=r)
        self.signature_wait = Histogram("eldr_router_signature_wait_seconds",
                                        "Time from prefill dispatch to signature (or timeout)",
                                        buckets=_FAST, registry=r)
        self.choose_time = Histogram("eldr_router_policy_choose_seconds",
                                     "Policy decision time (explain())", buckets=_MICRO, registry=r)
        self.added_latency = Histogram("eldr_router_added_latency_seconds",
                                       "Handler entry to decode POST issued, minus signature wait",
                                       buckets=_MICRO, registry=r)
        self.request_duration = Histogram("eldr_router_request_duration_seconds",
                                          "End-to-end request time in the router",
                                          ["endpoint"], buckets=_E2E, registry=r)
        self.fallbacks = Counter("eldr_router_fallbacks", "Decode picks without a signature",
                                 ["reason"], registry=r)
        self.errors = Counter("eldr_router_errors", "Router-side errors", ["kind"], registry=r)
        self.upstream_failures = Counter("eldr_router_upstream_failures",
                                         "Failed calls to prefill/decode servers",
                                         ["role", "server"], registry=r)
        self.worker_requests = Counter("eldr_router_worker_requests",
                                       "Requests sent to each worker", ["role", "server"],
                                       registry=r)
        self.worker_errors = Counter("eldr_router_worker_errors",
                                     "Worker errors: connect, timeout, disconnect, http_4xx, "
                                     "http_5xx, stream", ["role", "server", "kind"], registry=r)
        self.retries = Counter("eldr_router_retries", "Requests re-sent to another worker "
                               "(never reached the first one)", ["role"], registry=r)
        self.signatures = Counter("eldr_router_signature_messages",
                                  "Signature messages received", ["outcome"], registry=r)
        self.signature_auth_refused = Counter(
            "eldr_router_signature_auth_refused", "Signature bodies (HTTP) or lines (TCP) refused "
            "under --signature-key-file: unsigned, bad_mac (HMAC does not match)", ["reason"], registry=r)
        self.inflight = Gauge("eldr_router_inflight", "In-flight requests per server",
                              ["role", "server"], registry=r)
        self.healthy = Gauge("eldr_router_server_healthy",
                             "1 if the server may be picked (health check passing, breaker "
                             "not open)", ["role", "server"], registry=r)
        self.breaker = Gauge("eldr_router_breaker_state",
                             "Circuit breaker: 0 closed, 1 half-open, 2 open",
                             ["role", "server"], registry=r)
        self.health_checks = Counter("eldr_router_health_checks",
                                     "Active health checks", ["role", "server", "outcome"],
                                     registry=r)
        self.client_requests = Gauge("eldr_router_client_requests_inflight",
                                     "Client requests being served", registry=r)
        self.draining = Gauge("eldr_router_draining", "1 while draining (SIGTERM)", registry=r)
        self.board = Gauge("eldr_router_signature_board",
                           "Signature rendezvous entries (waiting requests, buffered messages)",
                           ["state"], registry=r)
        self.reloads = Counter("eldr_router_calibration_reloads", "Calibration reloads",
                               ["outcome"], registry=r)
        self.shadow = Counter("eldr_router_shadow_decisions", "Shadow policy picks: same or "
                              "different server than the routing policy, no_signature, error",
                              ["policy", "outcome"], registry=r)
        self.shadow_gap = Histogram("eldr_router_shadow_similarity_gap",
                                    "Shadow eldr: best server similarity minus that of the server "
                                    "actually chosen", buckets=(0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3,
                                                                 0.5, 0.75, 1.0, 2.0), registry=r)
        # online calibration (``--online``): the live artifact's lifecycle
        self.calibration_age = Gauge("eldr_router_calibration_age_seconds",
                                     "Seconds since the live calibration was fitted "
                                     "(offline or online); absent before the first fit",
                                     registry=r)
        self.calibration_refits = Counter("eldr_router_calibration_refits",
                                          "Online refits swapped in, by reason (initial, "
                                          "periodic, drift, settle, membership, manual)", ["reason"],
                                          registry=r)
        self.calibration_churn = Gauge("eldr_router_calibration_churn",
                                       "Share of recent signatures whose decode server changed "
                                       "at the last swap", registry=r)
        self.calibration_drift = Gauge("eldr_router_calibration_drift",
                                       "Drift statistics of recent signatures against the fit "
                                       "(similarity_ks: KS distance of best-centroid similarity; "
                                       "owner_shift: total-variation distance of region shares)",
                                       ["statistic"], registry=r)
        self.calibration_signatures = Gauge("eldr_router_calibration_signatures",
                                            "Signatures held for the next online fit", registry=r)
        self.calibration_online = Gauge("eldr_router_calibration_online",
                                        "Online calibration: 0 off, 1 warming up (routing by "
                                        "load), 2 routing by signature", registry=r)

    def deferred(self, histogram: Any, *labels: str) -> Deferred:
        """A :class:`Deferred` view of ``histogram`` (with ``labels``), flushed with the rest."""
        key = (id(histogram), labels)
        d = self._deferred.get(key)
        if d is None:
            d = self._deferred[key] = Deferred(histogram.labels(*labels) if labels else histogram)
        return d

    def flush(self) -> None:
        for d in list(self._deferred.values()):
            d.flush()

    def worker(self, role: str, url: str) -> WorkerMetrics:
        lab = (role, url)
        return WorkerMetrics(self.inflight.labels(*lab), self.healthy.labels(*lab),
                             self.breaker.labels(*lab), self.worker_requests.labels(*lab),
                             self.reported_load.labels(*lab))

    def event(self, name: str, n: int = 1) -> None:
        child = self._events.get(name)
        if child is None:  # a labels() lookup costs ~5 us: once per event name
            child = self._events[name] = self.events.labels(name)
        child.inc(n)

    def value(self, metric: str, **labels: str) -> float:
        """Sum of the samples named ``eldr_router_<metric>`` (``_total`` optional; a
        histogram's ``..._count``/``..._sum`` too) whose labels include ``labels``; 0
        when none."""
        self.flush()
        name = f"eldr_router_{metric}"
        total = 0.0
        for family in self.registry.collect():
            if not name.startswith(family.name):
                continue
            for s in family.samples:
                if s.name in (name, f"{name}_total") and all(
                        s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def counters(self) -> dict[str, float]:
        """Counters for status pages: each event by name; each other counter's total as
        its short name, and each labelled sample as ``name{label=value,...}``."""
        self.flush()
        out: dict[str, float] = {}
        for family in self.registry.collect():
            if family.type != "counter":
                continue
            short = family.name.removeprefix("eldr_router_")
            for s in family.samples:
                if not (s.name.endswith("_total") and s.value):
                    continue
                if family.name == "eldr_router_events":
                    out[s.labels["event"]] = s.value
                    continue
                out[short] = out.get(short, 0.0) + s.value
                if s.labels:
                    out[short + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                        + "}"] = s.value
        return out

    def render(self) -> tuple[bytes, str]:
        self.flush()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def histogram_quantiles(text: str, name: str, qs: tuple[float, ...] = (0.5, 0.99)) -> dict:
    """From Prometheus text (``prometheus_client``'s parser): each quantile's bucket upper
    bound (ms) of histogram ``name`` summed over its label sets, the count and the buckets;
    {} when it has no observations (benchmarks read routers)."""
    from prometheus_client.parser import text_string_to_metric_families

    by_le: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name + "_bucket" and "le" in s.labels:
                le = float(s.labels["le"])  # "+Inf" -> inf
                by_le[le] = by_le.get(le, 0.0) + s.value
    buckets = sorted(by_le.items())
    if not buckets or buckets[-1][1] == 0:
        return {}
    total = buckets[-1][1]
    out: dict[str, Any] = {"count": total, "buckets": {str(le): c for le, c in buckets}}
    for q in qs:
        out[f"p{int(q * 100)}_le_ms"] = next(le for le, c in buckets if c >= q * total) * 1e3
    return out
