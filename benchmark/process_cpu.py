"""CPU time of the processes a serving benchmark starts, per request it served.

A benchmark run's wall time includes the client's start-up (bench_serving imports for
~14 s), while routers keep polling their workers, so the CPU a process spends around a
run is its CPU while serving plus its idle rate times the time nothing was sent:

    per request = (CPU(after) - CPU(before) - idle rate * (wall - duration)) / requests

with ``duration`` the client's own measured time. :func:`idle_rates` measures each
process's idle rate over a quiet window before the runs. User and system time are kept
apart: a router in Python and one in Rust pay about the same system time for the same
socket work, so the user time is where they differ.
"""

from __future__ import annotations

import time

import psutil


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` and its live children (a router's
    ``--workers`` processes); (0, 0) for a process that is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, 0.0
    user = system = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        user += t.user
        system += t.system
    return user, system


def snapshot(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    """{name: (user, system)} of every process now."""
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def idle_rates(pids: dict[str, int], seconds: float = 5.0) -> dict[str, float]:
    """{name: CPU seconds per second} of each process over ``seconds`` with no load."""
    before, t0 = snapshot(pids), time.monotonic()
    time.sleep(seconds)
    after, wall = snapshot(pids), time.monotonic() - t0
    return {n: max(0.0, sum(after[n]) - sum(before[n])) / wall for n in pids}


def per_request(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                idle: dict[str, float], wall_s: float, duration_s: float, requests: int
                ) -> dict[str, dict[str, float]]:
    """{name: {"user_us", "system_us", "total_us"}} per request served, the idle rate over
    the time the client was not sending (``wall_s - duration_s``) taken off the user time
    (a poll loop is user time, mostly)."""
    out: dict[str, dict[str, float]] = {}
    if requests <= 0:
        return out
    quiet = max(0.0, wall_s - duration_s)
    for n in before:
        user = after[n][0] - before[n][0] - idle.get(n, 0.0) * quiet
        system = after[n][1] - before[n][1]
        out[n] = {"user_us": round(max(0.0, user) / requests * 1e6, 1),
                  "system_us": round(system / requests * 1e6, 1),
                  "total_us": round((max(0.0, user) + system) / requests * 1e6, 1)}
    return out
