"""ELDR router vs sglang-router 0.3.2 (PD mode) on the same stub workers.

    python benchmark/bench_router_vs_sglang_router.py [--requests 1000] [--duration 10]
        [--load-concurrency 32] [--decodes 4] [--skip-sglang] [--json out.json]

1. decision time: ``EldrPolicy.choose()`` / ``explain()`` at K = 24 centroids of
   dim 6144 (24 layers x 256 experts), 24 decode servers; signature encode time;
2. router-added latency: p50/p99 of sequential requests (concurrency 1) through
   each router (every path started first, then measured in interleaved rounds so
   the machine's drift hits all alike) minus the same figure without a router (``direct``: the client
   itself posts prefill and decode at once, with the bootstrap fields);
3. max sustained throughput: closed loop, ``--load-concurrency`` clients for
   ``--duration`` s; the router's RSS is sampled during the run (memory must stay
   flat) and, for the ELDR router, its signature board size afterwards.

Routers compared (each its own process, stubs in another, client here):
``eldr`` (ELDR router, eldr policy, signature hop: prefill stub posts a 24 x 256
count message per request, counts packed as the engine plugin sends them),
``eldr-list`` (the same with counts as JSON rows), ``eldr-tcp`` (packed counts as
JSON lines on the router's ``--signature-port``: the engine's ``--eldr-publish tcp://``), ``eldr-rr`` (ELDR router, round_robin: no signature
wait), ``sglang-router`` (``python -m sglang_router.launch_router
--pd-disaggregation ... --policy round_robin``: posts prefill and decode at once).
The stubs keep SGLang's PD dependency (``eldr_sglang/testing/stub_worker.py: KvHandoff``): a
decode stub answers only after the prefill stub finished the same bootstrap room,
and the prefill stub only after a decode stub took it, so a router that posts both
at once (sglang-router) and one that posts decode after the signature (ELDR) both
pay the prefill-then-decode order the workers impose; what differs is the router.
``--no-kv-handoff`` gives stubs that answer at once (decode never waits for a
prefill; baseline: one decode stub alone): there, late binding's serial order
counts as router latency in full.
All processes share the machine's cores: on a 2-core machine the stubs and the
Python client are part of the bottleneck for every router alike.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import aiohttp
import numpy as np
import orjson

from eldr_sglang.router.cli import run_loop  # uvloop for the stubs and the client too
from eldr_sglang.router.metrics import histogram_quantiles

ROOT = Path(__file__).resolve().parents[1]

N_LAYERS, N_EXPERTS, K_DECISION = 24, 256, 24
JSON_HEADERS = {"Content-Type": "application/json"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_artifact(k: int, seed: int = 0):
    from eldr_sglang.core.artifact import CalibrationArtifact
    from eldr_sglang.core.traces import ModelSpec

    rng = np.random.default_rng(seed)
    idf = rng.uniform(0.5, 3.0, (N_LAYERS, N_EXPERTS)).astype(np.float32)
    cents = rng.random((k, N_LAYERS * N_EXPERTS)).astype(np.float32) ** 4
    cents /= np.linalg.norm(cents, axis=1, keepdims=True)
    return CalibrationArtifact(model=ModelSpec("bench-moe", N_LAYERS, N_EXPERTS, 8),
                               variant="idf", layers=list(range(N_LAYERS)), idf=idf,
                               centroids=cents)


def timeit(f, n: int) -> tuple[float, float]:
    for _ in range(min(n, 2000)):
        f()
    ts = np.empty(n)
    pc = time.perf_counter
    for i in range(n):
        t = pc()
        f()
        ts[i] = pc() - t
    return float(np.median(ts)) * 1e6, float(np.percentile(ts, 99)) * 1e6


def bench_decision(iters: int) -> dict:
    from eldr_sglang.core.counts_codec import pack_counts
    from eldr_sglang.core.policies import RouteRequest, make_policy
    from eldr_sglang.router.signatures import SignatureEncoder, parse_message

    art = make_artifact(K_DECISION)
    enc = SignatureEncoder(art)
    rng = np.random.default_rng(1)
    counts = rng.poisson(3.0, (N_LAYERS, N_EXPERTS))
    msg = parse_message({"bootstrap_room": 1, "layers": list(range(N_LAYERS)),
                         "counts": counts.tolist()})
    sig = enc.encode(msg)
    pol = make_policy("eldr", K_DECISION, centroids=enc.centroids, tau=0.1)
    req = RouteRequest(sig)
    loads = rng.integers(0, 8, K_DECISION).tolist()
    allowed = [True] * K_DECISION
    out = {"K": K_DECISION, "dim": int(enc.centroids.shape[1]), "servers": K_DECISION}
    out["choose_us"] = timeit(lambda: pol.choose(req, loads, allowed), iters)
    out["explain_us"] = timeit(lambda: pol.explain(req, loads, allowed), iters)
    out["matvec_us"] = timeit(lambda: enc.centroids @ sig, iters)
    out["encode_us"] = timeit(lambda: enc.encode(msg), iters // 4)
    body = orjson.dumps({"bootstrap_room": 1, "layers": msg["layers"], "counts": counts.tolist()})
    out["parse_us"] = timeit(lambda: parse_message(orjson.loads(body)), iters // 4)
    out["message_kb"] = len(body) / 1024
    packed = orjson.dumps({"bootstrap_room": 1, "layers": msg["layers"], "counts": pack_counts(counts)})
    out["parse_packed_us"] = timeit(lambda: parse_message(orjson.loads(packed)), iters // 4)
    out["packed_kb"] = len(packed) / 1024
    return out


# ---------------------------------------------------------------- processes
def serve_stubs(args) -> None:
    """Child mode: 1 prefill + N decode stubs in one event loop; prints their URLs."""
    import logging

    from eldr_sglang.core.counts_codec import pack_counts
    from eldr_sglang.testing.stub_worker import KvHandoff, StubWorker

    # sglang-router first probes workers with gRPC (HTTP/2 preface): aiohttp logs a
    # 400 "Pause on PRI/Upgrade" per probe, harmless, then it falls back to HTTP
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    async def run() -> None:
        kv = None if args.no_kv_handoff else KvHandoff()
        fixed = np.random.default_rng(2).poisson(3.0, (N_LAYERS, N_EXPERTS))
        # the engine's cost of packing is measured by bench_engine_overhead.py; here the
        # stub sends one prepared message, as fast as a worker can
        fixed = fixed.tolist() if args.list_counts else pack_counts(fixed)
        prefill = StubWorker("prefill", layers=list(range(N_LAYERS)), num_experts=N_EXPERTS,
                             signature_url=args.signature_url, packed_counts=not args.list_counts,
                             send_signature=bool(args.signature_url), stream_chunks=1, kv=kv)
        prefill.counts_fn = lambda text: fixed
        decodes = [StubWorker("decode", name=f"d{i}", stream_chunks=1, kv=kv) for i in range(args.decodes)]
        urls = {"prefill": await prefill.start(), "decode": [await d.start() for d in decodes]}
        for w in [prefill] + decodes:  # keep memory flat over long runs
            w.requests = _Discard()
        print(orjson.dumps(urls).decode(), flush=True)
        await asyncio.Event().wait()

    run_loop(run())


class _Discard(list):
    def append(self, x) -> None:  # the stubs record bodies for tests; not here
        pass


def start_stubs(decodes: int, signature_url: str = "", list_counts: bool = False,
                kv_handoff: bool = True) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, __file__, "--serve-stubs", "--decodes", str(decodes)]
    if not kv_handoff:
        cmd += ["--no-kv-handoff"]
    if signature_url:
        cmd += ["--signature-url", signature_url]
    if list_counts:
        cmd += ["--list-counts"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    return proc, orjson.loads(proc.stdout.readline())


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_healthy(url: str, timeout: float, proc: subprocess.Popen) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: process exited with {proc.returncode}")
            try:
                async with http.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} not healthy after {timeout}s")


# ---------------------------------------------------------------- load
async def post_status(http, url: str, data: bytes) -> int:
    async with http.post(url, data=data, headers=JSON_HEADERS) as r:
        await r.read()
        return r.status


def pd_payload(body: dict, room: int) -> bytes:
    """The body as a PD router sends it to both servers (the stubs' bootstrap fields)."""
    return orjson.dumps({**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998,
                         "bootstrap_room": room})


def router_sender(http, url: str):
    """``send(body) -> HTTP status`` through a router (or straight to one stub)."""
    async def send(body: dict) -> int:
        return await post_status(http, url, orjson.dumps(body))
    return send


def pd_sender(http, urls: dict):
    """``send(body)`` as a router of zero cost would: the client itself adds the
    bootstrap fields and posts prefill and decode (round robin) at once, as mini_lb."""
    gens = [f"{u}/generate" for u in urls["decode"]]
    prefill = f"{urls['prefill']}/generate"
    rr = itertools.count()

    async def send(body: dict) -> int:
        data = pd_payload(body, random.getrandbits(63))
        p, d = await asyncio.gather(post_status(http, prefill, data),
                                    post_status(http, gens[next(rr) % len(gens)], data))
        return d if p == 200 else p
    return send


class LateSender:
    """``send(body)`` as a late-binding router of zero cost would: the client posts
    prefill, reads the room's signature from its own TCP signature port, then posts
    decode (round robin: no policy work) and waits for both. Its latency minus the
    concurrent PD client's is what late binding costs on these stubs whatever the
    router; a router's latency minus this one's is the router's own cost."""

    def __init__(self, http, urls: dict, port: int) -> None:
        self.http, self.urls, self.port = http, urls, port
        self.waiting: dict[int, asyncio.Future] = {}
        self.rr = itertools.count()
        self.server: Optional[asyncio.AbstractServer] = None

    async def start(self) -> None:
        async def on_conn(reader, writer) -> None:
            while line := await reader.readline():
                msg = orjson.loads(line)
                fut = self.waiting.get(msg["bootstrap_room"])
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            writer.close()
        self.server = await asyncio.start_server(on_conn, "127.0.0.1", self.port, limit=2**24)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def __call__(self, body: dict) -> int:
        room = random.getrandbits(63)
        data = pd_payload(body, room)
        fut = self.waiting[room] = asyncio.get_running_loop().create_future()
        try:
            prefill = asyncio.ensure_future(post_status(self.http, f"{self.urls['prefill']}/generate", data))
            await asyncio.wait_for(fut, 10)
            decodes = self.urls["decode"]
            d = await post_status(self.http, f"{decodes[next(self.rr) % len(decodes)]}/generate", data)
            p = await prefill
        finally:
            del self.waiting[room]
        return d if p == 200 else p


async def sequential(send, n: int) -> np.ndarray:
    lat = np.empty(n)
    for i in range(n):
        body = {"text": f"topic:{i % 4} bench {i}", "sampling_params": {"max_new_tokens": 1}}
        t0 = time.perf_counter()
        status = await send(body)
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
        lat[i] = time.perf_counter() - t0
    return lat


async def closed_loop(send, conc: int, duration: float, pid: int) -> dict:
    done = errors = 0
    stop_at = time.perf_counter() + duration
    rss = []

    async def worker(w: int) -> None:
        nonlocal done, errors
        i = 0
        while time.perf_counter() < stop_at:
            body = {"text": f"topic:{(w + i) % 4} load {i}"}
            i += 1
            try:
                if await send(body) == 200:
                    done += 1
                else:
                    errors += 1
            except aiohttp.ClientError:
                errors += 1

    async def sampler() -> None:
        while time.perf_counter() < stop_at:
            rss.append(rss_mb(pid))
            await asyncio.sleep(max(duration / 10, 0.2))

    t0 = time.perf_counter()
    await asyncio.gather(sampler(), *(worker(w) for w in range(conc)))
    el = time.perf_counter() - t0
    return {"rps": done / el, "ok": done, "errors": errors, "rss_mb": [round(x, 1) for x in rss]}


class Target:
    """One way of sending requests (a router, or a client baseline) with its processes."""

    def __init__(self, name: str) -> None:
        self.name, self.url, self.urls = name, "", {}
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []
        self.sig_port = 0
        self.send = None
        self.lat: list[float] = []

    @property
    def pid(self) -> int:  # the router's (or, without one, the stubs') process: RSS sampled
        return self.procs[-1].pid

    def stop(self) -> None:
        if isinstance(self.send, LateSender):
            self.send.close()
        for proc in reversed(self.procs):
            stop(proc)
        for log in self.logs:
            log.close()


async def start_path(name: str, args, artifact_path: str) -> Target:
    """Start ``name``'s stubs and router (if any) and wait until they answer."""
    path = Target(name)
    port = free_port()
    url = path.url = f"http://127.0.0.1:{port}"
    sig_port = path.sig_port = free_port()
    sig_url = {"eldr": f"{url}/eldr/signature", "eldr-list": f"{url}/eldr/signature",
               "eldr-tcp": f"tcp://127.0.0.1:{sig_port}",
               "direct-late": f"tcp://127.0.0.1:{sig_port}"}.get(name, "")
    stubs, path.urls = start_stubs(args.decodes, sig_url, list_counts=name == "eldr-list",
                                   kv_handoff=not args.no_kv_handoff)
    path.procs.append(stubs)
    urls = path.urls
    if name in ("direct", "direct-late"):  # the baselines: no router
        return path
    try:
        if name.startswith("eldr"):
            cmd = [sys.executable, "-m", "eldr_sglang.router", "--host", "127.0.0.1",
                   "--port", str(port), "--prefill", urls["prefill"], "8998",
                   "--policy", "round_robin" if name == "eldr-rr" else "eldr",
                   "--calibration", artifact_path, "--log-level", "warning"]
            if name == "eldr-tcp":
                cmd += ["--signature-port", str(sig_port)]
        else:
            cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                   "--prefill", urls["prefill"], "8998", "--policy", "round_robin",
                   "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"]
        for d in urls["decode"]:
            cmd += ["--decode", d]
        log = open(Path(tempfile.gettempdir()) / f"bench-{name}.log", "w")
        path.logs.append(log)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        path.procs.append(proc)
        t0 = time.monotonic()
        await wait_healthy(url, args.start_timeout, proc)
        if name == "sglang-router":  # /health answers before workers are registered
            await _wait_sglang_workers(url, time.monotonic() - t0, args.start_timeout)
    except BaseException:
        path.stop()
        raise
    return path


async def make_sender(path: Target, http, args):
    if path.name == "direct":
        if args.no_kv_handoff:
            return router_sender(http, f"{path.urls['decode'][0]}/generate")
        return pd_sender(http, path.urls)
    if path.name == "direct-late":
        send = LateSender(http, path.urls, path.sig_port)
        await send.start()
        return send
    return router_sender(http, f"{path.url}/generate")


async def measure_all(paths: list[Target], args) -> dict:
    """Latency in interleaved rounds (every path takes its turn in each round, in a
    rotating order, so drift of this shared machine hits them alike), then each
    path's throughput alone (the others idle)."""
    rows = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for p in paths:
            p.send = await make_sender(p, http, args)
            await sequential(p.send, args.warmup)
        per_round = max(1, args.requests // args.rounds)
        for r in range(args.rounds):
            k = r % len(paths)
            for p in paths[k:] + paths[:k]:
                p.lat.extend((await sequential(p.send, per_round)).tolist())
        for p in paths:
            print(f"  closed loop: {p.name} ...", flush=True)
            load = await closed_loop(p.send, args.load_concurrency, args.duration, p.pid)
            extra = {}
            if p.name.startswith("eldr"):
                async with http.get(f"{p.url}/eldr/status") as resp:
                    st = await resp.json()
                extra = {"board": st["signature_buffer"], "fallbacks": st["counters"].get("fallbacks", 0)}
                async with http.get(f"{p.url}/metrics") as resp:
                    text = await resp.text()
                extra["added_latency_metric"] = histogram_quantiles(text, "eldr_router_added_latency_seconds")
            lat = np.asarray(p.lat)
            rows[p.name] = {"name": p.name, "p50_ms": float(np.percentile(lat, 50)) * 1e3,
                            "p99_ms": float(np.percentile(lat, 99)) * 1e3, "samples": len(lat),
                            **load, **extra}
    return rows


async def run_paths(names: list[str], args, artifact_path: str) -> dict:
    paths = []
    try:
        for name in names:
            print(f"starting {name} ...", flush=True)
            try:
                paths.append(await start_path(name, args, artifact_path))
            except Exception as e:  # noqa: BLE001 - report and continue
                print(f"  {name} failed to start: {e}")
        return await measure_all(paths, args)
    finally:
        for p in paths:
            p.stop()


async def _wait_sglang_workers(url: str, spent: float, timeout: float) -> None:
    async with aiohttp.ClientSession() as http:
        while spent < timeout:
            try:
                async with http.post(f"{url}/generate", json={"text": "probe"}) as r:
                    await r.read()
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
            spent += 0.5
    raise RuntimeError("sglang-router never routed a request")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000, help="sequential requests (latency)")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=10,
                    help="latency rounds: each path sends requests/rounds per round, in turn")
    ap.add_argument("--duration", type=float, default=10.0, help="closed-loop seconds (throughput)")
    ap.add_argument("--load-concurrency", type=int, default=32)
    ap.add_argument("--decodes", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20000, help="decision-time iterations")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--skip-sglang", action="store_true")
    ap.add_argument("--only", help="comma list of: direct,direct-late,eldr-tcp,eldr,eldr-list,eldr-rr,sglang-router")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--serve-stubs", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--signature-url", help=argparse.SUPPRESS)
    ap.add_argument("--list-counts", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-kv-handoff", action="store_true",
                    help="stubs answer at once, decode never waits for its prefill (not SGLang's "
                         "protocol); the baseline is then one decode stub alone")
    args = ap.parse_args()
    if args.serve_stubs:
        return serve_stubs(args)

    print(f"cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")
    dec = bench_decision(args.iters)
    print(f"\ndecision time, K={dec['K']} centroids x dim {dec['dim']}, {dec['servers']} servers "
          f"(median / p99 us; goal <= 20 us median):")
    for key in ("choose_us", "explain_us", "matvec_us", "encode_us", "parse_us", "parse_packed_us"):
        print(f"  {key[:-3]:12s} {dec[key][0]:8.1f} {dec[key][1]:8.1f}")
    print(f"  (signature message {dec['message_kb']:.1f} KB with JSON rows, "
          f"{dec['packed_kb']:.1f} KB packed)")

    late_bound = ("eldr-tcp", "eldr", "eldr-list")
    names = ["direct", "direct-late", "eldr-tcp", "eldr", "eldr-list", "eldr-rr"] + \
        ([] if args.skip_sglang else ["sglang-router"])
    if args.only:
        names = [n for n in args.only.split(",")]
        if "direct" not in names:
            names.insert(0, "direct")
        if "direct-late" not in names and any(n in late_bound for n in names):
            names.insert(1, "direct-late")
    with tempfile.TemporaryDirectory() as tmp:
        art_path = str(make_artifact(args.decodes).save(Path(tmp) / "artifact.json"))
        rows = run_loop(run_paths(names, args, art_path))
    base, late = rows.get("direct"), rows.get("direct-late")
    base_what = "one decode stub" if args.no_kv_handoff else "client posting prefill+decode itself"
    print(f"\n{args.requests} sequential requests per path in {args.rounds} interleaved rounds "
          f"(added = router - direct: {base_what}), then "
          f"{args.duration:.0f}s closed loop at concurrency {args.load_concurrency}; "
          f"{args.decodes} decode stubs + 1 prefill stub in one process, "
          f"KV handoff {'off' if args.no_kv_handoff else 'on (decode waits for its prefill)'}")
    print("  direct-late: the client late-binds itself (prefill, its own signature port, then decode); "
          "'own' = a late-binding router's p50 minus direct-late's: the router's own cost")
    print(f"  {'path':15s} {'p50 ms':>7s} {'p99 ms':>7s} {'+p50 ms':>8s} {'+p99 ms':>8s} {'own p50':>8s} "
          f"{'req/s':>7s} {'errors':>6s}  RSS MB (start -> end)")
    nan = float("nan")
    for name, r in rows.items():
        add50 = r["p50_ms"] - base["p50_ms"] if base and name != "direct" else nan
        add99 = r["p99_ms"] - base["p99_ms"] if base and name != "direct" else nan
        own = r["p50_ms"] - late["p50_ms"] if late and name in late_bound else nan
        rss = r["rss_mb"]
        print(f"  {name:15s} {r['p50_ms']:7.3f} {r['p99_ms']:7.3f} {add50:8.3f} {add99:8.3f} {own:8.3f} "
              f"{r['rps']:7.0f} {r['errors']:6d}  {rss[0] if rss else 0:.1f} -> {rss[-1] if rss else 0:.1f}")
    for name in late_bound + ("eldr-rr",):
        if name in rows:
            r = rows[name]
            print(f"  {name}: in-router added latency (metric, bucket bound) "
                  f"{r.get('added_latency_metric')}, board after load {r.get('board')}, "
                  f"fallbacks {r.get('fallbacks')}")
    sg = rows.get("sglang-router")
    if sg and base:
        for name in late_bound + ("eldr-rr",):
            if name in rows:
                r = rows[name]
                own = f", own {r['p50_ms'] - late['p50_ms']:.3f} ms" if late and name in late_bound else ""
                print(f"  ratio {name}/sglang-router: throughput {r['rps'] / sg['rps']:.2f}x "
                      f"(goal >= 0.5x), added p50 {r['p50_ms'] - base['p50_ms']:.3f} ms{own} vs "
                      f"{sg['p50_ms'] - base['p50_ms']:.3f} ms (goal <= 0.5 ms)")
    if args.json:
        command = "python benchmark/bench_router_vs_sglang_router.py " + " ".join(sys.argv[1:])
        Path(args.json).write_text(json.dumps({"command": command.strip(), "decision": dec,
                                               "routers": rows}, indent=1))


if __name__ == "__main__":
    main()
