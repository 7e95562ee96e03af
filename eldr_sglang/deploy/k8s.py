"""Kubernetes manifests for an ELDR PD cluster (``python -m eldr_sglang.deploy k8s``).

Every prefill and decode server is a one-pod StatefulSet behind a headless Service
per role, so it has a stable DNS name
``<cluster>-<role>-<i>-0.<cluster>-<role>.<namespace>.svc.<cluster domain>``; the router
is a Deployment behind a Service. The description is mapped to that
layout (:func:`in_cluster`: one node per pod, the pod's GPUs numbered from 0, the
router's signature address the router Service, each router replica advertising its
pod IP) and :func:`~eldr_sglang.deploy.commands.build_launches` builds every
command, so the pods run the flags ``dry-run`` prints, with in-cluster addresses.
The calibration artifact becomes a ConfigMap, mounted at the description's
``calibration`` path in the router and prefill pods. Engine pods get Mooncake's RDMA
(a device plugin resource or the host network) and are held to the nodes holding
the model folder; NetworkPolicies and PodDisruptionBudgets come with them
(:mod:`~eldr_sglang.deploy.k8s_policy`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Callable

import yaml

from .commands import Launch, build_launches, has_flag
from .files import check_artifact
from .image import default_image
from .k8s_policy import disruption_budgets, network_policies
from .k8s_pods import (ENGINE_KEY_FLAG, GPU_RESOURCE, ROUTER_KEY_FLAG, SIGNATURE_KEY_ITEM, SIGNATURE_KEY_PATH,
                       engine_ports, engine_statefulset, router_deployment, router_ports)
from .spec import Cluster, DescriptionError, Node, Pin

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # DNS-1035: Service names
STATEFULSET_NAME_MAX = 52  # its pods' controller-revision-hash label adds 11 characters to 63
CONFIGMAP_MAX_BYTES = 1_000_000  # the API server refuses ConfigMaps over 1 MiB
CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


@dataclass(frozen=True)
class K8sOptions:
    """What the description does not say about a Kubernetes deployment."""

    namespace: str = "default"
    image: str | None = None  # None: default_image(vendor), built from the repository's Dockerfile
    router_replicas: int = 1
    pin_nodes: bool = False  # nodeSelector kubernetes.io/hostname = the description's node names
    artifact: str | None = None  # read the artifact here instead of the description's path
    cluster_domain: str = "cluster.local"


def server_name(cluster: Cluster, kind: str, index: int) -> str:
    """StatefulSet of a server (its one pod is this name + ``-0``)."""
    return f"{cluster.name}-{kind}-{index}"


def service_name(cluster: Cluster, part: str) -> str:
    """Headless Service of a role (``prefill``/``decode``), the router's Service and
    Deployment (``router``), the artifact's ConfigMap (``calibration``)."""
    return f"{cluster.name}-{part}"


def check_names(cluster: Cluster, options: K8sOptions) -> None:
    """DescriptionError naming the field when a generated name would be refused."""
    if not DNS_LABEL.match(options.namespace) or len(options.namespace) > 63:
        raise DescriptionError(f"namespace: {options.namespace!r} is not a DNS-1123 label")
    if not all(DNS_LABEL.match(part) for part in options.cluster_domain.split(".")):
        raise DescriptionError(f"cluster_domain: {options.cluster_domain!r} is not a DNS name")
    if options.router_replicas < 1:
        raise DescriptionError(f"router_replicas: {options.router_replicas} (at least 1)")
    longest = max(len(server_name(cluster, r.kind, r.count - 1)) for r in (cluster.prefill, cluster.decode))
    if not DNS_LABEL.match(cluster.name) or longest > STATEFULSET_NAME_MAX:
        raise DescriptionError(
            f"name: {cluster.name!r} cannot prefix Kubernetes names: lower-case letters, digits and '-', "
            f"starting with a letter, at most {STATEFULSET_NAME_MAX - (longest - len(cluster.name))} characters")
    for where, path in (("calibration", cluster.calibration), ("decode.placement_dir", cluster.decode.placement_dir)):
        if path is not None and not PurePosixPath(path).is_absolute():
            raise DescriptionError(f"{where}: {path!r} must be an absolute path to be mounted into pods")


def check_pods(cluster: Cluster, options: K8sOptions) -> list[str]:
    """DescriptionError when engine pods could not work as generated: Mooncake without RDMA
    in the pod, folders mounted from nodes (hostPath) without pods held to those nodes."""
    kube = cluster.kubernetes
    if cluster.transfer_backend == "mooncake" and not (kube.rdma_resource or kube.host_network):
        device = (f"ib_device {cluster.ib_device} is not visible inside a pod" if cluster.ib_device
                  else "ib_device is null")
        raise DescriptionError(
            f"kubernetes.rdma_resource: transfer_backend mooncake moves KV caches over RDMA, but the engine pods "
            f"would get no RDMA device ({device}): set kubernetes.rdma_resource (the RDMA device plugin's resource, "
            "e.g. rdma/hca_shared_devices_a) or kubernetes.host_network: true, or transfer_backend: mooncake_tcp "
            "to move them over TCP")
    decode = cluster.decode
    for where, path in (("model_path", cluster.model_path),
                        ("decode.placement_dir", decode.placement_dir if decode.ep_size > 1 else None)):
        if path and PurePosixPath(path).is_absolute() and not (options.pin_nodes or kube.node_selector):
            raise DescriptionError(
                f"kubernetes.node_selector: {where} {path} is mounted from the nodes (hostPath), so engine pods must "
                "be held to nodes that have it: set kubernetes.node_selector (labels those nodes carry) or pass "
                "--pin-nodes")
    notes = signature_key_notes(cluster) + publish_allow_notes(cluster)
    if kube.host_network:
        notes.append("kubernetes.host_network: engine pods of one role listen on the same ports, so at most one "
                     "prefill and one decode pod fit on a node")
    return notes


def publish_allow_notes(cluster: Cluster) -> list[str]:
    """The warning when prefill pods would publish signatures to any destination a request names."""
    if cluster.kubernetes.publish_allow or has_flag(cluster.prefill.extra_args, "--eldr-publish-allow"):
        return []
    return ["kubernetes.publish_allow is not set: prefill pods publish signatures to any destination a request "
            "names (router replicas advertise their pod IPs, so no fixed host can be allowed); set it to the pod "
            "network, e.g. publish_allow: [10.244.0.0/16]"]


def signature_key_notes(cluster: Cluster) -> list[str]:
    """The loud warning when routers would take unsigned signatures: neither
    ``kubernetes.signature_key_secret`` nor a key file in ``router.extra_args``."""
    if cluster.kubernetes.signature_key_secret is not None or has_flag(cluster.router.extra_args, ROUTER_KEY_FLAG):
        return []
    return ["kubernetes.signature_key_secret is not set: the routers' signature intake (the signature port and "
            "POST /eldr/signature) is UNAUTHENTICATED, anyone who reaches a router can post signatures for other "
            "requests and steer them; create a Secret holding the key (kubectl create secret generic NAME "
            f"--from-file={SIGNATURE_KEY_ITEM}=FILE) and set kubernetes.signature_key_secret: NAME (deploy k8s), "
            f"or pass {ENGINE_KEY_FLAG} in prefill.extra_args and {ROUTER_KEY_FLAG} in router.extra_args"]


def in_cluster(cluster: Cluster, namespace: str, domain: str = "cluster.local") -> Cluster:
    """The description as laid out in Kubernetes: one node per server pod (host = its DNS
    name, GPUs 0..tp-1 of the pod) and one for the router (host = its Service)."""
    suffix = f"{namespace}.svc.{domain}"
    nodes: list[Node] = []
    roles = {}
    keyed = cluster.kubernetes.signature_key_secret is not None  # the Secret's file, mounted in every pod
    for role in (cluster.prefill, cluster.decode):
        pins = []
        for i in range(role.count):
            name = server_name(cluster, role.kind, i)
            nodes.append(Node(name, f"{name}-0.{service_name(cluster, role.kind)}.{suffix}", role.tp_size))
            pins.append(Pin(name, tuple(range(role.tp_size))))
        args = _with_flag(role.extra_args, ENGINE_KEY_FLAG, SIGNATURE_KEY_PATH) if keyed else role.extra_args
        if role.kind == "prefill" and cluster.kubernetes.publish_allow:
            args = _with_flag(args, "--eldr-publish-allow", ",".join(cluster.kubernetes.publish_allow))
        roles[role.kind] = replace(role, nodes=tuple(p.node for p in pins), servers=tuple(pins), extra_args=args)
    router = service_name(cluster, "router")
    nodes.append(Node(router, f"{router}.{suffix}", 0))
    extra = _with_flag(cluster.router.extra_args, "--advertise-host", "$(POD_IP)")  # each replica its own address
    if keyed:
        extra = _with_flag(extra, ROUTER_KEY_FLAG, SIGNATURE_KEY_PATH)
    return replace(cluster, nodes=tuple(nodes), prefill=roles["prefill"], decode=roles["decode"],
                   router=replace(cluster.router, node=router, extra_args=extra), warnings=list(cluster.warnings))


def _with_flag(args: tuple[str, ...], flag: str, value: str) -> tuple[str, ...]:
    """``args`` plus ``flag value`` unless the description already gives the flag."""
    return args if has_flag(args, flag) else (*args, flag, value)


def build_manifests(cluster: Cluster, options: K8sOptions) -> tuple[dict[str, list[dict]], list[str]]:
    """{file name: [objects]} for ``kubectl apply -f DIR``, and notes for the operator (beside
    the description's own warnings); DescriptionError names the field."""
    if cluster.vendor not in GPU_RESOURCE:
        raise DescriptionError(f"vendor: {cluster.vendor!r}: Kubernetes manifests request GPUs "
                               f"({' or '.join(sorted(GPU_RESOURCE))}); use `scripts` for a CPU cluster")
    check_names(cluster, options)
    try:
        _, notes = check_artifact(cluster, options.artifact)
    except DescriptionError as exc:
        hint = "" if options.artifact else " (--artifact FILE reads it from elsewhere)"
        raise DescriptionError(f"{exc}{hint}") from None
    artifact_path = Path(options.artifact or cluster.calibration)
    text = artifact_path.read_text()
    size = len(text.encode())
    if size > CONFIGMAP_MAX_BYTES:
        raise DescriptionError(f"calibration: {artifact_path} is {size} bytes; a ConfigMap holds at most about "
                               "1 MiB (calibrate with fewer --layers)")
    notes += check_pods(cluster, options)
    image = options.image or default_image(cluster.vendor)
    ns = options.namespace
    k8s = in_cluster(cluster, ns, options.cluster_domain)
    launches = build_launches(k8s)
    placed = {l.name: l.node for l in build_launches(cluster)}  # where the description puts each server
    key = PurePosixPath(cluster.calibration).name
    key = key if CONFIG_KEY.match(key) else "artifact.json"
    config = {"name": service_name(cluster, "calibration"), "key": key, "path": cluster.calibration,
              "sha256": hashlib.sha256(text.encode()).hexdigest()}
    meta = lambda name: {"name": name, "namespace": ns, "labels": labels(cluster)}  # noqa: E731
    files: dict[str, list[dict]] = {}
    if ns != "default":
        files["00-namespace.yaml"] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}]
    files["10-calibration.yaml"] = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(config["name"]),
                                     "data": {key: text}}]
    files["20-services.yaml"] = [_service(cluster, meta, kind, launches) for kind in ("prefill", "decode", "router")]
    for number, role in ((30, cluster.prefill), (40, cluster.decode)):
        files[f"{number}-{role.kind}.yaml"] = [
            engine_statefulset(cluster, role, l, meta(l.node), labels(cluster, role.kind, l.node),
                               service_name(cluster, role.kind), image,
                               config if role.kind == "prefill" else None,
                               placed[l.name] if options.pin_nodes else None)
            for l in launches if l.name.startswith(f"{role.kind}-")]
    router = launches[-1]
    files["50-router.yaml"] = [router_deployment(
        cluster, router, meta(router.node), labels(cluster, "router"), image, options.router_replicas,
        config if "--calibration" in router.argv else None, cluster.router.node if options.pin_nodes else None)]
    files["60-policies.yaml"] = [
        *network_policies(cluster, meta, labels(cluster), "signature" in dict(router_ports(router))),
        *disruption_budgets(cluster, meta, labels(cluster))]
    return files, notes


def labels(cluster: Cluster, component: str | None = None, server: str | None = None) -> dict[str, str]:
    """Labels of every object of the cluster; with ``component`` (and ``server``), a pod selector."""
    out = {"app.kubernetes.io/name": "eldr-sglang", "app.kubernetes.io/instance": cluster.name}
    if component:
        out["app.kubernetes.io/component"] = component
    if server:
        out["eldr-sglang/server"] = server
    return out


def _service(cluster: Cluster, meta: Callable[[str], dict], kind: str, launches: list[Launch]) -> dict:
    """Headless Service of a role (every pod resolvable before it is ready: the router
    checks health itself), or the router's ClusterIP Service."""
    if kind == "router":
        ports = router_ports(launches[-1])
        spec: dict = {"type": "ClusterIP"}
    else:
        ports = engine_ports(next(l for l in launches if l.name.startswith(f"{kind}-")))
        spec = {"clusterIP": "None", "publishNotReadyAddresses": True}
    spec["selector"] = labels(cluster, kind)
    spec["ports"] = [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports]
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(service_name(cluster, kind)), "spec": spec}


class _Dumper(yaml.SafeDumper):
    """No anchors for shared dicts (labels), multi-line strings as literal blocks."""

    def ignore_aliases(self, data: object) -> bool:
        return True


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def write_manifests(files: dict[str, list[dict]], out: str | Path) -> list[Path]:
    """One multi-document YAML file per group; returns the paths written."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, docs in files.items():
        path = folder / name
        path.write_text(yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=120))
        paths.append(path)
    return paths
