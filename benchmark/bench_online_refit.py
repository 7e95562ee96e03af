"""Decision latency while an online refit runs (one router process, no network).

    python -m benchmark.bench_online_refit [--signatures 20000] [--servers 24] [--json out.json]

A router with ``--online`` holds ``--signatures`` raw signatures (synthetic traces:
128 experts, top-8, 4 published layers) and an installed fit with K = ``--servers``.
On its event loop a request stream makes decisions back to back (``Dispatcher.decide``
+ the decision log entry, yielding to the loop between decisions) while a 1 ms
timer measures event-loop lag. Three windows of the same length: no fit running,
a refit in the process pool (``--online-fit-in process``, the default) and a
refit in a thread (``--online-fit-in thread``). Prints median / p99 / max of the
decision time and of the loop lag per window, and the fit's duration.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from benchmark.common import parse_with_quick, write_record
from eldr_sglang.core.online import run_fit
from eldr_sglang.core.policies import RouteRequest
from eldr_sglang.core.synthetic import make_synthetic_traces
from eldr_sglang.router.app import Router


def stats(values: list[float]) -> dict:
    a = np.asarray(values) * 1e6
    return {"n": int(a.size), "median_us": round(float(np.median(a)), 1),
            "p99_us": round(float(np.quantile(a, 0.99)), 1), "max_us": round(float(a.max()), 1)}


async def window(router: Router, sigs: np.ndarray, until) -> tuple[list[float], list[float]]:
    """Decisions back to back and a 1 ms lag probe until ``until()`` is true."""
    decide, pc = router.dispatcher.decide, time.perf_counter
    times: list[float] = []
    lags: list[float] = []
    done = False

    async def probe() -> None:
        while not done:
            t0 = pc()
            await asyncio.sleep(0.001)
            lags.append(pc() - t0 - 0.001)

    task = asyncio.get_running_loop().create_task(probe())
    i = 0
    while not until():
        t0 = pc()
        d, dec, loads = decide(RouteRequest(sigs[i % len(sigs)]))
        router.record(["r"], [i], None, [], d, dec, loads)
        times.append(pc() - t0)
        i += 1
        await asyncio.sleep(0)
    done = True
    await task
    return times, lags


async def measure(args, fit_in: str) -> dict:
    traces = make_synthetic_traces(args.signatures, num_layers=8, num_experts=128, top_k=8,
                                   informative_layers=[1, 3, 5, 7], include_gates=False, seed=0).traces
    layers = [1, 3, 5, 7]
    counts = traces.prefill_counts[:, layers]
    router = Router([("http://127.0.0.1:1", 8998)], [f"http://127.0.0.1:{2 + i}" for i in range(args.servers)],
                    "eldr", online=True, online_min_signatures=min(2000, args.signatures),
                    online_window=args.signatures, online_fit_in=fit_in, health_interval=0, load_interval=0)
    cal = router.online.calibrator
    for c in counts:
        cal.observe(c, layers, traces.model)
    router.online.install(run_fit(cal.job(args.servers, "initial")))
    sigs = router.routing.encoder.artifact.signature(counts[:2048])
    loop = asyncio.get_running_loop()
    # warm the pool (a spawned process imports numpy/scipy/sklearn once)
    if fit_in == "process":
        await loop.run_in_executor(router.online._executor(), int, 0)
    t0 = time.perf_counter()
    cal.request()
    router.online.maybe_fit()
    task = router.online.task
    during = await window(router, sigs, task.done)
    fit_s = time.perf_counter() - t0
    end = time.perf_counter() + fit_s
    idle = await window(router, sigs, lambda: time.perf_counter() > end)
    router.online.close()
    return {"fit_in": fit_in, "fit_seconds": round(fit_s, 2), "generation": cal.generation,
            "idle": {"decide": stats(idle[0]), "loop_lag": stats(idle[1])},
            "during_fit": {"decide": stats(during[0]), "loop_lag": stats(during[1])}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_online_refit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--signatures", type=int, default=20000)
    ap.add_argument("--servers", type=int, default=24)
    ap.add_argument("--json", default=None)
    args = parse_with_quick(ap, argv, signatures=400, servers=4)
    if args.signatures < args.servers or args.servers < 1:
        ap.error("--signatures must be >= --servers >= 1")
    out = {"signatures": args.signatures, "servers": args.servers,
           "runs": [asyncio.run(measure(args, mode)) for mode in ("process", "thread")]}
    for r in out["runs"]:
        print(f"fit in a {r['fit_in']}: {r['fit_seconds']} s (generation {r['generation']})")
        for name in ("idle", "during_fit"):
            print(f"  {name:>10}: decide {r[name]['decide']}  loop lag {r[name]['loop_lag']}")
    if args.json:
        write_record(args.json, out, argv, script=__file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
