"""Start real SGLang servers (and a router in front of them) as local processes.

Used by the test fixtures, the demo and the end-to-end benchmarks. Every
process gets its own log file and process group; ``stop()`` kills the whole
group, so no scheduler or detokenizer child outlives a failed test.

On a CPU-only machine the servers run with SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native``);
where CUDA is present the same code starts normal GPU servers.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eldr_sglang.patches.cpu_compat import cuda_available
from eldr_sglang.router.state.ab import parse_prometheus

#: KV slots per CPU server: bounds the memory SGLang reserves (it otherwise
#: sizes the pool from the machine's free RAM).
CPU_MAX_TOTAL_TOKENS = 16384


CPU_SIGNATURE_TIMEOUT = 60.0  # seconds: CPU prefills queue for seconds under the demo's load


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sglang_router_argv(port: int, *args: str) -> list[str]:
    """``python -m sglang_router.launch_router`` on 127.0.0.1:``port`` followed by ``args``.

    Its Prometheus exporter gets a free loopback port of its own: left at the default
    (0.0.0.0:29000) a second sglang-router on the machine, or anything else holding
    29000, makes it exit with status 1 at start."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), *args]


@functools.lru_cache(maxsize=None)
def on_cpu() -> bool:
    return not cuda_available()


def http_json(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    """GET (body None) or POST JSON; return the decoded JSON response."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def flush_cache(server_url: str) -> None:
    """Empty an SGLang server's prefix cache (``POST /flush_cache``)."""
    req = urllib.request.Request(server_url + "/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()


@dataclass
class ManagedProcess:
    """A child process in its own process group, with a log file."""

    name: str
    argv: list[str]
    log_path: Path
    url: str
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0

    def start(self) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(
        self,
        path: str = "/health",
        timeout: float = 300.0,
        progress: Callable[[str, float], None] | None = None,
    ) -> float:
        """Poll ``url + path`` until HTTP 200; return seconds since start."""
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - self.started_at
            except (urllib.error.URLError, OSError, TimeoutError):
                pass
            if progress:
                progress(self.name, time.monotonic() - self.started_at)
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(
            f"{self.name} not ready after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class ServerSpec:
    """One SGLang server: role is "single", "prefill" or "decode"."""

    model_path: str
    role: str = "single"
    port: int = 0
    bootstrap_port: int = 0
    nccl_port: int = 0
    eldr_metrics_port: int = 0  # ELDR plugin's Prometheus endpoint (0: off)
    late_binding: bool = True
    max_total_tokens: int = CPU_MAX_TOTAL_TOKENS
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    cpus: str = ""  # pin the server to these cores (taskset -c list; "" = not pinned)

    def argv(self, host: str = "127.0.0.1") -> list[str]:
        args = (["taskset", "-c", self.cpus] if self.cpus else []) + [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--host", host, "--port", str(self.port),
            "--nccl-port", str(self.nccl_port),
            "--max-total-tokens", str(self.max_total_tokens),
            "--skip-server-warmup",
            "--log-level", "info",
        ]
        if on_cpu():
            args += ["--device", "cpu", "--attention-backend", "torch_native"]
        if self.role in ("prefill", "decode"):
            args += [
                "--disaggregation-mode", self.role,
                "--disaggregation-transfer-backend", "mooncake_tcp" if on_cpu() else "mooncake",
            ]
            if self.late_binding:
                args += ["--disaggregation-decode-allocation-policy", "prefill_complete"]
        if self.role == "prefill":
            args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if self.eldr_metrics_port:
            args += ["--eldr-metrics-port", str(self.eldr_metrics_port)]
        if self.role == "decode" and on_cpu():
            args += ["--disaggregation-decode-retraction-backup", "none"]
        return args + list(self.extra_args)


def scrape_metrics(port: int) -> dict[str, float]:
    """Each sample name of a Prometheus endpoint, summed over its label sets."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return parse_prometheus(resp.read().decode())


def start_server(spec: ServerSpec, log_dir: Path, name: str | None = None) -> ManagedProcess:
    spec.port = spec.port or free_port()
    spec.nccl_port = spec.nccl_port or free_port()
    if spec.role == "prefill":
        spec.bootstrap_port = spec.bootstrap_port or free_port()
    env = {"SGLANG_USE_CPU_ENGINE": "1"} if on_cpu() else {}
    name = name or f"{spec.role}-{spec.port}"
    return ManagedProcess(
        name=name,
        argv=spec.argv(),
        log_path=log_dir / f"{name}.log",
        url=f"http://127.0.0.1:{spec.port}",
        env={**env, **spec.env},
    ).start()


def port_clash(proc: ManagedProcess) -> bool:
    """The server died because a port it was given got taken first (``free_port``
    hands out ports that outgoing connections may grab before the server binds)."""
    tail = proc.log_tail(200)
    return not proc.alive() and ("address already in use" in tail or "EADDRINUSE" in tail)


def start_server_ready(spec: ServerSpec, log_dir: Path, name: str, timeout: float = 420.0,
                       progress: Callable[[str, float], None] | None = None,
                       attempts: int = 3) -> ManagedProcess:
    """:func:`start_server` and wait until ready; on a port clash, again with fresh ports."""
    for attempt in range(1, attempts + 1):
        proc = start_server(spec, log_dir, name)
        try:
            proc.wait_ready(timeout=timeout, progress=progress)
            return proc
        except BaseException as e:  # Ctrl-C included: never leave the server behind
            retry = isinstance(e, RuntimeError) and attempt < attempts and port_clash(proc)
            proc.stop()
            if not retry:
                raise
        print(f"{name}: a port was taken before the server bound it; retrying with fresh ports",
              file=sys.stderr, flush=True)
        spec.port = spec.nccl_port = spec.bootstrap_port = 0
        if spec.eldr_metrics_port:
            spec.eldr_metrics_port = free_port()
    raise ValueError(f"attempts must be >= 1, got {attempts}")


@dataclass
class PDCluster:
    """1..n prefill servers + 1..m decode servers (no router)."""

    prefills: list[tuple[ManagedProcess, ServerSpec]]
    decodes: list[tuple[ManagedProcess, ServerSpec]]

    @property
    def processes(self) -> list[ManagedProcess]:
        return [p for p, _ in self.prefills + self.decodes]

    def stop(self) -> None:
        for p in self.processes:
            p.stop()


def start_pd_cluster(
    model_path: str,
    log_dir: Path,
    n_prefill: int = 1,
    n_decode: int = 1,
    late_binding: bool = True,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    eldr_metrics: bool = False,
    env: dict[str, str] | None = None,
    progress: Callable[[str, float], None] | None = None,
    timeout: float = 420.0,
    prefill_cpus: str = "",
    decode_cpus: Sequence[str] = (),
) -> PDCluster:
    """Start the servers one after another (each waits until ready: on two
    cores concurrent start-ups only contend); stop all on any failure.

    ``decode_cpus``: decode server i is pinned to ``decode_cpus[i % len]`` (taskset -c
    lists, e.g. ``["0", "1"]``); ``prefill_cpus`` pins every prefill server."""
    cluster = PDCluster([], [])
    roles = [("prefill", i, prefill_args, prefill_cpus) for i in range(n_prefill)]
    roles += [("decode", i, decode_args, decode_cpus[i % len(decode_cpus)] if decode_cpus else "")
              for i in range(n_decode)]
    try:
        for role, i, extra, cpus in roles:
            spec = ServerSpec(model_path, role, late_binding=late_binding, extra_args=extra,
                              eldr_metrics_port=free_port() if eldr_metrics else 0, env=dict(env or {}),
                              cpus=cpus)
            proc = start_server_ready(spec, log_dir, f"{role}-{i}", timeout, progress)
            (cluster.prefills if role == "prefill" else cluster.decodes).append((proc, spec))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def start_sglang_router(
    cluster: PDCluster, log_dir: Path, policy: str = "round_robin", port: int = 0
) -> ManagedProcess:
    """sglang-router (the Rust PD gateway) in front of ``cluster``."""
    port = port or free_port()
    argv = sglang_router_argv(port, "--pd-disaggregation", "--policy", policy)
    for proc, spec in cluster.prefills:
        argv += ["--prefill", proc.url, str(spec.bootstrap_port)]
    for proc, _ in cluster.decodes:
        argv += ["--decode", proc.url]
    return ManagedProcess("sglang-router", argv, log_dir / "sglang-router.log",
                          f"http://127.0.0.1:{port}").start()


def start_eldr_router(
    cluster: PDCluster, log_dir: Path, policy: str = "eldr", artifact: str | Path | None = None,
    port: int = 0, extra_args: Sequence[str] = (),
) -> ManagedProcess:
    """The ELDR router (``python -m eldr_sglang.router``) in front of ``cluster``.

    A CPU prefill under load takes seconds before its signature exists, so the
    signature wait's ceiling is raised to ``CPU_SIGNATURE_TIMEOUT`` (``extra_args``
    may override it)."""
    port = port or free_port()
    argv = [sys.executable, "-m", "eldr_sglang.router", "--host", "127.0.0.1",
            "--port", str(port), "--policy", policy, "--signature-timeout", str(CPU_SIGNATURE_TIMEOUT),
            "--health-timeout", "10"]  # a busy CPU server answers /health late
    if artifact is not None:
        argv += ["--calibration", str(artifact)]
    for proc, spec in cluster.prefills:
        argv += ["--prefill", proc.url, str(spec.bootstrap_port)]
    for proc, _ in cluster.decodes:
        argv += ["--decode", proc.url]
    return ManagedProcess(f"eldr-router-{policy}", argv + list(extra_args),
                          log_dir / f"eldr-router-{policy}.log", f"http://127.0.0.1:{port}").start()


def start_eldr_router_ready(cluster: PDCluster, log_dir: Path, policy: str = "eldr",
                            artifact: str | Path | None = None, extra_args: Sequence[str] = (),
                            timeout: float = 60.0, attempts: int = 3) -> ManagedProcess:
    """:func:`start_eldr_router` on a port picked just now, waited until ready; on a port
    clash (another process took the port first) again with a fresh one."""
    for attempt in range(1, attempts + 1):
        router = start_eldr_router(cluster, log_dir, policy, artifact, free_port(), extra_args)
        try:
            router.wait_ready(timeout=timeout)
            return router
        except BaseException as e:
            retry = isinstance(e, RuntimeError) and attempt < attempts and port_clash(router)
            router.stop()
            if not retry:
                raise
    raise ValueError(f"attempts must be >= 1, got {attempts}")
