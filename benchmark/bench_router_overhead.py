"""Router overhead: policy choose() time, signature encoding time, and end-to-end
latency added by the router over calling a stub decode server directly.

    python benchmark/bench_router_overhead.py [--requests 300] [--servers 16]
        [--layers 24] [--experts 128] [--decode-latency 0.0] [--concurrency 1]

The client and the router share one event loop; the stubs (1 prefill that posts a
signature per request, N decodes) run in a child process (``--in-process``: same
loop). The end-to-end difference is the router's extra hops (prefill POST,
signature callback, decode POST, relay) over loopback HTTP, not network time. The
paper's figure for comparison: 0.86 ms per request.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]

from eldr_sglang.core.policies import RouteRequest, make_policy, policy_spec  # noqa: E402
from eldr_sglang.router.app import Router, start_router  # noqa: E402
from eldr_sglang.router.signatures import SignatureEncoder, parse_message  # noqa: E402
from eldr_sglang.testing.stub_worker import StubWorker  # noqa: E402


def make_artifact(n_layers: int, experts: int, k: int, seed: int = 0):
    """A real CalibrationArtifact when the core module is there, else the test toy."""
    rng = np.random.default_rng(seed)
    layers = list(range(n_layers))
    idf = rng.uniform(0.5, 3.0, (n_layers, experts)).astype(np.float32)
    cents = rng.random((k, n_layers * experts)).astype(np.float32) ** 4
    cents /= np.linalg.norm(cents, axis=1, keepdims=True)
    try:
        from eldr_sglang.core.artifact import CalibrationArtifact
        from eldr_sglang.core.traces import ModelSpec

        return CalibrationArtifact(model=ModelSpec("bench-moe", n_layers, experts, 8),
                                   variant="idf", layers=layers, idf=idf, centroids=cents)
    except ImportError:
        from eldr_sglang.testing.stub_worker import ToyArtifact

        art = ToyArtifact(layers, experts, 1)
        art.idf, art.centroids = idf, cents
        return art


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q))


def bench_policies(art, servers: int, iters: int) -> None:
    rng = np.random.default_rng(1)
    enc = SignatureEncoder(art)
    counts = rng.poisson(3.0, (len(art.layers), art.idf.shape[1]))
    msg = parse_message({"bootstrap_room": 1, "layers": list(art.layers), "counts": counts.tolist()})
    t0 = time.perf_counter()
    for _ in range(iters):
        sig = enc.encode(msg)
    t_enc = (time.perf_counter() - t0) / iters
    body = orjson.dumps({"bootstrap_room": 1, "layers": msg["layers"], "counts": counts.tolist()})
    t0 = time.perf_counter()
    for _ in range(iters):
        parse_message(orjson.loads(body))
    t_json = (time.perf_counter() - t0) / iters
    print(f"signature: D={enc.centroids.shape[1]} ({enc.centroids.shape[1] * 4 / 1024:.0f} KB float32), "
          f"message {len(body) / 1024:.1f} KB JSON")
    print(f"  callback: orjson + validate {t_json * 1e6:7.1f} us   encode (IDF + L2) {t_enc * 1e6:7.1f} us")
    print(f"policy choose(), {servers} servers, K={enc.centroids.shape[0]}:")
    for name in ("random", "round_robin", "jsq", "p2c", "domain", "eldr"):
        p = make_policy(name, servers, centroids=enc.centroids, tau=0.1,
                        domain_map={"a": list(range(servers // 2))})
        req = RouteRequest(signature=sig, label="a")
        loads = rng.integers(0, 8, servers).tolist()
        allowed = [True] * servers
        t0 = time.perf_counter()
        for _ in range(iters):
            p.choose(req, loads, allowed)
        print(f"  {name:12s} {(time.perf_counter() - t0) / iters * 1e6:8.1f} us")


async def timed_requests(http: aiohttp.ClientSession, url: str, n: int, conc: int,
                         art_text: str) -> list[float]:
    lat: list[float] = []
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            async with http.post(url, data=orjson.dumps({"text": f"{art_text} {i}",
                                                          "bootstrap_room": i})) as r:
                await r.read()
                assert r.status == 200, r.status
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(one(i) for i in range(n)))
    return lat


async def start_stubs(n_sel: int, experts: int, args, signature_url: str):
    """Prefill + decode stubs in this event loop; returns (workers, prefill url, decode urls)."""
    prefill = StubWorker("prefill", layers=list(range(n_sel)), num_experts=experts,
                         latency=args.decode_latency, signature_url=signature_url)
    fixed = np.random.default_rng(2).poisson(3.0, (n_sel, experts)).tolist()
    prefill.counts_fn = lambda text: fixed
    decodes = [StubWorker("decode", name=f"d{i}", latency=args.decode_latency)
               for i in range(args.e2e_servers)]
    purl = await prefill.start()
    return [prefill] + decodes, purl, [await d.start() for d in decodes]


def serve_stubs(args) -> None:
    """Child-process mode: run the stubs, print their URLs as one JSON line, wait."""
    async def run() -> None:
        _, purl, durls = await start_stubs(args.layers, args.experts, args, args.signature_url)
        print(orjson.dumps({"prefill": purl, "decode": durls}).decode(), flush=True)
        await asyncio.Event().wait()
    asyncio.run(run())


async def bench_e2e(art, args) -> None:
    port = free_port()
    sig_url = f"http://127.0.0.1:{port}/eldr/signature"
    child, workers = None, []
    if args.in_process:
        workers, purl, durls = await start_stubs(len(art.layers), art.idf.shape[1], args, sig_url)
    else:
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve-stubs", "--signature-url", sig_url,
             "--layers", str(args.layers), "--experts", str(args.experts),
             "--e2e-servers", str(args.e2e_servers), "--decode-latency", str(args.decode_latency)],
            stdout=subprocess.PIPE, text=True)
        urls = orjson.loads(await asyncio.get_running_loop().run_in_executor(
            None, child.stdout.readline))
        purl, durls = urls["prefill"], urls["decode"]
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    where = "in this process" if args.in_process else "in a child process"
    print(f"\nend to end: {args.requests} requests, concurrency {args.concurrency}, stub latency "
          f"{args.decode_latency * 1e3:.1f} ms, 1 prefill + {args.e2e_servers} decode stubs {where}")
    print(f"  {'path':28s} {'p50 ms':>8s} {'p90 ms':>8s} {'p99 ms':>8s} {'mean ms':>8s}")
    try:
        await timed_requests(http, f"{durls[0]}/generate", 50, args.concurrency, "warm")
        base = await timed_requests(http, f"{durls[0]}/generate", args.requests,
                                    args.concurrency, "x")
        rows = [("direct to decode stub", base)]
        for policy in ("jsq", "eldr"):
            router = Router([(purl, 8998)], durls, policy,
                            artifact=art if policy_spec(policy).needs_artifact else None, signature_timeout=2.0)
            runner, _ = await start_router(router, port=port)
            url = f"http://127.0.0.1:{port}/generate"
            await timed_requests(http, url, 50, args.concurrency, "warm")
            lat = await timed_requests(http, url, args.requests, args.concurrency, "x")
            rows.append((f"router {policy}" + (" (+signature)" if policy_spec(policy).needs_artifact else ""), lat))
            fb = router.metrics.value("fallbacks")
            await runner.cleanup()
            if fb:
                print(f"  warning: {fb} fallbacks under {policy}")
        for name, lat in rows:
            print(f"  {name:28s} {pct(lat, 50) * 1e3:8.3f} {pct(lat, 90) * 1e3:8.3f} "
                  f"{pct(lat, 99) * 1e3:8.3f} {statistics.fmean(lat) * 1e3:8.3f}")
        b = pct(base, 50)
        for name, lat in rows[1:]:
            print(f"  added by {name:28s} p50 {(pct(lat, 50) - b) * 1e3:6.3f} ms")
    finally:
        await http.close()
        for w in workers:
            await w.stop()
        if child is not None:
            child.terminate()
            child.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--servers", type=int, default=16, help="decode servers / clusters (micro)")
    ap.add_argument("--e2e-servers", type=int, default=4, help="decode stubs (end to end)")
    ap.add_argument("--layers", type=int, default=24, help="selected layers in the signature")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--decode-latency", type=float, default=0.0)
    ap.add_argument("--in-process", action="store_true",
                    help="run the stubs in the router's event loop (default: a child process)")
    ap.add_argument("--serve-stubs", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--signature-url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_stubs:
        return serve_stubs(args)
    bench_policies(make_artifact(args.layers, args.experts, args.servers), args.servers, args.iters)
    asyncio.run(bench_e2e(make_artifact(args.layers, args.experts, args.e2e_servers), args))


if __name__ == "__main__":
    main()
