"""Online calibration vs the static offline artifact and the oracle grouping: SIMULATED.

    .venv/bin/python -m benchmark.bench_online            # 5 seeds (10-20 min of one core)
    .venv/bin/python -m benchmark.bench_online --quick    # 1 seed, short windows; outputs under .cache/

Scenarios on the measured traces (``benchmark/traces/{task,language}/{calib,eval}``,
the tiny 4-layer model; every number SIMULATED by ``eldr_sglang/sim``), 8 prefill
servers, 3.75 req/s per decode server:

(a) cold start, 16 decode servers: the first 2,000 arrivals replay the task calib
    split, later ones the task eval split; ``online`` starts with no artifact
    (least loaded) and fits after 2,000 signatures; measured: arrivals after them,
    and again from 10 s later (the requests routed by load meanwhile have left).
(b) drift, 16 decode servers, 40 s phases: task, then language, then both mixed;
    within a phase the first half replays calib requests, the measured second half
    eval requests. ``static`` is the offline artifact (task calib); ``online`` starts
    from an online fit on the same task calib traffic (min_signatures 1,000, so the
    settle fit lands inside a phase); ``oracle`` groups by decode counts of both
    calib splits.
(c) scale-out 16 -> 24 and (d) scale-in 24 -> 16: the online calibrator fitted on
    2,000 task calib arrivals at the first size follows the pool one server at a
    time (``membership`` refits; churn = share of signatures whose server changed
    per step), then the steady state at the new size is simulated on task eval
    (``static``: the offline artifact of the old size, its centroids shared or
    handed over by ``CentroidOwnership``).

Reduction = 1 - distinct experts per decode step / jsq's, same seed and rate;
lengths rescaled to means of 600 prompt / 300 output tokens (as ``benchmark/report.py``).
Fits are instantaneous in simulated time (the router fits in another process, for
seconds, and keeps routing meanwhile). Seed s = arrival seed and calibration seed.
Writes ``benchmark/results/online.json`` and ``benchmark/results/online.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from benchmark.common import command_line, fmt_mean_sd, markdown_table, write_record
from eldr_sglang.core.layer_selection import spread_layers  # noqa: E402
from eldr_sglang.core.online import OnlineCalibrator, OnlineSettings, run_fit  # noqa: E402
from eldr_sglang.core.policies import make_policy  # noqa: E402
from eldr_sglang.core.traces import concat_traces, load_traces  # noqa: E402
from eldr_sglang.sim.calibration import calibrate_artifact, eldr_signatures, oracle_grouping  # noqa: E402
from eldr_sglang.sim.online import OnlineEldrPolicy, elastic_refits  # noqa: E402
from eldr_sglang.sim.simulator import SimConfig, simulate  # noqa: E402
from eldr_sglang.sim.workload import build_workload  # noqa: E402

PER_SERVER = 3.75  # req/s per decode server (60 req/s on 16)
DRAIN_S = 10.0  # cold start also measured this long after the switch (warm-up requests drained)
TAU = 0.1


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_online", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 20 s phases; outputs under .cache/")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--traces", default=str(HERE / "traces"))
    ap.add_argument("--out", default=None, help="directory for online.json / online.md")
    return ap.parse_args(argv)


class Data:
    def __init__(self, root: Path) -> None:
        self.tc, self.te = load_traces(root / "task" / "calib"), load_traces(root / "task" / "eval")
        self.lc, self.le = load_traces(root / "language" / "calib"), load_traces(root / "language" / "eval")
        self.all = concat_traces([self.tc, self.te, self.lc, self.le])  # rows: tc | te | lc | le
        n = len(self.tc)
        self.block = {"tc": np.arange(0, n), "te": np.arange(n, 2 * n),
                      "lc": np.arange(2 * n, 3 * n), "le": np.arange(3 * n, 4 * n)}
        # lengths as benchmark/report.py's defaults (prompt 600, output 300 tokens on average)
        self.sim = build_workload(self.all, "domain", "task+language", 600.0, 300.0)
        self.layers = spread_layers(self.all.model.num_layers)  # what an engine without artifact publishes
        self.counts = self.all.prefill_counts[:, self.layers]


def phase_rows(schedule):
    """rows(arrivals, rng) from [(until_s, [block rows, ...]), ...]."""
    def rows(arrivals: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        out = np.empty(arrivals.size, dtype=np.int64)
        start = 0.0
        for until, blocks in schedule:
            sel = (arrivals >= start) & (arrivals < until)
            pool = np.concatenate(blocks)
            out[sel] = pool[rng.integers(0, pool.size, int(sel.sum()))]
            start = until
        return out
    return rows


def run(data: Data, policy, cfg: SimConfig, rows, signatures=None, counts=None) -> dict:
    res = simulate(data.sim, policy, cfg, signatures=signatures, counts=counts, rows=rows)
    s = res.summary
    out = {k: s[k] for k in ("unique_experts_per_step", "mean_batch", "tpot_median_ms", "tpot_p99_ms",
                             "ttft_median_ms", "load_cv", "measured_requests")}
    if isinstance(policy, OnlineEldrPolicy):
        out["fits"] = policy.fits
    return out


def offline(data: Data, calib: str, k: int, seed: int, work: Path, quick: bool):
    """The operator's offline artifact for ``calib`` ("tc" or "lc"), K = k."""
    src = {"tc": data.tc, "lc": data.lc}[calib]
    d = work / f"traces-{calib}"
    if not d.is_dir():
        from eldr_sglang.core.traces import write_traces
        write_traces(src, d)
    art = calibrate_artifact(d, k, work / f"{calib}-K{k}-s{seed}.json", seed=seed,
                             pairs=2000 if quick else 20_000, n_init=1 if quick else 3)
    return art


def fitted(data: Data, k: int, seed: int, n: int = 2000) -> OnlineCalibrator:
    """An online calibrator after ``n`` task calib arrivals (random order), K = k."""
    rng = np.random.default_rng(seed)
    cal = OnlineCalibrator(OnlineSettings(min_signatures=n, window=max(n, 20000), seed=seed), model=data.all.model)
    for r in data.block["tc"][rng.integers(0, len(data.tc), n)]:
        cal.observe(data.counts[r], data.layers)
    cal.install(run_fit(cal.job(k, "initial")))
    return cal


def scenario_cold(data, seed, work, quick, drain_s: float = 0.0) -> dict:
    """Measured from the 2,000th arrival plus ``drain_s`` (the requests routed by load
    during the warm-up still decode for a few seconds after the switch)."""
    k = 16
    rate = PER_SERVER * k
    warm = 2000 / rate
    cfg = SimConfig(num_prefill=8, num_decode=k, rate=rate, warmup_s=warm + drain_s,
                    measure_s=15.0 if quick else 25.0, seed=seed)
    rows = phase_rows([(warm, [data.block["tc"]]), (1e9, [data.block["te"]])])
    art = offline(data, "tc", k, seed, work, quick)
    oracle = oracle_grouping(data.tc, data.all, k, seed=seed, n_init=1 if quick else 3)
    online = OnlineEldrPolicy(k, data.layers, data.all.model, OnlineSettings(min_signatures=2000, seed=seed),
                              seed=seed)
    return {
        "jsq": run(data, make_policy("jsq", k, seed=seed), cfg, rows),
        "static": run(data, make_policy("eldr", k, centroids=art.centroids, tau=TAU, seed=seed), cfg, rows,
                      eldr_signatures(art, data.all)),
        "online": run(data, online, cfg, rows, counts=data.counts),
        "oracle": run(data, make_policy("eldr", k, centroids=oracle.centroids, tau=TAU, seed=seed), cfg, rows,
                      oracle.signatures),
    }


def scenario_drift(data, seed, work, quick) -> dict:
    k, phase = 16, (20.0 if quick else 40.0)
    rate = PER_SERVER * k
    b = data.block
    h = phase / 2
    rows = phase_rows([(h, [b["tc"]]), (phase, [b["te"]]),
                       (phase + h, [b["lc"]]), (2 * phase, [b["le"]]),
                       (2 * phase + h, [b["tc"], b["lc"]]), (1e9, [b["te"], b["le"]])])
    art = offline(data, "tc", k, seed, work, quick)
    both = concat_traces([data.tc, data.lc])
    oracle = oracle_grouping(both, data.all, k, seed=seed, n_init=1 if quick else 3)
    sig_static, out = eldr_signatures(art, data.all), {}
    # online starts from the offline artifact's centroids, in the layers engines publish
    seed_cal = fitted(data, k, seed)  # same traffic as the offline artifact saw
    for name, end in (("language", 2 * phase), ("mixed", 3 * phase)):
        cfg = SimConfig(num_prefill=8, num_decode=k, rate=rate, warmup_s=end - h, measure_s=h, seed=seed)
        online = OnlineEldrPolicy(k, data.layers, data.all.model, OnlineSettings(min_signatures=1000, seed=seed),
                                  artifact=seed_cal.artifact, seed=seed)
        out[name] = {
            "jsq": run(data, make_policy("jsq", k, seed=seed), cfg, rows),
            "static": run(data, make_policy("eldr", k, centroids=art.centroids, tau=TAU, seed=seed), cfg, rows,
                          sig_static),
            "online": run(data, online, cfg, rows, counts=data.counts),
            "oracle": run(data, make_policy("eldr", k, centroids=oracle.centroids, tau=TAU, seed=seed), cfg, rows,
                          oracle.signatures),
        }
    return out


def scenario_scale(data, seed, work, quick, start: int, end: int) -> dict:
    cal = fitted(data, start, seed)
    steps = elastic_refits(cal, start, end, seed)
    art_old = offline(data, "tc", start, seed, work, quick)
    oracle = oracle_grouping(data.tc, data.all, end, seed=seed, n_init=1 if quick else 3)
    rows = phase_rows([(1e9, [data.block["te"]])])
    cfg = SimConfig(num_prefill=8, num_decode=end, rate=PER_SERVER * end, warmup_s=5.0 if quick else 15.0,
                    measure_s=15.0 if quick else 25.0, seed=seed)
    live = cal.artifact
    return {
        "churn_steps": steps,
        "jsq": run(data, make_policy("jsq", end, seed=seed), cfg, rows),
        "static": run(data, make_policy("eldr", end, centroids=art_old.centroids, tau=TAU, seed=seed), cfg, rows,
                      eldr_signatures(art_old, data.all)),
        "online": run(data, make_policy("eldr", end, centroids=live.centroids, tau=TAU, seed=seed), cfg, rows,
                      live.signature(data.counts)),
        "oracle": run(data, make_policy("eldr", end, centroids=oracle.centroids, tau=TAU, seed=seed), cfg, rows,
                      oracle.signatures),
    }


def reduction(cell: dict, policy: str) -> float:
    return 1.0 - cell[policy]["unique_experts_per_step"] / cell["jsq"]["unique_experts_per_step"]


def render(results: dict, command: str) -> str:
    seeds = results["seeds"]
    cells = {"(a) cold start, K=16, from request 2,000": [r["cold"] for r in seeds],
             f"(a) cold start, from {DRAIN_S:g} s later": [r["cold_drained"] for r in seeds],
             "(b) drift: language phase": [r["drift"]["language"] for r in seeds],
             "(b) drift: mixed phase": [r["drift"]["mixed"] for r in seeds],
             "(c) scale-out 16 -> 24": [r["scale_out"] for r in seeds],
             "(d) scale-in 24 -> 16": [r["scale_in"] for r in seeds]}
    lines = [f"# Online calibration (SIMULATED; {len(seeds)} seeds, mean ± sd)", "",
             f"Command: `{command}`", "",
             "Reduction of distinct experts per decode step vs jsq (%), median and P99 TPOT (ms), load CV:", ""]
    verdicts, rows = [], []
    for name, cs in cells.items():
        red = {p: [reduction(c, p) for c in cs] for p in ("static", "online", "oracle")}
        ratio = np.mean(red["online"]) / max(np.mean(red["oracle"]), 1e-9)
        tp = lambda p, q: np.mean([c[p][q] for c in cs])  # noqa: E731
        rows.append([name, *(fmt_mean_sd(red[k], scale=100) for k in ("static", "online", "oracle")), f"{ratio:.2f}",
                     " / ".join(f"{tp(p, 'tpot_median_ms'):.2f}" for p in ("static", "online", "jsq")),
                     " / ".join(f"{tp(p, 'tpot_p99_ms'):.2f}" for p in ("static", "online", "jsq")),
                     f"{tp('static', 'load_cv'):.3f} / {tp('online', 'load_cv'):.3f}"])
        if name.startswith("(a)"):
            got = np.mean(red["online"]) / max(np.mean(red["static"]), 1e-9)
            verdicts.append(f"- {name[4:]}: online reaches {100 * got:.0f}% of the offline artifact's reduction "
                            f"(target >= 90%): {'met' if got >= 0.9 else 'NOT met'}")
        if name.startswith("(b)"):
            st = np.mean(red["static"]) / max(np.mean(red["oracle"]), 1e-9)
            verdicts.append(f"- {name[4:]}: online recovers {100 * ratio:.0f}% of the oracle's reduction, static "
                            f"{100 * st:.0f}% (target: online >= 90%, static below): "
                            f"{'met' if ratio >= 0.9 and st < 0.9 else 'NOT met'}")
    for key, label, k in (("scale_out", "scale-out 16 -> 24", 16), ("scale_in", "scale-in 24 -> 16", 24)):
        churn = [s["churn"] for r in seeds for s in r[key]["churn_steps"]]
        worst = max(churn)
        bound = [1 / (s["servers"] - (1 if key == "scale_out" else -1)) + 0.10
                 for r in seeds for s in r[key]["churn_steps"]]
        ok = all(c <= b for c, b in zip(churn, bound))
        verdicts.append(f"- {label}: churn per one-server step mean {100 * np.mean(churn):.1f}%, worst "
                        f"{100 * worst:.1f}% (bound 1/K + 10% per step): {'met' if ok else 'NOT met'}")
    fits = [f for r in seeds for f in r["cold"]["online"].get("fits", [])]
    drift_fits = [f["reason"] for r in seeds for ph in ("language", "mixed") for f in r["drift"][ph]["online"]["fits"]]
    lines += [markdown_table(["scenario", "static", "online", "oracle", "online / oracle",
                              "TPOT p50 static / online / jsq", "TPOT p99 static / online / jsq",
                              "load CV static / online"], rows),
              "", "Targets:", *verdicts, "",
              f"Online fits in the cold-start runs: {len(fits)}; in the drift runs, by reason: "
              + ", ".join(f"{x} {drift_fits.count(x)}" for x in sorted(set(drift_fits))), "",
              "Fits are instantaneous in simulated time; the router fits in another process (seconds) and "
              "routes with the previous calibration meanwhile. Traces: the tiny 4-layer model; online uses the "
              "4 layers an engine without artifact publishes, the offline artifact its greedy selection."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    n_seeds = args.seeds or (1 if args.quick else 5)
    out_dir = Path(args.out) if args.out else (ROOT / ".cache" / "bench-online" if args.quick else HERE / "results")
    work = ROOT / ".cache" / "bench-online-work"
    work.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = Data(Path(args.traces))
    results = {"command": command_line(__file__, argv), "simulated": True, "seeds": []}
    t0 = time.perf_counter()
    for seed in range(n_seeds):
        r = {"seed": seed,
             "cold": scenario_cold(data, seed, work, args.quick),
             "cold_drained": scenario_cold(data, seed, work, args.quick, DRAIN_S),
             "drift": scenario_drift(data, seed, work, args.quick),
             "scale_out": scenario_scale(data, seed, work, args.quick, 16, 24),
             "scale_in": scenario_scale(data, seed, work, args.quick, 24, 16)}
        results["seeds"].append(r)
        print(f"seed {seed} done ({time.perf_counter() - t0:.0f} s)", flush=True)
        write_record(out_dir / "online.json", results)
    md = render(results, results["command"])
    (out_dir / "online.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
