"""Signature predictor: prompt token ids -> predicted prefill counts of the selected layers.

A router that must choose a server before prefill (early binding, co-located
servers, a router that commits at arrival) has only the prompt. The predictor is a
per-token expert table: each token id ``t`` has a vector ``w_t`` [n_sel * E] (how
often one occurrence of it routes to each expert of the selected layers), and a
prompt's predicted counts are the sum over its tokens::

    counts_hat = sum_t n_t * w_t = T * m + sum_t n_t * d_t        (T prompt tokens)

``m`` is the global mean per token (the back-off: an unseen token contributes
``m``), ``d_t = w_t - m`` a deviation learned only for tokens seen at calibration.

The table is learned from per-request prefill counts (traces hold counts per
request, not per token), on per-token profiles: ``x_r = bag_r / T_r`` (token shares)
and ``y_r = counts_r / T_r``, so rows of ``x_r`` sum to 1 and ``y_r - m`` is what the
deviations must explain. Two estimators:

* ``ridge`` (default): least squares with a ridge pull towards the back-off,
  ``min ||Y - X W||^2 + lam ||W - 1 m^T||^2``, solved in its dual form
  ``D = X^T (X X^T + lam I)^-1 (Y - m)`` (an N x N system: N requests, any vocabulary),
  ``lam = alpha * mean(diag(X X^T))``;
* ``mean``: each token's deviation is the share-weighted mean of the requests it
  occurs in, shrunk by ``alpha`` pseudo-occurrences of the back-off.

Predictions are clipped at 0. Memory: the deviations of seen tokens only, int8 with
one float32 scale per token (or float16/float32), the seen ids as int32 and ``m``:
about ``n_seen * (n_sel * E + 8)`` bytes (:func:`table_bytes`). Pure numpy (scipy
for the sparse bag of tokens at fit time).
"""

from __future__ import annotations

import base64
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

METHODS = ("ridge", "mean")
DTYPES = ("int8", "float16", "float32")
__all__ = ["SignaturePredictor", "METHODS", "DTYPES", "table_bytes"]


def table_bytes(n_tokens: int, n_layers: int, num_experts: int, dtype: str = "int8") -> int:
    """Bytes of a table holding ``n_tokens`` seen tokens (ids, scales, deviations, mean)."""
    d = n_layers * num_experts
    per = {"int8": d + 4, "float16": 2 * d, "float32": 4 * d}[dtype]
    return int(n_tokens * (per + 4) + 4 * d)


def _bags(token_ids: Sequence[Sequence[int]], vocab: int | None = None):
    """CSR [N, V] of token occurrence counts, and [N] prompt lengths."""
    from scipy import sparse

    lengths = np.array([len(t) for t in token_ids], dtype=np.int64)
    cols = np.concatenate([np.asarray(t, dtype=np.int64).reshape(-1) for t in token_ids]) if len(token_ids) else \
        np.zeros(0, np.int64)
    if cols.size and cols.min() < 0:
        raise ValueError("token ids must be >= 0")
    rows = np.repeat(np.arange(len(token_ids)), lengths)
    v = int(vocab if vocab is not None else (cols.max() + 1 if cols.size else 1))
    bag = sparse.csr_matrix((np.ones(cols.size), (rows, cols)), shape=(len(token_ids), v))
    bag.sum_duplicates()
    return bag, lengths


class SignaturePredictor:
    """Scikit-learn style: ``fit(token_ids, counts)``, ``predict(token_ids)``.

    ``token_ids``: a list of N prompts' token id lists; ``counts``: [N, n_sel, E] raw
    prefill counts of the artifact's selected layers (``traces.prefill_counts[:, layers]``).
    Fitted state: ``shape_`` (n_sel, E), ``mean_`` [D], ``tokens_`` [n_seen] sorted ids,
    ``dev_`` [n_seen, D] deviations (quantised per ``dtype``), ``scale_`` [n_seen].
    """

    def __init__(self, method: str = "ridge", alpha: float = 1.0, dtype: str = "int8") -> None:
        self.method, self.alpha, self.dtype = method, alpha, dtype

    # -- fit -----------------------------------------------------------------------------
    def fit(self, token_ids: Sequence[Sequence[int]], counts: np.ndarray) -> "SignaturePredictor":
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {METHODS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {DTYPES}")
        if not (np.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        counts = np.asarray(counts, dtype=np.float64)
        if counts.ndim != 3 or counts.shape[0] != len(token_ids) or counts.shape[0] == 0:
            raise ValueError(f"counts must be [N, n_sel, E] with N = {len(token_ids)} prompts, got {counts.shape}")
        if any(len(t) == 0 for t in token_ids):
            raise ValueError("every prompt needs at least one token id")
        n = counts.shape[0]
        self.shape_ = tuple(int(s) for s in counts.shape[1:])
        bag, lengths = _bags(token_ids)
        seen = np.flatnonzero(np.diff(bag.tocsc().indptr) > 0)
        bag = bag[:, seen]  # only tokens seen at calibration get a deviation
        y = counts.reshape(n, -1) / lengths[:, None]  # per-token profiles [N, D]
        self.mean_ = (counts.reshape(n, -1).sum(axis=0) / lengths.sum()).astype(np.float32)
        resid = y - self.mean_.astype(np.float64)
        x = bag.multiply(1.0 / lengths[:, None]).tocsr()  # token shares, rows sum to 1
        if self.method == "ridge":
            gram = (x @ x.T).toarray()
            lam = self.alpha * float(np.mean(np.diag(gram)))
            dual = np.linalg.solve(gram + lam * np.eye(n), resid)
            dev = np.asarray(x.T @ dual)  # [V, D]
        else:
            occ = np.asarray(bag.sum(axis=0)).ravel()
            dev = np.asarray(bag.T @ resid) / (occ + self.alpha)[:, None]
        self.tokens_ = seen.astype(np.int32)
        self._store(dev.astype(np.float32))
        self.n_requests_ = n
        return self

    def _store(self, dev: np.ndarray) -> None:
        if self.dtype == "int8":
            scale = np.abs(dev).max(axis=1) / 127.0 if dev.size else np.zeros(0)
            scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
            self.dev_ = np.clip(np.rint(dev / scale[:, None]), -127, 127).astype(np.int8)
            self.scale_ = scale
        else:
            self.dev_ = dev.astype(self.dtype)
            self.scale_ = np.ones(len(dev), dtype=np.float32)

    # -- predict -------------------------------------------------------------------------
    def _check(self) -> None:
        if not hasattr(self, "mean_"):
            raise RuntimeError("SignaturePredictor is not fitted")

    def predict(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """One prompt's token ids -> predicted counts [n_sel, E] float32 (>= 0)."""
        self._check()
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        out = self.mean_ * np.float32(ids.size)
        if ids.size:
            uniq, reps = np.unique(ids, return_counts=True)
            pos = np.searchsorted(self.tokens_, uniq)
            pos = np.minimum(pos, max(len(self.tokens_) - 1, 0))
            hit = (self.tokens_[pos] == uniq) if len(self.tokens_) else np.zeros(uniq.size, bool)
            if hit.any():
                rows, w = pos[hit], (reps[hit] * self.scale_[pos[hit]]).astype(np.float32)
                out = out + w @ self.dev_[rows].astype(np.float32)
        return np.maximum(out, 0.0).reshape(self.shape_)

    def predict_many(self, token_ids: Iterable[Sequence[int]]) -> np.ndarray:
        """N prompts -> [N, n_sel, E]."""
        return np.stack([self.predict(t) for t in token_ids])

    def coverage(self, token_ids: Sequence[int]) -> float:
        """Share of the prompt's tokens the table has seen (1 - back-off share)."""
        self._check()
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if not ids.size or not len(self.tokens_):
            return 0.0
        pos = np.minimum(np.searchsorted(self.tokens_, ids), len(self.tokens_) - 1)
        return float(np.mean(self.tokens_[pos] == ids))

    @property
    def nbytes(self) -> int:
        """Bytes of the fitted table in memory."""
        self._check()
        return int(self.dev_.nbytes + self.scale_.nbytes + self.tokens_.nbytes + self.mean_.nbytes)

    # -- persistence (the artifact's "predictor" field) ---------------------------------
    def to_dict(self) -> dict:
        self._check()
        return {"method": self.method, "alpha": float(self.alpha), "dtype": self.dtype,
                "shape": list(self.shape_), "n_requests": int(self.n_requests_),
                "mean": _enc(self.mean_, "float32"), "tokens": _enc(self.tokens_, "int32"),
                "dev": _enc(self.dev_, self.dtype), "scale": _enc(self.scale_, "float32")}

    def digest_bytes(self) -> bytes:
        """What the artifact checksum covers."""
        d = self.to_dict()
        head = f"{d['method']}|{d['alpha']!r}|{d['dtype']}|{d['shape']}".encode()
        return head + b"".join(np.ascontiguousarray(a).tobytes()
                               for a in (self.mean_, self.tokens_, self.dev_, self.scale_))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "predictor") -> "SignaturePredictor":
        try:
            p = cls(str(d["method"]), float(d["alpha"]), str(d["dtype"]))
            p.shape_ = tuple(int(s) for s in d["shape"])
            p.n_requests_ = int(d.get("n_requests", 0))
            p.mean_ = _dec(d["mean"], "float32", f"{source}.mean")
            p.tokens_ = _dec(d["tokens"], "int32", f"{source}.tokens")
            p.dev_ = _dec(d["dev"], p.dtype, f"{source}.dev")
            p.scale_ = _dec(d["scale"], "float32", f"{source}.scale")
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{source}: malformed predictor ({exc!r})") from None
        dim = int(np.prod(p.shape_)) if len(p.shape_) == 2 else -1
        n = len(p.tokens_)
        if p.method not in METHODS or p.dtype not in DTYPES:
            raise ValueError(f"{source}: unknown method {p.method!r} or dtype {p.dtype!r}")
        if dim <= 0 or p.mean_.shape != (dim,) or p.dev_.shape != (n, dim) or p.scale_.shape != (n,):
            raise ValueError(f"{source}: shapes disagree (shape {list(p.shape_)}, mean {p.mean_.shape}, "
                             f"dev {p.dev_.shape}, scale {p.scale_.shape}, tokens {p.tokens_.shape})")
        if n > 1 and not (np.diff(p.tokens_) > 0).all():
            raise ValueError(f"{source}: token ids must be sorted and distinct")
        if not (np.isfinite(p.mean_).all() and np.isfinite(p.scale_).all()
                and np.isfinite(p.dev_.astype(np.float32)).all()):
            raise ValueError(f"{source}: non-finite values")
        return p


def _enc(a: np.ndarray, dtype: str) -> dict:
    a = np.ascontiguousarray(a, dtype=np.dtype(dtype).newbyteorder("<"))
    return {"dtype": dtype, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}


def _dec(obj: Any, dtype: str, name: str) -> np.ndarray:
    if not isinstance(obj, Mapping) or obj.get("dtype") != dtype:
        raise ValueError(f"{name}: expected an encoded {dtype} array")
    try:
        raw = base64.b64decode(obj["data"], validate=True)
        shape = tuple(int(s) for s in obj["shape"])
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{name}: bad data/shape ({exc})") from None
    dt = np.dtype(dtype).newbyteorder("<")
    if len(raw) != dt.itemsize * int(np.prod(shape)):
        raise ValueError(f"{name}: {len(raw)} bytes do not fill shape {list(shape)}")
    return np.frombuffer(raw, dtype=dt).reshape(shape).astype(dtype)
