"""The routing state of one router process and its lifecycle.

:class:`Routing` is one immutable value (policy, encoder, tau, artifact path),
swapped whole on a calibration reload or an A/B slice, so a request sees either the
old pair or the new one. :class:`RoutingState` holds the live one and the A/B arms,
builds them on the live pool, installs a new artifact in one step and tells every
policy that follows the pool of membership changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from eldr_sglang.core.policies import (Policy, PolicyContext, PolicySpec, build_policy, policy_spec,
                                       reads_artifact)
from eldr_sglang.core.policies.params import params_for
from eldr_sglang.core.step_law import artifact_cost_params
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.signals.signatures import SignatureEncoder
from eldr_sglang.router.pool.workers import WorkerPool

logger = logging.getLogger("eldr_sglang.router")


@dataclass(frozen=True)
class Routing:
    """The policy and what it was built from; replaced whole, never mutated."""

    spec: PolicySpec
    policy: Policy
    encoder: Optional[SignatureEncoder]
    tau: Optional[float]  # the tau in force for band policies (None: not used)
    calibration_path: Optional[str]

    @property
    def name(self) -> str:
        return self.spec.name


def _extra(encoder: Optional[SignatureEncoder]) -> Optional[dict]:
    return getattr(getattr(encoder, "artifact", None), "extra", None)


def domain_indices(domain_map: dict, urls: Sequence[str]) -> dict[str, list[int]]:
    """Domain map values may be decode indices or decode URLs."""
    urls = list(urls)
    out = {}
    for label, servers in domain_map.items():
        idx = []
        for s in servers if isinstance(servers, list) else [servers]:
            if isinstance(s, int) and 0 <= s < len(urls):
                idx.append(s)
            elif isinstance(s, str) and s.rstrip("/") in urls:
                idx.append(urls.index(s.rstrip("/")))
            else:
                raise ValueError(f"domain map: unknown decode server {s!r} for {label!r}")
        out[str(label)] = idx
    return out


class RoutingState:
    """The live :class:`Routing`, the A/B arms (empty without A/B) and the layers of
    the last signature message (to warn when a new artifact has others)."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics,
                 artifact: Any = None, domain_map: Optional[dict] = None) -> None:
        self.config, self.pool, self.metrics = config, pool, metrics
        self.domain_map = domain_map or {}
        self.spec = policy_spec(config.policy)  # the configured policy
        self.params = config.policy_params()  # --policy-param: name -> value text
        for line in config.ignored_settings():
            logger.warning("%s", line)
        if (artifact is None and reads_artifact(self.spec) and not self.spec.needs_artifact
                and not (config.online or config.calibration_watch)):
            logger.warning("policy %s routes requests to the decode server whose calibration region "
                           "they match, but no artifact was given (--calibration): it routes by cost "
                           "alone, ELDR locality is OFF", self.spec.name)
        self.routing = self.build(self.spec,
                                  SignatureEncoder(artifact) if artifact is not None else None,
                                  config.calibration if artifact is not None else None)
        enc = self.routing.encoder
        if enc is not None and reads_artifact(self.spec) and enc.centroids.shape[0] != len(pool.decodes):
            logger.warning("the artifact has %d centroids for %d decode servers (calibrate with --clusters "
                           "%d): %s", enc.centroids.shape[0], len(pool.decodes), len(pool.decodes),
                           "some servers own several regions" if enc.centroids.shape[0] > len(pool.decodes)
                           else "servers share regions")
        self.arms: list[Routing] = []
        self.arm: Optional[int] = None  # the A/B slice index in force
        self.last_layers: Optional[list[int]] = None  # layers of the last signature message

    def build(self, spec: PolicySpec, encoder: Optional[SignatureEncoder],
              path: Optional[str]) -> Routing:
        """``spec`` on the live pool; while an artifact policy waits for its first
        artifact (``--online`` warming up, a followed file not written yet), least loaded."""
        c = self.config
        if spec.needs_artifact and encoder is None and (c.online or c.calibration_watch):
            spec = policy_spec("jsq")
        ctx = PolicyContext(
            len(self.pool.decodes), seed=c.seed, tau=c.tau,
            centroids=encoder.centroids if encoder is not None else None,
            artifact_tau=encoder.tau if encoder is not None else None,
            domain_map=domain_indices(self.domain_map, [d.url for d in self.pool.decodes]),
            # the A/B arms' and shadow's differ; the artifact's step law (eldr-calibrate --step-law)
            # under what --policy-param sets
            params=params_for(spec.params, {**artifact_cost_params(_extra(encoder)), **self.params}))
        if spec.needs_domain_map and not self.domain_map:
            raise ValueError(f"{spec.name} policy needs a domain map (--domain-map)")
        policy = build_policy(spec.name, ctx)
        return Routing(spec, policy, encoder, getattr(policy, "tau", None) if spec.needs_artifact else None,
                       path)

    def build_routing(self, spec: PolicySpec, encoder: Optional[SignatureEncoder]) -> Routing:
        """A routing for ``spec`` on the live pool (shadow policies, A/B arms)."""
        return self.build(spec, encoder, self.routing.calibration_path)

    def set_routing(self, routing: Routing) -> None:
        """Swap the live routing: requests in flight keep theirs."""
        self.routing = routing

    def set_arms(self, names: Sequence[str]) -> None:
        """The A/B arms, one per policy name; the first one goes live."""
        self.arms = [self.build_routing(policy_spec(p), self.routing.encoder) for p in names]
        self.routing = self.arms[0]

    def use_arm(self, index: int) -> Routing:
        """Slice ``index``'s arm goes live."""
        self.arm = index
        self.routing = self.arms[index % len(self.arms)]
        return self.routing

    def install_artifact(self, art: Any, path: str, origin: str = "file") -> dict:
        """Make ``art`` the live calibration in one step (a reload, an online fit).

        Policies that declare ``rebuild_on_reload`` are built again from it (server i
        owns centroid i; K != N handled by ``CentroidOwnership``); ``--tau`` given at
        start-up stays, otherwise the new artifact's tau is used (0 included)."""
        enc = SignatureEncoder(art)
        old = self.routing
        if self.spec.rebuild_on_reload or old.spec is not self.spec:
            new = self.build(self.spec, enc, path)
        else:
            new = replace(old, encoder=enc, calibration_path=path)
        warnings = []
        k, n = int(enc.centroids.shape[0]), len(self.pool.decodes)
        if k != n:
            warnings.append(f"{k} centroids for {n} decode servers: "
                            + ("several centroids per server" if k > n else "servers share centroids"))
        if self.last_layers is not None and [int(x) for x in self.last_layers] != enc.layers:
            warnings.append(f"prefill plugin last sent layers {self.last_layers}, artifact has "
                            f"{enc.layers}: signatures will fall back until the plugin matches")
        self.routing = new  # one step: requests see the old pair or the new one
        if self.arms:  # every arm moves to the new artifact
            self.arms = [self.build(a.spec, enc, path) for a in self.arms]
            if self.arm is not None:
                self.routing = self.arms[self.arm % len(self.arms)]
        if origin == "file":
            self.metrics.reloads.labels("ok").inc()
        logger.info("calibration reloaded from %s: K=%d dim=%d tau=%s%s", path, k,
                    enc.centroids.shape[1], new.tau, f" ({'; '.join(warnings)})" if warnings else "")
        return {"ok": True, "path": str(path),
                "previous": old.encoder.describe() if old.encoder else None,
                "artifact": enc.describe(), "tau": new.tau, "warnings": warnings,
                "policy_state": new.policy.describe()}

    def change_servers(self, add: Sequence[str] = (), remove: Sequence[str] = (),
                       add_prefill: Sequence[tuple[str, Optional[int]]] = (),
                       remove_prefill: Sequence[str] = ()) -> None:
        """Membership changes; in-flight requests keep the worker objects they hold.
        Every policy that follows the pool (the live one, the other A/B arms) is told."""
        pool = self.pool
        policies = list({id(r.policy): r.policy for r in [self.routing, *self.arms]}.values())
        for url in remove:
            i = pool.decode_index(url)
            pool.remove_decode(i)
            for policy in policies:
                policy.remove_server(i)
        for url in add:
            pool.add_decode(url)
            for policy in policies:
                policy.add_server()
        for url in remove_prefill:
            pool.remove_prefill(url)
        for url, port in add_prefill:
            pool.add_prefill(url, port)
