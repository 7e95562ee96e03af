"""Prometheus endpoint of the scheduler process (``--eldr-metrics-port``).

``eldr_decode_unique_experts_total / eldr_decode_steps_total`` is the mean
number of distinct experts a decode step activated (summed over MoE layers):
the hardware-independent cost figure that ELDR routing lowers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from eldr_sglang.patches.state import CaptureState


def serve_metrics(state: CaptureState, port: int) -> None:
    registry = CollectorRegistry()

    def gauge(name: str, doc: str, fn) -> None:
        Gauge(name, doc, registry=registry).set_function(fn)

    d = state.decode
    gauge("eldr_decode_steps_total", "Decode forward steps run", lambda: d.steps)
    gauge("eldr_decode_tokens_total", "Requests summed over decode steps (batch sizes)", lambda: d.tokens)
    gauge("eldr_decode_unique_experts_total", "Distinct experts per decode step, summed over layers and steps",
          lambda: float(d.unique_total.item()) if d.unique_total is not None else 0.0)
    gauge("eldr_decode_unique_experts_per_step", "Mean distinct experts per decode step (all MoE layers)",
          d.mean_unique_per_step)
    pub = lambda attr: (lambda: getattr(state.publisher, attr, 0) if state.publisher else 0)  # noqa: E731
    gauge("eldr_signatures_sent_total", "Signature messages delivered to the router", pub("sent"))
    gauge("eldr_signatures_dropped_total", "Signature messages dropped (router unreachable or queue full)",
          pub("dropped"))
    start_http_server(port, addr="0.0.0.0", registry=registry)
