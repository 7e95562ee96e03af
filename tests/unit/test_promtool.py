"""The alert rules checked by Prometheus' own ``promtool``: ``check rules`` on
``deploy/monitoring/prometheus-alerts.yaml``, ``test rules`` on its committed unit tests
(``prometheus-alerts.test.yaml``: alerts firing and not firing on given series)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
RULES = MONITORING / "prometheus-alerts.yaml"
RULE_TESTS = MONITORING / "prometheus-alerts.test.yaml"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus; "
                                                         "make install adds it)")


def promtool(*args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_check_rules():
    result = promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert f"SUCCESS: {len(alerts)} rules found" in result.stdout


def test_rule_unit_tests_pass():
    result = promtool("test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_tested_alert_is_seen_firing_and_silent():
    cases = [case for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in t["alert_rule_test"]]
    firing = {c["alertname"] for c in cases if c["exp_alerts"]}
    silent = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert {"EldrServerUnhealthy", "EldrAllDecodeServersUnhealthy", "EldrFallbackRateHigh",
            "EldrSignaturesDropped", "EldrBreakerOpen"} <= firing
    assert firing - {"EldrBreakerOpen"} <= silent  # EldrBreakerOpen's silent case: the half-open series


@pytest.mark.parametrize("change", [
    ("max by (instance) (eldr_router_server_healthy{role=\"decode\"}) == 0",
     "min by (instance) (eldr_router_server_healthy{role=\"decode\"}) == 0"),  # fires on one server out
    ("            > 0.2\n        for: 10m", "            > 0.5\n        for: 10m"),  # 30% no longer fires
    ("sum by (instance) (rate(eldr_signatures_dropped_total[5m])) > 0",
     "sum by (instance) (rate(eldr_signatures_dropped_total[5m])) > 5"),
])
def test_the_unit_tests_catch_a_broken_rule(tmp_path, change):
    """The committed cases fail on rules that alert too early or not at all."""
    old, new = change
    text = RULES.read_text()
    assert old in text
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    result = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr
