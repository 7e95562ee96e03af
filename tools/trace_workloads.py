"""Collect expert traces of the workloads through a real SGLang server in trace mode.

Starts ``python -m sglang.launch_server`` with the engine plugin's trace mode
(``--eldr-trace-dir DIR --eldr-layers all``), replays each workload set through
``/generate`` (greedy, ``--max-new-tokens`` cap, batched and concurrent), then
joins the server's trace logs into one trace set per workload set::

    python -m tools.trace_workloads --model models/eldr-tiny-moe --workloads benchmark/workloads \
        --sets task/calib task/eval language/calib language/eval --out benchmark/traces

Decode counts cover the decode steps the server ran (``output_tokens - 1``: the
first output token comes from the prefill forward). Output lengths are capped at
``--max-new-tokens``; the simulator uses per-step expert frequencies, which the
cap leaves unbiased.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eldr_sglang.collect_traces import join_records, model_spec, read_jsonl  # noqa: E402
from eldr_sglang.core import TraceWriter  # noqa: E402
from eldr_sglang.core.traces import existing_shards  # noqa: E402
from eldr_sglang.testing.local_cluster import ServerSpec, http_json, start_server  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--workloads", type=Path, default=Path("benchmark/workloads"))
    p.add_argument("--sets", nargs="+", default=["task/calib", "task/eval", "language/calib", "language/eval"])
    p.add_argument("--out", type=Path, default=Path("benchmark/traces"))
    p.add_argument("--limit", type=int, default=0, help="requests per set (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="prompts per /generate call")
    p.add_argument("--concurrency", type=int, default=3, help="/generate calls in flight")
    p.add_argument("--logs", type=Path, default=None, help="server log + raw trace folder (default: temp)")
    p.add_argument("--append", action="store_true",
                   help="add to trace shards already in --out/<set> (refused without it: two runs would mix)")
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        p.error(f"--model: no config.json in {args.model}")
    for s in args.sets:
        if not (args.workloads / f"{s}.jsonl").exists():
            p.error(f"--sets: {args.workloads / (s + '.jsonl')} not found (build it: python -m tools.build_workloads)")
    if args.max_new_tokens < 2 or args.batch < 1 or args.concurrency < 1:
        p.error("--max-new-tokens must be >= 2, --batch and --concurrency >= 1")
    for s in args.sets:  # refused before the server starts, not after the replay
        shards, records = existing_shards(args.out / s)
        if shards and not args.append:
            p.error(f"--out: {args.out / s} already holds {len(shards)} trace shards ({records} records); "
                    f"use an empty --out, or --append to add to them")
    if args.logs and any((args.logs / "raw").glob("*.jsonl")):
        p.error(f"--logs: {args.logs / 'raw'} already holds trace-mode logs of an earlier run; use a new folder")
    return args


def load_set(path: Path, limit: int) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        reqs = [json.loads(line) for line in f]
    return reqs[:limit] if limit else reqs


def replay(url: str, reqs: list[dict], max_new: int, batch: int, concurrency: int) -> None:
    from tqdm import tqdm

    def send(chunk: list[dict]) -> int:
        body = {"text": [r["prompt"] for r in chunk], "rid": [r["id"] for r in chunk],
                "sampling_params": [{"max_new_tokens": min(max_new, r["output_len"]), "temperature": 0.0,
                                     "ignore_eos": True} for r in chunk]}
        http_json(f"{url}/generate", body, timeout=1800)
        return len(chunk)

    chunks = [reqs[i:i + batch] for i in range(0, len(reqs), batch)]
    with ThreadPoolExecutor(concurrency) as pool, tqdm(total=len(reqs), unit="req") as bar:
        for n in pool.map(send, chunks):
            bar.update(n)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = model_spec(args.model)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="eldr-traces-"))
    raw = logs / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    server_spec = ServerSpec(str(args.model), "single", max_total_tokens=32768,
                             extra_args=["--eldr-trace-dir", str(raw), "--eldr-layers", "all"])
    t0 = time.time()
    print(f"starting SGLang ({args.model}) in trace mode; log {logs}", flush=True)
    server = start_server(server_spec, logs, "trace-server")
    timings = {}
    sets = {name: load_set(args.workloads / f"{name}.jsonl", args.limit) for name in args.sets}
    try:
        server.wait_ready(timeout=600)
        for name, reqs in sets.items():
            t1 = time.time()
            print(f"{name}: {len(reqs)} requests", flush=True)
            replay(server.url, reqs, args.max_new_tokens, args.batch, args.concurrency)
            timings[name] = round(time.time() - t1, 1)
        time.sleep(2.0)  # trace lines are written by a background thread
    finally:
        server.stop()
    prefill = read_jsonl(sorted(raw.glob("prefill-*.jsonl")))
    decode = read_jsonl(sorted(raw.glob("decode-*.jsonl")))
    for name, reqs in sets.items():
        labels = {r["id"]: r["labels"] for r in reqs}
        pre = {rid: prefill[rid] for rid in labels if rid in prefill}
        out = args.out / name
        n = 0
        with TraceWriter(out, spec, append=args.append) as writer:
            for record in join_records(pre, decode, labels, spec):
                writer.add(record)
                n += 1
        added = f", after {writer.existing_records} already there" if writer.existing_records else ""
        print(f"{name}: {n}/{len(reqs)} trace records -> {out}{added} ({timings[name]} s)")
        if n < len(reqs):
            print(f"  warning: {len(reqs) - n} requests have no complete trace", file=sys.stderr)
    info = {"command": "python -m tools.trace_workloads " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": str(args.model), "seconds_per_set": timings, "wall_s": round(time.time() - t0, 1),
            "max_new_tokens": args.max_new_tokens}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "collection.json").write_text(json.dumps(info, indent=1))
    print(f"done in {info['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
