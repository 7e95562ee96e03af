"""Numeric core of eldr-sglang (numpy / scipy / scikit-learn only).

Traces -> signatures -> layer selection -> balanced clustering -> artifact.
"""

from .artifact import DEFAULT_TAU, FORMAT_VERSION, CalibrationArtifact, creation_info, load_artifact
from .clustering import BalancedKMeans, balanced_assignment, is_optimal_assignment
from .layer_selection import (
    LayerSelection,
    greedy_layer_selection,
    pair_cosine,
    pair_weighted_jaccard,
    sample_pairs,
    select_layers,
    spearman,
)
from .signature import (
    COUNT_VARIANTS,
    VARIANTS,
    SignatureBuilder,
    l2_normalize,
    signature_from_counts,
    smoothed_idf,
    variant_input,
)
from .synthetic import SyntheticTraces, make_synthetic_traces
from .traces import (
    ModelSpec,
    TraceRecord,
    TraceSet,
    TraceWriter,
    concat_traces,
    iter_traces,
    load_traces,
    read_shard,
    write_traces,
)

__all__ = [
    "DEFAULT_TAU", "FORMAT_VERSION", "CalibrationArtifact", "creation_info", "load_artifact",
    "BalancedKMeans", "balanced_assignment", "is_optimal_assignment",
    "LayerSelection", "greedy_layer_selection", "pair_cosine", "pair_weighted_jaccard", "sample_pairs",
    "select_layers", "spearman",
    "COUNT_VARIANTS", "VARIANTS", "SignatureBuilder", "l2_normalize", "signature_from_counts", "smoothed_idf",
    "variant_input",
    "SyntheticTraces", "make_synthetic_traces",
    "ModelSpec", "TraceRecord", "TraceSet", "TraceWriter", "concat_traces", "iter_traces", "load_traces",
    "read_shard", "write_traces",
]
