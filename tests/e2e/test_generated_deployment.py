"""What ``deploy scripts`` generates for the committed one-machine CPU description
(preset ``cpu-1p2d-loopback``: 1 prefill + 2 decode real SGLang CPU servers and the
router, on loopback), run as the docs say: ``sglang.bench_serving`` through the
generated router routes with signatures (the default policy reads the artifact),
``/metrics`` answers, the decode servers' ELDR metrics count steps, and the stop
script leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from eldr_sglang.deploy.presets import load_description
from eldr_sglang.testing.local_cluster import free_port
from tests.helpers import processes_marked, run_bench_serving, wait_until

pytestmark = [pytest.mark.sglang, pytest.mark.exclusive, pytest.mark.timeout(1500)]
ROOT = Path(__file__).resolve().parents[2]
MARK = "ELDR_TEST_GENERATED_DEPLOYMENT"
PROMPTS = 24


def marked(marker: str) -> set[int]:
    return processes_marked(MARK, marker)


def get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except OSError as e:
        return getattr(e, "code", 0) or 0, str(e)


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deployment")
    doc = load_description(preset="cpu-1p2d-loopback")
    doc.update(python=sys.executable, log_dir=str(tmp / "logs"))
    doc["prefill"].update(port=free_port(), bootstrap_port=free_port(), metrics_port=free_port())
    doc["decode"].update(port=free_port(), metrics_port=free_port())
    doc["router"].update(port=free_port(), signature_port=free_port())
    desc = tmp / "cluster.yaml"
    desc.write_text(yaml.safe_dump(doc))
    gen = subprocess.run([sys.executable, "-m", "eldr_sglang.deploy", "scripts", str(desc), "--out",
                          str(tmp / "launch")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    marker = uuid.uuid4().hex
    env = {**os.environ, MARK: marker, "PYTHONUNBUFFERED": "1"}
    log = open(tmp / "script.out", "w")
    proc = subprocess.Popen(["bash", str(tmp / "launch" / "local.sh")], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    router = f"http://127.0.0.1:{doc['router']['port']}"
    try:
        wait_until(lambda: "is up" in (tmp / "script.out").read_text() or proc.poll() is not None,
                   900, "the generated deployment up", step=1.0)
        assert proc.poll() is None, (tmp / "script.out").read_text()
        yield router, doc, tmp, proc, env, marker
    finally:
        subprocess.run(["bash", str(tmp / "launch" / "local-stop.sh")], cwd=ROOT, env=env,
                       capture_output=True, timeout=120)
        proc.wait(120)
        for pid in marked(marker):
            os.kill(pid, signal.SIGKILL)


def test_generated_cluster_serves_bench_serving_with_signatures(deployment):
    router, doc, tmp, proc, env, marker = deployment
    result = run_bench_serving(router, ROOT / doc["model_path"], tmp / "bench.jsonl", PROMPTS, 48, 8)
    assert result["completed"] == PROMPTS
    status, text = get(f"{router}/metrics")
    assert status == 200, text[:500]
    decisions = {s[0]["kind"]: s[1] for s in samples(text, "eldr_router_decisions_total")}
    total = sum(decisions.values())
    assert total >= PROMPTS
    assert decisions.get("signature", 0) >= 0.9 * total, decisions  # ELDR on, not the fallback
    fallbacks = {s[0]["reason"]: s[1] for s in samples(text, "eldr_router_fallbacks_total")}
    assert fallbacks.get("timeout", 0) + fallbacks.get("no_activation", 0) <= 0.1 * total, fallbacks
    assert samples(text, "eldr_router_best_similarity_count")[0][1] >= 0.9 * total
    for i in range(doc["decode"]["count"]):  # the decode servers' ELDR metrics count steps
        status, text = get(f"http://127.0.0.1:{doc['decode']['metrics_port'] + i}/metrics")
        assert status == 200 and sum(v for _, v in samples(text, "eldr_decode_steps_total")) > 0
    # the generated router reads the engines' batch reports (--engine-metrics) and fits their step laws
    status, text = get(f"{router}/eldr/status")
    assert status == 200, text[:300]
    reports = json.loads(text)["engine_reports"]
    assert len(reports) == doc["decode"]["count"] and all(r["samples"] > 0 for r in reports.values()), reports
    wait_until(lambda: len(samples(get(f"{router}/metrics")[1], "eldr_router_step_law_r2"))
               == doc["decode"]["count"], 60, "a step law per decode server", step=0.5)


def test_stop_script_leaves_no_process(deployment):
    router, doc, tmp, proc, env, marker = deployment
    assert len(marked(marker)) >= 4
    done = subprocess.run(["bash", str(tmp / "launch" / "local-stop.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert proc.wait(120) == 0  # the start script ends: stopped, not crashed
    wait_until(lambda: not marked(marker), 60, "every process of the deployment gone", step=0.5)
