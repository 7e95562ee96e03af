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
interrupted sweep keeps what it did) and ``benchmark/results/state_aware.md`` (analysis, decision
rule and page: ``benchmark/state_aware_report.py``; calibration cache: ``benchmark/routing_cache.py``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from benchmark.common import write_record
from benchmark.routing_cache import routing_for
from benchmark.state_aware_report import POLICIES, decision, key_of, render
from eldr_sglang.sim import experiments
from eldr_sglang.core.policies import PolicyContext, build_policy
from eldr_sglang.sim.calibration import prefill_activations
from eldr_sglang.sim.cost_model import PARAM_SETS, get_params, step_cost
from eldr_sglang.sim.simulator import SimConfig, simulate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

TAU = 0.1
NUM_PREFILL = 8  # report.py's pool sweep keeps its 8 prefill servers for every decode pool size
# Windows chosen from timing runs on this machine so that the full grid (900 runs) takes
# about 35 minutes of one core (see the estimate the script prints before it starts).
FULL_GRID = dict(pools=(8, 16, 24), rates=(20.0, 40.0, 60.0, 80.0, 100.0), seeds=5, warmup_s=15.0, measure_s=40.0)
QUICK_GRID = dict(pools=(8,), rates=(20.0, 80.0), seeds=2, warmup_s=3.0, measure_s=8.0)


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


# -- the record ---------------------------------------------------------------------------------------------
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
        write_record(a.json_path, doc)
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
    write_record(a.json_path, doc)
    a.md_path.write_text(render(doc))
    dec = decision(doc["runs"], a.workload_list, a.pool_list, a.rate_list)
    print(f"simulated {len(todo)} runs in {doc['wall_s'] / 60:.1f} min; wrote {a.json_path} and {a.md_path}")
    print("verdict:", "recommend state_aware" if dec["recommend"] else "keep ELDR; state_aware stays an option")
    return 0


if __name__ == "__main__":
    sys.exit(main())
