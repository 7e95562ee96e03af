"""Furniture shared by the benchmark scripts: recording a run, mean ± sd, markdown tables, timing, ports.

Scripts are run as ``python -m benchmark.<script>`` from the repository root and import it as
``from benchmark.common import ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

#: This folder and the repository root.
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
#: where ``--quick`` runs write (never over the committed results); tests point it at a temporary folder
QUICK_OUT = Path(os.environ.get("ELDR_BENCH_QUICK_OUT", ROOT / ".cache" / "bench-quick"))


def __getattr__(name: str) -> Any:
    """``free_port``, re-exported for the scripts from :mod:`eldr_sglang.testing.local_cluster`
    (aiohttp, orjson) when a script asks for it, not when this module loads."""
    if name == "free_port":
        from eldr_sglang.testing.local_cluster import free_port

        return free_port
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------ statistics
def mean_sd(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``ddof=1``; 0.0 for a single value)."""
    import numpy as np  # here: the module loads with the standard library alone (the GPU check's scripts)

    a = np.asarray(list(values), dtype=float)
    if a.size == 0:
        raise ValueError("mean_sd: no values")
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def fmt_mean_sd(values: Iterable[float], digits: int = 1, scale: float = 1.0) -> str:
    """``"mean ± sd"`` of ``values`` times ``scale``, both with ``digits`` decimals."""
    m, sd = mean_sd(values)
    return f"{scale * m:.{digits}f} ± {scale * sd:.{digits}f}"


# ------------------------------------------------------------------ tables
def markdown_table(headers: Sequence[Any], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table, ``| a | b |`` with a ``|---|---|`` rule; cells are ``str()``-ed as given."""
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"markdown_table: row of {len(row)} cells under {len(headers)} headers: {row!r}")
        lines.append("| " + " | ".join(map(str, row)) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------ --quick
def parse_with_quick(ap: argparse.ArgumentParser, argv: Sequence[str] | None, **quick_defaults: Any) -> argparse.Namespace:
    """``ap.parse_args(argv)`` with a ``--quick`` flag: a smoke run of seconds whose defaults are
    ``quick_defaults`` (flags given explicitly still win); ``args.quick`` tells which."""
    shown = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick_defaults.items()
                      if not isinstance(v, (str, os.PathLike)) or "/" not in str(v))
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run of a few seconds ({shown}); outputs under {QUICK_OUT}")
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(**quick_defaults)
        args = ap.parse_args(argv)
    return args


def quick_out(name: str) -> Path:
    """The folder a ``--quick`` run of ``name`` writes to."""
    return QUICK_OUT / name


# ------------------------------------------------------------------ recording a run
def command_line(script: str | os.PathLike, argv: Sequence[str] | None = None) -> str:
    """The command that reruns a benchmark: ``python -m benchmark.<script> <args>`` (``script``: its file or
    module name; args default: ``sys.argv[1:]``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", "-m", f"benchmark.{Path(script).stem}", *map(shlex.quote, args)])


def machine_facts() -> dict[str, Any]:
    """What a reader needs to compare timings across machines."""
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "load_average": list(os.getloadavg())}


def _json_default(obj: Any) -> Any:
    """numpy scalars as numbers, anything else JSON cannot write (paths ...) as text."""
    try:
        return float(obj)
    except (TypeError, ValueError):
        return str(obj)


def write_record(path: str | os.PathLike, doc: dict, argv: Sequence[str] | None = None, *,
                 script: str | os.PathLike | None = None) -> dict:
    """Write ``doc`` as JSON after the command line, the time (UTC) and the machine facts; returns the record.

    ``script`` defaults to ``sys.argv[0]``; a ``"command"`` already in ``doc`` wins. The
    file is replaced atomically, so a run that writes after every step never leaves half a file.
    """
    record = {"command": doc.get("command") or command_line(script or sys.argv[0], argv),
              "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_facts()}
    record.update((k, v) for k, v in doc.items() if k not in record)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=_json_default) + "\n")
    os.replace(tmp, path)
    return record


# ------------------------------------------------------------------ timing
class Stopwatch:
    """``with Stopwatch() as t: ...`` then ``t.seconds`` (wall) and ``t.cpu_seconds`` (this process)."""

    def __enter__(self) -> "Stopwatch":
        self.seconds = self.cpu_seconds = 0.0
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._c0


def seconds_per_call(fn: Callable[[], Any], repeat: int) -> float:
    """Mean wall seconds of ``fn()`` over ``repeat`` back-to-back calls."""
    if repeat < 1:
        raise ValueError(f"seconds_per_call: repeat must be >= 1, got {repeat}")
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers ("1,4,16")."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
