"""A router (or any server) run as a process by a benchmark: started with its log and a
client session, waited for until it answers, stopped (SIGTERM, then kill)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

import aiohttp

ROOT = Path(__file__).resolve().parents[1]


async def wait_up(http: aiohttp.ClientSession, url: str, *, path: str = "/ready",
                  proc: Optional[subprocess.Popen] = None, timeout: float = 60.0, step: float = 0.2) -> bool:
    """Whether ``url + path`` answered 200 within ``timeout`` s (False at once if ``proc`` exits)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and (proc is None or proc.poll() is None):
        try:
            async with http.get(url + path) as r:
                if r.status == 200:
                    return True
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(step)
    return False


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM, then kill after ``timeout`` s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RouterProcess:
    """``python -m eldr_sglang.router ARGV`` on 127.0.0.1:``port``, logging to ``tmp``/router.log."""

    def __init__(self, argv: Sequence[str], port: int, tmp: Path) -> None:
        self.log_path = tmp / "router.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(list(argv), stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.url = f"http://127.0.0.1:{port}"
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def ready(self, timeout: float = 60.0) -> None:
        if not await wait_up(self.http, self.url, proc=self.proc, timeout=timeout):
            raise SystemExit(f"router did not become ready; see {self.log_path}")

    async def close(self) -> None:
        await self.http.close()
        stop(self.proc)
        self.log.close()
