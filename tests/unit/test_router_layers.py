"""The router's folders are floors: a module imports only from its own floor or a
lower one (no import runs back up), and the composition (shell, the two flows, the
CLI) is imported by nothing below it."""

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[2] / "eldr_sglang" / "router"
# lowest first; top-level modules are named by their stem, folders by their name
FLOORS = [{"http"}, {"config", "metrics", "runtime"}, {"pool"}, {"signals"}, {"state"}, {"flow"}, {"api"},
          {"shell"}, {"app", "colocated"}, {"cli", "__init__", "__main__"}]


def unit_of(path: Path, root: Path = ROUTER) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def floor_of(unit: str) -> int:
    for i, units in enumerate(FLOORS):
        if unit in units:
            return i
    raise AssertionError(f"eldr_sglang/router/{unit}: on no floor (add it to FLOORS)")


def router_imports(path: Path) -> set[str]:
    """The router units a module imports (``eldr_sglang.router.X[.Y]`` -> X)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        for name in names:
            parts = name.split(".")
            if parts[:2] != ["eldr_sglang", "router"]:
                continue
            if len(parts) > 2:
                out.add(parts[2])
            else:  # from eldr_sglang.router import X
                out.update(a.name for a in node.names)
    return out


def violations(root: Path = ROUTER) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        unit = unit_of(path, root)
        mine = floor_of(unit)
        for dep in sorted(router_imports(path) - {unit}):
            if dep in ("Router", "start_router"):
                dep = "__init__"
            if floor_of(dep) > mine:
                bad.append(f"{path.relative_to(root)} ({unit}, floor {mine}) imports {dep} (floor {floor_of(dep)})")
    return bad


def test_every_router_module_is_on_a_floor():
    units = {unit_of(p) for p in ROUTER.rglob("*.py")}
    for unit in units:
        floor_of(unit)
    assert {"http", "pool", "signals", "state", "flow", "api"} <= units


def test_no_import_runs_back_up():
    assert violations() == []


def test_the_check_sees_an_import_running_up(tmp_path):
    pkg = tmp_path / "router"
    (pkg / "pool").mkdir(parents=True)
    (pkg / "pool" / "workers.py").write_text("from eldr_sglang.router.flow.dispatch import Dispatcher\n"
                                             "from eldr_sglang.router.config import RouterConfig\n")
    (pkg / "config.py").write_text("from eldr_sglang.router import cli\n")
    found = violations(pkg)
    assert len(found) == 2
    assert any("imports cli" in f for f in found) and any("imports flow" in f for f in found)
