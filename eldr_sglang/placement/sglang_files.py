"""SGLang ``--init-expert-location`` files: write them, and read them back through SGLang.

A file holds exactly ``{"physical_to_logical_map": [layers][num_physical]}``: SGLang
passes the JSON object's keys as keyword arguments to
``ExpertLocationMetadata.init_by_mapping``, so any other key would stop the server.
Figures and provenance go to the manifest ``placement.json`` beside the files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

MANIFEST = "placement.json"
SERVER_FILE = "server-{:02d}.json"


def write_location_file(path: str | os.PathLike, physical_to_logical: np.ndarray) -> Path:
    """Write one ``[layers][num_physical]`` map of logical expert ids."""
    p2l = np.asarray(physical_to_logical)
    if p2l.ndim != 2:
        raise ValueError(f"physical_to_logical must be [layers, num_physical], got shape {p2l.shape}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"physical_to_logical_map": p2l.astype(int).tolist()}, separators=(",", ":")) + "\n")
    return path


def read_location_file(path: str | os.PathLike) -> np.ndarray:
    """The map of a file written by :func:`write_location_file` (plain JSON read)."""
    doc = json.loads(Path(path).read_text())
    if set(doc) != {"physical_to_logical_map"}:
        raise ValueError(f"{path}: expected only the key 'physical_to_logical_map', found {sorted(doc)}")
    return np.asarray(doc["physical_to_logical_map"], dtype=np.int64)


def parse_with_sglang(model_path: str, files: Iterable[str | os.PathLike], ep_size: int,
                      num_redundant: int = 0) -> list[np.ndarray]:
    """Load each file the way an SGLang 0.5.23 server started with
    ``--model-path MODEL --ep-size EP --ep-num-redundant-experts R --init-expert-location FILE``
    does (``compute_initial_expert_location_metadata``), on CPU; returns the parsed maps.

    Raises ValueError when SGLang refuses a file, or when its layer or physical expert
    count differs from the server's, or a logical expert has no slot (SGLang 0.5.23
    checks none of these at load time).
    """
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import (
        ModelConfigForExpertLocation,
        compute_initial_expert_location_metadata,
    )
    from sglang.srt.runtime_context import get_context, restore_context, snapshot_context
    from sglang.srt.server_args import ServerArgs

    saved = snapshot_context()
    maps = []
    try:
        for file in files:
            args = ServerArgs(model_path=str(model_path), device="cpu", tp_size=ep_size, ep_size=ep_size,
                              ep_num_redundant_experts=num_redundant, init_expert_location=str(file))
            get_context().set_server_args(args)
            model_config = ModelConfig.from_server_args(args)
            expected = ModelConfigForExpertLocation.from_model_config(model_config)
            if expected is None:
                raise ValueError(f"{model_path}: SGLang has no expert placement for this architecture")
            try:
                meta = compute_initial_expert_location_metadata(model_config, moe_ep_rank=0)
            except (AssertionError, RuntimeError, TypeError, ValueError, IndexError) as exc:
                raise ValueError(f"{file}: SGLang refused the file ({type(exc).__name__}: {exc})") from None
            if meta.num_layers != expected.num_layers:
                raise ValueError(f"{file}: {meta.num_layers} layers, the model has {expected.num_layers}")
            want_physical = expected.num_logical_experts + num_redundant
            if meta.num_physical_experts != want_physical:
                raise ValueError(f"{file}: {meta.num_physical_experts} physical experts per layer, the server has "
                                 f"{expected.num_logical_experts} experts + {num_redundant} redundant = {want_physical}")
            missing = (meta.logical_to_all_physical_map_num_valid.cpu() == 0).nonzero().tolist()
            if missing:
                raise ValueError(f"{file}: (layer, logical expert) pairs without a physical slot: {missing[:5]}")
            maps.append(meta.physical_to_logical_map_cpu.numpy().astype(np.int64))
    finally:
        restore_context(saved)
    return maps
