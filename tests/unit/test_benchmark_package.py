"""benchmark/ and tools/ are packages of short functions: no function over 80 lines there, no
``sys.path`` edit anywhere in the repository's own code, no import circle among benchmark modules.

Each check is a function over a folder; every one is first shown to fail on a small bad tree."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from tests.helpers import ROOT

MAX_FUNCTION_LINES = 80
SHORT_FUNCTION_DIRS = ("benchmark", "tools")
OWN_CODE_DIRS = ("benchmark", "tools", "tests", "eldr_sglang")


def python_files(root: Path, dirs: Iterable[str]) -> list[Path]:
    return sorted(p for d in dirs for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts)


def long_functions(files: Iterable[Path], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:line name (N lines)`` of every function (methods and nested ones too) over ``limit`` lines."""
    out = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(f"{path}:{node.lineno} {node.name} ({lines} lines)")
    return out


def _is_sys_path(node: ast.AST) -> bool:
    """``sys.path`` (or ``sys.path[...]``)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def sys_path_edits(files: Iterable[Path]) -> list[str]:
    """``file:line`` of every ``sys.path`` assignment, augmented assignment or mutating call
    (``insert``, ``append``, ``extend``, ``remove``, ``pop``, ``clear``)."""
    out = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear")):
                targets = [node.func.value]
            if any(_is_sys_path(t) for t in targets):
                out.append((str(path), node.lineno))
    return [f"{file}:{line}" for file, line in sorted(out)]


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports (anywhere in it, lazy imports too)} for the
    top-level modules of one package folder; absolute and relative imports."""
    package = package_dir.name
    modules = {p.stem for p in package_dir.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in sorted(modules):
        edges: set[str] = set()
        for node in ast.walk(ast.parse((package_dir / f"{name}.py").read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == package and len(parts) > 1:
                        edges.add(parts[1])
            elif isinstance(node, ast.ImportFrom):
                base = (node.module or "").split(".") if node.level == 0 else [package, *filter(None, (node.module or "").split("."))]
                if base[0] != package:
                    continue
                if len(base) > 1:
                    edges.add(base[1])
                else:  # from benchmark import common, report
                    edges.update(alias.name for alias in node.names)
        graph[name] = (edges & modules) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle (``[a, b, ..., a]``) of the graph, or ``[]``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return []


# ---------------------------------------------------------------- the checks can fail


def test_long_function_check_fails_on_a_long_function(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body}\n")
    (found,) = long_functions([tmp_path / "long.py"])
    assert " long (81 lines)" in found
    assert long_functions([tmp_path / "long.py"], limit=81) == []


def test_sys_path_check_fails_on_every_kind_of_edit(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.path.insert(0, 'x')\nsys.path.append('y')\nsys.path = ['z']\n"
                   "sys.path[0:0] = ['w']\nsys.path += ['v']\nprint(sys.path)\npaths = []\npaths.append(1)\n")
    assert sys_path_edits([bad]) == [f"{bad}:{n}" for n in (2, 3, 4, 5, 6)]


def test_cycle_check_fails_on_a_circle(tmp_path):
    pkg = tmp_path / "benchmark"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "common.py").write_text("import json\n")
    (pkg / "a.py").write_text("from benchmark.common import x\nfrom benchmark import b\n")
    (pkg / "b.py").write_text("import benchmark.common\n\ndef f():\n    from . import c\n")
    (pkg / "c.py").write_text("from .a import y\n")
    graph = import_graph(pkg)
    assert graph == {"a": {"common", "b"}, "b": {"common", "c"}, "c": {"a"}, "common": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    (pkg / "c.py").write_text("from benchmark.common import y\n")
    assert find_cycle(import_graph(pkg)) == []


# ---------------------------------------------------------------- the repository


def test_no_long_functions_in_benchmark_and_tools():
    assert long_functions(python_files(ROOT, SHORT_FUNCTION_DIRS)) == []


def test_no_sys_path_edits_in_the_repository():
    files = python_files(ROOT, OWN_CODE_DIRS)
    assert len(files) > 100
    assert sys_path_edits(files) == []


def test_no_import_circle_among_benchmark_modules():
    graph = import_graph(ROOT / "benchmark")
    assert "common" in graph["report"]  # the walker sees the package's imports
    assert find_cycle(graph) == []


def test_benchmark_and_tools_are_packages():
    for package in ("benchmark", "tools"):
        init = ROOT / package / "__init__.py"
        assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), package
