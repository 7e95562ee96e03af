"""Router replicas and engine-reported batches: does the default policy keep its gain when
several routers share the decode servers? SIMULATED.

    .venv/bin/python -m benchmark.bench_replicas --seeds 5         # 2 workloads x 2 rates x 5 seeds
    .venv/bin/python -m benchmark.bench_replicas --quick           # smoke run (seconds)

Each run replays the measured traces (``benchmark/traces``) through the simulator with
16 decode servers. R router replicas (1, 2, 4) each take a random share of the
arrivals. A replica sees the load a router sees (``eldr_sglang/router/pool/workers.py``):
each server's in-flight count as of its last load poll (every ``--poll`` s, 0.5 s as
the router's ``--load-interval``; each replica polls at its own phase), plus its own
requests started there since, never less than its own in-flight count. "own" replicas
price a server's live batch from their own requests only; "engine" replicas are also
told every server's true batch with each poll (the engines' ``/eldr/batch`` read with
the load poll, ``--engine-metrics``). ``--oracle`` adds the earlier, optimistic model:
"engine" replicas that see every server's true in-flight count at every decision.
``--reckon`` adds "reckon" replicas: "engine" replicas that count their own net change
since the poll ``1 + s (R - 1)`` times (``s = --reckon-share``, default 0.5): the router's
view with ``--routers R`` (``reckon_factor`` and ``reckoned_load`` of
``eldr_sglang/router/pool/workers.py``, the router's own functions). ``--auto`` adds "auto"
replicas: "reckon" replicas that estimate R at each poll as the router's ``--routers 0``
(``estimate_routers``: polled total over own in flight, clamped and smoothed).

Reported per workload and rate, over seeds (mean, and the standard error of the paired
differences): median and P99 TPOT gain over JSQ (one router, the better balancer at
these loads), and each replica setting's gain as a share of the one-router gain.
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
from eldr_sglang.router.pool.workers import RECKON_SHARE, estimate_routers, reckon_factor, reckoned_load
from eldr_sglang.sim import experiments
from eldr_sglang.sim.calibration import prefill_activations
from eldr_sglang.sim.simulator import SimConfig, simulate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REPORT_S = 0.5  # the router's default --load-interval
TICKS = 4  # simulator report ticks per poll interval: replicas poll at one of TICKS phases
FULL = dict(k=16, rates=(60.0, 120.0), seeds=5, replicas=(2, 4), warmup_s=10.0, measure_s=30.0)
QUICK = dict(k=8, rates=(40.0,), seeds=1, replicas=(2,), warmup_s=2.0, measure_s=6.0)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_replicas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small point; outputs under .cache/")
    ap.add_argument("--workloads", default="task,language")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--rates", default=None, help="comma-separated req/s (default 60,120)")
    ap.add_argument("--poll", type=float, default=REPORT_S,
                    help="seconds between a replica's load polls (the router's --load-interval)")
    ap.add_argument("--oracle", action="store_true",
                    help="also run replicas that see the true in-flight counts at every decision")
    ap.add_argument("--reckon", action="store_true",
                    help="also run replicas that count their own change since the poll 1 + s (R - 1) times "
                         "(the router's --routers R)")
    ap.add_argument("--reckon-share", type=float, default=RECKON_SHARE,
                    help="reckon: s, the share of the other replicas' traffic assumed to match this one's "
                         "(the router's: %(default)s)")
    ap.add_argument("--auto", action="store_true",
                    help="also run reckon replicas that estimate R from their polls (the router's --routers 0)")
    ap.add_argument("--reckon-as", type=int, default=None,
                    help="reckon: the R replicas assume (the router's --routers; default: the true count), "
                         "to measure a wrong --routers")
    ap.add_argument("--replicas", default=None, help="comma-separated replica counts (default 2,4)")
    ap.add_argument("--cost", default="qwen3-30b-a3b-mi300x")
    ap.add_argument("--traces-root", type=Path, default=HERE / "traces")
    ap.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "bench_state_aware",
                    help="calibrations are cached here (shared with bench_state_aware.py)")
    ap.add_argument("--json", type=Path, default=None, help="default: results/replicas.json (--quick: .cache/)")
    return ap


class PolledReplica:
    """One router replica's view of the decode servers, around its policy object.

    The simulator hands every replica the servers' true in-flight counts (``loads``, one
    list it updates in place) and calls ``observe_engine`` on its report ticks (every
    ``poll / TICKS`` s). This wrapper polls on every ``TICKS``-th tick from its own
    phase: it keeps each server's count then and its own in-flight count then, and
    hands the policy what the router computes from them (``Worker.load``, through the
    router's ``reckoned_load``): the polled count plus its own requests started since
    (``reckon`` times), never less than its own in-flight count;
    before the first poll, its own in-flight count. Engine-reported batches reach the
    policy on its polls only, and only when ``engine`` (else the policy prices its own
    requests alone)."""

    def __init__(self, policy, k: int, phase: int, engine: bool, reckon: float = 1, auto: bool = False):
        self.policy, self.engine, self.phase, self.reckon, self.auto = policy, engine, phase, reckon, auto
        self.routers: float | None = None  # auto: the estimate of R
        self.own = [0] * k
        self.reported: list[int] | None = None
        self.own_at_poll = [0] * k
        self.loads = None  # the simulator's list of true in-flight counts
        self.tick = 0

    def __getattr__(self, name):  # needs_signature, uses_activation, name, set_step_law, ...
        return getattr(self.policy, name)

    def view(self) -> list[int]:
        if self.reported is None:
            return list(self.own)
        m = self.reckon
        return [reckoned_load(o, r, a, m) for o, r, a in zip(self.own, self.reported, self.own_at_poll)]

    def choose(self, request, loads, allowed=None) -> int:
        self.loads = loads
        return self.policy.choose(request, self.view(), allowed)

    def admit(self, index: int, request):
        self.own[index] += 1
        return index, self.policy.admit(index, request)

    def release(self, token) -> None:
        index, inner = token
        self.own[index] -= 1
        self.policy.release(inner)

    def observe_engine(self, index: int, log_free) -> None:
        if index == 0:
            self.tick += 1
        if self.tick % TICKS != self.phase:
            return
        if index == 0:  # the load poll
            self.reported = list(self.loads) if self.loads is not None else [0] * len(self.own)
            self.own_at_poll = list(self.own)
            if self.auto:  # as the router's pool after each poll (--routers 0)
                self.routers = estimate_routers(sum(self.reported), sum(self.own), self.routers)
                self.reckon = reckon_factor(self.routers or 1)
        if self.engine:
            observe = getattr(self.policy, "observe_engine", None)
            if observe is not None:
                observe(index, log_free)


def run(data, routing, acts, cfg: SimConfig, variant: str, replicas: int, poll: float = REPORT_S,
        reckon_share: float = RECKON_SHARE, reckon_as: int | None = None) -> dict:
    """Median and P99 TPOT (ms) of one SIMULATED run of ``variant``: "jsq" (one router), "own" /
    "engine" (replicas polling every ``poll`` s, see ``PolledReplica``), "oracle" (replicas told
    the true in-flight counts at every decision and the true batches every ``poll`` s)."""
    k = cfg.num_decode
    if variant == "jsq":
        res = simulate(data.sim, build_policy("jsq", PolicyContext(k, seed=cfg.seed)), cfg)
    else:
        pols = [candidate_policy(k, routing, data, cfg.cost) for _ in range(replicas)]
        if variant == "oracle":
            res = simulate(data.sim, pols, cfg, routing.eldr_signatures, activations=acts, engine_report_s=poll)
        else:
            phases = np.random.default_rng([cfg.seed, 0xB011]).integers(0, TICKS, replicas)
            wrapped = [PolledReplica(p, k, int(ph), variant in ("engine", "reckon", "auto"),
                                     reckon_factor(reckon_as or replicas, reckon_share)
                                     if variant == "reckon" else 1, auto=variant == "auto")
                       for p, ph in zip(pols, phases)]
            res = simulate(data.sim, wrapped, cfg, routing.eldr_signatures, activations=acts,
                           engine_report_s=poll / TICKS)
    return {"median": float(res.summary["tpot_median_ms"]), "p99": float(res.summary["tpot_p99_ms"])}


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    g = dict(QUICK if a.quick else FULL)
    if a.seeds:
        g["seeds"] = a.seeds
    if a.rates:
        g["rates"] = tuple(float(x) for x in a.rates.split(","))
    g["poll_s"] = a.poll
    if a.reckon:
        g["reckon_share"] = a.reckon_share
        if a.reckon_as:
            g["reckon_as"] = a.reckon_as
    if a.replicas:
        g["replicas"] = tuple(int(x) for x in a.replicas.split(","))
    a.json = a.json or (QUICK_OUT / "replicas.json" if a.quick else HERE / "results" / "replicas.json")
    sweep = experiments.FULL
    base = SimConfig(num_prefill=max(8, g["k"] * 3 // 2), num_decode=g["k"], warmup_s=g["warmup_s"],
                     measure_s=g["measure_s"], cost=a.cost)
    variants = ("own", "engine") + (("oracle",) if a.oracle else ()) + (("reckon",) if a.reckon else ()) + (("auto",) if a.auto else ())
    rows = []
    for wl in a.workloads.split(","):
        data = experiments.load_workload(wl, a.traces_root, a.work_dir, sweep, 600.0, 300.0)
        for seed in range(g["seeds"]):
            routing = routing_for(data, g["k"], seed, a)
            acts = prefill_activations(data.evaluation, routing.layers)
            for rate in g["rates"]:
                cfg = replace(base, rate=rate, seed=seed)
                row = {"workload": wl, "rate": rate, "seed": seed,
                       "jsq": run(data, routing, acts, cfg, "jsq", 1),
                       "x1": run(data, routing, acts, cfg, "own", 1, a.poll)}
                for r in g["replicas"]:
                    for variant in variants:
                        row[f"x{r}-{variant}"] = run(data, routing, acts, cfg, variant, r, a.poll, a.reckon_share,
                                                     a.reckon_as)
                rows.append(row)
                print("  " + "  ".join(f"{k}={v['median']:.2f}/{v['p99']:.1f}" if isinstance(v, dict)
                                       else f"{k}={v}" for k, v in row.items()), flush=True)
    table = summarise(rows, g["replicas"], variants, a.poll, a.reckon_as)
    print("\n".join(table))
    write_record(a.json, {"command": command_line(__file__, argv), "simulated": True, "grid": g, "rows": rows,
                          "table": table})
    print(f"-> {a.json}")
    return 0


def summarise(rows: list[dict], replicas: Sequence[int], variants: Sequence[str] = ("own", "engine"),
              poll: float = REPORT_S, reckon_as: int | None = None) -> list[str]:
    """Per (workload, rate, statistic): gain over JSQ of one router, and each setting's share of it."""
    cols = ["x1"] + [f"x{r}-{v}" for r in replicas for v in variants]
    out = []
    for key in sorted({(r["workload"], r["rate"]) for r in rows}):
        rs = [r for r in rows if (r["workload"], r["rate"]) == key]
        for stat in ("median", "p99"):
            jsq = np.array([r["jsq"][stat] for r in rs])
            gains = {c: 100 * (jsq - np.array([r[c][stat] for r in rs])) / jsq for c in cols}
            cells = [key[0], f"{key[1]:g}", stat, f"{jsq.mean():.1f}"]
            for c in cols:
                g = gains[c]
                share = 100 * g.mean() / gains["x1"].mean() if gains["x1"].mean() > 0 else float("nan")
                d = g - gains["x1"]
                se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
                cells.append(f"{g.mean():+.1f}%" + ("" if c == "x1" else
                                                    f" ({share:.0f}% of x1; diff {d.mean():+.1f} ± {se:.1f} pp)"))
            out.append(cells)
    return [f"SIMULATED: median and P99 TPOT gain of the default policy over JSQ (one router); R replicas each "
            f"take a random share of arrivals and see their last load poll (every {poll:g} s) plus their own "
            f"requests since; 'engine': true batches reported with each poll; 'oracle': true in-flight counts "
            f"at every decision" + ("; 'reckon': engine replicas counting their own change since the poll "
                                    f"1 + s (R - 1) times, the router's view with --routers R"
                                    + (f", here all with R = {reckon_as}" if reckon_as else "") if "reckon" in variants
                                    else "") + ("; 'auto': reckon replicas estimating R from each poll "
                                                "(--routers 0)" if "auto" in variants else ""), "",
            *markdown_table(["workload", "req/s", "TPOT", "JSQ ms", *cols], out).splitlines()]


if __name__ == "__main__":
    sys.exit(main())
