"""Every kept benchmark script runs its ``--quick`` smoke mode to the end (exit 0), writing under
``ELDR_BENCH_QUICK_OUT`` (here a temporary folder) or its own ``.cache/`` folder, never over
``benchmark/results``.

Scripts that need real SGLang servers answer ``--quick`` with their plan only (arguments
checked, nothing started); ``bench_default_policy.py --quick`` and ``report.py --quick`` also
run in tests/unit/test_sim_report.py with their outputs checked.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

BENCH = ROOT / "benchmark"
PROMPT_TRACES = ROOT / ".cache" / "prompt-traces" / "task" / "calib" / "prompts.jsonl"

# script -> extra arguments that keep the smoke run to seconds (after --quick, so they win)
QUICK = {
    "bench_calibration.py": [],
    "bench_colocated_real.py": [],
    "bench_cost_sensitivity.py": [],
    "bench_decision.py": [],
    "bench_engine_overhead.py": [],
    "bench_fat_expert.py": [],
    "bench_fat_expert_sim.py": [],
    "bench_late_binding.py": [],
    "bench_locality.py": ["--workloads", "task"],
    "bench_long_decodes.py": [],
    "bench_online_refit.py": [],
    "bench_placement.py": [],
    "bench_real_cpu.py": [],
    "bench_replicas.py": ["--workloads", "task"],
    "bench_law_fit.py": ["--workloads", "task"],
    "microbench_moe_layer.py": [],
    "signature_memory.py": [],
    "warm_cold_precision.py": [],
    "bench_state_aware.py": ["--workloads", "task", "--rates", "20", "--seeds", "1", "--warmup-s", "1",
                             "--measure-s", "2"],
    "report.py": ["--workloads", "task", "--skip-microbench"],
}
# smoke runs that start router, stub and bench_serving processes (minutes on 2 cores)
PROCESSES = {"bench_burst.py": [], "bench_serving_routers.py": ["--paths", "eldr,direct"],
             "bench_router_cpu.py": []}
SLOW = {"bench_online.py": [],  # its --quick replays 2,000 arrivals per scenario: about 3 min on 2 cores
        "bench_integrations.py": [],  # starts SMG + stub worker + pre-router processes (about 1 min)
        "bench_dynamo_prefill.py": [],  # Dynamo frontend + 4 mockers (about 10 s; records a skip without Dynamo)
        "bench_soak.py": [],  # a router process under faults: 25 s warm-up, 20 s measured (about 1 min)
        "bench_signature_attack.py": []}  # a router process and an attacker process: 2 x 20 s (about 1 min)
NEEDS_PROMPT_TRACES = {"bench_predicted_signatures.py": ["--workloads", "task", "--no-sim"]}
COVERED_ELSEWHERE = {"bench_default_policy.py",  # tests/unit/test_sim_report.py runs --quick
                     "render_results.py"}  # tests/unit/test_render_results.py: its pages are current


def run_quick(script: str, extra: list[str], out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "ELDR_BENCH_QUICK_OUT": str(out)}
    module = f"benchmark.{Path(script).stem}"
    return subprocess.run([sys.executable, "-m", module, "--quick", *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def check(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])


@pytest.mark.parametrize("script", sorted(QUICK))
def test_quick_smoke_run(script, tmp_path):
    check(run_quick(script, QUICK[script], tmp_path))


@contextlib.contextmanager
def port_held(port: int):
    """Something else listens on ``port`` (or already did) while the block runs."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # already taken: the condition holds anyway
            s.bind(("0.0.0.0", port))
            s.listen()
        yield


@pytest.mark.sglang
@pytest.mark.parametrize("script", sorted(PROCESSES))
def test_quick_smoke_run_with_processes(script, tmp_path):
    """With sglang-router's default Prometheus port (29000) taken, as by a second
    sglang-router on the machine: the comparison peer must still start."""
    with port_held(29000):
        check(run_quick(script, PROCESSES[script], tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SLOW))
def test_quick_smoke_run_of_minutes(script, tmp_path):
    check(run_quick(script, SLOW[script], tmp_path))


@pytest.mark.skipif(not PROMPT_TRACES.is_file(), reason="needs traces recorded with prompts "
                    "(tools/record_prompt_traces.py on a real SGLang server)")
@pytest.mark.parametrize("script", sorted(NEEDS_PROMPT_TRACES))
def test_quick_smoke_run_on_recorded_prompts(script, tmp_path):
    check(run_quick(script, NEEDS_PROMPT_TRACES[script], tmp_path))


def test_every_kept_benchmark_has_a_smoke_run():
    """A new benchmark script joins one of the lists above (modules it imports are not scripts)."""
    listed = set(QUICK) | set(PROCESSES) | set(SLOW) | set(NEEDS_PROMPT_TRACES) | COVERED_ELSEWHERE
    scripts = {p.name for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text()}
    assert sorted(scripts - listed) == []


def test_quick_runs_write_under_the_quick_folder(tmp_path):
    """--quick of a script that writes by default lands under ELDR_BENCH_QUICK_OUT."""
    check(run_quick("bench_late_binding.py", [], tmp_path))
    assert (tmp_path / "late_binding" / "late_binding.json").is_file()
    assert (tmp_path / "late_binding" / "late_binding.md").is_file()
