"""tools/gpu_check.py, the one GPU check: its CPU dry run with torch alone (SGLang, numpy,
orjson, aiohttp refused at import), that each of its comparisons can fail, and the real
run on a GPU (marker ``gpu``, skipped without CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT

REFUSED = ("sglang", "numpy", "orjson", "aiohttp", "scipy", "sklearn")

#: ``python -m tools.gpu_check ARGS`` from the repository root, as on the GPU machine, with
#: the packages that machine lacks absent: ``None`` in ``sys.modules`` makes ``import numpy``
#: raise ModuleNotFoundError and ``importlib.util.find_spec('numpy')`` answer None, as for a
#: package that is not installed (torch itself asks find_spec; a finder that raised would
#: break torch where a missing package does not)
RUN_REFUSING = """
import runpy, sys
REFUSED = {refused!r}
for name in REFUSED:
    sys.modules[name] = None
sys.argv = ['gpu_check', *{args!r}]
try:
    runpy.run_module('tools.gpu_check', run_name='__main__', alter_sys=True)
finally:
    print('IMPORTED', sorted(m for m in sys.modules if m.split('.')[0] in REFUSED and sys.modules[m] is not None))
"""


def run_check(args: list[str], env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    code = RUN_REFUSING.format(refused=REFUSED, args=args)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_the_dry_run_passes_every_check_with_torch_alone(tmp_path):
    """The command of the GPU machine, on CPU: the replay stand-in for the graphs, small shapes,
    graph path and eager path bit for bit equal, and equal to the reference."""
    out = tmp_path / "gpu_check.json"
    proc = run_check(["--out", str(out)], env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "IMPORTED []" in proc.stdout  # the stand-in sglang modules were taken out again
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["mode"] == "cpu dry run" and doc["torch"] == torch.__version__
    names = [c["name"] for c in doc["checks"]]
    scenarios = ["plain", "dp_rank2_table", "dp_rank0_stats", "eplb_rebalance", "trace_decode_counts"]
    for shape in ("small", "small-deep"):
        assert [n for n in names if n.startswith(f"hooks/{shape}/")] == [f"hooks/{shape}/{s}" for s in scenarios]
    assert "hook_cost/small" in names and sum(n.startswith("microbench/") for n in names) == 2
    for check in doc["checks"]:
        assert check["ok"] is True, check
        if check["name"].startswith("hooks/"):
            comparisons = check["details"]["comparisons"]
            assert sum(k.endswith("graph == eager") for k in comparisons) >= 3
            assert sum(k.endswith("== reference") for k in comparisons) >= 3
            assert check["details"]["replays"]["decode"] == 9


def _small(name: str):
    from tools import gpu_check as gc

    return gc, next(s for s in gc.SCENARIOS if s.name == name)


@pytest.mark.parametrize("scenario, broken, failing", [
    # the rank's block taken at the wrong offset of the DP gather
    ("dp_rank2_table", ("local_block", lambda blocks, rank, n: blocks[0]), "table: == reference"),
    # a decode replay read as the eager (max-length) layout: padding rows counted
    ("dp_rank0_stats", ("graph_batch", lambda *a: None), "unique_per_step: graph == eager"),
    # physical slots left unmapped
    ("eplb_rebalance", ("physical_to_logical", lambda ids, layers, n: ids), "RuntimeError"),
])
def test_a_broken_after_forward_fails_the_check(monkeypatch, scenario, broken, failing):
    """A failed comparison, or (physical slots beyond the logical experts in the table) an error."""
    gc, scn = _small(scenario)
    from eldr_sglang.patches import after_forward

    monkeypatch.setattr(after_forward, *broken)
    check = gc.attempt(scenario, gc.hooks_check, gc.SMALL, scn, torch.device("cpu"), 0)
    assert check["ok"] is False
    if "error" in check:
        assert check["error"].startswith(failing), check["error"]
    else:
        assert check["details"]["comparisons"][failing] is False


def test_stale_eplb_metadata_after_a_rebalance_fails_the_check(monkeypatch):
    """The rebalance rewrites the dispatch inside the live graphs; mapping back with the old
    physical -> logical map miscounts."""
    gc, scn = _small("eplb_rebalance")
    real = gc.Eplb.rebalance

    def dispatch_only(self):  # the first call builds both maps, later ones keep the old p2l
        old = self.p2l.clone()
        real(self)
        if getattr(self, "built", False):
            self.p2l.copy_(old)
        self.built = True

    monkeypatch.setattr(gc.Eplb, "rebalance", dispatch_only)
    comparisons = gc.hooks_check(gc.SMALL, scn, torch.device("cpu"), 0)["details"]["comparisons"]
    assert comparisons["counts: == reference"] is False and comparisons["unique_per_step: == reference"] is False
    assert comparisons["counts: graph == eager"] is True  # both runs equally wrong: only the reference tells


def test_a_scatter_that_drops_a_row_fails_the_check(monkeypatch):
    gc, scn = _small("plain")
    from eldr_sglang.patches import after_forward

    real = after_forward.scatter_rows
    monkeypatch.setattr(after_forward, "scatter_rows", lambda t, s, r, c=None: real(t, s[:-1], r[:-1], c))
    comparisons = gc.hooks_check(gc.SMALL, scn, torch.device("cpu"), 0)["details"]["comparisons"]
    assert comparisons["table: == reference"] is False and comparisons["counts: == reference"] is False


def test_a_host_sync_inside_the_graphed_hook_fails_the_check(monkeypatch):
    """The replay stand-in refuses ``.item()`` at capture; the hook logs it once and carries on
    (as in a server), and the check reports the failed hook."""
    gc, scn = _small("plain")
    from eldr_sglang.patches import capture

    real = capture.stage_ids
    monkeypatch.setattr(capture, "stage_ids", lambda state, layer, ids, d: (ids.sum().item(), real(state, layer, ids, d)))
    check = gc.hooks_check(gc.SMALL, scn, torch.device("cpu"), 0)
    assert check["ok"] is False and check["details"]["comparisons"]["no hook failed, state ready"] is False
    assert "select_experts capture" in check["details"]["failed_hooks"]


def test_signatures_are_the_routers():
    """The check's torch signature is ``core.signature.signature_from_counts`` (the router's)."""
    import numpy as np

    from eldr_sglang.core.signature import signature_from_counts
    from tools.gpu_check import signatures

    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 40, (5, 3, 16), generator=gen)
    counts[2] = 0
    idf = 1.0 + torch.rand((3, 16), generator=gen)
    ours = signatures(counts, idf).numpy()
    theirs = np.stack([signature_from_counts(c.numpy(), idf.numpy()) for c in counts])
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    assert not ours[2].any()


def test_the_make_target_runs_the_command():
    make = (ROOT / "Makefile").read_text()
    assert "\ngpu-check:" in make and "-m tools.gpu_check --out" in make


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU")
def test_the_real_check_on_a_gpu(tmp_path):
    """The real run: CUDA graphs, Qwen3 shapes, at most the 10 minutes of a lent GPU."""
    out = tmp_path / "gpu_check.json"
    proc = run_check(["--out", str(out)], timeout=660)
    doc = json.loads(out.read_text())
    failed = [c for c in doc["checks"] if c.get("ok") is False]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert doc["mode"] == "gpu" and doc["graphs"] == "torch.cuda.CUDAGraph"
