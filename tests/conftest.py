"""Shared fixtures: the fixture model and real SGLang CPU servers.

Servers are expensive (~2.5 GB and ~45-90 s each on 2 cores), so each kind is
started once per test session and torn down at the end (also after a failed
or interrupted run). When a test that used a server fails, the tails of the
server logs are attached to its report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eldr_sglang.testing import local_cluster as lc
from tests.helpers import (GREEDY_NEW_TOKENS, LOG_DIR, ROOT, TEST_ARTIFACT_LAYERS, greedy_generate, progress, serving,
                           started)

MODEL_DIR = Path(os.environ.get("ELDR_FIXTURE_MODEL", ROOT / ".cache" / "models" / "tiny-qwen3-moe"))


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """``async def test_*`` functions (anyio's plugin, ``anyio_mode = "auto"``) run on asyncio only."""
    return "asyncio"


@pytest.fixture(scope="session")
def fixture_model() -> Path:
    """The tiny random Qwen3-MoE (4 layers, 16 experts, top-4), built if missing."""
    if not (MODEL_DIR / "model.safetensors").exists():
        subprocess.run(
            [sys.executable, "-m", "tools.make_fixture_model", "--out", str(MODEL_DIR)],
            check=True, cwd=ROOT,
        )
    return MODEL_DIR


@pytest.fixture(scope="module")
def single_server(fixture_model: Path):
    """One plain (non-PD) SGLang CPU server with the ELDR plugin capturing
    layers 1 and 3 (module scope: stopped before the PD servers start)."""
    spec = lc.ServerSpec(str(fixture_model), extra_args=["--eldr-layers", ",".join(map(str, TEST_ARTIFACT_LAYERS))])
    with serving(spec, "single") as proc:
        yield proc


@pytest.fixture(scope="session")
def n_decode() -> int:
    """Decode servers in the shared PD cluster (``ELDR_TEST_DECODES``, default 2)."""
    return int(os.environ.get("ELDR_TEST_DECODES", "2"))


@pytest.fixture(scope="session")
def test_artifact(tmp_path_factory, n_decode) -> Path:
    """A calibration artifact for the fixture model: layers 1 and 3, random
    centroids (one per decode server), IDF from a skewed pattern, tau 0 (strict
    affinity, so the expected decode server is the best centroid)."""
    import numpy as np

    from eldr_sglang.core import CalibrationArtifact, ModelSpec

    rng = np.random.default_rng(7)
    centroids = rng.random((n_decode, len(TEST_ARTIFACT_LAYERS) * 16)).astype(np.float32) ** 3
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    idf = (1.0 + rng.random((len(TEST_ARTIFACT_LAYERS), 16))).astype(np.float32)
    path = tmp_path_factory.mktemp("artifact") / "tiny-eldr.json"
    CalibrationArtifact(ModelSpec("tiny-qwen3-moe", 4, 16, 4), "idf", TEST_ARTIFACT_LAYERS, idf,
                        centroids, tau=0.0).save(path)
    return path


@pytest.fixture(scope="session")
def trace_dir(tmp_path_factory) -> Path:
    """Where the shared cluster's servers write trace-mode logs."""
    return tmp_path_factory.mktemp("eldr-trace")


@pytest.fixture(scope="session")
def pd_cluster(fixture_model: Path, test_artifact: Path, n_decode: int, trace_dir: Path):
    """1 prefill + N decode SGLang CPU servers over mooncake_tcp, late binding
    on, the ELDR plugin active: prefill publishes the artifact's layers to the
    address each request carries (each ELDR router's signature port); all servers
    run in trace mode and serve plugin metrics."""
    trace = ["--eldr-trace-dir", str(trace_dir)]
    cluster = lc.start_pd_cluster(
        str(fixture_model), LOG_DIR, n_prefill=1, n_decode=n_decode, progress=progress,
        prefill_args=["--eldr-calibration", str(test_artifact),
                      "--eldr-publish", "request", *trace],
        decode_args=trace, eldr_metrics=True)
    started.extend(cluster.processes)
    try:
        yield cluster
    finally:
        cluster.stop()


def _serve_router(proc: lc.ManagedProcess):
    """Ready = it answers a real request (sglang-router's /health is up before
    its workers are registered, and it answers 503 until they are)."""
    started.append(proc)
    try:
        proc.wait_ready(path="/health", timeout=60)
        deadline = time.monotonic() + 60
        while True:
            try:
                greedy_generate(proc.url, "ping", max_new_tokens=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def eldr_router(pd_cluster, test_artifact: Path):
    """The ELDR router (policy eldr) in front of ``pd_cluster``; its port is picked just
    before it starts (again on a clash), signatures come to its own signature port."""
    yield from _serve_router(lc.start_eldr_router_ready(pd_cluster, LOG_DIR, artifact=test_artifact,
                                                        extra_args=["--signature-port", "0"]))


@pytest.fixture(scope="session")
def sglang_router(pd_cluster):
    """sglang-router (Rust PD gateway, round robin) in front of ``pd_cluster``."""
    yield from _serve_router(lc.start_sglang_router(pd_cluster, LOG_DIR))


GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Aspirin is used to treat",
    "Москва — столица",
]


@pytest.fixture(scope="session")
def hf_model(fixture_model):
    """(tokenizer, model): transformers' own Qwen3-MoE on the fixture, bf16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(fixture_model),
            AutoModelForCausalLM.from_pretrained(fixture_model, dtype=torch.bfloat16))


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """Greedy continuations from transformers' own Qwen3-MoE implementation."""
    import torch

    tok, model = hf_model
    out = {}
    for prompt in GREEDY_PROMPTS:
        ids = tok(prompt).input_ids
        gen = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_NEW_TOKENS,
                             min_new_tokens=GREEDY_NEW_TOKENS, do_sample=False)
        out[prompt] = gen[0, len(ids):].tolist()
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for proc in started:
            report.sections.append((f"log tail: {proc.name} ({proc.log_path})", proc.log_tail(30)))


def pytest_sessionfinish(session, exitstatus):
    for proc in started:  # belt and braces: nothing outlives the session
        proc.stop(grace=2)


def pytest_collection_modifyitems(session, config, items):
    """Run order, by marker and fixture (never by file name):

    0. tests marked ``exclusive`` (the fast demo): they start their own cluster and
       need the machine to themselves, so they run before any other server starts;
    1. tests with their own module-scoped servers (``single_server``,
       ``trained_server``, ``chunked_prefill``, ``openai_router``): those stop with their module,
       before the shared PD cluster starts, so at most three servers run at once;
    2. everything else (the shared PD cluster starts with its first user);
    3. tests marked ``destructive`` (they kill servers of the shared cluster).

    Within a rank the collection order is kept."""
    own_servers = {"single_server", "trained_server", "chunked_prefill", "openai_router"}

    def rank(item) -> int:
        if item.get_closest_marker("exclusive"):
            return 0
        if own_servers & set(getattr(item, "fixturenames", ())):
            return 1
        return 3 if item.get_closest_marker("destructive") else 2

    items.sort(key=rank)
