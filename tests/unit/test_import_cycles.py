"""No import circle inside eldr_sglang: every ``import`` (module level, inside a
function, or under ``TYPE_CHECKING``) is an edge of the package's module graph,
and the graph must sort topologically. Importing a submodule is not counted as
importing its parent package (Python runs the parent first either way)."""

import ast
import graphlib
from pathlib import Path

import eldr_sglang

ROOT = Path(eldr_sglang.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str:
    """The package module that ``name`` (a module or an object in one) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                continue
            graph[name].update(t for t in (_owner(t, modules) for t in targets) if t and t != name)
    return graph


def test_the_graph_sees_the_package_imports():
    graph = import_graph()
    assert "eldr_sglang.router.flow.dispatch" in graph["eldr_sglang.router.app"]
    assert "eldr_sglang.core.policies" in graph["eldr_sglang.router.flow.dispatch"]
    assert "eldr_sglang.router.pool.upstream" in graph["eldr_sglang.router.flow.dispatch"]  # from pkg import mod


def test_a_planted_circle_is_found():
    graph = import_graph()
    graph["eldr_sglang.core.policies"] = graph["eldr_sglang.core.policies"] | {"eldr_sglang.router.app"}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        assert "eldr_sglang.router.app" in e.args[1]
    else:
        raise AssertionError("the planted circle was not found")


def test_no_import_circle_in_the_package():
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import circle: {' -> '.join(e.args[1])}") from None


def test_only_the_cli_imports_the_router_app():
    importers = sorted(m for m, deps in import_graph().items() if "eldr_sglang.router.app" in deps)
    assert importers in (["eldr_sglang.router", "eldr_sglang.router.cli"], ["eldr_sglang.router.cli"]), importers
