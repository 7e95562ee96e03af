"""deploy/monitoring/: the Grafana dashboard and the Prometheus alert rules.

Every PromQL expression parses (promql-parser), and every metric and label it names
is exported: the router's from a fresh ``RouterMetrics`` registry, the engine
plugin's from ``ENGINE_METRICS`` of ``eldr_sglang/patches/metrics.py``, SGLang's own
(``sglang:*``, ``--enable-metrics``) from the installed SGLang's metrics collector."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import promql_parser as pp
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from eldr_sglang.patches.metrics import ENGINE_METRICS
from eldr_sglang.router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
TARGET_LABELS = {"instance", "job"}  # Prometheus adds them to every scraped sample
GRAFANA = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$router": ".*", "$engine": ".*"}
NAME = re.compile(r"(?<![A-Za-z0-9_:])((?:eldr_|sglang:)[A-Za-z0-9_:]*)(?=[{\[),]|\s|$)")
LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
ANNOTATION_LABEL = re.compile(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)")
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


def router_exports() -> dict[str, set[str]]:
    """Sample name -> label names of a fresh router registry (labelled metrics without
    children yet expose no samples: their names come from the family name and type)."""
    metrics = RouterMetrics()
    out: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            for suffix in SUFFIXES[metric._type]:
                labels = set(metric._labelnames) | ({"le"} if suffix == "_bucket" else set())
                out.setdefault(metric._name + suffix, set()).update(labels)
    return out


def engine_exports() -> dict[str, set[str]]:
    """The engine plugin's metrics (no labels of their own): counters as ``NAME_total``."""
    return {name + ("_total" if kind == "counter" else ""): set() for name, kind, _, _ in ENGINE_METRICS}


# the labels every TokenizerMetricsCollector metric carries (sglang tokenizer_metric_labels)
SGLANG_BASE_LABELS = {"model_name", "engine_type"}
SGLANG_METRIC_KINDS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram"}


def sglang_exports() -> dict[str, set[str]]:
    """Sample name -> label names of the installed SGLang's metrics (its
    ``observability/metrics_collector.py``, read without importing SGLang): every
    ``Counter``/``Gauge``/``Histogram`` call with a ``name="sglang:..."``."""
    package = importlib.util.find_spec("sglang")
    assert package is not None and package.submodule_search_locations, "sglang is not installed"
    source = Path(list(package.submodule_search_locations)[0]) / "srt" / "observability" / "metrics_collector.py"
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in SGLANG_METRIC_KINDS):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        name = kw.get("name")
        if not (isinstance(name, ast.Constant) and str(name.value).startswith("sglang:")):
            continue
        labels: set[str] = set()
        if "labelnames" in kw:
            expr = kw["labelnames"]
            labels = {n.value for n in ast.walk(expr) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            if any(isinstance(n, ast.Name) and n.id == "labels" for n in ast.walk(expr)):
                labels |= SGLANG_BASE_LABELS
        kind = SGLANG_METRIC_KINDS[node.func.id]
        base = name.value.removesuffix("_total") if kind == "counter" else name.value
        for suffix in SUFFIXES[kind]:
            out.setdefault(base + suffix, set()).update(labels | ({"le"} if suffix == "_bucket" else set()))
    return out


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    return {**router_exports(), **engine_exports(), **sglang_exports()}


def metric_names(expr: str) -> set[str]:
    """Identifiers starting with ``eldr_`` followed by ``{``, ``[``, ``)``, ``,``, space or the end."""
    return set(NAME.findall(expr))


def selectors(node) -> list:
    found: list = []
    pp.walk(node, lambda n: found.append(n) if isinstance(n, pp.VectorSelector) else None)
    return found


def aggregations(node) -> list:
    found: list = []
    pp.walk(node, lambda n: found.append(n) if isinstance(n, (pp.AggregateExpr, pp.BinaryExpr)) else None)
    return found


def problems(expr: str, exported: dict[str, set[str]]) -> list[str]:
    """What is wrong with one PromQL expression: unknown metrics, labels a metric does not
    have (in selectors, ``by``/``without``, ``on``/``ignoring``); [] when none."""
    for var, value in GRAFANA.items():
        expr = expr.replace(var, value)
    tree = pp.parse(expr)  # raises on a syntax error
    names = metric_names(expr)
    out = [f"unknown metric {n}" for n in sorted(names) if n not in exported]
    if names != {s.name for s in selectors(tree) if s.name and s.name.startswith(("eldr_", "sglang:"))}:
        out.append(f"name extraction disagrees with the parser: {sorted(names)}")
    labels_of = lambda node: [exported.get(s.name, set()) | TARGET_LABELS for s in selectors(node)]  # noqa: E731
    for s in selectors(tree):
        for m in s.matchers.matchers:
            if m.name != "__name__" and m.name not in exported.get(s.name, set()) | TARGET_LABELS:
                out.append(f"{s.name} has no label {m.name}")
    for node in aggregations(tree):
        if isinstance(node, pp.AggregateExpr) and node.modifier is not None:
            sets = labels_of(node.expr)
            need = all if node.modifier.type == pp.AggModifierType.By else any
            out += [f"{node.op} by/without {l}: not a label of its metrics" for l in node.modifier.labels
                    if not need(l in s for s in sets)]
        elif isinstance(node, pp.BinaryExpr) and node.modifier is not None and node.modifier.matching is not None:
            for side in (node.lhs, node.rhs):
                out += [f"on/ignoring {l}: not a label of {side}" for l in node.modifier.matching.labels
                        if not any(l in s for s in labels_of(side))]
    return out


def result_labels(expr: str, exported: dict[str, set[str]]) -> set[str]:
    """Labels a legend or an annotation may use: the ``by`` labels when the expression
    aggregates, else its selectors' labels."""
    for var, value in GRAFANA.items():
        expr = expr.replace(var, value)
    tree = pp.parse(expr)
    by = {l for n in aggregations(tree) if isinstance(n, pp.AggregateExpr) and n.modifier is not None
          and n.modifier.type == pp.AggModifierType.By for l in n.modifier.labels}
    if by or any(isinstance(n, pp.AggregateExpr) for n in aggregations(tree)):
        return by
    return set().union(TARGET_LABELS, *(exported.get(s.name, set()) for s in selectors(tree)))


def dashboard() -> dict:
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())


def dashboard_targets() -> list[dict]:
    return [t for p in dashboard()["panels"] for t in p.get("targets", [])]


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((MONITORING / "prometheus-alerts.yaml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_exports_are_read_from_the_code(exported):
    assert {"eldr_router_decisions_total", "eldr_router_signature_wait_seconds_bucket",
            "eldr_router_calibration_age_seconds", "eldr_router_calibration_refits_total",
            "eldr_decode_steps_total", "eldr_decode_unique_experts_total",
            "eldr_signatures_dropped_total"} <= set(exported)
    assert exported["eldr_router_decisions_total"] == {"policy", "kind"}
    assert exported["eldr_router_request_duration_seconds_bucket"] == {"endpoint", "le"}
    assert "eldr_router_decisions" not in exported  # a counter is exposed with _total only
    assert exported["sglang:request_time_per_output_token_seconds_bucket"] == {
        "model_name", "engine_type", "is_streaming", "le"}
    assert {"sglang:time_to_first_token_seconds_count", "sglang:num_running_reqs",
            "sglang:prompt_tokens_total"} <= set(exported)


def test_the_checker_refuses_unknown_metrics_and_labels(exported):
    """The helpers the other tests rely on do fail."""
    assert metric_names('sum(rate(eldr_router_made_up_total{a="eldr_x"}[5m])) / eldr_y') == {
        "eldr_router_made_up_total", "eldr_y"}
    assert problems("sum(rate(eldr_router_made_up_total[5m]))", exported) == [
        "unknown metric eldr_router_made_up_total"]
    assert problems("rate(eldr_router_decisions[5m])", exported) == ["unknown metric eldr_router_decisions"]
    assert problems('rate(eldr_router_fallbacks_total{reasons="timeout"}[5m])', exported) == [
        "eldr_router_fallbacks_total has no label reasons"]
    assert problems("sum by (policy) (rate(eldr_router_fallbacks_total[5m]))", exported) == [
        "sum by/without policy: not a label of its metrics"]
    assert problems("eldr_router_inflight > on (endpoint) eldr_router_request_duration_seconds_count", exported)
    assert problems("sum(rate(eldr_decode_steps_total[5m])) by (instance)", exported) == []
    assert problems("rate(sglang:time_per_output_token_seconds_bucket[5m])", exported) == [
        "unknown metric sglang:time_per_output_token_seconds_bucket"]
    assert problems('rate(sglang:time_to_first_token_seconds_count{role="decode"}[5m])', exported) == [
        "sglang:time_to_first_token_seconds_count has no label role"]
    with pytest.raises(Exception):
        problems("sum(rate(eldr_router_decisions_total[5m])", exported)  # unbalanced
    assert result_labels("sum by (reason) (rate(eldr_router_fallbacks_total[5m]))", exported) == {"reason"}


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_expression_names_exported_metrics_and_labels(exported, source):
    if source == "dashboard":
        items = [(t["expr"], t.get("legendFormat", ""), t["refId"]) for t in dashboard_targets()]
    else:
        items = [(r["expr"], " ".join(r["annotations"].values()), r["alert"]) for r in alert_rules()]
    assert items
    for expr, text, where in items:
        assert metric_names(expr), where
        assert problems(expr, exported) == [], (where, expr)
        used = set(LEGEND.findall(text)) if source == "dashboard" else set(ANNOTATION_LABEL.findall(text))
        assert used <= result_labels(expr, exported), (where, used)


def test_dashboard_is_importable():
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    source = {"type": "prometheus", "uid": "${datasource}"}
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == source
            metric, label = re.fullmatch(r"label_values\((\w+), *(\w+)\)", v["definition"]).groups()
            assert metric in {**router_exports(), **engine_exports()} and label in TARGET_LABELS
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["targets"] and p["datasource"] == source, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["datasource"] == source and t["expr"] for t in p["targets"])
    used = {n for t in dashboard_targets() for n in metric_names(t["expr"])}
    wanted = {"decisions_total", "fallbacks_total", "signature_wait_seconds_bucket", "band_size_bucket",
              "best_similarity_bucket", "inflight", "reported_load", "breaker_state", "server_healthy",
              "request_duration_seconds_bucket", "added_latency_seconds_bucket", "overloaded_total",
              "calibration_age_seconds", "calibration_refits_total", "calibration_churn", "calibration_drift",
              "calibration_online"}
    assert {f"eldr_router_{w}" for w in wanted} | {"eldr_decode_unique_experts_total",
                                                   "eldr_decode_steps_total"} <= used
    assert {"sglang:request_time_per_output_token_seconds_bucket", "sglang:time_to_first_token_seconds_bucket"} <= used


def test_alert_rules_file():
    doc = yaml.safe_load((MONITORING / "prometheus-alerts.yaml").read_text())
    assert set(doc) == {"groups"} and all({"name", "rules"} <= set(g) for g in doc["groups"])
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert {"alert", "expr", "for", "labels", "annotations"} <= set(r), r.get("alert")
        assert re.fullmatch(r"\d+[smhdw]", r["for"]) and r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
    used = {n for r in rules for n in metric_names(r["expr"])}
    assert {"eldr_router_fallbacks_total", "eldr_router_decisions_total", "eldr_router_signature_wait_seconds_bucket",
            "eldr_router_breaker_state", "eldr_router_server_healthy", "eldr_router_calibration_drift",
            "eldr_router_calibration_age_seconds", "eldr_router_calibration_online", "eldr_router_overloaded_total",
            "eldr_signatures_dropped_total"} <= used
    critical = [r for r in rules if r["labels"]["severity"] == "critical"]
    assert any('role="decode"' in r["expr"] for r in critical)  # all decode servers unhealthy
