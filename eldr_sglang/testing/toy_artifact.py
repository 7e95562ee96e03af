"""A real calibration artifact for the stub workers' toy model (``toy-moe``: 4 layers, 8 experts, top-2).

Its centroids are :class:`~eldr_sglang.testing.stub_worker.ToyArtifact`'s, one per
topic the stubs publish, so a router loading the file routes ``topic:k`` prompts
to decode server ``k``. Used by the integration tests and the serving benchmarks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from eldr_sglang.core.artifact import CalibrationArtifact
from eldr_sglang.core.traces import ModelSpec
from eldr_sglang.testing.stub_worker import ToyArtifact

TOY_MODEL = ModelSpec("toy-moe", 4, 8, 2)


def toy_calibration_artifact(num_clusters: int, layers: Sequence[int] = (0, 1), tau: float = 0.1) -> CalibrationArtifact:
    """The stubs' ``num_clusters`` topics as an IDF calibration artifact on ``layers``."""
    toy = ToyArtifact(layers=list(layers), num_clusters=num_clusters)
    return CalibrationArtifact(model=TOY_MODEL, variant="idf", layers=list(layers),
                               idf=toy.idf, centroids=toy.centroids, tau=tau)


def save_toy_artifact(path: str | os.PathLike, num_clusters: int, layers: Sequence[int] = (0, 1)) -> str:
    """Write :func:`toy_calibration_artifact` to ``path``; returns the path as a string."""
    toy_calibration_artifact(num_clusters, layers).save(path)
    return str(path)
