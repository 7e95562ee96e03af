"""A step law the policy is not told: the default policy priced with its shipped law, with
laws it fits online from noisy engine step samples, and with the simulator's true law.
SIMULATED.

    .venv/bin/python -m benchmark.bench_law_fit            # 6 laws x 2 workloads x 2 seeds (~5 CPU-min)
    .venv/bin/python -m benchmark.bench_law_fit --quick    # smoke run (seconds)

The simulator runs one of six step-time laws (the paper-anchored MI300X law, its
per-expert term x0.25 and x2, its per-sequence terms x4, the law measured on a real
CPU server, Qwen3-235B on TP4/EP4); the policy always starts from the shipped law
(Qwen3-30B-A3B on one MI300X). "fitted": every 0.5 s it is told each server's true
batch and every 5 s each server's law is fitted from its last 1,024 steps' samples
(time x log-normal noise, sd 0.1), as the router does with ``--engine-metrics``.
"told": the policy is given the simulator's law. Reported: median and P99 TPOT gain
over JSQ (mean over seeds).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from benchmark.common import QUICK_OUT, command_line, markdown_table, write_record
from benchmark.routing_cache import routing_for
from eldr_sglang.core.policies import PolicyContext, build_policy
from eldr_sglang.core.policies.eldr_balanced import EldrBalancedPolicy
from eldr_sglang.sim import experiments
from eldr_sglang.sim.calibration import prefill_activations
from eldr_sglang.sim.cost_model import CostParams, get_params, step_cost
from eldr_sglang.sim.simulator import SimConfig, simulate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHIPPED = "qwen3-30b-a3b-mi300x"
FULL = dict(k=16, rate=60.0, seeds=2, warmup_s=10.0, measure_s=30.0)
QUICK = dict(k=8, rate=30.0, seeds=1, warmup_s=2.0, measure_s=6.0)


def laws() -> dict[str, CostParams]:
    base = get_params(SHIPPED)
    return {"paper MI300X (shipped)": base,
            "per-expert x0.25": replace(base, name="per-expert-x0.25", mem_bandwidth=4 * base.mem_bandwidth),
            "per-expert x2": replace(base, name="per-expert-x2", mem_bandwidth=base.mem_bandwidth / 2),
            "per-sequence x4": replace(base, name="per-seq-x4", attn_s_per_token=4 * base.attn_s_per_token,
                                       moe_s_per_token=4 * base.moe_s_per_token),
            "measured CPU server": get_params("real-cpu-server"),
            "235B TP4/EP4": get_params("qwen3-235b-a22b-mi300x-tp4ep4")}


def policy(k: int, routing, data, params: CostParams) -> EldrBalancedPolicy:
    """The default policy with ``params``' law (as bench_default_policy builds it)."""
    law = step_cost(params, len(routing.layers), expert_scale=params.num_experts / data.sim.num_experts,
                    context_tokens=600.0 + 300.0 / 2)
    return EldrBalancedPolicy(k, cost=law, centroids=routing.eldr_centroids)


def run(data, routing, acts, cfg: SimConfig, law: CostParams, variant: str) -> tuple[float, float]:
    k = cfg.num_decode
    if variant == "jsq":
        res = simulate(data.sim, build_policy("jsq", PolicyContext(k, seed=cfg.seed)), cfg, cost=law)
    else:
        told = variant == "told"
        pol = policy(k, routing, data, law if told else get_params(SHIPPED))
        res = simulate(data.sim, pol, cfg, routing.eldr_signatures, cost=law, activations=acts,
                       engine_report_s=0.5 if variant == "fitted" else None,
                       fit_law_s=5.0 if variant == "fitted" else None)
    return float(res.summary["tpot_median_ms"]), float(res.summary["tpot_p99_ms"])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_law_fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workloads", default="task,language")
    ap.add_argument("--traces-root", type=Path, default=HERE / "traces")
    ap.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "bench_state_aware")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    g = QUICK if a.quick else FULL
    a.json = a.json or (QUICK_OUT / "law_fit.json" if a.quick else HERE / "results" / "law_fit.json")
    sets = laws() if not a.quick else dict(list(laws().items())[:2])
    rows = []
    for wl in a.workloads.split(","):
        data = experiments.load_workload(wl, a.traces_root, a.work_dir, experiments.FULL, 600.0, 300.0)
        for seed in range(g["seeds"]):
            routing = routing_for(data, g["k"], seed, a)
            acts = prefill_activations(data.evaluation, routing.layers)
            cfg = SimConfig(num_prefill=max(8, g["k"] * 3 // 2), num_decode=g["k"], rate=g["rate"], seed=seed,
                            warmup_s=g["warmup_s"], measure_s=g["measure_s"])
            for name, law in sets.items():
                row = {"workload": wl, "law": name, "seed": seed}
                for variant in ("jsq", "shipped", "fitted", "told"):
                    row[variant] = run(data, routing, acts, cfg, law, variant)
                rows.append(row)
                print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    table = summarise(rows)
    print("\n".join(table))
    write_record(a.json, {"command": command_line(__file__, argv), "simulated": True, "grid": g, "rows": rows,
                          "table": table})
    print(f"-> {a.json}")
    return 0


def summarise(rows: list[dict]) -> list[str]:
    out = []
    for wl, law in dict.fromkeys((r["workload"], r["law"]) for r in rows):
        rs = [r for r in rows if (r["workload"], r["law"]) == (wl, law)]
        jsq = np.array([r["jsq"] for r in rs])
        cells = [wl, law, f"{jsq[:, 0].mean():.1f} / {jsq[:, 1].mean():.1f}"]
        for v in ("shipped", "fitted", "told"):
            x = np.array([r[v] for r in rs])
            gain = 100 * (jsq - x) / jsq
            cells.append(f"{gain[:, 0].mean():+.1f}% / {gain[:, 1].mean():+.1f}%")
        out.append(cells)
    return ["SIMULATED: median / P99 TPOT gain over JSQ of the default policy priced with the shipped law, "
            "with laws fitted online from noisy step samples, and with the simulator's own law", "",
            *markdown_table(["workload", "simulator's law", "JSQ median / P99 ms", "shipped law", "fitted online",
                             "told the true law"], out).splitlines()]


if __name__ == "__main__":
    sys.exit(main())
