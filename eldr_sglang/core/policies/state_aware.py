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

from dataclasses import dataclass
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
        self.free: Optional[np.ndarray] = None  # [N, D] prod (1 - p) over live requests
        self.centroids = None
        if centroids is not None:
            c = np.asarray(centroids, dtype=np.float32)
            self.centroids = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)
        if dim is not None:
            self.free = np.ones((num_servers, dim))

    # ------------------------------------------------------------ state
    def _ensure(self, dim: int) -> None:
        if self.free is None:
            self.dim, self.free = dim, np.ones((len(self.servers), dim))
        elif dim != self.dim:
            raise ValueError(f"activation has {dim} dims, the policy tracks {self.dim}")

    def admit(self, index: int, request) -> Any:
        p = request.activation
        if p is None:
            return None
        q = 1.0 - np.minimum(np.asarray(p, dtype=np.float64).reshape(-1), P_MAX)
        self._ensure(q.size)
        s = self.servers[index]
        self.free[index] *= q
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

    def add_server(self) -> None:
        self.servers.append(_Server())
        if self.free is not None:
            self.free = np.vstack([self.free, np.ones((1, self.dim))])

    def remove_server(self, index: int) -> None:
        self.servers.pop(index)
        if self.free is not None:
            self.free = np.delete(self.free, index, axis=0)

    # ------------------------------------------------------------ decision
    def scores(self, request, loads) -> np.ndarray:
        """[N] predicted increase of total token time (s) if the request joins each server."""
        c = self.cost
        b = np.asarray(loads, dtype=np.float64)
        if request.activation is None or self.free is None:
            du = np.zeros_like(b)
            u = np.zeros_like(b)
        else:
            p = np.minimum(np.asarray(request.activation, dtype=np.float64).reshape(-1), P_MAX)
            self._ensure(p.size)
            du = self.free @ p
            u = self.dim - self.free.sum(axis=1)
        t0 = c.base_s + c.per_seq_s * b + c.per_expert_s * u
        t1 = t0 + c.per_seq_s + c.per_expert_s * du
        score = (b + 1.0) * t1 - b * t0
        full = b >= c.max_batch
        if full.any():
            score = score + np.where(full, (b - c.max_batch + 1.0) * t1, 0.0)
        return score

    def explain(self, request, loads, allowed=None) -> Decision:
        n = len(loads)
        if n != len(self.servers):
            raise ValueError(f"{n} loads for {len(self.servers)} servers")
        cand = _candidates(n, allowed)
        score = self.scores(request, loads)
        sims = None
        key = score[cand]
        if self.centroids is not None and request.signature is not None:
            sims = self.centroids @ np.asarray(request.signature, dtype=np.float32).reshape(-1)
            if sims.shape[0] == n:  # one centroid per server: ties to the more similar
                key = key - 1e-9 * sims[cand]
        idx = int(cand[int(np.argmin(key))])
        return Decision(idx, self.name, "cost" if request.activation is not None else "no_activation",
                        server_similarities=-score, centroid_similarities=sims)

    def choose(self, request, loads, allowed=None) -> int:
        return self.explain(request, loads, allowed).index

    def describe(self) -> dict:
        return {"policy": self.name, "cost": vars(self.cost) if hasattr(self.cost, "__dict__") else
                {k: getattr(self.cost, k) for k in self.cost.__dataclass_fields__},
                "live": [s.live for s in self.servers],
                "expected_unique": (None if self.free is None
                                    else (self.dim - self.free.sum(axis=1)).round(2).tolist())}


register_policy(PolicySpec(
    "state_aware", lambda ctx: StateAwarePolicy(ctx.num_servers, centroids=ctx.centroids),
    aliases=("cost",),
    summary="least predicted increase of decode time given each server's live batch"))
