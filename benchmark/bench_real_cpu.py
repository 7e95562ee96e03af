"""Real end-to-end comparison on CPU: SGLang PD servers, each router policy, sglang-router.

Starts 1 prefill + N decode real SGLang CPU servers with the trained tiny MoE and
the ELDR plugin, then for each policy of the ELDR router (and for sglang-router
0.3.2 with round robin) replays the same ``sglang.bench_serving --dataset-name
custom`` workload (the committed demo mix: both workloads' evaluation requests)
and records bench_serving's figures plus the mean distinct experts per decode
step measured inside the decode servers (plugin metrics). Only the router is
restarted between runs; the prefill cache is flushed before each. CPU TPOT says
nothing about GPU TPOT: distinct experts per decode step is the
hardware-independent figure::

    python benchmark/bench_real_cpu.py --json benchmark/results/real_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from eldr_sglang.core.policies import policy_spec  # noqa: E402
from eldr_sglang.demo import DEFAULT_MODEL, DEFAULT_WORKLOAD, calibration_artifact, decode_counters  # noqa: E402
from eldr_sglang.testing import local_cluster as lc  # noqa: E402

POLICIES = ["round_robin", "random", "jsq", "p2c", "eldr"]
FIGURES = ("completed", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--dataset", type=Path, default=DEFAULT_WORKLOAD.with_suffix(".bench.jsonl"),
                   help="bench_serving custom-format file")
    p.add_argument("--decodes", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=POLICIES, choices=POLICIES)
    p.add_argument("--no-sglang-router", action="store_true", help="skip the sglang-router run")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--output-len", type=int, default=24, help="tokens per request (bench_serving --sharegpt-output-len)")
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path(".cache/bench-real"))
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        p.error(f"--model: no Hugging Face model at {args.model}")
    if not args.dataset.is_file():
        p.error(f"--dataset: {args.dataset} not found")
    if args.decodes < 2 or args.num_prompts < 1 or args.output_len < 4:
        p.error("--decodes must be >= 2, --num-prompts >= 1, --output-len >= 4")
    return args


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


def decode_experts(cluster: lc.PDCluster) -> tuple[float, float]:
    """(distinct experts summed over steps, steps) over all decode servers."""
    per_server = decode_counters(cluster).values()
    return sum(u for u, _ in per_server), sum(s for _, s in per_server)


def run_one(name: str, router: lc.ManagedProcess, cluster: lc.PDCluster, args, out: Path) -> dict:
    router.wait_ready(timeout=90)
    lc.flush_cache(cluster.prefills[0][0].url)
    u0, s0 = decode_experts(cluster)
    t0 = time.time()
    res = bench_serving(router.url, args, out / f"{name}.jsonl")
    u1, s1 = decode_experts(cluster)
    row = {"router": name, **{k: res.get(k) for k in FIGURES}, "wall_s": round(time.time() - t0, 1),
           "decode_steps": s1 - s0, "distinct_experts_per_step": (u1 - u0) / (s1 - s0) if s1 > s0 else None}
    print(f"  {name:22s} " + "  ".join(f"{k}={row[k]:.2f}" if isinstance(row[k], float) else f"{k}={row[k]}"
                                       for k in ("median_tpot_ms", "p99_tpot_ms", "distinct_experts_per_step",
                                                 "decode_steps")), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    artifact = calibration_artifact(args.model, args.decodes, args.out)
    router_port = lc.free_port()
    print(f"starting 1 prefill + {args.decodes} decode SGLang CPU servers ({args.model}) ...", flush=True)
    cluster = lc.start_pd_cluster(
        str(args.model), logs, n_prefill=1, n_decode=args.decodes, eldr_metrics=True,
        prefill_args=["--eldr-calibration", str(artifact),
                      "--eldr-publish", f"http://127.0.0.1:{router_port}/eldr/signature"])
    rows = []
    try:
        runs = [(f"eldr-router/{p}", lambda p=p: lc.start_eldr_router(
            cluster, logs, policy=p, port=router_port, artifact=artifact if policy_spec(p).needs_artifact else None))
            for p in args.policies]
        if not args.no_sglang_router:
            runs.append(("sglang-router/round_robin", lambda: lc.start_sglang_router(cluster, logs)))
        for name, start in runs:
            router = start()
            try:
                rows.append(run_one(name.replace("/", "-"), router, cluster, args, args.out) | {"router": name})
            finally:
                router.stop()
    finally:
        cluster.stop()
    result = {"command": "python benchmark/bench_real_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "measured": "real SGLang CPU servers (2-core machine); CPU TPOT does not stand for GPU TPOT",
              "decodes": args.decodes, "num_prompts": args.num_prompts, "output_len": args.output_len,
              "request_rate": args.request_rate, "dataset": str(args.dataset.relative_to(ROOT)
                                                                if args.dataset.is_relative_to(ROOT) else args.dataset),
              "artifact": str(artifact), "runs": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
