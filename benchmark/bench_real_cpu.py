"""Real end-to-end comparison on CPU: SGLang PD servers, each router policy, sglang-router.

Starts 1 prefill + N decode real SGLang CPU servers with the trained tiny MoE and
the ELDR plugin (decode servers in trace mode: one record per decode step with
its batch size, distinct experts per layer and forward time), then replays the
same unmodified ``python -m sglang.bench_serving --dataset-name custom`` workload
(the committed demo mix) through every router path, ``--repeats`` times,
interleaved: round r runs every path once, the order rotated by r, so drift of
this shared machine hits all paths alike. Only the router is restarted between
runs; the prefill cache is flushed before each::

    python -m benchmark.bench_real_cpu --repeats 3 --json benchmark/results/real_cpu.json

Reported per path: bench_serving's TPOT/TTFT/throughput (median and min-max over
repeats), distinct experts per decode step overall and AT EQUAL BATCH SIZE (the
steps of each batch size compared across paths, weighted by the pooled step
count), mean batch, and how unevenly the requests spread over the decode servers.
A least-squares fit of the decode forward time on batch size and distinct experts
(all steps of all runs) says what CPU step time is made of. CPU TPOT says nothing
about GPU TPOT: on two cores shared by every server, a step's time is mostly its
batch's compute and the other servers' contention; distinct experts per decode step
is the hardware-independent figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from benchmark.common import command_line, parse_with_quick, write_record
from benchmark.measured import real_cpu_table
from eldr_sglang.core.policies import policy_names, policy_spec, reads_artifact
from eldr_sglang.demo import DEFAULT_MODEL, DEFAULT_WORKLOAD, calibration_artifact, decode_counters
from eldr_sglang.testing import local_cluster as lc

ROOT = Path(__file__).resolve().parents[1]

POLICIES = policy_names()
FIGURES = ("completed", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput")
SGLANG_ROUTER = "sglang-router/round_robin"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--dataset", type=Path, default=DEFAULT_WORKLOAD.with_suffix(".bench.jsonl"),
                   help="bench_serving custom-format file")
    p.add_argument("--decodes", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=["round_robin", "eldr", "state_aware"], choices=POLICIES)
    p.add_argument("--no-sglang-router", action="store_true", help="skip the sglang-router path")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every path once (rotated order)")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--output-len", type=int, default=24, help="tokens per request (bench_serving --sharegpt-output-len)")
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--threads", type=int, default=None,
                   help="every server's torch threads (OMP_NUM_THREADS; 1 on the fat-expert model, docs/MEASURED.md)")
    p.add_argument("--prefill-cpus", default="", help="pin the prefill server to these cores (taskset -c list)")
    p.add_argument("--decode-cpus", nargs="+", default=[],
                   help="pin decode server i to the i-th list (cycled), e.g. --decode-cpus 0 1")
    p.add_argument("--out", type=Path, default=Path(".cache/bench-real"))
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parse_with_quick(p, argv)
    if not (args.model / "config.json").is_file():
        p.error(f"--model: no Hugging Face model at {args.model}")
    if not args.dataset.is_file():
        p.error(f"--dataset: {args.dataset} not found")
    if args.decodes < 2 or args.num_prompts < 1 or args.output_len < 4 or args.repeats < 1:
        p.error("--decodes must be >= 2, --num-prompts and --repeats >= 1, --output-len >= 4")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    ncpu = os.cpu_count() or 1
    for name, cpus in [("--prefill-cpus", args.prefill_cpus), *(("--decode-cpus", c) for c in args.decode_cpus)]:
        if cpus and not cpu_list_ok(cpus, ncpu):
            p.error(f"{name}: {cpus!r} is not a list of cores 0-{ncpu - 1} (taskset -c syntax: 0,2-3)")
    return args


def cpu_list_ok(text: str, ncpu: int) -> bool:
    """``text`` is a taskset -c core list ("0", "0,2-3") naming cores below ``ncpu``."""
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi or lo)
            if not 0 <= a <= b < ncpu:
                return False
    except ValueError:
        return False
    return True


def bench_serving(url: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
           "--model", str(args.model), "--tokenizer", str(args.model), "--dataset-name", "custom",
           "--dataset-path", str(args.dataset), "--num-prompts", str(args.num_prompts),
           "--sharegpt-output-len", str(args.output_len), "--request-rate", str(args.request_rate),
           "--max-concurrency", str(args.max_concurrency), "--seed", "1", "--output-file", str(out),
           "--disable-tqdm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_serving failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text().splitlines()[-1])


def step_records(trace_dir: Path) -> dict[str, list[dict]]:
    """Decode-step records per decode server process (file), in order."""
    return {f.name: [json.loads(line) for line in f.open()] for f in sorted(trace_dir.glob("steps-*.jsonl"))}


def wait_for_step_records(trace_dir: Path, steps_before: float, cluster, timeout: float = 30.0) -> dict:
    """The step records once the trace writer has caught up with the servers' step counters."""
    want = sum(s for _, s in decode_counters(cluster).values()) - steps_before
    deadline = time.monotonic() + timeout
    while True:
        recs = step_records(trace_dir)
        if sum(len(v) for v in recs.values()) >= want or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def engine_args(cluster: lc.PDCluster) -> list[str]:
    """``--engine-metrics``: the decode servers' plugin endpoints (live batches, step laws)."""
    urls = [f"http://127.0.0.1:{spec.eldr_metrics_port}/metrics" for _, spec in cluster.decodes]
    return ["--engine-metrics", ",".join(urls)]


def online_laws(router_url: str, cluster: lc.PDCluster, wait_s: float = 30.0) -> dict:
    """The step law the router fitted per decode server from its engine's samples (its
    /eldr/status), waiting up to ``wait_s`` for every server's first fit."""
    deadline = time.time() + wait_s
    laws: dict = {}
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{router_url}/eldr/status", timeout=10) as resp:
                reports = json.loads(resp.read()).get("engine_reports") or {}
        except OSError:
            reports = {}
        laws = {url: rep["law"] for url, rep in reports.items() if rep.get("law")}
        if len(laws) == len(cluster.decodes):
            break
        time.sleep(1.0)
    return laws


def run_one(name: str, router: lc.ManagedProcess, cluster: lc.PDCluster, args, out: Path, trace_dir: Path) -> dict:
    router.wait_ready(timeout=90)
    lc.flush_cache(cluster.prefills[0][0].url)
    before = step_records(trace_dir)
    s0 = sum(len(v) for v in before.values())
    t0 = time.time()
    res = bench_serving(router.url, args, out / f"{name.replace('/', '-')}.jsonl")
    after = wait_for_step_records(trace_dir, s0, cluster)
    steps = [dict(rec, server=f) for f, recs in after.items() for rec in recs[len(before.get(f, [])):]]
    per_server = Counter(r["server"] for r in steps)
    tokens = Counter()
    for r in steps:
        tokens[r["server"]] += r["batch_size"]
    load = np.array([tokens[f] for f in sorted(after)], dtype=float)
    laws = online_laws(router.url, cluster) if name.startswith("eldr-router/") else {}
    row = {"router": name, **{k: res.get(k) for k in FIGURES}, "wall_s": round(time.time() - t0, 1),
           "online_laws": laws,
           "decode_steps": len(steps),
           "distinct_experts_per_step": float(np.mean([sum(r["unique_per_layer"]) for r in steps])) if steps else None,
           "mean_batch": float(np.mean([r["batch_size"] for r in steps])) if steps else None,
           "steps_per_server": [per_server[f] for f in sorted(after)],
           "tokens_per_server": load.tolist(),
           "token_max_over_mean": float(load.max() / load.mean()) if load.sum() else None,
           "steps": [[r["batch_size"], sum(r["unique_per_layer"]), r.get("forward_ms")] for r in steps]}
    print(f"  {name:28s} TPOT p50 {row['median_tpot_ms']:.0f} ms  distinct/step {row['distinct_experts_per_step']:.1f}"
          f"  mean batch {row['mean_batch']:.2f}  max/mean tokens per server {row['token_max_over_mean']:.2f}",
          flush=True)
    return row


def equal_batch(rows: list[dict], base: str) -> dict:
    """Per path: distinct experts per step at equal batch size, relative to ``base``
    (batch sizes every path saw, weighted by the pooled step count)."""
    by = defaultdict(lambda: defaultdict(list))
    for r in rows:
        for b, u, _ in r["steps"]:
            by[r["router"]][b].append(u)
    paths = list(by)
    common = sorted(set.intersection(*(set(by[p]) for p in paths))) if paths else []
    weight = {b: sum(len(by[p][b]) for p in paths) for b in common}
    out = {"batch_sizes": common, "per_batch": {p: {b: float(np.mean(by[p][b])) for b in common} for p in paths}}
    if base in by and common:
        tot = sum(weight.values())
        out["vs_" + base.replace("/", "_")] = {
            p: 100.0 * sum(weight[b] * (np.mean(by[p][b]) / np.mean(by[base][b]) - 1.0) for b in common) / tot
            for p in paths}
    return out


def step_time_fit(rows: list[dict]) -> dict | None:
    """OLS of decode forward ms on batch size and distinct experts (summed over layers)."""
    s = np.array([st for r in rows for st in r["steps"] if st[2] is not None], dtype=float)
    if len(s) < 10:
        return None
    X = np.column_stack([np.ones(len(s)), s[:, 0], s[:, 1]])
    coef, *_ = np.linalg.lstsq(X, s[:, 2], rcond=None)
    pred = X @ coef
    r2 = 1.0 - ((s[:, 2] - pred) ** 2).sum() / ((s[:, 2] - s[:, 2].mean()) ** 2).sum()
    return {"intercept_ms": float(coef[0]), "ms_per_sequence": float(coef[1]), "ms_per_distinct_expert": float(coef[2]),
            "r2": float(r2), "steps": int(len(s)), "mean_forward_ms": float(s[:, 2].mean())}


def summarise(rows: list[dict]) -> dict:
    out = {}
    for name in dict.fromkeys(r["router"] for r in rows):
        rs = [r for r in rows if r["router"] == name]
        out[name] = {}
        for k in FIGURES[1:] + ("distinct_experts_per_step", "mean_batch", "token_max_over_mean"):
            v = np.array([r[k] for r in rs if r.get(k) is not None], dtype=float)
            if v.size:
                out[name][k] = {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max())}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:  # real SGLang servers: the smoke run checks the arguments and the plan only
        paths = [f"eldr-router/{p}" for p in args.policies] + ([] if args.no_sglang_router else ["sglang-router"])
        pins = f"; decode cores {' | '.join(args.decode_cpus)}" if args.decode_cpus else ""
        print(f"plan: 1 prefill + {args.decodes} decode SGLang CPU servers of {args.model}{pins}; {args.repeats} rounds "
              f"of {', '.join(paths)}, {args.num_prompts} prompts from {args.dataset} at {args.request_rate:g} req/s")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    trace_dir = args.out / "decode-steps"
    trace_dir.mkdir(parents=True, exist_ok=True)
    for f in trace_dir.glob("steps-*.jsonl"):
        f.unlink()
    artifact = calibration_artifact(args.model, args.decodes, args.out)
    router_port = lc.free_port()
    print(f"starting 1 prefill + {args.decodes} decode SGLang CPU servers ({args.model}) ...", flush=True)
    cluster = lc.start_pd_cluster(
        str(args.model), logs, n_prefill=1, n_decode=args.decodes, eldr_metrics=True,
        prefill_args=["--eldr-calibration", str(artifact),
                      "--eldr-publish", f"http://127.0.0.1:{router_port}/eldr/signature"],
        decode_args=["--eldr-trace-dir", str(trace_dir)],
        env={"OMP_NUM_THREADS": str(args.threads)} if args.threads else None,
        prefill_cpus=args.prefill_cpus, decode_cpus=args.decode_cpus)
    paths = [(f"eldr-router/{p}", lambda p=p: lc.start_eldr_router(
        cluster, logs, policy=p, port=router_port, artifact=artifact if reads_artifact(policy_spec(p)) else None,
        extra_args=engine_args(cluster)))
        for p in args.policies]
    if not args.no_sglang_router:
        paths.append((SGLANG_ROUTER, lambda: lc.start_sglang_router(cluster, logs)))
    rows = []
    try:
        for rnd in range(args.repeats):
            order = paths[rnd % len(paths):] + paths[:rnd % len(paths)]
            print(f"round {rnd + 1}/{args.repeats}: {', '.join(n for n, _ in order)}", flush=True)
            for name, start in order:
                router = start()
                try:
                    rows.append(run_one(name, router, cluster, args, args.out, trace_dir) | {"round": rnd})
                finally:
                    router.stop()
    finally:
        cluster.stop()
    base = "eldr-router/round_robin" if "round_robin" in args.policies else rows[0]["router"]
    result = {"command": command_line(__file__, argv),
              "measured": "real SGLang CPU servers (2-core machine); CPU TPOT does not stand for GPU TPOT",
              "decodes": args.decodes, "num_prompts": args.num_prompts, "output_len": args.output_len,
              "model": str(args.model), "threads": args.threads, "prefill_cpus": args.prefill_cpus,
              "decode_cpus": args.decode_cpus,
              "request_rate": args.request_rate, "repeats": args.repeats,
              "dataset": str(args.dataset.relative_to(ROOT) if args.dataset.is_relative_to(ROOT) else args.dataset),
              "artifact": str(artifact),
              "artifact_policies": [p for p in args.policies if reads_artifact(policy_spec(p))],
              "summary": summarise(rows), "equal_batch_base": base,
              "equal_batch": equal_batch(rows, base), "step_time_fit": step_time_fit(rows), "runs": rows}
    print("\n".join(real_cpu_table(result)))
    if args.json:
        write_record(args.json, result)
        print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
