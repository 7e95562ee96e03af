"""The ELDR router's own CPU time per request, optionally against another checkout.

    python -m benchmark.bench_router_cpu [--rounds 6] [--requests 3200] [--concurrency 64]
        [--policy eldr] [--baseline PATH] [--json benchmark/results/router_cpu.json]

A benchmark, not a timed test. It starts 1 prefill + 4 decode stub workers
(``python -m eldr_sglang.testing.stub_worker``) and one router process
(``python -m eldr_sglang.router``, signatures over TCP) for this checkout, and with
``--baseline PATH`` a second one run from the checkout at PATH (e.g. ``git worktree
add /tmp/base COMMIT``), both on the same stubs. Then, in rounds whose order
alternates, it sends ``--requests`` requests at ``--concurrency`` from this process
to each router and reads the router process's CPU time (user + system,
``/proc/PID/stat``) before and after: CPU microseconds per request, a figure that
other load on the machine moves far less than req/s does. Each round also gives
req/s and, at concurrency 1 over 300 requests, the median latency (both shared-
machine figures). Medians and [min-max] over the rounds; per-round ratios against
the baseline, then their median.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmark.common import free_port, parse_with_quick, quick_out, write_record
from benchmark.serving_harness import BOOTSTRAP_PORT, N_DECODES, Procs, make_artifact, stub_cmd, wait_generate

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmark" / "results" / "router_cpu.json"
BODY = {"input_ids": list(range(32)), "sampling_params": {"max_new_tokens": 4}}
LATENCY_REQUESTS = 300


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, concurrency: int, requests: int) -> tuple[float, float]:
    """(req/s, median seconds per request) of ``requests`` POSTs at ``concurrency``."""
    import aiohttp

    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def client(n: int) -> None:
            for _ in range(n):
                t = time.perf_counter()
                async with http.post(f"{url}/generate", json=BODY) as r:
                    body = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: HTTP {r.status} {body[:200]!r}")
                latencies.append(time.perf_counter() - t)
        t0 = time.perf_counter()
        await asyncio.gather(*(client(requests // concurrency) for _ in range(concurrency)))
    return len(latencies) / (time.perf_counter() - t0), statistics.median(latencies)


def router_cmd(port: int, prefill: str, decodes: list[str], artifact: str, policy: str) -> list[str]:
    cmd = [sys.executable, "-m", "eldr_sglang.router", "--prefill", prefill, BOOTSTRAP_PORT,
           "--policy", policy, "--calibration", artifact, "--signature-port", "0",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    for d in decodes:
        cmd += ["--decode", d]
    return cmd


def start(procs: Procs, trees: dict[str, Path], policy: str, logdir: Path) -> dict[str, tuple[str, int]]:
    """Stubs, then one router per tree (run from that tree); name -> (url, pid)."""
    artifact = make_artifact(logdir / "artifact.json")
    prefill = f"http://127.0.0.1:{free_port()}"
    procs.start("prefill", stub_cmd("prefill", int(prefill.rsplit(":", 1)[1]), "p"))
    decodes = []
    for i in range(N_DECODES):
        port = free_port()
        procs.start(f"decode{i}", stub_cmd("decode", port, f"d{i}"))
        decodes.append(f"http://127.0.0.1:{port}")
    routers = {}
    for name, tree in trees.items():
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(tree)}
        proc = procs.start(name, router_cmd(port, prefill, decodes, artifact, policy), env=env, cwd=tree)
        routers[name] = (f"http://127.0.0.1:{port}", proc.pid)
        wait_generate(name, routers[name][0], procs, proc, 120)
    return routers


def measure(routers: dict[str, tuple[str, int]], rounds: int, requests: int, concurrency: int) -> dict:
    """Per router: cpu_us, rps and p50_ms per round (round r runs them in rotated order)."""
    out = {name: {"cpu_us": [], "rps": [], "p50_ms": []} for name in routers}
    names = list(routers)
    for name, (url, _) in routers.items():  # warm-up: connections, caches
        asyncio.run(drive(url, concurrency, min(requests, 640)))
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            url, pid = routers[name]
            c0 = cpu_seconds(pid)
            rps, _ = asyncio.run(drive(url, concurrency, requests))
            out[name]["cpu_us"].append(round((cpu_seconds(pid) - c0) / requests * 1e6, 1))
            out[name]["rps"].append(round(rps, 1))
            out[name]["p50_ms"].append(round(1e3 * asyncio.run(drive(url, 1, LATENCY_REQUESTS))[1], 3))
            print(f"round {r} {name:9s} {out[name]['cpu_us'][-1]:7.1f} us CPU/request  "
                  f"{out[name]['rps'][-1]:7.1f} req/s  p50 {out[name]['p50_ms'][-1]:.3f} ms", flush=True)
    return out


def summarise(runs: dict) -> dict:
    """Median and [min, max] of each figure; with a baseline, the per-round ratio's median."""
    summary = {name: {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in figs.items()}
               for name, figs in runs.items()}
    if "baseline" in runs:
        for k in ("cpu_us", "rps"):
            ratios = [a / b for a, b in zip(runs["this"][k], runs["baseline"][k]) if b]
            summary["this"][f"{k}_vs_baseline"] = round(statistics.median(ratios), 3) if ratios else None
    return summary


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_router_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=3200, help="requests per round and router at --concurrency")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--policy", default="eldr")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to compare with")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parse_with_quick(ap, argv, rounds=1, requests=256, concurrency=16,
                            json=quick_out("bench_router_cpu") / "router_cpu.json")
    for name in ("rounds", "requests", "concurrency"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.baseline is not None and not (args.baseline / "eldr_sglang" / "router").is_dir():
        ap.error(f"--baseline {args.baseline}: not a checkout of this project (no eldr_sglang/router)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    trees = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    with tempfile.TemporaryDirectory(prefix="router-cpu-") as tmp:
        procs = Procs(Path(tmp))
        try:
            routers = start(procs, trees, args.policy, Path(tmp))
            runs = measure(routers, args.rounds, args.requests, args.concurrency)
        finally:
            procs.stop_all()
    summary = summarise(runs)
    for name, figs in summary.items():
        print(f"{name:9s} CPU/request {figs['cpu_us']['median']:.1f} us [{figs['cpu_us']['min']:.1f}-"
              f"{figs['cpu_us']['max']:.1f}]  req/s {figs['rps']['median']:.0f}  p50 {figs['p50_ms']['median']:.3f} ms"
              + (f"  CPU x{figs['cpu_us_vs_baseline']} of the baseline" if "cpu_us_vs_baseline" in figs else ""))
    write_record(args.json, {"trees": {k: str(v) for k, v in trees.items()}, "policy": args.policy,
                             "rounds": args.rounds, "requests": args.requests, "concurrency": args.concurrency,
                             "runs": runs, "summary": summary}, argv, script=__file__)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
