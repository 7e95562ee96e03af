"""ELDR: signature similarity to per-server centroids, least loaded within tau of the best."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from eldr_sglang.core.artifact import DEFAULT_TAU
from eldr_sglang.core.policies.balancers import JSQPolicy
from eldr_sglang.core.policies.base import _EPS, Decision, Policy, PolicySpec, register_policy
from eldr_sglang.core.params import Params, param


@dataclass(frozen=True)
class EldrParams(Params):
    """``tau``: the similarity band (cosine); None: the artifact's, else :data:`DEFAULT_TAU`.
    The router's ``--tau`` is an alias of this parameter (:func:`~.base.build_policy`)."""

    tau: Optional[float] = param(None, 0.0, "similarity band (cosine) below the best server; "
                                             "none: the artifact's tau (alias: --tau)")


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

    def similarity_of(self, server: int, signature: np.ndarray) -> float:
        """Server ``server``'s similarity to a float32 signature (max over the centroids it
        owns): one dot per owned centroid instead of the [K, D] matvec."""
        flat = self.flat
        if self.single:
            return float(np.dot(self.centroids[flat[server]], signature))
        end = self.offsets[server + 1] if server + 1 < len(self.offsets) else len(flat)
        return float(max(np.dot(self.centroids[k], signature) for k in flat[self.offsets[server]:end]))

    def similarities_later(self, signature: np.ndarray):
        """``() -> ([N] server similarities, [K] centroid similarities)`` of this ownership as
        it is now (a later membership change does not alter it)."""
        centroids, flat, offsets, single = self.centroids, self.flat, self.offsets, self.single

        def fill():
            cs = centroids @ signature
            return (cs[flat] if single else np.maximum.reduceat(cs[flat], offsets)), cs
        return fill

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

    def __init__(self, centroids: np.ndarray, num_servers: int, tau: float = DEFAULT_TAU,
                 seed: Optional[int] = 0) -> None:
        self.tau = EldrParams(float(tau)).tau  # checked where it is declared
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
    # at N = 24 (git show f0ce8c6:benchmark/bench_router_vs_sglang_router.py, since removed) it costs ~4 us against
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
                picks = range(n)
            else:
                picks = [i for i in range(n) if mask[i]]
                best = max(sl[i] for i in picks)
            thr = best - thr_pad
            cand = [i for i in picks if sl[i] >= thr]  # the band
            idx, bk = -1, float("inf")
            for i in cand:
                k = loads[i] * 4.0 - sl[i]
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


register_policy(PolicySpec(
    "eldr", lambda ctx, prm: EldrPolicy(ctx.centroids, ctx.num_servers,
                                        ctx.effective_tau if prm.tau is None else prm.tau, ctx.seed),
    family="similarity",
    params=EldrParams, needs_artifact=True, rebuild_on_reload=True,
    summary="least loaded among servers within tau of the best centroid similarity"))
