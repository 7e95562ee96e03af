"""Routing inputs for SIMULATED runs: calibration artifacts, signatures, Domain map, oracle.

* ELDR: calibrated on the calibration split by the operator command itself
  (:func:`eldr_sglang.calibrate.main`: IDF, greedy layers, balanced K-means with
  K = decode servers), loaded back with :func:`load_artifact`; each evaluation
  request's signature is ``artifact.signature(prefill counts of the selected
  layers)``, the call the router makes on a signature message. With prefix
  caching the radix signature cache makes the signature exact, so it is the same.
* Oracle grouping (reference, not deployable): the same IDF + balanced K-means,
  but on DECODE counts of all layers, and each request routed by its actual decode
  signature with the same band rule (:class:`EldrPolicy`, unchanged).
* Domain: labels partition the servers equally (label i owns servers
  i, i + n_labels, ...), as the paper's Domain baseline does.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import numpy as np

from ..core.artifact import CalibrationArtifact, load_artifact
from ..core.clustering import BalancedKMeans
from ..core.signature import SignatureBuilder
from ..core.traces import TraceSet

__all__ = ["calibrate_artifact", "eldr_signatures", "prefill_activations", "OracleGrouping", "oracle_grouping",
           "domain_map"]


def calibrate_artifact(calib_dir: str | os.PathLike, clusters: int, out: str | os.PathLike, seed: int = 0,
                       pairs: int = 20_000, n_init: int = 3, max_layers: int | None = None,
                       log: str | os.PathLike | None = None) -> CalibrationArtifact:
    """Run ``python -m eldr_sglang.calibrate`` in-process; its printout goes to ``log``."""
    from .. import calibrate

    argv = ["--traces", str(calib_dir), "--clusters", str(clusters), "--out", str(out),
            "--seed", str(seed), "--pairs", str(pairs), "--n-init", str(n_init)]
    if max_layers:
        argv += ["--max-layers", str(max_layers)]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = calibrate.main(argv)
    except SystemExit as exc:
        rc = exc.code
    if log is not None:
        Path(log).write_text(buf.getvalue())
    if rc != 0:
        tail = buf.getvalue().strip().splitlines()[-3:]
        raise ValueError(f"calibration of {calib_dir} (K={clusters}) failed: {' | '.join(tail)}")
    return load_artifact(out, expect_clusters=clusters)


def eldr_signatures(artifact: CalibrationArtifact, traces: TraceSet) -> np.ndarray:
    """[N, D] unit signatures, as the router computes them from prefill counts."""
    return artifact.signature(traces.prefill_counts[:, artifact.layers])


def prefill_activations(traces: TraceSet, layers: list[int]) -> np.ndarray:
    """[N, len(layers) * E] per-step expert probabilities as the router estimates them from a
    signature message: the selected layers' prefill counts / prompt tokens."""
    counts = traces.prefill_counts[:, layers].astype(np.float64)
    tokens = np.maximum(traces.prompt_tokens.astype(np.float64), counts.max(axis=(1, 2)))
    return (counts / np.maximum(tokens, 1.0)[:, None, None]).reshape(counts.shape[0], -1)


class OracleGrouping:
    """Centroids from calibration DECODE counts and each evaluation request's decode signature."""

    def __init__(self, centroids: np.ndarray, signatures: np.ndarray) -> None:
        self.centroids = centroids
        self.signatures = signatures


def oracle_grouping(calib: TraceSet, evaluation: TraceSet, clusters: int, seed: int = 0,
                    n_init: int = 3) -> OracleGrouping:
    """Balanced K-means on IDF-weighted decode-count signatures (all layers)."""
    builder = SignatureBuilder("idf").fit(calib.decode_counts)
    km = BalancedKMeans(clusters, n_init=n_init, random_state=seed).fit(builder.transform(calib.decode_counts))
    return OracleGrouping(km.cluster_centers_, builder.transform(evaluation.decode_counts))


def domain_map(labels: np.ndarray, num_servers: int) -> dict[str, list[int]]:
    """Equal partition of servers over the known labels (most frequent label first)."""
    names, counts = np.unique(labels[labels != ""], return_counts=True)
    order = [str(names[i]) for i in np.argsort(-counts, kind="stable")]
    if not order:
        return {}
    return {name: [s for s in range(num_servers) if s % len(order) == i] or [i % num_servers]
            for i, name in enumerate(order)}
