"""Recorded per-step expert sets of decodes (``steps.npz`` beside a trace set's shards).

``tools/record_long_decodes.py`` writes ``experts`` uint8 ``[n, T, L, top_k]`` (the
top-k expert ids of every decode step, every layer) and ``request_id`` ``[n]``.
A batch's distinct experts per layer at one step is the union of its requests'
sets at their current steps; without per-step sets it can only be estimated from
the per-request totals (independence: ``sum_e 1 - prod_r (1 - p_re)``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .traces import TraceSet

__all__ = ["STEPS_FILE", "P_MAX", "load_step_experts", "decode_step_probs", "used_experts", "true_distinct",
           "independent_distinct"]

STEPS_FILE = "steps.npz"
P_MAX = 1.0 - 1e-6  # an expert used in every step still leaves log(1 - p) finite


def load_step_experts(trace_dir: str | os.PathLike, traces: TraceSet) -> np.ndarray | None:
    """The ``steps.npz`` of a trace set ([N, T, L, top_k] uint8), rows in the traces' order;
    None when the set has none. Raises ValueError when it does not match the traces."""
    path = Path(trace_dir) / STEPS_FILE
    if not path.is_file():
        return None
    with np.load(path) as z:
        experts, ids = z["experts"], [str(x) for x in z["request_id"]]
    m = traces.model
    if experts.ndim != 4 or experts.shape[2:] != (m.num_layers, m.top_k):
        raise ValueError(f"{path}: experts has shape {experts.shape}, want [n, T, {m.num_layers}, {m.top_k}]")
    index = {rid: i for i, rid in enumerate(ids)}
    missing = [rid for rid in traces.request_ids if str(rid) not in index]
    if missing:
        raise ValueError(f"{path}: no step sets for {len(missing)} trace requests (first {missing[0]!r})")
    if int(experts.max(initial=0)) >= m.num_experts:
        raise ValueError(f"{path}: expert id {int(experts.max())} >= num_experts {m.num_experts}")
    return experts[[index[str(rid)] for rid in traces.request_ids]]


def decode_step_probs(traces: TraceSet) -> np.ndarray:
    """[N, L, E] probability that one decode step of request n uses expert e at layer l."""
    counts = traces.decode_counts.astype(np.float64)
    L, k = traces.model.num_layers, traces.model.top_k
    steps = np.maximum(counts.sum(axis=(1, 2)) / (L * k), counts.max(axis=(1, 2)))
    steps = np.maximum(steps, 1.0)
    return np.minimum(counts / steps[:, None, None], P_MAX)


def used_experts(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E] bool: which experts any of the ``ids`` ([b, L, k] expert ids) uses, per layer."""
    L = ids.shape[1]
    flat = ids.astype(np.int64) + (np.arange(L) * num_experts)[None, :, None]
    return (np.bincount(flat.ravel(), minlength=L * num_experts) > 0).reshape(L, num_experts)


def true_distinct(steps: np.ndarray, rows: np.ndarray, at: np.ndarray, num_experts: int) -> np.ndarray:
    """[L] distinct experts of one batch: request ``rows[i]`` at its decode step ``at[i]``."""
    return used_experts(steps[rows, at], num_experts).sum(axis=1)


def independent_distinct(p: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[L] expected distinct experts of a batch under independence (``p``: [N, L, E] per-step probabilities)."""
    return (1.0 - np.prod(1.0 - p[rows], axis=0)).sum(axis=1)
