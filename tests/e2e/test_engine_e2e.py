"""The engine plugin inside real SGLang CPU servers, behind the real ELDR router.

Shared cluster (conftest): 1 prefill (ELDR flags: artifact layers 1 and 3,
publish to the router) + 2 decode servers, mooncake_tcp, late binding.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from eldr_sglang.testing.local_cluster import flush_cache, http_json, scrape_metrics
from tests.helpers import TEST_ARTIFACT_LAYERS, greedy_generate, run_bench_serving, wait_until

pytestmark = pytest.mark.sglang

PROMPTS = [
    "Patients with chronic kidney disease often present with anemia and hypertension.",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs",
    "Le contrat de licence accorde au titulaire un droit non exclusif.",
    "Solve for x: 3x + 7 = 22, then compute x squared.",
]


def route(router_url: str, prompt: str, max_new_tokens: int = 4) -> dict:
    """Send one request through the router; return its routing decision."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    rid = http_json(router_url + "/generate", body, timeout=120)["meta_info"]["id"]
    for decision in reversed(http_json(router_url + "/eldr/decisions?last=50")):
        if rid in decision["rids"]:
            return decision
    raise AssertionError(f"no routing decision recorded for rid {rid}")


@pytest.fixture(scope="module")
def hf_topk_counts(hf_model):
    """Per-layer top-k expert counts of each prompt from transformers' own gates."""
    import torch

    tok, model = hf_model
    top_k, n_exp = model.config.num_experts_per_tok, model.config.num_experts

    def counts(prompt: str) -> tuple[int, np.ndarray]:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_router_logits=True)
        rows = []
        for layer in TEST_ARTIFACT_LAYERS:
            top = out.router_logits[layer].float().topk(top_k, dim=-1).indices.flatten()
            rows.append(np.bincount(top.numpy(), minlength=n_exp))
        return len(ids), np.stack(rows)

    return counts


def test_signature_counts_equal_hf_gate_topk(eldr_router, hf_topk_counts):
    """SGLang's and transformers' bf16 kernels round differently, so a token
    whose k-th and (k+1)-th gate logits nearly tie may swap them: allow one
    such swap per layer and prompt (an L1 difference of 2), nothing more."""
    exact = 0
    for prompt in PROMPTS:
        msg = route(eldr_router.url, prompt)["messages"][0]
        n_tokens, expected = hf_topk_counts(prompt)
        got = np.array(msg["counts"])
        assert msg["layers"] == TEST_ARTIFACT_LAYERS
        assert msg["prompt_tokens"] == n_tokens
        assert (got.sum(axis=1) == n_tokens * 4).all(), "every token counts top-k = 4 experts per layer"
        assert (np.abs(got - expected).sum(axis=1) <= 2).all(), (prompt, got, expected)
        exact += bool((got == expected).all())
    assert exact >= len(PROMPTS) // 2, "most prompts should match transformers exactly"


def test_prefix_cache_hit_signature_equals_cold_signature(eldr_router, pd_cluster):
    """Warm (prefix-cache hit, including a radix node split) and cold
    signatures of the same prompt count every prompt token, and agree.

    Cached tokens' ids come from the KV-slot table exactly as first computed;
    but SGLang's forward of the new tokens on top of a cached prefix is not
    bitwise identical to a cold forward of the whole prompt (bf16 reductions
    in another order), so a token whose k-th and (k+1)-th gate logits nearly
    tie may swap them: allow one such swap per layer (L1 difference 2)."""
    prefill = pd_cluster.prefills[0][0]
    base = "The committee reviewed the quarterly budget report and approved the new hiring plan"
    extended = base + " for the engineering department next year."
    branch = base + " but postponed the office move until the spring."
    flush_cache(prefill.url)
    route(eldr_router.url, base)  # caches the prefix
    warm = route(eldr_router.url, extended)["messages"][0]
    assert warm["cached_tokens"] > 0, "should hit the cached prefix"
    split = route(eldr_router.url, branch)["messages"][0]  # splits the node of `extended` inside `base`
    assert split["cached_tokens"] > 0
    for prompt, warm_msg in ((extended, warm), (branch, split)):
        flush_cache(prefill.url)  # evicts everything: the cold run reuses freed KV slots
        cold = route(eldr_router.url, prompt)["messages"][0]
        assert cold["cached_tokens"] == 0, "flush_cache should have emptied the prefix cache"
        assert warm_msg["prompt_tokens"] == cold["prompt_tokens"]
        warm_counts, cold_counts = np.array(warm_msg["counts"]), np.array(cold["counts"])
        for counts in (warm_counts, cold_counts):  # cached + new tokens all counted, top-4 each
            assert (counts.sum(axis=1) == 4 * cold["prompt_tokens"]).all(), prompt
        assert (np.abs(warm_counts - cold_counts).sum(axis=1) <= 2).all(), (prompt, warm_counts, cold_counts)


def test_eldr_picks_the_decode_server_of_the_best_centroid(eldr_router, pd_cluster, test_artifact):
    """tau = 0 in the test artifact: the best centroid's server, whatever the loads."""
    art = json.loads(test_artifact.read_text())
    idf, centroids = (np.frombuffer(base64.b64decode(art[k]["data"]), dtype=art[k]["dtype"]).reshape(art[k]["shape"])
                      for k in ("idf", "centroids"))
    decode_urls = [proc.url for proc, _ in pd_cluster.decodes]
    for prompt in PROMPTS:
        decision = route(eldr_router.url, prompt)
        # recomputed here from the raw counts: IDF-weighted, L2-normalised, cosine to centroids
        counts = np.array(decision["messages"][0]["counts"], dtype=np.float64)
        vec = (counts * idf).flatten()
        vec /= np.linalg.norm(vec)
        best = int(np.argmax(centroids @ vec))
        assert decision["decode"] == decode_urls[best], prompt


def test_greedy_output_through_eldr_router_equals_hf(eldr_router, hf_greedy):
    for prompt, expected in hf_greedy.items():
        assert greedy_generate(eldr_router.url, prompt) == expected, prompt


def test_decode_servers_report_unique_experts_per_step(eldr_router, pd_cluster):
    route(eldr_router.url, PROMPTS[0], max_new_tokens=8)
    steps = 0
    for _, spec in pd_cluster.decodes:
        m = scrape_metrics(spec.eldr_metrics_port)
        steps += m["eldr_decode_steps_total"]
        if m["eldr_decode_steps_total"]:
            per_step = m["eldr_decode_unique_experts_per_step"]
            # one or more requests per step: at least top_k per layer, at most every expert
            assert 4 * 4 <= per_step <= 4 * 16, m
    assert steps >= 7


def test_bench_serving_through_eldr_router(eldr_router, fixture_model, tmp_path):
    before = http_json(eldr_router.url + "/eldr/status")["counters"]
    result = run_bench_serving(eldr_router.url, fixture_model, tmp_path / "bench.jsonl", 10, 48, 8)
    assert result["completed"] == 10, result
    after = http_json(eldr_router.url + "/eldr/status")["counters"]
    delivered = "signature_messages{outcome=delivered}"
    delta = {k: after.get(k, 0) - before.get(k, 0)
             for k in ("requests", "signature_messages", delivered, "signatures_used")}
    # exactly one signature message per PD prefill, each delivered to its waiting request
    assert delta["requests"] >= 10 and delta["signature_messages"] == delta["requests"], delta
    assert delta[delivered] == delta["requests"], delta
    assert delta["signatures_used"] == delta["requests"], delta
    assert after.get("fallbacks", 0) == before.get("fallbacks", 0), after


def test_trace_mode_logs_join_into_calibration_traces(eldr_router, trace_dir, fixture_model, tmp_path):
    rids = {rid for prompt in PROMPTS for rid in route(eldr_router.url, prompt, max_new_tokens=6)["rids"]}

    def logged(kind: str) -> set:
        return {json.loads(line).get("rid") for f in trace_dir.glob(f"{kind}-*.jsonl")
                for line in f.read_text().split("\n")[:-1] if line.strip()}  # complete lines

    wait_until(lambda: rids <= logged("prefill") and rids <= logged("decode"), timeout=60,
               what="the trace lines (written by a background thread)", step=0.1)
    out = tmp_path / "traces"
    proc = subprocess.run([sys.executable, "-m", "eldr_sglang.collect_traces", "--logs", str(trace_dir),
                           "--model", str(fixture_model), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from eldr_sglang.core import load_traces

    traces = load_traces(out)
    assert len(traces) >= len(PROMPTS)
    assert traces.prefill_counts.shape[1:] == (4, 16)
    # every prompt token picks top-k = 4 experts per layer; decode computes output_tokens - 1 tokens
    assert (traces.prefill_counts.sum(axis=2) == 4 * traces.prompt_tokens[:, None]).all()
    # decode computes output_tokens - 1 tokens, plus the one step that SGLang's
    # overlap scheduler runs ahead before it sees the request finished
    decode_tokens = traces.decode_counts.sum(axis=2) // 4
    assert (traces.decode_counts.sum(axis=2) % 4 == 0).all()
    assert ((decode_tokens == traces.output_tokens[:, None] - 1) | (decode_tokens == traces.output_tokens[:, None])).all()
    assert traces.gate_prob_sums is not None and (traces.gate_prob_sums.sum(axis=2) <= traces.prompt_tokens[:, None] + 1e-3).all()
    steps = [json.loads(line) for f in trace_dir.glob("steps-*.jsonl") for line in f.open()]
    assert steps and all(4 <= u <= 16 for s in steps for u in s["unique_per_layer"])


def test_router_started_without_artifact_converges_and_routes_by_signature(eldr_router, pd_cluster):
    """``--online`` in front of real SGLang servers: no artifact at start (least loaded),
    a fit once 6 signatures came (in a separate process, K = 2 decode servers), then
    decisions by signature; the fit's layers are those the engine publishes."""
    from eldr_sglang.testing import local_cluster as lc
    from tests.helpers import LOG_DIR

    router = lc.start_eldr_router_ready(
        pd_cluster, LOG_DIR, policy="eldr",
        extra_args=["--online", "--online-min-signatures", "6", "--online-drift-window", "4",
                    "--signature-port", "0"])
    try:
        first = route(router.url, PROMPTS[0])
        assert first["policy"] == "jsq"  # warming: by load
        for i in range(5):
            route(router.url, PROMPTS[(i + 1) % len(PROMPTS)] + f" ({i})")
        info = {}

        def fitted() -> bool:
            info.update(http_json(router.url + "/eldr/calibration"))
            return info["online"]["generation"] >= 1
        wait_until(fitted, timeout=180, what="the first online fit", step=0.5)
        assert info["provenance"]["mode"] == "online" and info["policy"] == "eldr"
        assert info["artifact"]["layers"] == list(TEST_ARTIFACT_LAYERS)
        assert info["artifact"]["num_clusters"] == len(pd_cluster.decodes)
        later = [route(router.url, p) for p in PROMPTS[:2]]
        assert all(d["policy"] == "eldr" and d["reason"] == "band" for d in later), later
    finally:
        router.stop()


def test_time_sliced_ab_on_real_servers_gives_a_verdict(pd_cluster, test_artifact, tmp_path):
    """``--ab-policies eldr,round_robin`` in front of real SGLang servers: slices
    alternate, each record carries the decode servers' steps, batch and distinct
    experts from their plugin metrics, and ``python -m eldr_sglang.ab`` turns the
    records into a verdict and a plot."""
    from eldr_sglang.testing import local_cluster as lc
    from tests.helpers import LOG_DIR

    record = tmp_path / "ab.jsonl"
    engines = ",".join(f"http://127.0.0.1:{spec.eldr_metrics_port}/metrics" for _, spec in pd_cluster.decodes)
    router = lc.start_eldr_router_ready(
        pd_cluster, LOG_DIR, policy="eldr", artifact=test_artifact,
        extra_args=["--ab-policies", "eldr,round_robin", "--ab-slice", "5", "--ab-record", str(record),
                    "--engine-metrics", engines, "--signature-port", "0"])
    try:
        deadline, i = time.monotonic() + 240, 0
        while not record.exists() or len(record.read_text().splitlines()) < 4:
            assert time.monotonic() < deadline, "fewer than 4 A/B slices written"
            body = {"text": PROMPTS[i % len(PROMPTS)] + f" #{i}",
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            http_json(router.url + "/generate", body, timeout=120)
            i += 1
    finally:
        router.stop()
    recs = [json.loads(line) for line in record.read_text().splitlines()]
    assert {r["arm"] for r in recs} == {"eldr", "round_robin"}
    busy = [r for r in recs if r["requests"]]
    assert busy and all(r["decode_steps"] > 0 and r["unique_per_step"] > 0 for r in busy)
    out = subprocess.run([sys.executable, "-m", "eldr_sglang.ab", str(record), "--baseline", "round_robin",
                          "--plot", str(tmp_path / "ab.png")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "eldr vs round_robin" in out.stdout and (tmp_path / "ab.png").exists()
