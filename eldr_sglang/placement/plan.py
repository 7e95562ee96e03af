"""Whole-model placements: per decode server (its region's activation) or global."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.artifact import CalibrationArtifact
from ..core.traces import TraceSet
from .optimizer import LayerPlacement, default_map, evaluate, optimize_layer
from .regions import RegionActivity, activity, region_activities
from .sglang_files import MANIFEST, SERVER_FILE, write_location_file


@dataclass(frozen=True)
class ModelPlacement:
    """All layers of one server: the map [L, num_physical] and per-layer figures."""

    physical_to_logical: np.ndarray
    layers: list[LayerPlacement]

    def summary(self, default: "ModelPlacement | None" = None) -> dict:
        loads = np.stack([l.rank_load for l in self.layers])  # [L, G]
        bounds = np.array([l.lower_bound for l in self.layers])
        out = {
            "max_rank_load_mean": float(loads.max(1).mean()),
            "lower_bound_mean": float(bounds.mean()),
            "gap_mean": float(np.mean([l.gap for l in self.layers])),
            "gap_max": float(np.max([l.gap for l in self.layers])),
            "imbalance_mean": float((loads.max(1) / loads.mean(1)).mean()),
            "max_rank_distinct_mean": float(np.stack([l.rank_distinct for l in self.layers]).max(1).mean()),
        }
        if default is not None:
            out["default"] = default.summary()
        return out


def place_model(act: RegionActivity, ep_size: int, num_redundant: int = 0,
                batch_size: int = 32) -> ModelPlacement:
    """Optimise every layer for one activation pattern."""
    layers = [optimize_layer(act.load[l], ep_size, num_redundant, act.token_prob[l], batch_size)
              for l in range(act.load.shape[0])]
    return ModelPlacement(np.stack([l.physical_to_logical for l in layers]), layers)


def default_placement(act: RegionActivity, ep_size: int, num_redundant: int = 0,
                      batch_size: int = 32) -> ModelPlacement:
    """SGLang's trivial layout evaluated on an activation pattern."""
    from .optimizer import lower_bound

    num_layers, num_experts = act.load.shape
    p2l = default_map(num_experts, ep_size, num_redundant)
    layers = []
    for l in range(num_layers):
        load, distinct = evaluate(p2l, act.load[l], ep_size, act.token_prob[l], batch_size)
        layers.append(LayerPlacement(p2l, load, distinct, lower_bound(act.load[l], ep_size, num_redundant)))
    return ModelPlacement(np.tile(p2l, (num_layers, 1)), layers)


def plan_per_server(artifact: CalibrationArtifact, traces: TraceSet, ep_size: int, num_redundant: int = 0,
                    batch_size: int = 32) -> tuple[list[ModelPlacement], list[RegionActivity]]:
    """One placement per decode server (centroid order), fit on its region's requests."""
    acts, _ = region_activities(artifact, traces)
    return [place_model(a, ep_size, num_redundant, batch_size) for a in acts], acts


def plan_global(traces: TraceSet, ep_size: int, num_redundant: int = 0, batch_size: int = 32) -> ModelPlacement:
    """One balanced placement fit on all requests together (what one global EPLB pass gives)."""
    return place_model(activity(traces), ep_size, num_redundant, batch_size)


def write_plan(out_dir: str | os.PathLike, placements: list[ModelPlacement], acts: list[RegionActivity],
               *, ep_size: int, num_redundant: int, batch_size: int, model: dict, source: dict) -> Path:
    """``server-KK.json`` per decode server plus the ``placement.json`` manifest."""
    out = Path(out_dir)
    servers = []
    for k, (placement, act) in enumerate(zip(placements, acts)):
        path = write_location_file(out / SERVER_FILE.format(k), placement.physical_to_logical)
        base = default_placement(act, ep_size, num_redundant, batch_size)
        servers.append({"server": k, "file": path.name, "requests": act.num_requests,
                        **placement.summary(default=base)})
    manifest = {"format": "eldr-placement", "model": model, "ep_size": ep_size, "num_redundant": num_redundant,
                "num_physical": model["num_experts"] + num_redundant, "batch_size": batch_size,
                "source": source, "servers": servers}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out / MANIFEST
