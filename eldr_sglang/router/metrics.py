"""Prometheus metrics of the ELDR router (one registry per router instance)."""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
         0.25, 0.5, 1.0, 2.0, 5.0)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("eldr_router_requests", "Requests routed to a decode server",
                                ["policy", "decode"], registry=r)
        self.signature_wait = Histogram("eldr_router_signature_wait_seconds",
                                        "Time from prefill dispatch to signature (or timeout)",
                                        buckets=_FAST, registry=r)
        self.choose_time = Histogram("eldr_router_policy_choose_seconds",
                                     "Policy choose() time", buckets=_FAST, registry=r)
        self.fallbacks = Counter("eldr_router_fallbacks", "Decode picks without a signature",
                                 ["reason"], registry=r)
        self.errors = Counter("eldr_router_errors", "Router-side errors", ["kind"], registry=r)
        self.upstream_failures = Counter("eldr_router_upstream_failures",
                                         "Failed calls to prefill/decode servers",
                                         ["role", "server"], registry=r)
        self.signatures = Counter("eldr_router_signature_messages",
                                  "Signature messages received", ["outcome"], registry=r)
        self.inflight = Gauge("eldr_router_inflight", "In-flight requests per server",
                              ["role", "server"], registry=r)
        self.healthy = Gauge("eldr_router_server_healthy", "1 if the server is not in cooldown",
                             ["role", "server"], registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
