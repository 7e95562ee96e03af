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

Policies are found by name in a registry: each policy module declares a
:class:`PolicySpec` (name, aliases, whether it needs a calibration artifact or a
domain map, its typed parameter set (:mod:`.params`), how it is built from a
:class:`PolicyContext` and its parameters, how it reacts to a calibration reload)
with :func:`register_policy`. Every module of this package is
imported by ``__init__``, so a new policy is one new file (and its test).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from eldr_sglang.core.artifact import DEFAULT_TAU
from eldr_sglang.core.params import NoParams, param_names, parse_params


_EPS = 1e-9


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about a request: its signature and/or its label."""

    signature: Optional[np.ndarray] = None
    label: Optional[str] = None
    # [n_sel * E] probability of each expert in one decode step (prefill counts / prompt
    # tokens); read by policies that price a server's live batch
    activation: Optional[np.ndarray] = None
    # [n_sel, E] raw prefill counts of the published layers; read by policies that learn
    # their calibration online (the simulator's OnlineEldrPolicy)
    counts: Optional[np.ndarray] = None
    # a fallback the router already counted for this request (e.g. "timeout": its signature
    # did not come); a decision counts at most one
    fallback: Optional[str] = None


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
    # set when the policy could not decide by its own rule (e.g. "degenerate_cost") and fell
    # back to the least loaded server; the router counts it as a fallback of that reason
    fallback: Optional[str] = None

    def top(self, n: int = 3) -> list[tuple[int, float]]:
        """The ``n`` most similar servers as (index, similarity), best first."""
        if self.server_similarities is None:
            return []
        s = self.server_similarities
        order = np.argsort(-s, kind="stable")[:n]
        return [(int(i), float(s[i])) for i in order]


_SERVER_SIMS = Decision.__dict__["server_similarities"]  # the slots' descriptors
_CENTROID_SIMS = Decision.__dict__["centroid_similarities"]


class LazyDecision(Decision):
    """A :class:`Decision` whose ``server_similarities`` / ``centroid_similarities`` are
    computed when first read, by ``fill() -> ([N], [K])``: a policy that needed only a few
    servers' similarities to decide skips the [K, D] matvec unless a reader (the decision
    log, the A/B and shadow records, ``/eldr/score``) asks for them."""

    __slots__ = ("_fill",)

    def __init__(self, index: int, policy: str, reason: str, band: Optional[tuple[int, ...]],
                 best_similarity: Optional[float], fill: Callable[[], tuple]) -> None:
        Decision.__init__(self, index, policy, reason, band, best_similarity)
        self._fill = fill

    def _filled(self, slot: Any) -> Any:
        fill = self._fill
        if fill is not None:
            self._fill = None
            ss, cs = fill()
            _SERVER_SIMS.__set__(self, ss)
            _CENTROID_SIMS.__set__(self, cs)
        return slot.__get__(self, Decision)

    server_similarities = property(lambda self: self._filled(_SERVER_SIMS), _SERVER_SIMS.__set__)
    centroid_similarities = property(lambda self: self._filled(_CENTROID_SIMS), _CENTROID_SIMS.__set__)


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
    needs_signature: bool = False  # wait for the request's signature message
    uses_activation: bool = False  # route by RouteRequest.activation (no artifact needed)
    uses_counts: bool = False  # reads RouteRequest.counts (learns online)

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

    def admit(self, index: int, request: RouteRequest) -> Any:
        """The request was sent to server ``index``; returns a token for :meth:`release`."""
        return None

    def release(self, token: Any) -> None:
        """The request of ``token`` left its server (finished, failed or aborted)."""

    def add_server(self) -> None:
        """A server was appended at the end of the server list."""

    def remove_server(self, index: int) -> None:
        """The server at ``index`` was removed; later servers shift down."""

    def describe(self) -> dict:
        """JSON-able state for status pages."""
        return {"policy": self.name}


def least_loaded(
    loads: Sequence[int], cand: np.ndarray, rng: Optional[np.random.Generator] = None
) -> int:
    """Pick step shared by jsq/domain/eldr: min load in ``cand``; ties random or lowest."""
    cl = np.asarray(loads, dtype=np.int64)[cand]
    best = cand[cl == cl.min()]
    if rng is None or best.size == 1:
        return int(best[0])
    return int(best[rng.integers(best.size)])


@dataclass(frozen=True)
class PolicyContext:
    """What the router (or the simulator) knows when it builds a policy."""

    num_servers: int
    seed: Optional[int] = 0
    tau: Optional[float] = None  # ``--tau``: the ``tau`` parameter of a policy that declares one
    centroids: Optional[np.ndarray] = None  # [K, D] from the calibration artifact
    artifact_tau: Optional[float] = None  # the artifact's tau (0 is a valid value)
    domain_map: Mapping[str, Sequence[int]] = field(default_factory=dict)
    # the policy's parameters: name -> text or number (``--policy-param``, a config file),
    # or an instance of its parameter dataclass; checked by build_policy
    params: Any = None

    @property
    def effective_tau(self) -> float:
        """``--tau`` if given, else the artifact's tau, else :data:`DEFAULT_TAU`."""
        if self.tau is not None:
            return float(self.tau)
        if self.artifact_tau is not None:
            return float(self.artifact_tau)
        return DEFAULT_TAU


@dataclass(frozen=True)
class PolicySpec:
    """A registered policy: how to build it and what it needs."""

    name: str
    build: Callable[[PolicyContext, Any], Policy]  # (context, parameters) -> policy
    aliases: tuple[str, ...] = ()
    params: type = NoParams  # its parameter set: a frozen dataclass (names, types, defaults, checks)
    needs_artifact: bool = False  # centroids from a calibration artifact (refused without one)
    uses_artifact: bool = False  # reads centroids when given (routes blind without them)
    needs_domain_map: bool = False  # a label -> servers map
    rebuild_on_reload: bool = False  # a calibration reload builds it again from the new artifact
    summary: str = ""
    # what it routes by, one of FAMILIES: "balancer" (load only), "label", "similarity"
    # (calibration regions), "cost" (prices live batches); the simulated report's grid
    # (sim.experiments.POLICIES) takes the first three
    family: str = ""


FAMILIES = ("balancer", "label", "similarity", "cost")


def reads_artifact(spec: PolicySpec) -> bool:
    """The policy routes by a calibration artifact's centroids (needs or uses one)."""
    return spec.needs_artifact or spec.uses_artifact


_REGISTRY: dict[str, PolicySpec] = {}
_ALIASES: dict[str, str] = {}


def register_policy(spec: PolicySpec) -> PolicySpec:
    """Add ``spec`` to the registry (its name and aliases must be new, its family one of
    :data:`FAMILIES`)."""
    if spec.family not in FAMILIES:
        raise ValueError(f"policy {spec.name!r}: family {spec.family!r} is not one of {', '.join(FAMILIES)}")
    for key in (spec.name, *spec.aliases):
        if key in _REGISTRY or key in _ALIASES:
            raise ValueError(f"policy name {key!r} is already registered")
    _REGISTRY[spec.name] = spec
    _ALIASES.update({a: spec.name for a in spec.aliases})
    return spec


def policy_spec(name: str) -> PolicySpec:
    """The spec registered under ``name`` or one of its aliases; ValueError otherwise."""
    spec = _REGISTRY.get(_ALIASES.get(name, name))
    if spec is None:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(policy_names())}")
    return spec


def policy_names(aliases: bool = False) -> list[str]:
    """Registered policy names (and their aliases with ``aliases=True``), sorted."""
    return sorted([*_REGISTRY, *(_ALIASES if aliases else ())])


def policies_of(*families: str) -> tuple[str, ...]:
    """The registered policies of these families, in registration order."""
    return tuple(n for n, s in _REGISTRY.items() if s.family in families)


def build_policy(name: str, ctx: PolicyContext) -> Policy:
    """Build a policy by name from a context and its parameters (``ctx.params``);
    ValueError naming what is missing or the parameter that is wrong. The one builder
    of the router, the co-located router, the simulator and the benchmarks."""
    spec = policy_spec(name)
    if spec.needs_artifact and ctx.centroids is None:
        raise ValueError(f"{spec.name} policy needs centroids (a calibration artifact)")
    prm = parse_params(spec.name, spec.params, ctx.params)
    if ctx.tau is not None and "tau" in param_names(spec.params) and prm.tau is None:
        prm = replace(prm, tau=ctx.tau)  # --tau: an alias of the policy's tau parameter
    return spec.build(ctx, prm)


def make_policy(
    name: str,
    num_servers: int,
    *,
    centroids: Optional[np.ndarray] = None,
    tau: Optional[float] = None,
    domain_map: Optional[Mapping[str, Sequence[int]]] = None,
    seed: Optional[int] = 0,
    params: Any = None,
) -> Policy:
    """Shorthand for :func:`build_policy` (tau None: :data:`DEFAULT_TAU`; ``params``: the
    policy's parameters, see :mod:`.params`)."""
    return build_policy(name, PolicyContext(num_servers, seed=seed, tau=tau, centroids=centroids,
                                            domain_map=domain_map or {}, params=params))
