"""State-aware decode routing: price what each server is running right now.

Every server keeps the expected expert activation of its live requests on the
published layers: ``free[s] = prod_r (1 - p_r)`` over the requests it runs, where
``p_r`` [n_sel * E] is request ``r``'s probability of using each expert in one
decode step (its prefill counts / prompt tokens: a token routes to ``top_k``
distinct experts per layer). A batch's expected distinct experts is then
``sum(1 - free[s])`` (the simulator's expected-union formula), and a new request
adds ``free[s] @ p`` of them: one [N, D] matvec per decision, ``free`` updated in
place on :meth:`admit` / :meth:`release`.

Score of joining server ``s`` = the increase of the total token time of its batch,
``(B + 1) t(B + 1, U + dU) - B t(B, U)`` with ``t = base + per_seq B + per_expert U``
(the cost model's step time without the KV term), plus a queue term when the
batch is full (``B >= max_batch``: the request waits about ``(B - max_batch + 1)``
steps). The cheapest allowed server wins; with an artifact, ties go to the higher
centroid similarity. No calibration is needed without one, and it follows any
number of servers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import numpy as np

from eldr_sglang.core.policies.base import (Decision, Policy, PolicySpec, _candidates,
                                            register_policy)

P_MAX = 1.0 - 1e-6  # an expert used by every token still leaves 1 - p > 0


@dataclass(frozen=True)
class StepCost:
    """Decode step time ``base_s + per_seq_s * B + per_expert_s * U`` (seconds), ``U`` the
    expected distinct experts summed over the published layers. Defaults: Qwen3-30B-A3B
    on one MI300X with 2 published layers, from the simulator's cost model
    (``eldr_sglang.sim.cost_model.step_cost``; a test keeps them equal)."""

    base_s: float = 0.006318
    per_seq_s: float = 1.74e-05
    per_expert_s: float = 5.698e-05
    max_batch: int = 256


class _Server:
    __slots__ = ("live",)

    def __init__(self) -> None:
        self.live = 0


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
        self.free: Optional[np.ndarray] = None  # [N, D] float32 prod (1 - p) over live requests
        self.free_sum: Optional[np.ndarray] = None  # [N] float64 row sums of free (kept in step)
        self.centroids = None
        if centroids is not None:
            c = np.asarray(centroids, dtype=np.float32)
            self.centroids = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)
        if dim is not None:
            self._ensure(dim)

    # ------------------------------------------------------------ state
    def _ensure(self, dim: int) -> None:
        if self.free is None:
            self.dim = dim
            self.free = np.ones((len(self.servers), dim), dtype=np.float32)
            self.free_sum = np.full(len(self.servers), float(dim))
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
        q = 1.0 - np.minimum(p, np.float32(P_MAX))
        s = self.servers[index]
        row = self.free[index]
        self.free_sum[index] -= float(np.dot(row, p))  # the experts this request adds
        row *= q
        s.live += 1
        return (s, q)

    def release(self, token: Any) -> None:
        if token is None:
            return
        s, q = token
        try:
            i = self.servers.index(s)
        except ValueError:  # its server was removed meanwhile
            return
        s.live -= 1
        if s.live <= 0:
            s.live = 0
            self.free[i] = 1.0  # drop accumulated rounding
        else:
            self.free[i] /= q
        self.free_sum[i] = float(self.free[i].sum(dtype=np.float64))

    def add_server(self) -> None:
        self.servers.append(_Server())
        if self.free is not None:
            self.free = np.vstack([self.free, np.ones((1, self.dim), dtype=np.float32)])
            self.free_sum = np.append(self.free_sum, float(self.dim))

    def remove_server(self, index: int) -> None:
        self.servers.pop(index)
        if self.free is not None:
            self.free = np.delete(self.free, index, axis=0)
            self.free_sum = np.delete(self.free_sum, index)

    def expected_unique(self) -> np.ndarray:
        """[N] expected distinct experts of each server's live batch (published layers)."""
        if self.free is None:
            return np.zeros(len(self.servers))
        return self.dim - self.free_sum

    # ------------------------------------------------------------ decision
    def _added_experts(self, p: np.ndarray) -> list[float]:
        """[N] expected distinct experts ``p`` adds to each server's batch: one matvec."""
        return (self.free @ p).tolist()

    def _costs(self, request, loads) -> list[float]:
        """Per-server score as Python floats (a loop over N beats ~15 small numpy calls)."""
        c = self.cost
        n = len(loads)
        if request.activation is None or self.free is None:
            du = u = [0.0] * n
        else:
            p = self._vector(request.activation)
            self._ensure(p.size)
            du = self._added_experts(p)
            u = (self.dim - self.free_sum).tolist()
        base, ps, pe, mb = c.base_s, c.per_seq_s, c.per_expert_s, c.max_batch
        out = []
        for b, ui, dui in zip(loads, u, du):
            t0 = base + ps * b + pe * ui
            t1 = t0 + ps + pe * dui
            score = (b + 1) * t1 - b * t0
            if b >= mb:  # a full batch: the request waits about (b - max_batch + 1) steps
                score += (b - mb + 1) * t1
            out.append(score)
        return out

    def scores(self, request, loads) -> np.ndarray:
        """[N] predicted increase of total token time (s) if the request joins each server."""
        return np.asarray(self._costs(request, loads))

    def explain(self, request, loads, allowed=None) -> Decision:
        n = len(loads)
        if n != len(self.servers):
            raise ValueError(f"{n} loads for {len(self.servers)} servers")
        cand = _candidates(n, allowed).tolist()
        costs = self._costs(request, loads)
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
                "live": [s.live for s in self.servers],
                "expected_unique": (None if self.free is None
                                    else (self.dim - self.free_sum).round(2).tolist())}


register_policy(PolicySpec(
    "state_aware", lambda ctx: StateAwarePolicy(ctx.num_servers, centroids=ctx.centroids),
    aliases=("cost",), uses_artifact=True,
    summary="least predicted increase of decode time given each server's live batch"))
