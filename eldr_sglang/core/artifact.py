"""Calibration artifact: one versioned JSON file, validated by ``load_artifact``.

Layout (``format_version`` 2; version 1 files, without ``predictor``, still load)::

    {"format": "eldr-calibration", "format_version": 1,
     "model": {"name", "num_layers", "num_experts", "top_k"},
     "variant": "idf", "layers": [..], "tau": 0.1,
     "idf":       {"dtype": "float32", "shape": [n_sel, E], "data": base64 little-endian},
     "centroids": {"dtype": "float32", "shape": [K, n_sel * E], "data": ...},
     "created": {"time", "n_requests", "tool", "tool_version", ...},
     "extra": {...free-form, not checksummed...},
     "predictor": {...} (optional: prompt token ids -> predicted counts, core.predictor),
     "checksum": "sha256:<hex>"}

The checksum is sha256 over the canonical JSON of (format_version, model, variant,
layers, tau) followed by the raw float32 bytes of idf and centroids, then the
predictor's arrays when there is one. ``created`` and ``extra`` are informational
and not covered.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .predictor import SignaturePredictor
from .signature import COUNT_VARIANTS, signature_from_counts
from .traces import ModelSpec

FORMAT = "eldr-calibration"
FORMAT_VERSION = 2  # 2: optional signature predictor
READABLE_VERSIONS = (1, 2)
DEFAULT_TAU = 0.1
_REQUIRED = ("format", "format_version", "model", "variant", "layers", "tau", "idf", "centroids", "checksum")


@dataclass
class CalibrationArtifact:
    """What the router, engine plugin, placement tool and simulator share."""

    model: ModelSpec
    variant: str
    layers: list[int]
    idf: np.ndarray
    centroids: np.ndarray
    tau: float = DEFAULT_TAU
    created: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    predictor: SignaturePredictor | None = None  # prompt token ids -> predicted counts

    def __post_init__(self) -> None:
        self.layers = [int(l) for l in self.layers]
        self.idf = np.ascontiguousarray(self.idf, dtype=np.float32)
        self.centroids = np.ascontiguousarray(self.centroids, dtype=np.float32)
        _validate(self, "artifact")

    @property
    def num_clusters(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def dim(self) -> int:
        return int(self.centroids.shape[1])

    def signature(self, counts: np.ndarray) -> np.ndarray:
        """Raw counts of the selected layers [n_sel, E] or [B, n_sel, E] -> unit float32 [D] / [B, D]."""
        return signature_from_counts(counts, self.idf, self.variant)

    def similarities(self, signatures: np.ndarray) -> np.ndarray:
        """Cosine similarity of unit signatures [D] / [B, D] to every centroid -> [K] / [B, K]."""
        return np.asarray(signatures, dtype=np.float32) @ self.centroids.T

    def checksum(self) -> str:
        head = json.dumps(
            {"format_version": self.format_version, "model": self.model.to_dict(), "variant": self.variant,
             "layers": self.layers, "tau": float(self.tau)},
            sort_keys=True, separators=(",", ":"),
        ).encode()
        digest = hashlib.sha256(head)
        digest.update(self.idf.astype("<f4").tobytes())
        digest.update(self.centroids.astype("<f4").tobytes())
        if self.predictor is not None:
            digest.update(self.predictor.digest_bytes())
        return "sha256:" + digest.hexdigest()

    def predicted_counts(self, token_ids) -> np.ndarray:
        """Prompt token ids -> predicted raw counts [n_sel, E] of the selected layers."""
        if self.predictor is None:
            raise ValueError("this artifact has no signature predictor (calibrate with --predictor-prompts)")
        return self.predictor.predict(token_ids)

    def to_dict(self) -> dict:
        out = {
            "format": FORMAT,
            "format_version": self.format_version,
            "model": self.model.to_dict(),
            "variant": self.variant,
            "layers": self.layers,
            "tau": float(self.tau),
            "idf": _encode(self.idf),
            "centroids": _encode(self.centroids),
            "created": self.created,
            "extra": self.extra,
            "checksum": self.checksum(),
        }
        if self.predictor is not None:
            out["predictor"] = self.predictor.to_dict()
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temp file + rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        os.replace(tmp, path)
        return path


def creation_info(n_requests: int, tool: str = "eldr_sglang.calibrate", **more: Any) -> dict:
    from .. import __version__

    return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "n_requests": int(n_requests),
            "tool": tool, "tool_version": __version__, **more}


def _encode(a: np.ndarray) -> dict:
    return {"dtype": "float32", "shape": list(a.shape), "data": base64.b64encode(a.astype("<f4").tobytes()).decode()}


def _decode(obj: Any, name: str, source: str) -> np.ndarray:
    if not isinstance(obj, Mapping) or not {"dtype", "shape", "data"} <= set(obj):
        raise ValueError(f"{source}: field '{name}' must be an object with dtype, shape, data")
    if obj["dtype"] != "float32":
        raise ValueError(f"{source}: field '{name}' dtype is {obj['dtype']!r}, expected 'float32'")
    try:
        raw = base64.b64decode(obj["data"], validate=True)
        shape = tuple(int(s) for s in obj["shape"])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{source}: field '{name}' is not valid base64/shape ({exc})") from None
    if len(raw) != 4 * int(np.prod(shape)):
        raise ValueError(f"{source}: field '{name}' holds {len(raw)} bytes, shape {list(shape)} needs {4 * int(np.prod(shape))}")
    return np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)


def _validate(art: CalibrationArtifact, source: str) -> None:
    m = art.model
    if art.variant not in COUNT_VARIANTS:
        raise ValueError(f"{source}: variant {art.variant!r} is not a count variant {COUNT_VARIANTS}")
    if not art.layers or len(set(art.layers)) != len(art.layers):
        raise ValueError(f"{source}: layers {art.layers} must be a non-empty list without repeats")
    bad = [l for l in art.layers if not 0 <= l < m.num_layers]
    if bad:
        raise ValueError(f"{source}: layers {bad} out of range for num_layers={m.num_layers}")
    want_idf = (len(art.layers), m.num_experts)
    if art.idf.shape != want_idf:
        raise ValueError(f"{source}: idf shape {list(art.idf.shape)} != [n_layers, num_experts] = {list(want_idf)}")
    dim = len(art.layers) * m.num_experts
    if art.centroids.ndim != 2 or art.centroids.shape[1] != dim or art.centroids.shape[0] < 1:
        raise ValueError(f"{source}: centroids shape {list(art.centroids.shape)} != [K, {dim}]")
    if not (np.isfinite(art.idf).all() and np.isfinite(art.centroids).all()):
        raise ValueError(f"{source}: idf or centroids contain non-finite values")
    if not (np.isfinite(art.tau) and art.tau >= 0.0):
        raise ValueError(f"{source}: tau {art.tau} must be finite and >= 0")
    if art.predictor is not None:
        if art.format_version < 2:
            raise ValueError(f"{source}: a predictor needs format_version >= 2")
        if tuple(art.predictor.shape_) != want_idf:
            raise ValueError(f"{source}: predictor shape {list(art.predictor.shape_)} != [n_layers, num_experts] "
                             f"= {list(want_idf)}")


def load_artifact(
    path: str | os.PathLike,
    expect_model: ModelSpec | Mapping[str, Any] | None = None,
    expect_layers: list[int] | None = None,
    expect_clusters: int | None = None,
) -> CalibrationArtifact:
    """Load and validate an artifact; ValueError says exactly what is wrong.

    Refuses: unreadable JSON, wrong format/version, missing fields, bad shapes,
    checksum mismatch, and (when given) a different model (any of name,
    num_layers, num_experts, top_k present in ``expect_model``), layer list or
    cluster count.
    """
    source = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{source}: cannot read artifact JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: artifact must be a JSON object")
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise ValueError(f"{source}: missing field(s) {missing}")
    if doc["format"] != FORMAT:
        raise ValueError(f"{source}: format is {doc['format']!r}, expected {FORMAT!r}")
    if doc["format_version"] not in READABLE_VERSIONS:
        raise ValueError(f"{source}: format_version {doc['format_version']} unsupported "
                         f"(this code reads {', '.join(map(str, READABLE_VERSIONS))})")
    if not isinstance(doc["model"], Mapping):
        raise ValueError(f"{source}: field 'model' must be an object")
    try:
        art = CalibrationArtifact(
            model=ModelSpec.from_dict(doc["model"], f"{source}: field 'model'"),
            variant=str(doc["variant"]),
            layers=[int(l) for l in doc["layers"]],
            idf=_decode(doc["idf"], "idf", source),
            centroids=_decode(doc["centroids"], "centroids", source),
            tau=float(doc["tau"]),
            created=dict(doc.get("created") or {}),
            extra=dict(doc.get("extra") or {}),
            format_version=int(doc["format_version"]),
            predictor=(SignaturePredictor.from_dict(doc["predictor"], f"{source}: field 'predictor'")
                       if doc.get("predictor") is not None else None),
        )
    except ValueError as exc:
        msg = str(exc)
        raise ValueError(msg if msg.startswith(source) else msg.replace("artifact:", f"{source}:", 1)) from None
    except TypeError as exc:
        raise ValueError(f"{source}: malformed field ({exc})") from None
    if art.checksum() != doc["checksum"]:
        raise ValueError(f"{source}: checksum mismatch (stored {doc['checksum']}, content gives {art.checksum()}); the file is corrupt or was edited")
    if expect_model is not None:
        want = expect_model.to_dict() if isinstance(expect_model, ModelSpec) else dict(expect_model)
        have = art.model.to_dict()
        diffs = [f"{k} is {have[k]!r}, expected {want[k]!r}" for k in ("name", "num_layers", "num_experts", "top_k")
                 if k in want and want[k] is not None and have[k] != want[k]]
        if diffs:
            raise ValueError(f"{source}: model mismatch: " + "; ".join(diffs))
    if expect_layers is not None and list(expect_layers) != art.layers:
        raise ValueError(f"{source}: layers {art.layers} != expected {list(expect_layers)}")
    if expect_clusters is not None and expect_clusters != art.num_clusters:
        raise ValueError(f"{source}: {art.num_clusters} clusters, expected {expect_clusters}")
    return art
