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

import numpy as np

from benchmark.common import markdown_table, mean_sd, quick_out, write_record
from benchmark import measured
from eldr_sglang.sim import experiments
from eldr_sglang.sim.cost_model import (PAPER_EXPERT_RATIO, PARAM_SETS, get_params,
                                        moe_layer_time)

HERE = Path(__file__).resolve().parent

PAPER = {  # the paper's numbers (docs/PAPER.md); ranges over loads
    "task_eldr_vs_lb_median": (7.0, 13.9), "task_eldr_vs_lb_p99": (3.4, 6.0),
    "task_domain_vs_lb_median": (6.8, 9.7),
    "task_eldr_vs_domain_median": (1.4, 6.9), "task_eldr_vs_domain_p99": (1.6, 4.5),
    "language_eldr_vs_lb_median": (5.9, 10.0),
    "language_eldr_vs_domain_median": (5.7, 9.1), "language_eldr_vs_domain_p99": (7.0, 9.5),
    "tau01_median_gain": (5.2, 12.7),
    "pool_gain": {8: 8.0, 16: 9.8, 24: 10.2},
    "fewer_experts_task": (17.0, 21.0), "fewer_experts_language": (3.0, 10.0),
}
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


def aggregate(runs: list[dict], **where) -> dict | None:
    """Mean over seeds of the runs matching ``where``; ``<key>_sd``: the sd over seeds."""
    rows = [r for r in runs if all(r.get(k) == v for k, v in where.items())]
    if not rows:
        return None
    keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out = {k: float(np.mean([r[k] for r in rows])) for k in keys}
    out.update({f"{k}_sd": _sd([r[k] for r in rows]) for k in keys})
    out.update({k: rows[0][k] for k in ("workload", "policy", "experiment")})
    return out


def _sd(values) -> float:
    ok = [v for v in values if v is not None and np.isfinite(v)]
    return mean_sd(ok)[1] if ok else 0.0


def _mean(values) -> float:
    a = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    return float(a.mean()) if a.size else float("nan")


def seeds_of(runs: list[dict]) -> list[int]:
    return sorted({r.get("seed", 0) for r in runs})


# -- analysis -----------------------------------------------------------------------------------------------
def gain(base: float, new: float) -> float:
    """Percent reduction of ``new`` against ``base`` (positive = better)."""
    return 100.0 * (base - new) / base


def main_table(runs, workload, loads, policies) -> dict:
    return {(rate, p): aggregate(runs, experiment="load", workload=workload, rate=rate, policy=p)
            for rate in loads for p in policies}


def headline(runs, workload, loads) -> dict:
    """Per load: ELDR / Domain / oracle gains against the best load balancer and Domain,
    computed within each seed, then mean and ``<key>_sd`` over seeds."""
    per_seed = [_headline_one([r for r in runs if r.get("seed", 0) == s], workload, loads) for s in seeds_of(runs)]
    out = {}
    for rate in loads:
        rows = [h[rate] for h in per_seed if rate in h]
        if not rows:
            continue
        out[rate] = {k: _mean([r.get(k, np.nan) for r in rows]) for k in rows[0]}
        out[rate].update({f"{k}_sd": _sd([r.get(k, np.nan) for r in rows]) for k in rows[0]})
    return out


def _headline_one(runs, workload, loads) -> dict:
    table = main_table(runs, workload, loads, experiments.POLICIES)
    out = {}
    for rate in loads:
        lbs = [table[(rate, p)] for p in experiments.LOAD_BALANCERS if table.get((rate, p))]
        e, d, o = table.get((rate, "eldr")), table.get((rate, "domain")), table.get((rate, "oracle"))
        if not lbs or e is None:
            continue
        best_med = min(r["tpot_median_ms"] for r in lbs)
        best_p99 = min(r["tpot_p99_ms"] for r in lbs)
        rr = table[(rate, "round_robin")]
        row = {"eldr_vs_lb_median": gain(best_med, e["tpot_median_ms"]),
               "eldr_vs_lb_p99": gain(best_p99, e["tpot_p99_ms"]),
               "eldr_fewer_experts": gain(rr["unique_experts_per_step"], e["unique_experts_per_step"])}
        if d:
            row.update(domain_vs_lb_median=gain(best_med, d["tpot_median_ms"]),
                       domain_vs_lb_p99=gain(best_p99, d["tpot_p99_ms"]),
                       eldr_vs_domain_median=gain(d["tpot_median_ms"], e["tpot_median_ms"]),
                       eldr_vs_domain_p99=gain(d["tpot_p99_ms"], e["tpot_p99_ms"]),
                       domain_fewer_experts=gain(rr["unique_experts_per_step"], d["unique_experts_per_step"]))
        if o:
            reach = rr["unique_experts_per_step"] - o["unique_experts_per_step"]
            got = rr["unique_experts_per_step"] - e["unique_experts_per_step"]
            row.update(oracle_vs_lb_median=gain(best_med, o["tpot_median_ms"]),
                       oracle_fewer_experts=gain(rr["unique_experts_per_step"], o["unique_experts_per_step"]),
                       captured=100.0 * got / reach if reach > 1e-9 else float("nan"))
        out[rate] = row
    return out


def goodput_of(rows: list[dict], target_ms: float) -> tuple[float, str]:
    """Highest load whose P99 TPOT meets ``target_ms`` (linear between swept loads, at the
    first crossing); the flag is "" or ">=" (met at every swept load) or "<" (at none)."""
    rows = sorted(rows, key=lambda r: r["rate"])
    if not rows or rows[0]["tpot_p99_ms"] > target_ms:
        return (rows[0]["rate"] if rows else float("nan")), "<"
    for lo, hi in zip(rows, rows[1:]):
        if hi["tpot_p99_ms"] > target_ms:
            f = (target_ms - lo["tpot_p99_ms"]) / (hi["tpot_p99_ms"] - lo["tpot_p99_ms"])
            return lo["rate"] + f * (hi["rate"] - lo["rate"]), ""
    return rows[-1]["rate"], ">="


def goodput(runs, workload, policies, targets) -> dict:
    """{(policy, target): (mean, sd, flags)} over seeds, plus ("eldr_vs_best_lb", target) gains
    computed within each seed."""
    out = {}
    for t in targets:
        per = {p: [goodput_of([r for r in runs if r["experiment"] == "goodput" and r["workload"] == workload
                               and r["policy"] == p and r.get("seed", 0) == s], t) for s in seeds_of(runs)]
               for p in policies}
        for p, vals in per.items():
            out[(p, t)] = (float(np.mean([v for v, _ in vals])), _sd([v for v, _ in vals]),
                           "".join(sorted({f for _, f in vals})))
        lbs = [p for p in policies if p in experiments.LOAD_BALANCERS]
        if "eldr" in per and lbs:
            g = [gain(max(per[p][i][0] for p in lbs), per["eldr"][i][0]) * -1 for i in range(len(per["eldr"]))]
            out[("eldr_vs_best_lb", t)] = (float(np.mean(g)), _sd(g), "")
    return out


def microbench_shape(mb: dict, params_name: str) -> dict:
    """Linear fit of measured layer time vs distinct experts; model vs measured ratios."""
    from scipy.stats import linregress

    params = get_params(params_name)
    out = {}
    for batch in sorted({r["batch"] for r in mb["rows"]}):
        rows = [r for r in mb["rows"] if r["batch"] == batch]
        u = np.array([r["unique"] for r in rows], dtype=float)
        t = np.array([r["median_ms"] for r in rows])
        fit = linregress(u, t)
        frac = u / mb["experts"]  # compare at the same fraction of the expert pool
        model = moe_layer_time(params, frac * params.num_experts, batch) if params.ep_size == 1 else None
        out[batch] = {"unique": u.tolist(), "measured_ms": t.tolist(), "r2": fit.rvalue ** 2,
                      "intercept_ms": fit.intercept, "slope_ms": fit.slope,
                      "measured_ratio": t[-1] / t[1] if len(t) > 1 else float("nan"),
                      "model_ratio": (model[-1] / model[1]) if model is not None and len(t) > 1 else float("nan"),
                      "u_low": u[1] if len(u) > 1 else u[0], "u_high": u[-1]}
    return out


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


def pool_gain(runs, wl, k) -> float:
    rr = aggregate(runs, experiment="pool", workload=wl, num_decode=k, policy="round_robin")
    e = aggregate(runs, experiment="pool", workload=wl, num_decode=k, policy="eldr")
    return gain(rr["tpot_median_ms"], e["tpot_median_ms"]) if rr and e else float("nan")


# -- markdown -----------------------------------------------------------------------------------------------
def fmt_range(values) -> str:
    v = [x for x in values if np.isfinite(x)]
    return "n/a" if not v else (f"{min(v):.1f}" if len(v) == 1 else f"{min(v):.1f} to {max(v):.1f}")


def fmt_spread(head: dict, key: str, seeds: int) -> str:
    """Range over loads of the seed means, each with its sd over seeds."""
    vals = sorted((h[key], h.get(f"{key}_sd", 0.0)) for h in head.values() if np.isfinite(h.get(key, np.nan)))
    if not vals:
        return "n/a"
    one = (lambda v: f"{v[0]:.1f} ± {v[1]:.1f}") if seeds > 1 else (lambda v: f"{v[0]:.1f}")  # noqa: E731
    return one(vals[0]) if len(vals) == 1 else f"{one(vals[0])} to {one(vals[-1])}"


def pm(r: dict, key: str, fmt: str = ".2f") -> str:
    """``mean ± sd`` of an aggregated row (the sd only when there are several seeds)."""
    sd = r.get(f"{key}_sd", 0.0)
    return f"{r[key]:{fmt}}" + (f" ± {sd:{fmt}}" if sd else "")


def paper_range(key) -> str:
    lo, hi = PAPER[key]
    return f"{lo:g} to {hi:g}"


def render(args, sweep, runs, info, microbenches, plot_files, command) -> str:
    wls = args.workload_list
    L = []
    w = L.append
    w("# ELDR at paper scale: SIMULATED results\n")
    w("**Every TPOT, TTFT, distinct-expert and load figure below is SIMULATED** (discrete-event simulator "
      "`eldr_sglang/sim/simulator.py` + analytic step-time cost model `eldr_sglang/sim/cost_model.py`), "
      "not measured on a cluster. The measurements are the MoE-layer microbenchmark, on the hardware named "
      "in its table, and the sections marked MEASURED at the end (real traces, the trained model, real SGLang CPU "
      "servers). The routing decisions are made by the unchanged policy objects of "
      "`eldr_sglang.core.policies`. This file is generated; do not edit it by hand.\n")
    w("## Regenerate\n")
    w("```bash\n" + command + "\n```\n")
    w("(`--from-runs benchmark/results/runs.json` re-renders this file from the saved runs without simulating; "
      "the MEASURED sections are recomputed from `benchmark/traces/`, `models/eldr-tiny-moe/specialisation.json` "
      "and `benchmark/results/real_cpu.json`.)\n")
    w(f"Configuration: **{sweep.name}**" + (" (tiny CI configuration: NOT paper scale)" if args.quick else "") + ".\n")
    for mb in microbenches:
        if mb.get("command"):
            w("Microbenchmark: `" + mb["command"] + "`\n")
    w("## Setup\n")
    for name, src in info["workloads"].items():
        w(f"- workload **{name}**: {src}")
    if any("SYNTHETIC" in s for s in info["workloads"].values()):
        w("- **Synthetic traces were used** (measured traces missing under `--traces-root`): the gains below "
          "reflect the synthetic generator's planted structure, not a real model's expert routing.")
    b = info["base_config"]
    p = get_params(args.cost)
    w(f"- cost model `{p.name}`: {p.num_moe_layers} MoE layers, {p.num_experts} experts, top-{p.top_k}, "
      f"{p.bytes_per_expert / 1e6:.2f} MB per expert per GPU, {p.mem_bandwidth / 1e12:.2f} TB/s effective, "
      f"TP{p.tp_size} x EP{p.ep_size}; MoE layer 128 vs 16 experts = "
      f"{moe_layer_time(p, 128, 32) / moe_layer_time(p, 16, 32) if p.ep_size == 1 else float('nan'):.2f}x (paper {PAPER_EXPERT_RATIO}x)")
    w(f"- cluster: {b['num_prefill']} prefill servers, decode pool {sweep.main_decode} (scaling: "
      f"{', '.join(map(str, sweep.pools))}), {b['arrival']} arrivals, warm-up {b['warmup_s']:g} s, "
      f"measured window {b['measure_s']:g} s, max batch {b['max_batch']}, KV capacity {b['kv_capacity_tokens']} "
      f"tokens, prefill {b['prefill_fixed_s'] * 1e3:g} ms + {b['prefill_s_per_token'] * 1e6:g} us/token, "
      f"KV transfer {b['kv_transfer_s'] * 1e3:g} ms, seeds {list(sweep.seeds)}")
    w(f"- lengths: prompt/output rescaled to means {args.mean_prompt_tokens:g}/{args.mean_output_tokens:g} "
      "tokens (0 = the traces' own), keeping each trace's relative length")
    w("- per-step expert sets (not stored in these traces) are compressed to per-request per-step probabilities "
      "p = decode_counts / decode steps; a batch's distinct experts per layer is the **expected union under "
      "independence**, sum_e (1 - prod_r (1 - p_re)); that approximation is measured against recorded "
      "per-step sets of 300-step decodes in `benchmark/results/long_decodes.md` "
      "(`python -m benchmark.bench_long_decodes`)")
    w(f"- spread: every figure is the mean over {len(sweep.seeds)} seed(s); each seed draws its own arrivals AND "
      "its own calibration (K-means seed); `±` is the sd over seeds, gains are computed within a seed")
    w("- trace layers -> target layers: each trace layer's distinct-expert **fraction** of its pool is applied "
      "to the target's expert count, and the mean over trace layers stands for every MoE layer of the target")
    w("- ELDR: `python -m eldr_sglang.calibrate` on the calibration split (K = decode servers), evaluation on "
      "the evaluation split; selected layers: " + "; ".join(f"{k}: {v}" for k, v in info["layers"].items()))
    w("- oracle grouping (reference): balanced K-means on IDF-weighted DECODE counts, requests routed by their "
      "actual decode signature with the same band rule; Domain: labels own equal shares of the servers")
    w(f"- prefix caching: {sweep.prefix_fraction:.0%} of each prompt cached (prefill time reduced by that share); "
      "signatures unchanged (the radix signature cache keeps them exact)\n")

    w("## Paper vs simulation (headline)\n")
    heads = {wl: headline(runs, wl, sweep.loads) for wl in wls}
    nseeds = len(seeds_of(runs))
    col = lambda wl, key: fmt_spread(heads[wl], key, nseeds)  # noqa: E731
    claims = []
    if "task" in wls:
        claims += [
            ["task: ELDR median TPOT better than best load balancer (%)", paper_range("task_eldr_vs_lb_median"),
             col("task", "eldr_vs_lb_median")],
            ["task: ELDR P99 TPOT better than best load balancer (%)", paper_range("task_eldr_vs_lb_p99"),
             col("task", "eldr_vs_lb_p99")],
            ["task: Domain median better than best load balancer (%)", paper_range("task_domain_vs_lb_median"),
             col("task", "domain_vs_lb_median")],
            ["task: ELDR median better than Domain (%)", paper_range("task_eldr_vs_domain_median"),
             col("task", "eldr_vs_domain_median")],
            ["task: ELDR P99 better than Domain (%)", paper_range("task_eldr_vs_domain_p99"),
             col("task", "eldr_vs_domain_p99")],
            ["task: fewer distinct experts, grouped vs mixed (%)",
             f"{paper_range('fewer_experts_task')} (same-task batches)",
             f"ELDR {col('task', 'eldr_fewer_experts')}, Domain {col('task', 'domain_fewer_experts')} vs round robin"]]
    if "language" in wls:
        claims += [
            ["language: ELDR median better than best load balancer (%)", paper_range("language_eldr_vs_lb_median"),
             col("language", "eldr_vs_lb_median")],
            ["language: ELDR P99 TPOT better than best load balancer (%)", "(not in paper)",
             col("language", "eldr_vs_lb_p99")],
            ["language: ELDR median better than Domain (%)", paper_range("language_eldr_vs_domain_median"),
             col("language", "eldr_vs_domain_median")],
            ["language: ELDR P99 better than Domain (%)", paper_range("language_eldr_vs_domain_p99"),
             col("language", "eldr_vs_domain_p99")],
            ["language: fewer distinct experts, grouped vs mixed (%)",
             f"{paper_range('fewer_experts_language')} (same-language batches)",
             f"ELDR {col('language', 'eldr_fewer_experts')}, Domain {col('language', 'domain_fewer_experts')} "
             "vs round robin"]]
    for wl in wls:
        claims.append([f"{wl}: share of the oracle grouping's expert reduction that ELDR captures (%)",
                       "(not in paper)", col(wl, "captured")])
    goods = {wl: goodput(runs, wl, sweep.goodput_policies, sweep.goodput_targets_ms) for wl in wls}
    for t in sweep.goodput_targets_ms:
        cells = []
        for wl in wls:
            m, sd, _ = goods[wl].get(("eldr_vs_best_lb", t), (float("nan"), 0.0, ""))
            cells.append(f"{wl} {m:.1f}" + (f" ± {sd:.1f}" if nseeds > 1 else ""))
        claims.append([f"goodput (highest req/s with P99 TPOT <= {t:g} ms): ELDR vs best load balancer (%)",
                       "(not in paper)", ", ".join(cells)])
    for k in sweep.pools:
        claims.append([f"median TPOT gain over round robin, {k} decode servers (%)", PAPER["pool_gain"].get(k, "n/a"),
                       ", ".join(f"{wl} {pool_gain(runs, wl, k):.1f}" for wl in wls)])
    w(markdown_table(["claim", "paper", "simulated (over loads; mean ± sd over seeds)"], claims))
    w("")

    default_json = args.out_dir / "results" / "default_policy.json"
    if default_json.is_file():
        from benchmark import bench_default_policy

        doc = json.loads(default_json.read_text())
        doc["decision"] = bench_default_policy.decide(doc["runs"], doc["grid"], doc["grid"]["workloads"])
        w("## The router's default policy: eldr_balanced (simulated)\n")
        w("`eldr_balanced` (`eldr_sglang/core/policies/eldr_balanced.py`) as it was until the locality pick below "
          "became its default (`--policy-param sim_band=none --policy-param load_cap=none`): it prices each decode "
          "server's live batch with the step-time law (state-aware cost), and among the servers within 2% of the "
          "cheapest takes the one whose calibration region is most similar to the request. Judged against the "
          "balancers, ELDR's band rule, "
          "Domain and the oracle grouping by a fixed decision rule; every check and table in "
          "[results/default_policy.md](results/default_policy.md) "
          f"(`{doc['command']}`; 8/16/24 decode servers, 5 seeds, both workloads):\n")
        for line in bench_default_policy.headline_lines(doc):
            w(line)
        w("")
    locality_md = args.out_dir / "results" / "locality.md"
    if locality_md.is_file():  # benchmark/bench_locality.py: the default's locality pick against the rule above
        w(locality_md.read_text())

    w("## TPOT vs load (simulated)\n")
    for wl in wls:
        w(f"### {wl} workload, {b['num_prefill']}P{sweep.main_decode}D\n")
        w(markdown_table(
            ["req/s", "policy", "median TPOT ms", "P99 TPOT ms", "median TTFT ms", "P99 TTFT ms",
             "distinct experts/step/layer", "mean batch", "load CV", "max/mean load", "tokens/s"],
            [[f"{rate:g}", pol, pm(r, "tpot_median_ms"), pm(r, "tpot_p99_ms"), f"{r['ttft_median_ms']:.1f}",
              f"{r['ttft_p99_ms']:.1f}", f"{r['unique_experts_per_step']:.1f}", f"{r['mean_batch']:.1f}",
              f"{r['load_cv']:.3f}", f"{r['load_max_over_mean']:.2f}", f"{r['throughput_tokens_s']:.0f}"]
             for (rate, pol), r in main_table(runs, wl, sweep.loads, sweep.policies).items()]))
        w("")
        rows = []
        for rate, h in heads[wl].items():
            g = lambda k: f"{h.get(k, float('nan')):.1f}" + (f" ± {h.get(k + '_sd', 0.0):.1f}" if nseeds > 1 else "")  # noqa: E731
            rows.append([f"{rate:g}", g("eldr_vs_lb_median"), g("eldr_vs_lb_p99"), g("eldr_vs_domain_median"),
                         g("eldr_vs_domain_p99"), g("oracle_vs_lb_median"), g("captured")])
        w(markdown_table(["req/s", "ELDR vs best LB median %", "ELDR vs best LB P99 %", "ELDR vs Domain median %",
                          "ELDR vs Domain P99 %", "oracle vs best LB median %", "expert reduction captured %"], rows))
        w("")
    w("![TPOT vs load](results/tpot_vs_load.png)\n")
    w("![distinct experts](results/unique_experts.png)\n")
    if sweep.goodput_rates:
        render_goodput(w, runs, sweep, wls, goods, nseeds)

    w(f"## tau sweep (ELDR, {sweep.tau_rate:g} req/s, {sweep.main_decode} decode; simulated)\n")
    rows = []
    for wl in wls:
        for t in sweep.taus:
            r = aggregate(runs, experiment="tau", workload=wl, tau=t)
            rows.append([wl, f"{t:g}", f"{r['tpot_median_ms']:.2f}", f"{r['tpot_p99_ms']:.2f}",
                         f"{r['unique_experts_per_step']:.1f}", f"{r['load_cv']:.3f}"])
    w(markdown_table(["workload", "tau", "median TPOT ms", "P99 TPOT ms", "distinct experts/step/layer", "load CV"],
                     rows))
    w("\n![tau sweep](results/tau_sweep.png)\n")

    w(f"## Decode-pool scaling ({sweep.pool_rate_per_server:g} req/s per decode server; simulated)\n")
    rows = []
    for wl in wls:
        for k in sweep.pools:
            rr = aggregate(runs, experiment="pool", workload=wl, num_decode=k, policy="round_robin")
            e = aggregate(runs, experiment="pool", workload=wl, num_decode=k, policy="eldr")
            rows.append([wl, k, f"{rr['rate']:g}", f"{rr['tpot_median_ms']:.2f}", f"{e['tpot_median_ms']:.2f}",
                         f"{pool_gain(runs, wl, k):.1f}", PAPER["pool_gain"].get(k, "n/a")])
    w(markdown_table(["workload", "decode servers", "req/s", "RR median ms", "ELDR median ms", "gain %",
                      "paper gain %"], rows))
    w("\n![pool scaling](results/pool_scaling.png)\n")

    w(f"## Prefix caching ({sweep.prefix_rate:g} req/s; simulated)\n")
    rows = []
    for wl in wls:
        for frac in (0.0, sweep.prefix_fraction):
            rr = aggregate(runs, experiment="prefix", workload=wl, prefix_cached_fraction=frac, policy="round_robin")
            for pol in sweep.prefix_policies:
                r = aggregate(runs, experiment="prefix", workload=wl, prefix_cached_fraction=frac, policy=pol)
                g = f"{gain(rr['tpot_median_ms'], r['tpot_median_ms']):.1f}" if pol == "eldr" else ""
                rows.append([wl, f"{frac:.0%}", pol, f"{r['tpot_median_ms']:.2f}", f"{r['tpot_p99_ms']:.2f}",
                             f"{r['ttft_median_ms']:.1f}", g])
    w(markdown_table(["workload", "cached share", "policy", "median TPOT ms", "P99 TPOT ms", "median TTFT ms",
                      "ELDR median gain vs round robin %"], rows))
    w("")

    w("## MoE-layer microbenchmark (MEASURED) vs the cost model's shape\n")
    for mb in microbenches:
        shape = microbench_shape(mb, args.cost)
        w(f"{mb['device']} ({mb['device_name']}, {mb['threads']} thread(s), {mb['dtype']}, hidden {mb['hidden']}, "
          f"ffn {mb['ffn']}, {mb['experts']} experts, top-{mb['top_k']}, torch {mb['torch']}; "
          f"timing: {mb.get('timing', 'wall clock per call')}):\n")
        if mb.get("command"):
            w(f"`{mb['command']}`\n")
        w(markdown_table(["batch", "distinct experts", "median ms"],
                         [[r["batch"], r["unique"], f"{r['median_ms']:.3f}"] for r in mb["rows"]]))
        w("")
        rows = []
        for batch, s in shape.items():
            gbs = 3 * mb["bytes_per_expert"] / (s["slope_ms"] * 1e-3) / 1e9 if s["slope_ms"] > 0 else float("nan")
            rows.append([batch, f"{s['r2']:.3f}", f"{s['intercept_ms']:.3f}", f"{s['slope_ms']:.4f}", f"{gbs:.0f}",
                         f"{s['measured_ratio']:.2f} ({s['u_high']:g} vs {s['u_low']:g})", f"{s['model_ratio']:.2f}"])
        w(markdown_table(["batch", "linear fit R^2", "intercept ms", "ms per expert", "implied GB/s (3 passes)",
                          "measured ratio", "cost-model ratio (same expert fractions)"], rows))
        w("")
    if microbenches:
        w("Each extra distinct expert costs the slope: this layer passes over an expert's weights 3 times "
          "(gather read and write, matmul read; a fused MoE kernel reads them once), hence the implied "
          "bandwidth. The cost model's anchors come from the paper's 16 -> 128 ratio, not from these runs.\n")
    if not microbenches:
        w("(not run: --skip-microbench)\n")

    sp = info.get("speed")
    if sp:
        w("## Simulator speed\n")
        w(f"{sp['num_decode']} decode servers x {sp['rate']:g} req/s x {sp['seconds']:g} s simulated "
          f"({sp['requests']} requests, {sp['steps']} measured decode steps, policy {sp['policy']}): "
          f"**{sp['wall_s']:.1f} s** wall on this machine.\n")
    return "\n".join(L) + "\n"


def render_goodput(w, runs, sweep, wls, goods, nseeds) -> None:
    warm, window = sweep.goodput_window
    w("## Goodput up to saturation (simulated)\n")
    w(f"{sweep.main_decode} decode servers, {sweep.goodput_prefill} prefill servers (enough that prefill is never "
      f"the bottleneck), loads {', '.join(f'{r:g}' for r in sweep.goodput_rates)} req/s, warm-up {warm:g} s, "
      f"measured {window:g} s, max batch {sweep.base.max_batch}. Goodput = the highest load whose P99 TPOT meets "
      "the target (linear between swept loads, at the first crossing); `>=` = met at every swept load, "
      "`<` = at none. TPOT includes waiting for a decode batch slot, so a saturated server shows in it.\n")
    rows = []
    for wl in wls:
        for p in sweep.goodput_policies:
            cells = []
            for t in sweep.goodput_targets_ms:
                m, sd, flag = goods[wl][(p, t)]
                cells.append(f"{flag}{m:.0f}" + (f" ± {sd:.0f}" if nseeds > 1 else ""))
            rows.append([wl, p, *cells])
    w(markdown_table(["workload", "policy", *(f"goodput req/s, P99 TPOT <= {t:g} ms" for t in sweep.goodput_targets_ms)],
                     rows))
    w("")
    rows = []
    for wl in wls:
        for rate in sweep.goodput_rates:
            for p in sweep.goodput_policies:
                r = aggregate(runs, experiment="goodput", workload=wl, rate=rate, policy=p)
                if r:
                    rows.append([wl, f"{rate:g}", p, pm(r, "tpot_median_ms"), pm(r, "tpot_p99_ms"),
                                 f"{r['ttft_p99_ms']:.1f}", f"{r['mean_batch']:.1f}", f"{r['load_max_over_mean']:.2f}"])
    w(markdown_table(["workload", "req/s", "policy", "median TPOT ms", "P99 TPOT ms", "P99 TTFT ms", "mean batch",
                      "max/mean load"], rows))
    w("")


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
