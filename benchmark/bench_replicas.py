"""Router replicas and engine-reported batches: does the default policy keep its gain when
several routers share the decode servers? SIMULATED.

    .venv/bin/python -m benchmark.bench_replicas                   # 2 workloads x 2 rates x 3 seeds (~10 CPU-min)
    .venv/bin/python -m benchmark.bench_replicas --quick           # smoke run (seconds)

Each run replays the measured traces (``benchmark/traces``) through the simulator with
16 decode servers. R router replicas (1, 2, 4) each take a random share of the
arrivals and see the servers' true in-flight counts (the shared load poll); "own"
replicas price a server's live batch from their own requests only, "engine" replicas
are also told every server's true batch every 0.5 s (the engines' ``/eldr/batch``
read with the load poll). Reported per workload and rate, over seeds (mean, and the
standard error of the paired differences): median TPOT gain over JSQ (one router,
the better balancer at these loads), and each replica setting's gain as a share of
the one-router gain.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from benchmark.bench_default_policy import candidate_policy
from benchmark.common import QUICK_OUT, command_line, markdown_table, write_record
from benchmark.routing_cache import routing_for
from eldr_sglang.core.policies import PolicyContext, build_policy
from eldr_sglang.sim import experiments
from eldr_sglang.sim.calibration import prefill_activations
from eldr_sglang.sim.simulator import SimConfig, simulate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REPORT_S = 0.5  # the router's default --load-interval
FULL = dict(k=16, rates=(60.0, 120.0), seeds=3, replicas=(2, 4), warmup_s=10.0, measure_s=30.0)
QUICK = dict(k=8, rates=(40.0,), seeds=1, replicas=(2,), warmup_s=2.0, measure_s=6.0)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_replicas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small point; outputs under .cache/")
    ap.add_argument("--workloads", default="task,language")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--cost", default="qwen3-30b-a3b-mi300x")
    ap.add_argument("--traces-root", type=Path, default=HERE / "traces")
    ap.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "bench_state_aware",
                    help="calibrations are cached here (shared with bench_state_aware.py)")
    ap.add_argument("--json", type=Path, default=None, help="default: results/replicas.json (--quick: .cache/)")
    return ap


def run(data, routing, acts, cfg: SimConfig, variant: str, replicas: int) -> float:
    """Median TPOT (ms) of one SIMULATED run of ``variant`` ("jsq" or "own"/"engine")."""
    k = cfg.num_decode
    if variant == "jsq":
        res = simulate(data.sim, build_policy("jsq", PolicyContext(k, seed=cfg.seed)), cfg)
    else:
        pols = [candidate_policy(k, routing, data, cfg.cost) for _ in range(replicas)]
        res = simulate(data.sim, pols, cfg, routing.eldr_signatures, activations=acts,
                       engine_report_s=REPORT_S if variant == "engine" else None)
    return float(res.summary["tpot_median_ms"])


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    g = dict(QUICK if a.quick else FULL)
    if a.seeds:
        g["seeds"] = a.seeds
    a.json = a.json or (QUICK_OUT / "replicas.json" if a.quick else HERE / "results" / "replicas.json")
    sweep = experiments.FULL
    base = SimConfig(num_prefill=max(8, g["k"] * 3 // 2), num_decode=g["k"], warmup_s=g["warmup_s"],
                     measure_s=g["measure_s"], cost=a.cost)
    rows = []
    for wl in a.workloads.split(","):
        data = experiments.load_workload(wl, a.traces_root, a.work_dir, sweep, 600.0, 300.0)
        for seed in range(g["seeds"]):
            routing = routing_for(data, g["k"], seed, a)
            acts = prefill_activations(data.evaluation, routing.layers)
            for rate in g["rates"]:
                cfg = replace(base, rate=rate, seed=seed)
                row = {"workload": wl, "rate": rate, "seed": seed, "jsq": run(data, routing, acts, cfg, "jsq", 1),
                       "x1": run(data, routing, acts, cfg, "own", 1)}
                for r in g["replicas"]:
                    for variant in ("own", "engine"):
                        row[f"x{r}-{variant}"] = run(data, routing, acts, cfg, variant, r)
                rows.append(row)
                print("  " + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in row.items()), flush=True)
    table = summarise(rows, g["replicas"])
    print("\n".join(table))
    write_record(a.json, {"command": command_line(__file__, argv), "simulated": True, "grid": g, "rows": rows,
                          "table": table})
    print(f"-> {a.json}")
    return 0


def summarise(rows: list[dict], replicas: Sequence[int]) -> list[str]:
    """Per (workload, rate): gain over JSQ of one router, and each setting's share of it."""
    cols = ["x1"] + [f"x{r}-{v}" for r in replicas for v in ("own", "engine")]
    out = []
    for key in sorted({(r["workload"], r["rate"]) for r in rows}):
        rs = [r for r in rows if (r["workload"], r["rate"]) == key]
        jsq = np.array([r["jsq"] for r in rs])
        gains = {c: 100 * (jsq - np.array([r[c] for r in rs])) / jsq for c in cols}
        cells = [key[0], f"{key[1]:g}", f"{jsq.mean():.1f}"]
        for c in cols:
            g = gains[c]
            share = 100 * g.mean() / gains["x1"].mean() if gains["x1"].mean() > 0 else float("nan")
            d = g - gains["x1"]
            se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
            cells.append(f"{g.mean():+.1f}%" + ("" if c == "x1" else f" ({share:.0f}% of x1; diff {d.mean():+.1f} ± {se:.1f} pp)"))
        out.append(cells)
    return ["SIMULATED: median TPOT gain of the default policy over JSQ (one router); R replicas each take a random "
            "share of arrivals; 'engine': true batches reported every 0.5 s", "",
            *markdown_table(["workload", "req/s", "JSQ median TPOT ms", *cols], out).splitlines()]


if __name__ == "__main__":
    sys.exit(main())
