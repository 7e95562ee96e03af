"""Decode-routing policies: small pure objects shared by the router and the simulator.

See :mod:`eldr_sglang.core.policies.base` for the interface and the registry.
Every module of this package is imported here, so each registers its policies.
"""

from __future__ import annotations

import importlib
import pkgutil

from eldr_sglang.core.policies.base import (FAMILIES, Decision, Policy, PolicyContext, PolicySpec, RouteRequest,
                                            build_policy, least_loaded, make_policy, policies_of, policy_names,
                                            policy_spec, reads_artifact, register_policy)

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")

from eldr_sglang.core.policies.balancers import JSQPolicy, P2CPolicy, RandomPolicy, RoundRobinPolicy  # noqa: E402
from eldr_sglang.core.policies.domain import DomainPolicy  # noqa: E402
from eldr_sglang.core.policies.eldr import CentroidOwnership, EldrPolicy  # noqa: E402
from eldr_sglang.core.policies.state_aware import StateAwarePolicy, StepCost  # noqa: E402
from eldr_sglang.core.policies.params import NoParams, parse_params  # noqa: E402

POLICY_NAMES = tuple(policy_names())

__all__ = ["FAMILIES", "policies_of", "Decision", "Policy", "PolicyContext", "PolicySpec", "RouteRequest", "build_policy",
           "least_loaded", "make_policy", "policy_names", "policy_spec", "reads_artifact", "register_policy",
           "RandomPolicy", "RoundRobinPolicy", "JSQPolicy", "P2CPolicy", "DomainPolicy",
           "CentroidOwnership", "EldrPolicy", "StateAwarePolicy", "StepCost", "NoParams", "parse_params",
           "POLICY_NAMES"]
