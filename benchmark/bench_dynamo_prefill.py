"""What pinning costs inside Dynamo's KV router on a prefix-heavy workload.

    python -m benchmark.bench_dynamo_prefill [--repeats 3] [--requests 48] [--gpu-blocks 16384,256]
    python -m benchmark.bench_dynamo_prefill --quick

ai-dynamo 1.6.1 (scripts/install_dynamo.sh) frontend with the KV router over
``dynamo.mocker`` workers, disaggregated (2 prefill + 2 decode, ``--speedup-ratio 1``:
the mocker's simulated engine time), loopback only (eldr_sglang.integrations.dynamo_local).
Every request is one of a few long shared prefixes plus a short unique tail, streamed; the
client sends them straight to the frontend, ``--concurrency`` at a time, under three pins:

* ``none``: no header: Dynamo's KV router picks prefill (KV overlap) and decode;
* ``both``: what the ELDR pre-router sends in disaggregated mode: the decode instance the
  policy picks (here: one per prefix, as a grouping policy would) and a prefill instance
  round robin over the listed ones (``x-dynamo-worker-instance-id`` +
  ``x-dynamo-prefill-instance-id``): Dynamo's KV-aware prefill choice is lost;
* ``decode_only``: the decode header alone (the pre-router's ``--decode-only-pin``); 1.6.1
  answers it 400 in disaggregated mode, so only its answers are recorded (the pre-router
  then pins both, as ``both``).

Per ``--gpu-blocks`` value (the mockers' KV cache, blocks of 64 tokens) a fresh deployment
and one unmeasured warm-up block; each repeat runs the modes as blocks in a random order,
each block with prefixes of its own (no block reuses another's cache). Reported per mode:
client TTFT (first streamed text) median / P99 per repeat and pooled, the frontend's own
``nvext.timing.ttft_ms``, the prefill mocker's simulated ``prefill_time_ms``, the router's
``kv_hit_rate`` (its KV overlap on the prefill worker that served the request: the prefix
reuse of prefill) and
``usage.prompt_tokens_details.cached_tokens`` / prompt tokens (reported by the decode
mocker: its reuse, not prefill's).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

import aiohttp
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]

from benchmark.common import markdown_table, parse_with_quick, quick_out, write_record
from eldr_sglang.integrations.dynamo import DECODE_HEADER, PREFILL_HEADER
from eldr_sglang.integrations.dynamo_local import LocalDynamo, dynamo_importable

OUT = ROOT / "benchmark" / "results" / "dynamo_prefill.json"
MODES = ("none", "both", "decode_only")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud forest").split()


def prefix_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one(http, url: str, model: str, prompt: str, headers: dict, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "nvext": {"extra_fields": ["worker_id", "timing"]}}
    t0 = time.perf_counter()
    ttft: Optional[float] = None
    out: dict[str, Any] = {}
    async with http.post(url + "/v1/completions", data=orjson.dumps(body),
                         headers={"Content-Type": "application/json", **headers}) as r:
        if r.status != 200:
            return {"status": r.status, "body": (await r.read())[:300].decode(errors="replace")}
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            doc = orjson.loads(line[6:])
            if ttft is None and any(c.get("text") for c in doc.get("choices") or []):
                ttft = time.perf_counter() - t0
            if doc.get("usage"):
                out["prompt_tokens"] = doc["usage"].get("prompt_tokens")
                out["cached_tokens"] = (doc["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            nv = doc.get("nvext") or {}
            if nv.get("timing"):
                out["server_ttft_ms"] = nv["timing"].get("ttft_ms")
                out["prefill_time_ms"] = nv["timing"].get("prefill_time_ms")
                out["kv_hit_rate"] = nv["timing"].get("kv_hit_rate")
            if nv.get("worker_id"):
                out["prefill"] = str(nv["worker_id"].get("prefill_worker_id"))
                out["decode"] = str(nv["worker_id"].get("decode_worker_id"))
    out.update(status=200, ttft_ms=None if ttft is None else 1e3 * ttft)
    return out


async def run_block(d: LocalDynamo, mode: str, seed: int, args) -> list[dict]:
    """``args.requests`` requests over ``args.prefixes`` fresh prefixes, ``args.concurrency`` at a time."""
    rng = random.Random(seed)
    prefixes = [prefix_text(seed * 1000 + k, args.prefix_words) for k in range(args.prefixes)]
    decodes, prefills = d.instances("backend"), d.instances("prefill")
    jobs = [(rng.randrange(args.prefixes), i) for i in range(args.requests)]
    rr = iter(range(10 ** 9))
    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)
    results: list[dict] = []

    async def client(http):
        while not queue.empty():
            k, i = queue.get_nowait()
            headers: dict[str, str] = {}
            if mode in ("both", "decode_only"):
                headers[DECODE_HEADER] = decodes[k % len(decodes)]  # one decode per prefix (a grouping policy)
            if mode == "both":
                headers[PREFILL_HEADER] = prefills[next(rr) % len(prefills)]  # the pre-router's round robin
            tail = f" request {seed}-{i}: " + prefix_text(seed * 7919 + i, args.tail_words)
            res = await one(http, d.url, d.model_name, prefixes[k] + tail, headers, args.max_tokens)
            res["prefix"] = k
            results.append(res)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*[client(http) for _ in range(args.concurrency)])
    return results


def pct(xs: list[float], q: float) -> Optional[float]:
    return round(float(np.percentile(xs, q)), 2) if xs else None


def summarise(rs: list[dict]) -> dict:
    ok = [r for r in rs if r["status"] == 200]
    out: dict[str, Any] = {"n": len(rs), "ok": len(ok)}
    if len(ok) < len(rs):
        bad = [r for r in rs if r["status"] != 200]
        out["refused"] = {"status": sorted({r["status"] for r in bad}), "body": bad[0]["body"]}
    if not ok:
        return out
    t = [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]
    s = [r["server_ttft_ms"] for r in ok if r.get("server_ttft_ms") is not None]
    pf = [r["prefill_time_ms"] for r in ok if r.get("prefill_time_ms") is not None]
    pt = sum(r.get("prompt_tokens") or 0 for r in ok)
    out.update(ttft_p50_ms=pct(t, 50), ttft_p99_ms=pct(t, 99), server_ttft_p50_ms=pct(s, 50),
               server_ttft_p99_ms=pct(s, 99), prefill_time_p50_ms=pct(pf, 50), prefill_time_p99_ms=pct(pf, 99),
               prompt_tokens_mean=round(pt / len(ok), 1),
               # usage.cached_tokens: reported by the DECODE mocker (checked: a request pinned to a
               # prefill worker holding its prefix but to a fresh decode worker reads 0 here while
               # the router's kv_hit_rate for that prefill reads 0.92), so not the prefill's reuse
               decode_cached_share=round(sum(r.get("cached_tokens") or 0 for r in ok) / pt, 4) if pt else None,
               router_kv_hit_rate=round(float(np.mean([r["kv_hit_rate"] for r in ok if r.get("kv_hit_rate")
                                                       is not None] or [np.nan])), 4),
               prefill_workers_per_prefix=round(float(np.mean([len({r.get("prefill") for r in ok if r["prefix"] == k})
                                                              for k in {r["prefix"] for r in ok}])), 2))
    return out


async def run_regime(blocks: int, args) -> dict:
    d = LocalDynamo(n_prefill=2, n_decode=2, speedup=args.speedup,  # logs in a temporary folder
                    mocker_args=["--num-gpu-blocks-override", str(blocks)])
    d.start()
    try:
        per: dict[str, list[dict]] = {m: [] for m in MODES}
        reps: dict[str, list[dict]] = {m: [] for m in MODES}
        order_rng = random.Random(args.seed * 7 + blocks)
        orders = []
        # one unmeasured block first (prefixes of its own): a fresh deployment's first requests are slower
        await run_block(d, "none", seed=args.seed * 100 + 99 + blocks,
                        args=argparse.Namespace(**{**vars(args), "requests": max(8, args.requests // 4)}))
        for rep in range(args.repeats):
            order = list(MODES)
            order_rng.shuffle(order)
            orders.append(order)
            for mode in order:
                n = args.requests if mode != "decode_only" else min(args.requests, 4)  # refused: a few answers
                a = argparse.Namespace(**{**vars(args), "requests": n})
                rs = await run_block(d, mode, seed=args.seed * 100 + rep * 10 + MODES.index(mode) + blocks, args=a)
                per[mode].extend(rs)
                reps[mode].append(summarise(rs))
                print(f"blocks={blocks} repeat={rep} {mode}: {reps[mode][-1]}", file=sys.stderr, flush=True)
        return {"gpu_blocks": blocks, "orders": orders, "instances": {"prefill": d.instances("prefill"),
                                                                       "decode": d.instances("backend")},
                "modes": {m: {"pooled": summarise(per[m]), "repeats": reps[m]} for m in MODES}}
    finally:
        d.stop()


def render(doc: dict) -> str:
    rows = []
    for reg in doc["regimes"]:
        if "skipped" in reg:
            rows.append(["-", "skipped: " + reg["skipped"]] + [""] * 7)
            continue
        for m in MODES:
            p = reg["modes"][m]["pooled"]
            reps = reg["modes"][m]["repeats"]
            if not p.get("ok"):
                rows.append([reg["gpu_blocks"], m, f"refused {p.get('refused', {}).get('status')}: "
                             f"{p.get('refused', {}).get('body')}"] + [""] * 6)
                continue
            rows.append([reg["gpu_blocks"], m, f"{p['ttft_p50_ms']} / {p['ttft_p99_ms']}",
                         " ".join(f"{r['ttft_p50_ms']}/{r['ttft_p99_ms']}" for r in reps),
                         f"{p['server_ttft_p50_ms']} / {p['server_ttft_p99_ms']}",
                         f"{p['prefill_time_p50_ms']} / {p['prefill_time_p99_ms']}", p["router_kv_hit_rate"],
                         p["decode_cached_share"], p["prefill_workers_per_prefix"]])
    return markdown_table(["gpu blocks", "pin", "client TTFT p50 / p99 ms (pooled)", "p50/p99 per repeat",
                           "frontend ttft_ms p50 / p99", "prefill_time_ms p50 / p99", "router kv_hit_rate (prefill)",
                           "decode cached share", "prefill workers per prefix"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64, help="per mode and repeat")
    ap.add_argument("--prefixes", type=int, default=8, help="shared prefixes per block")
    ap.add_argument("--prefix-words", type=int, default=1500,
                    help="words per prefix (1500: about 4,400 tokens, 70 blocks of 64)")
    ap.add_argument("--tail-words", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--speedup", type=float, default=1.0, help="the mockers' --speedup-ratio")
    ap.add_argument("--gpu-blocks", default="16384,400",
                    help="comma list: the mockers' --num-gpu-blocks-override, one deployment each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(OUT))
    args = parse_with_quick(ap, argv, repeats=1, requests=8, prefixes=2, prefix_words=300, gpu_blocks="16384",
                            json=str(quick_out("dynamo_prefill") / "dynamo_prefill.json"))
    ok, why = dynamo_importable()
    doc: dict[str, Any] = {"dynamo": why if ok else None, "regimes": []}
    if not ok:
        doc["regimes"].append({"skipped": why})
    else:
        for blocks in [int(b) for b in str(args.gpu_blocks).split(",")]:
            doc["regimes"].append(asyncio.run(run_regime(blocks, args)))
            write_record(args.json, doc, argv)
    doc["table"] = render(doc)
    write_record(args.json, doc, argv)
    print(doc["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
