"""A bounded soak of the router under faults: does anything leak?

::

    python -m benchmark.bench_soak [--duration 180] [--clients 12] [--event-loop auto|asyncio|uvloop] [--quick]

The router runs in its own process (``python -m eldr_sglang.router``, a signature key,
the TCP signature port, ``--policy eldr`` on a toy artifact); one prefill and three
decode stubs (``eldr_sglang.testing.stub_worker``) and ``--clients`` client loops run
here, on loopback. Every few seconds one fault, in turn:

* ``prefill_500``: the prefill answers 500 after its signature and its latency, while
  the decode POST is in flight (the connection-leak case);
* ``decode_kill``: a decode stub is stopped, then started again on its port;
* ``decode_freeze``: a decode stub stops answering anything (health included), then thaws;
* ``bad_signatures``: unsigned, wrongly signed, malformed and stale messages on HTTP and
  the TCP port, half-lines left open, idle connections;
* ``replay``: one validly signed message sent again, over HTTP and TCP, many times.

At the start (after a warm-up of traffic and faults, every path taken once) and at the end (after the traffic stops and idle
connections had time to close) it prints the router's RSS, open file descriptors,
open and idle upstream connections, client requests in flight and per-worker
in-flight counts, and checks: RSS and fds flat within 5% (plus a small absolute
slack: allocator noise, and the few connections per worker the router's aiohttp
session keeps alive for health checks, load polls and aborts), upstream connections not above the start, every counter
back at 0, no client request lost (an exception or no answer), no broken 200 (an
answer that is not whole JSON, or a stream without its end). Exit status 1 when a
check fails. ``--quick``: 20 s. Results: ``benchmark/results/soak.json``
(``--quick``: under ``.cache/bench-quick``). The router runs with
``--signature-max-age 10`` and the warm-up lasts 30 s, so its replay memory (rooms
kept 2 x the age) has reached its steady size before the start figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import orjson

from benchmark.common import QUICK_OUT, RESULTS, free_port
from benchmark.router_process import RouterProcess
from eldr_sglang.core import wire
from eldr_sglang.testing.stub_worker import StubWorker, topic_counts
from eldr_sglang.testing.toy_artifact import save_toy_artifact

KEY = b"soak-key-0123456789abcdef"
N_DECODE = 3
SLACK_RSS_MB = 4.0  # allocator noise allowed on top of 5%
# the router's aiohttp session (health checks every 1 s, load polls every 0.5 s, aborts)
# keeps up to a few kept-alive connections per worker, more or fewer at any instant
SLACK_FDS = 2 + 2 * (1 + N_DECODE)
MAX_AGE_S = 10  # --signature-max-age: rooms are remembered 2 x this (steady before the start figures)
SETTLE_S = 8.0  # after the traffic: idle keep-alive connections (3 s) closed, signature streams idle


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid: int) -> dict[str, int]:
    """Open descriptors by kind (socket, pipe, anon_inode, file)."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kinds[target.split(":")[0] if ":" in target and not target.startswith("/") else "file"] += 1
    return dict(kinds)


class Soak:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.outcomes: Counter[str] = Counter()  # client answers by status / failure kind
        self.lost = 0  # client requests with no answer (an exception, a timeout)
        self.broken = 0  # 200s that are not whole JSON or a stream without its end
        self.faults: Counter[str] = Counter()
        self.stop_traffic = asyncio.Event()
        self.room = 1 << 40

    # ------------------------------------------------------------ setup
    async def start(self) -> None:
        a = self.args
        self.prefill = StubWorker("prefill", name="p0", signature_key=KEY, latency=0.02)
        self.decodes = [StubWorker("decode", name=f"d{i}", latency=0.03, stream_chunks=4)
                        for i in range(N_DECODE)]
        purl = await self.prefill.start()
        self.durls = [await d.start() for d in self.decodes]
        key_file = self.tmp / "key"
        key_file.write_bytes(KEY)
        artifact = save_toy_artifact(self.tmp / "artifact.json", N_DECODE)
        self.port, self.sig_port = free_port(), free_port()
        argv = [sys.executable, "-m", "eldr_sglang.router", "--prefill", purl, "8998",
                *[x for u in self.durls for x in ("--decode", u)],
                "--policy", "eldr", "--calibration", artifact, "--host", "127.0.0.1",
                "--port", str(self.port), "--signature-port", str(self.sig_port),
                "--signature-key-file", str(key_file), "--event-loop", a.event_loop,
                "--health-interval", "1", "--health-failures", "1", "--health-timeout", "0.5",
                "--health-cooldown", "1", "--first-byte-timeout", "2", "--signature-timeout", "1",
                "--signature-line-timeout", "2", "--signature-stream-idle", "5",
                "--signature-max-age", str(MAX_AGE_S), "--log-level", "warning"]
        self.process = RouterProcess(argv, self.port, self.tmp)
        self.router, self.url, self.http = self.process.proc, self.process.url, self.process.http
        await self.process.ready()

    async def close(self) -> None:
        await self.process.close()
        for w in [self.prefill, *self.decodes]:
            await w.stop()

    # ------------------------------------------------------------ measuring
    async def snapshot(self) -> dict:
        async with self.http.get(f"{self.url}/eldr/status") as r:
            st = await r.json()
        pid = self.router.pid
        return {"rss_mb": round(rss_mb(pid), 1), "fds": open_fds(pid), "fd_kinds": fd_kinds(pid),
                "upstream_open": st["upstream"]["open"], "upstream_idle": st["upstream"]["idle"],
                "upstream_waiting": st["upstream"]["waiting"],
                "active_requests": st["active_requests"],
                "worker_inflight": {w["url"].rsplit(":", 1)[1]: w.get("inflight")
                                    for w in st["prefill"] + st["decode"]},
                "signature_streams": st["signature_streams"],
                "signature_buffered": st["signature_buffer"]["buffered"],
                "signature_waiting": st["signature_buffer"]["waiting"],
                "client_connections": st["client_connections"]}

    # ------------------------------------------------------------ traffic
    async def client(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop_traffic.is_set():
            stream = rng.random() < 0.3
            body = {"text": f"topic:{rng.randrange(N_DECODE)} soak {i}", "stream": stream,
                    "sampling_params": {"max_new_tokens": 4}}
            try:
                async with self.http.post(f"{self.url}/generate", data=orjson.dumps(body),
                                          timeout=aiohttp.ClientTimeout(total=30)) as r:
                    raw = await r.read()
                    self.outcomes[str(r.status)] += 1
                    if r.status == 200 and not self.whole(raw, stream):
                        self.broken += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.lost += 1
                self.outcomes[type(e).__name__] += 1

    @staticmethod
    def whole(raw: bytes, stream: bool) -> bool:
        try:
            if not stream:
                return isinstance(orjson.loads(raw), dict)
            events = [e for e in raw.split(b"\n\n") if e.strip()]
            if not events or events[-1] != b"data: [DONE]":
                return False
            return all(isinstance(orjson.loads(e[len(b"data: "):]), dict) for e in events[:-1])
        except (orjson.JSONDecodeError, ValueError):
            return False

    # ------------------------------------------------------------ faults
    async def prefill_500(self) -> None:
        self.prefill.fail_after_kv = 1.0  # after its signature and latency: decode POSTs in flight
        await asyncio.sleep(2.0)
        self.prefill.fail_after_kv = 0.0

    async def decode_kill(self, k: int) -> None:
        d = self.decodes[k]
        port = int(self.durls[k].rsplit(":", 1)[1])
        await d.stop()
        await asyncio.sleep(2.0)
        fresh = StubWorker("decode", name=d.name, latency=0.03, stream_chunks=4)
        for _ in range(50):
            try:
                await fresh.start(port=port)
                break
            except OSError:  # the port in TIME_WAIT or still closing
                await asyncio.sleep(0.1)
        self.decodes[k] = fresh

    async def decode_freeze(self, k: int) -> None:
        d = self.decodes[k]
        d.freeze()
        await asyncio.sleep(3.0)
        d.thaw()

    def message(self, stamp: bool = True, ts: float | None = None) -> dict:
        self.room += 1
        msg = wire.build_message(self.room, "soak", 4, 0, [0, 1], topic_counts("topic:1"), packed=True)
        return {**msg, "ts": ts} if ts is not None else msg

    async def bad_signatures(self) -> None:
        post = f"{self.url}/eldr/signature"
        bodies = [(orjson.dumps(self.message()), {}),  # unsigned
                  (*wire.http_body(self.message(), b"wrong-key"),),  # another key
                  (b'{"bootstrap_room": "x"', {wire.MAC_HEADER: "sha256=" + "0" * 64}),  # malformed
                  (*wire.http_body(self.message(ts=time.time() - 3600), KEY),)]  # stale
        for body, headers in bodies:
            async with self.http.post(post, data=body, headers=headers) as r:
                await r.read()
        _, w = await asyncio.open_connection("127.0.0.1", self.sig_port)
        w.write(b'{"bootstrap_room": 1, "junk": "' + b"x" * 200_000 + b'"}\n')  # unsigned
        w.write(wire.stream_lines([self.message()], b"wrong-key"))
        w.write(b"sha256=" + b"f" * 64 + b" not json\n")
        w.write(b"sha256=" + b"0" * 64 + b' {"bootstrap_room": 2, ')  # a half-line left open
        await w.drain()
        idle = [await asyncio.open_connection("127.0.0.1", self.sig_port) for _ in range(20)]
        await asyncio.sleep(3.0)
        for _, x in [(None, w), *idle]:
            x.close()

    async def replay(self) -> None:
        body, headers = wire.http_body(self.message(), KEY)
        line = wire.stream_lines([self.message()], KEY)
        for _ in range(50):
            async with self.http.post(f"{self.url}/eldr/signature", data=body, headers=headers) as r:
                await r.read()
        _, w = await asyncio.open_connection("127.0.0.1", self.sig_port)
        w.write(line * 200)
        await w.drain()
        await asyncio.sleep(0.5)
        w.close()

    async def faults_loop(self, until: float) -> None:
        cycle = ["prefill_500", "decode_kill", "bad_signatures", "decode_freeze", "replay"]
        n = 0
        while time.monotonic() < until:
            name = cycle[n % len(cycle)]
            k = (n // len(cycle)) % N_DECODE
            self.faults[name] += 1
            if name == "prefill_500":
                await self.prefill_500()
            elif name == "decode_kill":
                await self.decode_kill(k)
            elif name == "decode_freeze":
                await self.decode_freeze(k)
            elif name == "bad_signatures":
                await self.bad_signatures()
            else:
                await self.replay()
            n += 1
            await asyncio.sleep(self.args.fault_every)

    # ------------------------------------------------------------ the run
    async def settle(self) -> dict:
        """Wait until nothing is in flight and idle connections could close (the
        router's worker keep-alive is 3 s, its aiohttp session's too), then measure."""
        end = time.monotonic() + 30
        while time.monotonic() < end:
            snap = await self.snapshot()
            if (snap["active_requests"] == 0 and not any(snap["worker_inflight"].values())
                    and snap["upstream_open"] == snap["upstream_idle"] == 0):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(SETTLE_S)
        return await self.snapshot()

    async def run(self) -> dict:
        a = self.args
        await self.start()
        try:
            clients = [asyncio.ensure_future(self.client(i)) for i in range(a.clients)]
            await self.faults_loop(time.monotonic() + a.warmup)  # every path once before measuring
            self.stop_traffic.set()
            await asyncio.gather(*clients)
            for d in self.decodes:
                d.thaw()
            warm_faults, self.faults = dict(self.faults), Counter()  # answers: counted over both
            start = await self.settle()
            print("start:", json.dumps(start), flush=True)
            self.stop_traffic.clear()
            t0 = time.monotonic()
            clients = [asyncio.ensure_future(self.client(i)) for i in range(a.clients)]
            await self.faults_loop(t0 + a.duration)
            self.stop_traffic.set()
            await asyncio.gather(*clients)
            for d in self.decodes:
                d.thaw()
            self.prefill.fail_after_kv = 0.0
            end = await self.settle()
            print("end:  ", json.dumps(end), flush=True)
            async with self.http.get(f"{self.url}/metrics") as r:
                metrics = await r.text()
        finally:
            await self.close()
        replays = sum(float(x.split()[-1]) for x in metrics.splitlines()
                      if x.startswith("eldr_router_errors_total") and 'kind="signature_replay"' in x)
        checks = {
            "rss_flat": end["rss_mb"] <= start["rss_mb"] * 1.05 + SLACK_RSS_MB,
            "fds_flat": end["fds"] <= start["fds"] * 1.05 + SLACK_FDS,
            "upstream_not_above_start": end["upstream_open"] <= start["upstream_open"],
            "counters_at_zero": (end["active_requests"] == 0 and end["upstream_waiting"] == 0
                                 and not any(end["worker_inflight"].values())
                                 and end["signature_waiting"] == 0),
            "no_lost_requests": self.lost == 0,
            "no_broken_200s": self.broken == 0,
            "replays_refused": replays > 0,
        }
        return {"duration_s": a.duration, "warmup_s": a.warmup, "warmup_faults": warm_faults,
                "clients": a.clients, "event_loop": a.event_loop,
                "start": start, "end": end, "answers": dict(self.outcomes), "lost": self.lost,
                "broken_200s": self.broken, "faults": dict(self.faults),
                "replays_refused": replays, "checks": checks, "ok": all(checks.values())}


def main() -> None:
    import logging

    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # stubs writing to closed peers
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180.0, help="seconds of traffic under faults")
    p.add_argument("--warmup", type=float, default=30.0,
                   help="seconds of traffic before the start figures (past 2 x the signature max age, "
                        "so the replay memory is at its steady size)")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--fault-every", type=float, default=2.0, help="seconds between two faults")
    p.add_argument("--event-loop", default="auto", choices=("auto", "uvloop", "asyncio"))
    p.add_argument("--quick", action="store_true", help="20 s (a smoke run, not a figure)")
    args = p.parse_args()
    if args.quick:
        args.duration, args.warmup = 20.0, 25.0
    with tempfile.TemporaryDirectory(prefix="eldr-soak-") as tmp:
        result = asyncio.run(Soak(args, Path(tmp)).run())
    out = (QUICK_OUT if args.quick else RESULTS) / f"soak{'-' + args.event_loop if args.event_loop != 'auto' else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("answers", "lost", "broken_200s", "faults",
                                             "replays_refused", "checks", "ok")}, indent=1))
    print(f"written to {out}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
