"""Routing before prefill on real SGLang CPU servers: co-located mode and PD early binding.

    python -m benchmark.bench_colocated_real --repeats 2 --json benchmark/results/colocated_real.json
    python -m benchmark.bench_colocated_real --setup pd --artifact .cache/bench-colocated/artifact-predictor.json \\
        --out .cache/bench-pd --repeats 2 --json benchmark/results/early_binding_real.json
    python -m benchmark.bench_colocated_real --render benchmark/results/colocated_real.json   # the table again

``--setup colocated`` (default): N plain (non-PD) SGLang CPU servers with the tiny MoE
and the ELDR plugin in trace mode (one record per request and per decode step, each
server its own folder). First a calibration pass: every prompt of the workload (and,
for the fitting half, its document's continuation) is prefilled once on server 0
(``max_new_tokens`` 1, the token ids sent as ``input_ids``), which gives the model's
true prompt counts as SGLang computes them. The workload's documents are split in two
halves: the predictor is fitted on the first half only (ridge, ``--alpha``) and added
to the committed calibration for N servers (``models/<model>/calibration-k<N>.json``);
the second half is the request stream, so every routed prompt is held out, and its
true counts give the predicted-vs-true region agreement on real servers. Then the same
unmodified ``python -m sglang.bench_serving --dataset-name custom`` stream goes through
each path, interleaved in ``--repeats`` rounds (order rotated per round), prefix caches
flushed before each run:

``eldr``         ``eldr-router --mode colocated`` with the default policy and the artifact;
``round_robin``  ``eldr-router --mode colocated --policy round_robin``;
``cache_aware``  ``python -m sglang_router.launch_router --worker-urls ... --policy cache_aware``.

``--setup pd``: 1 prefill + N decode servers (the existing late-binding configuration,
Mooncake over TCP) and the ELDR PD router with ``--binding early`` (decode chosen at
arrival from the predicted signature), ``--binding late`` (the prefill's signature) and
``--policy round_robin``; the artifact (with its predictor) comes from ``--artifact``
(the co-located run writes one). The late path's signature wait is read from the
router's ``eldr_router_signature_wait_seconds`` histogram.

Reported per path: TPOT and TTFT median/P99 (bench_serving's; mean ± sd and min-max
over rounds), distinct experts per decode step overall and at equal batch size
(relative to round robin), mean batch, requests per server. CPU latency figures do not
stand for GPU ones; distinct experts per step at equal batch size is the
hardware-independent figure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmark.bench_real_cpu import bench_serving, equal_batch, summarise
from benchmark.common import ROOT, free_port, markdown_table, mean_sd, parse_with_quick, write_record

from eldr_sglang.core.artifact import FORMAT_VERSION, load_artifact
from eldr_sglang.core.predictor import SignaturePredictor
from eldr_sglang.prompts import load_tokenizer
from eldr_sglang.router.metrics import histogram_quantiles
from eldr_sglang.testing import local_cluster as lc

DEFAULT_MODEL = ROOT / "models" / "eldr-tiny-moe"
DEFAULT_WORKLOAD = ROOT / "benchmark" / "workloads" / "demo.jsonl"
PATHS = {"colocated": ("eldr", "round_robin", "cache_aware"), "pd": ("eldr-early", "eldr-late", "round_robin")}
BASE = "round_robin"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", choices=sorted(PATHS), default="colocated")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD,
                   help="JSON lines with id, prompt, doc, labels; its .bench.jsonl twin (same order) is the stream")
    p.add_argument("--servers", type=int, default=2, help="plain servers (colocated) or decode servers (pd)")
    p.add_argument("--paths", default=None, help="comma-separated subset of the setup's paths")
    p.add_argument("--repeats", type=int, default=2, help="rounds; each runs every path once (rotated order)")
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--alpha", type=float, default=0.05, help="predictor ridge strength")
    p.add_argument("--policy", default=None, help="ELDR policy (default: the router's default)")
    p.add_argument("--artifact", type=Path, default=None,
                   help="calibration artifact with a predictor (pd: required; colocated: skip the calibration pass)")
    p.add_argument("--seed", type=int, default=0, help="the document split")
    p.add_argument("--out", type=Path, default=ROOT / ".cache" / "bench-colocated")
    p.add_argument("--json", type=Path, default=None)
    args = parse_with_quick(p, argv)
    if not (args.model / "config.json").is_file():
        p.error(f"--model: no Hugging Face model at {args.model}")
    bench = args.workload.with_suffix(".bench.jsonl")
    if not args.workload.is_file() or not bench.is_file():
        p.error(f"--workload: need {args.workload} and {bench}")
    if args.servers < 2 or args.repeats < 1 or args.output_len < 4 or args.alpha <= 0:
        p.error("--servers must be >= 2, --repeats >= 1, --output-len >= 4, --alpha > 0")
    if args.setup == "pd" and (args.artifact is None or not args.artifact.is_file()):
        p.error("--artifact: --setup pd needs an artifact with a predictor (the colocated run writes one)")
    known = PATHS[args.setup]
    args.paths = [x.strip() for x in (args.paths or ",".join(known)).split(",") if x.strip()]
    bad = [x for x in args.paths if x not in known]
    if bad:
        p.error(f"--paths: unknown {bad} for --setup {args.setup} (choose from {', '.join(known)})")
    return args


# ------------------------------------------------------------------ workload and artifact
def split_workload(path: Path, seed: int) -> tuple[list[dict], list[dict]]:
    """(fit rows, stream rows): whole documents to one side, each side half of the documents."""
    rows = [json.loads(line) for line in path.open(encoding="utf-8")]
    bench = [json.loads(line) for line in path.with_suffix(".bench.jsonl").open(encoding="utf-8")]
    if len(bench) != len(rows):
        raise ValueError(f"{path} and its .bench.jsonl twin differ in length")
    for r, b in zip(rows, bench):
        r["bench"] = b
        r["continuation"] = b["conversations"][1]["content"]
    docs = sorted({r.get("doc", r["id"]) for r in rows})
    random.Random(seed).shuffle(docs)
    fit_docs = set(docs[: len(docs) // 2])
    return [r for r in rows if r.get("doc", r["id"]) in fit_docs], [r for r in rows if r.get("doc", r["id"]) not in fit_docs]


def per_file(folder: Path, kind: str) -> dict[str, list[dict]]:
    """Trace records per server process (``<kind>-<pid>.jsonl``: one scheduler per server here)."""
    return {f.name: [json.loads(line) for line in f.open() if line.strip()] for f in sorted(folder.glob(f"{kind}-*.jsonl"))}


def records(folder: Path, kind: str) -> list[dict]:
    return [r for recs in per_file(folder, kind).values() for r in recs]


def wait_records(folder: Path, kind: str, want: int, timeout: float = 60.0) -> list[dict]:
    """The trace records once ``want`` of them are there (a background thread writes them)."""
    deadline = time.monotonic() + timeout
    while True:
        recs = records(folder, kind)
        if len(recs) >= want or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def calibration_pass(url: str, trace_dir: Path, texts: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """Prefill every token list once; {rid: true prompt counts [layers, experts]} from the trace."""
    before = len(records(trace_dir, "prefill"))
    for rid, ids in texts.items():
        lc.http_json(url + "/generate", {"input_ids": ids, "rid": rid,
                                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, timeout=300)
    recs = wait_records(trace_dir, "prefill", before + len(texts))
    out = {r["rid"]: np.asarray(r["counts"], dtype=np.float32) for r in recs if r["rid"] in texts}
    missing = set(texts) - set(out)
    if missing:
        raise RuntimeError(f"no prefill trace record for {len(missing)} calibration prompts (e.g. {sorted(missing)[0]})")
    return out


def fit_artifact(args, tok, fit: list[dict], stream: list[dict], url: str, trace_dir: Path) -> tuple[Path, dict]:
    """The committed calibration plus a predictor fitted on the fit half; holdout agreement on the stream."""
    base = load_artifact(args.model / f"calibration-k{args.servers}.json")
    texts = {}
    for r in fit:
        texts[f"cal-{r['id']}"] = tok.encode(r["prompt"])
        texts[f"cal-{r['id']}-cont"] = tok.encode(r["continuation"])
    for r in stream:
        texts[f"hold-{r['id']}"] = tok.encode(r["prompt"])
    texts = {k: v for k, v in texts.items() if len(v) >= 2}
    print(f"calibration pass: {len(texts)} prefills on {url} ...", flush=True)
    true = calibration_pass(url, trace_dir, texts)
    layers = list(base.layers)
    fit_ids = [k for k in texts if k.startswith("cal-")]
    pred = SignaturePredictor(alpha=args.alpha).fit([texts[k] for k in fit_ids],
                                                    np.stack([true[k][layers] for k in fit_ids]))
    art = replace(base, format_version=FORMAT_VERSION, predictor=pred, extra={**base.extra, "predictor": {
        "method": "ridge", "alpha": args.alpha, "requests": len(fit_ids), "tokens_seen": int(len(pred.tokens_)),
        "bytes": pred.nbytes, "tokenizer": str(args.model), "fitted_on": "bench_colocated_real calibration pass"}})
    path = art.save(args.out / "artifact-predictor.json")
    hold = [k for k in texts if k.startswith("hold-")]
    cents = np.asarray(art.centroids, dtype=np.float32)
    p_region = np.array([int(np.argmax(cents @ art.signature(pred.predict(texts[k])))) for k in hold])
    t_region = np.array([int(np.argmax(cents @ art.signature(true[k][layers]))) for k in hold])
    share = np.bincount(t_region, minlength=len(cents)) / len(t_region)
    acc = {"fit_prompts": len(fit_ids), "holdout_prompts": len(hold), "alpha": args.alpha,
           "region_agreement": float((p_region == t_region).mean()),
           "majority_region_share": float(share.max()), "tokens_seen": int(len(pred.tokens_)),
           "coverage_mean": float(np.mean([pred.coverage(texts[k]) for k in hold]))}
    print(f"predictor: {acc['fit_prompts']} fit prompts; held-out region agreement {acc['region_agreement']:.2f} "
          f"(majority region {acc['majority_region_share']:.2f}), coverage {acc['coverage_mean']:.2f}", flush=True)
    return path, acc


# ------------------------------------------------------------------ servers and routers
def start_plain_servers(args, logs: Path, trace_dir: Path) -> lc.PDCluster:
    """N plain servers (kept as ``decodes``), one after another (concurrent start-ups only contend)."""
    cluster = lc.PDCluster([], [])
    try:
        for i in range(args.servers):
            spec = lc.ServerSpec(str(args.model), "single", eldr_metrics_port=free_port(),
                                 extra_args=["--eldr-trace-dir", str(trace_dir)])
            cluster.decodes.append((lc.start_server_ready(spec, logs, f"server-{i}"), spec))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def eldr_colocated(cluster: lc.PDCluster, logs: Path, policy: str | None, artifact: Path, model: Path) -> lc.ManagedProcess:
    port = free_port()
    argv = [sys.executable, "-m", "eldr_sglang.router", "--mode", "colocated", "--host", "127.0.0.1",
            "--port", str(port), "--calibration", str(artifact), "--tokenizer", str(model), "--health-timeout", "10"]
    argv += ["--policy", policy] if policy else []
    for proc, _ in cluster.decodes:
        argv += ["--worker", proc.url]
    name = f"eldr-colocated-{policy or 'default'}"
    return lc.ManagedProcess(name, argv, logs / f"{name}.log", f"http://127.0.0.1:{port}").start()


def sglang_cache_aware(cluster: lc.PDCluster, logs: Path) -> lc.ManagedProcess:
    port = free_port()
    argv = lc.sglang_router_argv(port, "--policy", "cache_aware",
                                 "--worker-urls", *[p.url for p, _ in cluster.decodes])
    return lc.ManagedProcess("sglang-router-cache_aware", argv, logs / "sglang-router-cache_aware.log",
                             f"http://127.0.0.1:{port}").start()


def wait_routing(router: lc.ManagedProcess, timeout: float = 180.0) -> None:
    """Until one 1-token /generate through the router answers 200 (sglang-router answers
    /health before its workers are registered)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if not router.alive():
            raise RuntimeError(f"{router.name} exited:\n{router.log_tail()}")
        try:
            lc.http_json(router.url + "/generate", {"text": "ready?", "sampling_params": {"max_new_tokens": 1}},
                         timeout=60)
            return
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = repr(e)
        time.sleep(0.5)
    raise TimeoutError(f"{router.name} not routing after {timeout:.0f}s ({last}):\n{router.log_tail()}")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


# ------------------------------------------------------------------ one run
def step_count(cluster: lc.PDCluster) -> float:
    return sum(lc.scrape_metrics(spec.eldr_metrics_port)["eldr_decode_steps_total"] for _, spec in cluster.decodes)


def new_records(trace_dir: Path, kind: str, before: dict[str, list]) -> dict[str, list[dict]]:
    return {f: recs[len(before.get(f, [])):] for f, recs in per_file(trace_dir, kind).items()}


def run_one(name: str, router: lc.ManagedProcess, cluster: lc.PDCluster, trace_dir: Path, args,
            bench_args: argparse.Namespace) -> dict:
    wait_routing(router)
    for proc, _ in cluster.prefills + cluster.decodes:
        lc.flush_cache(proc.url)
    steps0, done0, count0 = per_file(trace_dir, "steps"), per_file(trace_dir, "decode"), step_count(cluster)
    t0 = time.time()
    res = bench_serving(router.url, bench_args, args.out / f"{name}-{time.time_ns()}.jsonl")
    want = step_count(cluster) - count0
    deadline = time.monotonic() + 60
    while (sum(map(len, new_records(trace_dir, "steps", steps0).values())) < want
           and time.monotonic() < deadline):
        time.sleep(0.2)
    steps = [[r["batch_size"], sum(r["unique_per_layer"]), r.get("forward_ms")]
             for recs in new_records(trace_dir, "steps", steps0).values() for r in recs]
    per_server = sorted((len(v) for v in new_records(trace_dir, "decode", done0).values()), reverse=True)
    per_server += [0] * (len(cluster.decodes) - len(per_server))
    row = {"router": name, **{k: res.get(k) for k in ("completed", "median_ttft_ms", "p99_ttft_ms",
                                                       "median_tpot_ms", "p99_tpot_ms", "output_throughput")},
           "wall_s": round(time.time() - t0, 1), "decode_steps": len(steps),
           "distinct_experts_per_step": float(np.mean([s[1] for s in steps])) if steps else None,
           "mean_batch": float(np.mean([s[0] for s in steps])) if steps else None,
           "requests_per_server": per_server, "steps": steps}
    load = np.array(per_server, dtype=float)
    row["requests_max_over_mean"] = float(load.max() / load.mean()) if load.sum() else None
    if name == "eldr-late":
        row["signature_wait_ms"] = histogram_quantiles(scrape(router.url), "eldr_router_signature_wait_seconds")
    print(f"  {name:12s} TPOT p50 {row['median_tpot_ms']:.0f} ms  TTFT p50 {row['median_ttft_ms']:.0f} ms  "
          f"distinct/step {row['distinct_experts_per_step']:.1f}  mean batch {row['mean_batch']:.2f}  "
          f"requests per server {per_server}", flush=True)
    return row


# ------------------------------------------------------------------ report
def busiest_batch(doc: dict) -> tuple[int, dict[str, list[float]]]:
    """The batch size with the most steps every run saw; per path, per round, the change (%)
    of distinct experts per step there against round robin of the same round."""
    runs = doc["runs"]
    common = set.intersection(*({int(s[0]) for s in r["steps"]} for r in runs))
    b = max(common, key=lambda k: sum(int(s[0]) == k for r in runs for s in r["steps"]))
    mean = {(r["router"], r["round"]): float(np.mean([s[1] for s in r["steps"] if int(s[0]) == b])) for r in runs}
    out: dict[str, list[float]] = {}
    for (name, rnd), m in sorted(mean.items(), key=lambda kv: kv[0][1]):
        out.setdefault(name, []).append(100.0 * (m / mean[(BASE, rnd)] - 1.0))
    return b, out


def table(doc: dict) -> str:
    rows = []
    eb = doc["equal_batch"].get(f"vs_{BASE}", {})
    b, at_b = busiest_batch(doc)
    for name in doc["paths"]:
        rs = [r for r in doc["runs"] if r["router"] == name]

        def ms(key: str) -> str:
            m, sd = mean_sd(r[key] for r in rs)
            return f"{m:.0f} ± {sd:.0f}"
        rows.append([name, ms("median_tpot_ms"), ms("p99_tpot_ms"), ms("median_ttft_ms"), ms("p99_ttft_ms"),
                     f"{np.mean([r['distinct_experts_per_step'] for r in rs]):.1f}",
                     f"{eb.get(name, float('nan')):+.1f}%", " / ".join(f"{x:+.1f}%" for x in at_b[name]),
                     f"{np.mean([r['mean_batch'] for r in rs]):.2f}",
                     " / ".join(str(r["requests_per_server"]) for r in rs)])
    waits = [(r["round"], r["signature_wait_ms"]) for r in doc["runs"] if r.get("signature_wait_ms")]
    top = "above the 5000 ms top bucket"

    def le(v: float) -> str:
        return top if v == float("inf") else f"<= {v:g} ms"
    note = "".join(f"\n\nlate path's signature wait, round {rnd + 1}: p50 {le(w['p50_le_ms'])}, "
                   f"p99 {le(w['p99_le_ms'])} ({w['count']:.0f} requests; histogram buckets)" for rnd, w in waits)
    return markdown_table(["path", "TPOT p50 ms", "TPOT p99 ms", "TTFT p50 ms", "TTFT p99 ms", "distinct/step",
                           f"at equal batch vs {BASE}", f"at batch {b}, per round", "mean batch", "requests per server (per round)"], rows) + note


def plan(args: argparse.Namespace, fit: list[dict], stream: list[dict]) -> str:
    """What a run of ``args`` starts and sends, for ``--quick``."""
    n = args.servers
    if args.setup == "colocated":
        servers = f"{n} plain SGLang CPU servers of {args.model} (plugin in trace mode)"
        artifact = (f"artifact {args.artifact}, no calibration pass" if args.artifact else
                    f"calibration pass on server 0 ({len(fit)} fit prompts and their continuations, "
                    f"{len(stream)} held-out prompts), ridge predictor (alpha {args.alpha:g})")
        routers = {"eldr": "eldr-router --mode colocated" + (f" --policy {args.policy}" if args.policy else ""),
                   "round_robin": "eldr-router --mode colocated --policy round_robin",
                   "cache_aware": "sglang_router.launch_router --policy cache_aware"}
    else:
        servers = f"1 prefill + {n} decode SGLang CPU servers of {args.model} (Mooncake over TCP)"
        artifact = f"artifact {args.artifact}"
        pol = args.policy or "eldr_balanced"
        routers = {"eldr-early": f"eldr-router --policy {pol} --binding early",
                   "eldr-late": f"eldr-router --policy {pol} (late binding)",
                   "round_robin": "eldr-router --policy round_robin"}
    paths = "; ".join(f"{p}: {routers[p]}" for p in args.paths)
    return (f"plan: {servers}; {artifact}; {args.repeats} rounds of {paths} (order rotated per round), each "
            f"`sglang.bench_serving --dataset-name custom` over {len(stream)} prompts at {args.request_rate:g} req/s, "
            f"{args.output_len} output tokens")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--render"]:  # --render JSON: the table of a recorded run
        if len(argv) != 2 or not Path(argv[1]).is_file():
            print("--render: give one recorded JSON file", file=sys.stderr)
            return 2
        print(table(json.loads(Path(argv[1]).read_text())))
        return 0
    args = parse_args(argv)
    fit, stream = split_workload(args.workload, args.seed)
    if args.quick:  # real SGLang servers: the smoke run checks the arguments and the plan only
        print(plan(args, fit, stream))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    tok = load_tokenizer(args.model)
    dataset = args.out / "stream.bench.jsonl"
    dataset.write_text("".join(json.dumps(r["bench"], ensure_ascii=False) + "\n" for r in stream))
    bench_args = argparse.Namespace(model=args.model, dataset=dataset, num_prompts=len(stream),
                                    output_len=args.output_len, request_rate=args.request_rate,
                                    max_concurrency=args.max_concurrency)
    n = args.servers
    traces = args.out / f"traces-{args.setup}"
    traces.mkdir(parents=True, exist_ok=True)
    for f in traces.glob("*.jsonl"):
        f.unlink()
    accuracy, router_port = None, free_port()
    if args.setup == "colocated":
        print(f"starting {n} plain SGLang CPU servers ({args.model}) ...", flush=True)
        cluster = start_plain_servers(args, logs, traces)
    else:
        print(f"starting 1 prefill + {n} decode SGLang CPU servers ({args.model}) ...", flush=True)
        committed = args.model / f"calibration-k{n}.json"
        cluster = lc.start_pd_cluster(
            str(args.model), logs, n_prefill=1, n_decode=n, eldr_metrics=True,
            prefill_args=["--eldr-calibration", str(committed),
                          "--eldr-publish", f"http://127.0.0.1:{router_port}/eldr/signature"],
            decode_args=["--eldr-trace-dir", str(traces)])
    rows: list[dict] = []
    try:
        if args.setup == "colocated":
            artifact, accuracy = (args.artifact, None) if args.artifact else fit_artifact(
                args, tok, fit, stream, cluster.decodes[0][0].url, traces)
            starters = {"eldr": lambda: eldr_colocated(cluster, logs, args.policy, artifact, args.model),
                        "round_robin": lambda: eldr_colocated(cluster, logs, "round_robin", artifact, args.model),
                        "cache_aware": lambda: sglang_cache_aware(cluster, logs)}
        else:
            artifact = args.artifact
            pol = args.policy or "eldr_balanced"
            tok_arg = ["--tokenizer", str(args.model)]
            starters = {
                "eldr-early": lambda: lc.start_eldr_router(cluster, logs, pol, artifact, router_port,
                                                           ["--binding", "early", *tok_arg]),
                "eldr-late": lambda: lc.start_eldr_router(cluster, logs, pol, artifact, router_port, tok_arg),
                "round_robin": lambda: lc.start_eldr_router(cluster, logs, "round_robin", None, router_port)}
        paths = [(p, starters[p]) for p in args.paths]
        for rnd in range(args.repeats):
            order = paths[rnd % len(paths):] + paths[:rnd % len(paths)]
            print(f"round {rnd + 1}/{args.repeats}: {', '.join(p for p, _ in order)}", flush=True)
            for name, start in order:
                router = start()
                try:
                    rows.append(run_one(name, router, cluster, traces, args, bench_args) | {"round": rnd})
                finally:
                    router.stop()
                if args.json:  # after every run: an interrupted benchmark keeps what it measured
                    write_record(args.json, record(args, rows, artifact, accuracy, len(stream), done=False), argv)
    finally:
        cluster.stop()
    doc = record(args, rows, artifact, accuracy, len(stream), done=True)
    print(table(doc))
    if args.json:
        write_record(args.json, doc, argv)
        print(f"-> {args.json}")
    return 0


def record(args, rows: list[dict], artifact, accuracy, stream_prompts: int, done: bool) -> dict:
    return {"measured": "real SGLang CPU servers (2-core machine); CPU latency does not stand for GPU latency",
            "complete": done, "setup": args.setup, "servers": args.servers, "paths": args.paths,
            "stream_prompts": stream_prompts, "output_len": args.output_len, "request_rate": args.request_rate,
            "repeats": args.repeats, "artifact": str(artifact), "predictor_holdout": accuracy,
            "summary": summarise(rows), "equal_batch": equal_batch(rows, BASE), "runs": rows}


if __name__ == "__main__":
    sys.exit(main())
