"""The simulation grid: sweep definitions and runners for the SIMULATED evaluation
(``benchmark/report.py``, ``benchmark/bench_state_aware.py``, ``benchmark/bench_default_policy.py`` ...).

Data: measured traces under ``<traces-root>/<workload>/{calib,eval}/`` when present,
otherwise synthetic traces (``eldr_sglang.core.synthetic``, clearly labelled).
Routing inputs per (workload, decode pool size K) come from
:mod:`eldr_sglang.sim.calibration` (the operator calibration command, the oracle
grouping, the Domain map); runs use :func:`eldr_sglang.sim.simulator.simulate`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from eldr_sglang.core.policies import make_policy, policies_of, policy_spec
from eldr_sglang.core.policies.params import params_for
from eldr_sglang.core.synthetic import make_synthetic_traces
from eldr_sglang.core.traces import TraceSet, load_traces, write_traces
from eldr_sglang.sim.calibration import calibrate_artifact, domain_map, eldr_signatures, oracle_grouping
from eldr_sglang.sim.simulator import SimConfig, simulate
from eldr_sglang.sim.workload import SimWorkload, build_workload, label_kind_for

WORKLOADS = ("task", "language")
# from the registry (registration order): the load balancers, the label and similarity policies,
# and the simulator's oracle grouping (eldr on the labels' centroids); the cost policies have
# their own sweeps (benchmark/bench_state_aware.py, bench_default_policy.py)
LOAD_BALANCERS = policies_of("balancer")
POLICIES = policies_of("balancer", "label", "similarity") + ("oracle",)

# synthetic stand-ins: the task workload's structure follows the task label, the language
# workload's mostly the language label (weaker, as the paper measured)
SYNTHETIC_STRENGTH = {"task": dict(task_strength=2.0, language_strength=0.5),
                      "language": dict(task_strength=0.5, language_strength=1.5)}


@dataclass(frozen=True)
class SweepConfig:
    """Everything one report run simulates."""

    name: str
    base: SimConfig
    loads: tuple[float, ...]
    policies: tuple[str, ...]
    main_decode: int
    pools: tuple[int, ...]
    pool_rate_per_server: float
    taus: tuple[float, ...]
    tau_rate: float
    default_tau: float
    prefix_fraction: float
    prefix_rate: float
    prefix_policies: tuple[str, ...]
    speed_check: tuple[int, float, float]  # (decode servers, req/s, seconds simulated)
    synthetic: dict = field(default_factory=dict)
    seeds: tuple[int, ...] = (0,)
    calib_pairs: int = 20_000
    calib_n_init: int = 3
    # goodput: loads up to decode saturation (batches of 64-256 per server); prefill is
    # scaled out so that it never is the bottleneck, and shorter windows keep it affordable
    goodput_rates: tuple[float, ...] = ()
    goodput_policies: tuple[str, ...] = ("round_robin", "jsq", "domain", "eldr")
    goodput_prefill: int = 24
    goodput_window: tuple[float, float] = (20.0, 40.0)  # (warm-up s, measured s)
    goodput_targets_ms: tuple[float, ...] = ()  # P99 TPOT targets


FULL = SweepConfig(
    name="full",
    base=SimConfig(num_prefill=8, num_decode=16, warmup_s=20.0, measure_s=60.0),
    loads=(20.0, 40.0, 60.0, 80.0, 100.0), policies=POLICIES, main_decode=16,
    pools=(8, 16, 24), pool_rate_per_server=5.0,
    taus=(0.0, 0.05, 0.1, 0.2, 0.5, 1.0), tau_rate=80.0, default_tau=0.1,
    prefix_fraction=0.5, prefix_rate=80.0, prefix_policies=("round_robin", "jsq", "eldr"),
    speed_check=(24, 100.0, 150.0),
    synthetic=dict(n_requests=8000, num_layers=8, num_experts=128, top_k=8, n_informative=4),
    goodput_rates=(100.0, 200.0, 300.0, 350.0, 400.0, 450.0, 500.0, 550.0, 600.0),
    goodput_targets_ms=(25.0, 40.0),
)

QUICK = SweepConfig(
    name="quick",
    base=SimConfig(num_prefill=2, num_decode=4, warmup_s=2.0, measure_s=8.0),
    loads=(4.0, 8.0), policies=POLICIES, main_decode=4,
    pools=(2, 4), pool_rate_per_server=2.0,
    taus=(0.0, 0.1, 1.0), tau_rate=8.0, default_tau=0.1,
    prefix_fraction=0.5, prefix_rate=8.0, prefix_policies=("round_robin", "eldr"),
    speed_check=(4, 8.0, 10.0),
    synthetic=dict(n_requests=600, num_layers=4, num_experts=32, top_k=4, n_informative=2),
    calib_pairs=2000, calib_n_init=1,
    goodput_rates=(8.0, 16.0, 32.0), goodput_policies=("round_robin", "eldr"), goodput_prefill=4,
    goodput_window=(2.0, 6.0), goodput_targets_ms=(15.0,),
)


@dataclass
class WorkloadData:
    """One workload's two splits, where they came from, and the simulated requests."""

    name: str
    source: str  # "measured traces (<path>)" or "SYNTHETIC ..."
    calib: TraceSet
    evaluation: TraceSet
    calib_dir: Path
    sim: SimWorkload


def load_workload(name: str, traces_root: Path, work_dir: Path, sweep: SweepConfig,
                  mean_prompt: float | None, mean_output: float | None, seed: int = 0) -> WorkloadData:
    """Measured traces when ``traces_root/name/{calib,eval}`` exist, else synthetic ones."""
    calib_dir, eval_dir = traces_root / name / "calib", traces_root / name / "eval"
    if calib_dir.is_dir() and eval_dir.is_dir():
        calib, evaluation = load_traces(calib_dir), load_traces(eval_dir)
        source = f"measured traces ({traces_root / name}, model {calib.model.name})"
    else:
        syn = dict(sweep.synthetic)
        n = syn.pop("n_requests")
        traces = make_synthetic_traces(n, include_gates=False, seed=seed + (0 if name == "task" else 1),
                                       model_name=f"synthetic-{name}", **syn, **SYNTHETIC_STRENGTH[name]).traces
        calib, evaluation = traces.subset(slice(0, n // 2)), traces.subset(slice(n // 2, n))
        calib_dir = work_dir / "synthetic-traces" / name / "calib"
        if not calib_dir.is_dir():
            write_traces(calib, calib_dir)
        m = traces.model
        source = (f"SYNTHETIC traces (no {traces_root / name}/{{calib,eval}}; "
                  f"eldr_sglang.core.synthetic, {n} requests, L={m.num_layers}, E={m.num_experts}, top-{m.top_k})")
    sim = build_workload(evaluation, label_kind_for(evaluation, name), name, mean_prompt, mean_output)
    return WorkloadData(name, source, calib, evaluation, Path(calib_dir), sim)


@dataclass
class Routing:
    """Per (workload, K): ELDR artifact + signatures, oracle grouping, Domain map."""

    eldr_centroids: np.ndarray
    eldr_signatures: np.ndarray
    layers: list[int]
    oracle_centroids: np.ndarray
    oracle_signatures: np.ndarray
    domain: dict


def prepare_routing(data: WorkloadData, clusters: int, work_dir: Path, sweep: SweepConfig, seed: int = 0) -> Routing:
    out = work_dir / "artifacts" / f"{data.name}-K{clusters}-seed{seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    art = calibrate_artifact(data.calib_dir, clusters, out, seed=seed, pairs=sweep.calib_pairs,
                             n_init=sweep.calib_n_init, log=out.with_suffix(".log"))
    oracle = oracle_grouping(data.calib, data.evaluation, clusters, seed=seed, n_init=sweep.calib_n_init)
    return Routing(art.centroids, eldr_signatures(art, data.evaluation), art.layers,
                   oracle.centroids, oracle.signatures, domain_map(data.sim.labels, clusters))


def run_one(data: WorkloadData, routing: Routing, policy: str, config: SimConfig, tau: float,
            params: Optional[Mapping[str, Any]] = None) -> dict:
    """One SIMULATED run; returns its summary plus the sweep coordinates. ``params``: policy
    parameters as the router's ``--policy-param`` gives them (each policy takes those it declares)."""
    k = config.num_decode
    name = "eldr" if policy == "oracle" else policy
    prm = params_for(policy_spec(name).params, params)
    if policy == "oracle":
        pol = make_policy("eldr", k, centroids=routing.oracle_centroids, tau=tau, seed=config.seed, params=prm)
        sigs = routing.oracle_signatures
    else:
        pol = make_policy(policy, k, centroids=routing.eldr_centroids, tau=tau, domain_map=routing.domain,
                          seed=config.seed, params=prm)
        sigs = routing.eldr_signatures
    t0 = time.perf_counter()
    res = simulate(data.sim, pol, config, sigs)
    summary = dict(res.summary)
    summary.update(workload=data.name, policy=policy, tau=tau if policy in ("eldr", "oracle") else None,
                   rate=config.rate, num_decode=k, seed=config.seed,
                   prefix_cached_fraction=config.prefix_cached_fraction, wall_s=time.perf_counter() - t0)
    return summary


def plan(sweep: SweepConfig) -> list[tuple[str, str, SimConfig, float]]:
    """(experiment, policy, config, tau) for every run of the sweep, per workload."""
    base, runs = sweep.base, []
    for seed in sweep.seeds:
        b = replace(base, seed=seed, num_decode=sweep.main_decode)
        for rate in sweep.loads:
            runs += [("load", p, replace(b, rate=rate), sweep.default_tau) for p in sweep.policies]
        runs += [("tau", "eldr", replace(b, rate=sweep.tau_rate), t) for t in sweep.taus]
        for k in sweep.pools:
            cfg = replace(b, num_decode=k, rate=sweep.pool_rate_per_server * k)
            runs += [("pool", p, cfg, sweep.default_tau) for p in ("round_robin", "eldr")]
        for frac in (0.0, sweep.prefix_fraction):
            cfg = replace(b, rate=sweep.prefix_rate, prefix_cached_fraction=frac)
            runs += [("prefix", p, cfg, sweep.default_tau) for p in sweep.prefix_policies]
        warm, window = sweep.goodput_window
        for rate in sweep.goodput_rates:
            cfg = replace(b, rate=rate, num_prefill=sweep.goodput_prefill, warmup_s=warm, measure_s=window)
            runs += [("goodput", p, cfg, sweep.default_tau) for p in sweep.goodput_policies]
    return runs


POOL_STATE: dict = {}  # what forked workers read: workload data and routing per (seed, K)


def calibrate_task(task: tuple[str, int, int]):
    name, k, seed = task
    st = POOL_STATE
    return task, prepare_routing(st["data"][name], k, st["work_dir"], st["sweep"], seed=seed)


def simulate_task(task: tuple[str, str, str, object, float]) -> dict:
    name, exp, policy, cfg, tau = task
    st = POOL_STATE
    row = run_one(st["data"][name], st["routing"][(name, cfg.seed, cfg.num_decode)], policy, cfg, tau)
    row["experiment"] = exp
    return row


def pool_map(fn, tasks: list, jobs: int, desc: str):
    """``fn`` over ``tasks`` in ``jobs`` forked processes (in order), with a progress bar."""
    import multiprocessing

    from tqdm import tqdm

    if jobs <= 1:
        return [fn(t) for t in tqdm(tasks, desc=desc, file=sys.stderr)]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return list(tqdm(pool.imap(fn, tasks, chunksize=1), total=len(tasks), desc=desc, file=sys.stderr))
