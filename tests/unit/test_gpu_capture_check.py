"""tools/gpu_capture_check.py, the prepared GPU check: its dry run on CPU, and that
it needs nothing but torch (the GPU machine has no SGLang, numpy is not assumed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.helpers import ROOT


def load_tool():
    spec = importlib.util.spec_from_file_location("gpu_capture_check", ROOT / "tools" / "gpu_capture_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('sglang', 'numpy', 'orjson', 'aiohttp', 'scipy', 'sklearn'):
            raise ModuleNotFoundError('not on the GPU machine: ' + name)
sys.meta_path.insert(0, Block())
sys.argv = ['gpu_capture_check.py', '--device', 'cpu', '--no-timing']
import runpy
runpy.run_path(%r, run_name='__main__')
"""


def test_the_dry_run_passes_its_checks_with_torch_alone():
    script = str(ROOT / "tools" / "gpu_capture_check.py")
    proc = subprocess.run([sys.executable, "-c", BLOCK % script],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("OK   ") == 2 and "eager dry run" in proc.stdout


def test_a_wrong_scatter_fails_the_check(monkeypatch):
    """The check can fail: a scatter that drops the last live row is caught."""
    mod = load_tool()
    real = mod.scatter_rows
    monkeypatch.setattr(mod, "scatter_rows", lambda t, s, r, c=None: real(t, s[:-1], r[:-1], c))
    import torch

    gen = torch.Generator().manual_seed(0)
    assert mod.check_extend(mod.SMALL, "cpu", gen)["ok"] is False
    monkeypatch.undo()
    assert mod.main(["--device", "cpu", "--no-timing"]) == 0  # the real one passes
