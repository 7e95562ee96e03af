"""Request signatures: per-(layer, expert) weights, concatenated, L2-normalised.

Six variants (the paper compares them; "idf" is the one ELDR uses):

========== ==================================================  ===================
variant    per-(layer, expert) value before normalisation       input
========== ==================================================  ===================
raw        count                                                 prefill counts
idf        count * idf                                           prefill counts
sqrt       sqrt(count)                                           prefill counts
binary     1 if count > 0 else 0                                 prefill counts
gate_prob  sum over prompt tokens of the gate softmax            gate_prob_sums
gate_logit sum over prompt tokens of the raw gate logits         gate_logit_sums
========== ==================================================  ===================

IDF treats each request as a document and each (layer, expert) as a term. With N
requests and df = number of requests whose count is > 0, the smoothed idf is

    idf = log((1 + N) / (1 + df)) + 1

(scikit-learn's ``smooth_idf`` form): always >= 1 and finite, even for df = 0 or
df = N. The selected layers' vectors are concatenated and the whole vector is
L2-normalised; an all-zero vector stays zero (no NaN).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .traces import TraceSet

COUNT_VARIANTS = ("raw", "idf", "sqrt", "binary")
GATE_VARIANTS = ("gate_prob", "gate_logit")
VARIANTS = COUNT_VARIANTS + GATE_VARIANTS
_GATE_FIELD = {"gate_prob": "gate_prob_sums", "gate_logit": "gate_logit_sums"}


def smoothed_idf(doc_freq: np.ndarray, n_docs: int) -> np.ndarray:
    """``log((1 + n_docs) / (1 + doc_freq)) + 1`` as float32."""
    doc_freq = np.asarray(doc_freq, dtype=np.float64)
    return (np.log((1.0 + n_docs) / (1.0 + doc_freq)) + 1.0).astype(np.float32)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Row-wise L2 normalisation of [..., D] as float32; zero rows stay zero."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:  # one signature (the router's case): no blocks, no temporaries
        norm = float(np.sqrt(np.dot(x.astype(np.float64), x)))
        return x / np.float32(norm) if norm > 0 else np.zeros_like(x)
    flat = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    out = np.zeros_like(flat)
    for s in range(0, flat.shape[0], 4096):  # float64 norms, blockwise (no [N, D] float64 copy)
        block = flat[s:s + 4096]
        norm = np.sqrt(np.einsum("nd,nd->n", block, block, dtype=np.float64)).astype(np.float32)[:, None]
        np.divide(block, norm, out=out[s:s + 4096], where=norm > 0)
    return out.reshape(x.shape)


def weigh(values: np.ndarray, variant: str, idf: np.ndarray | None = None) -> np.ndarray:
    """Apply a variant's per-element transform to [..., L, E] values (float32, unnormalised)."""
    x = np.asarray(values)
    if variant == "raw" or variant in GATE_VARIANTS:
        return x.astype(np.float32)
    if variant == "idf":
        if idf is None:
            raise ValueError("variant 'idf' needs idf weights")
        if idf.shape != x.shape[-2:]:
            raise ValueError(f"idf shape {idf.shape} does not match counts shape {x.shape[-2:]}")
        return x.astype(np.float32) * idf
    if variant == "sqrt":
        return np.sqrt(np.maximum(x, 0), dtype=np.float32)
    if variant == "binary":
        return (x > 0).astype(np.float32)
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


def signature_from_counts(counts: np.ndarray, idf: np.ndarray, variant: str = "idf") -> np.ndarray:
    """Raw counts of the selected layers [n_sel, E] or [B, n_sel, E] -> unit float32 [D] or [B, D].

    ``idf`` is the artifact's [n_sel, E] weights (ignored except for variant "idf").
    This is what the router runs on each signature message from the engine.
    """
    counts = np.asarray(counts)
    if counts.ndim not in (2, 3) or counts.shape[-2:] != tuple(idf.shape):
        raise ValueError(f"counts shape {counts.shape} does not match [n_sel, E] = {tuple(idf.shape)}")
    if variant not in COUNT_VARIANTS:
        raise ValueError(f"variant {variant!r} cannot be built from counts")
    x = weigh(counts, variant, idf)
    return l2_normalize(x.reshape(*counts.shape[:-2], -1))


def variant_input(traces: TraceSet, variant: str) -> np.ndarray:
    """The [N, L, E] array a variant is built from (prefill counts or gate sums)."""
    if variant in COUNT_VARIANTS:
        return traces.prefill_counts
    if variant in GATE_VARIANTS:
        values = getattr(traces, _GATE_FIELD[variant])
        if values is None:
            raise ValueError(f"variant {variant!r} needs field '{_GATE_FIELD[variant]}', absent from the traces")
        return values
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


class SignatureBuilder:
    """Scikit-learn style signature transformer.

    ``fit`` learns the IDF (variant "idf") from [N, L, E] counts over ALL layers, so
    ``idf_`` is [L, E] and does not change with the layer subset. ``transform`` keeps
    ``layers`` (all when None), weighs, concatenates and L2-normalises to
    [N, n_sel * E] float32. Inputs may be arrays or a TraceSet (the variant picks
    the field).
    """

    def __init__(self, variant: str = "idf", layers: Sequence[int] | None = None):
        self.variant = variant
        self.layers = layers

    def fit(self, X: np.ndarray | TraceSet, y=None) -> "SignatureBuilder":
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; expected one of {VARIANTS}")
        X = self._as_array(X)
        n, num_layers, num_experts = X.shape
        self.n_layers_in_, self.n_experts_ = num_layers, num_experts
        self.layers_ = np.arange(num_layers) if self.layers is None else np.asarray(self.layers, dtype=np.int64)
        if self.layers_.size == 0 or self.layers_.min() < 0 or self.layers_.max() >= num_layers:
            raise ValueError(f"layers {self.layers_.tolist()} out of range for {num_layers} layers")
        if self.variant == "idf":
            doc_freq = np.count_nonzero(X, axis=0)
            self.idf_ = smoothed_idf(doc_freq, n)
        else:
            self.idf_ = np.ones((num_layers, num_experts), dtype=np.float32)
        self.n_samples_fit_ = n
        return self

    def transform(self, X: np.ndarray | TraceSet, chunk: int = 4096) -> np.ndarray:
        X = self._as_array(X)
        if not hasattr(self, "idf_"):
            raise RuntimeError("SignatureBuilder is not fitted")
        if X.shape[1:] != (self.n_layers_in_, self.n_experts_):
            raise ValueError(f"input shape {X.shape[1:]} != fitted [L, E] {(self.n_layers_in_, self.n_experts_)}")
        idf = self.selected_idf()
        out = np.empty((X.shape[0], idf.size), dtype=np.float32)
        for start in range(0, X.shape[0], chunk):
            part = X[start:start + chunk][:, self.layers_]
            out[start:start + chunk] = l2_normalize(weigh(part, self.variant, idf).reshape(len(part), -1))
        return out

    def fit_transform(self, X: np.ndarray | TraceSet, y=None) -> np.ndarray:
        return self.fit(X).transform(X)

    def with_layers(self, layers: Sequence[int]) -> "SignatureBuilder":
        """A fitted copy restricted to ``layers`` (same IDF; no refit)."""
        if not hasattr(self, "idf_"):
            raise RuntimeError("SignatureBuilder is not fitted")
        layers_ = np.asarray(layers, dtype=np.int64)
        if layers_.size == 0 or layers_.min() < 0 or layers_.max() >= self.n_layers_in_:
            raise ValueError(f"layers {layers_.tolist()} out of range for {self.n_layers_in_} layers")
        other = SignatureBuilder(self.variant, list(map(int, layers_)))
        other.__dict__.update({k: v for k, v in self.__dict__.items() if k.endswith("_")})
        other.layers_ = layers_
        return other

    def selected_idf(self) -> np.ndarray:
        """IDF of the selected layers, [n_sel, E] (what the artifact stores)."""
        return np.ascontiguousarray(self.idf_[self.layers_])

    def _as_array(self, X: np.ndarray | TraceSet) -> np.ndarray:
        if isinstance(X, TraceSet):
            X = variant_input(X, self.variant)
        X = np.asarray(X)
        if X.ndim != 3:
            raise ValueError(f"expected [N, L, E] input, got shape {X.shape}")
        return X
