"""Check the files a cluster description points to: artifact and placement files."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.artifact import CalibrationArtifact, load_artifact
from ..placement.sglang_files import MANIFEST, SERVER_FILE, read_location_file
from .spec import Cluster, DescriptionError


def check_artifact(cluster: Cluster, path: str | None = None) -> tuple[CalibrationArtifact, list[str]]:
    """The calibration artifact (read from ``path``, default the description's ``calibration``)
    and notes; DescriptionError when it is unreadable or does not fit the decode servers."""
    try:
        artifact = load_artifact(path or cluster.calibration)
    except ValueError as exc:
        raise DescriptionError(f"calibration: {exc}") from None
    decode, notes = cluster.decode, []
    if artifact.num_clusters != decode.count:
        message = (f"calibration: the artifact has {artifact.num_clusters} centroids for {decode.count} decode "
                   f"servers (calibrate with --clusters {decode.count})")
        if decode.ep_size > 1:
            raise DescriptionError(message + "; per-server placement needs one centroid per decode server")
        notes.append(message + "; the router shares centroids between servers")
    return artifact, notes


def check_files(cluster: Cluster) -> list[str]:
    """Raise DescriptionError for a missing or inconsistent file; return notes."""
    artifact, notes = check_artifact(cluster)
    decode = cluster.decode
    if decode.ep_size == 1:
        return notes
    folder = Path(decode.placement_dir)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise DescriptionError(f"decode.placement_dir: {manifest_path} not found "
                               "(python -m eldr_sglang.placement optimize --out ...)")
    manifest = json.loads(manifest_path.read_text())
    for key, want in (("ep_size", decode.ep_size), ("num_redundant", decode.num_redundant_experts)):
        if manifest.get(key) != want:
            field = "ep_size" if key == "ep_size" else "num_redundant_experts"
            raise DescriptionError(f"decode.{field}: {want}, but {manifest_path} was made with {key} {manifest.get(key)}")
    model = manifest.get("model", {})
    if (model.get("num_layers"), model.get("num_experts")) != (artifact.model.num_layers, artifact.model.num_experts):
        raise DescriptionError(f"decode.placement_dir: {manifest_path} is for model {model}, "
                               f"the artifact for {artifact.model.to_dict()}")
    width = artifact.model.num_experts + decode.num_redundant_experts
    for k in range(decode.count):
        path = folder / SERVER_FILE.format(k)
        if not path.is_file():
            raise DescriptionError(f"decode.placement_dir: {path} missing (decode server {k} of {decode.count})")
        shape = read_location_file(path).shape
        if shape != (artifact.model.num_layers, width):
            raise DescriptionError(f"decode.placement_dir: {path} is {list(shape)}, "
                                   f"expected [{artifact.model.num_layers}, {width}]")
    return notes
