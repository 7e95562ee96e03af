"""Numeric core of eldr-sglang (numpy / scipy / scikit-learn only).

Traces -> signatures -> layer selection -> balanced clustering -> artifact;
routing policies. Names are imported lazily, so the router (artifact and
policies only) does not pay for scikit-learn at start-up.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "artifact": ["DEFAULT_TAU", "FORMAT_VERSION", "CalibrationArtifact", "creation_info", "load_artifact"],
    "clustering": ["BalancedKMeans", "balanced_assignment", "is_optimal_assignment"],
    "layer_selection": ["LayerSelection", "greedy_layer_selection", "pair_cosine", "pair_weighted_jaccard",
                        "sample_pairs", "select_layers", "spearman"],
    "signature": ["COUNT_VARIANTS", "VARIANTS", "SignatureBuilder", "l2_normalize", "signature_from_counts",
                  "smoothed_idf", "variant_input"],
    "synthetic": ["SyntheticTraces", "make_synthetic_traces"],
    "traces": ["ModelSpec", "TraceDirNotEmpty", "TraceRecord", "TraceSet", "TraceWriter", "concat_traces",
               "iter_traces", "load_traces", "read_shard", "write_traces"],
    "policies": ["RouteRequest", "make_policy"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
