"""The labelled corpus (``tools/build_corpus.py``) and its document-level split.

Every tool that reads the corpus (tokenizer/model trainer, workload builder,
specialisation report) uses :func:`split_of`, so the model never trains on a
calibration or evaluation document and the two workload sets share no document.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

SPLITS = (("train", 0.8), ("calib", 0.1), ("eval", 0.1))


def split_of(group: str, seed: int = 0) -> str:
    """Deterministic split of a source document (all its chunks go to the same split)."""
    u = int.from_bytes(hashlib.sha256(f"{seed}:{group}".encode()).digest()[:8], "big") / 2**64
    edge = 0.0
    for name, share in SPLITS:
        edge += share
        if u < edge:
            return name
    return SPLITS[-1][0]


def load_corpus(path: str | Path, split: str | None = None, seed: int = 0) -> list[dict]:
    """Rows of ``docs.jsonl`` (optionally one split only)."""
    file = Path(path) / "docs.jsonl"
    if not file.exists():
        raise FileNotFoundError(f"{file}: no corpus here (build it: python -m tools.build_corpus --out {path})")
    with open(file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if split is None or split_of(r["group"], seed) == split]


def cell(row: dict) -> str:
    """The (domain, language) label of a row as ``"domain/language"``."""
    return f"{row['domain']}/{row['language']}"
