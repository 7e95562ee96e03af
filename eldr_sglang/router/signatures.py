"""Signature messages from prefill servers: validation, the rendezvous board, encoding.

Message contract (engine plugin -> router, ``POST /eldr/signature``; a list of
messages is accepted too)::

    {"bootstrap_room": int, "rid": str, "prompt_tokens": int, "cached_tokens": int,
     "layers": [int] * n_sel, "counts": [[int] * E] * n_sel}

``counts`` may also be packed (``{"dtype", "shape", "data": base64}``, see
:mod:`eldr_sglang.core.counts_codec`), as the engine plugin sends it. Only
``bootstrap_room``, ``layers`` and ``counts`` are required. The router turns
counts into the unit signature vector with the calibration artifact, so a new
artifact with the same layers needs no engine restart.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Optional

import numpy as np
import orjson

from eldr_sglang.core.artifact import DEFAULT_TAU
from eldr_sglang.core.counts_codec import unpack_counts
from eldr_sglang.core.signature import COUNT_VARIANTS

MAX_ROOM = 2**64
MAX_RID_CHARS = 512  # SGLang's rids are 32 hex characters; a client's own rid is short too
MAX_LAYERS = 1024  # published layers per message (a model has at most a few hundred)
MAX_NAME_CHARS = 256
MAX_MODEL_BYTES = 1024  # the optional ``model`` object (name, layers, experts, top-k)
# the message contract: any other field is dropped on intake (it would be memory the
# byte cap of the board does not see)
FIELDS = frozenset({"bootstrap_room", "rid", "prompt_tokens", "cached_tokens", "layers", "counts",
                    "model", "model_name"})


class SignatureError(ValueError):
    """A message that cannot be turned into a signature; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_message(obj: Any) -> dict:
    """Validate one signature message (counts become an ndarray); ValueError if malformed."""
    if not isinstance(obj, dict):
        raise ValueError("signature message must be a JSON object")
    room = obj.get("bootstrap_room")
    if not _is_int(room) or not 0 <= room < MAX_ROOM:
        raise ValueError("bootstrap_room must be a non-negative 64-bit integer")
    for key in [k for k in obj if k not in FIELDS]:
        del obj[key]
    layers = obj.get("layers")
    if not isinstance(layers, list) or not set(map(type, layers)) <= {int}:  # C-speed; bools excluded
        raise ValueError("layers must be a list of integers")
    if len(layers) > MAX_LAYERS:
        raise ValueError(f"layers: {len(layers)} entries, at most {MAX_LAYERS}")
    rid = obj.get("rid")
    if rid is not None and (not isinstance(rid, str) or len(rid) > MAX_RID_CHARS):
        raise ValueError(f"rid must be a string of at most {MAX_RID_CHARS} characters")
    _check_model_fields(obj)
    counts = obj.get("counts")
    if isinstance(counts, dict):
        arr = unpack_counts(counts)
    elif isinstance(counts, (list, np.ndarray)):
        try:
            arr = np.array(counts)  # one C pass; ragged rows raise ValueError
        except (ValueError, TypeError):
            raise ValueError("counts rows must be lists of numbers of equal length") from None
    else:
        raise ValueError("counts must be a list of rows (one per layer) or packed counts")
    if arr.ndim != 2 or arr.shape[0] != len(layers) or arr.dtype.kind not in "iuf":
        raise ValueError(f"counts must be numbers shaped [len(layers)={len(layers)}, E], "
                         f"got shape {list(arr.shape)}")
    obj["counts"] = arr  # kept as an array: the encoder needs no second conversion
    for key in ("prompt_tokens", "cached_tokens"):
        if key in obj and obj[key] is not None and not _is_int(obj[key]):
            raise ValueError(f"{key} must be an integer")
    return obj


def preparse(raw: bytes) -> Any:
    """A signature body parsed, each message validated where it can be (its counts an
    array); the parser process runs it for big bodies (JSONDecodeError when invalid)."""
    data = orjson.loads(raw)
    for m in data if isinstance(data, list) else [data]:
        try:
            parse_message(m)
        except ValueError:
            pass  # validated again, refused and counted on intake
    return data


def _check_model_fields(obj: dict) -> None:
    name = obj.get("model_name")
    if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME_CHARS):
        raise ValueError(f"model_name must be a string of at most {MAX_NAME_CHARS} characters")
    model = obj.get("model")
    if model is not None and (not isinstance(model, dict)
                              or len(orjson.dumps(model)) > MAX_MODEL_BYTES):
        raise ValueError(f"model must be an object of at most {MAX_MODEL_BYTES} bytes")


def message_bytes(msg: dict) -> int:
    """Memory a parsed message holds: its counts array, rid, layers and model fields."""
    counts = msg.get("counts")
    size = counts.nbytes if isinstance(counts, np.ndarray) else 0
    size += len(msg.get("rid") or "") + len(msg.get("model_name") or "")
    size += 36 * len(msg.get("layers") or ())  # a list slot and an int object each
    model = msg.get("model")
    if isinstance(model, dict):
        size += MAX_MODEL_BYTES
    return size


class SignatureBoard:
    """Rendezvous of requests (waiting by bootstrap room) and signature messages.

    A message whose room has a waiter resolves it; otherwise it is buffered for
    ``ttl`` seconds so a waiter registered later still gets it, within
    ``max_buffered`` messages and ``max_bytes`` of counts (oldest dropped first).
    Waiters are removed by :meth:`discard` when their request ends (however it
    ends), buffered messages by TTL/size on every post/expect and by the router's
    periodic :meth:`sweep`.
    """

    OVERHEAD = 512  # bytes of a buffered message besides its fields' contents (dict, ints)

    def __init__(self, ttl: float = 10.0, max_buffered: int = 4096, max_bytes: int = 64 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_buffered = max_buffered
        self.max_bytes = max_bytes
        self.clock = clock
        self.waiters: dict[int, asyncio.Future] = {}
        self.buffer: "OrderedDict[int, tuple[float, dict, int]]" = OrderedDict()
        self.buffered_bytes = 0
        self.expired = 0

    @classmethod
    def size_of(cls, msg: dict) -> int:
        return cls.OVERHEAD + message_bytes(msg)

    def sweep(self) -> None:
        """Drop expired buffered messages (and the oldest beyond the bounds)."""
        now = self.clock()
        while self.buffer:
            room, (t, _, size) = next(iter(self.buffer.items()))
            if (now - t < self.ttl and len(self.buffer) <= self.max_buffered
                    and self.buffered_bytes <= self.max_bytes):
                break
            self.buffer.popitem(last=False)
            self.buffered_bytes -= size
            self.expired += 1

    def expect(self, room: int) -> asyncio.Future:
        """Register interest in ``room``; the future resolves to the message."""
        self.sweep()
        fut = asyncio.get_running_loop().create_future()
        early = self.buffer.pop(room, None)
        if early is not None:
            self.buffered_bytes -= early[2]
            fut.set_result(early[1])
        self.waiters[room] = fut
        return fut

    def post(self, msg: dict, buffer: bool = True) -> bool:
        """Deliver a validated message; True if a waiting request got it. Otherwise it
        is buffered (``buffer``) or dropped."""
        room = msg["bootstrap_room"]
        fut = self.waiters.get(room)
        if fut is not None:
            if not fut.done():
                fut.set_result(msg)
            return True
        if buffer:
            size = self.size_of(msg)
            old = self.buffer.pop(room, None)
            if old is not None:
                self.buffered_bytes -= old[2]
            self.buffer[room] = (self.clock(), msg, size)
            self.buffered_bytes += size
            self.sweep()
        return False

    def discard(self, room: int) -> None:
        fut = self.waiters.pop(room, None)
        if fut is not None and not fut.done():
            fut.cancel()


class WaitLimit:
    """The signature wait: ``factor`` x p99 of recent waits, within [``floor``, ``ceiling``].

    Until ``min_samples`` waits were seen (or with ``factor`` 0) it is the ceiling.
    A request whose signature does not come within it falls back (counted)."""

    def __init__(self, ceiling: float, floor: float = 0.5, factor: float = 4.0,
                 window: int = 512, min_samples: int = 32, every: int = 32) -> None:
        self.ceiling, self.floor, self.factor = ceiling, min(floor, ceiling), factor
        self.samples: deque[float] = deque(maxlen=window)
        self.min_samples, self.every = min_samples, every
        self._since = 0
        self.value = ceiling

    def observe(self, waited: float) -> None:
        """A signature arrived after ``waited`` seconds."""
        self.samples.append(waited)
        self._since += 1
        if self.factor > 0 and len(self.samples) >= self.min_samples and self._since >= self.every:
            self._since = 0
            p99 = float(np.quantile(np.fromiter(self.samples, float), 0.99))
            self.value = min(self.ceiling, max(self.floor, self.factor * p99))


class SignatureEncoder:
    """Thin adapter over a calibration artifact (``eldr_sglang.core.artifact``).

    Needs ``artifact.layers``, ``artifact.centroids`` [K, D], optional
    ``artifact.tau`` and ``artifact.signature(counts [n_sel, E]) -> [D]``.
    """

    def __init__(self, artifact: Any) -> None:
        self.artifact = artifact
        self.layers = [int(x) for x in artifact.layers]
        self.centroids = np.asarray(artifact.centroids, dtype=np.float32)
        tau = getattr(artifact, "tau", None)
        self.tau = DEFAULT_TAU if tau is None else float(tau)  # 0 is a valid tau
        idf = getattr(artifact, "idf", None)
        # [n_sel, E] the counts of a message must have (None: not known, not checked)
        self.counts_shape = tuple(np.shape(idf)) if idf is not None and np.ndim(idf) == 2 else None
        # the core's count variants are elementwise weights then an L2 norm: done here in
        # place on the flat counts (a few us), else through artifact.signature()
        variant = getattr(artifact, "variant", None)
        self._variant = variant if variant in COUNT_VARIANTS and self.counts_shape else None
        self._idf = (np.ascontiguousarray(idf, dtype=np.float32).reshape(-1)
                     if self._variant == "idf" else None)

    def check(self, msg: dict) -> None:
        """SignatureError unless the message's layers and counts shape fit the artifact."""
        if msg["layers"] != self.layers:
            raise SignatureError(
                "layer_mismatch", f"message layers {msg['layers']} != artifact {self.layers}")
        shape = np.shape(msg["counts"])
        if self.counts_shape is not None and shape != self.counts_shape:
            raise SignatureError("bad_counts", f"counts shape {list(shape)} != artifact's "
                                 f"{list(self.counts_shape)} (layers x experts)")

    def _weigh(self, counts: np.ndarray) -> np.ndarray:
        """The variant's weights on flat counts (float32, not normalised)."""
        x = counts.reshape(-1)
        v = self._variant
        if v == "idf":
            return np.multiply(x, self._idf, dtype=np.float32, casting="unsafe")
        if v == "sqrt":
            return np.sqrt(x, dtype=np.float32, casting="unsafe")
        if v == "binary":
            return (x > 0).astype(np.float32)
        return x.astype(np.float32)  # raw

    def encode(self, msg: dict) -> np.ndarray:
        self.check(msg)
        try:
            if self._variant is not None:
                vec = self._weigh(np.asarray(msg["counts"]))
            else:
                vec = np.asarray(self.artifact.signature(np.asarray(msg["counts"])),
                                 dtype=np.float32).reshape(-1)
        except Exception as e:  # artifact rejects the shape etc.
            raise SignatureError("bad_counts", f"artifact.signature failed: {e}") from e
        if vec.shape[0] != self.centroids.shape[1]:
            raise SignatureError("bad_counts", f"signature has {vec.shape[0]} dims, "
                                 f"centroids {self.centroids.shape[1]}")
        norm = math.sqrt(float(np.dot(vec, vec)))
        if not math.isfinite(norm) or norm < 1e-12:
            raise SignatureError("empty_signature", "signature is zero or not finite")
        if abs(norm - 1.0) >= 1e-5:
            vec *= np.float32(1.0 / norm)  # a fresh array of ours (weights or the artifact's)
        return vec

    def describe(self) -> dict:
        a = self.artifact
        model = getattr(a, "model", "")
        return {"model": str(getattr(model, "name", model)), "layers": self.layers,
                "num_clusters": int(self.centroids.shape[0]), "dim": int(self.centroids.shape[1]),
                "tau": self.tau}


def combine(vectors: list[np.ndarray]) -> Optional[np.ndarray]:
    """One routing vector for a batch request: normalised sum of its items' signatures."""
    if not vectors:
        return None
    if len(vectors) == 1:
        return vectors[0]
    s = np.sum(vectors, axis=0)
    n = float(np.linalg.norm(s))
    return s / n if n > 1e-12 else vectors[0]


def activation(msg: dict) -> np.ndarray:
    """[n_sel * E] probability of each expert in one decode step of the request: its
    prefill counts / prompt tokens (a token routes to top-k distinct experts)."""
    counts = np.asarray(msg["counts"])
    tokens = max(float(msg.get("prompt_tokens") or 0), float(counts.max(initial=0)), 1.0)
    return np.multiply(counts.reshape(-1), np.float32(1.0 / tokens), dtype=np.float32, casting="unsafe")


def union(activations: list[np.ndarray]) -> Optional[np.ndarray]:
    """A batch's activation: an expert is used if any item uses it (independent items)."""
    if not activations:
        return None
    if len(activations) == 1:
        return activations[0]
    return 1.0 - np.prod([1.0 - np.minimum(a, 1.0) for a in activations], axis=0)


def load_calibration(path: str) -> Any:
    """Load a calibration artifact with the core loader (imported lazily)."""
    from eldr_sglang.core.artifact import load_artifact

    return load_artifact(path)
