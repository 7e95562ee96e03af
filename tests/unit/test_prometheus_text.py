"""Reading Prometheus text with ``prometheus_client.parser`` (A/B engine counters,
benchmark histograms, the local cluster's scrapes) and the engine plugin's export of
its running totals as counters."""

from __future__ import annotations

import socket
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from eldr_sglang.patches.metrics import ENGINE_METRICS, EngineCollector
from eldr_sglang.router.state.ab import ENGINE_COUNTERS, parse_prometheus
from eldr_sglang.router.metrics import histogram_quantiles
from eldr_sglang.testing.local_cluster import scrape_metrics

TIMESTAMPED = """# HELP eldr_decode_steps_total Decode forward steps run
# TYPE eldr_decode_steps_total counter
eldr_decode_steps_total{tp_rank="0"} 12 1764650000000
eldr_decode_steps_total{tp_rank="1"} 8.5 1764650000000
# TYPE sglang:request_time_per_output_token_seconds histogram
sglang:request_time_per_output_token_seconds_bucket{le="0.01",model_name="m"} 1 1764650000000
sglang:request_time_per_output_token_seconds_bucket{le="0.05",model_name="m"} 3 1764650000000
sglang:request_time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 4 1764650000000
sglang:request_time_per_output_token_seconds_bucket{le="0.01",model_name="n"} 0
sglang:request_time_per_output_token_seconds_bucket{le="0.05",model_name="n"} 2
sglang:request_time_per_output_token_seconds_bucket{le="+Inf",model_name="n"} 6
sglang:request_time_per_output_token_seconds_sum{model_name="m"} 0.1 1764650000000
sglang:request_time_per_output_token_seconds_count{model_name="m"} 4 1764650000000
"""


def engine_state(steps=4, tokens=10, sent=3, dropped=1):
    decode = SimpleNamespace(steps=steps, tokens=tokens, unique_total=None, mean_unique_per_step=lambda: 2.5)
    return SimpleNamespace(decode=decode, publisher=SimpleNamespace(sent=sent, dropped=dropped))


def test_parse_prometheus_reads_values_not_timestamps():
    got = parse_prometheus(TIMESTAMPED, ("eldr_decode_steps_total", "sglang:request_time_per_output_token_seconds_count"))
    assert got == {"eldr_decode_steps_total": 20.5, "sglang:request_time_per_output_token_seconds_count": 4.0}
    assert parse_prometheus('x{a="1 2"} 3\n', ("x",)) == {"x": 3.0}  # a space inside a label value
    assert parse_prometheus("x 1\nthis is { not metrics\n", ("x",)) == {}


def test_histogram_quantiles_sums_label_sets_and_ignores_timestamps():
    q = histogram_quantiles(TIMESTAMPED, "sglang:request_time_per_output_token_seconds", (0.1, 0.5, 0.9))
    assert q["count"] == 10.0
    assert q["buckets"] == {"0.01": 1.0, "0.05": 5.0, "inf": 10.0}
    assert (q["p10_le_ms"], q["p50_le_ms"], q["p90_le_ms"]) == (10.0, 50.0, float("inf"))
    assert histogram_quantiles(TIMESTAMPED, "eldr_router_added_latency_seconds") == {}


def test_engine_totals_are_counters():
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine_state()))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    kinds = {name: kind for name, kind, _, _ in ENGINE_METRICS}
    assert {n for n, k in kinds.items() if k == "gauge"} == {"eldr_decode_unique_experts_per_step"}
    for name, kind in kinds.items():
        assert families[name].type == kind, name
    samples = {s.name: s.value for f in families.values() for s in f.samples}
    assert set(ENGINE_COUNTERS) <= set(samples)
    assert samples["eldr_decode_steps_total"] == 4 and samples["eldr_decode_tokens_total"] == 10
    assert samples["eldr_signatures_dropped_total"] == 1 and samples["eldr_decode_unique_experts_per_step"] == 2.5


def test_scrape_metrics_of_a_live_endpoint():
    registry = CollectorRegistry()
    state = engine_state(steps=7)
    registry.register(EngineCollector(state))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        assert scrape_metrics(port)["eldr_decode_steps_total"] == 7
        state.decode.steps = 9  # read at each scrape
        assert scrape_metrics(port)["eldr_decode_steps_total"] == 9
    finally:
        server.shutdown()
        thread.join(5)
