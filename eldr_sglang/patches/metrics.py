"""Prometheus endpoint of the scheduler process (``--eldr-metrics-port``).

``eldr_decode_unique_experts_total / eldr_decode_steps_total`` is the mean
number of distinct experts a decode step activated (summed over MoE layers):
the hardware-independent cost figure that ELDR routing lowers. Running totals
are exported as counters (``rate()`` and ``increase()`` handle their resets),
read from the plugin's state at each scrape by :class:`EngineCollector`.

The same port answers ``GET /eldr/batch``: the live decode batch's expert usage and
the last steps' samples (:mod:`~eldr_sglang.patches.batch_report`), which the router
reads with its load poll.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Callable, Iterator
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
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


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    state: "CaptureState"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlsplit(self.path)
        if url.path == "/metrics":
            self._send(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif url.path == "/eldr/batch":
            report = self.state.decode.report
            if report is None:
                self._send(404, b'{"error": "no decode batch report on this server"}', "application/json")
                return
            last = parse_qs(url.query).get("last", [None])[0]
            doc = report.snapshot(int(last) if last and last.isdigit() else None)
            self._send(200, json.dumps(doc).encode(), "application/json")
        else:
            self._send(404, b'{"error": "not found: /metrics or /eldr/batch"}', "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # scrapes are not worth a log line each
        pass


def serve_metrics(state: "CaptureState", port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """``/metrics`` and ``/eldr/batch`` on ``host:port``, in a daemon thread."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(state))
    handler = type("EngineMetricsHandler", (_Handler,), {"registry": registry, "state": state})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="eldr-metrics", daemon=True).start()
    return server
