"""State-aware decode routing vs ELDR and the baselines: SIMULATED sweep.

    .venv/bin/python -m benchmark.bench_state_aware            # full grid (about 35 min of one core)
    .venv/bin/python -m benchmark.bench_state_aware --quick    # smoke test (< 3 min; outputs under .cache/)
    .venv/bin/python -m benchmark.bench_state_aware --resume   # keep the points already in the JSON
    .venv/bin/python -m benchmark.bench_state_aware --render-only   # rewrite the markdown from the JSON

Grid: workloads task and language (measured traces under ``benchmark/traces``),
decode servers K in {8, 16, 24} with 8 prefill servers (as ``benchmark/report.py``'s
pool sweep), 20-100 req/s, seeds 0-4, policies round_robin, jsq, domain, eldr
(tau 0.1), state_aware and the oracle grouping. Seed ``s`` is the simulator's seed
(arrival times and which trace request each arrival replays; every policy sees the
same requests for a seed) AND the calibration seed of ``experiments.prepare_routing``
(ELDR artifact, oracle grouping) for each (workload, K).

``state_aware`` is built as the router builds it, its step law ``step_cost(params, len(layers),
expert_scale=params.num_experts / workload.num_experts)`` given as its parameters
(``build_policy("state_aware", PolicyContext(K, params=asdict(law)))``), fed the activations the
router would see (``prefill_activations`` of the evaluation traces on the ELDR
artifact's layers). Every number this writes is SIMULATED
(``eldr_sglang/sim/simulator.py`` + ``eldr_sglang/sim/cost_model.py``).

Outputs: ``benchmark/results/state_aware_sweep.json`` (every run's summary plus its
coordinates, the command, the settings; written after every run, so an
interrupted sweep keeps what it did) and ``benchmark/results/state_aware.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from benchmark.common import markdown_table, mean_sd, write_record
from eldr_sglang.sim import experiments
from eldr_sglang.core.policies import PolicyContext, build_policy
from eldr_sglang.sim.calibration import prefill_activations
from eldr_sglang.sim.cost_model import PARAM_SETS, get_params, step_cost
from eldr_sglang.sim.simulator import SimConfig, simulate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

POLICIES = ("round_robin", "jsq", "domain", "eldr", "state_aware", "oracle")
TAU = 0.1
NUM_PREFILL = 8  # report.py's pool sweep keeps its 8 prefill servers for every decode pool size
# Windows chosen from timing runs on this machine so that the full grid (900 runs) takes
# about 35 minutes of one core (see the estimate the script prints before it starts).
FULL_GRID = dict(pools=(8, 16, 24), rates=(20.0, 40.0, 60.0, 80.0, 100.0), seeds=5, warmup_s=15.0, measure_s=40.0)
QUICK_GRID = dict(pools=(8,), rates=(20.0, 80.0), seeds=2, warmup_s=3.0, measure_s=8.0)
DECISION_RATE = 60.0  # the rule compares median TPOT at rates >= this
GOODPUT_FACTOR = 1.25


# -- arguments ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_state_aware", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny grid (K=8, 20 and 80 req/s, 2 seeds, 3 s + 8 s windows); outputs under .cache/")
    ap.add_argument("--resume", action="store_true", help="keep the runs already in the JSON, run the rest")
    ap.add_argument("--redo", default="",
                    help="with --resume: run these policies' points again (comma-separated), e.g. after a policy "
                         "change; their old rows move to 'superseded_runs' in the JSON")
    ap.add_argument("--render-only", action="store_true", help="rewrite the markdown from the JSON; no simulation")
    ap.add_argument("--estimate-only", action="store_true", help="print the time estimate and stop")
    ap.add_argument("--workloads", default="task,language", help="comma-separated subset of task,language")
    ap.add_argument("--pools", default=None, help="decode pool sizes, e.g. 8,16,24")
    ap.add_argument("--rates", default=None, help="arrival rates (req/s), e.g. 20,40,60,80,100")
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1")
    ap.add_argument("--warmup-s", type=float, default=None, help="simulated warm-up seconds per run")
    ap.add_argument("--measure-s", type=float, default=None, help="simulated measured seconds per run")
    ap.add_argument("--cost", default="qwen3-30b-a3b-mi300x", help=f"cost-model parameter set: {', '.join(PARAM_SETS)}")
    ap.add_argument("--mean-prompt-tokens", type=float, default=600.0, help="as report.py (0: the traces' own)")
    ap.add_argument("--mean-output-tokens", type=float, default=300.0, help="as report.py (0: the traces' own)")
    ap.add_argument("--traces-root", type=Path, default=HERE / "traces")
    ap.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "bench_state_aware",
                    help="calibration artifacts and cached routing inputs")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where the JSON and markdown go (default: benchmark/results; --quick: <work-dir>/quick)")
    ap.add_argument("--budget-min", type=float, default=35.0, help="warn when the estimate exceeds this")
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = build_parser()
    a = ap.parse_args(argv)
    grid = QUICK_GRID if a.quick else FULL_GRID
    a.pool_list = tuple(int(x) for x in a.pools.split(",")) if a.pools else grid["pools"]
    a.rate_list = tuple(float(x) for x in a.rates.split(",")) if a.rates else grid["rates"]
    a.seed_list = tuple(range(a.seeds if a.seeds is not None else grid["seeds"]))
    a.warmup = a.warmup_s if a.warmup_s is not None else grid["warmup_s"]
    a.measure = a.measure_s if a.measure_s is not None else grid["measure_s"]
    a.workload_list = [w.strip() for w in a.workloads.split(",") if w.strip()]
    if not a.workload_list or any(w not in experiments.WORKLOADS for w in a.workload_list):
        ap.error(f"--workloads: choose from {', '.join(experiments.WORKLOADS)}")
    if a.cost not in PARAM_SETS:
        ap.error(f"--cost {a.cost!r} unknown")
    if not a.seed_list or not a.pool_list or not a.rate_list or a.measure <= 0 or a.warmup < 0:
        ap.error("empty grid or bad windows")
    a.redo_list = [x.strip() for x in a.redo.split(",") if x.strip()]
    if any(x not in POLICIES for x in a.redo_list):
        ap.error(f"--redo: choose from {', '.join(POLICIES)}")
    if a.redo_list and not a.resume:
        ap.error("--redo needs --resume")
    if a.out_dir is None:
        a.out_dir = a.work_dir / "quick" if a.quick else HERE / "results"
    a.json_path = a.out_dir / "state_aware_sweep.json"
    a.md_path = a.out_dir / "state_aware.md"
    return a


def settings_of(a: argparse.Namespace) -> dict:
    """What a run's numbers depend on (besides its coordinates); --resume insists they match."""
    return {"cost": a.cost, "num_prefill": NUM_PREFILL, "warmup_s": a.warmup, "measure_s": a.measure,
            "mean_prompt_tokens": a.mean_prompt_tokens, "mean_output_tokens": a.mean_output_tokens,
            "tau": TAU, "calib_pairs": experiments.FULL.calib_pairs, "calib_n_init": experiments.FULL.calib_n_init,
            "traces_root": str(a.traces_root)}


def git_state() -> dict:
    """HEAD and whether the code the runs use (eldr_sglang/) differs from it."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"head": git("rev-parse", "HEAD"),
            "code_modified": git("status", "--porcelain", "--", "eldr_sglang").splitlines()}


def key_of(r: dict) -> tuple:
    return (r["workload"], int(r["num_decode"]), float(r["rate"]), int(r["seed"]), r["policy"])


# -- routing inputs (cached) --------------------------------------------------------------------------------
def _fingerprint(*paths: Path) -> str:
    h = hashlib.sha1()
    for base in paths:
        for f in sorted(Path(base).rglob("*")):
            if f.is_file():
                st = f.stat()
                h.update(f"{f.relative_to(base)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def routing_for(data: experiments.WorkloadData, k: int, seed: int, a: argparse.Namespace) -> experiments.Routing:
    """``experiments.prepare_routing`` with calibration seed ``seed``, cached under the work dir."""
    fp = _fingerprint(a.traces_root / data.name)
    cache = a.work_dir / "routing" / f"{data.name}-K{k}-seed{seed}-{fp}-p{experiments.FULL.calib_pairs}.pkl"
    if cache.is_file():
        with open(cache, "rb") as f:
            return pickle.load(f)
    routing = experiments.prepare_routing(data, k, a.work_dir / f"seed{seed}", experiments.FULL, seed=seed)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(routing, f)
    os.replace(tmp, cache)
    return routing


# -- one run ------------------------------------------------------------------------------------------------
def run_point(data: experiments.WorkloadData, routing: experiments.Routing, acts: np.ndarray, policy: str,
              cfg: SimConfig) -> dict:
    if policy != "state_aware":
        row = experiments.run_one(data, routing, policy, cfg, TAU)
    else:
        params = get_params(cfg.cost)
        law = step_cost(params, len(routing.layers), expert_scale=params.num_experts / data.sim.num_experts)
        pol = build_policy("state_aware", PolicyContext(cfg.num_decode, params=asdict(law)))
        t0 = time.perf_counter()
        res = simulate(data.sim, pol, cfg, routing.eldr_signatures, activations=acts)
        row = dict(res.summary)
        row.update(workload=data.name, policy=policy, tau=None, rate=cfg.rate, num_decode=cfg.num_decode,
                   seed=cfg.seed, prefix_cached_fraction=cfg.prefix_cached_fraction,
                   wall_s=time.perf_counter() - t0)
        if any(s.live for s in pol.servers):
            raise RuntimeError("state_aware: a request was admitted and never released")
    row["calib_seed"] = cfg.seed
    row["layers"] = list(routing.layers)
    return row


def base_config(a: argparse.Namespace) -> SimConfig:
    return SimConfig(num_prefill=NUM_PREFILL, num_decode=a.pool_list[0], warmup_s=a.warmup, measure_s=a.measure,
                     cost=a.cost)


# -- time estimate ------------------------------------------------------------------------------------------
def estimate(a: argparse.Namespace, data: experiments.WorkloadData) -> dict:
    """Time short runs (ELDR and state_aware, each K, lowest and highest rate) and scale by simulated seconds.

    A run's wall time is about (steps in warm-up + window + drain) x cost per step; the
    drain after the last arrival is about one request's lifetime, taken as ``DRAIN_S``."""
    drain_s, w, m = 4.0, 5.0, 15.0
    per_sim_s = {}
    for k in a.pool_list:
        routing = routing_for(data, k, 0, a)
        acts = prefill_activations(data.evaluation, routing.layers)
        for rate in (min(a.rate_list), max(a.rate_list)):
            cfg = replace(base_config(a), num_decode=k, rate=rate, warmup_s=w, measure_s=m, seed=99)
            walls = []
            for pol in ("eldr", "state_aware"):
                t0 = time.perf_counter()
                run_point(data, routing, acts, pol, cfg)
                walls.append(time.perf_counter() - t0)
            per_sim_s[(k, rate)] = float(np.mean(walls)) / (w + m + drain_s)
    lo, hi = min(a.rate_list), max(a.rate_list)
    total = 0.0
    for k in a.pool_list:
        for rate in a.rate_list:
            f = 0.0 if hi == lo else (rate - lo) / (hi - lo)
            c = (1 - f) * per_sim_s[(k, lo)] + f * per_sim_s[(k, hi)]
            total += c * (a.warmup + a.measure + drain_s)
    total *= len(a.seed_list) * len(POLICIES) * len(a.workload_list)
    return {"estimate_s": total, "probe_s_per_simulated_s": {f"K={k} rate={r:g}": v for (k, r), v in per_sim_s.items()},
            "method": f"ELDR and state_aware runs of {w:g}+{m:g} s on workload {data.name}, "
                      f"scaled by (warm-up + window + {drain_s:g} s drain)"}


# -- saving -------------------------------------------------------------------------------------------------
def save(path: Path, doc: dict) -> None:
    write_record(path, doc)


# -- analysis -----------------------------------------------------------------------------------------------
METRICS = ("tpot_median_ms", "tpot_p99_ms", "unique_experts_per_step", "load_cv", "mean_batch")


def stats(runs: list[dict], **where) -> dict | None:
    rows = [r for r in runs if all(r.get(k) == v for k, v in where.items())]
    if not rows:
        return None
    out = {"n": len(rows), "seeds": sorted(r["seed"] for r in rows)}
    for m in METRICS + ("ttft_median_ms", "ttft_p99_ms"):
        out[m], out[m + "_sd"] = mean_sd(r[m] for r in rows)
    return out


def paired(runs: list[dict], metric: str, wl: str, k: int, rate: float, a: str = "state_aware", b: str = "eldr"):
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


def goodput(runs, wl, k, rates, policies) -> dict:
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


def decision(runs, workloads, pools, rates) -> dict:
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


def _header(w, doc: dict, st: dict, runs: list[dict], n_expected: int) -> None:
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


def _setup(w, doc: dict, st: dict, wls, pools, rates, seeds) -> None:
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


def _paired_table(w, runs: list[dict], wls, pools, rates) -> None:
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


def _goodput_table(w, runs: list[dict], wls, pools, rates, pols) -> None:
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


def _decision_table(w, dec: dict) -> None:
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


def _per_pool_tables(w, runs: list[dict], st: dict, wls, pools, rates, pols) -> None:
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


def resume_from(doc: dict, old: dict, a: argparse.Namespace, command: str) -> None:
    """``--resume``: the saved runs, sources, layers, times and history of ``old`` (``--redo``: the named
    policies' runs moved to ``superseded_runs``)."""
    doc["runs"] = old["runs"]
    doc["sources"].update(old.get("sources", {}))
    doc["layers"].update(old.get("layers", {}))
    doc["estimate"] = old.get("estimate")
    if "cpu_s" in old:
        doc["cpu_s"] = old["cpu_s"]
    doc["wall_s_previous"] = old.get("wall_s", 0.0) + old.get("wall_s_previous", 0.0)
    doc["commands_previous"] = old.get("commands_previous", []) + [old.get("command")]
    doc["git_previous"] = old.get("git_previous", []) + ([old["git"]] if old.get("git") else [])
    doc["superseded_runs"] = old.get("superseded_runs", [])
    doc["notes"] = old.get("notes", [])
    if a.redo_list:
        reason = f"superseded by a --redo run ({command})"
        doc["superseded_runs"] += [dict(r, superseded=reason) for r in doc["runs"] if r["policy"] in a.redo_list]
        doc["runs"] = [r for r in doc["runs"] if r["policy"] not in a.redo_list]
        print(f"--redo: {len(doc['superseded_runs'])} runs of {', '.join(a.redo_list)} moved to superseded_runs")
    print(f"resume: {len(doc['runs'])} runs already in {a.json_path}")


def simulate_points(a: argparse.Namespace, doc: dict, datas: dict, todo: list[tuple], t_start: float, c_start: float,
                    cpu_before: float) -> None:
    """Simulate every point still to do, saving the JSON after each."""
    from tqdm import tqdm

    routing_key, routing, acts = None, None, None
    bar = tqdm(todo, desc="simulate", file=sys.stderr, dynamic_ncols=True)
    for wl, k, seed, rate, p in bar:
        bar.set_postfix_str(f"{wl} K={k} s={seed} {rate:g}/s {p}")
        if routing_key != (wl, k, seed):
            routing = routing_for(datas[wl], k, seed, a)
            acts = prefill_activations(datas[wl].evaluation, routing.layers)
            routing_key = (wl, k, seed)
            doc["layers"][f"{wl} K={k} seed={seed}"] = list(routing.layers)
        cfg = replace(base_config(a), num_decode=k, rate=rate, seed=seed)
        row = run_point(datas[wl], routing, acts, p, cfg)
        if not row["conserved"]:
            raise RuntimeError(f"request conservation failed: {wl} K={k} seed={seed} rate={rate} {p}")
        doc["runs"].append(row)
        doc["wall_s"] = time.perf_counter() - t_start
        doc["cpu_s"] = cpu_before + time.process_time() - c_start
        save(a.json_path, doc)
    bar.close()


# -- main ---------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    argv_list = list(argv if argv is not None else sys.argv[1:])
    command = (".venv/bin/python -m benchmark.bench_state_aware " + " ".join(shlex.quote(x) for x in argv_list)).strip()
    settings = settings_of(a)
    grid = {"workloads": a.workload_list, "pools": list(a.pool_list), "rates": list(a.rate_list),
            "seeds": list(a.seed_list), "policies": list(POLICIES)}

    if a.render_only:
        doc = json.loads(a.json_path.read_text())
        a.md_path.write_text(render(doc))
        print(f"wrote {a.md_path}")
        return 0

    doc = {"simulated": True, "command": command, "settings": settings, "grid": grid, "runs": [],
           "sources": {}, "layers": {}, "complete": False}
    if a.resume and a.json_path.is_file():
        old = json.loads(a.json_path.read_text())
        if old.get("settings") != settings:
            print(f"--resume: settings in {a.json_path} differ from this run's:\n  {old.get('settings')}\n  {settings}",
                  file=sys.stderr)
            return 2
        resume_from(doc, old, a, command)
    doc["git"] = git_state()
    done = {key_of(r) for r in doc["runs"]}

    datas = {}
    for wl in a.workload_list:
        datas[wl] = experiments.load_workload(wl, a.traces_root, a.work_dir, experiments.FULL,
                                         a.mean_prompt_tokens or None, a.mean_output_tokens or None)
        doc["sources"][wl] = datas[wl].source
        if "SYNTHETIC" in datas[wl].source:
            print(f"WARNING: {wl}: {datas[wl].source}", file=sys.stderr)

    points = [(wl, k, seed, rate, p) for wl in a.workload_list for k in a.pool_list for seed in a.seed_list
              for rate in a.rate_list for p in POLICIES]
    todo = [pt for pt in points if (pt[0], pt[1], pt[3], pt[2], pt[4]) not in done]

    if not a.resume or not doc.get("estimate") or a.estimate_only:
        t0 = time.perf_counter()
        est = estimate(a, datas[a.workload_list[0]])
        est["probe_wall_s"] = time.perf_counter() - t0
        doc["estimate"] = est
    est = doc["estimate"]
    remaining = est["estimate_s"] * len(todo) / max(len(points), 1)
    print(f"grid: {len(points)} runs ({len(todo)} to do), windows {a.warmup:g} s + {a.measure:g} s; "
          f"estimated {est['estimate_s'] / 60:.1f} min for the whole grid, {remaining / 60:.1f} min for what is "
          f"left, plus calibration (~1-2 s per workload, K, seed)", flush=True)
    if est["estimate_s"] > 60 * a.budget_min:
        print(f"WARNING: estimate exceeds the {a.budget_min:g} min budget; shorten --measure-s/--warmup-s",
              file=sys.stderr)
    if a.estimate_only:
        return 0

    t_start, c_start = time.perf_counter(), time.process_time()
    cpu_before = doc.get("cpu_s", 0.0) if a.resume else 0.0
    simulate_points(a, doc, datas, todo, t_start, c_start, cpu_before)
    doc["wall_s"] = time.perf_counter() - t_start
    doc["cpu_s"] = cpu_before + time.process_time() - c_start
    doc["complete"] = {key_of(r) for r in doc["runs"]} >= {(w, k, r, s, p) for w, k, s, r, p in points}
    save(a.json_path, doc)
    a.md_path.write_text(render(doc))
    dec = decision(doc["runs"], a.workload_list, a.pool_list, a.rate_list)
    print(f"simulated {len(todo)} runs in {doc['wall_s'] / 60:.1f} min; wrote {a.json_path} and {a.md_path}")
    print("verdict:", "recommend state_aware" if dec["recommend"] else "keep ELDR; state_aware stays an option")
    return 0


if __name__ == "__main__":
    sys.exit(main())
