"""Unmodified ``python -m sglang.bench_serving`` against the ELDR router and sglang-router.

    python -m benchmark.bench_serving_routers [--repeats 3] [--quick]
        [--throughput-prompts 2000] [--throughput-concurrency 64] [--latency-prompts 200]
        [--paths eldr,eldr-w2,eldr-rr,sglang-router,direct]
        [--json benchmark/results/bench_serving_routers.json]

A benchmark, not a timed test. It starts 1 prefill + 4 decode stub workers
(``python -m eldr_sglang.testing.stub_worker``, one process each), then every router path,
each its own process, all before measuring:

``eldr``           ELDR router, ``--policy eldr``, signatures over TCP (``--signature-port 0``);
``eldr-w2``        the same with ``--workers 2`` (two processes on one fixed port);
``eldr-rr``        ELDR router, ``--policy round_robin`` (no signature wait);
``sglang-router``  ``python -m sglang_router.launch_router --pd-disaggregation
                   --policy round_robin`` (posts prefill and decode at once);
``direct``         bench_serving straight at one decode stub: no router, no prefill
                   (the latency baseline).

Then it runs ``python -m sglang.bench_serving --backend sglang --dataset-name
random-ids ...`` (unmodified, as a subprocess) against each path, interleaved in
rounds: round r runs every path once per mode, the order rotated by r, so drift of
this shared machine hits all paths alike. Two modes: ``throughput`` (high
concurrency, request rate inf) and ``latency`` (concurrency 1, so the added latency
is not queueing). Figures are bench_serving's own (``request_throughput``,
``median_e2e_latency_ms``, ``p99_e2e_latency_ms`` of its ``--output-file``); the
table shows the median over repeats and the min-max spread; ratios and added
latency are paired per round (path vs sglang-router / direct of the same round),
then the median over rounds.

Stubs: no KV handoff across processes (a decode stub answers at once, it never
waits for its prefill), so a router that posts decode only after the prefill's
signature (ELDR's late binding) pays the prefill round trip in series, one that
posts both at once (sglang-router) in parallel; ``direct`` pays no prefill at all.
The added latency vs ``direct`` is therefore the router *and* the PD hop it makes.

Every process it starts (stubs, routers, bench_serving) is its own process group,
ended on exit, Ctrl-C, SIGTERM or an exception (and sent SIGTERM if this process dies).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from benchmark.common import free_port, parse_with_quick, quick_out, write_record
from benchmark.process_cpu import idle_rates, per_request, snapshot
from benchmark.serving_harness import (BOOTSTRAP_PORT, N_DECODES, PY, STREAM_CHUNKS, Procs, bench_cmd, http_json,
                                       make_artifact, preflight_stream, router_status, run_bench, stub_cmd,
                                       wait_generate)
from benchmark.serving_report import record_summary
from eldr_sglang.testing.local_cluster import sglang_router_argv

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmark" / "results" / "bench_serving_routers.json"
ALL_PATHS = ("eldr", "eldr-w2", "eldr-rr", "sglang-router", "direct")


# ------------------------------------------------------------------ setup
def router_cmd(name: str, port: int, prefill: str, decodes: list[str], artifact: str) -> list[str]:
    """The command of router path ``name`` (an ELDR variant or sglang-router) over the stubs."""
    if name == "sglang-router":
        cmd = sglang_router_argv(port, "--pd-disaggregation", "--prefill", prefill, BOOTSTRAP_PORT,
                                 "--policy", "round_robin", "--log-level", "warn")
    else:
        cmd = [PY, "-m", "eldr_sglang.router", "--prefill", prefill, BOOTSTRAP_PORT,
               "--policy", "round_robin" if name == "eldr-rr" else "eldr",
               "--calibration", artifact, "--signature-port", "0",
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
               "--drain-timeout", "2"]
        if name == "eldr-w2":
            cmd += ["--workers", "2"]
    for d in decodes:
        cmd += ["--decode", d]
    return cmd


# ------------------------------------------------------------------ main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each runs every path once per mode")
    ap.add_argument("--throughput-prompts", type=int, default=2000)
    ap.add_argument("--throughput-concurrency", type=int, default=64)
    ap.add_argument("--latency-prompts", type=int, default=300)
    ap.add_argument("--paths", default=",".join(ALL_PATHS), help=f"comma list of {','.join(ALL_PATHS)}")
    ap.add_argument("--start-timeout", type=float, default=120.0)
    ap.add_argument("--run-timeout", type=float, default=300.0, help="longest one bench_serving run")
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    ap.add_argument("--keep-logs", action="store_true", help="keep the process logs (path printed)")
    # --quick (< 2 min): 1 repeat, one small mode (C=4, N=40) per path; each bench_serving start
    # costs ~14 s of imports
    return parse_with_quick(ap, argv, json=str(quick_out("serving_routers") / "bench_serving_routers.json"))


def plan_runs(args: argparse.Namespace) -> tuple[list[str], int, dict, list]:
    """(paths, repeats, modes, distinct modes) of this run; an unknown path exits."""
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in ALL_PATHS]
    if bad:
        sys.exit(f"unknown path(s) {bad}; choose from {ALL_PATHS}")
    if args.quick:
        repeats = 1
        smoke = ("smoke", 4, 40)
        modes = {"throughput": smoke, "latency": smoke}
    else:
        repeats = args.repeats
        modes = {"throughput": ("throughput", args.throughput_concurrency, args.throughput_prompts),
                 "latency": ("latency", 1, args.latency_prompts)}
    mode_list = list(dict.fromkeys(modes.values()))  # smoke: one mode serves both columns
    return paths, repeats, modes, mode_list


def new_doc(argv: Optional[list[str]], repeats: int, modes: dict, paths: list[str], quick: bool) -> dict[str, Any]:
    """The result document before anything runs: command, environment, configuration, notes."""
    return {
        "command": shlex.join([PY, "-m", "benchmark.bench_serving_routers",
                               *(sys.argv[1:] if argv is None else argv)]),
        "argv": sys.argv if argv is None else argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": _environment(),
        "config": {"repeats": repeats, "modes": {k: dict(zip(("name", "concurrency", "prompts"), v))
                                                 for k, v in modes.items()},
                   "paths": paths, "decode_stubs": N_DECODES, "prefill_stubs": 1,
                   "stub_stream_chunks": STREAM_CHUNKS, "quick": quick},
        "notes": [
            "stubs: 1 prefill + 4 decode, one process each (python -m eldr_sglang.testing.stub_worker); "
            "no KV handoff across processes: a decode stub answers at once, never waits for its prefill",
            "direct: bench_serving at one decode stub, no router and no prefill (latency baseline); "
            "added latency = router cost + the PD prefill hop the router makes",
            "eldr/eldr-w2 post decode after the prefill's signature (serial); sglang-router and "
            "eldr-rr post prefill and decode at once",
        ],
        "paths": {}, "runs": [],
        "cpu_note": "cpu_per_request: CPU us per completed request of each process (its --workers "
                    "children included), user and system apart, the idle rate (idle_cpu_per_s, "
                    "measured before the runs) over the client's start-up taken off (benchmark/process_cpu.py)",
    }


def start_processes(procs: Procs, paths: list[str], logdir: Path, doc: dict, start_timeout: float) -> dict[str, str]:
    """Stubs and routers, every one started and answering before anything is measured; {path: url}."""
    # ---- stubs
    sp = free_port()
    prefill = f"http://127.0.0.1:{sp}"
    stub_procs = [("stub-prefill", procs.start("stub-prefill", stub_cmd("prefill", sp, "p0")))]
    decodes = []
    for i in range(N_DECODES):
        port = free_port()
        decodes.append(f"http://127.0.0.1:{port}")
        stub_procs.append((f"stub-d{i}", procs.start(f"stub-d{i}",
                                                      stub_cmd("decode", port, f"d{i}"))))
    doc["stubs"] = {"prefill": prefill, "decode": decodes,
                    "cmd": [shlex.join(stub_cmd("decode", 0, "dN"))]}
    # ---- routers (all started before anything is measured)
    art = make_artifact(logdir / "artifact.json")
    urls: dict[str, str] = {}
    started: dict[str, subprocess.Popen] = {}
    for p in paths:
        if p == "direct":
            urls[p] = decodes[0]
            doc["paths"][p] = {"url": urls[p], "cmd": None}
            continue
        port = free_port()
        urls[p] = f"http://127.0.0.1:{port}"
        cmd = router_cmd(p, port, prefill, decodes, art)
        doc["paths"][p] = {"url": urls[p], "cmd": shlex.join(cmd)}
        started[p] = procs.start(p, cmd)
    for name, proc in stub_procs:
        idx = name.removeprefix("stub-")
        url = prefill if idx == "prefill" else decodes[int(idx[1:])]
        wait_generate(name, url, procs, proc, start_timeout)
    for p in paths:
        proc = started.get(p, dict(stub_procs)["stub-d0"])
        waited = wait_generate(p, urls[p], procs, proc, start_timeout)
        ok, why = preflight_stream(urls[p])
        doc["paths"][p]["ready_after_s"] = round(waited, 2)
        doc["paths"][p]["preflight"] = why
        print(f"  {p:14s} {urls[p]}  ready, preflight: {why}")
        if not ok:
            raise SystemExit(f"\nbench_serving cannot parse {p}'s answers: {why}")
        for i in range(20):  # warm connections and first-use paths
            http_json("POST", f"{urls[p]}/generate",
                      {"text": f"warmup topic:{i % 4}", "sampling_params": {"max_new_tokens": 4}})
    return urls


def run_rounds(procs: Procs, paths: list[str], urls: dict[str, str], mode_list: list, repeats: int, logdir: Path,
               run_timeout: float, env: dict, doc: dict) -> int:
    """The interleaved rounds of bench_serving (each round starts at the next path); 1 if a run failed."""
    rc = 0
    # ---- interleaved rounds
    from tqdm import tqdm
    total = repeats * len(mode_list) * len(paths)
    pbar = tqdm(total=total, desc="bench_serving runs", unit="run", file=sys.stderr,
                dynamic_ncols=True)
    outdir = logdir / "bench"
    outdir.mkdir()
    pids = {name: proc.pid for name, proc, _ in procs.items}  # the stubs and the routers
    idle = doc["idle_cpu_per_s"] = idle_rates(pids, 2.0 if doc["config"]["quick"] else 5.0)
    for r in range(repeats):
        order = paths[r % len(paths):] + paths[:r % len(paths)]
        for mode, conc, n in mode_list:
            for p in order:
                dead = procs.check_alive()
                if dead:
                    raise RuntimeError(f"a process died: {dead}")
                out_file = outdir / f"r{r}-{mode}-{p}.jsonl"
                cmd = bench_cmd(urls[p], conc, n, str(out_file))
                pbar.set_postfix_str(f"round {r} {mode} {p}")
                before = snapshot(pids)
                run = {"round": r, "mode": mode, "path": p, "concurrency": conc, "prompts": n,
                       "cmd": shlex.join(cmd),
                       **run_bench(procs, cmd, out_file, run_timeout, env)}
                doc["runs"].append(run)
                res = run.get("result")
                if res:
                    run["cpu_per_request"] = per_request(before, snapshot(pids), idle, run["wall_s"],
                                                         res["duration"], res["completed"])
                    msg = (f"round {r} {mode:10s} {p:14s} {res['request_throughput']:8.1f} req/s  "
                           f"p50 {res['median_e2e_latency_ms']:7.3f} ms  "
                           f"p99 {res['p99_e2e_latency_ms']:7.3f} ms  "
                           f"completed {res['completed']}/{n}  ({run['wall_s']:.0f}s)")
                else:
                    msg = (f"round {r} {mode:10s} {p:14s} FAILED rc={run['returncode']}: "
                           f"{run.get('error', '')[-400:]}")
                    rc = 1
                pbar.write(msg)
                pbar.update(1)
    pbar.close()
    return rc


def summarise_routers(doc: dict, paths: list[str], urls: dict[str, str], modes: dict, repeats: int,
                      quick: bool) -> None:
    """The routers' own status after the runs, the summary and its targets, printed."""
    for p in paths:
        if p.startswith("eldr"):
            doc["paths"][p]["after"] = router_status(p, urls[p])
    record_summary(doc, paths, modes, repeats, quick)


def finish(procs: Procs, doc: dict, args: argparse.Namespace, argv: Optional[list[str]], logdir: Path, rc: int,
           t_start: float) -> None:
    """Stop every process, keep crash logs, write the JSON, keep or remove the logs."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    crashed = procs.check_alive()
    if crashed:
        doc["process_exits_before_stop"] = crashed
        for name, _, _ in procs.items:
            if any(c.startswith(name + " ") for c in crashed) and not name.startswith("bench-"):
                doc.setdefault("crash_logs", {})[name] = procs.log_tail(name)
    procs.stop_all()
    doc["wall_s"] = round(time.monotonic() - t_start, 1)
    if args.json and doc["runs"]:
        write_record(args.json, doc, argv, script=__file__)
        print(f"\nwrote {args.json} ({doc['wall_s']:.0f}s in all)")
    if args.keep_logs or rc not in (0, 130):
        print(f"logs kept in {logdir}")
    else:
        import shutil
        shutil.rmtree(logdir, ignore_errors=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    paths, repeats, modes, mode_list = plan_runs(args)

    # SIGTERM -> the same clean exit as Ctrl-C
    def on_term(*_: Any) -> None:
        raise KeyboardInterrupt()
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    logdir = Path(tempfile.mkdtemp(prefix="bench_serving_routers-"))
    procs = Procs(logdir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    t_start = time.monotonic()
    doc = new_doc(argv, repeats, modes, paths, args.quick)
    print(f"cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}; logs in {logdir}")
    for n in doc["notes"]:
        print(f"  note: {n}")
    rc = 0
    try:
        urls = start_processes(procs, paths, logdir, doc, args.start_timeout)
        doc["startup_s"] = round(time.monotonic() - t_start, 1)
        rc = run_rounds(procs, paths, urls, mode_list, repeats, logdir, args.run_timeout, env, doc)
        summarise_routers(doc, paths, urls, modes, repeats, args.quick)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process started", file=sys.stderr)
        doc["interrupted"] = True
        rc = 130
    except (RuntimeError, SystemExit) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        doc["error"] = str(e)
        rc = 2
    finally:
        finish(procs, doc, args, argv, logdir, rc, t_start)
    return rc


def _environment() -> dict:
    from importlib import metadata
    env = {"python": platform.python_version(), "cores": os.cpu_count(),
           "load_average": os.getloadavg(), "platform": platform.platform()}
    try:  # the router code measured
        env["git_head"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                         text=True, timeout=10).stdout.strip()
        env["git_dirty_router"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "--", "eldr_sglang"], cwd=ROOT, capture_output=True,
            text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    for pkg in ("sglang", "sglang-router", "aiohttp", "uvloop"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    return env


if __name__ == "__main__":
    sys.exit(main())
