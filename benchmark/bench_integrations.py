"""The latency the ELDR pre-router (eldr_sglang.integrations) adds in front of a host router.

    python -m benchmark.bench_integrations [--hosts smg,dynamo] [--requests 400] [--json PATH]
    python -m benchmark.bench_integrations --render benchmark/results/integrations.json

Per host router, on this machine, loopback only, everything in its own process:

* ``smg``: sglang-router 0.3.2 in PD mode (``--decode-policy manual``) over stub workers
  (1 prefill + 2 decode, ``python -m eldr_sglang.testing.stub_worker``, no latency);
* ``dynamo``: ai-dynamo 1.6.1 (scripts/install_dynamo.sh) frontend with the KV router over
  ``dynamo.mocker`` prefill + 2 decode at ``--speedup-ratio 0`` (no simulated engine time);
* the pre-router: ``python -m eldr_sglang.integrations {smg,dynamo}`` with the in-process
  scorer (predictor + ``eldr_balanced``) and the two-topic artifact of
  :mod:`eldr_sglang.testing.topic_words`.

One client sends requests one at a time (no queueing), interleaved: each round sends the
same prompt through the host router alone and through pre-router + host router, in a
random order (for SMG also straight to a decode stub: the worker alone; for Dynamo also
straight to the frontend with the two pin headers set by hand). Reported per
path: p50/p99 of the end-to-end latency; ``added`` = pre-router path minus host path
(p50 and p99 of each, and the median of the per-round differences); ``decision`` = the
pre-router's own time from reading the body to forwarding (its status page). The host
router's own share is its path minus the worker alone where a worker answers HTTP (SMG).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import aiohttp
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]

from benchmark.common import markdown_table, parse_with_quick, quick_out, write_record
from eldr_sglang.integrations.dynamo_local import (LocalDynamo, dynamo_importable, free_port,
                                                   non_loopback_listeners)
from eldr_sglang.testing.local_cluster import sglang_router_argv
from eldr_sglang.testing.topic_words import TOKENIZER_DIR, topic_artifact, topic_prompt

OUT = ROOT / "benchmark" / "results" / "integrations.json"


class Procs:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.procs = log_dir, []

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdout=open(self.log_dir / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
                             cwd=str(ROOT), start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


async def wait_for(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            if await pred():
                return
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, KeyError, ValueError):
            pass
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.25)


async def status_of(http, url: str) -> dict:
    async with http.get(url + "/eldr/adapter/status") as r:
        return await r.json()


def adapter_argv(kind: str, host_url: str, port: int, artifact: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "eldr_sglang.integrations", kind, "--host-url", host_url, "--host", "127.0.0.1",
            "--port", str(port), "--calibration", str(artifact), "--tokenizer", TOKENIZER_DIR,
            "--refresh", "1", *extra]


async def measure(paths: dict[str, tuple[str, dict]], body_fn, n: int, warmup: int, seed: int) -> dict:
    """Interleaved sequential requests: per round every path once, in a random order."""
    rng = random.Random(seed)
    lat: dict[str, list[float]] = {p: [] for p in paths}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for i in range(warmup + n):
            body = orjson.dumps(body_fn(i))
            order = list(paths)
            rng.shuffle(order)
            for p in order:
                url, headers = paths[p]
                t0 = time.perf_counter()
                async with http.post(url, data=body, headers={"Content-Type": "application/json", **headers}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{p}: HTTP {r.status}")
                if i >= warmup:
                    lat[p].append(time.perf_counter() - t0)
    return lat


def summarise(lat: dict[str, list[float]], adapter: str, host: str, worker: Optional[str]) -> dict:
    ms = {p: 1e3 * np.asarray(v) for p, v in lat.items()}
    out: dict[str, Any] = {p: {"p50_ms": round(float(np.percentile(v, 50)), 3),
                                "p99_ms": round(float(np.percentile(v, 99)), 3), "n": int(v.size)}
                           for p, v in ms.items()}
    diff = ms[adapter] - ms[host]
    out["added"] = {"p50_ms": round(out[adapter]["p50_ms"] - out[host]["p50_ms"], 3),
                    "p99_ms": round(out[adapter]["p99_ms"] - out[host]["p99_ms"], 3),
                    "paired_median_ms": round(float(np.median(diff)), 3)}
    if worker:
        out["host_own"] = {"p50_ms": round(out[host]["p50_ms"] - out[worker]["p50_ms"], 3),
                           "p99_ms": round(out[host]["p99_ms"] - out[worker]["p99_ms"], 3),
                           "paired_median_ms": round(float(np.median(ms[host] - ms[worker])), 3)}
    return out


async def run_smg(args, tmp: Path, artifact: Path) -> dict:
    procs = Procs(tmp)
    try:
        ports = [free_port() for _ in range(3)]
        procs.spawn("prefill", [sys.executable, "-m", "eldr_sglang.testing.stub_worker", "--role", "prefill",
                                "--port", str(ports[0]), "--no-signature", "--name", "p0"])
        for i in (1, 2):
            procs.spawn(f"decode{i}", [sys.executable, "-m", "eldr_sglang.testing.stub_worker", "--role", "decode",
                                       "--port", str(ports[i]), "--name", f"d{i - 1}"])
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        sport = free_port()
        argv = sglang_router_argv(sport, "--pd-disaggregation", "--prefill", urls[0], "8998",
                                  "--decode", urls[1], "--decode", urls[2], "--prefill-policy", "round_robin",
                                  "--decode-policy", "manual", "--assignment-mode", "random")
        mport = argv[argv.index("--prometheus-port") + 1]
        procs.spawn("smg", argv)
        smg = f"http://127.0.0.1:{sport}"
        aport = free_port()
        procs.spawn("adapter", adapter_argv("smg", smg, aport, artifact,
                                            ["--metrics-url", f"http://127.0.0.1:{mport}/metrics"]))
        aurl = f"http://127.0.0.1:{aport}"
        async with aiohttp.ClientSession() as http:
            async def smg_up():
                async with http.post(smg + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}}) as r:
                    return r.status == 200
            await wait_for(smg_up, 120, "SMG")
            await wait_for(lambda: _keys(http, aurl), 120, "the pre-router's routing keys")
        bad = non_loopback_listeners([p.pid for p in procs.procs])
        if bad:
            raise RuntimeError(f"listening outside loopback: {bad}")
        paths = {"worker alone": (urls[1] + "/generate", {}), "smg": (smg + "/generate", {}),
                 "eldr pre-router + smg": (aurl + "/generate", {})}
        lat = await measure(paths, lambda i: {"text": topic_prompt(i % 2, i), "sampling_params": {"max_new_tokens": 1}},
                            args.requests, args.warmup, args.seed)
        async with aiohttp.ClientSession() as http:
            st = await status_of(http, aurl)
        res = summarise(lat, "eldr pre-router + smg", "smg", "worker alone")
        res["decision"] = st["decision_ms"]
        res["adapter_paths"] = st["counters"]
        res["setup"] = "sglang-router 0.3.2 PD (--decode-policy manual, learned X-SMG-Routing-Key per decode), " \
                       "stub workers (1 prefill + 2 decode, no latency), /generate, 1 new token"
        return res
    finally:
        procs.stop()


async def _keys(http, aurl: str) -> bool:
    st = await status_of(http, aurl)
    return len(st.get("keys", {})) == 2


async def run_dynamo(args, tmp: Path, artifact: Path) -> dict:
    ok, why = dynamo_importable()
    if not ok:
        return {"skipped": why}
    procs = Procs(tmp)
    d = LocalDynamo(speedup=0.0, log_dir=tmp / "dynamo").start()
    try:
        aport = free_port()
        procs.spawn("adapter", adapter_argv("dynamo", d.url, aport, artifact, []))
        aurl = f"http://127.0.0.1:{aport}"
        async with aiohttp.ClientSession() as http:
            async def mapped():
                st = await status_of(http, aurl)
                return len(st["workers"]) == 2 and st["prefills"]
            await wait_for(mapped, 60, "the pre-router's instance mapping")
        bad = non_loopback_listeners([p.pid for p in procs.procs] + d.pids())
        if bad:
            raise RuntimeError(f"listening outside loopback: {bad}")
        dec, pre = d.instances("backend"), d.instances("prefill")
        # the same two pin headers sent straight to the frontend: what pinning costs inside Dynamo
        paths = {"dynamo": (d.url + "/v1/completions", {}),
                 "dynamo, pinned by hand": (d.url + "/v1/completions", {"x-dynamo-worker-instance-id": dec[0],
                                                                         "x-dynamo-prefill-instance-id": pre[0]}),
                 "eldr pre-router + dynamo": (aurl + "/v1/completions", {})}
        lat = await measure(paths, lambda i: {"model": d.model_name, "prompt": topic_prompt(i % 2, i), "max_tokens": 1},
                            args.requests, args.warmup, args.seed)
        async with aiohttp.ClientSession() as http:
            st = await status_of(http, aurl)
        res = summarise(lat, "eldr pre-router + dynamo", "dynamo", None)
        ms = {p: 1e3 * np.asarray(v) for p, v in lat.items()}
        res["pinning_inside_dynamo"] = {"paired_median_ms": round(float(np.median(
            ms["dynamo, pinned by hand"] - ms["dynamo"])), 3)}
        res["decision"] = st["decision_ms"]
        res["adapter_paths"] = st["counters"]
        res["setup"] = "ai-dynamo 1.6.1 frontend --router-mode kv (file discovery, TCP request plane, ZMQ events " \
                       "via loopback broker), dynamo.mocker 1 prefill + 2 decode at --speedup-ratio 0, " \
                       "/v1/completions, 1 token, both pin headers"
        return res
    finally:
        procs.stop()
        d.stop()


def render(doc: dict) -> str:
    rows = []
    for host, r in doc["hosts"].items():
        if "skipped" in r:
            rows.append([host, "skipped: " + r["skipped"], "", "", "", "", ""])
            continue
        paths = [p for p in r if isinstance(r[p], dict) and "p50_ms" in r[p] and "n" in r[p]]
        for p in paths:
            rows.append([host, p, r[p]["n"], r[p]["p50_ms"], r[p]["p99_ms"], "", ""])
        a = r["added"]
        if "load_average_1m" in r:
            rows.append([host, f"(load average {r['load_average_1m'][0]} -> {r['load_average_1m'][1]} on "
                         f"{os.cpu_count()} cores)", "", "", "", "", ""])
        rows.append([host, "**added by the pre-router**", "", a["p50_ms"], a["p99_ms"],
                     a["paired_median_ms"], f'{r["decision"]["p50"]} / {r["decision"]["p99"]}'])
        if "pinning_inside_dynamo" in r:
            rows.append([host, "pinning inside dynamo (pinned by hand minus dynamo)", "", "", "",
                         r["pinning_inside_dynamo"]["paired_median_ms"], ""])
        if "host_own" in r:
            h = r["host_own"]
            rows.append([host, f"{host}'s own (minus worker alone)", "", h["p50_ms"], h["p99_ms"],
                         h["paired_median_ms"], ""])
    return markdown_table(["host", "path", "requests", "p50 ms", "p99 ms", "paired median ms",
                           "pre-router decision p50 / p99 ms"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="smg,dynamo")
    ap.add_argument("--requests", type=int, default=400, help="measured rounds per host")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(OUT))
    ap.add_argument("--render", help="print the table of a recorded JSON and exit")
    args = parse_with_quick(ap, argv, requests=20, warmup=5, hosts="smg",
                            json=str(quick_out("integrations") / "integrations.json"))
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    doc: dict[str, Any] = {"hosts": {}}
    with tempfile.TemporaryDirectory(prefix="bench-integrations-") as t:
        tmp = Path(t)
        artifact = tmp / "topics.json"
        topic_artifact().save(artifact)
        for host in [h.strip() for h in args.hosts.split(",") if h.strip()]:
            print(f"== {host}", flush=True)
            fn = {"smg": run_smg, "dynamo": run_dynamo}[host]
            load0 = os.getloadavg()[0]
            doc["hosts"][host] = asyncio.run(fn(args, tmp, artifact))
            # the machine is shared: its 1-minute load average before and after this host's run
            doc["hosts"][host]["load_average_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            write_record(args.json, doc, argv)
    print(render(doc))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
