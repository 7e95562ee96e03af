"""SIMULATED effect of expert placement on TP x EP decode servers (cost model, not hardware).

Compares, on each decode server's own traffic (eval requests routed to the nearest
centroid, as the ELDR router does at tau = 0), three placements:

  (a) default    SGLang's layout: expert e on EP rank e // (E / G)
  (b) global     one balanced placement fit on all calibration requests (EPLB-style)
  (c) per-server this project's placement, fit on each server's calibration region

For sampled decode batches of the server's requests it estimates, per layer and EP
rank, the expected distinct experts read in one step (sum over the rank's slots of
1 - prod_r (1 - p_re / replicas), p_re = decode_counts / output_tokens) and the
token load, then the cost model's step time (``eldr_sglang/sim/cost_model.py``,
parameter set ``qwen3-235b-a22b-mi300x-tp4ep4`` by default).

    python -m benchmark.bench_placement [--traces DIR --artifact FILE] [--eval-traces DIR] \\
        [--servers 6] [--ep-size 4] [--redundant 0] [--batch-size 32] [--batches 100] [--json out.json]

Without ``--traces`` it generates SYNTHETIC traces (make_synthetic_traces, 128 experts,
top-8) and calibrates them with ``python -m eldr_sglang.calibrate``'s code. A
``--traces`` directory holding ``calib/`` and ``eval/`` (``benchmark/traces/<workload>``)
is split that way.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmark.common import parse_with_quick, quick_out, write_record
from eldr_sglang import calibrate
from eldr_sglang.core.artifact import load_artifact
from eldr_sglang.core.synthetic import make_synthetic_traces
from eldr_sglang.core.traces import TraceSet, load_traces, write_traces
from eldr_sglang.placement import (
    assign_regions,
    default_map,
    plan_global,
    plan_per_server,
    token_probabilities,
)
from eldr_sglang.sim.cost_model import get_params, moe_layer_time, step_time


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", help="calibration traces (or a folder with calib/ and eval/)")
    ap.add_argument("--eval-traces", help="evaluation traces (default: eval/ beside calib/, else the calibration traces)")
    ap.add_argument("--artifact", help="calibration artifact (default: calibrate --traces here)")
    ap.add_argument("--servers", type=int, default=6, help="decode servers = clusters when calibrating here")
    ap.add_argument("--ep-size", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batches", type=int, default=100, help="sampled batches per decode server")
    ap.add_argument("--params", default="qwen3-235b-a22b-mi300x-tp4ep4", help="cost-model parameter set")
    ap.add_argument("--synthetic-requests", type=int, default=3000)
    ap.add_argument("--synthetic-layers", type=int, default=None, help="default: the cost model's MoE layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_placement.json", help="output JSON")
    return parse_with_quick(ap, argv, synthetic_requests=450, synthetic_layers=8, batches=10, servers=4,
                            json=quick_out("placement") / "bench_placement.json")


def synthetic(args: argparse.Namespace, work: Path, num_layers: int) -> tuple[TraceSet, TraceSet, Path]:
    """Synthetic calib/eval split (2:1) and an artifact from the project's calibration CLI code."""
    syn = make_synthetic_traces(n_requests=args.synthetic_requests, num_layers=num_layers, num_experts=128,
                                top_k=8, n_informative=max(2, num_layers // 8), include_gates=False,
                                model_name="synthetic-128x8", seed=args.seed)
    n_cal = 2 * len(syn.traces) // 3
    calib, evals = syn.traces.subset(slice(0, n_cal)), syn.traces.subset(slice(n_cal, None))
    write_traces(calib, work / "calib")
    artifact = work / "artifact.json"
    calibrate.main(["--traces", str(work / "calib"), "--clusters", str(args.servers), "--out", str(artifact),
                    "--max-layers", "6", "--pairs", "5000", "--n-init", "1", "--seed", str(args.seed)])
    return calib, evals, artifact


def batch_figures(p_tok: np.ndarray, p2l: np.ndarray, ep_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[B, L, E] per-token probabilities, [L, P] map -> per-rank distinct experts and loads, [L, G] each."""
    num_layers, num_physical = p2l.shape
    replicas = np.stack([np.bincount(row, minlength=p_tok.shape[2]) for row in p2l])  # [L, E]
    rows = np.arange(num_layers)[:, None]
    share = p_tok[:, rows, p2l] / replicas[rows, p2l]  # [B, L, P]
    distinct = 1.0 - np.exp(np.log1p(-np.clip(share, 0.0, 1.0 - 1e-12)).sum(axis=0))  # [L, P]
    load = share.sum(axis=0)
    per_rank = num_physical // ep_size
    return (distinct.reshape(num_layers, ep_size, per_rank).sum(-1),
            load.reshape(num_layers, ep_size, per_rank).sum(-1))


def main(argv=None) -> int:
    args = parse_args(argv)
    params = get_params(args.params)
    if args.ep_size != params.ep_size:
        sys.exit(f"--ep-size {args.ep_size} differs from {args.params}'s ep_size {params.ep_size}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.traces is None:
            source = "SYNTHETIC traces (make_synthetic_traces, 128 experts, top-8)"
            calib, evals, artifact_path = synthetic(args, Path(tmp), args.synthetic_layers or params.num_moe_layers)
        else:
            root = Path(args.traces)
            split = (root / "calib").is_dir()
            calib = load_traces(root / "calib" if split else root)
            eval_dir = args.eval_traces or (root / "eval" if split and (root / "eval").is_dir() else None)
            evals = load_traces(eval_dir) if eval_dir else calib
            source = f"traces {root}" + (f", eval {eval_dir}" if eval_dir else " (eval = calibration requests)")
            artifact_path = Path(args.artifact) if args.artifact else Path(tmp) / "artifact.json"
            if not args.artifact:
                calibrate.main(["--traces", str(root / "calib" if split else root), "--clusters", str(args.servers),
                                "--out", str(artifact_path), "--n-init", "1", "--seed", str(args.seed)])
        artifact = load_artifact(artifact_path)
    num_experts = calib.model.num_experts
    per_server, _ = plan_per_server(artifact, calib, args.ep_size, args.redundant, args.batch_size)
    placements = {
        "default": [np.tile(default_map(num_experts, args.ep_size, args.redundant), (calib.model.num_layers, 1))]
        * artifact.num_clusters,
        "global": [plan_global(calib, args.ep_size, args.redundant, args.batch_size).physical_to_logical]
        * artifact.num_clusters,
        "per-server": [p.physical_to_logical for p in per_server],
    }
    t_fit = time.perf_counter() - t0

    regions = assign_regions(artifact, evals)
    p_all = token_probabilities(evals)
    ctx = evals.prompt_tokens + evals.output_tokens // 2  # KV tokens at mid-generation
    rng = np.random.default_rng(args.seed)
    acc = {name: {"imbalance": [], "distinct_max": [], "moe_ms": [], "step_ms": []} for name in placements}
    for k in range(artifact.num_clusters):
        members = np.flatnonzero(regions == k)
        if len(members) == 0:
            continue
        for _ in range(args.batches):
            batch = rng.choice(members, size=args.batch_size, replace=len(members) < args.batch_size)
            p_tok = p_all[batch]
            context = int(ctx[batch].sum())
            for name, maps in placements.items():
                distinct, load = batch_figures(p_tok, maps[k], args.ep_size)
                a = acc[name]
                a["imbalance"].append(float((load.max(1) / load.mean(1)).mean()))
                a["distinct_max"].append(float(distinct.max(1).mean()))
                layer_t = np.atleast_1d(moe_layer_time(params, distinct, args.batch_size))
                a["moe_ms"].append(1e3 * float(layer_t.mean()) * params.num_moe_layers)
                a["step_ms"].append(1e3 * step_time(params, args.batch_size, context, distinct))
    rows = {name: {key: float(np.mean(v)) for key, v in a.items()} for name, a in acc.items()}
    base = rows["default"]["step_ms"]
    for r in rows.values():
        r["step_vs_default_pct"] = 100.0 * (r["step_ms"] / base - 1.0)
    gaps = [l.gap for p in per_server for l in p.layers]

    print(f"SIMULATED (cost model {args.params}); {source}")
    print(f"{artifact.num_clusters} decode servers, EP{args.ep_size}, {args.redundant} redundant slots, "
          f"batch {args.batch_size}, {args.batches} batches per server, {len(evals)} eval requests")
    print(f"\n{'placement':<11} {'load max/mean':>13} {'distinct (max rank)':>19} {'MoE ms/step':>11} "
          f"{'step ms':>8} {'vs default':>10}")
    for name, r in rows.items():
        print(f"{name:<11} {r['imbalance']:>13.4f} {r['distinct_max']:>19.2f} {r['moe_ms']:>11.3f} "
              f"{r['step_ms']:>8.3f} {r['step_vs_default_pct']:>+9.2f}%")
    print(f"\noptimiser gap to the lower bound (max rank load, calibration loads): mean {np.mean(gaps):.2e}, "
          f"max {np.max(gaps):.2e} over {len(gaps)} (server, layer) problems; fit time {t_fit:.1f} s")
    report = {"simulated": True, "source": source, "cost_model": args.params, "servers": artifact.num_clusters,
              "ep_size": args.ep_size, "redundant": args.redundant, "batch_size": args.batch_size,
              "batches_per_server": args.batches, "eval_requests": len(evals), "rows": rows,
              "gap_to_bound": {"mean": float(np.mean(gaps)), "max": float(np.max(gaps))}}
    write_record(args.json, report, argv, script=__file__)
    print(f"written {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
