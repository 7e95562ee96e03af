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
import collections
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

from benchmark.common import free_port, parse_with_quick, quick_out, write_record
from eldr_sglang.router.metrics import histogram_quantiles
from eldr_sglang.testing.local_cluster import sglang_router_argv
from eldr_sglang.testing.toy_artifact import save_toy_artifact

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TOKENIZER = "models/eldr-tiny-moe"
DEFAULT_JSON = ROOT / "benchmark" / "results" / "bench_serving_routers.json"
ALL_PATHS = ("eldr", "eldr-w2", "eldr-rr", "sglang-router", "direct")
N_DECODES = 4
BOOTSTRAP_PORT = "8998"
STREAM_CHUNKS = 4  # = --random-output-len: one chunk per output token
TARGETS = {"eldr_throughput_ratio": 0.7, "eldr_w2_throughput_ratio": 1.0, "added_p50_ms": 0.5}


# ------------------------------------------------------------------ processes
def _child_setup() -> None:
    """In the child before exec: SIGTERM when this benchmark dies (Linux)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


class Procs:
    """Every process this benchmark starts: own process group each, logs in logdir."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.items: list[tuple[str, subprocess.Popen, Any]] = []

    def start(self, name: str, cmd: list[str], env: Optional[dict] = None,
              cwd: Optional[Path] = None) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, cwd=cwd or ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_child_setup)
        self.items.append((name, proc, log))
        return proc

    def log_tail(self, name: str, n: int = 3000) -> str:
        try:
            return (self.logdir / f"{name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def check_alive(self) -> list[str]:
        return [f"{name} exited with {p.returncode}" for name, p, _ in self.items
                if p.poll() is not None]

    def forget(self, proc: subprocess.Popen) -> None:
        """A process that ended and was reaped: never signal its (reusable) id again."""
        for it in [it for it in self.items if it[1] is proc]:
            self.items.remove(it)
            it[2].close()

    def stop_all(self) -> None:
        """SIGTERM each live process's group, wait up to 10 s, then SIGKILL the groups
        (a router's --workers children are in its group)."""
        items = [it for it in self.items if it[1].poll() is None]
        for it in self.items:
            if it not in items:
                it[2].close()
        self.items = []
        for _, proc, _ in reversed(items):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, proc, _ in reversed(items):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, proc, log in reversed(items):
            _signal_group(proc, signal.SIGKILL)  # the group: --workers children too
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            log.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group this benchmark created for ``proc`` (pgid = its pid)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def http_json(method: str, url: str, body: Optional[dict] = None, timeout: float = 5.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
        return r.status, raw


def wait_generate(name: str, url: str, procs: Procs, proc: subprocess.Popen, timeout: float) -> float:
    """Poll ``POST /generate`` until it answers 200 (sglang-router answers /health
    before its workers are registered); returns seconds waited."""
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{procs.log_tail(name)}")
        try:
            st, raw = http_json("POST", f"{url}/generate",
                                {"text": "warmup topic:1", "sampling_params": {"max_new_tokens": 1}})
            if st == 200:
                return time.monotonic() - t0
            last = f"HTTP {st}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}: {e.read()[:200]!r}"
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(0.25)
    raise RuntimeError(f"{name} ({url}) not routing after {timeout:.0f}s (last: {last})\n"
                       f"{procs.log_tail(name)}")


def preflight_stream(url: str) -> tuple[bool, str]:
    """One streamed /generate as bench_serving's sglang backend sends it; checks every
    chunk carries what the backend reads. Returns (ok, explanation)."""
    body = {"text": "preflight topic:2", "sampling_params": {"temperature": 0.0, "max_new_tokens": 4,
                                                             "ignore_eos": True}, "stream": True}
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        lines = [ln.strip() for ln in r.read().splitlines() if ln.strip()]
    chunks = 0
    for ln in lines:
        data = ln[6:] if ln.startswith(b"data: ") else ln
        if data == b"[DONE]":
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            return False, f"chunk is not JSON: {ln[:200]!r}"
        chunks += 1
        if obj.get("text") and "completion_tokens" not in (obj.get("meta_info") or {}):
            return False, ("a streamed chunk with text has no meta_info.completion_tokens "
                           "(bench_serving's sglang backend does "
                           "output_len = data['meta_info']['completion_tokens'] -> KeyError, "
                           f"every request fails): {ln[:300].decode(errors='replace')}")
    if not chunks:
        return False, f"no data chunk in the stream: {lines[:3]!r}"
    return True, f"{chunks} chunks with meta_info.completion_tokens"


# ------------------------------------------------------------------ setup
def make_artifact(path: Path) -> str:
    """The toy calibration artifact matching the stubs' default layers (0,1) x 8
    experts, 4 clusters = 4 decode servers."""
    return save_toy_artifact(path, N_DECODES)


def stub_cmd(role: str, port: int, name: str) -> list[str]:
    return [PY, "-m", "eldr_sglang.testing.stub_worker", "--role", role, "--name", name, "--host", "127.0.0.1", "--port", str(port),
                   "--stream-chunks", str(STREAM_CHUNKS)]


def router_cmd(name: str, port: int, prefill: str, decodes: list[str], artifact: str) -> list[str]:
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


def bench_cmd(url: str, conc: int, prompts: int, out_file: str) -> list[str]:
    """The unmodified bench_serving command line (flags as sglang 0.5.23 takes them)."""
    return [PY, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
            "--dataset-name", "random-ids", "--random-input-len", "32", "--random-output-len", "4",
            "--random-range-ratio", "1.0", "--num-prompts", str(prompts), "--request-rate", "inf",
            "--max-concurrency", str(conc), "--tokenizer", TOKENIZER, "--output-file", out_file,
            "--output-details", "--disable-tqdm"]


# ------------------------------------------------------------------ runs
SUMMARY_KEYS = ("duration", "completed", "request_throughput", "output_throughput",
                "mean_e2e_latency_ms", "median_e2e_latency_ms", "p90_e2e_latency_ms",
                "p95_e2e_latency_ms", "p99_e2e_latency_ms", "median_ttft_ms", "p99_ttft_ms",
                "concurrency", "max_concurrency", "total_input_tokens", "total_output_tokens")


def run_bench(procs: Procs, cmd: list[str], out_file: Path, timeout: float, env: dict) -> dict:
    """Run bench_serving once; returns its result record (per-request arrays reduced
    to error counts) or the failure."""
    t0 = time.monotonic()
    log_name = f"bench-{out_file.stem}"
    proc = procs.start(log_name, cmd, env=env)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    procs.forget(proc)
    wall = time.monotonic() - t0
    run: dict[str, Any] = {"returncode": rc, "wall_s": round(wall, 2)}
    record = None
    try:
        lines = [ln for ln in out_file.read_text().splitlines() if ln.strip()]
        record = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        pass
    if rc != 0 or record is None or "request_throughput" not in record:
        run["error"] = procs.log_tail(log_name, 2500)
        return run
    errors = [e for e in record.pop("errors", []) if e]
    for k in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts"):
        record.pop(k, None)
    run["failed"] = len(errors)
    if errors:
        run["error_kinds"] = dict(collections.Counter(
            e.strip().splitlines()[-1][:200] for e in errors).most_common(5))
    run["result"] = record
    return run


def router_status(name: str, url: str) -> dict:
    """After the runs: the ELDR router's /eldr/status counters and added-latency metric."""
    out: dict[str, Any] = {}
    try:
        _, raw = http_json("GET", f"{url}/eldr/status")
        st = json.loads(raw)
        out["status"] = {k: st[k] for k in ("counters", "signature_buffer", "policy") if k in st}
    except (urllib.error.URLError, OSError, ValueError) as e:
        out["status_error"] = str(e)
    try:
        _, raw = http_json("GET", f"{url}/metrics")
        text = raw.decode()
        for key, metric in (("added_latency_metric", "eldr_router_added_latency_seconds"),
                            ("signature_wait_metric", "eldr_router_signature_wait_seconds")):
            out[key] = histogram_quantiles(text, metric)
    except (urllib.error.URLError, OSError) as e:
        out["metrics_error"] = str(e)
    return out


# ------------------------------------------------------------------ report
def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _spread(xs: list[float], fmt: str) -> str:
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(_med(xs), fmt)} [{format(min(xs), fmt)}-{format(max(xs), fmt)}]"


def summarize(runs: list[dict], paths: list[str], thr_mode: str, lat_mode: str) -> dict:
    """Per path: medians over repeats; ratio and added latency paired per round."""
    by = collections.defaultdict(dict)  # (mode, path) -> {round: result}
    for r in runs:
        if "result" in r:
            by[(r["mode"], r["path"])][r["round"]] = r["result"]
    out: dict[str, Any] = {}
    for p in paths:
        thr = by[(thr_mode, p)]
        lat = by[(lat_mode, p)]
        s: dict[str, Any] = {
            "request_throughput": [v["request_throughput"] for v in thr.values()],
            "p50_ms": [v["median_e2e_latency_ms"] for v in lat.values()],
            "p99_ms": [v["p99_e2e_latency_ms"] for v in lat.values()],
            "failed": sum(r.get("failed", 0) for r in runs if r["path"] == p),
            "failed_runs": sum(1 for r in runs if r["path"] == p and "result" not in r),
        }
        sg, d = by[(thr_mode, "sglang-router")], by[(lat_mode, "direct")]
        s["ratio_vs_sglang_router"] = [thr[k]["request_throughput"] / sg[k]["request_throughput"]
                                       for k in thr if k in sg and sg[k]["request_throughput"]]
        s["added_p50_ms"] = [lat[k]["median_e2e_latency_ms"] - d[k]["median_e2e_latency_ms"]
                             for k in lat if k in d]
        s["added_p99_ms"] = [lat[k]["p99_e2e_latency_ms"] - d[k]["p99_e2e_latency_ms"]
                             for k in lat if k in d]
        sgl = by[(lat_mode, "sglang-router")]
        s["p50_minus_sglang_router_ms"] = [lat[k]["median_e2e_latency_ms"] - sgl[k]["median_e2e_latency_ms"]
                                           for k in lat if k in sgl]
        s["median"] = {k: _med(s[k]) for k in ("request_throughput", "p50_ms", "p99_ms",
                                               "ratio_vs_sglang_router", "added_p50_ms", "added_p99_ms",
                                               "p50_minus_sglang_router_ms")}
        out[p] = s
    return out


def targets(summary: dict) -> list[dict]:
    rows = []

    def add(what: str, path: str, key: str, goal: float, ge: bool) -> None:
        v = summary.get(path, {}).get("median", {}).get(key, float("nan"))
        met = (v >= goal if ge else v <= goal) if v == v else None
        rows.append({"target": what, "path": path, "value": v, "goal": goal, "met": met})

    add(f"{'eldr'} throughput >= {TARGETS['eldr_throughput_ratio']}x sglang-router", "eldr",
        "ratio_vs_sglang_router", TARGETS["eldr_throughput_ratio"], True)
    add(f"eldr --workers 2 throughput >= {TARGETS['eldr_w2_throughput_ratio']}x sglang-router",
        "eldr-w2", "ratio_vs_sglang_router", TARGETS["eldr_w2_throughput_ratio"], True)
    add(f"eldr added p50 <= {TARGETS['added_p50_ms']} ms (vs direct)", "eldr", "added_p50_ms",
        TARGETS["added_p50_ms"], False)
    add(f"eldr --workers 2 added p50 <= {TARGETS['added_p50_ms']} ms (vs direct)", "eldr-w2",
        "added_p50_ms", TARGETS["added_p50_ms"], False)
    return rows


def print_table(summary: dict, tgt: list[dict], modes: dict, repeats: int, quick: bool) -> None:
    (tm, tc, tn), (lm, lc, ln) = modes["throughput"], modes["latency"]
    print(f"\nbench_serving (unmodified), median over {repeats} repeat(s) [min-max]; "
          f"throughput: {tm} mode (C={tc}, N={tn}); latency: {lm} mode (C={lc}, N={ln})"
          + ("; --quick smoke run: latency under load, not the targets' figures" if quick else ""))
    print("x sglang-rt, +p50/+p99 (vs direct) and p50-sgl (vs sglang-router) are paired per round "
          "(same round's figures), then the median over rounds; failed = failed requests")
    hdr = (f"  {'path':14s} {'req/s':>22s} {'x sglang-rt':>12s} {'p50 ms':>20s} {'p99 ms':>20s} "
           f"{'+p50 ms':>8s} {'+p99 ms':>8s} {'p50-sgl':>8s} {'failed':>6s}")
    print(hdr)
    for p, s in summary.items():
        m = s["median"]
        fr = f"{s['failed']}" + (f"+{s['failed_runs']}run" if s["failed_runs"] else "")
        ratio = f"{m['ratio_vs_sglang_router']:.2f}" if m["ratio_vs_sglang_router"] == m["ratio_vs_sglang_router"] else "n/a"
        a50 = f"{m['added_p50_ms']:+.3f}" if p != "direct" and m["added_p50_ms"] == m["added_p50_ms"] else "-"
        a99 = f"{m['added_p99_ms']:+.3f}" if p != "direct" and m["added_p99_ms"] == m["added_p99_ms"] else "-"
        vs = m["p50_minus_sglang_router_ms"]
        vs = f"{vs:+.3f}" if p != "sglang-router" and vs == vs else "-"
        print(f"  {p:14s} {_spread(s['request_throughput'], '.0f'):>22s} {ratio:>12s} "
              f"{_spread(s['p50_ms'], '.3f'):>20s} {_spread(s['p99_ms'], '.3f'):>20s} "
              f"{a50:>8s} {a99:>8s} {vs:>8s} {fr:>6s}")
    print("targets:")
    for t in tgt:
        v = t["value"]
        verdict = "n/a" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
        print(f"  {t['target']:55s} {v:8.3f}  {verdict}")


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
                run = {"round": r, "mode": mode, "path": p, "concurrency": conc, "prompts": n,
                       "cmd": shlex.join(cmd),
                       **run_bench(procs, cmd, out_file, run_timeout, env)}
                doc["runs"].append(run)
                res = run.get("result")
                if res:
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
    thr_mode, lat_mode = modes["throughput"][0], modes["latency"][0]
    summary = summarize(doc["runs"], paths, thr_mode, lat_mode)
    doc["summary"] = summary
    doc["targets"] = targets(summary)
    print_table(summary, doc["targets"], modes, repeats, quick)
    for p in paths:
        after = doc["paths"][p].get("after")
        if after:
            st = after.get("status", {})
            c = st.get("counters") or {}
            al = after.get("added_latency_metric") or {}
            sw = after.get("signature_wait_metric") or {}
            print(f"  {p} (/eldr/status of one process): requests {c.get('requests')}, decisions "
                  f"{c.get('decisions')}, signatures_used {c.get('signatures_used')}, fallbacks "
                  f"{c.get('fallbacks', 0)}; added-latency metric p50/p99 <= "
                  f"{al.get('p50_le_ms')}/{al.get('p99_le_ms')} ms (n={al.get('count')}, "
                  f"{(al.get('buckets') or {}).get('1e-05')} in the <= 10 us bucket); signature "
                  f"wait p50/p99 <= {sw.get('p50_le_ms')}/{sw.get('p99_le_ms')} ms")


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
