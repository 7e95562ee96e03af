"""The simulated report's analysis and its markdown (``python -m benchmark.report`` writes RESULTS.md).

Seed means and sds of the simulated runs (``aggregate``), the headline gains against the best load
balancer and Domain (``headline``), goodput to saturation (``goodput``), the microbenchmark's linear
shape (``microbench_shape``) and ``render``: RESULTS.md's simulated sections, one function a section.
"""

from __future__ import annotations

import json

import numpy as np

from benchmark.common import markdown_table, mean_sd
from benchmark.rules import CANDIDATE, decide, default_rule, goodput_of, headline_lines
from eldr_sglang.sim import experiments
from eldr_sglang.sim.cost_model import PAPER_EXPERT_RATIO, get_params, moe_layer_time

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


def pool_gain(runs, wl, k) -> float:
    rr = aggregate(runs, experiment="pool", workload=wl, num_decode=k, policy="round_robin")
    e = aggregate(runs, experiment="pool", workload=wl, num_decode=k, policy="eldr")
    return gain(rr["tpot_median_ms"], e["tpot_median_ms"]) if rr and e else float("nan")


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
    """RESULTS.md's simulated sections (the MEASURED ones come from ``benchmark.measured``)."""
    wls = args.workload_list
    L: list[str] = []
    w = L.append
    heads = {wl: headline(runs, wl, sweep.loads) for wl in wls}
    goods = {wl: goodput(runs, wl, sweep.goodput_policies, sweep.goodput_targets_ms) for wl in wls}
    nseeds = len(seeds_of(runs))
    _intro(w, args, sweep, info, microbenches, command)
    _claims(w, runs, sweep, wls, heads, goods, nseeds)
    _default_policy(w, args.out_dir)
    _load_tables(w, runs, sweep, wls, info["base_config"], heads, goods, nseeds)
    _sweep_tables(w, runs, sweep, wls)
    _microbench_and_speed(w, args, microbenches, info)
    return "\n".join(L) + "\n"


def _intro(w, args, sweep, info, microbenches, command) -> None:
    """Title, what is simulated, how to regenerate, the setup."""
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


def _claims(w, runs, sweep, wls, heads, goods, nseeds) -> None:
    """The paper's headline claims against the simulated ranges."""
    w("## Paper vs simulation (headline)\n")
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


def _default_policy(w, out_dir) -> None:
    """The default policy's verdict (results/default_policy.json), the analysis of it and of the rules
    screened against it (results/default_policy_notes.md, written from the runs it names) and its
    locality (results/locality.md)."""
    default_json = out_dir / "results" / "default_policy.json"
    if default_json.is_file():
        doc = json.loads(default_json.read_text())
        doc["decision"] = decide(doc["runs"], doc["grid"], doc["grid"]["workloads"])
        g = doc["grid"]
        n_runs = sum(r.get("policy") == CANDIDATE for r in doc["runs"])
        w("## The router's default policy: eldr_balanced (simulated)\n")
        w(f"`eldr_balanced` (`eldr_sglang/core/policies/eldr_balanced.py`): {default_rule()}. "
          "Judged against the balancers, ELDR's band rule, "
          "Domain and the oracle grouping by a fixed decision rule; every check and table in "
          "[results/default_policy.md](results/default_policy.md) "
          f"(`{doc['command']}`; {'/'.join(map(str, g['pools']))} decode servers, {g['seeds']} seeds, both "
          f"workloads; {n_runs} runs of the candidate):\n")
        for line in headline_lines(doc):
            w(line)
        w("")
        notes = out_dir / "results" / "default_policy_notes.md"
        if notes.is_file():
            w(notes.read_text())
    locality_md = out_dir / "results" / "locality.md"
    if locality_md.is_file():  # benchmark/bench_locality.py: the default against the rules it was chosen between
        w(locality_md.read_text())


def _load_tables(w, runs, sweep, wls, b, heads, goods, nseeds) -> None:
    """TPOT vs load per workload, the gains per load, goodput to saturation."""
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


def _sweep_tables(w, runs, sweep, wls) -> None:
    """The tau sweep, decode-pool scaling and prefix caching."""
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


def _microbench_and_speed(w, args, microbenches, info) -> None:
    """The measured MoE-layer microbenchmark against the cost model's shape, and the simulator's speed."""
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
