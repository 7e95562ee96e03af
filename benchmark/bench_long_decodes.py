"""Long decodes with recorded per-step expert sets: how wrong is the independence
approximation, and does ELDR's simulated gain survive replaying the real sets?

    .venv/bin/python -m benchmark.bench_long_decodes [--long benchmark/traces-long] [--seeds 5]

Input: ``tools/record_long_decodes.py`` output (``<long>/<workload>/eval``: trace shards
+ ``steps.npz``, the top-k experts of every decode step of every request) and the
calibration split of the same model (``benchmark/traces/<workload>/calib``).

1. MEASURED (no simulation): batches of b requests, each at a random decode step of
   its own, drawn three ways: mixed (any requests), ELDR-grouped (requests whose
   signature is closest to the same centroid of the K=16 calibration) and
   label-grouped. For each batch, the TRUE distinct experts per layer (union of the
   recorded sets) against the independence approximation the simulator uses when it
   has no per-step sets (``sum_e 1 - prod_r (1 - p_re)``, ``p = decode counts / steps``).
2. SIMULATED: the simulator's round robin vs ELDR on these requests (output lengths =
   the recorded decodes), once with the approximation and once replaying the recorded
   per-step sets, 16 decode servers, mean ± sd over seeds (arrival + calibration seed).

Writes ``benchmark/results/long_decodes.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmark.common import command_line, fmt_mean_sd, markdown_table, parse_with_quick, quick_out, write_record
from eldr_sglang.sim import experiments
from eldr_sglang.core.policies import make_policy
from eldr_sglang.core.step_sets import independent_distinct, load_step_experts, true_distinct
from eldr_sglang.core.traces import load_traces
from eldr_sglang.sim.simulator import SimConfig, simulate
from eldr_sglang.sim.workload import build_workload, decode_step_probs, label_kind_for

HERE = Path(__file__).resolve().parent

BATCHES = (4, 16, 64, 128, 256)
GROUPINGS = ("mixed", "eldr", "label")


def batch_rows(grouping: str, b: int, groups: dict[str, np.ndarray], n: int, rng: np.random.Generator) -> np.ndarray:
    if grouping == "mixed":
        return rng.integers(0, n, b)
    members = list(groups[grouping].values())
    pool = members[rng.integers(len(members))]
    return pool[rng.integers(0, len(pool), b)]


def approximation_error(steps, p, groups, num_experts, batches: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    n, T = steps.shape[:2]
    out = []
    for grouping in GROUPINGS:
        for b in BATCHES:
            true, approx = [], []
            for _ in range(batches):
                rows = batch_rows(grouping, b, groups, n, rng)
                at = rng.integers(0, T, b)
                true.append(true_distinct(steps, rows, at, num_experts).mean())
                approx.append(independent_distinct(p, rows).mean())
            true, approx = np.array(true), np.array(approx)
            rel = approx / true - 1.0
            out.append({"grouping": grouping, "batch": b, "true_distinct": float(true.mean()),
                        "approx_distinct": float(approx.mean()), "rel_error_mean_pct": 100 * float(rel.mean()),
                        "rel_error_abs_p95_pct": 100 * float(np.quantile(np.abs(rel), 0.95))})
    return out


def grouping_gain(rows: list[dict]) -> list[dict]:
    """Fewer distinct experts, grouped vs mixed, in truth and under the approximation."""
    by = {(r["grouping"], r["batch"]): r for r in rows}
    out = []
    for g in ("eldr", "label"):
        for b in BATCHES:
            m, x = by[("mixed", b)], by[(g, b)]
            out.append({"grouping": g, "batch": b,
                        "true_reduction_pct": 100 * (1 - x["true_distinct"] / m["true_distinct"]),
                        "approx_reduction_pct": 100 * (1 - x["approx_distinct"] / m["approx_distinct"])})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_long_decodes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", type=Path, default=HERE / "traces-long")
    ap.add_argument("--traces", type=Path, default=HERE / "traces", help="calibration splits (same model)")
    ap.add_argument("--workloads", default="task,language")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=300, help="sampled batches per (grouping, size)")
    ap.add_argument("--rates", default="60,120,240", help="req/s for the simulated comparison")
    ap.add_argument("--measure-s", type=float, default=40.0)
    ap.add_argument("--json", type=Path, default=HERE / "results" / "long_decodes.json")
    args = parse_with_quick(ap, argv, traces=HERE / "traces-12l", workloads="task", seeds=1, batches=20, rates="60",
                            measure_s=2.0,
                            json=quick_out("long_decodes") / "long_decodes.json")
    work = HERE.parent / ".cache" / "bench-long-decodes"
    result = {"command": command_line(__file__, argv),
              "simulated_part": "section 2 is SIMULATED (cost model qwen3-30b-a3b-mi300x); section 1 is measured "
                                "on the recorded per-step sets", "workloads": {}}
    for name in args.workloads.split(","):
        eval_dir, calib_dir = args.long / name / "eval", args.traces / name / "calib"
        for d in (eval_dir, calib_dir):
            if not d.is_dir():
                ap.error(f"{d} not found (record it: tools/record_long_decodes.py; traces: make traces)")
        evaluation, calib = load_traces(eval_dir), load_traces(calib_dir)
        if evaluation.model.num_layers != calib.model.num_layers:
            ap.error(f"{eval_dir} and {calib_dir} come from different models")
        steps = load_step_experts(eval_dir, evaluation)
        if steps is None:
            ap.error(f"{eval_dir} has no steps.npz")
        p = decode_step_probs(evaluation)
        kind = label_kind_for(evaluation, name)
        sim_indep = build_workload(evaluation, kind, name, 600.0, None)
        sim_replay = replace(sim_indep, step_experts=steps)
        data = experiments.WorkloadData(name, f"long decodes ({eval_dir})", calib, evaluation, calib_dir, sim_indep)
        wl = {"requests": len(evaluation), "decode_steps": int(steps.shape[1]), "layers": int(steps.shape[2]),
              "model": evaluation.model.name, "error": [], "sim": []}
        rep = eval_dir / "repetition.json"
        if rep.is_file():
            wl["repetition"] = json.loads(rep.read_text())
        for seed in range(args.seeds):
            routing = experiments.prepare_routing(data, 16, work, experiments.FULL, seed=seed)
            best = np.argmax(routing.eldr_signatures @ routing.eldr_centroids.T, axis=1)
            labels = np.asarray(evaluation.labels[kind])
            groups = {"eldr": {str(c): np.flatnonzero(best == c) for c in np.unique(best)},
                      "label": {str(c): np.flatnonzero(labels == c) for c in np.unique(labels)}}
            rows = approximation_error(steps, p, groups, evaluation.model.num_experts, args.batches, seed)
            wl["error"] += [{"seed": seed, **r} for r in rows]
            for rate in [float(r) for r in args.rates.split(",")]:
                cfg = SimConfig(num_prefill=8, num_decode=16, rate=rate, warmup_s=10.0, measure_s=args.measure_s,
                                seed=seed)
                for mode, sim in (("independence", sim_indep), ("replay", sim_replay)):
                    for policy in ("round_robin", "eldr"):
                        pol = make_policy(policy, 16, centroids=routing.eldr_centroids, tau=0.1, seed=seed)
                        s = simulate(sim, pol, cfg, routing.eldr_signatures).summary
                        wl["sim"].append({"seed": seed, "rate": rate, "mode": mode, "policy": policy,
                                          **{k: s[k] for k in ("tpot_median_ms", "tpot_p99_ms",
                                                               "unique_experts_per_step", "mean_batch")}})
            print(f"{name}: seed {seed} done", flush=True)
        result["workloads"][name] = wl
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_record(args.json, result)
    md = render(result)
    args.json.with_suffix(".md").write_text(md)
    print(md)
    return 0


def render(result: dict) -> str:
    lines = ["# Long decodes: recorded per-step expert sets vs the independence approximation", "",
             f"`{result['command']}`", "",
             "Section 1 is MEASURED on recorded per-step sets (no simulation). Section 2 is SIMULATED.", ""]
    for name, wl in result["workloads"].items():
        lines += [f"## {name}: {wl['requests']} requests x {wl['decode_steps']} decode steps, "
                  f"{wl['layers']} layers (model {wl['model']})", ""]
        if "repetition" in wl:
            r = wl["repetition"]
            lines += [f"Repetition in the outputs (greedy, small model): {100 * r['repeated_4gram_share_mean']:.1f}% "
                      f"of 4-grams repeat an earlier one (p90 {100 * r['repeated_4gram_share_p90']:.1f}%); "
                      f"{100 * r['ends_in_loop_share']:.1f}% of outputs end in a loop of period <= 16.", ""]
        err = wl["error"]
        keys = sorted({(r["grouping"], r["batch"]) for r in err}, key=lambda k: (GROUPINGS.index(k[0]), k[1]))
        cells = []
        for g, b in keys:
            rs = [r for r in err if r["grouping"] == g and r["batch"] == b]
            cells.append([g, b, *(fmt_mean_sd([r[k] for r in rs]) for k in (
                "true_distinct", "approx_distinct", "rel_error_mean_pct", "rel_error_abs_p95_pct"))])
        lines += ["### 1. Distinct experts per layer of a batch: truth vs independence (mean ± sd over seeds)", "",
                  markdown_table(["grouping", "batch", "true", "independence", "mean error %", "p95 abs error %"],
                                 cells)]
        per_seed = {}
        for seed in sorted({r["seed"] for r in err}):
            for g in grouping_gain([r for r in err if r["seed"] == seed]):
                per_seed.setdefault((g["grouping"], g["batch"]), []).append(g)
        cells = [[g, b, fmt_mean_sd([r["true_reduction_pct"] for r in rs]),
                  fmt_mean_sd([r["approx_reduction_pct"] for r in rs])] for (g, b), rs in per_seed.items()]
        lines += ["", "Fewer distinct experts when grouped than mixed (%), truth vs approximation:", "",
                  markdown_table(["grouping", "batch", "true", "independence"], cells)]
        lines += ["", "### 2. SIMULATED: ELDR vs round robin, 16 decode servers", "",
                  "| req/s | decode model | RR median TPOT ms | ELDR median TPOT ms | ELDR median gain % | "
                  "ELDR P99 gain % | distinct/step RR | distinct/step ELDR | mean batch |",
                  "|---|---|---|---|---|---|---|---|---|"]
        sim = wl["sim"]
        for rate in sorted({r["rate"] for r in sim}):
            for mode in ("independence", "replay"):
                pick = lambda pol: sorted((r for r in sim if r["rate"] == rate and r["mode"] == mode  # noqa: E731
                                           and r["policy"] == pol), key=lambda r: r["seed"])
                rr, el = pick("round_robin"), pick("eldr")
                med = [100 * (a["tpot_median_ms"] - b["tpot_median_ms"]) / a["tpot_median_ms"] for a, b in zip(rr, el)]
                p99 = [100 * (a["tpot_p99_ms"] - b["tpot_p99_ms"]) / a["tpot_p99_ms"] for a, b in zip(rr, el)]
                lines.append(f"| {rate:g} | {mode} | {fmt_mean_sd([r['tpot_median_ms'] for r in rr])} | "
                             f"{fmt_mean_sd([r['tpot_median_ms'] for r in el])} | {fmt_mean_sd(med)} | {fmt_mean_sd(p99)} | "
                             f"{fmt_mean_sd([r['unique_experts_per_step'] for r in rr])} | "
                             f"{fmt_mean_sd([r['unique_experts_per_step'] for r in el])} | {fmt_mean_sd([r['mean_batch'] for r in el])} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
