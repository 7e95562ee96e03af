"""A burst of N requests sent at once through this router and through sglang-router,
on the same stub workers: wall time (first send to last answer), errors, and
whether a worker got blamed.

::

    python -m benchmark.bench_burst [--requests 2000] [--repeats 3] [--quick]

One prefill and ``--decodes`` decode stubs (``eldr_sglang.testing.stub_worker``, one
process each, listen backlog ``--stub-backlog``, 2048 as SGLang's uvicorn) serve both routers; the routers run
one after another, interleaved over ``--repeats`` rounds, each started fresh. Every
request is sent at once from one client with no connection limit (one connection
each). Per run: wall time, answers by status, client-side errors (connection
failures, timeouts), the kernel's listen-queue overflows meanwhile
(``TcpExt: ListenOverflows``, every listener on the machine), and for this router
the worker failures it counted and the requests that queued for a connection.
Results go to ``benchmark/results/burst.json``. ``--quick``: 200 requests, 1 round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from benchmark.common import free_port, write_record
from benchmark.router_process import stop, wait_up
from eldr_sglang.testing.local_cluster import sglang_router_argv

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmark" / "results" / "burst.json"
ROUTERS = ("eldr", "sglang-router")


def listen_overflows() -> int:
    """The machine's ``TcpExt: ListenOverflows`` counter (0 when unreadable)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return 0
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:]))
            return int(row.get("ListenOverflows", 0))
    return 0


def start_stub(role: str, log, backlog: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "eldr_sglang.testing.stub_worker", "--role", role,
                             "--name", f"{role}-{port}", "--port", str(port), "--no-signature",
                             "--backlog", str(backlog)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def router_command(name: str, port: int, prefill: str, decodes: list[str],
                   eldr_args: str = "") -> list[str]:
    workers = ["--prefill", prefill, "8998", *[a for d in decodes for a in ("--decode", d)]]
    if name != "eldr":
        return sglang_router_argv(port, "--pd-disaggregation", "--policy", "round_robin",
                                  "--log-level", "warn", *workers)
    return [sys.executable, "-m", "eldr_sglang.router", "--policy", "round_robin",
            "--log-level", "warning", "--health-interval", "0", *eldr_args.split(),
            "--host", "127.0.0.1", "--port", str(port), *workers]


async def wait_stub(url: str, timeout: float = 60.0) -> None:
    async with aiohttp.ClientSession() as http:
        if not await wait_up(http, url, path="/health", timeout=timeout, step=0.1):
            raise RuntimeError(f"stub {url} not up after {timeout} s")


async def wait_serving(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until the router answers a generate request with 200 (sglang-router's /health
    answers before its workers are registered)."""
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: router exited with {proc.returncode}")
            try:
                async with http.post(f"{url}/generate", json={"text": "probe"}) as r:
                    await r.read()
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{url}: not serving after {timeout} s")


async def burst(url: str, n: int, timeout: float) -> dict:
    """``n`` requests at once; wall time and outcomes."""
    statuses: Counter = Counter()
    errors: Counter = Counter()
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        async def one(i: int) -> None:
            try:
                async with http.post(f"{url}/generate", json={"text": f"burst {i}", "stream": False,
                                                              "sampling_params": {"max_new_tokens": 1}}) as r:
                    await r.read()
                    statuses[r.status] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                errors[type(e).__name__] += 1

        before = listen_overflows()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 3), "ok": statuses.get(200, 0),
            "errors": n - statuses.get(200, 0),
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "client_errors": dict(errors), "listen_overflows": listen_overflows() - before}


async def eldr_counters(url: str) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
    out = {"worker_failures": 0.0, "breaker_opened": 0.0}
    for line in text.splitlines():
        if line.startswith("eldr_router_upstream_failures_total"):
            out["worker_failures"] += float(line.split()[-1])
        if line.startswith("eldr_router_events_total") and "breaker_opened" in line:
            out["breaker_opened"] += float(line.split()[-1])
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/eldr/status") as r:
            out["queued_for_a_connection"] = (await r.json())["upstream"]["queued"]
    return out


async def run_one(name: str, stubs: dict, args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(Path(tempfile.gettempdir()) / f"bench-burst-{name}.log", "w")
    proc = subprocess.Popen(router_command(name, port, stubs["prefill"], stubs["decode"], args.eldr_args),
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        await wait_serving(url, proc, args.start_timeout)
        await asyncio.sleep(args.settle)  # let the start-up work end before the burst
        row = {"router": name, **await burst(url, args.requests, args.timeout)}
        if name == "eldr":
            row.update(await eldr_counters(url))
        return row
    finally:
        stop(proc)
        log.close()


def summarize(runs: list[dict]) -> dict:
    out = {}
    for name in ROUTERS:
        rows = [r for r in runs if r["router"] == name]
        if not rows:
            continue
        walls = [r["wall_s"] for r in rows]
        out[name] = {"runs": len(rows), "wall_s_median": statistics.median(walls),
                     "wall_s_min": min(walls), "wall_s_max": max(walls),
                     "errors": [r["errors"] for r in rows],
                     "listen_overflows": [r["listen_overflows"] for r in rows]}
    return out


async def main(args) -> dict:
    log = open(Path(tempfile.gettempdir()) / "bench-burst-stubs.log", "w")
    procs, urls = [], {"decode": []}
    try:
        p, urls["prefill"] = start_stub("prefill", log, args.stub_backlog)
        procs.append(p)
        for _ in range(args.decodes):
            p, u = start_stub("decode", log, args.stub_backlog)
            procs.append(p)
            urls["decode"].append(u)
        await asyncio.gather(*(wait_stub(u) for u in [urls["prefill"], *urls["decode"]]))
        runs = []
        names = [n for n in ROUTERS if n in args.routers.split(",")]
        for k in range(args.repeats):
            order = names[k % len(names):] + names[:k % len(names)]
            for name in order:
                print(f"round {k + 1}/{args.repeats}: {name}, {args.requests} requests at once ...",
                      flush=True)
                row = await run_one(name, urls, args)
                print(f"  {json.dumps(row)}", flush=True)
                runs.append({"round": k, **row})
        return {"requests": args.requests, "decodes": args.decodes, "stub_backlog": args.stub_backlog,
                "eldr_args": args.eldr_args, "runs": runs,
                "summary": summarize(runs)}
    finally:
        for p in procs:
            stop(p)
        log.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="requests sent at once")
    p.add_argument("--repeats", type=int, default=3, help="rounds (each router once per round)")
    p.add_argument("--decodes", type=int, default=2)
    p.add_argument("--stub-backlog", type=int, default=2048,
                   help="the stubs' listen backlog (SGLang's uvicorn: 2048; aiohttp's default: 128)")
    p.add_argument("--eldr-args", default="", help="extra flags for this router, e.g. "
                   "'--worker-max-connections 100'")
    p.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated: eldr,sglang-router")
    p.add_argument("--timeout", type=float, default=180.0, help="client limit per request (s)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds between start and burst")
    p.add_argument("--start-timeout", type=float, default=60.0)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--quick", action="store_true", help="200 requests, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.repeats = 200, 1
    return args


if __name__ == "__main__":
    a = parse_args()
    result = asyncio.run(main(a))
    for name, s in result["summary"].items():
        print(f"{name:14s} wall {s['wall_s_median']:.2f} s [{s['wall_s_min']:.2f}-{s['wall_s_max']:.2f}]"
              f"  errors {s['errors']}  listen overflows {s['listen_overflows']}")
    if not a.quick:
        write_record(a.out, result, script=__file__)
        print(f"written to {a.out}")
