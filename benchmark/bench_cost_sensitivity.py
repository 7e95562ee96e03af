"""ELDR's gain across cost models: the paper's anchor, our microbenchmark's fit, and a
range of per-layer fixed costs. SIMULATED.

    .venv/bin/python -m benchmark.bench_cost_sensitivity [--seeds 3] [--rate 80]

The simulator's step time charges each distinct expert a weight read and each MoE
layer a fixed cost; the fixed cost decides how much fewer experts save. Parameter
sets (Qwen3-30B-A3B, task traces, 8P16D, lengths 600 / 300 as ``report.py``):

* ``paper anchor`` (MI300X and H200): fixed cost set so 128 vs 16 experts = 4.7x
  (the paper's measurement);
* ``H200 microbench fit``: fixed, per-token and per-expert terms fitted by least
  squares to the committed H200 run of ``benchmark/microbench_moe_layer.py``
  (``results/microbench_h200_qwen3-30b.json``; a plain PyTorch layer that passes
  over each expert's weights 3 times);
* ``... 1 pass``: the same fit with the per-expert time divided by 3 (what a fused
  MoE kernel reading each expert once would pay; an estimate, not measured);
* ``ratio R``: the H200 bandwidth with the fixed cost set so 128 vs 16 = R.

Reported (mean ± sd over seeds): the model's 128/16 layer ratio, and ELDR's median
and P99 TPOT gain over round robin and over JSQ. Writes
``benchmark/results/cost_sensitivity.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from benchmark.common import command_line, fmt_mean_sd, markdown_table, parse_with_quick, quick_out, write_record
from eldr_sglang.sim import experiments
from eldr_sglang.core.policies import make_policy
from eldr_sglang.sim.cost_model import fit_moe_layer_fixed, fit_to_microbench, get_params, layer_ratio
from eldr_sglang.sim.simulator import SimConfig, simulate

HERE = Path(__file__).resolve().parent


def param_sets() -> dict:
    h200 = get_params("qwen3-30b-a3b-h200")
    mb = json.loads((HERE / "results" / "microbench_h200_qwen3-30b.json").read_text())
    fit = fit_to_microbench(h200, mb["rows"], mb["bytes_per_expert"], "h200-microbench-fit")
    sets = {"paper anchor, MI300X": get_params("qwen3-30b-a3b-mi300x"), "paper anchor, H200": h200,
            "H200 microbench fit": fit,
            "H200 microbench fit, 1 pass": replace(fit, name="h200-fit-1pass", mem_bandwidth=3 * fit.mem_bandwidth)}
    for ratio in (2.0, 3.0, 6.0):
        sets[f"ratio {ratio:g}"] = replace(h200, name=f"h200-ratio-{ratio:g}",
                                           moe_layer_fixed_s=fit_moe_layer_fixed(h200.expert_read_s,
                                                                                 h200.moe_s_per_token, ratio))
    return sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_cost_sensitivity",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=80.0)
    ap.add_argument("--measure-s", type=float, default=30.0)
    ap.add_argument("--out-dir", type=Path, default=HERE / "results", help="where the JSON and markdown go")
    args = parse_with_quick(ap, argv, seeds=1, measure_s=2.0, out_dir=quick_out("cost_sensitivity"))
    sweep = experiments.QUICK if args.quick else experiments.FULL
    work = HERE.parent / ".cache" / "bench-cost-sensitivity" / sweep.name
    data = experiments.load_workload("task", HERE / "traces", work, sweep, 600.0, 300.0)
    sets = param_sets()
    rows = []
    for seed in range(args.seeds):
        routing = experiments.prepare_routing(data, 16, work, sweep, seed=seed)
        cfg = SimConfig(num_prefill=8, num_decode=16, rate=args.rate, warmup_s=2.0 if args.quick else 10.0,
                        measure_s=args.measure_s,
                        seed=seed)
        for label, params in sets.items():
            res = {}
            for policy in ("round_robin", "jsq", "eldr"):
                pol = make_policy(policy, 16, centroids=routing.eldr_centroids, tau=0.1, seed=seed)
                res[policy] = simulate(data.sim, pol, cfg, routing.eldr_signatures, cost=params).summary
            e = res["eldr"]
            rows.append({"seed": seed, "params": label, "ratio_128_16": layer_ratio(params),
                         **{f"gain_{q}_vs_{b}": 100 * (1 - e[f"tpot_{q}_ms"] / res[b][f"tpot_{q}_ms"])
                            for q in ("median", "p99") for b in ("round_robin", "jsq")}})
        print(f"seed {seed} done", flush=True)
    out = {"simulated": True, "rate": args.rate,
           "command": command_line(__file__, argv), "rows": rows}
    write_record(args.out_dir / "cost_sensitivity.json", out)
    md = render(rows, out["command"], args.seeds, args.rate)
    (args.out_dir / "cost_sensitivity.md").write_text(md)
    print(md)
    return 0


def render(rows: list[dict], command: str, seeds: int, rate: float) -> str:
    cells = []
    for label in dict.fromkeys(r["params"] for r in rows):
        sel = [r for r in rows if r["params"] == label]
        cells.append([label, f"{sel[0]['ratio_128_16']:.2f}", *(fmt_mean_sd([r[k] for r in sel]) for k in (
            "gain_median_vs_round_robin", "gain_p99_vs_round_robin", "gain_median_vs_jsq", "gain_p99_vs_jsq"))])
    table = markdown_table(["cost model", "128/16 layer ratio", "median gain vs RR %", "P99 gain vs RR %",
                            "median gain vs JSQ %", "P99 gain vs JSQ %"], cells)
    return (f"# ELDR's TPOT gain across cost models (SIMULATED; task, 8P16D, {rate:g} req/s, {seeds} seeds)\n\n"
            f"Command: `{command}`\n\n{table}\n")


if __name__ == "__main__":
    sys.exit(main())
