"""The router's import path stays light: research-only dependencies (scipy, scikit-learn,
matplotlib, tqdm, pandas) and the engine side (torch, sglang) are not imported by
``eldr_sglang.router.app`` or its CLI; they load only where an online fit or a tool needs them."""

import subprocess
import sys

import pytest

HEAVY = ("scipy", "sklearn", "matplotlib", "tqdm", "pandas", "torch", "sglang")


@pytest.mark.parametrize("module", ["eldr_sglang.router.app", "eldr_sglang.router.cli",
                                    "eldr_sglang.router.colocated"])
def test_router_imports_no_research_or_engine_dependency(module):
    code = (f"import sys, {module}\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"{module} imports {done.stdout.strip()}"
