"""Both CLIs end to end on a small synthetic trace set, plus bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eldr_sglang.core import load_artifact, make_synthetic_traces, write_traces

ROOT = Path(__file__).resolve().parents[2]


def run_cli(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    syn = make_synthetic_traces(900, num_layers=10, num_experts=32, top_k=4, n_informative=3, seed=4)
    out = tmp_path_factory.mktemp("traces")
    write_traces(syn.traces, out, shard_size=400)
    return out, syn.informative_layers


def test_calibrate_end_to_end(trace_dir, tmp_path):
    traces, planted = trace_dir
    out, png = tmp_path / "artifact.json", tmp_path / "map.png"
    res = run_cli("eldr_sglang.calibrate", "--traces", traces, "--clusters", 4, "--out", out, "--plot", png,
                  "--seed", 1, "--n-init", 2)
    assert res.returncode == 0, res.stderr
    art = load_artifact(out, expect_model={"num_layers": 10, "num_experts": 32, "top_k": 4})
    assert sorted(art.layers) == planted
    assert art.centroids.shape == (4, len(planted) * 32) and art.idf.shape == (len(planted), 32)
    assert art.extra["cluster_sizes"] and max(art.extra["cluster_sizes"]) <= 225
    assert art.extra["purity"]["task"]["purity"] > 0.6
    for text in ("layer selection (greedy)", "cluster sizes (capacity 225)", "label purity [task]", "stopped:"):
        assert text in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_manual_layers_and_variant(trace_dir, tmp_path):
    traces, _ = trace_dir
    out = tmp_path / "a.json"
    res = run_cli("eldr_sglang.calibrate", "--traces", traces, "--clusters", 3, "--out", out, "--layers", "1,5",
                  "--variant", "sqrt", "--n-init", 1)
    assert res.returncode == 0, res.stderr
    art = load_artifact(out)
    assert art.layers == [1, 5] and art.variant == "sqrt" and art.num_clusters == 3


def test_calibrate_bad_inputs(trace_dir, tmp_path):
    traces, _ = trace_dir
    broken = tmp_path / "broken"
    broken.mkdir()
    cols = dict(np.load(traces / "shard-00000.npz"))
    cols["prefill_counts"] = cols["prefill_counts"][:, :, :5]
    np.savez(broken / "shard-00000.npz", **cols)
    res = run_cli("eldr_sglang.calibrate", "--traces", broken, "--clusters", 2, "--out", tmp_path / "x.json")
    assert res.returncode == 2
    assert "shard-00000.npz: field 'prefill_counts' has shape (400, 10, 5), expected (400, 10, 32)" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--clusters", "5000"], "--clusters 5000 exceeds the 900 requests"),
        (["--clusters", "2", "--layers", "3,99"], "--layers '3,99': need distinct layers in [0, 9]"),
        (["--clusters", "2", "--tau", "-0.5"], "--tau must be >= 0"),
    ],
)
def test_calibrate_bad_arguments_in_process(trace_dir, tmp_path, capsys, extra, message):
    from eldr_sglang.calibrate import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--traces", str(trace_dir[0]), "--out", str(tmp_path / "x.json"), *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_analyze_end_to_end(trace_dir, tmp_path):
    traces, _ = trace_dir
    report = tmp_path / "report.json"
    res = run_cli("eldr_sglang.analyze", "--traces", traces, "--pairs", 5000, "--batches", 50, "--json", report)
    assert res.returncode == 0, res.stderr
    for text in ("Pearson r per request", "gate_logit", "binary", "reduction", "task", "language"):
        assert text in res.stdout
    data = json.loads(report.read_text())
    assert set(data["variants"]) == {"raw", "idf", "sqrt", "gate_prob", "gate_logit", "binary"}
    assert data["variants"]["idf"]["profile"] > data["variants"]["binary"]["profile"]
    assert 0.0 < data["pearson"]["mean"] <= 1.0
    assert data["locality"]["task"]["same_label"] <= data["locality"]["task"]["mixed"]


def test_analyze_bad_input(tmp_path):
    res = run_cli("eldr_sglang.analyze", "--traces", tmp_path / "nothing-here")
    assert res.returncode == 2 and "nothing-here: no such trace file or directory" in res.stderr
    assert "Traceback" not in res.stderr


def test_analyze_empty_dir_in_process(tmp_path, capsys):
    from eldr_sglang.analyze import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--traces", str(tmp_path)])
    assert exit_info.value.code == 2 and "no shard-*.npz files" in capsys.readouterr().err


def test_calibration_map_marks_regions_and_numbers_centroids_in_decode_order(trace_dir, tmp_path):
    """The map's first panel colours each point by its region (most similar centroid =
    decode server), every centroid carries its decode index, and the axes say what they are."""
    from eldr_sglang.calibrate import plot_map
    from eldr_sglang.core import BalancedKMeans, load_traces
    from eldr_sglang.core.signature import SignatureBuilder

    ts = load_traces(trace_dir[0])
    sig = SignatureBuilder(layers=[0, 1, 2]).fit(ts).transform(ts)
    km = BalancedKMeans(3, n_init=1, random_state=0).fit(sig)
    fig = plot_map(sig, km, ts, str(tmp_path / "map.png"), seed=0)
    region = fig.axes[0]
    assert region.get_title() == "signatures by region = decode server"
    assert sorted(t.get_text() for t in region.texts) == ["0", "1", "2"]
    labels = [t.get_text() for t in region.get_legend().get_texts()]
    assert [l.split(" (")[0] for l in labels] == ["decode 0", "decode 1", "decode 2"]
    assert sum(int(l.split("(")[1].rstrip(")")) for l in labels) == len(sig)
    assert region.get_xlabel().startswith("PC 1 (") and region.get_ylabel().startswith("PC 2 (")
    assert len(fig.axes) == 1 + len(ts.labels)
