"""Label-based baseline: each request label owns a set of decode servers."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from eldr_sglang.core.policies.base import (Policy, PolicySpec, _candidates, least_loaded,
                                            register_policy)


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


register_policy(PolicySpec("domain", lambda ctx, _: DomainPolicy(ctx.domain_map, ctx.seed),
                           needs_domain_map=True, family="label",
                           summary="label -> owned servers, least loaded among them"))
