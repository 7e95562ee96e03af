"""benchmark.process_cpu: CPU per request with the idle rate over the client's start-up taken off."""

from __future__ import annotations

import os

import pytest

from benchmark.process_cpu import cpu_seconds, per_request


def test_per_request_takes_the_idle_rate_over_the_quiet_time_off_the_user_time():
    before = {"router": (10.0, 2.0), "stub": (1.0, 1.0)}
    after = {"router": (10.5, 2.1), "stub": (1.2, 1.0)}
    # 20 s around the run, 2 s of it serving: 18 s at the router's idle 0.01 CPU-s/s
    out = per_request(before, after, {"router": 0.01}, wall_s=20.0, duration_s=2.0, requests=1000)
    assert out["router"] == {"user_us": pytest.approx(320.0), "system_us": pytest.approx(100.0),
                             "total_us": pytest.approx(420.0)}
    assert out["stub"]["user_us"] == pytest.approx(200.0)  # no idle rate known: nothing taken off
    # an idle rate that over-explains the CPU never gives a negative figure
    low = per_request(before, after, {"router": 1.0}, wall_s=20.0, duration_s=2.0, requests=1000)
    assert low["router"]["user_us"] == 0.0
    assert per_request(before, after, {}, 1.0, 1.0, 0) == {}


def test_cpu_seconds_follow_the_process_and_a_gone_process_is_zero():
    u0, s0 = cpu_seconds(os.getpid())
    x = 0
    while sum(cpu_seconds(os.getpid())) <= u0 + s0 + 0.05:  # spin until the counters move
        x += sum(range(1000))
    u1, s1 = cpu_seconds(os.getpid())
    assert u1 + s1 > u0 + s0
    assert cpu_seconds(2 ** 22 + 12345) == (0.0, 0.0)  # above the kernel's PID_MAX_LIMIT: never a process
