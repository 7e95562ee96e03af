"""Does the default keep the oracle's locality without giving up balance? SIMULATED.

    .venv/bin/python -m benchmark.bench_locality --quick          # smoke run (< 1 min; .cache/bench-quick/locality)
    .venv/bin/python -m benchmark.bench_locality --seeds 5        # the figures in RESULTS.md
    .venv/bin/python -m benchmark.bench_locality --variants 'eldr_balanced:sim_band=none,load_cap=none' ...

Every number is SIMULATED (``eldr_sglang/sim/simulator.py`` + ``cost_model.py``, cost set
``qwen3-30b-a3b-mi300x``) on the measured expert traces of the tiny trained MoE
(``benchmark/traces``: task and language); the decisions are made by the policy objects of
``eldr_sglang.core.policies`` built through the registry (``build_policy``), as the router
builds them, with the step law mapped onto the trace model (as ``bench_default_policy.py``).
Routed requests are the evaluation split: held out from calibration.

Per policy variant and workload (16 decode servers; seed s = arrival/replay seed and
calibration seed):

* **locality**: distinct experts per decode step (published-layer average of the simulator)
  vs round robin at equal load (same arrivals, same requests, same req/s), at 20, 60, 100
  req/s with 8 prefill servers; as % of the label oracle's reduction (``domain``: servers
  partitioned by the true label) and of ``eldr``'s; the share of decisions that went to the
  most similar region;
* **TPOT**: median / P99 at those loads and near saturation (24 prefill servers, 450-550 req/s);
* **burst**: 70% of arrivals of one label (the least frequent) for 10 s of every 30 s;
  **shift**: calibrated without that label, served the calibrated mix until 20 s, then 70%
  of that label for good; at 100, 450 and 550 req/s: max/mean in flight (per-server mean
  in-flight count over the measured window, max over servers / mean; and the worst 1-s
  window), exceptions a decision raised (counted, then least loaded) and counted fallbacks.

Decision rules checked on seed means (paired per-seed differences, sd over seeds shown):
(a) reduction >= 90% of the label oracle's and >= eldr's at every locality load, both
workloads; (b) max/mean in flight <= 1.5 (worst 1-s window) and 0 exceptions under burst and
shift; (c) near saturation median TPOT <= 1.02 x eldr's; (d) median TPOT below the best
balancer (round robin, JSQ) at every load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from benchmark.common import command_line, markdown_table, quick_out, write_record
from benchmark import bench_state_aware as grid_bench
from benchmark.routing_cache import routing_for
from benchmark.rules import default_rule
from eldr_sglang.core.policies import Policy, PolicyContext, build_policy, least_loaded
from eldr_sglang.core.policies.eldr import CentroidOwnership
from eldr_sglang.core.traces import write_traces
from eldr_sglang.sim import experiments
from eldr_sglang.sim.calibration import calibrate_artifact, eldr_signatures, prefill_activations
from eldr_sglang.sim.cost_model import get_params, step_cost
from eldr_sglang.sim.simulator import SimConfig, simulate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TAU = 0.1
BALANCERS = ("round_robin", "jsq")
REFS = ("round_robin", "jsq", "domain", "eldr")
OLD_DEFAULT = "eldr_balanced:sim_band=none,load_cap=none,cost_band=0.02,cost_band_full=none"
LOCALITY_PICK = "eldr_balanced:sim_band=0.05,sim_band_full=0.15"
FIXED_BAND = "eldr_balanced:cost_band_full=none"  # today's rule with its 5% band at every load
DEFAULT_VARIANTS = (OLD_DEFAULT, LOCALITY_PICK, FIXED_BAND, "eldr_balanced")
BURST_SHARE, BURST_ON, BURST_PERIOD = 0.7, 10.0, 30.0
SHIFT_AT = 20.0

FULL = dict(k=16, prefill=8, loc_rates=(20.0, 60.0, 100.0), loc_window=(15.0, 40.0),
            sat_prefill=24, sat_rates=(450.0, 500.0, 550.0), sat_window=(20.0, 40.0),
            stress_rates=(100.0, 450.0, 550.0), stress_window=(10.0, 60.0), seeds=3)
QUICK = dict(k=8, prefill=4, loc_rates=(20.0, 60.0), loc_window=(3.0, 8.0),
             sat_prefill=12, sat_rates=(250.0,), sat_window=(3.0, 8.0),
             stress_rates=(250.0,), stress_window=(10.0, 30.0), seeds=1)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_locality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 decode servers, 1 seed, short windows (< 1 min)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 3; --quick 1)")
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                    help="policies under test: NAME or NAME:PARAM=VALUE,... (eldr_balanced's parameters); "
                         f"default: the rule of wave 3 ({OLD_DEFAULT}), the locality pick ({LOCALITY_PICK}), "
                         f"today's rule without its queue band ({FIXED_BAND}) and today's default")
    ap.add_argument("--stress-variants", nargs="*", default=None,
                    help="the variants run under burst and shift (default: today's default only)")
    ap.add_argument("--workloads", default="task,language")
    ap.add_argument("--experiments", default="locality,saturation,burst,shift")
    ap.add_argument("--out-dir", type=Path, default=None, help="default benchmark/results (--quick: .cache/...)")
    ap.add_argument("--render-only", action="store_true", help="rewrite locality.md from locality.json")
    ap.add_argument("--traces-root", type=Path, default=HERE / "traces")
    ap.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "bench_state_aware",
                    help="calibration artifacts (shared with bench_state_aware.py)")
    return ap


# -- policies -----------------------------------------------------------------------------------------------
def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    params = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, params


def trace_law(cost: str, layers: int, num_experts: int) -> dict:
    """The router's step law for the simulated cost set, mapped onto the trace model (published
    layers, target experts per trace expert, an average sequence's KV read)."""
    p = get_params(cost)
    sc = step_cost(p, layers, expert_scale=p.num_experts / num_experts, context_tokens=600.0 + 300.0 / 2)
    return dict(base_s=sc.base_s, per_seq_s=sc.per_seq_s, per_expert_s=sc.per_expert_s, max_batch=sc.max_batch)


def make(spec: str, k: int, routing, data, cfg: SimConfig) -> Policy:
    name, params = parse_variant(spec)
    ctx = dict(seed=cfg.seed, tau=TAU, centroids=routing.eldr_centroids, domain_map=routing.domain)
    if name == "oracle":
        name, ctx["centroids"] = "eldr", routing.oracle_centroids
    if name == "eldr_balanced":
        params = {**trace_law(cfg.cost, len(routing.layers), data.sim.num_experts), **params}
    return build_policy(name, PolicyContext(k, params=params or None, **ctx))


class Probe(Policy):
    """Wraps a policy: counts exceptions (then least loaded, as the router does) and decisions
    that went to the most similar region."""

    def __init__(self, inner: Policy, ownership: CentroidOwnership) -> None:
        self.inner, self.own = inner, ownership
        self.name = inner.name
        self.needs_signature = True
        self.uses_activation = getattr(inner, "uses_activation", False)
        self.uses_counts = getattr(inner, "uses_counts", False)
        self.exceptions = self.home = self.decisions = 0

    def choose(self, request, loads, allowed=None) -> int:
        try:
            idx = self.inner.choose(request, loads, allowed)
        except Exception:  # noqa: BLE001  (counted; the router falls back the same way)
            self.exceptions += 1
            idx = least_loaded(loads, np.arange(len(loads)))
        if request.signature is not None:
            ss = self.own.server_similarity(np.asarray(request.signature, dtype=np.float32))
            self.home += bool(ss[idx] >= ss.max() - 1e-6)
            self.decisions += 1
        return idx

    def admit(self, index, request):
        return self.inner.admit(index, request)

    def release(self, token) -> None:
        self.inner.release(token)


# -- traffic ------------------------------------------------------------------------------------------------
def rows_for(kind: str, labels: np.ndarray, label: str):
    """Row picker (simulate's ``rows``) of a stress scenario."""
    hot = np.flatnonzero(labels == label)
    rest = np.flatnonzero(labels != label)
    every = np.arange(labels.size)

    def rows(arrivals: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if kind == "burst":
            on = (arrivals % BURST_PERIOD) < BURST_ON
            normal = every
        else:  # shift: the calibrated mix (without the label) until SHIFT_AT, then 70% of it for good
            on = arrivals >= SHIFT_AT
            normal = rest
        out = normal[rng.integers(normal.size, size=arrivals.size)]
        take = on & (rng.random(arrivals.size) < BURST_SHARE)
        out[take] = hot[rng.integers(hot.size, size=int(take.sum()))]
        return out
    return rows


def stress_label(data) -> str:
    """The least frequent label of the calibration split (the strongest pile-up pressure)."""
    names, counts = np.unique(data.sim.labels, return_counts=True)
    return str(names[np.argmin(counts)])


def routing_without(data, label: str, k: int, seed: int, a) -> experiments.Routing:
    """Routing inputs calibrated on the calibration split without ``label`` (cached)."""
    cache = a.work_dir / "routing" / f"{data.name}-no-{label}-K{k}-seed{seed}-p{experiments.FULL.calib_pairs}.pkl"
    if cache.is_file():
        with open(cache, "rb") as f:
            return pickle.load(f)
    base = routing_for(data, k, seed, a)
    kind = experiments.label_kind_for(data.calib, data.name)
    keep = np.flatnonzero(np.asarray(data.calib.labels[kind]) != label)
    tdir = a.work_dir / "without" / f"{data.name}-no-{label}" / "calib"
    if not tdir.is_dir():
        write_traces(data.calib.subset(keep), tdir)
    out = a.work_dir / "without" / f"{data.name}-no-{label}-K{k}-seed{seed}.json"
    art = calibrate_artifact(tdir, k, out, seed=seed, pairs=experiments.FULL.calib_pairs,
                             n_init=experiments.FULL.calib_n_init, log=out.with_suffix(".log"))
    routing = experiments.Routing(art.centroids, eldr_signatures(art, data.evaluation), art.layers,
                                  base.oracle_centroids, base.oracle_signatures, base.domain)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache, "wb") as f:
        pickle.dump(routing, f)
    return routing


# -- one run ------------------------------------------------------------------------------------------------
def in_flight(res, k: int, dt: float = 0.05) -> np.ndarray:
    """[T, K] in-flight count of every server on a time grid over the measured window (a request is
    in flight from its decision, at its first token, to its finish)."""
    c = res.config
    grid = np.arange(c.warmup_s, c.warmup_s + c.measure_s, dt)
    out = np.zeros((grid.size, k))
    for s in range(k):
        m = res.server == s
        out[:, s] = (np.searchsorted(np.sort(res.first_token[m]), grid, side="right")
                     - np.searchsorted(np.sort(res.finish[m]), grid, side="right"))
    return out


def random_union(data, draws: int = 64, bmax: int = 400, seed: int = 0) -> np.ndarray:
    """[bmax + 1] expected distinct experts (per layer, as the simulator counts them) of a batch of b
    requests drawn at random from the workload: round robin's batches at equal batch size."""
    rng = np.random.default_rng(seed)
    lq = data.sim.log1mp
    n, L, E = lq.shape
    out = np.zeros(bmax + 1)
    for _ in range(draws):
        order = rng.integers(n, size=bmax)
        cum = np.cumsum(lq[order].reshape(bmax, -1), axis=0)
        out[1:] += (L * E - np.exp(cum).sum(axis=1)) / L
    return out / draws


def equal_batch(res, picked: np.ndarray, data, k: int, dt: float = 0.05) -> tuple[float, float]:
    """(distinct experts per layer of the live batches, the same for random batches of the same sizes),
    summed over a time grid of the measured window and every server: the live batch is the
    requests in flight, their expected union from the simulator's per-request log(1 - p)."""
    c = res.config
    lq = data.sim.log1mp.reshape(len(data.sim), -1)
    L = data.sim.num_layers
    ref = STATE.setdefault(("ref", data.name), random_union(data))
    ev = [(t, 1, r) for r, t in enumerate(res.first_token)] + [(t, 0, r) for r, t in enumerate(res.finish)]
    ev.sort()
    logsum = np.zeros((k, lq.shape[1]))
    count = [0] * k
    mine = rnd = 0.0
    j = 0
    for t in np.arange(c.warmup_s, c.warmup_s + c.measure_s, dt):
        while j < len(ev) and ev[j][0] <= t:
            _, add, r = ev[j]
            s = int(res.server[r])
            if add:
                logsum[s] += lq[picked[r]]
                count[s] += 1
            else:
                logsum[s] -= lq[picked[r]]
                count[s] -= 1
                if count[s] == 0:
                    logsum[s] = 0.0
            j += 1
        busy = [s for s in range(k) if count[s]]
        if busy:
            mine += float((lq.shape[1] - np.exp(logsum[busy]).sum(axis=1)).sum()) / L
            rnd += float(sum(ref[min(count[s], ref.size - 1)] for s in busy))
    return mine, rnd


def run(task: tuple) -> dict:
    exp, wl, spec, cfg, label = task
    a, data = STATE["args"], STATE["data"][wl]
    routing = (routing_without(data, label, cfg.num_decode, cfg.seed, a) if exp == "shift"
               else routing_for(data, cfg.num_decode, cfg.seed, a))
    pol = make(spec, cfg.num_decode, routing, data, cfg)
    probe = Probe(pol, CentroidOwnership(routing.eldr_centroids, cfg.num_decode))
    sigs = routing.oracle_signatures if parse_variant(spec)[0] == "oracle" else routing.eldr_signatures
    acts = prefill_activations(data.evaluation, routing.layers) if probe.uses_activation else None
    draw = (rows_for(exp, data.sim.labels, label) if exp in ("burst", "shift")
            else lambda arr, rng: rng.integers(0, len(data.sim), arr.size))  # simulate's own draw
    picked = []
    rows = lambda arr, rng: picked.append(draw(arr, rng)) or picked[0]  # noqa: E731
    t0 = time.perf_counter()
    res = simulate(data.sim, probe, cfg, sigs, activations=acts, rows=rows)
    eq = equal_batch(res, picked[0], data, cfg.num_decode) if exp == "locality" else (0.0, 0.0)
    fl = in_flight(res, cfg.num_decode)
    per = fl.mean(axis=0)
    win = int(round(1.0 / 0.05))
    w = fl[: fl.shape[0] // win * win].reshape(-1, win, cfg.num_decode).mean(axis=1)
    wm = w.mean(axis=1)
    worst = float(np.max(w.max(axis=1)[wm > 0] / wm[wm > 0])) if (wm > 0).any() else 0.0
    s = res.summary
    return dict(experiment=exp, workload=wl, variant=spec, rate=cfg.rate, seed=cfg.seed, label=label,
                unique=s["unique_experts_per_step"], batch=s["mean_batch"], median=s["tpot_median_ms"],
                p99=s["tpot_p99_ms"], conserved=s["conserved"],
                max_mean=float(per.max() / per.mean()) if per.mean() > 0 else 0.0, worst_1s=worst,
                exceptions=probe.exceptions, fallbacks=int(sum(getattr(pol, "fallbacks", {}).values())),
                home=probe.home / max(probe.decisions, 1), eq_batch=eq[0], eq_random=eq[1], wall_s=time.perf_counter() - t0)


STATE: dict = {}


def tasks_of(g: dict, variants: list[str], wls: list[str], exps: list[str], seeds: int,
             stress: list[str]) -> list[tuple]:
    base = SimConfig(num_prefill=g["prefill"], num_decode=g["k"])
    out = []
    for wl in wls:
        label = stress_label(STATE["data"][wl])
        for seed in range(seeds):
            if "locality" in exps:
                w, m = g["loc_window"]
                for rate in g["loc_rates"]:
                    cfg = replace(base, rate=rate, seed=seed, warmup_s=w, measure_s=m)
                    out += [("locality", wl, v, cfg, label) for v in (*REFS, *variants)]
            if "saturation" in exps:
                w, m = g["sat_window"]
                for rate in g["sat_rates"]:
                    cfg = replace(base, rate=rate, seed=seed, warmup_s=w, measure_s=m, num_prefill=g["sat_prefill"])
                    out += [("saturation", wl, v, cfg, label) for v in (*BALANCERS, "eldr", *variants)]
            for exp in ("burst", "shift"):
                if exp in exps:
                    w, m = g["stress_window"]
                    for rate in g["stress_rates"]:
                        cfg = replace(base, rate=rate, seed=seed, warmup_s=w, measure_s=m,
                                      num_prefill=g["sat_prefill"] if rate > 150 else g["prefill"])
                        out += [(exp, wl, v, cfg, label) for v in ("jsq", "eldr", *stress)]
    return out


# -- summary ------------------------------------------------------------------------------------------------
def pick(runs, **kw) -> dict:
    """{seed: row} of the runs matching ``kw``."""
    return {r["seed"]: r for r in runs if all(r[k] == v for k, v in kw.items())}


def reductions(runs, wl: str, rate: float, variant: str, metric: str) -> dict:
    """{seed: % fewer distinct experts than round robin}: per decode step at equal load ("step"), or at
    equal batch size ("batch": against random batches of the sizes the policy ran)."""
    me = pick(runs, experiment="locality", workload=wl, variant=variant, rate=rate)
    if metric == "batch":
        return {s: 100 * (1 - r["eq_batch"] / r["eq_random"]) for s, r in me.items() if r["eq_random"] > 0}
    rr = pick(runs, experiment="locality", workload=wl, variant="round_robin", rate=rate)
    return {s: 100 * (rr[s]["unique"] - r["unique"]) / rr[s]["unique"] for s, r in me.items() if s in rr}


def ms(values) -> str:
    v = np.asarray(list(values), dtype=float)
    return f"{v.mean():.1f} ± {v.std(ddof=1):.1f}" if v.size > 1 else f"{v.mean():.1f}"


def summarise(runs: list[dict], g: dict, variants: list[str], wls: list[str]) -> tuple[list[str], dict]:
    """The markdown tables and every check of the rule, per variant."""
    L, checks = [], []

    def check(rule, variant, where, ok, what):
        checks.append(dict(rule=rule, variant=variant, where=where, ok=bool(ok), what=what))

    _locality_table(L, check, runs, wls, variants)
    _tpot_tables(L, check, runs, g, wls, variants)
    _stress_table(L, check, runs, wls, variants)
    verdict = {}
    _new_against_old(L, runs, wls, variants)
    for v in variants:
        mine = [c for c in checks if c["variant"] == v]
        failed = [c for c in mine if not c["ok"]]
        verdict[v] = dict(checks=len(mine), failed=failed)
        L.append(f"- **{v}**: {len(mine) - len(failed)} of {len(mine)} checks pass"
                 + ("" if not failed else "; fails: " + "; ".join(f"rule ({c['rule']}) {c['where']}: {c['what']}"
                                                                  for c in failed)))
    return L, dict(checks=checks, verdict=verdict)


def _locality_table(L: list[str], check, runs: list[dict], wls: list[str], variants: list[str]) -> None:
    """Fewer distinct experts than round robin, per step and at equal batch size (rules a, a')."""
    rates = sorted({r["rate"] for r in runs if r["experiment"] == "locality"})
    if rates:
        L += ["### Locality: fewer distinct experts per decode step than round robin, held-out requests: per step "
              "at equal load (same req/s and requests), and at equal batch size (live batches sampled every 50 ms vs "
              "random batches of the same sizes); mean ± sd over seeds (% of the label oracle domain's / of eldr's); "
              "home: decisions to the most similar region; B: mean batch", ""]
        rows = []
        for wl in wls:
            for v in ("round_robin", "domain", "eldr", *variants):
                cells = []
                for rate in rates:
                    got = {(o, m): reductions(runs, wl, rate, o, m) for o in ("domain", "eldr", v) for m in ("step", "batch")}
                    me = pick(runs, experiment="locality", workload=wl, variant=v, rate=rate)
                    parts = []
                    for m in ("step", "batch"):
                        mine, dom, eld = (float(np.mean(list(got[(o, m)].values()))) for o in (v, "domain", "eldr"))
                        parts.append(f"{ms(got[(v, m)].values())}% ({100 * mine / dom:.0f}% / {100 * mine / eld:.0f}%)")
                        if v in variants:
                            check("a" if m == "batch" else "a'", v, f"{wl} {rate:g} req/s",
                                  mine >= 0.9 * dom and mine >= eld,
                                  f"{'equal batch' if m == 'batch' else 'per step'}: {mine:.1f}% = "
                                  f"{100 * mine / dom:.0f}% of domain's {dom:.1f}%, eldr {eld:.1f}%")
                    home = np.mean([r["home"] for r in me.values()])
                    cells.append(f"{parts[0]}; equal batch {parts[1]}; home {100 * home:.0f}%; "
                                 f"B {np.mean([r['batch'] for r in me.values()]):.1f}")
                rows.append([wl, v, *cells])
        L += [markdown_table(["workload", "policy", *[f"{r:g} req/s" for r in rates]], rows), ""]


def _tpot_tables(L: list[str], check, runs: list[dict], g: dict, wls: list[str], variants: list[str]) -> None:
    """TPOT at the locality loads and near saturation (rules c, d)."""
    for exp, title in (("locality", "TPOT (ms) median / P99 at the locality loads"),
                       ("saturation", f"TPOT (ms) median / P99 near saturation ({g['sat_prefill']} prefill servers)")):
        rates = sorted({r["rate"] for r in runs if r["experiment"] == exp})
        if not rates:
            continue
        L += [f"### {title}; seed means (sd of the median)", ""]
        rows = []
        for wl in wls:
            for v in (*BALANCERS, "eldr", *variants):
                cells = []
                for rate in rates:
                    me = pick(runs, experiment=exp, workload=wl, variant=v, rate=rate)
                    med = [r["median"] for r in me.values()]
                    cells.append(f"{np.mean(med):.2f} (±{np.std(med, ddof=1) if len(med) > 1 else 0:.2f}) / "
                                 f"{np.mean([r['p99'] for r in me.values()]):.2f}")
                    if v in variants:
                        lb = min(np.mean([r["median"] for r in pick(runs, experiment=exp, workload=wl, variant=b,
                                                                       rate=rate).values()]) for b in BALANCERS)
                        check("d", v, f"{wl} {exp} {rate:g} req/s", np.mean(med) < lb,
                              f"median {np.mean(med):.2f} vs best balancer {lb:.2f}")
                        if exp == "saturation":
                            el = np.mean([r["median"] for r in pick(runs, experiment=exp, workload=wl, variant="eldr",
                                                                       rate=rate).values()])
                            check("c", v, f"{wl} {rate:g} req/s", np.mean(med) <= 1.02 * el,
                                  f"median {np.mean(med):.2f} vs eldr {el:.2f} ({100 * (np.mean(med) / el - 1):+.1f}%)")
                rows.append([wl, v, *cells])
        L += [markdown_table(["workload", "policy", *[f"{r:g} req/s" for r in rates]], rows), ""]


def _stress_table(L: list[str], check, runs: list[dict], wls: list[str], variants: list[str]) -> None:
    """Burst and mix shift: load spread, exceptions, fallbacks (rule b)."""
    stress = [r for r in runs if r["experiment"] in ("burst", "shift")]
    if stress:
        L += ["### Burst (70% one label for 10 s of every 30 s) and shift (calibrated without the label, then 70% "
              "of it from 20 s): max/mean in flight (measured window / worst 1-s window), exceptions, fallbacks, "
              "median / P99 TPOT (ms); seed means, worst seed in brackets", ""]
        rows = []
        for exp in ("burst", "shift"):
            for wl in wls:
                for rate in sorted({r["rate"] for r in stress if r["experiment"] == exp}):
                    for v in ("jsq", "eldr", *variants):
                        me = list(pick(runs, experiment=exp, workload=wl, variant=v, rate=rate).values())
                        if not me:
                            continue
                        mm, w1 = [r["max_mean"] for r in me], [r["worst_1s"] for r in me]
                        exc, fb = sum(r["exceptions"] for r in me), sum(r["fallbacks"] for r in me)
                        rows.append([exp, wl, f"{rate:g}", me[0]["label"], v, f"{np.mean(mm):.2f} ({max(mm):.2f})",
                                     f"{np.mean(w1):.2f} ({max(w1):.2f})", exc, fb,
                                     f"{np.mean([r['median'] for r in me]):.2f} / {np.mean([r['p99'] for r in me]):.2f}"])
                        if v in variants:
                            check("b", v, f"{exp} {wl} {rate:g} req/s", max(w1) <= 1.5 and exc == 0,
                                  f"worst 1-s max/mean {max(w1):.2f}, window {max(mm):.2f}, {exc} exceptions, "
                                  f"{fb} fallbacks")
        L += [markdown_table(["scenario", "workload", "req/s", "label", "policy", "max/mean window",
                              "max/mean worst 1 s", "exceptions", "fallbacks", "TPOT median / P99"], rows), ""]


def _new_against_old(L: list[str], runs: list[dict], wls: list[str], variants: list[str]) -> None:
    """The last variant against the first (today's default against the rule it replaced)."""
    if len(variants) > 1:  # the last variant against the first (today's default against the rule it replaced)
        new, old = variants[-1], variants[0]
        for exp in ("locality", "saturation"):
            for metric in ("median", "p99"):
                cells = []
                for wl in wls:
                    for rate in sorted({r["rate"] for r in runs if r["experiment"] == exp}):
                        f = lambda v: np.mean([r[metric] for r in pick(runs, experiment=exp, workload=wl, variant=v,  # noqa: E731
                                                                      rate=rate).values()])
                        lb = min(f(b) for b in BALANCERS)
                        cells.append(f"{wl} {rate:g}: {100 * (f(new) / f(old) - 1):+.1f}% (vs best balancer "
                                     f"{100 * (f(new) / lb - 1):+.1f}%)")
                if cells:
                    L.append(f"- {metric} TPOT of {new} against {old}, {exp} loads: " + "; ".join(cells))
        L.append("")


INTRO = (
    f"The default `eldr_balanced` (`eldr_sglang/core/policies/eldr_balanced.py`): {default_rule()}. `fixed_band` "
    "is the same rule with its cost band the same at every load (`cost_band_full=none`). `old` is the rule before "
    "(`sim_band=none,load_cap=none,cost_band=0.02`: no cap, a 2% cost band). `locality_pick` "
    "(`sim_band=0.05,sim_band_full=0.15`, "
    "`eldr_sglang/core/policies/locality.py`): bounded load, then the servers whose calibration region is within "
    "0.05 (cosine) of the most similar one, the band widening linearly to 0.15 as the mean in flight nears a full "
    "batch (256), then the cheapest. Rule (a) is judged at equal batch size: the per-step "
    "figure at equal req/s (rule a', shown too) also rewards imbalance, because servers left with small batches "
    "take many cheap steps (eldr runs max/mean 1.3-1.7 even on the calibrated mix).")


def render(doc: dict, command: str) -> str:
    wls = doc["grid"].get("workloads") or sorted({r["workload"] for r in doc["runs"]})
    lines, decision = summarise(doc["runs"], doc["grid"], list(doc["variants"]), wls)
    doc["decision"] = decision
    head = ["## Locality of the default (SIMULATED)", "",
            f"Command: `{command}`; {doc['grid']['k']} decode servers, seeds 0-{doc['seeds'] - 1}, "
            f"{len(doc['runs'])} runs, {doc.get('wall_s', 0):.0f} s on a shared 2-core machine. Every figure is SIMULATED "
            "(discrete-event simulator + analytic step law on the measured traces; the policies are the router's "
            "objects, built by `build_policy`). Generated by `benchmark/bench_locality.py`.", "", INTRO, ""]
    text = "\n".join(head + lines)
    for variant, short in ((OLD_DEFAULT, "old"), (LOCALITY_PICK, "locality_pick"), (FIXED_BAND, "fixed_band")):
        text = text.replace(f"`{variant}`", f"`{short}`").replace(variant, short)
    return text + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    g = dict(QUICK if args.quick else FULL)
    seeds = args.seeds or g["seeds"]
    wls = [w for w in args.workloads.split(",") if w]
    exps = [e for e in args.experiments.split(",") if e]
    out_dir = args.out_dir or (quick_out("locality") if args.quick else HERE / "results")
    if args.render_only:
        doc = json.loads((out_dir / "locality.json").read_text())
        (out_dir / "locality.md").write_text(render(doc, doc.get("command", "")))
        print(out_dir / "locality.md")
        return 0
    ga = grid_bench.parse_args(["--quick"] if args.quick else [])
    ga.work_dir, ga.traces_root = args.work_dir, args.traces_root
    STATE["args"] = ga
    STATE["data"] = {wl: experiments.load_workload(wl, ga.traces_root, ga.work_dir, experiments.FULL, 600.0, 300.0)
                     for wl in wls}
    stress = list(args.variants[-1:] if args.stress_variants is None else args.stress_variants)
    tasks = tasks_of(g, list(args.variants), wls, exps, seeds, stress)
    t0 = time.perf_counter()
    runs = experiments.pool_map(run, tasks, 1, "simulate")
    command = command_line(__file__, argv if argv is not None else sys.argv[1:])
    doc = {"simulated": True, "command": command, "grid": dict(g, workloads=wls), "seeds": seeds,
           "variants": list(args.variants), "runs": runs, "wall_s": time.perf_counter() - t0}
    text = render(doc, command)
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_record(out_dir / "locality.json", doc)
    (out_dir / "locality.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
