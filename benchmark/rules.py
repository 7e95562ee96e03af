"""The default-policy decision rule (``python -m benchmark.bench_default_policy``) and goodput.

The checks of the rule run on simulated rows (one per experiment, workload, decode pool, load, seed and
policy); ``decide`` applies them, ``headline_lines`` states its verdict and headline ranges (the default
policy's results page and RESULTS.md quote them). ``goodput_of``: the highest load whose P99 TPOT meets a
target, shared with the simulated report.
"""

from __future__ import annotations

import numpy as np

from eldr_sglang.core.policies.eldr_balanced import (BALANCED_COST, DEFAULT_COST_BAND, DEFAULT_COST_BAND_FULL,
                                                     DEFAULT_LOAD_CAP, DEFAULT_LOAD_SLACK)
from eldr_sglang.sim import experiments

CANDIDATE = "eldr_balanced"
BALANCERS = ("round_robin", "jsq")
GOODPUT_POLICIES = ("round_robin", "jsq", "eldr", CANDIDATE)


def default_rule() -> str:
    """The default ``eldr_balanced`` rule in one clause, from its constants (RESULTS.md and
    ``bench_locality``'s page quote it)."""
    return (f"a server takes the request while it holds fewer than ceil({DEFAULT_LOAD_CAP:g} x mean + "
            f"{DEFAULT_LOAD_SLACK:g}) in flight; among those, the servers within {100 * DEFAULT_COST_BAND:g}% of the "
            "cheapest state-aware cost (the step-time law priced on each server's live batch; "
            f"{100 * DEFAULT_COST_BAND_FULL:g}% once the mean in flight reaches a full batch, "
            f"{BALANCED_COST.max_batch}: requests queue and a step's distinct experts set the throughput); of those, "
            "the one whose calibration region is most similar to the request")


def key(r: dict) -> tuple:
    return (r["experiment"], r["workload"], int(r["num_decode"]), float(r["rate"]), int(r["seed"]), r["policy"])


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


def per_seed(runs, exp, wl, k, rate, policy, metric) -> dict:
    return {r["seed"]: r[metric] for r in runs if key(r)[:4] == (exp, wl, k, rate) and r["policy"] == policy}


def mean_of(runs, exp, wl, k, rate, policy, metric) -> float:
    v = list(per_seed(runs, exp, wl, k, rate, policy, metric).values())
    return float(np.mean(v)) if v else float("nan")


def diff(runs, exp, wl, k, rate, metric, other) -> dict:
    """Paired per-seed candidate - ``other`` (``other`` may be 'best_lb': the balancer with the
    lower seed-mean ``metric``)."""
    if other == "best_lb":
        other = min(BALANCERS, key=lambda p: np.mean(list(per_seed(runs, exp, wl, k, rate, p, metric).values())))
    c, o = per_seed(runs, exp, wl, k, rate, CANDIDATE, metric), per_seed(runs, exp, wl, k, rate, other, metric)
    s = sorted(set(c) & set(o))
    d = np.array([c[i] - o[i] for i in s])
    se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else 0.0
    return {"vs": other, "cand": float(np.mean([c[i] for i in s])), "other": float(np.mean([o[i] for i in s])),
            "diff": float(d.mean()), "se": se, "n": int(d.size)}


def goodputs(runs, wl, k, target) -> dict:
    out = {}
    for p in GOODPUT_POLICIES:
        by_seed = {}
        for r in runs:
            if r["experiment"] == "goodput" and r["workload"] == wl and r["policy"] == p:
                by_seed.setdefault(r["seed"], []).append(r)
        out[p] = {s: goodput_of(rows, target)[0] for s, rows in sorted(by_seed.items())}
    return out


def decide(runs: list[dict], g: dict, wls: list[str]) -> dict:
    checks = []

    def add(rule, where, ok, d, note=""):
        checks.append({"rule": rule, "where": where, "pass": bool(ok), **d, "note": note})

    for wl in wls:
        for k in g["pools"]:
            for rate in g["rates"]:
                w = f"{wl} K={k} {rate:g} req/s"
                m = diff(runs, "grid", wl, k, rate, "tpot_median_ms", "best_lb")
                add(1, w, m["diff"] < 0, m, "median < best balancer")
                if rate >= 40:
                    e = diff(runs, "grid", wl, k, rate, "tpot_median_ms", "eldr")
                    add(1, w, e["diff"] <= 2 * e["se"], e, "median within 2 SE of eldr or better")
                p = diff(runs, "grid", wl, k, rate, "tpot_p99_ms", "best_lb")
                add(2, w, p["diff"] <= 2 * p["se"], p, "P99 within 2 SE of best balancer or better")
                if wl == "task" and rate >= 60:
                    dm = diff(runs, "grid", wl, k, rate, "tpot_median_ms", "domain")
                    add(5, w, dm["diff"] <= 2 * dm["se"], dm, "median within 2 SE of domain or better")
                    o = diff(runs, "grid", wl, k, rate, "tpot_median_ms", "oracle")
                    lb = m["other"]
                    share = 100.0 * (m["other"] - m["cand"]) / max(lb - o["other"], 1e-9)
                    add(5, w, share >= 90.0, {"vs": "oracle", "cand": m["cand"], "other": o["other"],
                                              "diff": share, "se": 0.0, "n": o["n"]},
                        "share of the oracle's median gain over the best balancer (%)")
        for t in experiments.FULL.goodput_targets_ms:
            gp = goodputs(runs, wl, g["goodput_k"], t)
            lb = max(BALANCERS, key=lambda p: np.mean(list(gp[p].values())))
            d = np.array([gp[CANDIDATE][s] - gp[lb][s] for s in gp[CANDIDATE]])
            se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else 0.0
            cand, other = float(np.mean(list(gp[CANDIDATE].values()))), float(np.mean(list(gp[lb].values())))
            add(3, f"{wl} goodput P99 <= {t:g} ms", cand >= other,
                {"vs": lb, "cand": cand, "other": other, "diff": float(d.mean()), "se": se, "n": int(d.size)},
                f"goodput req/s >= best balancer (eldr {np.mean(list(gp['eldr'].values())):.0f})")
        for rate in g["shift_rates"]:
            w = f"{wl} mix shift K={g['shift_k']} {rate:g} req/s"
            for metric in ("load_cv", "tpot_p99_ms"):
                d = diff(runs, "shift", wl, g["shift_k"], rate, metric, "jsq")
                add(4, w, d["diff"] <= 2 * d["se"], d, f"{metric} within 2 SE of jsq or better")
    failed = [c for c in checks if not c["pass"]]
    unreachable = [c for c in failed if c["rule"] == 4 and c["note"].startswith("load_cv")]
    return {"checks": checks, "failed": failed, "unreachable": unreachable,
            "all_pass": not failed, "default": all(c in unreachable for c in failed)}


def headline_lines(doc: dict) -> list[str]:
    """The verdict and the headline ranges (RESULTS.md and the README quote these)."""
    dec, runs, g = doc["decision"], doc["runs"], doc["grid"]
    pct = lambda c: -100.0 * c["diff"] / c["other"]  # noqa: E731  (positive = eldr_balanced better)
    rows = lambda rule, note: [c for c in dec["checks"] if c["rule"] == rule and c["note"].startswith(note)]  # noqa: E731
    rng = lambda cs: f"{min(map(pct, cs)):+.1f} to {max(map(pct, cs)):+.1f}%" if cs else "n/a"  # noqa: E731
    n, failed = len(dec["checks"]), dec["failed"]
    out = [f"- verdict: " + (f"all {n} checks of the decision rule pass" if not failed else
                             f"{len(failed)} of {n} checks fail: " + "; ".join(
                                 f"rule {c['rule']} at {c['where']} ({c['note']}: {c['cand']:.3f} vs {c['vs']} "
                                 f"{c['other']:.3f}, diff {c['diff']:+.3f}, SE {c['se']:.3f})" for c in failed)),
           f"- median TPOT better than the best balancer by {rng(rows(1, 'median <'))} over "
           f"{len(rows(1, 'median <'))} points (K = {', '.join(map(str, g['pools']))}; "
           f"{', '.join(f'{r:g}' for r in g['rates'])} req/s; both workloads); than ELDR's band rule by "
           f"{rng(rows(1, 'median within'))} at >= 40 req/s",
           f"- P99 TPOT better than the best balancer by {rng(rows(2, 'P99'))}"]
    for wl in g["workloads"]:
        cells = []
        for t in experiments.FULL.goodput_targets_ms:
            gp = goodputs(runs, wl, g["goodput_k"], t)
            m = {p: np.mean(list(v.values())) for p, v in gp.items()}
            cells.append(f"P99 <= {t:g} ms: {m[CANDIDATE]:.0f} req/s vs best balancer "
                         f"{max(m[p] for p in BALANCERS):.0f}, eldr {m['eldr']:.0f}")
        out.append(f"- goodput, {wl}: " + "; ".join(cells))
        for rate in g["shift_rates"][-1:]:
            f_ = lambda p, m: mean_of(runs, "shift", wl, g["shift_k"], rate, p, m)  # noqa: E731
            rr = f_("round_robin", "unique_experts_per_step")
            out.append(f"- mix shift, {wl}, {rate:g} req/s: P99 TPOT {f_(CANDIDATE, 'tpot_p99_ms'):.2f} ms vs jsq "
                       f"{f_('jsq', 'tpot_p99_ms'):.2f} and eldr {f_('eldr', 'tpot_p99_ms'):.2f}; max/mean load "
                       f"{f_(CANDIDATE, 'load_max_over_mean'):.2f} (eldr {f_('eldr', 'load_max_over_mean'):.2f}); "
                       f"{100 * (rr - f_(CANDIDATE, 'unique_experts_per_step')) / rr:.1f}% fewer distinct experts "
                       f"than round robin (eldr {100 * (rr - f_('eldr', 'unique_experts_per_step')) / rr:.1f}%)")
    return out
