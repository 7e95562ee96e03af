"""Calibrated routing inputs of the simulated benchmarks, cached on disk.

``routing_for`` is ``experiments.prepare_routing`` (ELDR artifact, oracle grouping) for one
(workload, K, calibration seed), pickled under the work dir and keyed by a fingerprint of the
workload's traces, so the sweeps that share a work dir (``bench_state_aware``, ``bench_default_policy``,
``bench_locality``, ``bench_replicas``, ``bench_law_fit``) calibrate each point once.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
from pathlib import Path

from eldr_sglang.sim import experiments


def _fingerprint(*paths: Path) -> str:
    """12 hex digits over the name, size and mtime of every file under ``paths``."""
    h = hashlib.sha1()
    for base in paths:
        for f in sorted(Path(base).rglob("*")):
            if f.is_file():
                st = f.stat()
                h.update(f"{f.relative_to(base)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def routing_for(data: experiments.WorkloadData, k: int, seed: int, a: argparse.Namespace) -> experiments.Routing:
    """``experiments.prepare_routing`` with calibration seed ``seed``, cached under the work dir
    (``a.work_dir``; the traces are read from ``a.traces_root``)."""
    fp = _fingerprint(a.traces_root / data.name)
    cache = a.work_dir / "routing" / f"{data.name}-K{k}-seed{seed}-{fp}-p{experiments.FULL.calib_pairs}.pkl"
    if cache.is_file():
        with open(cache, "rb") as f:
            return pickle.load(f)
    routing = experiments.prepare_routing(data, k, a.work_dir / f"seed{seed}", experiments.FULL, seed=seed)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(routing, f)
    os.replace(tmp, cache)
    return routing

