"""The docs' flag tables are generated from the config dataclasses (RouterConfig,
EngineConfig) and must be current; the engine's parser is built from EngineConfig."""

import subprocess
import sys
from dataclasses import fields

from eldr_sglang import flag_tables
from eldr_sglang.patches.flags import EngineConfig, _parser, flag_of
from eldr_sglang.router.config import RouterConfig


def test_docs_tables_are_current():
    assert flag_tables.stale() == [], "regenerate: python -m eldr_sglang.flag_tables"


def test_every_setting_has_a_row():
    router = "\n".join(flag_tables.router_table())
    engine = "\n".join(flag_tables.engine_table())
    for f in fields(RouterConfig):
        assert f"| `--{f.name.replace('_', '-')}` |" in router, f.name
    for f in fields(EngineConfig):
        assert f"| `{flag_of(f)} " in engine, f.name
    assert "| `--prefill URL [BOOTSTRAP_PORT]` |" in router


def test_engine_parser_has_every_field_and_nothing_else():
    flags = {o for a in _parser()._actions for o in a.option_strings}
    assert flags == {flag_of(f) for f in fields(EngineConfig)}


def test_a_stale_table_is_found_and_rewritten(tmp_path):
    for name in flag_tables.TABLES:
        (tmp_path / name).write_text((flag_tables.DOCS / name).read_text())
    engine = tmp_path / "ENGINE.md"
    engine.write_text(engine.read_text().replace("| `--eldr-trace-dir DIR` |", "| `--eldr-old DIR` |"))
    assert flag_tables.stale(tmp_path) == [str(engine)]
    check = [sys.executable, "-m", "eldr_sglang.flag_tables", "--docs", str(tmp_path), "--check"]
    done = subprocess.run(check, capture_output=True, text=True)
    assert done.returncode == 1 and "ENGINE.md: flag table is stale" in done.stderr
    subprocess.run(check[:-1], check=True, capture_output=True)
    assert flag_tables.stale(tmp_path) == [] and "--eldr-old" not in engine.read_text()


def test_a_doc_without_markers_is_a_one_line_error(tmp_path):
    for name in flag_tables.TABLES:
        (tmp_path / name).write_text("# no table here\n")
    done = subprocess.run([sys.executable, "-m", "eldr_sglang.flag_tables", "--docs", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: no <!-- ") and "Traceback" not in done.stderr
