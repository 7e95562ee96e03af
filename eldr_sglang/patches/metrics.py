"""Prometheus endpoint of the scheduler process (``--eldr-metrics-port``).

``eldr_decode_unique_experts_total / eldr_decode_steps_total`` is the mean
number of distinct experts a decode step activated (summed over MoE layers):
the hardware-independent cost figure that ELDR routing lowers. Running totals
are exported as counters (``rate()`` and ``increase()`` handle their resets),
read from the plugin's state at each scrape by :class:`EngineCollector`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # the state module loads torch
    from eldr_sglang.patches.state import CaptureState


def _unique_total(state: "CaptureState") -> float:
    d = state.decode
    return float(d.unique_total.item()) if d.unique_total is not None else 0.0


def _published(attr: str) -> Callable[["CaptureState"], float]:
    return lambda state: float(getattr(state.publisher, attr, 0) if state.publisher else 0)


# (name without _total, type, help, value of the state)
ENGINE_METRICS: tuple[tuple[str, str, str, Callable[["CaptureState"], float]], ...] = (
    ("eldr_decode_steps", "counter", "Decode forward steps run", lambda s: float(s.decode.steps)),
    ("eldr_decode_tokens", "counter", "Requests summed over decode steps (batch sizes)",
     lambda s: float(s.decode.tokens)),
    ("eldr_decode_unique_experts", "counter",
     "Distinct experts per decode step, summed over layers and steps", _unique_total),
    ("eldr_decode_unique_experts_per_step", "gauge", "Mean distinct experts per decode step (all MoE layers)",
     lambda s: float(s.decode.mean_unique_per_step())),
    ("eldr_signatures_sent", "counter", "Signature messages delivered to the router", _published("sent")),
    ("eldr_signatures_dropped", "counter", "Signature messages dropped (router unreachable or queue full)",
     _published("dropped")),
    ("eldr_signatures_refused_destinations", "counter",
     "Signature messages whose return address --eldr-publish-allow refused (never connected to)",
     _published("refused_destinations")),
)


class EngineCollector(Collector):
    """The plugin's counters and gauges, read from ``state`` when scraped."""

    def __init__(self, state: "CaptureState") -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        for name, kind, doc, value in ENGINE_METRICS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, doc, value=value(self.state))


def serve_metrics(state: "CaptureState", port: int) -> None:
    registry = CollectorRegistry()
    registry.register(EngineCollector(state))
    start_http_server(port, addr="0.0.0.0", registry=registry)
