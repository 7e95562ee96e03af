"""Cluster description (YAML) -> validated dataclasses; every error names its field.

Schema (unknown keys are refused)::

    name: str                      vendor: rocm | cuda | cpu model_path: str
    calibration: str               # artifact path on the nodes (router + prefill servers)
    python: python                 log_dir: logs             transfer_backend: mooncake | mooncake_tcp
    ib_device: str | null          # --disaggregation-ib-device
    engine_host: 0.0.0.0           # the servers' --host (e.g. 127.0.0.1 for a one-machine cluster)
    attention_dp_late_binding: false   # allow TP > 1 under late binding (see DEPLOY.md)
    nodes: [{name, host, gpus}]    # vendor cpu: gpus = how many servers the node runs
    router: {node, port: 8000, signature_port: 8001, host: 0.0.0.0, policy: eldr_balanced, tau: (the artifact's), extra_args: []}
                                   # signature_port: null -> engines publish over HTTP instead
    prefill: {count, tp_size: 1, ep_size: 1, nodes: [names], port, bootstrap_port, metrics_port, servers, extra_args, env}
    decode:  {count, tp_size: 1, ep_size: 1, nodes: [names], port, metrics_port, placement_dir,
              num_redundant_experts: 0, servers, extra_args, env}

``servers`` (optional) pins each server: ``[{node: name, gpus: [0, 1, 2, 3]}, ...]``;
without it servers fill the role's nodes in order with the lowest free GPUs.
``kubernetes`` (optional; only ``deploy k8s`` reads it): the fields of :class:`Kubernetes`
(``rdma_resource``, ``rdma_count``, ``host_network``, ``node_selector``,
``signature_key_secret``, ``publish_allow``), each documented in its field's ``help`` (the table in
docs/DEPLOY.md is generated from them: :mod:`~eldr_sglang.deploy.keys_doc`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from eldr_sglang.patches.publish_allow import parse_entries

from eldr_sglang.core.policies import policy_names
from eldr_sglang.router.config import RouterConfig

VENDORS = ("rocm", "cuda", "cpu")  # cpu: SGLang's CPU engine, to try a deployment on one machine
SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # DNS-1123 subdomain
LATE_BINDING_BACKENDS = ("mooncake", "mooncake_tcp")


class DescriptionError(ValueError):
    """A bad cluster description; the message starts with the field path."""


@dataclass(frozen=True)
class Node:
    name: str
    host: str
    gpus: int


@dataclass(frozen=True)
class Pin:
    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Role:
    kind: str  # "prefill" | "decode"
    count: int
    tp_size: int = 1
    ep_size: int = 1
    nodes: tuple[str, ...] = ()
    port: int = 30000
    bootstrap_port: int = 8998  # prefill only
    metrics_port: int | None = None  # decode only: --eldr-metrics-port base
    placement_dir: str | None = None  # decode only
    num_redundant_experts: int = 0  # decode only
    servers: tuple[Pin, ...] = ()
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def _key(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Kubernetes:
    """How engine pods reach RDMA, the model files and the signature key (``deploy k8s`` only)."""

    rdma_resource: str | None = _key(
        None, "the RDMA device plugin's resource each engine pod requests (e.g. `rdma/hca_shared_devices_a`); "
              "`transfer_backend: mooncake` needs it or `host_network`")
    rdma_count: int = _key(1, "how many of `rdma_resource` each engine pod requests")
    host_network: bool = _key(
        False, "engine pods use their node's network (Mooncake reaches the NICs without a device plugin; "
               "at most one prefill and one decode pod per node, their ports would collide)")
    node_selector: tuple[tuple[str, str], ...] = _key(
        (), "labels (name: value) of the nodes holding `model_path` and `decode.placement_dir`, which engine "
            "pods mount from the node (hostPath); without it, `--pin-nodes`")
    signature_key_secret: str | None = _key(
        None, "name of a Secret in the namespace whose key `signature-key` holds the shared signature key; "
              "mounted read-only at `/etc/eldr/signature-key` in every engine and router pod "
              "(`--eldr-signature-key-file`, `--signature-key-file`). Unset: the routers take unsigned "
              "signatures from anyone who reaches them, and `deploy k8s` warns")
    publish_allow: tuple[str, ...] = _key(
        (), "CIDRs or host names the prefill pods may publish signatures to (`--eldr-publish-allow`), e.g. "
            "the pod network `10.244.0.0/16`: router replicas advertise their pod IPs. Unset: any destination, "
            "and `deploy k8s` warns")


@dataclass(frozen=True)
class Router:
    node: str
    port: int = RouterConfig.port
    signature_port: int | None = 8001  # TCP signature stream (None: HTTP POST to port)
    host: str = RouterConfig.host
    policy: str = RouterConfig.policy
    tau: float | None = None  # None: the calibration artifact's tau
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Cluster:
    name: str
    vendor: str
    model_path: str
    calibration: str
    nodes: tuple[Node, ...]
    router: Router
    prefill: Role
    decode: Role
    python: str = "python"
    log_dir: str = "logs"
    transfer_backend: str = "mooncake"
    ib_device: str | None = None
    attention_dp_late_binding: bool = False
    engine_host: str = "0.0.0.0"
    kubernetes: Kubernetes = Kubernetes()
    warnings: list[str] = field(default_factory=list, compare=False)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)


_TOP = {"name", "vendor", "model_path", "calibration", "python", "log_dir", "transfer_backend", "ib_device",
        "attention_dp_late_binding", "engine_host", "nodes", "router", "prefill", "decode", "kubernetes"}
_ROLE = {"count", "tp_size", "ep_size", "nodes", "port", "servers", "extra_args", "env"}
_PREFILL = _ROLE | {"bootstrap_port", "metrics_port"}
_DECODE = _ROLE | {"metrics_port", "placement_dir", "num_redundant_experts"}
_ROUTER = {"node", "port", "signature_port", "host", "policy", "tau", "extra_args"}


def parse_cluster(doc: Any) -> Cluster:
    """Build a :class:`Cluster` from the YAML document; DescriptionError names the field."""
    top = _mapping(doc, "description", _TOP)
    for key in ("name", "vendor", "model_path", "calibration", "nodes", "router", "prefill", "decode"):
        if key not in top:
            raise DescriptionError(f"{key}: required")
    vendor = _str(top["vendor"], "vendor")
    if vendor not in VENDORS:
        raise DescriptionError(f"vendor: {vendor!r} is not one of {list(VENDORS)}")
    backend = _str(top.get("transfer_backend", "mooncake"), "transfer_backend")
    if backend not in LATE_BINDING_BACKENDS:
        raise DescriptionError(f"transfer_backend: {backend!r}; late binding (prefill_complete) in SGLang 0.5.23 "
                               f"needs Mooncake: one of {list(LATE_BINDING_BACKENDS)}")
    nodes = _nodes(top["nodes"])
    names = [n.name for n in nodes]
    cluster = Cluster(
        name=_str(top["name"], "name"), vendor=vendor, model_path=_str(top["model_path"], "model_path"),
        calibration=_str(top["calibration"], "calibration"), nodes=nodes,
        router=_router(top["router"], names),
        prefill=_role(top["prefill"], "prefill", _PREFILL, names),
        decode=_role(top["decode"], "decode", _DECODE, names),
        python=_str(top.get("python", "python"), "python"), log_dir=_str(top.get("log_dir", "logs"), "log_dir"),
        transfer_backend=backend,
        ib_device=None if top.get("ib_device") is None else _str(top["ib_device"], "ib_device"),
        attention_dp_late_binding=_bool(top.get("attention_dp_late_binding", False), "attention_dp_late_binding"),
        engine_host=_str(top.get("engine_host", "0.0.0.0"), "engine_host"),
        kubernetes=_kubernetes(top.get("kubernetes", {})),
    )
    for role in (cluster.prefill, cluster.decode):
        _check_parallelism(cluster, role)
    if vendor == "cpu":
        _check_cpu(cluster)
    return cluster


def _check_cpu(cluster: Cluster) -> None:
    """SGLang's CPU engine: one process per server, Mooncake over TCP (no RDMA)."""
    if cluster.transfer_backend != "mooncake_tcp":
        raise DescriptionError(f"transfer_backend: {cluster.transfer_backend!r} with vendor cpu; CPU servers "
                               f"transfer KV over TCP: mooncake_tcp")
    for role in (cluster.prefill, cluster.decode):
        if role.tp_size != 1 or role.ep_size != 1:
            raise DescriptionError(f"{role.kind}.tp_size: vendor cpu runs one process per server "
                                   f"(tp_size 1, ep_size 1)")


def _check_parallelism(cluster: Cluster, role: Role) -> None:
    k = role.kind
    if role.tp_size % role.ep_size:
        raise DescriptionError(f"{k}.ep_size: {role.ep_size} does not divide tp_size {role.tp_size}")
    biggest = max(cluster.node(n).gpus for n in role.nodes)
    if role.tp_size > biggest:
        raise DescriptionError(f"{k}.tp_size: {role.tp_size} exceeds the {biggest} GPUs of the largest node in "
                               f"{k}.nodes (servers spanning nodes are not generated)")
    if role.tp_size > 1:
        if not cluster.attention_dp_late_binding:
            raise DescriptionError(
                f"{k}.tp_size: {role.tp_size}: late binding (--disaggregation-decode-allocation-policy "
                f"prefill_complete, which the ELDR router needs) requires attention TP 1. The layout for that is "
                f"--attn-dp-size {role.tp_size} (attention DP = TP); stock SGLang 0.5.23 refuses every "
                f"tp_size > 1 there (its check reads the deprecated dp-attention fields after they were "
                f"cleared), the eldr plugin's hook makes it accept attention TP 1. Use tp_size 1, or set "
                f"attention_dp_late_binding: true")
        cluster.warnings.append(
            f"{k}: tp_size {role.tp_size} runs with --attn-dp-size {role.tp_size} (attention TP 1) for late binding; "
            f"stock SGLang 0.5.23 refuses this at start-up, the eldr plugin's hook (eldr_sglang/patches/"
            f"late_binding.py) makes it accept it: eldr-sglang must be installed beside SGLang on every node "
            f"(see docs/DEPLOY.md, 'TP > 1 and late binding')")
    if k == "decode" and role.ep_size > 1 and not role.placement_dir:
        raise DescriptionError("decode.placement_dir: required when ep_size > 1 (one --init-expert-location file "
                               "per decode server, from python -m eldr_sglang.placement optimize)")
    if role.num_redundant_experts and role.ep_size == 1:
        raise DescriptionError(f"{k}.num_redundant_experts: {role.num_redundant_experts} needs ep_size > 1")


def _mapping(value: Any, where: str, allowed: set[str]) -> Mapping:
    if not isinstance(value, Mapping):
        raise DescriptionError(f"{where}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        prefix = "" if where == "description" else where + "."
        raise DescriptionError(f"{prefix}{unknown[0]}: unknown key (allowed: {', '.join(sorted(allowed))})")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise DescriptionError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise DescriptionError(f"{where}: expected true or false, got {value!r}")
    return value


def _int(value: Any, where: str, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DescriptionError(f"{where}: expected an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        raise DescriptionError(f"{where}: {value} is out of range [{low}, {high if high is not None else 'inf'}]")
    return value


def _port(value: Any, where: str) -> int:
    return _int(value, where, 1, 65535)


def _args(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(a, (str, int, float)) for a in value):
        raise DescriptionError(f"{where}: expected a list of strings")
    return tuple(str(a) for a in value)


def _nodes(value: Any) -> tuple[Node, ...]:
    if not isinstance(value, list) or not value:
        raise DescriptionError("nodes: expected a non-empty list")
    nodes, seen = [], set()
    for i, item in enumerate(value):
        where = f"nodes[{i}]"
        m = _mapping(item, where, {"name", "host", "gpus"})
        for key in ("name", "host", "gpus"):
            if key not in m:
                raise DescriptionError(f"{where}.{key}: required")
        name = _str(m["name"], f"{where}.name")
        if name in seen:
            raise DescriptionError(f"{where}.name: {name!r} appears twice")
        seen.add(name)
        nodes.append(Node(name, _str(m["host"], f"{where}.host"), _int(m["gpus"], f"{where}.gpus", 1)))
    return tuple(nodes)


def _kubernetes(value: Any) -> Kubernetes:
    m = _mapping(value, "kubernetes", {f.name for f in fields(Kubernetes)})
    selector = m.get("node_selector") or {}
    if not isinstance(selector, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in selector.items()):
        raise DescriptionError("kubernetes.node_selector: expected a mapping of node label names to string values")
    rdma = m.get("rdma_resource")
    secret = m.get("signature_key_secret")
    if secret is not None and not (isinstance(secret, str) and len(secret) <= 253 and SECRET_NAME.match(secret)):
        raise DescriptionError(f"kubernetes.signature_key_secret: {secret!r} is not a Secret name (lower-case "
                               "letters, digits, '-' and '.', at most 253 characters)")
    return Kubernetes(rdma_resource=None if rdma is None else _str(rdma, "kubernetes.rdma_resource"),
                      rdma_count=_int(m.get("rdma_count", 1), "kubernetes.rdma_count", 1),
                      host_network=_bool(m.get("host_network", False), "kubernetes.host_network"),
                      node_selector=tuple(sorted(selector.items())), signature_key_secret=secret,
                      publish_allow=_publish_allow(m.get("publish_allow", [])))


def _publish_allow(value: Any) -> tuple[str, ...]:
    """``kubernetes.publish_allow``: a list of CIDRs or host names, each checked as the engine checks it."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DescriptionError("kubernetes.publish_allow: expected a list of CIDRs or host names")
    try:
        return tuple(parse_entries(",".join(value))) if value else ()
    except ValueError as e:
        raise DescriptionError(f"kubernetes.publish_allow: {e}") from None


def _router(value: Any, node_names: list[str]) -> Router:
    m = _mapping(value, "router", _ROUTER)
    if "node" not in m:
        raise DescriptionError("router.node: required")
    node = _str(m["node"], "router.node")
    if node not in node_names:
        raise DescriptionError(f"router.node: unknown node {node!r} (nodes: {node_names})")
    tau = m.get("tau")
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or tau < 0):
        raise DescriptionError(f"router.tau: expected a number >= 0 (or absent: the artifact's), got {tau!r}")
    sig = m.get("signature_port", 8001)
    policy = _str(m.get("policy", RouterConfig.policy), "router.policy")
    if policy not in policy_names(aliases=True):
        raise DescriptionError(f"router.policy: unknown policy {policy!r} (known: {', '.join(policy_names(aliases=True))})")
    return Router(node=node, port=_port(m.get("port", RouterConfig.port), "router.port"),
                  signature_port=None if sig is None else _port(sig, "router.signature_port"),
                  host=_str(m.get("host", RouterConfig.host), "router.host"),
                  policy=policy,
                  tau=None if tau is None else float(tau),
                  extra_args=_args(m.get("extra_args", []), "router.extra_args"))


def _role(value: Any, kind: str, allowed: set[str], node_names: list[str]) -> Role:
    m = _mapping(value, kind, allowed)
    if "count" not in m:
        raise DescriptionError(f"{kind}.count: required")
    nodes = m.get("nodes", node_names)
    if not isinstance(nodes, list) or not nodes:
        raise DescriptionError(f"{kind}.nodes: expected a non-empty list of node names")
    for i, n in enumerate(nodes):
        if n not in node_names:
            raise DescriptionError(f"{kind}.nodes[{i}]: unknown node {n!r} (nodes: {node_names})")
    env = m.get("env", {})
    if not isinstance(env, Mapping):
        raise DescriptionError(f"{kind}.env: expected a mapping of variable names to values")
    servers = []
    for i, pin in enumerate(m.get("servers") or []):
        where = f"{kind}.servers[{i}]"
        p = _mapping(pin, where, {"node", "gpus"})
        node = _str(p.get("node"), f"{where}.node")
        if node not in node_names:
            raise DescriptionError(f"{where}.node: unknown node {node!r} (nodes: {node_names})")
        gpus = p.get("gpus")
        if not isinstance(gpus, list) or not gpus:
            raise DescriptionError(f"{where}.gpus: expected a non-empty list of GPU indices")
        servers.append(Pin(node, tuple(_int(g, f"{where}.gpus[{j}]") for j, g in enumerate(gpus))))
    metrics = m.get("metrics_port")
    return Role(
        kind=kind, count=_int(m["count"], f"{kind}.count", 1), tp_size=_int(m.get("tp_size", 1), f"{kind}.tp_size", 1),
        ep_size=_int(m.get("ep_size", 1), f"{kind}.ep_size", 1), nodes=tuple(nodes),
        port=_port(m.get("port", 30000 if kind == "prefill" else 31000), f"{kind}.port"),
        bootstrap_port=_port(m.get("bootstrap_port", 8998), f"{kind}.bootstrap_port"),
        metrics_port=None if metrics is None else _port(metrics, f"{kind}.metrics_port"),
        placement_dir=None if m.get("placement_dir") is None else _str(m["placement_dir"], f"{kind}.placement_dir"),
        num_redundant_experts=_int(m.get("num_redundant_experts", 0), f"{kind}.num_redundant_experts"),
        servers=tuple(servers), extra_args=_args(m.get("extra_args", []), f"{kind}.extra_args"),
        env=tuple((str(k), str(v)) for k, v in env.items()),
    )
