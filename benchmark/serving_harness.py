"""The local processes a stub-cluster serving benchmark drives, and how it probes them.

Stub workers (``python -m eldr_sglang.testing.stub_worker``) and their toy calibration artifact,
``Procs`` (every process its own group, logs in one folder, all ended on exit), readiness and
stream probes, one unmodified ``python -m sglang.bench_serving`` run, and the ELDR router's own
counters afterwards. Used by ``bench_serving_routers.py`` and ``bench_router_cpu.py``.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

from eldr_sglang.router.metrics import histogram_quantiles
from eldr_sglang.testing.toy_artifact import save_toy_artifact

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TOKENIZER = "models/eldr-tiny-moe"
N_DECODES = 4
BOOTSTRAP_PORT = "8998"
STREAM_CHUNKS = 4  # = --random-output-len: one chunk per output token


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
        """Start ``cmd`` in its own session (so its own process group), output to ``<logdir>/<name>.log``."""
        log = open(self.logdir / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, cwd=cwd or ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_child_setup)
        self.items.append((name, proc, log))
        return proc

    def log_tail(self, name: str, n: int = 3000) -> str:
        """The last ``n`` characters of process ``name``'s log ("" if there is none)."""
        try:
            return (self.logdir / f"{name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def check_alive(self) -> list[str]:
        """``"<name> exited with <code>"`` for every process that has ended."""
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


def http_json(method: str, url: str, body: Optional[dict] = None, timeout: float = 5.0) -> tuple[int, bytes]:
    """(HTTP status, raw body) of one JSON request; HTTP errors raise ``urllib.error.HTTPError``."""
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
    """The command of one stub worker (``role``: prefill or decode) on 127.0.0.1:``port``."""
    return [PY, "-m", "eldr_sglang.testing.stub_worker", "--role", role, "--name", name, "--host", "127.0.0.1",
            "--port", str(port), "--stream-chunks", str(STREAM_CHUNKS)]


# ------------------------------------------------------------------ bench_serving
def bench_cmd(url: str, conc: int, prompts: int, out_file: str) -> list[str]:
    """The unmodified bench_serving command line (flags as sglang 0.5.23 takes them)."""
    return [PY, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
            "--dataset-name", "random-ids", "--random-input-len", "32", "--random-output-len", "4",
            "--random-range-ratio", "1.0", "--num-prompts", str(prompts), "--request-rate", "inf",
            "--max-concurrency", str(conc), "--tokenizer", TOKENIZER, "--output-file", out_file,
            "--output-details", "--disable-tqdm"]


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
