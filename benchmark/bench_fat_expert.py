"""ELDR's effect on one real SGLang server whose decode is bound by expert weights.

One SGLang CPU server on the fat-expert model (``tools/make_fat_expert_model.py``:
the trained tiny MoE with every expert FFN zero-padded to width W, so each distinct
expert a step activates costs ``3 * hidden * W`` weight reads per layer) in the
plugin's trace mode (one record per decode step: batch size, distinct experts per
layer, forward time). Batches of B concurrent requests (equal prompt length,
equal output length, greedy, EOS ignored) are either all of one (domain, language)
label ("grouped", what ELDR's routing gives a decode server) or of as many labels as
possible ("mixed", what a load balancer gives), repeated ``--repeats`` times with
the order rotated per round. Run it under the machine's SGLang lock::

    flock /tmp/eldr-sglang.lock python -m benchmark.bench_fat_expert --repeats 3 \\
        --json benchmark/results/fat_expert.json

Reported: per B, grouped vs mixed TPOT (client-side, per request: time between its
first and last streamed token over the tokens in between; mean ± sd over rounds)
and distinct experts per step; the least-squares fit of step time on
(1, batch size, distinct experts summed over layers), with R² and residuals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
from benchmark.bench_real_cpu import step_records, step_time_fit
from benchmark.common import fmt_mean_sd, markdown_table, parse_with_quick, positive_int_list, write_record
from tools import make_fat_expert_model as fat
from eldr_sglang.testing import local_cluster as lc

DEFAULT_WORKLOAD = ROOT / "benchmark" / "workloads" / "demo.jsonl"
KINDS = ("grouped", "mixed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None,
                   help="fat-expert model (default: built from models/eldr-tiny-moe at --width if missing)")
    p.add_argument("--width", type=int, default=fat.DEFAULT_WIDTH, help="expert FFN width of the default model")
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD, help="labelled prompts (our jsonl format)")
    p.add_argument("--batches", type=positive_int_list, default=[1, 2, 4, 8, 16], help="batch sizes B")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every (B, kind) once, rotated")
    p.add_argument("--prompt-tokens", type=int, default=48, help="every prompt cut to this many tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--cpus", default=None, help="pin the server to these cores (taskset -c)")
    p.add_argument("--threads", type=int, default=None, help="the server's torch threads (OMP_NUM_THREADS)")
    p.add_argument("--out", type=Path, default=Path(".cache/bench-fat"))
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parse_with_quick(p, argv)
    if args.repeats < 1 or args.prompt_tokens < 1 or args.new_tokens < 4:
        p.error("--repeats and --prompt-tokens must be >= 1, --new-tokens >= 4")
    if not args.workload.is_file():
        p.error(f"--workload: {args.workload} not found")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model: no Hugging Face model at {args.model}")
    return args


def label_pools(workload: Path, tokenizer_dir: Path, prompt_tokens: int) -> dict[str, list[list[int]]]:
    """Token ids of every prompt with at least ``prompt_tokens`` tokens, cut to that, per label."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    pools: dict[str, list[list[int]]] = defaultdict(list)
    for line in workload.open():
        r = json.loads(line)
        ids = tok.encode(r["prompt"]).ids
        if len(ids) >= prompt_tokens:
            pools[f"{r['labels']['domain']}/{r['labels']['language']}"].append(ids[:prompt_tokens])
    return dict(sorted(pools.items(), key=lambda kv: (-len(kv[1]), kv[0])))


def run_plan(batches: list[int]) -> list[tuple[int, str]]:
    """The (B, kind) runs of one round: B = 1 is grouped only (one request has one label)."""
    return [(b, k) for b in batches for k in (KINDS if b > 1 else ("grouped",))]


def batch_prompts(pools: dict[str, list[list[int]]], kind: str, size: int, rnd: int) -> tuple[list[list[int]], list[str]]:
    """``size`` prompts: one label (grouped; a label with enough prompts, rotated by round) or
    labels taken in turn (mixed; the turn starts at the round)."""
    labels = list(pools)
    if kind == "grouped":
        fits = [lab for lab in labels if len(pools[lab]) >= size]
        if not fits:
            raise ValueError(f"no label has {size} prompts of the required length")
        lab = fits[rnd % len(fits)]
        start = (rnd * size) % len(pools[lab])
        ids = [pools[lab][(start + i) % len(pools[lab])] for i in range(size)]
        return ids, [lab] * size
    taken: dict[str, int] = defaultdict(int)
    ids, labs = [], []
    i = rnd
    while len(ids) < size:
        lab = labels[i % len(labels)]
        ids.append(pools[lab][(rnd + taken[lab]) % len(pools[lab])])
        labs.append(lab)
        taken[lab] += 1
        i += 1
    return ids, labs


async def _one(session, url: str, ids: list[int], new_tokens: int) -> dict:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    sent = time.perf_counter()
    marks: list[tuple[float, int]] = []
    async with session.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/generate answered {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            n = json.loads(line[5:])["meta_info"]["completion_tokens"]
            marks.append((time.perf_counter(), n))
    (t0, n0), (t1, n1) = marks[0], marks[-1]
    if n1 != new_tokens:
        raise RuntimeError(f"request produced {n1} tokens, expected {new_tokens}")
    return {"ttft_ms": 1e3 * (t0 - sent), "tpot_ms": 1e3 * (t1 - t0) / max(n1 - n0, 1)}


async def run_batch(url: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        return list(await asyncio.gather(*(_one(session, url, ids, new_tokens) for ids in prompts)))


def wait_steps(trace_dir: Path, want: int, timeout: float = 60.0) -> dict[str, list[dict]]:
    """Step records once the trace writer has written ``want`` of them (or the deadline passed)."""
    deadline = time.monotonic() + timeout
    while True:
        recs = step_records(trace_dir)
        if sum(map(len, recs.values())) >= want or time.monotonic() > deadline:
            return recs
        time.sleep(0.1)


def start_server(model: Path, logs: Path, trace_dir: Path, metrics_port: int, cpus: str | None,
                 threads: int | None) -> lc.ManagedProcess:
    spec = lc.ServerSpec(str(model), "single", eldr_metrics_port=metrics_port,
                         extra_args=["--eldr-trace-dir", str(trace_dir), "--eldr-layers", "all"])
    spec.port, spec.nccl_port = lc.free_port(), lc.free_port()
    argv = (["taskset", "-c", cpus] if cpus else []) + spec.argv()
    env = {"SGLANG_USE_CPU_ENGINE": "1"} if lc.on_cpu() else {}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = lc.ManagedProcess("fat-server", argv, logs / "fat-server.log", f"http://127.0.0.1:{spec.port}", env=env).start()
    proc.wait_ready(timeout=600)
    return proc


def decode_steps_total(metrics_port: int) -> int:
    return int(lc.scrape_metrics(metrics_port).get("eldr_decode_steps_total", 0))


def fit_details(runs: list[dict]) -> dict | None:
    """``step_time_fit`` (bench_real_cpu) plus residual spread, per kind and per batch size."""
    fit = step_time_fit(runs)
    if fit is None:
        return None
    resid = defaultdict(list)
    for r in runs:
        for b, u, ms in r["steps"]:
            pred = fit["intercept_ms"] + fit["ms_per_sequence"] * b + fit["ms_per_distinct_expert"] * u
            resid[(r["kind"], b)].append(ms - pred)
    allres = np.concatenate([np.asarray(v) for v in resid.values()])
    fit["residual_sd_ms"] = float(allres.std(ddof=3))
    fit["residual_mean_by_kind_and_batch_ms"] = {f"{k}/B={b}": float(np.mean(v)) for (k, b), v in sorted(resid.items())}
    return fit


def summarise(runs: list[dict], batches: list[int]) -> list[dict]:
    rows = []
    for b in batches:
        row: dict = {"batch": b}
        for kind in KINDS:
            rs = [r for r in runs if r["batch"] == b and r["kind"] == kind]
            full = [u for r in rs for bb, u, _ in r["steps"] if bb == b]
            full_ms = [ms for r in rs for bb, _, ms in r["steps"] if bb == b]
            row[kind] = {"tpot_ms_per_round": [r["tpot_ms"] for r in rs],
                         "distinct_per_step": float(np.mean(full)) if full else None,
                         "forward_ms_per_step": float(np.mean(full_ms)) if full_ms else None}
        g, m = row["grouped"]["tpot_ms_per_round"], row["mixed"]["tpot_ms_per_round"]
        if g and m:
            gains = [100.0 * (1 - gi / mi) for gi, mi in zip(g, m)]  # paired per round
            row["tpot_gain_pct_per_round"] = gains
        rows.append(row)
    return rows


def report(result: dict) -> list[str]:
    fit = result["step_time_fit"]
    lines = [f"fat-expert model: {result['model']} (expert FFN {result['expert_width']}, "
             f"{result['expert_weight_bytes'] / 2**20:.0f} MiB of expert weights)"]
    rows = []
    for r in result["per_batch"]:
        g, m = r["grouped"], r["mixed"]
        gain = fmt_mean_sd(r["tpot_gain_pct_per_round"]) if r.get("tpot_gain_pct_per_round") else "-"
        rows.append([r["batch"], fmt_mean_sd(g["tpot_ms_per_round"]),
                     fmt_mean_sd(m["tpot_ms_per_round"]) if m["tpot_ms_per_round"] else "-", gain,
                     f"{g['distinct_per_step']:.0f}" if g["distinct_per_step"] else "-",
                     f"{m['distinct_per_step']:.0f}" if m["distinct_per_step"] else "-",
                     f"{g['forward_ms_per_step']:.0f}" if g["forward_ms_per_step"] else "-",
                     f"{m['forward_ms_per_step']:.0f}" if m["forward_ms_per_step"] else "-"])
    lines.append(markdown_table(["B", "TPOT grouped (ms)", "TPOT mixed (ms)", "grouped gain (%)",
                                 "distinct/step grouped", "distinct/step mixed", "forward ms/step grouped",
                                 "forward ms/step mixed"], rows))
    if fit:
        lines.append(f"step time fit ({fit['steps']} steps): {fit['intercept_ms']:.1f} ms + "
                     f"{fit['ms_per_sequence']:.2f} ms/sequence + {fit['ms_per_distinct_expert']:.3f} ms/distinct expert"
                     f" (summed over layers), R² {fit['r2']:.3f}, residual sd {fit['residual_sd_ms']:.1f} ms")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model
    if model is None:
        model = fat.default_out(ROOT / "models" / "eldr-tiny-moe", args.width)
    plan = run_plan(args.batches)
    if args.quick:  # a real SGLang server: the smoke run checks the arguments and the plan only
        built = "" if args.model is not None or (model / fat.WEIGHTS).is_file() else f" (built at width {args.width} first)"
        pin = f" on cores {args.cpus}" if args.cpus else ""
        print(f"plan: 1 SGLang CPU server{pin} on {model}{built}; a warm-up batch, then {args.repeats} rounds of "
              f"{', '.join(f'B={b} {k}' for b, k in plan)} (order rotated per round), {args.prompt_tokens}-token "
              f"prompts from {args.workload}, {args.new_tokens} new tokens each")
        return 0
    if args.model is None and not (model / fat.WEIGHTS).is_file():
        print(f"building {model} ...", flush=True)
        fat.build(ROOT / "models" / "eldr-tiny-moe", model, args.width)
    config = json.loads((model / "config.json").read_text())
    pools = label_pools(args.workload, model, args.prompt_tokens)
    trace_dir, logs = args.out / "steps", args.out / "logs"
    trace_dir.mkdir(parents=True, exist_ok=True)
    for f in trace_dir.glob("steps-*.jsonl"):
        f.unlink()
    metrics_port = lc.free_port()
    print(f"starting an SGLang CPU server on {model} ...", flush=True)
    server = start_server(model, logs, trace_dir, metrics_port, args.cpus, args.threads)
    runs: list[dict] = []
    try:
        asyncio.run(run_batch(server.url, batch_prompts(pools, "mixed", max(args.batches), 0)[0], 8))  # warm-up
        for rnd in range(args.repeats):
            order = plan[rnd % len(plan):] + plan[:rnd % len(plan)]
            for b, kind in order:
                ids, labs = batch_prompts(pools, kind, b, rnd)
                lc.flush_cache(server.url)
                before = step_records(trace_dir)
                n0 = sum(map(len, before.values()))
                c0 = decode_steps_total(metrics_port)
                reqs = asyncio.run(run_batch(server.url, ids, args.new_tokens))
                after = wait_steps(trace_dir, n0 + decode_steps_total(metrics_port) - c0)
                steps = [[r["batch_size"], sum(r["unique_per_layer"]), r["forward_ms"]]
                         for f, recs in after.items() for r in recs[len(before.get(f, [])):]]
                run = {"round": rnd, "batch": b, "kind": kind, "labels": sorted(set(labs)),
                       "tpot_ms": float(np.mean([q["tpot_ms"] for q in reqs])),
                       "ttft_ms": float(np.mean([q["ttft_ms"] for q in reqs])), "steps": steps}
                runs.append(run)
                full = [u for bb, u, _ in steps if bb == b]
                print(f"  round {rnd + 1} B={b:2d} {kind:7s} TPOT {run['tpot_ms']:7.1f} ms  "
                      f"distinct/step {np.mean(full) if full else float('nan'):6.1f}  ({len(steps)} steps)", flush=True)
    finally:
        server.stop()
    result = {"measured": "real SGLang CPU server, fat-expert model (zero-padded experts); one server, nothing else "
                          "of this benchmark running",
              "model": str(model.relative_to(ROOT) if model.is_relative_to(ROOT) else model),
              "expert_width": config["moe_intermediate_size"], "expert_weight_bytes": fat.expert_bytes(
                  config, config["moe_intermediate_size"]),
              "batches": args.batches, "repeats": args.repeats, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "cpus": args.cpus, "threads": args.threads,
              "labels": {lab: len(v) for lab, v in pools.items()},
              "per_batch": summarise(runs, args.batches), "step_time_fit": fit_details(runs), "runs": runs}
    if args.json:
        rec = write_record(args.json, result, argv)
        args.json.with_suffix(".md").write_text(f"Command: `flock /tmp/eldr-sglang.lock {rec['command']}`\n\n"
                                                + "\n\n".join(report(result)) + "\n")
        print(f"-> {args.json}, {args.json.with_suffix('.md')}")
    print("\n".join(report(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
