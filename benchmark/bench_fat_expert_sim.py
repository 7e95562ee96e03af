"""The headline comparison under a cost law measured on a real SGLang server. SIMULATED.

    .venv/bin/python -m benchmark.bench_fat_expert_sim --seeds 3 --json benchmark/results/fat_expert_sim.json
    .venv/bin/python -m benchmark.bench_fat_expert_sim --quick   # smoke run (seconds; outputs under .cache/)

The simulator (8 prefill + 16 decode servers, measured traces of the tiny trained MoE,
lengths 600 / 300 as ``report.py``) runs round robin, JSQ, ``eldr`` and the default
``eldr_balanced`` under two step-time laws:

* ``qwen3-30b-a3b-mi300x``: the paper-anchored set of the headline (analytic);
* ``real-cpu-server``: fixed + per-sequence + per-distinct-expert terms fitted to
  ``benchmark/bench_fat_expert.py`` (one real SGLang CPU server on the fat-expert model).

A CPU step is ~10^3 times slower than a GPU one, so the CPU law's arrival rates and
time windows are the paper set's scaled by the ratio of the two laws' step times at
batch 32 with half the experts active: each decode server sees the same batch sizes,
and the gain is driven by the measured law alone. Prefill and KV transfer keep the
simulator's GPU-scale defaults (they shape TTFT, not TPOT).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmark.common import fmt_mean_sd, markdown_table, parse_with_quick, quick_out, write_record
from benchmark.bench_default_policy import candidate_policy
from eldr_sglang.core.policies import make_policy
from eldr_sglang.sim import experiments
from eldr_sglang.sim.cost_model import get_params, step_time
from eldr_sglang.sim.simulator import SimConfig, simulate

HERE = Path(__file__).resolve().parent
COSTS = ("qwen3-30b-a3b-mi300x", "real-cpu-server")
POLICIES = ("round_robin", "jsq", "eldr", "eldr_balanced")
BALANCERS = ("round_robin", "jsq")


def time_scale(cost: str, reference: str = COSTS[0], batch: int = 32) -> float:
    """``cost``'s step time over ``reference``'s at ``batch`` sequences, half the experts active."""
    def t(name: str) -> float:
        p = get_params(name)
        return step_time(p, batch, batch * 750, 0.5 * p.num_experts)
    return t(cost) / t(reference)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_fat_expert_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rates", default="40,80", help="paper-set arrival rates (req/s); the CPU law's are scaled")
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--warmup-s", type=float, default=10.0, help="paper-set time window (scaled for the CPU law)")
    ap.add_argument("--measure-s", type=float, default=30.0, help="paper-set time window (scaled for the CPU law)")
    ap.add_argument("--workloads", default="task,language")
    ap.add_argument("--json", type=Path, default=None)
    a = parse_with_quick(ap, argv, seeds=1, rates="40", decodes=4, warmup_s=1.0, measure_s=2.0, workloads="task",
                         json=quick_out("fat_expert_sim") / "fat_expert_sim.json")
    try:
        a.rate_list = [float(x) for x in a.rates.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--rates: expected comma-separated numbers, got {a.rates!r}")
    a.workload_list = [w.strip() for w in a.workloads.split(",") if w.strip()]
    if not a.rate_list or min(a.rate_list) <= 0:
        ap.error("--rates must be positive numbers")
    if any(w not in experiments.WORKLOADS for w in a.workload_list) or not a.workload_list:
        ap.error(f"--workloads: choose from {', '.join(experiments.WORKLOADS)}")
    if a.seeds < 1 or a.decodes < 2:
        ap.error("--seeds must be >= 1 and --decodes >= 2")
    return a


def run(a: argparse.Namespace) -> list[dict]:
    sweep = experiments.QUICK if a.quick else experiments.FULL
    work = quick_out("fat_expert_sim") / "work" if a.quick else HERE.parent / ".cache" / "bench-fat-expert-sim"
    rows = []
    for wl in a.workload_list:
        data = experiments.load_workload(wl, HERE / "traces", work, sweep, 600.0, 300.0)
        for seed in range(a.seeds):
            routing = experiments.prepare_routing(data, a.decodes, work, sweep, seed=seed)
            for cost in COSTS:
                scale = time_scale(cost)
                for rate in a.rate_list:
                    cfg = SimConfig(num_prefill=8, num_decode=a.decodes, rate=rate / scale, seed=seed, cost=cost,
                                    warmup_s=a.warmup_s * scale, measure_s=a.measure_s * scale)
                    for policy in POLICIES:
                        if policy == "eldr_balanced":
                            pol = candidate_policy(a.decodes, routing, data, cost)
                        else:
                            pol = make_policy(policy, a.decodes, centroids=routing.eldr_centroids, tau=0.1, seed=seed)
                        s = simulate(data.sim, pol, cfg, routing.eldr_signatures).summary
                        rows.append({"workload": wl, "seed": seed, "cost": cost, "paper_rate": rate,
                                     "rate": rate / scale, "policy": policy, **s})
                print(f"{wl} seed {seed} {cost} done", flush=True)
    return rows


def gains(rows: list[dict]) -> list[dict]:
    """Per (workload, cost, rate, seed): each ELDR policy's TPOT gain over the best balancer of that seed."""
    out = []
    keys = sorted({(r["workload"], r["cost"], r["paper_rate"], r["seed"]) for r in rows})
    for wl, cost, rate, seed in keys:
        sel = {r["policy"]: r for r in rows if (r["workload"], r["cost"], r["paper_rate"], r["seed"]) == (wl, cost, rate, seed)}
        for q in ("median", "p99"):
            best = min(sel[b][f"tpot_{q}_ms"] for b in BALANCERS)
            for pol in ("eldr", "eldr_balanced"):
                out.append({"workload": wl, "cost": cost, "paper_rate": rate, "seed": seed, "quantile": q,
                            "policy": pol, "gain_pct": 100.0 * (1 - sel[pol][f"tpot_{q}_ms"] / best)})
    return out


def render(rows: list[dict], g: list[dict], command: str, seeds: int) -> str:
    lines = [f"# ELDR's TPOT gain under a measured vs a paper-anchored step-time law (SIMULATED; "
             f"mean ± sd over {seeds} seeds)", "", f"Command: `{command}`", ""]
    table = []
    for wl, cost, rate in sorted({(r["workload"], r["cost"], r["paper_rate"]) for r in rows}):
        sel = [r for r in rows if (r["workload"], r["cost"], r["paper_rate"]) == (wl, cost, rate)]

        def cell(pol: str, q: str) -> str:
            v = [x["gain_pct"] for x in g if (x["workload"], x["cost"], x["paper_rate"], x["policy"], x["quantile"])
                 == (wl, cost, rate, pol, q)]
            return fmt_mean_sd(v)
        rr = [r for r in sel if r["policy"] == "round_robin"]
        table.append([wl, cost, f"{sel[0]['rate']:.3g}", f"{np.mean([r['tpot_median_ms'] for r in rr]):.4g}",
                      f"{np.mean([r['mean_batch'] for r in rr]):.1f}" if "mean_batch" in rr[0] else "-",
                      cell("eldr", "median"), cell("eldr", "p99"),
                      cell("eldr_balanced", "median"), cell("eldr_balanced", "p99")])
    lines.append(markdown_table(["workload", "step-time law", "req/s", "round robin median TPOT (ms)",
                                 "round robin mean batch", "eldr median gain (%)", "eldr P99 gain (%)",
                                 "eldr_balanced median gain (%)", "eldr_balanced P99 gain (%)"], table))
    lines += ["", "Gains are over the better of round robin and JSQ in the same seed (positive = lower TPOT)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    rows = run(a)
    g = gains(rows)
    doc = {"simulated": True, "costs": list(COSTS), "time_scale": {c: time_scale(c) for c in COSTS},
           "rows": rows, "gains": g}
    if a.json:
        rec = write_record(a.json, doc, argv)
        md = render(rows, g, rec["command"], a.seeds)
        a.json.with_suffix(".md").write_text(md)
    else:
        md = render(rows, g, "python -m benchmark.bench_fat_expert_sim", a.seeds)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
