"""The signature wire contract (``eldr_sglang.core.wire``): one module builds, frames,
signs and parses the engine -> router message; nothing else writes it."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import orjson
import pytest

from eldr_sglang.core import wire

ROOT = Path(__file__).resolve().parents[2] / "eldr_sglang"


def test_built_message_parses_back_through_both_framings():
    counts = np.array([[3, 0, 1], [0, 7, 2]])
    msg = wire.build_message(5, "r5", 11, 4, [2, 9], counts, packed=True, model={"name": "m"})
    body, headers = wire.http_body([msg])
    assert headers == {"Content-Type": "application/json"}
    (got,) = [wire.parse_message(m) for m in orjson.loads(body)]
    assert got["bootstrap_room"] == 5 and got["layers"] == [2, 9] and got["prompt_tokens"] == 11
    assert got["counts"].tolist() == counts.tolist() and got["model"] == {"name": "m"}
    lines = wire.stream_lines([msg, wire.build_message(6, None, 1, 0, [2, 9], counts)])
    rooms = [wire.parse_message(orjson.loads(wire.split_line(line)[1]))["bootstrap_room"]
             for line in lines.splitlines()]
    assert rooms == [5, 6]
    assert wire.build_message(6, None, 1, 0, [2, 9], counts)["counts"] == counts.tolist()  # rows form


def test_parse_drops_unknown_fields_and_names_bad_ones():
    msg = wire.parse_message({"bootstrap_room": 1, "layers": [0], "counts": [[1, 2]], "junk": "x" * 100})
    assert "junk" not in msg
    with pytest.raises(ValueError, match="rid"):
        wire.parse_message({"bootstrap_room": 1, "layers": [0], "counts": [[1]], "rid": "x" * 10_000})
    with pytest.raises(ValueError, match="bootstrap_room"):
        wire.parse_message({"bootstrap_room": -1, "layers": [0], "counts": [[1]]})


@pytest.mark.parametrize("params, expected", [
    ({wire.RETURN_ADDRESS_KEY: "tcp://r:1"}, "tcp://r:1"), ({wire.RETURN_ADDRESS_KEY: ""}, None),
    ({wire.RETURN_ADDRESS_KEY: 3}, None), (["x"], None), (None, None)])
def test_return_address(params, expected):
    assert wire.return_address(params) == expected


def test_router_imports_nothing_from_the_engine_plugin():
    """The wire contract lives in the core: no router module imports ``eldr_sglang.patches``."""
    offenders = []
    for path in sorted((ROOT / "router").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("eldr_sglang.patches")]
    assert not offenders, offenders


def test_selfcheck_reads_lines_of_a_signing_engine():
    """eldr-selfcheck stands in for a router: a signed line is read like an unsigned one."""
    import socket

    from eldr_sglang.selfcheck import PrefillServer

    server = PrefillServer("http://127.0.0.1:1", 8998, timeout=5, api_key=None)
    msgs = [wire.build_message(room, f"r{room}", 3, 0, [1], [[3, 0]], packed=True) for room in (7, 8)]
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(wire.stream_lines(msgs[:1], b"key") + wire.stream_lines(msgs[1:]))
        with server.cond:
            assert server.cond.wait_for(lambda: len(server.messages) == 2, timeout=30)
    assert server.messages[7]["rid"] == "r7" and server.messages[8]["layers"] == [1]
    server.close()
