"""The state-aware sweep's analysis and markdown page (``benchmark/results/state_aware.md``).

``bench_state_aware.py`` runs the sweep and writes its JSON; this module reads that JSON:
seed statistics, per-seed paired differences against ELDR, goodput at a P99 TPOT target, the
issue's decision rule, and the page that shows them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from benchmark.common import markdown_table, mean_sd

#: The sweep's policies, in the order the tables show them.
POLICIES = ("round_robin", "jsq", "domain", "eldr", "state_aware", "oracle")
DECISION_RATE = 60.0  # the rule compares median TPOT at rates >= this
GOODPUT_FACTOR = 1.25

Writer = Callable[[str], None]


def key_of(r: dict) -> tuple:
    """A run's coordinates: (workload, K, rate, seed, policy)."""
    return (r["workload"], int(r["num_decode"]), float(r["rate"]), int(r["seed"]), r["policy"])


# -- analysis -----------------------------------------------------------------------------------------------
METRICS = ("tpot_median_ms", "tpot_p99_ms", "unique_experts_per_step", "load_cv", "mean_batch")


def stats(runs: list[dict], **where: object) -> dict | None:
    """Seed mean and sd of each metric over the runs matching ``where``; ``None`` if there are none."""
    rows = [r for r in runs if all(r.get(k) == v for k, v in where.items())]
    if not rows:
        return None
    out = {"n": len(rows), "seeds": sorted(r["seed"] for r in rows)}
    for m in METRICS + ("ttft_median_ms", "ttft_p99_ms"):
        out[m], out[m + "_sd"] = mean_sd(r[m] for r in rows)
    return out


def paired(runs: list[dict], metric: str, wl: str, k: int, rate: float, a: str = "state_aware",
           b: str = "eldr") -> dict | None:
    """Per-seed ``a - b`` of ``metric`` (same seed = same arrivals): mean, sd, wins of ``a``."""
    ra = {r["seed"]: r[metric] for r in runs if (r["workload"], r["num_decode"], r["rate"], r["policy"]) == (wl, k, rate, a)}
    rb = {r["seed"]: r[metric] for r in runs if (r["workload"], r["num_decode"], r["rate"], r["policy"]) == (wl, k, rate, b)}
    seeds = sorted(set(ra) & set(rb))
    if not seeds:
        return None
    d = np.array([ra[s] - rb[s] for s in seeds])
    mean, sd = mean_sd(d)
    return {"mean": mean, "sd": sd, "n": int(d.size),
            "a_wins": int((d < 0).sum()), "rel_pct": float(100.0 * d.mean() / np.mean([rb[s] for s in seeds]))}


def goodput(runs: list[dict], wl: str, k: int, rates: Sequence[float], policies: Sequence[str]) -> dict:
    """T = 1.25 x the lowest seed-mean P99 TPOT at the lowest rate; per policy the highest rate whose
    seed-mean P99 stays <= T (at that rate and every lower one)."""
    lo = min(rates)
    p99_lo = [s["tpot_p99_ms"] for p in policies if (s := stats(runs, workload=wl, num_decode=k, rate=lo, policy=p))]
    if not p99_lo:
        return {}
    target = GOODPUT_FACTOR * min(p99_lo)
    out = {"target_ms": target, "policies": {}}
    for p in policies:
        best, ok_rates, broken = 0.0, [], False
        for rate in sorted(rates):
            s = stats(runs, workload=wl, num_decode=k, rate=rate, policy=p)
            ok = s is not None and s["tpot_p99_ms"] <= target
            if ok:
                ok_rates.append(rate)
            broken = broken or not ok
            if not broken:
                best = rate
        out["policies"][p] = {"goodput_rate": best, "rates_within_target": ok_rates}
    return out


def decision(runs: list[dict], workloads: Sequence[str], pools: Sequence[int], rates: Sequence[float]) -> dict:
    """The issue's rule: state_aware's seed-mean median TPOT < ELDR's at every rate >= 60 req/s on both
    workloads and every K, and its seed-mean P99 TPOT never above ELDR's (every rate, every K)."""
    med_checks, p99_checks = [], []
    for wl in workloads:
        for k in pools:
            for rate in rates:
                s = stats(runs, workload=wl, num_decode=k, rate=rate, policy="state_aware")
                e = stats(runs, workload=wl, num_decode=k, rate=rate, policy="eldr")
                if s is None or e is None:
                    continue
                pm = paired(runs, "tpot_median_ms", wl, k, rate)
                pp = paired(runs, "tpot_p99_ms", wl, k, rate)
                se = lambda p: p["sd"] / np.sqrt(p["n"]) if p["n"] > 1 else float("nan")  # noqa: E731
                if rate >= DECISION_RATE:
                    med_checks.append({"workload": wl, "K": k, "rate": rate, "state_aware": s["tpot_median_ms"],
                                       "eldr": e["tpot_median_ms"], "pass": s["tpot_median_ms"] < e["tpot_median_ms"],
                                       "diff_ms": pm["mean"], "diff_se_ms": se(pm), "sa_wins": pm["a_wins"],
                                       "n": pm["n"]})
                p99_checks.append({"workload": wl, "K": k, "rate": rate, "state_aware": s["tpot_p99_ms"],
                                   "eldr": e["tpot_p99_ms"], "pass": s["tpot_p99_ms"] <= e["tpot_p99_ms"],
                                   "diff_ms": pp["mean"], "diff_se_ms": se(pp), "sa_wins": pp["a_wins"], "n": pp["n"]})
    complete = all(w in {r["workload"] for r in runs} for w in ("task", "language"))
    ok = bool(med_checks) and all(c["pass"] for c in med_checks) and all(c["pass"] for c in p99_checks)
    return {"median": med_checks, "p99": p99_checks, "both_workloads": complete,
            "recommend": bool(ok and complete)}


# -- markdown -----------------------------------------------------------------------------------------------
def pm(s: dict, m: str, digits: int = 2) -> str:
    """``"mean ± sd"`` of metric ``m`` of a ``stats`` row."""
    return f"{s[m]:.{digits}f} ± {s[m + '_sd']:.{digits}f}"


def render(doc: dict) -> str:
    """The sweep's markdown page: header, setup, verdict, then one table per section."""
    runs, st = doc["runs"], doc["settings"]
    grid = doc["grid"]
    wls, pools, rates, seeds = grid["workloads"], grid["pools"], grid["rates"], grid["seeds"]
    pols = [p for p in POLICIES if any(r["policy"] == p for r in runs)]
    n_expected = len(wls) * len(pools) * len(rates) * len(seeds) * len(POLICIES)
    L: list[str] = []
    w = L.append
    _header(w, doc, st, runs, n_expected)
    _setup(w, doc, st, wls, pools, rates, seeds)
    dec = decision(runs, wls, pools, rates)
    w("## Verdict\n")
    w(verdict_text(doc, dec) + "\n")
    _paired_table(w, runs, wls, pools, rates)
    _goodput_table(w, runs, wls, pools, rates, pols)
    _decision_table(w, dec)
    _per_pool_tables(w, runs, st, wls, pools, rates, pols)
    return "\n".join(L) + "\n"


def _header(w: Writer, doc: dict, st: dict, runs: list[dict], n_expected: int) -> None:
    """Title, what is simulated, the commands, the runs' count and time, superseded runs, notes."""
    w("# State-aware decode routing vs ELDR and baselines: SIMULATED\n")
    w("**Every number in this file is SIMULATED** (discrete-event simulator `eldr_sglang/sim/simulator.py` + "
      "analytic step-time cost model `eldr_sglang/sim/cost_model.py`, cost set `" + st["cost"] + "`), driven by "
      "measured expert traces of the tiny trained MoE (`benchmark/traces/{task,language}`); nothing here was "
      "measured on a serving cluster. The routing decisions are made by the unchanged policy objects of "
      "`eldr_sglang.core.policies`. Generated by `benchmark/bench_state_aware.py`; do not edit by hand.\n")
    cmds = [c for c in doc.get("commands_previous", []) if c] + [doc["command"]]
    w(("Commands, in order (later ones with `--resume` keep the earlier runs):\n\n" if len(cmds) > 1 else "")
      + "```bash\n" + "\n".join(cmds) + "\n```\n")
    w(f"Runs: {len(runs)} of {n_expected}" + ("" if len(runs) >= n_expected else " (**INCOMPLETE sweep**)")
      + (f"; simulation wall time {(doc['wall_s'] + doc.get('wall_s_previous', 0.0)) / 60:.1f} min over the commands above (one process each)"
         if doc.get("wall_s") else "")
      + (f", CPU time {doc['cpu_s'] / 60:.1f} min (wall above CPU = waiting for the shared cores)"
         if doc.get("cpu_s") else "")
      + (f" (estimated beforehand: {doc['estimate']['estimate_s'] / 60:.1f} min)" if doc.get("estimate") else "")
      + ".\n")
    sup = doc.get("superseded_runs") or []
    if sup:
        cur = {key_of(r): r for r in runs}
        pairs = [(r, cur[key_of(r)]) for r in sup if key_of(r) in cur]
        pol_names = sorted({r["policy"] for r in sup})
        line = (f"{len(sup)} earlier runs of {', '.join(pol_names)} were run again (`--redo`) and are kept in the "
                "JSON as `superseded_runs`")
        if pairs:
            for m, label in (("tpot_median_ms", "median TPOT"), ("tpot_p99_ms", "P99 TPOT")):
                d = np.array([100.0 * (new[m] - old[m]) / old[m] for old, new in pairs])
                line += (f"; {label} new vs old: mean {d.mean():+.2f}%, largest |change| {np.abs(d).max():.2f}% "
                         f"over {len(pairs)} points")
        w(line + ".\n")
    for note in doc.get("notes", []):
        w(f"Note: {note}\n")


def _setup(w: Writer, doc: dict, st: dict, wls: Sequence[str], pools: Sequence[int], rates: Sequence[float],
           seeds: Sequence[int]) -> None:
    """Workloads, cluster, windows, lengths, seeds, policies, layers."""
    w("## Setup\n")
    for name, src in doc.get("sources", {}).items():
        w(f"- workload **{name}**: {src}")
    w(f"- decode servers K in {pools}, {st['num_prefill']} prefill servers (as report.py's pool sweep), "
      f"Poisson arrivals at {', '.join(f'{r:g}' for r in rates)} req/s, seeds {seeds}")
    w(f"- windows: warm-up {st['warmup_s']:g} s, measured {st['measure_s']:g} s of simulated time per run (report.py "
      "uses 30 s + 120 s; shortened so that the whole grid fits about 35 min of one core). Each run then drains "
      "until every request has finished; TPOT counts requests arriving in the measured window.")
    w(f"- lengths rescaled to means {st['mean_prompt_tokens']:g}/{st['mean_output_tokens']:g} prompt/output "
      "tokens (as report.py); other SimConfig fields at their defaults (max batch 256, KV 1M tokens)")
    w("- seed s = the simulator's seed (arrival times and which trace request each arrival replays: every policy "
      "sees the same requests for a seed) **and** the calibration seed (`experiments.prepare_routing(..., seed=s)`: "
      "ELDR artifact and oracle grouping recalibrated per seed, per workload and K); Domain's map does not "
      "depend on the seed")
    w(f"- policies: round_robin, jsq, domain (label partition), eldr (band rule, tau {st['tau']:g}), state_aware "
      "(`StateAwarePolicy(K, cost=step_cost(params, len(layers), expert_scale=128/128))`, activations = "
      "`prefill_activations(eval traces, artifact layers)`, no centroids), oracle (ELDR band rule on balanced "
      "K-means of the DECODE counts: a reference the router cannot have)")
    lay = doc.get("layers", {})
    if lay:
        w("- ELDR artifact layers (also state_aware's activation layers), per workload and K over the seeds: "
          + "; ".join(layer_summary(lay, wl, k) for wl in wls for k in pools))
    w("- table cells: mean ± sample sd over the seeds; distinct experts = per step per layer, in the target "
      "model's 128 experts; load CV = coefficient of variation over servers of the mean in-flight count seen at "
      "dispatch; mean batch = running sequences per decode step\n")


def _paired_table(w: Writer, runs: list[dict], wls: Sequence[str], pools: Sequence[int],
                  rates: Sequence[float]) -> None:
    """state_aware minus ELDR, paired by seed."""
    w("## state_aware minus ELDR (paired by seed)\n")
    w("Per-seed difference state_aware - eldr (negative = state_aware better), mean ± sd over seeds, and the "
      "number of seeds in which state_aware is better.\n")
    cells = []
    for wl in wls:
        for k in pools:
            for rate in rates:
                a_ = paired(runs, "tpot_median_ms", wl, k, rate)
                b_ = paired(runs, "tpot_p99_ms", wl, k, rate)
                s = stats(runs, workload=wl, num_decode=k, rate=rate, policy="state_aware")
                e = stats(runs, workload=wl, num_decode=k, rate=rate, policy="eldr")
                if not a_ or not s or not e:
                    continue
                cells.append([wl, k, f"{rate:g}", f"{a_['mean']:+.2f} ± {a_['sd']:.2f}", f"{a_['rel_pct']:+.1f}",
                              f"{a_['a_wins']}/{a_['n']}", f"{b_['mean']:+.2f} ± {b_['sd']:.2f}", f"{b_['rel_pct']:+.1f}",
                              f"{b_['a_wins']}/{b_['n']}", f"{s['mean_batch']:.1f} / {e['mean_batch']:.1f}",
                              f"{s['load_cv']:.3f} / {e['load_cv']:.3f}"])
    w(markdown_table(["workload", "K", "req/s", "median TPOT ms", "median %", "wins", "P99 TPOT ms", "P99 %", "wins",
                      "mean batch sa / eldr", "load CV sa / eldr"], cells))
    w("")


def _goodput_table(w: Writer, runs: list[dict], wls: Sequence[str], pools: Sequence[int], rates: Sequence[float],
                   pols: Sequence[str]) -> None:
    """Goodput at a P99 TPOT target per workload and pool."""
    w("## Goodput at a P99 TPOT target\n")
    w(f"T = {GOODPUT_FACTOR:g} x the lowest seed-mean P99 TPOT among all policies at {min(rates):g} req/s for that "
      "(workload, K). Goodput = the highest grid rate such that the seed-mean P99 TPOT is <= T at that rate and at "
      "every lower grid rate (0 = not even at the lowest); the grid tops out at "
      f"{max(rates):g} req/s, so {max(rates):g} means 'at least {max(rates):g}'.\n")
    top, cells = 0.0, []
    for wl in wls:
        for k in pools:
            g = goodput(runs, wl, k, rates, pols)
            if not g:
                continue
            top = max([top] + [v["goodput_rate"] for v in g["policies"].values()])
            cells.append([wl, k, f"{g['target_ms']:.2f}", *(f"{g['policies'][p]['goodput_rate']:g}" for p in pols)])
    w(markdown_table(["workload", "K", "T (ms)", *pols], cells))
    w("")
    if top < max(rates):
        w(f"No policy keeps its P99 within T above {top:g} req/s: in this cost model every policy's TPOT grows with "
          "load (bigger batches, more distinct experts per step), so this goodput only separates policies at the "
          "low rates; the P99 columns above carry the finer comparison.\n")


def _decision_table(w: Writer, dec: dict) -> None:
    """The decision rule's checks."""
    w("## Decision rule, evaluated\n")
    w(f"Rule (issue): state_aware becomes the recommended policy only if it beats ELDR's median TPOT on both "
      f"workloads at >= {DECISION_RATE:g} req/s (here: every K) without a worse P99 TPOT at any load (every rate, "
      "every K). Compared on seed means; 'SE' is the standard error of the paired per-seed difference.\n")
    w(markdown_table(
        ["check", "workload", "K", "req/s", "state_aware ms", "eldr ms", "diff ± SE ms", "sa better in", "pass"],
        [[name, c["workload"], c["K"], f"{c['rate']:g}", f"{c['state_aware']:.2f}", f"{c['eldr']:.2f}",
          f"{c['diff_ms']:+.2f} ± {c['diff_se_ms']:.2f}", f"{c['sa_wins']}/{c['n']}", "yes" if c["pass"] else "**no**"]
         for name, checks in (("median", dec["median"]), ("P99", dec["p99"])) for c in checks]))
    w("")


def _per_pool_tables(w: Writer, runs: list[dict], st: dict, wls: Sequence[str], pools: Sequence[int],
                     rates: Sequence[float], pols: Sequence[str]) -> None:
    """Every policy per workload and decode pool."""
    w("## Per workload and decode pool: all policies (simulated)\n")
    for wl in wls:
        for k in pools:
            w(f"### {wl}, {st['num_prefill']}P{k}D\n")
            cells = []
            for rate in rates:
                rows = {p: stats(runs, workload=wl, num_decode=k, rate=rate, policy=p) for p in pols}
                rows = {p: s for p, s in rows.items() if s}
                if not rows:
                    continue
                best_med = min(s["tpot_median_ms"] for s in rows.values())
                best_p99 = min(s["tpot_p99_ms"] for s in rows.values())
                for p, s in rows.items():
                    med, p99 = pm(s, "tpot_median_ms"), pm(s, "tpot_p99_ms")
                    if s["tpot_median_ms"] == best_med:
                        med = f"**{med}**"
                    if s["tpot_p99_ms"] == best_p99:
                        p99 = f"**{p99}**"
                    cells.append([f"{rate:g}", p, med, p99, pm(s, "unique_experts_per_step", 1), pm(s, "load_cv", 3),
                                  f"{s['mean_batch']:.1f}"])
            w(markdown_table(["req/s", "policy", "median TPOT ms", "P99 TPOT ms", "distinct experts/step/layer",
                              "load CV", "mean batch"], cells))
            w("")
    w("Bold: lowest seed-mean of the rate (the oracle included).\n")


def layer_summary(lay: dict, wl: str, k: int) -> str:
    """The ELDR artifact layers of (workload, K): the most common over the seeds, the others by seed."""
    by: dict[str, list[str]] = {}
    for key, layers in lay.items():
        name, kk, seed = key.split()
        if name == wl and kk == f"K={k}":
            by.setdefault(str(layers), []).append(seed.split("=")[1])
    if not by:
        return f"{wl} K={k}: n/a"
    common = max(by, key=lambda x: len(by[x]))
    rest = ", ".join(f"seed {'/'.join(sorted(v))}: {x}" for x, v in by.items() if x != common)
    return f"{wl} K={k}: {common}" + (f" ({rest})" if rest else "")


def verdict_text(doc: dict, dec: dict) -> str:
    """The verdict paragraph: the rule's outcome, where it fails and by how much, load CV, seeds."""
    runs = doc["runs"]
    med, p99 = dec["median"], dec["p99"]
    if not med:
        return "No runs at >= 60 req/s for both state_aware and ELDR yet: no verdict."
    med_fail = [c for c in med if not c["pass"]]
    p99_fail = [c for c in p99 if not c["pass"]]
    rel = lambda c: 100.0 * (c["state_aware"] - c["eldr"]) / c["eldr"]  # noqa: E731
    parts = []
    if dec["recommend"]:
        parts.append("**state_aware meets the rule: recommend it** (simulated). Its seed-mean median TPOT is below "
                     f"ELDR's at every one of the {len(med)} (workload, K, rate >= {DECISION_RATE:g}) points "
                     f"(by {min(-rel(c) for c in med):.1f}% to {max(-rel(c) for c in med):.1f}%) and its seed-mean "
                     f"P99 TPOT is never above ELDR's ({len(p99)} points).")
    else:
        parts.append("**state_aware does NOT meet the rule: keep ELDR (band rule) as the recommended policy and "
                     "state_aware as an option** (simulated).")
        if not dec["both_workloads"]:
            parts.append("Not both workloads were run, so the rule cannot pass.")
        parts.append(f"Median TPOT at >= {DECISION_RATE:g} req/s: better than ELDR at {len(med) - len(med_fail)} "
                     f"of {len(med)} points" + (": fails at " + ", ".join(
                         f"{c['workload']} K={c['K']} {c['rate']:g} req/s ({rel(c):+.1f}%)" for c in med_fail)
                         if med_fail else "") + ".")
        parts.append(f"P99 TPOT: not worse than ELDR at {len(p99) - len(p99_fail)} of {len(p99)} points"
                     + (": worse at " + ", ".join(f"{c['workload']} K={c['K']} {c['rate']:g} req/s ({rel(c):+.1f}%)"
                                                 for c in p99_fail) if p99_fail else "") + ".")
    wins = [c for c in med if c["pass"]]
    if wins and not dec["recommend"]:
        parts.append(f"Where it does beat ELDR's median the gain is {min(-rel(c) for c in wins):.1f}% to "
                     f"{max(-rel(c) for c in wins):.1f}%.")
    fails = med_fail + p99_fail
    noisy = [c for c in fails if abs(c["diff_ms"]) < 2 * c["diff_se_ms"]]
    if fails:
        parts.append(f"{len(noisy)} of the {len(fails)} failed check{'s' if len(fails) > 1 else ''} "
                     f"{'is' if len(noisy) == 1 else 'are'} within two standard errors of the paired per-seed "
                     "difference" + ("" if len(noisy) == len(fails) else
                                     f" ({len(fails) - len(noisy)} {'is' if len(fails) - len(noisy) == 1 else 'are'} "
                                     "outside it)") + "; the rule is applied to the seed means as written.")
    for c in med_fail:
        s_ = stats(runs, workload=c["workload"], num_decode=c["K"], rate=c["rate"], policy="state_aware")
        e_ = stats(runs, workload=c["workload"], num_decode=c["K"], rate=c["rate"], policy="eldr")
        parts.append(f"At {c['workload']} K={c['K']} {c['rate']:g} req/s: distinct experts/step/layer "
                     f"{s_['unique_experts_per_step']:.1f} (state_aware) vs {e_['unique_experts_per_step']:.1f} (ELDR), "
                     f"mean batch {s_['mean_batch']:.1f} vs {e_['mean_batch']:.1f}, load CV {s_['load_cv']:.3f} vs "
                     f"{e_['load_cv']:.3f}.")
    gains = [-rel(c) for c in p99]
    if gains:
        best = max(p99, key=lambda c: -rel(c))
        parts.append(f"P99 TPOT vs ELDR: {min(gains):.1f}% to {max(gains):.1f}% lower (negative = higher; largest at "
                     f"{best['workload']} K={best['K']} {best['rate']:g} req/s).")
    cv = {}
    for c in p99:
        for p in ("state_aware", "eldr"):
            s_ = stats(runs, workload=c["workload"], num_decode=c["K"], rate=c["rate"], policy=p)
            cv.setdefault(p, []).append(s_["load_cv"])
    if cv:
        parts.append(f"Load CV over the grid: state_aware {min(cv['state_aware']):.3f} to "
                     f"{max(cv['state_aware']):.3f}, ELDR {min(cv['eldr']):.3f} to {max(cv['eldr']):.3f}.")
    n_seeds = len({r["seed"] for r in runs})
    parts.append(f"All figures are seed means over {n_seeds} seeds of SIMULATED runs "
                 f"({doc['settings']['warmup_s']:g} s + {doc['settings']['measure_s']:g} s windows).")
    return " ".join(parts)
