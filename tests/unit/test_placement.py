"""Expert placement: validity, never worse than SGLang's default, within the bound,
files readable by SGLang's own parser, and the documented CLI commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eldr_sglang import calibrate
from eldr_sglang.core.artifact import load_artifact
from eldr_sglang.core.synthetic import make_synthetic_traces
from eldr_sglang.core.traces import write_traces
from eldr_sglang.placement import (
    assign_regions,
    default_map,
    evaluate,
    lower_bound,
    optimize_layer,
    read_location_file,
    region_activities,
)

ROOT = Path(__file__).resolve().parents[2]
# The fixture model's shape (tools/make_fixture_model.py): Qwen3-MoE, 4 layers, 16 experts, top-4.
FIXTURE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
    "intermediate_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4,
    "vocab_size": 32000, "max_position_embeddings": 4096, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
}


def skewed_loads(seed: int, num_experts: int = 128, spread: float = 1.2) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    load = rng.lognormal(0.0, spread, num_experts)
    load /= load.sum()
    return load, np.clip(load * 8, 0, 1)


def assert_valid(p2l: np.ndarray, num_experts: int, ep_size: int, num_redundant: int) -> None:
    num_physical = num_experts + num_redundant
    assert p2l.shape == (num_physical,)
    assert set(p2l.tolist()) == set(range(num_experts)), "every logical expert on at least one rank"
    per_rank = p2l.reshape(ep_size, num_physical // ep_size)  # equal slots per rank by construction
    for rank in per_rank:
        assert len(set(rank.tolist())) == len(rank), "an expert twice on one rank"


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ep_size,num_redundant", [(4, 0), (4, 8), (8, 8), (2, 2)])
def test_optimiser_valid_better_than_default_and_within_bound(seed, ep_size, num_redundant):
    load, prob = skewed_loads(seed)
    placed = optimize_layer(load, ep_size, num_redundant, prob, batch_size=32)
    assert_valid(placed.physical_to_logical, 128, ep_size, num_redundant)
    default_load, _ = evaluate(default_map(128, ep_size, num_redundant), load, ep_size)
    assert placed.max_load <= default_load.max() + 1e-12
    bound = lower_bound(load, ep_size, num_redundant)
    assert placed.lower_bound == pytest.approx(bound)
    assert bound - 1e-12 <= placed.max_load <= bound * 1.02, f"gap {placed.gap:.3e}"
    assert placed.max_load == pytest.approx(placed.rank_load.max())


def test_lower_bound_dominates_simple_bound_and_is_tight_for_one_hot_expert():
    load = np.array([0.5] + [0.5 / 12] * 12)  # 13 experts + 3 redundant = 16 slots, 4 per rank
    simple = max(load.sum() / 4, load.max() / (1 + 3))
    assert lower_bound(load, 4, 3) >= simple
    placed = optimize_layer(load, 4, 3)
    assert placed.max_load == pytest.approx(lower_bound(load, 4, 3), rel=1e-9) == pytest.approx(0.25)
    assert np.bincount(placed.physical_to_logical)[0] == 4  # the hot expert on every rank


def test_bad_slot_counts_are_refused():
    with pytest.raises(ValueError, match="not divisible by ep_size 3"):
        optimize_layer(np.ones(16), 3)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """Synthetic traces with the fixture model's shape, calibrated with the project's CLI code."""
    work = tmp_path_factory.mktemp("placement")
    syn = make_synthetic_traces(n_requests=600, num_layers=4, num_experts=16, top_k=4, include_gates=False, seed=1)
    write_traces(syn.traces, work / "traces")
    calibrate.main(["--traces", str(work / "traces"), "--clusters", "3", "--out", str(work / "artifact.json"),
                    "--layers", ",".join(map(str, syn.informative_layers)), "--n-init", "1"])
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(FIXTURE_CONFIG))
    return work, syn.traces


def test_regions_follow_the_routers_signature(calibrated):
    work, traces = calibrated
    artifact = load_artifact(work / "artifact.json")
    regions = assign_regions(artifact, traces)
    # the router's computation for one request: selected layers' raw counts -> artifact signature
    i = 7
    sims = artifact.similarities(artifact.signature(traces.prefill_counts[i][artifact.layers]))
    assert regions[i] == int(np.argmax(sims))
    acts, _ = region_activities(artifact, traces)
    mine = np.flatnonzero(regions == 0)
    hits = traces.decode_counts[mine].sum(0).astype(float)
    np.testing.assert_allclose(acts[0].load, hits / hits.sum(1, keepdims=True))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_optimize_cli_writes_files_sglang_parses_identically(calibrated):
    work, _ = calibrated
    out = work / "placements"
    # docs/DEPLOY.md: python -m eldr_sglang.placement optimize ...
    done = run_cli("-m", "eldr_sglang.placement", "optimize", "--artifact", str(work / "artifact.json"),
                   "--traces", str(work / "traces"), "--ep-size", "4", "--redundant", "4",
                   "--model-path", str(work / "model"), "--out", str(out))
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "placement.json").read_text())
    assert manifest["num_physical"] == 20 and len(manifest["servers"]) == 3
    for server in manifest["servers"]:
        assert server["max_rank_load_mean"] <= server["default"]["max_rank_load_mean"] + 1e-12
        assert server["gap_max"] < 0.05
    files = sorted(out.glob("server-*.json"))
    for f in files:
        p2l = read_location_file(f)
        assert p2l.shape == (4, 20)
        for layer in p2l:
            assert_valid(layer, 16, 4, 4)

    from eldr_sglang.placement import parse_with_sglang

    parsed = parse_with_sglang(str(work / "model"), files, ep_size=4, num_redundant=4)
    for f, sglang_map in zip(files, parsed):
        np.testing.assert_array_equal(sglang_map, read_location_file(f))
    with pytest.raises(ValueError, match="physical experts per layer"):
        parse_with_sglang(str(work / "model"), files[:1], ep_size=4, num_redundant=0)

    # docs/DEPLOY.md: python -m eldr_sglang.placement verify ... and python -m tools.place_experts
    ok = run_cli("-m", "eldr_sglang.placement", "verify", "--model-path", str(work / "model"),
                 "--ep-size", "4", "--redundant", "4", str(out))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("ok ") == 3
    bad = run_cli("-m", "tools.place_experts", "optimize", "--artifact", str(work / "artifact.json"),
                  "--traces", str(work / "traces"), "--ep-size", "3", "--out", str(work / "bad"))
    assert bad.returncode == 2 and "not divisible by ep_size 3" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_placement_small_synthetic_run(tmp_path):
    """python -m benchmark.bench_placement end to end on a small synthetic set (the docs show the full-size run)."""
    out = tmp_path / "bench.json"
    done = run_cli("-m", "benchmark.bench_placement", "--synthetic-requests", "450", "--synthetic-layers", "8",
                   "--servers", "3", "--batches", "5", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "SIMULATED" in done.stdout and "SYNTHETIC" in done.stdout
    report = json.loads(out.read_text())
    assert report["simulated"] is True and set(report["rows"]) == {"default", "global", "per-server"}
    rows = report["rows"]
    assert rows["per-server"]["imbalance"] < rows["default"]["imbalance"]
    assert report["gap_to_bound"]["max"] < 0.05
