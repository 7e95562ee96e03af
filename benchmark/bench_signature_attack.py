"""Does an attacker, or a skewed engine clock, switch ELDR off? (signature intake, issue 47)

::

    python -m benchmark.bench_signature_attack [--duration 120] [--clients 4] [--quick]

The router runs in its own process (``python -m eldr_sglang.router``, a signature key,
the TCP ``--signature-port``, ``--policy eldr`` on a toy artifact, every intake limit at
its default); two prefill and three decode stubs and the client loops run here, the
attacker in a process of its own, all on loopback. ``--rounds`` interleaved pairs of runs
(so the machine's other load weighs on both), ``--duration`` seconds of each kind in all:

* ``quiet``: the clients alone (both prefills' clocks right);
* ``attack``: the same clients while the attacker holds signature-port slots
  (``--slot-conns`` connections from ``--attacker-hosts`` loopback addresses, a newline
  every 2 s, reconnecting when closed), fills the partial-line budget with half-lines
  behind a well-formed but wrong MAC prefix (``--partial-conns`` x 1 MiB, renewed every
  7 s), and posts forged stale messages (HTTP and TCP, wrong key, random rooms,
  ``--forged-rate`` a second); the second prefill's clock runs 61 s ahead (an unlucky
  operator), and the honest prefill's connection is dropped every 5 s (it reconnects,
  as after a restart).

Honest requests are those the honest prefill served. Checks: they keep >= 95% signature
decisions (routed to their topic's decode server) and their p50 latency is within 10% of
the quiet runs'; the skewed engine's requests (routed by load) are answered as fast as
in the quiet runs (p50 within 10%: they never wait out the signature timeout); no request
is lost. The router's CPU per request in each kind of run is reported too (the attacker
runs on the same cores). ``--quick``: 2 rounds, 20 s of each kind (a smoke test: the p50
checks are reported, not enforced). Results: ``benchmark/results/signature_attack.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson

from benchmark.common import QUICK_OUT, RESULTS, free_port, parse_with_quick
from benchmark.router_process import RouterProcess
from benchmark.process_cpu import cpu_seconds
from eldr_sglang.core import wire
from eldr_sglang.testing.stub_worker import StubWorker, topic_counts
from eldr_sglang.testing.toy_artifact import save_toy_artifact

KEY = b"attack-bench-key-0123456789abcdef"
N_DECODE = 3
SKEW_S = 61.0
FAKE_MAC = b"sha256=" + b"ab" * 32 + b" "  # well-formed, wrong: only the line's end tells


class TaggedStub(StubWorker):
    """A prefill stub that remembers the rids it published for, its clock ``skew`` s off."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.skew = 0.0
        self.rids: set[str] = set()

    def _message(self, room, rid: str, text: str) -> dict:
        self.rids.add(rid)
        msg = super()._message(room, rid, text)
        return {**msg, wire.TS_FIELD: round(time.time() + self.skew, 3)} if self.skew else msg

    def drop_streams(self) -> None:
        """Close the kept-open signature connections: the next message reconnects."""
        for w in list(self._writers.values()):
            w.close()


# ------------------------------------------------------------------ the attacker (own process)
def _source(i: int, hosts: int) -> tuple[str, int]:
    """Connection ``i``'s source address: one of ``hosts`` loopback addresses (127.0.0.2...)."""
    return f"127.0.0.{2 + i % hosts}", 0


async def _hold(active: asyncio.Event, port: int, src: tuple[str, int], first: bytes, every: float,
                then: bytes | None) -> None:
    """While ``active``: a connection that sends ``first``, then ``then`` every ``every`` s
    (None: a fresh connection instead); reconnects when the router closes it."""
    loop = asyncio.get_running_loop()
    while True:
        await active.wait()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=src)
            w.write(first)
            await w.drain()
            last = loop.time()
            while active.is_set() and not r.at_eof() and r.exception() is None:
                await asyncio.sleep(0.5)
                if loop.time() - last >= every:
                    if then is None:
                        break
                    w.write(then)
                    await w.drain()
                    last = loop.time()
            w.close()
        except (ConnectionError, OSError):
            await asyncio.sleep(0.2)


async def _forger(url: str, port: int, rate: float, active: asyncio.Event) -> None:
    rng = random.Random(1)
    w = None
    async with aiohttp.ClientSession() as http:
        while True:
            await active.wait()
            msg = {**wire.build_message(rng.getrandbits(62), "x", 4, 0, [0, 1], topic_counts("topic:0"),
                                        packed=True), wire.TS_FIELD: time.time() - 600}
            body, headers = wire.http_body(msg, b"not-the-key")
            try:
                async with http.post(f"{url}/eldr/signature", data=body, headers=headers) as r:
                    await r.read()
                if w is None or w.is_closing():
                    _, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(wire.stream_lines([msg], b"not-the-key"))
                await w.drain()
            except (aiohttp.ClientError, ConnectionError, OSError):
                w = None
            await asyncio.sleep(2.0 / rate)  # a message over HTTP and one over TCP each turn


async def _attack(url: str, port: int, opts: dict, flags) -> None:
    """Attacks while ``flags["active"]`` is set, until ``flags["stop"]``."""
    active, hosts = asyncio.Event(), opts["attacker_hosts"]
    half = FAKE_MAC + b"x" * (opts["partial_bytes"] - len(FAKE_MAC))
    tasks = [asyncio.ensure_future(_hold(active, port, _source(i, hosts), b"\n", 2.0, b"\n"))
             for i in range(opts["slot_conns"])]
    tasks += [asyncio.ensure_future(_hold(active, port, _source(i, hosts), half, 7.0, None))
              for i in range(opts["partial_conns"])]  # renewed under --signature-line-timeout
    tasks.append(asyncio.ensure_future(_forger(url, port, opts["forged_rate"], active)))
    while not flags["stop"].is_set():
        if flags["active"].is_set() != active.is_set():
            active.set() if flags["active"].is_set() else active.clear()
        await asyncio.sleep(0.05)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def attacker_main(url: str, port: int, opts: dict, flags) -> None:
    os.nice(opts["attacker_nice"])  # a remote attacker's CPU is not this machine's
    asyncio.run(_attack(url, port, opts, flags))


# ------------------------------------------------------------------ the bench
class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.records: list[dict] = []
        self.sent = 0  # requests sent (unique rids over all rounds)
        self.attacker_pid: int | None = None
        self.phases: dict[str, dict] = {}  # run name -> seconds, router CPU, engine reconnects
        self.stop = asyncio.Event()

    async def start(self) -> None:
        self.honest = TaggedStub("prefill", name="p0", signature_key=KEY, latency=0.02)
        self.skewed = TaggedStub("prefill", name="p1", signature_key=KEY, latency=0.02)
        self.decodes = [StubWorker("decode", name=f"d{i}", latency=0.03) for i in range(N_DECODE)]
        purls = [await self.honest.start(), await self.skewed.start()]
        durls = [await d.start() for d in self.decodes]
        (self.tmp / "key").write_bytes(KEY)
        artifact = save_toy_artifact(self.tmp / "artifact.json", N_DECODE)
        self.port, self.sig_port = free_port(), free_port()
        argv = [sys.executable, "-m", "eldr_sglang.router", *[x for u in purls for x in ("--prefill", u, "8998")],
                *[x for u in durls for x in ("--decode", u)], "--policy", "eldr", "--calibration", artifact,
                "--host", "127.0.0.1", "--port", str(self.port), "--signature-port", str(self.sig_port),
                "--signature-key-file", str(self.tmp / "key"), "--log-level", "error"]
        self.process = RouterProcess(argv, self.port, self.tmp)
        self.router, self.url, self.http = self.process.proc, self.process.url, self.process.http
        await self.process.ready()

    async def close(self) -> None:
        await self.process.close()
        for w in [self.honest, self.skewed, *self.decodes]:
            await w.stop()

    async def client(self, i: int, run: str) -> None:
        rng = random.Random(f"{run}-{i}-{len(self.records)}")
        while not self.stop.is_set():
            self.sent += 1
            topic, rid = rng.randrange(N_DECODE), f"{run}-{i}-{self.sent}"
            body = {"text": f"topic:{topic} bench {i}", "rid": rid, "sampling_params": {"max_new_tokens": 4}}
            t0 = time.perf_counter()
            try:
                async with self.http.post(f"{self.url}/generate", data=orjson.dumps(body),
                                          timeout=aiohttp.ClientTimeout(total=60)) as r:
                    raw, status = await r.read(), r.status
                server = orjson.loads(raw)["meta_info"]["server"] if status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, KeyError):
                status, server = 0, None
            self.records.append({"run": run, "rid": rid, "topic": topic, "status": status, "server": server,
                                 "latency": time.perf_counter() - t0})

    async def reconnects(self) -> int:
        n = 0
        while not self.stop.is_set():
            await asyncio.sleep(5.0)
            self.honest.drop_streams()
            n += 1
        return n

    async def run(self, name: str, duration: float) -> None:
        """``duration`` s of client traffic, counted under ``name`` (the router's CPU too)."""
        self.stop.clear()
        cpu0 = sum(cpu_seconds(self.router.pid))
        att0 = sum(cpu_seconds(self.attacker_pid)) if self.attacker_pid is not None else 0.0
        clients = [asyncio.ensure_future(self.client(i, name)) for i in range(self.args.clients)]
        drops = asyncio.ensure_future(self.reconnects()) if name == "attack" else None
        await asyncio.sleep(duration)
        self.stop.set()
        await asyncio.gather(*clients)
        st = self.phases.setdefault(name, {"seconds": 0.0, "router_cpu_s": 0.0, "engine_reconnects": 0})
        st["seconds"] += duration
        st["router_cpu_s"] = round(st["router_cpu_s"] + sum(cpu_seconds(self.router.pid)) - cpu0, 2)
        if self.attacker_pid is not None:
            st["attacker_cpu_s"] = round(st.get("attacker_cpu_s", 0.0) + sum(cpu_seconds(self.attacker_pid))
                                         - att0, 2)
        st["engine_reconnects"] += await drops if drops else 0

    def summary(self, name: str) -> dict:
        rec = [r for r in self.records if r["run"] == name]
        honest = [r for r in rec if r["rid"] in self.honest.rids]
        skewed = [r for r in rec if r["rid"] in self.skewed.rids]
        by_sig = sum(r["server"] == f"d{r['topic']}" for r in honest)

        def p50(rs):
            return round(float(np.median([r["latency"] for r in rs])) * 1000, 1) if rs else None
        cpu = self.phases[name]["router_cpu_s"]
        return {**self.phases[name], "router_cpu_ms_per_request": round(1000 * cpu / max(1, len(rec)), 3),
                "requests": len(rec), "lost": sum(r["status"] != 200 for r in rec),
                "honest": len(honest), "honest_signature_share": round(by_sig / max(1, len(honest)), 4),
                "honest_p50_ms": p50(honest), "skewed_engine": len(skewed), "skewed_p50_ms": p50(skewed),
                "skewed_max_ms": round(max((r["latency"] for r in skewed), default=0) * 1000, 1)}

    async def status(self) -> dict:
        async with self.http.get(f"{self.url}/eldr/status") as r:
            return (await r.json()).get("signature_intake")


async def measure(args: argparse.Namespace, tmp: Path) -> dict:
    """Interleaved rounds (quiet, then attack), so the machine's other load weighs on both."""
    b = Bench(args, tmp)
    await b.start()
    ctx = multiprocessing.get_context("spawn")
    flags = {"active": ctx.Event(), "stop": ctx.Event()}
    opts = {k: getattr(args, k) for k in ("slot_conns", "partial_conns", "partial_bytes", "forged_rate",
                                           "attacker_hosts", "attacker_nice")}
    attacker = ctx.Process(target=attacker_main, args=(b.url, b.sig_port, opts, flags), daemon=True)
    try:
        attacker.start()
        b.attacker_pid = attacker.pid
        await b.run("warmup", 3.0)  # the adaptive signature wait learns from real waits
        for _ in range(args.rounds):
            await b.run("quiet", args.duration / args.rounds)
            flags["active"].set()
            await asyncio.sleep(args.attack_warmup)  # the attacker takes what it can first
            b.skewed.skew = SKEW_S
            await b.run("attack", args.duration / args.rounds)
            intake = await b.status()
            flags["active"].clear()
            b.skewed.skew = 0.0
            await asyncio.sleep(2.0)  # the attacker lets go of its connections
    finally:
        flags["stop"].set()
        attacker.join(15)
        if attacker.is_alive():
            attacker.kill()
        await b.close()
    return {"quiet": b.summary("quiet"), "attack": b.summary("attack"),
            "router_intake_at_end_of_attack": intake}


def checks(res: dict, quick: bool) -> dict:
    q, a = res["quiet"], res["attack"]

    def ratio(key: str):
        return round(a[key] / q[key], 3) if q[key] and a[key] else None
    res["honest_p50_ratio"], res["skewed_p50_ratio"] = ratio("honest_p50_ms"), ratio("skewed_p50_ms")
    out = {"honest_signature_share_ge_95pct": a["honest_signature_share"] >= 0.95,
           "no_request_lost": q["lost"] == 0 and a["lost"] == 0,
           "honest_p50_within_10pct": res["honest_p50_ratio"] is not None and res["honest_p50_ratio"] <= 1.10,
           "skewed_engine_p50_within_10pct": (res["skewed_p50_ratio"] is not None
                                              and res["skewed_p50_ratio"] <= 1.10)}
    res["checks"] = out
    enforced = [k for k in out if not (quick and k.endswith("within_10pct"))]
    return {k: out[k] for k in enforced}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of quiet and of attacked traffic each")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved quiet/attack rounds the duration is split in")
    ap.add_argument("--clients", type=int, default=4, help="closed-loop client loops")
    ap.add_argument("--slot-conns", type=int, default=300, help="attacker connections holding slots")
    ap.add_argument("--partial-conns", type=int, default=65, help="attacker connections holding half-lines")
    ap.add_argument("--partial-bytes", type=int, default=(64 << 20) // 65, help="bytes of each half-line")
    ap.add_argument("--attacker-hosts", type=int, default=16,
                    help="loopback source addresses the attacker spreads its connections over")
    ap.add_argument("--attacker-nice", type=int, default=0,
                    help="niceness of the attacker process (19: it takes only CPU nothing else wants)")
    ap.add_argument("--forged-rate", type=float, default=100.0, help="forged stale messages a second")
    ap.add_argument("--attack-warmup", type=float, default=3.0, help="seconds the attacker runs first")
    ap.add_argument("--json", default=str(RESULTS / "signature_attack.json"))
    return parse_with_quick(ap, argv, duration=20.0, rounds=2, json=str(QUICK_OUT / "signature_attack.json"))


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        res = asyncio.run(measure(args, Path(tmp)))
    res["command"] = "python -m benchmark.bench_signature_attack " + " ".join(sys.argv[1:] if argv is None else argv)
    res["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    enforced = checks(res, args.quick)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("quiet", "attack", "honest_p50_ratio", "skewed_p50_ratio", "checks")},
                     indent=2))
    print(f"wrote {args.json}")
    sys.exit(0 if all(enforced.values()) else 1)


if __name__ == "__main__":
    main()
