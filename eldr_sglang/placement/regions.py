"""Each decode server's expected decode activation, from calibration traces.

A request belongs to the region of the centroid its signature is most similar to,
the signature being computed through the artifact exactly as the router does
(selected layers' raw prefill counts -> ``artifact.signature`` -> cosine to the
centroids). Decode server ``k`` serves centroid ``k`` (router decode order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.artifact import CalibrationArtifact
from ..core.traces import TraceSet


@dataclass(frozen=True)
class RegionActivity:
    """Expected decode activation of one group of requests, per layer and expert."""

    load: np.ndarray  # [L, E] share of the layer's decode expert hits (rows sum to 1)
    token_prob: np.ndarray  # [L, E] mean over requests of P(a decode token picks e)
    num_requests: int


def assign_regions(artifact: CalibrationArtifact, traces: TraceSet) -> np.ndarray:
    """[N] index of the most similar centroid per request (the router at tau = 0)."""
    check_model(artifact, traces)
    signatures = artifact.signature(traces.prefill_counts[:, artifact.layers])
    return np.argmax(artifact.similarities(signatures), axis=1)


def check_model(artifact: CalibrationArtifact, traces: TraceSet) -> None:
    """ValueError when artifact and traces describe different models."""
    a, t = artifact.model, traces.model
    if (a.num_layers, a.num_experts, a.top_k) != (t.num_layers, t.num_experts, t.top_k):
        raise ValueError(f"artifact model {a.to_dict()} does not match traces model {t.to_dict()}")


def token_probabilities(traces: TraceSet) -> np.ndarray:
    """[N, L, E] per-request P(one decode token picks expert e) = decode_counts / output_tokens."""
    tokens = np.maximum(traces.output_tokens, 1).astype(np.float64)[:, None, None]
    return np.clip(traces.decode_counts / tokens, 0.0, 1.0)


def activity(traces: TraceSet, index: np.ndarray | None = None) -> RegionActivity:
    """Decode activation of the requests at ``index`` (all when None)."""
    part = traces if index is None else traces.subset(index)
    n = len(part)
    if n == 0:
        raise ValueError("no requests to measure activation on")
    hits = part.decode_counts.sum(axis=0, dtype=np.float64)
    totals = hits.sum(axis=1, keepdims=True)
    load = np.divide(hits, totals, out=np.full_like(hits, 1.0 / hits.shape[1]), where=totals > 0)
    return RegionActivity(load, token_probabilities(part).mean(axis=0), n)


def region_activities(artifact: CalibrationArtifact, traces: TraceSet,
                      min_requests: int = 1) -> tuple[list[RegionActivity], np.ndarray]:
    """Per decode server (centroid order): its region's activation; an empty region
    (fewer than ``min_requests``) falls back to all requests. Also returns the regions."""
    regions = assign_regions(artifact, traces)
    everyone = None
    out = []
    for k in range(artifact.num_clusters):
        index = np.flatnonzero(regions == k)
        if len(index) >= max(min_requests, 1):
            out.append(activity(traces, index))
        else:
            everyone = everyone or activity(traces)
            out.append(everyone)
    return out, regions
