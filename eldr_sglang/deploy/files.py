"""Check the files a cluster description points to: artifact and placement files."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.artifact import CalibrationArtifact, load_artifact
from ..placement.sglang_files import MANIFEST, SERVER_FILE, read_location_file
from .models import target_model
from .spec import Cluster, DescriptionError


def check_artifact(cluster: Cluster, path: str | None = None) -> tuple[CalibrationArtifact, list[str]]:
    """The calibration artifact (read from ``path``, default the description's ``calibration``)
    and notes; DescriptionError when it is unreadable or does not fit the decode servers."""
    try:
        artifact = load_artifact(path or cluster.calibration)
    except ValueError as exc:
        raise DescriptionError(f"calibration: {exc}") from None
    check_model(cluster, artifact)
    decode, notes = cluster.decode, []
    k, n = artifact.num_clusters, decode.count
    if k != n:
        message = (f"calibration: the artifact has {k} centroids for {n} decode servers (calibrate with "
                   f"--clusters {n})")
        if decode.ep_size > 1:
            raise DescriptionError(message + "; per-server placement needs one centroid per decode server")
        if k == 1:
            raise DescriptionError(message + "; one region for every server is no locality")
        if k < n and n % k:
            raise DescriptionError(message + f"; {n} servers do not split evenly over {k} regions (some regions "
                                   f"would get {n // k + 1} servers, others {n // k}: unequal load by design)")
        notes.append(message + (f"; each region is shared by {n // k} servers" if k < n
                                else "; some servers own several centroids"))
    return artifact, notes


def check_model(cluster: Cluster, artifact: CalibrationArtifact) -> None:
    """DescriptionError when the artifact was calibrated on another model than ``model_path``."""
    target = target_model(cluster.model_path)
    have = artifact.model
    if target is None or (target.num_layers, target.num_experts, target.top_k) == (
            have.num_layers, have.num_experts, have.top_k):
        return
    raise DescriptionError(
        f"calibration: the artifact is for model {have.name!r} ({have.num_layers} layers, {have.num_experts} "
        f"experts, top-{have.top_k}), model_path {cluster.model_path} has {target.num_layers} layers, "
        f"{target.num_experts} experts, top-{target.top_k} (calibrate on traces of this model)")


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
