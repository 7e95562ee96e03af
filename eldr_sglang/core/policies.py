"""Decode-routing policies: small pure objects shared by the router and the simulator.

Every policy answers one question::

    policy.choose(request, loads, allowed=None) -> server index
    policy.explain(request, loads, allowed=None) -> Decision (same pick + why)

``request`` is a :class:`RouteRequest` (optional unit signature vector, optional
label), ``loads`` the in-flight request count per decode server (index order),
``allowed`` an optional mask of servers that may be picked (e.g. healthy ones; an
all-False or missing mask means "all"). Policies follow a filter -> score -> pick
shape and hold no I/O, clock or asyncio: numpy only, seeded RNG where random.

Servers are identified by their position. ``add_server()`` appends one at the end,
``remove_server(i)`` deletes position ``i`` (later servers shift down by one, like
``list.pop``). Policies with per-server state (eldr's centroid ownership, domain's
label sets) keep that state consistent; the caller keeps its server list in the
same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Mapping, Optional, Sequence

import numpy as np

__all__ = [
    "RouteRequest",
    "Decision",
    "Policy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "JSQPolicy",
    "P2CPolicy",
    "DomainPolicy",
    "CentroidOwnership",
    "EldrPolicy",
    "POLICY_NAMES",
    "make_policy",
]

_EPS = 1e-9


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about a request: its signature and/or its label."""

    signature: Optional[np.ndarray] = None
    label: Optional[str] = None


@dataclass(slots=True)  # not frozen: a frozen __init__ costs ~2 us per decision
class Decision:
    """A pick and why (``Policy.explain``): same index ``choose()`` returns for the same
    state. ``band``/similarities are only set by policies that score servers (eldr)."""

    index: int
    policy: str
    reason: str = ""  # "band" | "no_signature" | "pick"
    band: Optional[tuple[int, ...]] = None  # eldr: allowed servers within s* - tau
    best_similarity: Optional[float] = None  # eldr: s*
    server_similarities: Optional[np.ndarray] = None  # eldr: [N] max over owned centroids
    centroid_similarities: Optional[np.ndarray] = None  # eldr: [K], centroid order

    def top(self, n: int = 3) -> list[tuple[int, float]]:
        """The ``n`` most similar servers as (index, similarity), best first."""
        if self.server_similarities is None:
            return []
        s = self.server_similarities
        order = np.argsort(-s, kind="stable")[:n]
        return [(int(i), float(s[i])) for i in order]


def _candidates(n: int, allowed: Optional[Sequence[bool]]) -> np.ndarray:
    """Filter step: indices that may be picked (all of them if none is allowed)."""
    if n <= 0:
        raise ValueError("no servers to choose from")
    if allowed is None:
        return np.arange(n)
    mask = np.asarray(allowed, dtype=bool)
    if mask.shape != (n,):
        raise ValueError(f"allowed mask has shape {mask.shape}, expected ({n},)")
    idx = np.flatnonzero(mask)
    return idx if idx.size else np.arange(n)


class Policy:
    """Base class. Subclasses implement :meth:`choose`."""

    name: str = "base"
    needs_signature: bool = False

    def choose(
        self,
        request: RouteRequest,
        loads: Sequence[int],
        allowed: Optional[Sequence[bool]] = None,
    ) -> int:
        raise NotImplementedError

    def explain(
        self,
        request: RouteRequest,
        loads: Sequence[int],
        allowed: Optional[Sequence[bool]] = None,
    ) -> Decision:
        """Like :meth:`choose` (same pick, same state change) plus the reason."""
        return Decision(self.choose(request, loads, allowed), self.name, "pick")

    def add_server(self) -> None:
        """A server was appended at the end of the server list."""

    def remove_server(self, index: int) -> None:
        """The server at ``index`` was removed; later servers shift down."""

    def describe(self) -> dict:
        """JSON-able state for status pages."""
        return {"policy": self.name}


class RandomPolicy(Policy):
    """Uniform random among the allowed servers."""

    name = "random"

    def __init__(self, seed: Optional[int] = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def choose(self, request, loads, allowed=None) -> int:
        cand = _candidates(len(loads), allowed)
        return int(cand[self.rng.integers(cand.size)])


class RoundRobinPolicy(Policy):
    """Cycle through server indices, skipping those not allowed."""

    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, request, loads, allowed=None) -> int:
        n = len(loads)
        if n <= 0:
            raise ValueError("no servers to choose from")
        start = self.next % n
        if allowed is None or all(allowed) or not any(allowed):
            if allowed is not None and len(allowed) != n:
                raise ValueError(f"allowed mask has shape ({len(allowed)},), expected ({n},)")
            pick = start
        else:  # first allowed index at or after `start`, wrapping around
            if len(allowed) != n:
                raise ValueError(f"allowed mask has shape ({len(allowed)},), expected ({n},)")
            pick = next(i for i in chain(range(start, n), range(start)) if allowed[i])
        self.next = pick + 1
        return pick

    def remove_server(self, index: int) -> None:
        if self.next > index:
            self.next -= 1


class JSQPolicy(Policy):
    """Join the shortest queue: fewest in-flight; ties broken randomly or by index."""

    name = "jsq"

    def __init__(self, seed: Optional[int] = 0, random_ties: bool = True) -> None:
        self.rng = np.random.default_rng(seed)
        self.random_ties = random_ties

    def choose(self, request, loads, allowed=None) -> int:
        return least_loaded(loads, _candidates(len(loads), allowed),
                            self.rng if self.random_ties else None)


def least_loaded(
    loads: Sequence[int], cand: np.ndarray, rng: Optional[np.random.Generator] = None
) -> int:
    """Pick step shared by jsq/domain/eldr: min load in ``cand``; ties random or lowest."""
    cl = np.asarray(loads, dtype=np.int64)[cand]
    best = cand[cl == cl.min()]
    if rng is None or best.size == 1:
        return int(best[0])
    return int(best[rng.integers(best.size)])


class P2CPolicy(Policy):
    """Power of two choices: sample two distinct allowed servers, keep the less loaded."""

    name = "p2c"

    def __init__(self, seed: Optional[int] = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def choose(self, request, loads, allowed=None) -> int:
        cand = _candidates(len(loads), allowed)
        if cand.size == 1:
            return int(cand[0])
        a, b = self.rng.choice(cand, size=2, replace=False)
        if loads[a] == loads[b]:
            return int(a if self.rng.random() < 0.5 else b)
        return int(a if loads[a] < loads[b] else b)


class DomainPolicy(Policy):
    """Oracle baseline: a label owns a set of servers; least loaded in that set.

    Unknown or missing labels (or a label whose servers are all filtered out) fall
    back to JSQ over all allowed servers.
    """

    name = "domain"

    def __init__(self, domain_map: Mapping[str, Sequence[int]], seed: Optional[int] = 0) -> None:
        self.domain_map = {str(k): sorted({int(i) for i in v}) for k, v in domain_map.items()}
        self.rng = np.random.default_rng(seed)

    def choose(self, request, loads, allowed=None) -> int:
        cand = _candidates(len(loads), allowed)
        servers = self.domain_map.get(request.label) if request.label is not None else None
        if servers:
            inside = np.intersect1d(cand, np.asarray(servers, dtype=np.int64))
            if inside.size:
                cand = inside
        return least_loaded(loads, cand, self.rng)

    def remove_server(self, index: int) -> None:
        self.domain_map = {
            k: [i - (i > index) for i in v if i != index] for k, v in self.domain_map.items()
        }

    def describe(self) -> dict:
        return {"policy": self.name, "domain_map": self.domain_map}


class CentroidOwnership:
    """Which decode server owns which calibration centroid, stable under churn.

    Rules (K centroids, N servers; every centroid always has >= 1 owner while N >= 1):

    - Start: server i owns centroid i for i < min(N, K). Extra centroids (N < K) are
      handed over, in index order, to the owner of their nearest (cosine) owned one;
      extra servers (N > K) share the centroid with the fewest owners (lowest index).
    - Remove server s: a centroid s shares with others just loses s. A centroid only
      s owned is handed to the owner of the nearest centroid (its "next best" region)
      that some other server owns; among several owners, the one with fewest
      centroids. Handed-over centroids are remembered (most recent last).
    - Add server: it takes the most recently handed-over centroid whose owner still
      has more than one centroid (so remove-then-add restores the old partition);
      otherwise any centroid of the server owning the most (>1) centroids, the one
      least similar to that server's other centroids; otherwise (every server owns
      exactly one) it shares the centroid with the fewest owners.

    A server's similarity to a signature is the max over the centroids it owns.
    Co-owners of one centroid tie on similarity, so ELDR's band splits that region's
    traffic between them by load.
    """

    def __init__(self, centroids: np.ndarray, num_servers: int) -> None:
        c = np.asarray(centroids, dtype=np.float32)
        if c.ndim != 2 or c.shape[0] < 1:
            raise ValueError(f"centroids must be [K, D] with K >= 1, got {c.shape}")
        norms = np.linalg.norm(c, axis=1, keepdims=True)
        self.centroids = c / np.maximum(norms, 1e-12)
        self.K = self.centroids.shape[0]
        sim = self.centroids @ self.centroids.T
        # nearest-first order of the other centroids, per centroid
        order = np.argsort(-sim, axis=1, kind="stable")
        self.near = [[int(j) for j in row if j != k] for k, row in enumerate(order)]
        self.csim = sim
        self.homes: list[set[int]] = []  # per server: centroids owned
        self.handed: list[int] = []  # centroids handed over by removals, oldest first
        for _ in range(num_servers):
            self._initial_add()
        self._finish_initial()

    # -- queries -----------------------------------------------------------------
    @property
    def num_servers(self) -> int:
        return len(self.homes)

    def owners(self, k: int) -> list[int]:
        return [s for s, h in enumerate(self.homes) if k in h]

    def server_similarity(self, signature: np.ndarray) -> np.ndarray:
        """[N] similarity per server: max cosine over the centroids it owns."""
        return self.gather(self.centroids @ signature)

    def as_lists(self) -> list[list[int]]:
        return [sorted(h) for h in self.homes]

    # -- churn -------------------------------------------------------------------
    def _rebuild(self) -> None:
        m = np.zeros((len(self.homes), self.K), dtype=bool)
        for s, h in enumerate(self.homes):
            m[s, list(h)] = True
        self.mask = m
        # gather form of the mask: server s owns flat[offsets[s]:offsets[s + 1]]
        lists = [sorted(h) for h in self.homes]
        self.single = all(len(h) == 1 for h in lists)
        self.flat = np.array([k for h in lists for k in h], dtype=np.intp)
        self.offsets = np.cumsum([0] + [len(h) for h in lists[:-1]]).astype(np.intp)

    def gather(self, sims: np.ndarray) -> np.ndarray:
        """[K] centroid similarities -> [N] per-server max over owned centroids."""
        if self.single:
            return sims[self.flat]
        return np.maximum.reduceat(sims[self.flat], self.offsets)

    def _owner_count(self, k: int) -> int:
        return sum(k in h for h in self.homes)

    def _least_shared(self) -> int:
        counts = [self._owner_count(k) for k in range(self.K)]
        return int(np.argmin(counts))

    def _initial_add(self) -> None:
        s = len(self.homes)
        if s < self.K:
            self.homes.append({s})
        else:
            self.homes.append({self._least_shared()})

    def _finish_initial(self) -> None:
        """Hand centroids nobody owns yet (N < K) to the owners of nearest ones."""
        if self.homes:
            for k in range(self.K):
                if self._owner_count(k) == 0:
                    self._give_to_nearest(k)
                    self.handed.append(k)
        self._rebuild()

    def _give_to_nearest(self, k: int, exclude: int = -1) -> None:
        for j in self.near[k]:
            owners = [s for s, h in enumerate(self.homes) if j in h and s != exclude]
            if owners:
                best = min(owners, key=lambda s: (len(self.homes[s]), s))
                self.homes[best].add(k)
                return
        raise RuntimeError("no server left to own a centroid")

    def remove(self, index: int) -> None:
        if not 0 <= index < len(self.homes):
            raise IndexError(index)
        if len(self.homes) == 1:
            self.homes.pop()
            self._rebuild()
            return
        for k in sorted(self.homes[index]):
            if self._owner_count(k) == 1:
                self._give_to_nearest(k, exclude=index)
                if k in self.handed:
                    self.handed.remove(k)
                self.handed.append(k)
        self.homes.pop(index)
        self._rebuild()

    def add(self) -> None:
        if not self.homes:
            self.homes.append(set(range(self.K)))
            self._rebuild()
            return
        take: Optional[int] = None
        for k in reversed(self.handed):
            owners = self.owners(k)
            if len(owners) == 1 and len(self.homes[owners[0]]) > 1:
                take = k
                break
        if take is None:
            s = max(range(len(self.homes)), key=lambda i: (len(self.homes[i]), -i))
            h = self.homes[s]
            if len(h) > 1:
                # the centroid least similar to the rest of this server's region
                take = min(h, key=lambda k: (max(self.csim[k, j] for j in h if j != k), -k))
        if take is not None:
            for h in self.homes:
                h.discard(take)
            if take in self.handed:
                self.handed.remove(take)
            self.homes.append({take})
        else:
            self.homes.append({self._least_shared()})
        self._rebuild()


class EldrPolicy(Policy):
    """ELDR locality band (paper, "Online routing").

    similarity per server = max cosine(signature, centroids it owns); s* = best over
    allowed servers; candidates = allowed servers with similarity >= s* - tau; pick
    the candidate with the fewest in-flight requests (ties: higher similarity, then
    lower index). tau = 0 is strict affinity; tau = 1 is JSQ for count signatures
    (non-negative, so cosine is in [0, 1]). No signature -> JSQ.
    """

    name = "eldr"
    needs_signature = True

    def __init__(self, centroids: np.ndarray, num_servers: int, tau: float = 0.1,
                 seed: Optional[int] = 0) -> None:
        if tau < 0:
            raise ValueError("tau must be >= 0")
        self.tau = float(tau)
        self.ownership = CentroidOwnership(centroids, num_servers)
        self.fallback = JSQPolicy(seed=seed)
        self._C = np.ascontiguousarray(self.ownership.centroids, dtype=np.float32)
        self._dim = int(self._C.shape[1])
        self._sims = np.empty(self._C.shape[0], dtype=np.float32)  # reused by every choose()

    @property
    def dim(self) -> int:
        return self._dim

    def similarities(self, signature: np.ndarray) -> np.ndarray:
        sig = np.asarray(signature, dtype=np.float32).reshape(-1)
        if sig.shape[0] != self.dim:
            raise ValueError(f"signature has {sig.shape[0]} dims, centroids have {self.dim}")
        return self.ownership.server_similarity(sig)

    def _score(self, signature: np.ndarray) -> np.ndarray:
        """[K] cosine to every centroid: one matvec into a preallocated buffer."""
        sig = signature
        if not (isinstance(sig, np.ndarray) and sig.dtype == np.float32 and sig.ndim == 1
                and sig.flags.c_contiguous):
            sig = np.ascontiguousarray(sig, dtype=np.float32).reshape(-1)
        if sig.shape[0] != self._dim:
            raise ValueError(f"signature has {sig.shape[0]} dims, centroids have {self._dim}")
        return np.dot(self._C, sig, out=self._sims)

    # Up to this many servers the pick is a Python scan of the N similarities: measured
    # at N = 24 (benchmark/bench_router_vs_sglang_router.py) it costs ~4 us against
    # ~12 us for the ~9 small numpy calls of the vectorised pick (per-call overhead
    # dominates at this size); beyond it the vectorised pick wins.
    SCAN_MAX = 64

    def _decide(self, request, loads, allowed, want_band: bool = False):
        """(index, band tuple (``want_band``) or None, server sims [N] or None, s* or None).

        Pick rule: fewest in flight, then higher similarity, then lower index, i.e.
        argmin of ``load * 4 - similarity`` over the band (cosine is in [-1, 1], so
        one request of load outweighs any similarity gap; the first index wins
        exact ties)."""
        own = self.ownership
        n = len(loads)
        if n != own.num_servers:
            raise ValueError(f"{n} loads for {own.num_servers} servers")
        if request.signature is None:
            return self.fallback.choose(request, loads, allowed), None, None, None
        ss = own.gather(self._score(request.signature))  # one matvec + gather: [N]
        mask = None
        if allowed is not None:
            if len(allowed) != n:
                raise ValueError(f"allowed mask has shape ({len(allowed)},), expected ({n},)")
            if not all(allowed) and any(allowed):
                mask = allowed
        thr_pad = self.tau + _EPS
        if n <= self.SCAN_MAX:
            sl = ss.tolist()
            if mask is None:
                best = max(sl)
                thr = best - thr_pad
                cand = [i for i, v in enumerate(sl) if v >= thr] if want_band else None
                idx, bk = -1, float("inf")
                for i, v in enumerate(sl):
                    if v >= thr:
                        k = loads[i] * 4.0 - v
                        if k < bk:
                            idx, bk = i, k
            else:
                best = max(v for v, a in zip(sl, mask) if a)
                thr = best - thr_pad
                cand = [i for i, v in enumerate(sl) if v >= thr and mask[i]] if want_band else None
                idx, bk = -1, float("inf")
                for i, v in enumerate(sl):
                    if v >= thr and mask[i]:
                        k = loads[i] * 4.0 - v
                        if k < bk:
                            idx, bk = i, k
            return idx, (tuple(cand) if want_band else None), ss, best
        masked = ss if mask is None else np.where(np.asarray(mask, dtype=bool), ss, -np.inf)
        best = float(masked.max())
        band = masked >= best - thr_pad
        key = np.multiply(loads, 4.0)
        key -= ss
        key[~band] = np.inf
        return (int(key.argmin()), tuple(np.flatnonzero(band).tolist()) if want_band else None,
                ss, best)

    def choose(self, request, loads, allowed=None) -> int:
        return self._decide(request, loads, allowed)[0]

    def explain(self, request, loads, allowed=None) -> Decision:
        idx, band, ss, best = self._decide(request, loads, allowed, want_band=True)
        if ss is None:
            return Decision(idx, self.name, "no_signature")
        # ss is a fresh array (gather); the centroid buffer is reused, hence the copy
        return Decision(idx, self.name, "band", band, best, ss, self._sims.copy())

    def add_server(self) -> None:
        self.ownership.add()

    def remove_server(self, index: int) -> None:
        self.ownership.remove(index)

    def describe(self) -> dict:
        return {"policy": self.name, "tau": self.tau, "num_centroids": self.ownership.K,
                "ownership": self.ownership.as_lists()}


POLICY_NAMES = ("random", "round_robin", "jsq", "p2c", "domain", "eldr")


def make_policy(
    name: str,
    num_servers: int,
    *,
    centroids: Optional[np.ndarray] = None,
    tau: float = 0.1,
    domain_map: Optional[Mapping[str, Sequence[int]]] = None,
    seed: Optional[int] = 0,
) -> Policy:
    """Build a policy by name (``rr``/``power_of_two`` accepted as aliases)."""
    name = {"rr": "round_robin", "power_of_two": "p2c", "shortest_queue": "jsq"}.get(name, name)
    if name == "random":
        return RandomPolicy(seed)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "jsq":
        return JSQPolicy(seed)
    if name == "p2c":
        return P2CPolicy(seed)
    if name == "domain":
        return DomainPolicy(domain_map or {}, seed)
    if name == "eldr":
        if centroids is None:
            raise ValueError("eldr policy needs centroids (a calibration artifact)")
        return EldrPolicy(centroids, num_servers, tau, seed)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
