"""Load balancers that ignore the request: random, round robin, JSQ, power of two."""

from __future__ import annotations

from itertools import chain
from typing import Optional

import numpy as np

from eldr_sglang.core.policies.base import (Policy, PolicySpec, _candidates, least_loaded,
                                            register_policy)


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


register_policy(PolicySpec("random", lambda ctx, _: RandomPolicy(ctx.seed),
                           family="balancer", summary="uniform random among the allowed servers"))
register_policy(PolicySpec("round_robin", lambda ctx, _: RoundRobinPolicy(), aliases=("rr",),
                           family="balancer", summary="cycle through the servers"))
register_policy(PolicySpec("jsq", lambda ctx, _: JSQPolicy(ctx.seed), aliases=("shortest_queue",),
                           family="balancer", summary="fewest in-flight requests"))
register_policy(PolicySpec("p2c", lambda ctx, _: P2CPolicy(ctx.seed), aliases=("power_of_two",),
                           family="balancer", summary="the less loaded of two random servers"))
