"""Signature messages from prefill servers: the rendezvous board and encoding.

The message contract (fields, parse, framing) is :mod:`eldr_sglang.core.wire`. The
router turns counts into the unit signature vector with the calibration artifact,
so a new artifact with the same layers needs no engine restart.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Optional, Sequence

import numpy as np

from eldr_sglang.core.artifact import DEFAULT_TAU
from eldr_sglang.core.signature import COUNT_VARIANTS
from eldr_sglang.core.wire import message_bytes, parse_message  # noqa: F401 (parse_message: tests)

REFUSED = "refused"  # a waiter's result that stands for a refused message: its reason


class SignatureError(ValueError):
    """A message that cannot be turned into a signature; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


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

    def refuse(self, room: int, reason: str, detail: str, layers: Any = None) -> bool:
        """A message for ``room`` was refused (authenticated, so it names the room
        truthfully): its waiter, if still waiting, gets a stand-in that the encoder
        refuses with ``reason`` (its request falls back at once). True if it had one."""
        fut = self.waiters.get(room)
        if fut is None or fut.done():
            return False
        fut.set_result({"bootstrap_room": room, "layers": layers if isinstance(layers, list) else None,
                        REFUSED: reason, "detail": detail})
        return True

    def discard(self, room: int) -> None:
        fut = self.waiters.pop(room, None)
        if fut is not None and not fut.done():
            fut.cancel()


def upper_quantile(values: Sequence[float], q: float) -> float:
    """``np.quantile(values, q)`` (linear) for q near 1, from the few largest values only."""
    n = len(values)
    pos = (n - 1) * q
    lo = int(pos)
    top = heapq.nlargest(n - lo, values)  # descending; top[-1] is the lo-th smallest
    a = top[-1]
    b = top[-2] if len(top) > 1 else a
    return float(a + (b - a) * (pos - lo))


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
            self.value = min(self.ceiling, max(self.floor, self.factor * upper_quantile(self.samples, 0.99)))


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
        """SignatureError unless the message's layers and counts shape fit the artifact
        (a refused message's stand-in: its reason)."""
        if REFUSED in msg:
            raise SignatureError(msg[REFUSED], msg.get("detail") or msg[REFUSED])
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


def activation(msg: dict) -> Optional[np.ndarray]:
    """[n_sel * E] probability of each expert in one decode step of the request: its
    prefill counts / prompt tokens (a token routes to top-k distinct experts); None for
    a refused message's stand-in."""
    if REFUSED in msg:
        return None
    counts = np.asarray(msg["counts"])
    tokens = max(float(msg.get("prompt_tokens") or 0), float(counts.max(initial=0)), 1.0)
    return np.multiply(counts.reshape(-1), np.float32(1.0 / tokens), dtype=np.float32, casting="unsafe")


def union(activations: list[np.ndarray]) -> Optional[np.ndarray]:
    """A batch's activation: an expert is used if any item uses it (independent items);
    items without one (None) are left out."""
    activations = [a for a in activations if a is not None]
    if not activations:
        return None
    if len(activations) == 1:
        return activations[0]
    return 1.0 - np.prod([1.0 - np.minimum(a, 1.0) for a in activations], axis=0)


def load_calibration(path: str) -> Any:
    """Load a calibration artifact with the core loader (imported lazily)."""
    from eldr_sglang.core.artifact import load_artifact

    return load_artifact(path)
