"""Regenerate benchmark/RESULTS.md and its plots: SIMULATED paper-scale evaluation.

    python -m benchmark.report            # full configuration (8P16D, 20-100 req/s, 20 s + 60 s, goodput to 600 req/s)
    python -m benchmark.report --quick    # tiny configuration (seconds; outputs under .cache/bench-quick/report)

Runs the MoE-layer microbenchmark (measured, on this machine's CPU), the sweeps of
``eldr_sglang/sim/experiments.py`` on the discrete-event simulator (simulated), and writes
``RESULTS.md``, ``results/*.png`` and ``results/*.json`` under ``--out-dir``.
Nothing in RESULTS.md is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Sequence

from benchmark import measured
from benchmark.common import quick_out, write_record
from benchmark.render import PAPER, aggregate, pool_gain, render, seeds_of
from eldr_sglang.sim import experiments
from eldr_sglang.sim.cost_model import PARAM_SETS

HERE = Path(__file__).resolve().parent

POLICY_STYLE = {"random": ":", "round_robin": "--", "jsq": "-.", "p2c": ":", "domain": "-", "eldr": "-",
                "oracle": "--"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmark.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny configuration (seconds)")
    ap.add_argument("--traces-root", type=Path, default=HERE / "traces",
                    help="holds <workload>/{calib,eval}/ trace sets; synthetic traces when missing")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="RESULTS.md goes here, plots and JSON in results/ (default: benchmark/; --quick: .cache/)")
    ap.add_argument("--work-dir", type=Path, default=None, help="artifacts and synthetic trace shards (default: temp)")
    ap.add_argument("--cost", default="qwen3-30b-a3b-mi300x", help=f"cost-model parameter set: {', '.join(PARAM_SETS)}")
    ap.add_argument("--mean-prompt-tokens", type=float, default=600.0,
                    help="rescale prompt lengths to this mean (0: the traces' own)")
    ap.add_argument("--mean-output-tokens", type=float, default=300.0,
                    help="rescale output lengths to this mean (0: the traces' own)")
    ap.add_argument("--seeds", type=int, default=None,
                    help="seeds per run: arrivals and calibration (results: mean and sd over seeds; "
                         "default 5, with --quick 1)")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="simulation processes")
    ap.add_argument("--workloads", default="task,language", help="comma-separated subset of task,language")
    ap.add_argument("--microbench-json", type=Path, nargs="*", default=[],
                    help="extra microbench JSON files to include (e.g. from a GPU run)")
    ap.add_argument("--skip-microbench", action="store_true", help="do not run the CPU microbenchmark")
    ap.add_argument("--from-runs", type=Path, default=None,
                    help="re-render from a saved results/runs.json (no simulation; same --quick as that run)")
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cost not in PARAM_SETS:
        ap.error(f"--cost {args.cost!r} unknown; valid: {', '.join(PARAM_SETS)}")
    if args.mean_prompt_tokens < 0 or args.mean_output_tokens < 0:
        ap.error("--mean-prompt-tokens and --mean-output-tokens must be >= 0")
    if args.out_dir is None:  # a --quick run never writes over the committed RESULTS.md
        args.out_dir = quick_out("report") if args.quick else HERE
    if args.seeds is None:
        args.seeds = 1 if args.quick else 5
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    wl = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in wl if w not in experiments.WORKLOADS]
    if not wl or bad:
        ap.error(f"--workloads {args.workloads!r}: choose from {', '.join(experiments.WORKLOADS)}")
    args.workload_list = wl
    for path in args.microbench_json:
        if not path.is_file():
            ap.error(f"--microbench-json {path}: no such file")
    if args.traces_root.exists() and not args.traces_root.is_dir():
        ap.error(f"--traces-root {args.traces_root} is not a directory")
    if args.from_runs is not None and not args.from_runs.is_file():
        ap.error(f"--from-runs {args.from_runs}: no such file")
    return args


# -- running ------------------------------------------------------------------------------------------------
def run_microbench(quick: bool, out: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmark.microbench_moe_layer", "--device", "cpu", "--threads", "1",
           "--json", str(out.resolve())]
    cmd += (["--hidden", "128", "--ffn", "64", "--experts", "32", "--top-k", "4", "--unique", "4,8,16,32",
             "--repeats", "3"] if quick else
            ["--hidden", "512", "--ffn", "256", "--unique", "8,16,32,64,96,128", "--repeats", "10"])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=HERE.parent)
    data = json.loads(out.read_text())
    data["command"] = "python " + " ".join(shlex.quote(c) for c in cmd[1:]).replace(str(HERE.parent) + "/", "")
    return data


def run_sweeps(args: argparse.Namespace, sweep: experiments.SweepConfig, work_dir: Path) -> tuple[list[dict], dict]:
    """Every run of the sweep, each seed with its own arrivals AND its own calibration
    (K-means seed), in ``--jobs`` processes."""
    sweep = replace(sweep, base=replace(sweep.base, cost=args.cost), seeds=tuple(range(args.seeds)))
    mp = args.mean_prompt_tokens or None
    mo = args.mean_output_tokens or None
    info = {"workloads": {}, "layers": {}}
    plan = experiments.plan(sweep)
    data = {name: experiments.load_workload(name, args.traces_root, work_dir, sweep, mp, mo) for name in args.workload_list}
    for name, d in data.items():
        info["workloads"][name] = d.source
    k_speed = sweep.speed_check[0]
    pools = sorted({c.num_decode for _, _, c, _ in plan} | {k_speed})
    experiments.POOL_STATE.update(data=data, work_dir=work_dir, sweep=sweep, routing={})
    calib = [(name, k, seed) for name in data for k in pools for seed in sweep.seeds]
    for (name, k, seed), routing in experiments.pool_map(experiments.calibrate_task, calib, args.jobs, "calibrate (workload, K, seed)"):
        experiments.POOL_STATE["routing"][(name, seed, k)] = routing
        if seed == 0:
            info["layers"][f"{name} K={k}"] = routing.layers
        else:
            info.setdefault("layers_other_seeds", {})[f"{name} K={k} seed={seed}"] = routing.layers
    tasks = [(name, exp, policy, cfg, tau) for name in data for exp, policy, cfg, tau in plan]
    runs = experiments.pool_map(experiments.simulate_task, tasks, args.jobs, "simulate")
    name = args.workload_list[0]
    k, rate, secs = sweep.speed_check
    cfg = replace(sweep.base, num_decode=k, rate=rate, warmup_s=min(30.0, secs / 5), measure_s=secs - min(30.0, secs / 5))
    t0 = time.perf_counter()
    row = experiments.run_one(data[name], experiments.POOL_STATE["routing"][(name, 0, k)], "eldr", cfg, sweep.default_tau)
    info["speed"] = {"num_decode": k, "rate": rate, "seconds": secs, "requests": row["requests"],
                     "steps": row["steps"], "wall_s": time.perf_counter() - t0, "policy": "eldr"}
    experiments.POOL_STATE.clear()
    info["sweep"] = {k: v for k, v in asdict(sweep).items() if k != "base"}
    info["base_config"] = asdict(sweep.base)
    return runs, info


# -- plots --------------------------------------------------------------------------------------------------
def plots(runs, sweep, workloads, res_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 8), squeeze=False)
    for j, wl in enumerate(workloads):
        for i, (metric, title) in enumerate((("tpot_median_ms", "median TPOT"), ("tpot_p99_ms", "P99 TPOT"))):
            ax = axes[i][j]
            for p in sweep.policies:
                ys = [aggregate(runs, experiment="load", workload=wl, rate=r, policy=p) for r in sweep.loads]
                ax.plot(sweep.loads, [y[metric] for y in ys], POLICY_STYLE.get(p, "-"), marker="o", label=p,
                        linewidth=2.4 if p == "eldr" else 1.4)
            ax.set_title(f"{wl}: {title} (simulated, {sweep.main_decode} decode)")
            ax.set_xlabel("load (req/s)")
            ax.set_ylabel("ms")
            ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(_save(fig, res_dir / "tpot_vs_load.png"))

    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for j, wl in enumerate(workloads):
        ax = axes[0][j]
        for p in sweep.policies:
            ys = [aggregate(runs, experiment="load", workload=wl, rate=r, policy=p) for r in sweep.loads]
            ax.plot(sweep.loads, [y["unique_experts_per_step"] for y in ys], POLICY_STYLE.get(p, "-"),
                    marker="o", label=p)
        ax.set_title(f"{wl}: distinct experts per step per layer (simulated)")
        ax.set_xlabel("load (req/s)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(_save(fig, res_dir / "unique_experts.png"))

    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for j, wl in enumerate(workloads):
        ax = axes[0][j]
        ys = [aggregate(runs, experiment="tau", workload=wl, tau=t) for t in sweep.taus]
        ax.plot(sweep.taus, [y["tpot_median_ms"] for y in ys], "-o", label="median TPOT")
        ax.plot(sweep.taus, [y["tpot_p99_ms"] for y in ys], "--o", label="P99 TPOT")
        ax.set_xscale("symlog", linthresh=0.05)
        ax.set_title(f"{wl}: ELDR tau sweep at {sweep.tau_rate:g} req/s (simulated)")
        ax.set_xlabel("tau")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(_save(fig, res_dir / "tau_sweep.png"))

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for wl in workloads:
        ax.plot(sweep.pools, [pool_gain(runs, wl, k) for k in sweep.pools], "-o", label=f"{wl} (simulated)")
    paper = PAPER["pool_gain"]
    ax.plot(list(paper), list(paper.values()), "k:s", label="paper")
    ax.set_xlabel("decode servers")
    ax.set_ylabel("median TPOT gain over round robin (%)")
    ax.set_title("decode-pool scaling")
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(_save(fig, res_dir / "pool_scaling.png"))
    return files


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


# -- markdown -----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sweep = experiments.QUICK if args.quick else experiments.FULL
    res_dir = args.out_dir / "results"
    res_dir.mkdir(parents=True, exist_ok=True)
    work_ctx = tempfile.TemporaryDirectory(prefix="eldr-report-") if args.work_dir is None else None
    work_dir = Path(work_ctx.name) if work_ctx else args.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    command = (".venv/bin/python -m benchmark.report "
               + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))).strip()
    try:
        if args.from_runs is not None:
            saved = json.loads(args.from_runs.read_text())
            runs, info, command = saved["runs"], saved["info"], saved.get("command", command)
            mb_file = res_dir / "microbench_cpu.json"
            microbenches = [json.loads(mb_file.read_text())] if mb_file.is_file() and not args.skip_microbench else []
        else:
            microbenches = [] if args.skip_microbench else [run_microbench(args.quick, res_dir / "microbench_cpu.json")]
            runs, info = run_sweeps(args, sweep, work_dir)
        microbenches += [json.loads(p.read_text()) for p in args.microbench_json]
    except ValueError as exc:
        build_parser().error(str(exc))
    finally:
        if work_ctx:
            work_ctx.cleanup()
    used = replace(sweep, seeds=tuple(seeds_of(runs)))
    if args.from_runs is None:
        write_record(res_dir / "runs.json", {"simulated": True, "command": command, "info": info, "runs": runs})
    files = plots(runs, used, args.workload_list, res_dir)
    text = render(args, used, runs, info, microbenches, files, command)
    text += measured.render(args.traces_root, args.workload_list, args.out_dir / "results")
    (args.out_dir / "RESULTS.md").write_text(text)
    print(f"wrote {args.out_dir / 'RESULTS.md'} and {', '.join(files)} in {res_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
