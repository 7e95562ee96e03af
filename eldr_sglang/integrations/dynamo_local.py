"""A Dynamo deployment on one machine, loopback only: frontend + mocker workers.

For tests and the benchmark (``ai-dynamo`` 1.6.1 in its own virtualenv, see
``scripts/install_dynamo.sh``): file discovery (a temporary directory), TCP request
plane, ZMQ event plane. No etcd, no NATS.

Confining every socket to 127.0.0.1 takes these settings (read from the 1.6.1 runtime):

* ``DYN_TCP_RPC_HOST=127.0.0.1``: the request-plane server binds and advertises it
  (unset: the host's first interface address is advertised);
* ``DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1``: the frontend's response-stream listener;
* ``--http-host 127.0.0.1`` (``DYN_HTTP_HOST``): the frontend's HTTP server;
* ``DYN_SYSTEM_PORT=-1``: no per-process system status server;
* ``DYN_ZMQ_BROKER_URL="xsub=tcp://127.0.0.1:A , xpub=tcp://127.0.0.1:B"``: the event
  plane through a broker that this module runs bound to 127.0.0.1. Without a broker
  ("direct" mode) every publisher BINDS ``tcp://0.0.0.0:<port>`` (hard-coded in
  1.6.1; ``DYN_EVENT_PLANE_HOST`` only changes the advertised address), so direct
  mode cannot be confined to loopback and is not used here. With the broker, the
  publishers connect to it and listen on nothing.

:meth:`LocalDynamo.start` checks every listening socket of every process it started
(psutil) and every address advertised in discovery, and stops them all if one is
outside 127.0.0.0/8.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = ROOT / ".cache" / "dynamo-venv"
BROKER = """
import sys, zmq
ctx = zmq.Context()
xsub = ctx.socket(zmq.XSUB); xsub.bind("tcp://127.0.0.1:%s" % sys.argv[1])
xpub = ctx.socket(zmq.XPUB); xpub.bind("tcp://127.0.0.1:%s" % sys.argv[2])
print("broker ready", flush=True)
zmq.proxy(xsub, xpub)
"""


def dynamo_python() -> Path:
    """The interpreter of the Dynamo virtualenv: ``ELDR_DYNAMO_PYTHON``, else the venv
    ``ELDR_DYNAMO_VENV`` (as scripts/install_dynamo.sh), else .cache/dynamo-venv."""
    env = os.environ.get("ELDR_DYNAMO_PYTHON")
    if env:
        return Path(env)
    return Path(os.environ.get("ELDR_DYNAMO_VENV") or DEFAULT_VENV) / "bin" / "python"


def dynamo_importable(python: Optional[Path] = None) -> tuple[bool, str]:
    """(True, version) when ``python`` imports dynamo's frontend and mocker; (False, why)."""
    py = python or dynamo_python()
    if not py.exists():
        return False, f"{py} does not exist (run scripts/install_dynamo.sh)"
    r = subprocess.run([str(py), "-c", "import dynamo.frontend, dynamo.mocker, importlib.metadata as m; "
                        "print(m.version('ai-dynamo'))"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return False, f"{py} cannot import dynamo: {r.stderr.strip().splitlines()[-1:]}"
    return True, r.stdout.strip()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class LocalDynamo:
    """``start()`` a frontend (KV router) + 1 prefill + N decode mockers; ``stop()`` all."""

    model: str = str(ROOT / "models" / "eldr-tiny-moe")
    n_prefill: int = 1
    n_decode: int = 2
    speedup: float = 10.0
    router_mode: str = "kv"
    frontend_args: Sequence[str] = ()  # extra flags of dynamo.frontend (e.g. busy thresholds)
    mocker_args: Sequence[str] = ()  # extra flags of every dynamo.mocker (e.g. --num-gpu-blocks-override)
    python: Path = field(default_factory=dynamo_python)
    log_dir: Optional[Path] = None
    procs: dict[str, Proc] = field(default_factory=dict)
    url: str = ""
    model_name: str = ""

    def env(self) -> dict[str, str]:
        e = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
        e.update(DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=str(self.kv_dir), DYN_REQUEST_PLANE="tcp",
                 DYN_EVENT_PLANE="zmq", DYN_TCP_RPC_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
                 DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_HTTP_HOST="127.0.0.1", DYN_SYSTEM_HOST="127.0.0.1",
                 DYN_SYSTEM_PORT="-1", DYN_SELF_HOST_METADATA="0",
                 DYN_ZMQ_BROKER_URL=f"xsub=tcp://127.0.0.1:{self.xsub} , xpub=tcp://127.0.0.1:{self.xpub}",
                 HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DYN_LOG="warn",
                 OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        return e

    def _spawn(self, name: str, argv: Sequence[str]) -> Proc:
        log = self.log_dir / f"{name}.log"
        p = subprocess.Popen(list(argv), stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=self.env(),
                             cwd=str(ROOT), start_new_session=True)
        proc = Proc(name, p, log)
        self.procs[name] = proc
        return proc

    def start(self, timeout: float = 180.0) -> "LocalDynamo":
        self.tmp = Path(tempfile.mkdtemp(prefix="eldr-dynamo-"))
        self.kv_dir = self.tmp / "discovery"
        self.kv_dir.mkdir()
        self.log_dir = Path(self.log_dir or self.tmp)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.xsub, self.xpub, port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        py = str(self.python)
        try:
            self._spawn("broker", [py, "-c", BROKER, str(self.xsub), str(self.xpub)])
            self._spawn("frontend", [py, "-m", "dynamo.frontend", "--router-mode", self.router_mode,
                                     "--http-host", "127.0.0.1", "--http-port", str(port), *self.frontend_args])
            mock = [py, "-m", "dynamo.mocker", "--model-path", self.model, "--speedup-ratio", str(self.speedup),
                    *self.mocker_args]
            for i in range(self.n_prefill):
                self._spawn(f"prefill{i}", [*mock, "--disaggregation-mode", "prefill"])
            for i in range(self.n_decode):
                self.start_decode(f"decode{i}")
            self.wait_instances(self.n_prefill, self.n_decode, timeout)
            self.check_loopback()
        except BaseException:
            self.stop()
            raise
        return self

    def start_decode(self, name: str) -> Proc:
        return self._spawn(name, [str(self.python), "-m", "dynamo.mocker", "--model-path", self.model,
                                  "--speedup-ratio", str(self.speedup), *self.mocker_args,
                                  "--disaggregation-mode", "decode"])

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
            return json.loads(r.read())

    def instances(self, component: str) -> list[str]:
        try:
            doc = self.health()
        except OSError:
            return []
        return sorted(str(i["instance_id"]) for i in doc.get("instances", [])
                      if i.get("component") == component and i.get("endpoint") == "generate")

    def wait_instances(self, n_prefill: int, n_decode: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            for p in self.procs.values():
                if p.popen.poll() is not None:
                    raise RuntimeError(f"dynamo {p.name} exited ({p.popen.returncode}):\n{p.tail()}")
            if len(self.instances("prefill")) == n_prefill and len(self.instances("backend")) == n_decode:
                try:
                    with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                        models = json.loads(r.read()).get("data", [])
                except OSError:
                    models = []
                if models:
                    self.model_name = models[0]["id"]
                    return
            if time.monotonic() > end:
                raise TimeoutError(f"dynamo: {n_prefill} prefill + {n_decode} decode instances not listed "
                                   f"after {timeout:g} s:\n{self.procs['frontend'].tail()}")
            time.sleep(0.25)

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.procs.values() if p.popen.poll() is None]

    def advertised_addresses(self) -> set[str]:
        """Every IPv4 address (host:port) written to file discovery (instances, event sources)."""
        found: set[str] = set()
        for path in self.kv_dir.rglob("*"):
            if path.is_file():
                found.update(re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b", path.read_text(errors="replace")))
        return found

    def check_loopback(self) -> None:
        """Every listening socket of every process started here is on loopback, and so is every
        address they advertised in discovery; else stop them all."""
        bad = non_loopback_listeners(self.pids())
        adv = sorted(a for a in self.advertised_addresses() if not a.startswith("127."))
        if bad or adv:
            self.stop()
            raise RuntimeError(f"dynamo processes listen or advertise outside loopback (stopped): {bad} {adv}")

    def stop_process(self, name: str, sig: int = signal.SIGTERM, wait: float = 15.0) -> None:
        p = self.procs.pop(name)
        if p.popen.poll() is None:
            try:
                os.killpg(p.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                p.popen.wait(wait)
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait(5)

    def stop(self) -> None:
        for name in [n for n in self.procs if n != "broker"] + (["broker"] if "broker" in self.procs else []):
            self.stop_process(name, wait=10.0)
        if getattr(self, "tmp", None) and self.log_dir != self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "LocalDynamo":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def non_loopback_listeners(pids: Sequence[int]) -> list[tuple[int, str]]:
    """Listening sockets of ``pids`` (and children) bound outside 127.0.0.0/8 and ::1."""
    import psutil

    bad = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                conns = p.net_connections(kind="inet")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            for c in conns:
                if c.status in (psutil.CONN_LISTEN, psutil.CONN_NONE) and c.laddr:
                    ip = c.laddr.ip
                    if not (ip.startswith("127.") or ip == "::1"):
                        bad.append((p.pid, f"{ip}:{c.laddr.port}"))
    return bad


if __name__ == "__main__":  # a quick manual run: start, print the frontend URL, wait for Ctrl-C
    with LocalDynamo() as d:
        print(d.url, d.model_name, "decode:", d.instances("backend"), "prefill:", d.instances("prefill"),
              flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            sys.exit(0)
