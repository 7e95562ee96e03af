"""State-aware decode routing: price what each server is running right now.

Every server keeps the expected expert activation of its live requests on the
published layers, where ``p_r`` [n_sel * E] is request ``r``'s probability of using
each expert in one decode step (its prefill counts / prompt tokens: a token routes to
``top_k`` distinct experts per layer). The probability that no live request of server
``s`` uses an expert is ``free[s] = prod_r (1 - p_r)``; a batch's expected distinct
experts is ``U[s] = sum(1 - free[s])`` (the simulator's expected-union formula), and a
new request adds ``dU = free[s] @ p`` of them: one [N, D] matvec per decision.

The state is kept so that it cannot drift: ``log_free[s] = sum_r log(1 - p_r)`` in
float64 (``p`` clamped to ``[0, P_MAX]``, NaN as 0, so every term is finite), so a
release is an exact subtraction of what its admit added; ``free = exp(log_free)``
(float32, for the matvec) and ``U = D - sum(free)`` (float32 exp and sum: within ~1e-3
experts at D = 6,144) are derived from it when a decision reads a server that changed
(the locality pick reads only its band's). A server that empties is reset to exactly zero, and
every :data:`RESET_EVERY` releases of a server its sums are recomputed from its live
requests. (A float32 product multiplied on admit and divided on release underflowed
under concentrated load and could not be divided back: a server's distinct experts
went negative, its cost too, and it drew every request.)

Engine-reported batches (:meth:`StateAwarePolicy.observe_engine`): a decode server's
engine reports what its whole batch uses, every router replica's requests included.
The server's price then uses ``engine + (own now - own at the report)``: the true
batch at the report plus this router's admits and releases since, in the same log
domain (clamped at 0: nothing is more than free). Per-server step laws fitted from
the engines' step samples replace the default law for that server
(:meth:`StateAwarePolicy.set_step_law`).

Score of joining server ``s`` = the increase of the total token time of its batch,
``(B + 1) t(B + 1, U + dU) - B t(B, U)`` with ``t = base + per_seq B + per_expert U``
(the cost model's step time without the KV term), plus a queue term when the
batch is full (``B >= max_batch``: the request waits about ``(B - max_batch + 1)``
steps). The cheapest allowed server wins; with an artifact, ties go to the higher
centroid similarity. No calibration is needed without one, and it follows any
number of servers. A decision never raises on a valid request: probabilities that
are not numbers are priced as zero, and costs that are not numbers (they cannot come
from this state) are a counted fallback to the least loaded server (``Decision.fallback``).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Optional

import numpy as np

from eldr_sglang.core.policies.base import (Decision, Policy, PolicySpec, _candidates,
                                            least_loaded, register_policy)
from eldr_sglang.core.step_law import StepCost, marginal_seconds

P_MAX = 1.0 - 1e-6  # an expert used by every token still leaves 1 - p > 0: log(1 - p) >= -13.8
_P_MAX32 = np.float32(P_MAX)
LOG_FREE_MIN = -80.0  # exp(log_free) is computed from max(log_free, this)
_LOG_FREE_MIN32 = np.float32(LOG_FREE_MIN)
RESET_EVERY = 4096  # releases of one server between two recomputes of its sums from its live requests


class _Live:
    """A live request's token: its server and the log(1 - p) its admit added (float64 [D])."""

    __slots__ = ("server", "log_q")

    def __init__(self, server: "_Server", log_q: np.ndarray) -> None:
        self.server, self.log_q = server, log_q


class _Server:
    __slots__ = ("live", "tokens", "releases")

    def __init__(self) -> None:
        self.live = 0  # live requests with an activation
        self.tokens: set[_Live] = set()  # their tokens
        self.releases = 0  # since the last recompute of its sums


_BOUNDS32: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # size -> (zeros, P_MAX) float32 rows


def _bounds32(n: int) -> tuple[np.ndarray, np.ndarray]:
    b = _BOUNDS32.get(n)
    if b is None:
        if len(_BOUNDS32) > 8:  # a few activation sizes per process; never grows without bound
            _BOUNDS32.clear()
        b = _BOUNDS32[n] = (np.zeros(n, dtype=np.float32), np.full(n, _P_MAX32, dtype=np.float32))
        for a in b:
            a.flags.writeable = False
    return b


def unused_log(p: np.ndarray) -> np.ndarray:
    """``log(1 - p)`` (float64 of a float32 log1p) with ``p`` clamped to ``[0, P_MAX]``
    (-inf and NaN: 0, +inf: ``P_MAX``), so every term is <= 0 and finite: a server's sums
    never hold a value that is not a number."""
    if p.dtype == np.float32 and p.ndim == 1:
        # the same clamps against constant rows: numpy's fmax/fmin with an array operand
        # take their SIMD loop, with a scalar one ~2-3x slower at D = 6,144
        lo, hi = _bounds32(p.shape[0])
        q = np.fmax(p, lo)
        np.fmin(q, hi, out=q)
    else:
        q = np.fmax(p, np.float32(0.0))
        np.fmin(q, _P_MAX32, out=q)
    np.negative(q, out=q)
    np.log1p(q, out=q)
    return q.astype(np.float64)  # float64 += float64 is ~4x faster than += float32


class StateAwarePolicy(Policy):
    """Least predicted increase of total decode time (see the module docstring)."""

    name = "state_aware"
    needs_signature = True
    uses_activation = True

    def __init__(self, num_servers: int, dim: Optional[int] = None, cost: StepCost = StepCost(),
                 centroids: Optional[np.ndarray] = None) -> None:
        self.cost = cost
        self.dim = dim
        self.servers = [_Server() for _ in range(num_servers)]
        self.log_free: Optional[np.ndarray] = None  # [N, D] float64 sum of log(1 - p) over live requests
        self.free: Optional[np.ndarray] = None  # [N, D] float32 exp(log_free), for the matvec
        self.unique: Optional[np.ndarray] = None  # [N] float64 expected distinct experts
        self._stale: set[int] = set()  # servers whose free/unique lag log_free
        self.offset: Optional[np.ndarray] = None  # [N, D] engine report - own log_free at the report
        self._reported: set[int] = set()  # servers with an engine report (offset row in use)
        self.laws: list[Optional[StepCost]] = [None] * num_servers  # per-server step laws (None: cost)
        self.fallbacks: dict[str, int] = {}  # decisions that could not use the costs, by reason
        # every server is priced at once (_cost_array) unless a subclass prices servers its own way
        self._inline_score = type(self)._score is StateAwarePolicy._score
        self._law_cache: Optional[tuple] = None  # _law_arrays()
        self.centroids = None
        if centroids is not None:
            c = np.asarray(centroids, dtype=np.float32)
            self.centroids = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)
        if dim is not None:
            self._ensure(dim)

    # ------------------------------------------------------------ state
    def _ensure(self, dim: int) -> None:
        if self.log_free is None:
            n = len(self.servers)
            self.dim = dim
            self.log_free = np.zeros((n, dim))
            self.free = np.ones((n, dim), dtype=np.float32)
            self.unique = np.zeros(n)
            self.offset = np.zeros((n, dim))
            self._floor = np.full(dim, _LOG_FREE_MIN32)  # _refresh's clamp as an array operand (SIMD)
            self._floor.flags.writeable = False
        elif dim != self.dim:
            raise ValueError(f"activation has {dim} dims, the policy tracks {self.dim}")

    @staticmethod
    def _vector(p: Any) -> np.ndarray:
        v = np.asarray(p).reshape(-1)
        return v if v.dtype == np.float32 else v.astype(np.float32)

    def admit(self, index: int, request) -> Any:
        if request.activation is None:
            return None
        p = self._vector(request.activation)
        self._ensure(p.size)
        s = self.servers[index]
        tok = _Live(s, unused_log(p))
        row = self.log_free[index]  # a view: ``log_free[i] += x`` also copies the row onto itself
        row += tok.log_q
        s.tokens.add(tok)
        s.live += 1
        self._stale.add(index)
        return tok

    def release(self, token: Any) -> None:
        if token is None:
            return
        s = token.server
        if token not in s.tokens:  # released already
            return
        s.tokens.discard(token)
        s.live -= 1
        try:
            i = self.servers.index(s)
        except ValueError:  # its server was removed meanwhile
            return
        s.releases += 1
        if not s.tokens and i not in self._reported:  # exactly idle
            self.log_free[i] = 0.0
            self.free[i] = 1.0
            self.unique[i] = 0.0
            s.releases = 0
            self._stale.discard(i)
            return
        if not s.tokens:
            self.log_free[i] = 0.0
            s.releases = 0
        elif s.releases >= RESET_EVERY:  # drop the rounding of many additions
            self.log_free[i] = self._recomputed(s)
            s.releases = 0
        else:
            row = self.log_free[i]
            row -= token.log_q
        self._stale.add(i)

    @staticmethod
    def _recomputed(s: _Server) -> np.ndarray:
        """float64 sum of the live requests' log(1 - p), from scratch."""
        total = None
        for t in s.tokens:
            total = t.log_q.copy() if total is None else np.add(total, t.log_q, out=total)
        return total

    def _refresh(self, only: Optional[list[int]] = None) -> None:
        """``free`` and ``unique`` of the servers that changed, from ``log_free`` (``only``:
        of those among these servers; the others stay stale until they are read)."""
        stale = self._stale
        if not stale:
            return
        if only is None:
            rows = list(stale)
            stale.clear()
        else:
            rows = [i for i in only if i in stale]
            if not rows:
                return
            stale.difference_update(rows)
        # row by row in float32, in place in the free rows: log_free (plus the engine report's
        # offset, clamped at 0: nothing is more than free) clamped at LOG_FREE_MIN, then exp
        # (exp of a very negative number is both ~0 and slow: numpy leaves its SIMD path below
        # the normal range; the error per expert is below e^-80 ~ 2e-35)
        dim, unique, log_free, free, floor = self.dim, self.unique, self.log_free, self.free, self._floor
        reported, offset = self._reported, self.offset
        for i in rows:
            f = free[i]
            if i in reported:
                np.copyto(f, log_free[i] + offset[i], casting="same_kind")
                np.minimum(f, np.float32(0.0), out=f)
            else:
                np.copyto(f, log_free[i], casting="same_kind")
            np.maximum(f, floor, out=f)
            np.exp(f, out=f)
            unique[i] = dim - float(f.sum())

    # ------------------------------------------------------------ engine reports
    def observe_engine(self, index: int, log_free: Optional[np.ndarray]) -> None:
        """Server ``index``'s engine reported its whole batch: ``log_free`` [D] (float64,
        ``log`` of the probability that the batch leaves each expert unused), or None to
        forget the report (the engine stopped reporting). Prices use it plus this
        policy's own admits and releases from now on."""
        if log_free is None:
            if self.offset is not None:
                self.offset[index] = 0.0
            self._reported.discard(index)
        else:
            v = np.asarray(log_free, dtype=np.float64).reshape(-1)
            self._ensure(v.size)
            self.offset[index] = np.fmin(np.nan_to_num(v, nan=0.0), 0.0) - self.log_free[index]
            self._reported.add(index)
        self._stale.add(index)

    def set_step_law(self, index: int, law: Optional[StepCost]) -> None:
        """Price server ``index`` with ``law`` (fitted from its engine's steps), or with
        the policy's own cost again (None)."""
        self.laws[index] = law
        self._law_cache = None

    def expected_unique(self) -> np.ndarray:
        """[N] expected distinct experts of each server's live batch (published layers)."""
        if self.log_free is None:
            return np.zeros(len(self.servers))
        self._refresh()
        return self.unique.copy()

    def add_server(self) -> None:
        self.servers.append(_Server())
        self.laws.append(None)
        self._law_cache = None
        if self.log_free is not None:
            self.offset = np.vstack([self.offset, np.zeros((1, self.dim))])
            self.log_free = np.vstack([self.log_free, np.zeros((1, self.dim))])
            self.free = np.vstack([self.free, np.ones((1, self.dim), dtype=np.float32)])
            self.unique = np.append(self.unique, 0.0)

    def remove_server(self, index: int) -> None:
        self.servers.pop(index)
        self.laws.pop(index)
        self._law_cache = None
        self._reported = {i - (i > index) for i in self._reported if i != index}
        if self.log_free is not None:
            self.offset = np.delete(self.offset, index, axis=0)
            self.log_free = np.delete(self.log_free, index, axis=0)
            self.free = np.delete(self.free, index, axis=0)
            self.unique = np.delete(self.unique, index)
            self._stale = {i - (i > index) for i in self._stale if i != index}

    # ------------------------------------------------------------ decision
    def _added_experts(self, p: np.ndarray) -> list[float]:
        """[N] expected distinct experts ``p`` adds to each server's batch: one matvec
        (probabilities that are not numbers count as zero)."""
        du = np.dot(self.free, p).tolist()
        if not math.isfinite(sum(du)):
            p = np.nan_to_num(p, nan=0.0, posinf=1.0, neginf=0.0)
            du = np.dot(self.free, p).tolist()
        return du

    # From this many servers every server is priced with numpy (:meth:`_cost_array`, the same
    # floats as the loop below); below it the loop over Python floats is cheaper (measured on
    # one process, explain at 6,144 dimensions: numpy 1.7x the loop's time at 4 servers,
    # 1.2x at 16 and 24, about even at 32, 0.82-0.85x at 64).
    VECTOR_MIN = 32

    def _vectorised(self, n: int) -> bool:
        return n >= self.VECTOR_MIN and self._inline_score

    def _law_arrays(self) -> tuple:
        """(base_s, per_seq_s, per_expert_s, max_batch) of every server: the policy's law as
        scalars while no server has its own, else [N] arrays (cached until a law or the
        membership changes)."""
        law = self._law_cache
        if law is None:
            if not any(self.laws):
                c = self.cost
                law = (c.base_s, c.per_seq_s, c.per_expert_s, c.max_batch)
            else:
                laws = [x or self.cost for x in self.laws]
                law = tuple(np.array([getattr(x, f) for x in laws], dtype=np.float64)
                            for f in ("base_s", "per_seq_s", "per_expert_s", "max_batch"))
            self._law_cache = law
        return law

    def _cost_array(self, request, loads) -> np.ndarray:
        """[N] float64 score of every server: :func:`~eldr_sglang.core.step_law.marginal_seconds`
        on arrays (the same floats as :meth:`_score` server by server)."""
        n = len(loads)
        if request.activation is None or self.log_free is None:
            du = np.zeros(n)
            if self.log_free is None:
                u = np.zeros(n)
            else:
                self._refresh()
                u = self.unique
        else:
            p = self._vector(request.activation)
            self._ensure(p.size)
            self._refresh()
            u = self.unique
            du = np.dot(self.free, p)
            if not np.isfinite(du).all():
                du = np.dot(self.free, np.nan_to_num(p, nan=0.0, posinf=1.0, neginf=0.0))
            du = du.astype(np.float64)
        return marginal_seconds(*self._law_arrays(), np.asarray(loads, dtype=np.float64), u, du)

    def _costs(self, request, loads, rows: Optional[list[int]] = None) -> list[float]:
        """Per-server score as Python floats (a loop over N beats ~15 small numpy calls up to
        :data:`VECTOR_MIN` servers, :meth:`_cost_array` beyond); ``rows``: score only these
        servers (the others come back as +inf), one short matvec instead of the [N, D] one."""
        n = len(loads)
        if rows is None or len(rows) >= n:
            rows = None
            if n >= self.VECTOR_MIN and self._inline_score:  # _vectorised, without the call
                return self._cost_array(request, loads).tolist()
        if request.activation is None or self.log_free is None:
            du = [0.0] * n
            u = [0.0] * n if self.log_free is None else self._unique_list()
        else:
            p = self._vector(request.activation)
            self._ensure(p.size)
            self._refresh(rows)
            u = self.unique.tolist()
            if rows is not None:
                du = [0.0] * n
                free = self.free
                part = [float(np.dot(free[i], p)) for i in rows]
                if not math.isfinite(sum(part)):
                    q = np.nan_to_num(p, nan=0.0, posinf=1.0, neginf=0.0)
                    part = [float(np.dot(free[i], q)) for i in rows]
                for i, d in zip(rows, part):
                    du[i] = d
            else:
                du = self._added_experts(p)
        if self._inline_score and not any(self.laws):  # one law: marginal_seconds, one call per server
            c = self.cost
            base, ps, pe, full, price = c.base_s, c.per_seq_s, c.per_expert_s, c.max_batch, marginal_seconds
            if rows is None:
                return [price(base, ps, pe, full, loads[k], u[k], du[k]) for k in range(n)]
            out = [math.inf] * n
            for k in rows:
                out[k] = price(base, ps, pe, full, loads[k], u[k], du[k])
            return out
        score = self._score
        if rows is None:
            return [score(k, loads[k], u[k], du[k]) for k in range(n)]
        out = [math.inf] * n
        for k in rows:
            out[k] = score(k, loads[k], u[k], du[k])
        return out

    def _score(self, k: int, b: int, ui: float, dui: float) -> float:
        """Server ``k``'s price (:func:`~eldr_sglang.core.step_law.marginal_seconds`): its
        fitted law if it has one, else the policy's."""
        return (self.laws[k] or self.cost).marginal(b, ui, dui)

    def _unique_list(self) -> list[float]:
        self._refresh()
        return self.unique.tolist()

    def scores(self, request, loads) -> np.ndarray:
        """[N] predicted increase of total token time (s) if the request joins each server."""
        return np.asarray(self._costs(request, loads))

    def _fallback(self, reason: str, loads, cand: list[int], sims=None) -> Decision:
        """A decision the costs could not make: the least loaded candidate, counted."""
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        idx = least_loaded(loads, np.asarray(cand, dtype=np.intp))
        return Decision(idx, self.name, "fallback", fallback=reason, centroid_similarities=sims)

    def explain(self, request, loads, allowed=None) -> Decision:
        n = len(loads)
        if n != len(self.servers):
            raise ValueError(f"{n} loads for {len(self.servers)} servers")
        cand = _candidates(n, allowed).tolist()
        costs = self._costs(request, loads)
        if not math.isfinite(sum(costs)):
            return self._fallback("degenerate_cost", loads, cand)
        sims = None
        if self.centroids is not None and request.signature is not None:
            sims = self.centroids @ np.asarray(request.signature, dtype=np.float32).reshape(-1)
            if sims.shape[0] == n:  # one centroid per server: ties to the more similar
                sl = sims.tolist()
                costs = [x - 1e-9 * v for x, v in zip(costs, sl)]
        idx = min(cand, key=costs.__getitem__)
        return Decision(idx, self.name, "cost" if request.activation is not None else "no_activation",
                        server_similarities=-np.asarray(costs), centroid_similarities=sims)

    def choose(self, request, loads, allowed=None) -> int:
        return self.explain(request, loads, allowed).index

    def describe(self) -> dict:
        return {"policy": self.name, "cost": asdict(self.cost),
                "laws": [None if law is None else asdict(law) for law in self.laws],
                "engine_reported": sorted(self._reported),
                "live": [s.live for s in self.servers],
                "expected_unique": (None if self.log_free is None
                                    else self.expected_unique().round(2).tolist()),
                "fallbacks": dict(self.fallbacks)}


register_policy(PolicySpec(
    "state_aware", lambda ctx, prm: StateAwarePolicy(ctx.num_servers, cost=prm, centroids=ctx.centroids),
    aliases=("cost",), params=StepCost, uses_artifact=True, family="cost",
    summary="least predicted increase of decode time given each server's live batch"))
