"""tools/gpu_capture_check.py, the prepared GPU check: its dry run on CPU, and that
it needs nothing but torch (the GPU machine has no SGLang, numpy is not assumed)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('sglang', 'numpy', 'orjson', 'aiohttp', 'scipy', 'sklearn'):
            raise ModuleNotFoundError('not on the GPU machine: ' + name)
sys.meta_path.insert(0, Block())
sys.argv = ['gpu_capture_check', '--device', 'cpu', '--no-timing']
import runpy
runpy.run_module('tools.gpu_capture_check', run_name='__main__', alter_sys=True)
"""


def test_the_dry_run_passes_its_checks_with_torch_alone():
    """``python -m tools.gpu_capture_check`` from the repository root, as on the GPU machine."""
    proc = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("OK   ") == 2 and "eager dry run" in proc.stdout


def test_a_wrong_scatter_fails_the_check(monkeypatch):
    """The check can fail: a scatter that drops the last live row is caught."""
    from tools import gpu_capture_check as mod

    real = mod.scatter_rows
    monkeypatch.setattr(mod, "scatter_rows", lambda t, s, r, c=None: real(t, s[:-1], r[:-1], c))
    import torch

    gen = torch.Generator().manual_seed(0)
    assert mod.check_extend(mod.SMALL, "cpu", gen)["ok"] is False
    monkeypatch.undo()
    assert mod.main(["--device", "cpu", "--no-timing"]) == 0  # the real one passes
