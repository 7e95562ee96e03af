"""A real Prometheus server scrapes a router on stub workers and evaluates the shipped
alert rules: ``EldrAllDecodeServersUnhealthy`` stays inactive while the decode servers
answer and fires once they all fail their health checks (read through Prometheus'
HTTP API). The rules are ``deploy/monitoring/prometheus-alerts.yaml`` with every
``for:`` cut to 1 s so the test waits seconds, not minutes."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.integration.helpers import cluster, free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "monitoring" / "prometheus-alerts.yaml"
PROMETHEUS = shutil.which("prometheus")
ALERT = "EldrAllDecodeServersUnhealthy"

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package prometheus; "
                                                            "make install adds it)")]


def write_config(folder: Path, router_port: int) -> Path:
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["for"] = "1s"
    (folder / "rules.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
              "rule_files": ["rules.yaml"],
              "scrape_configs": [{"job_name": "eldr-router", "metrics_path": "/metrics",
                                  "static_configs": [{"targets": [f"127.0.0.1:{router_port}"]}]}]}
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


async def poll(http, url: str, test, what: str, timeout: float = 60.0):
    """GET ``url`` (JSON) until ``test(body)`` is truthy; returns that body."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    last = None
    while loop.time() < end:
        try:
            async with http.get(url) as r:
                if r.status == 200:
                    last = await r.json(content_type=None)
                    if test(last):
                        return last
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last answer: {last}")


def alert_state(body: dict) -> str | None:
    """State of ALERT in /api/v1/rules (inactive, pending, firing), None before its first evaluation."""
    for group in body["data"]["groups"]:
        for rule in group["rules"]:
            if rule.get("name") == ALERT and not rule.get("lastEvaluation", "0001").startswith("0001"):
                return rule["state"]
    return None


async def test_prometheus_scrapes_the_router_and_fires_an_alert(tmp_path):
    async with cluster(n_decode=2, policy="round_robin", health_interval=0.1, health_failures=1,
                       health_timeout=0.5) as (router, url, prefill, decodes, http):
        port = free_port()
        config = write_config(tmp_path, int(url.rsplit(":", 1)[1]))
        log = open(tmp_path / "prometheus.log", "wb")
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        api = f"http://127.0.0.1:{port}"
        try:
            await poll(http, f"{api}/api/v1/query?query=up", lambda b: any(
                s["value"][1] == "1" for s in b["data"]["result"]), "the router scraped (up == 1)")
            healthy = await poll(
                http, f"{api}/api/v1/query?query=eldr_router_server_healthy",
                lambda b: len(b["data"]["result"]) == 3, "the router's health gauges in Prometheus")
            assert {s["metric"]["role"] for s in healthy["data"]["result"]} == {"prefill", "decode"}
            assert {s["value"][1] for s in healthy["data"]["result"]} == {"1"}
            rules = await poll(http, f"{api}/api/v1/rules", lambda b: alert_state(b) is not None,
                               f"{ALERT} evaluated")
            assert alert_state(rules) == "inactive"
            for d in decodes:
                d.health_status = 503
            fired = await poll(http, f"{api}/api/v1/alerts", lambda b: any(
                a["labels"]["alertname"] == ALERT and a["state"] == "firing" for a in b["data"]["alerts"]),
                f"{ALERT} firing")
            alert = next(a for a in fired["data"]["alerts"] if a["labels"]["alertname"] == ALERT)
            assert alert["labels"]["severity"] == "critical"
            assert alert["labels"]["instance"] == url.removeprefix("http://")
            assert "no decode server can be picked" in alert["annotations"]["summary"]
            assert not any(a["labels"]["alertname"] == "EldrAllPrefillServersUnhealthy"
                           for a in fired["data"]["alerts"])
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
