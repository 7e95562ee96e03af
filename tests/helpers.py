"""Helpers shared by the test packages and ``tests/conftest.py``: the repository root
(benchmark/ and tools/ are packages there: ``from benchmark import report``), waiting for a
condition (``until``, ``wait_until``), and the real-server session state (log
folder, started processes, greedy generation, bench_serving)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from eldr_sglang.testing import local_cluster as lc
from eldr_sglang.testing.local_cluster import http_json

ROOT = Path(__file__).resolve().parents[1]
LOG_DIR = Path(os.environ.get("ELDR_TEST_LOGS", ROOT / ".cache" / "test-logs"))

#: every server and router process the session started (killed at the end; their
#: log tails are attached to failing tests' reports)
started: list[lc.ManagedProcess] = []

#: layers the shared cluster's test artifact (and the single server) capture
TEST_ARTIFACT_LAYERS = [1, 3]
GREEDY_NEW_TOKENS = 12


async def until(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 30.0,
                what: str = "condition", step: float = 0.02) -> None:
    """Wait until ``predicate()`` (plain or async) is true, polling every ``step`` s on the
    running loop; ``AssertionError`` naming ``what`` after ``timeout`` s."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        ok = predicate()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return
        if loop.time() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(step)


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition",
               step: float = 0.01) -> None:
    """:func:`until` for code outside an event loop (blocks this thread)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(step)


def processes_marked(variable: str, marker: str) -> set[int]:
    """Processes whose environment carries ``variable=marker``: the descendants of a process
    started with it (they inherit it), never processes someone else started meanwhile."""
    needle = f"{variable}={marker}".encode()
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    out.add(int(d.name))
            except OSError:
                continue
    return out


def progress(name: str, elapsed: float) -> None:
    if int(elapsed) % 15 == 0:
        sys.stderr.write(f"[fixtures] waiting for {name}: {elapsed:.0f}s\n")


@contextlib.contextmanager
def serving(spec: lc.ServerSpec, name: str) -> Iterator[lc.ManagedProcess]:
    """A real SGLang server for the block: started until ready (logs under ``LOG_DIR``),
    listed in ``started`` (so the session tears it down and reports its log tail), stopped
    on leaving the block."""
    proc = lc.start_server_ready(spec, LOG_DIR, name, progress=progress)
    started.append(proc)
    try:
        yield proc
    finally:
        proc.stop()


def post_ignoring_errors(url: str, body: dict, timeout: float = 120.0) -> None:
    """POST ``body`` as JSON and read the answer, whatever it is: a prefill server with no
    decode server to take its KV answers an error once the transfer gives up."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=timeout).read()
    except OSError:
        pass


def greedy_generate(url: str, prompt: str, max_new_tokens: int = GREEDY_NEW_TOKENS) -> list[int]:
    """Greedy token ids from an SGLang-compatible ``/generate`` endpoint."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                "temperature": 0, "ignore_eos": True}}
    return http_json(url + "/generate", body, timeout=120)["output_ids"]


def run_bench_serving(base_url: str, model: Path, out: Path, num_prompts: int,
                      input_len: int = 64, output_len: int = 16) -> dict:
    """``python -m sglang.bench_serving --dataset-name random-ids`` against
    ``base_url``; returns its result record (asserts the command succeeded)."""
    cmd = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
        "--base-url", base_url, "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random-ids", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
        "--request-rate", "inf", "--max-concurrency", "4", "--output-file", str(out),
        "--disable-tqdm",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text().splitlines()[-1])
