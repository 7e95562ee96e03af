"""Architecture boundaries: the numeric core imports neither sglang, torch nor
aiohttp; the router never imports sglang."""

import subprocess
import sys

import pytest


def _imported(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    return {m.split(".")[0] for m in out.split()}


def test_core_imports_no_engine_or_web_stack():
    mods = _imported("import eldr_sglang.core as c\nfor n in c.__all__: getattr(c, n)")
    assert not mods & {"sglang", "torch", "aiohttp"}, mods & {"sglang", "torch", "aiohttp"}


@pytest.mark.parametrize("module", ["eldr_sglang.router.app", "eldr_sglang.router.cli"])
def test_router_does_not_import_sglang(module):
    assert "sglang" not in _imported(f"import {module}")
