"""Workloads of the Kubernetes manifests: one StatefulSet per engine server, the router
Deployment. Commands, environment and ports come from the server's :class:`Launch`."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from eldr_sglang.router.config import RouterConfig

from .commands import Launch, flag_value
from .spec import Cluster, Role

GPU_RESOURCE = {"rocm": "amd.com/gpu", "cuda": "nvidia.com/gpu"}
ENGINE_CPU_PER_GPU = 8
ENGINE_MEMORY_GI_PER_GPU = 64
SHM_SIZE = "32Gi"  # NCCL/RCCL and SGLang's shared-memory queues (docker: --shm-size 32g)
ROUTER_MEMORY_GI_PER_WORKER = 2
# SGLang's /health generates one token and waits up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s);
# loading weights takes minutes, so the startup probe allows 60 s + 120 x 15 s.
ENGINE_STARTUP = {"initialDelaySeconds": 60, "periodSeconds": 15, "timeoutSeconds": 25, "failureThreshold": 120}
ENGINE_READY = {"periodSeconds": 30, "timeoutSeconds": 25, "failureThreshold": 2}
ENGINE_LIVE = {"periodSeconds": 30, "timeoutSeconds": 25, "failureThreshold": 4}
# the router's /ready: 200 with at least one healthy prefill and decode server (503 while
# draining); /health: the process answers (liveness)
ROUTER_READY = {"periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2}
ROUTER_LIVE = {"initialDelaySeconds": 10, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6}
# the shared signature key (kubernetes.signature_key_secret): the Secret's key, where pods see it
SIGNATURE_KEY_ITEM = "signature-key"
SIGNATURE_KEY_PATH = "/etc/eldr/signature-key"
ENGINE_KEY_FLAG, ROUTER_KEY_FLAG = "--eldr-signature-key-file", "--signature-key-file"


def engine_ports(launch: Launch) -> list[tuple[str, int]]:
    """(name, port) a server listens on: HTTP, prefill bootstrap, ELDR metrics."""
    ports = [("http", launch.port)]
    for name, flag in (("bootstrap", "--disaggregation-bootstrap-port"), ("eldr-metrics", "--eldr-metrics-port")):
        value = flag_value(launch.argv, flag)
        if value is not None:
            ports.append((name, int(value)))
    return ports


def router_ports(launch: Launch) -> list[tuple[str, int]]:
    sig = flag_value(launch.argv, "--signature-port")
    return [("http", launch.port)] + ([("signature", int(sig))] if sig not in (None, "0") else [])


ROUTER_PROBE_PATHS = {"readinessProbe": "/ready", "livenessProbe": "/health"}


def _probe(settings: dict, path: str = "/health") -> dict:
    return {"httpGet": {"path": path, "port": "http"}, **settings}


def _container(name: str, image: str, launch: Launch, ports: list[tuple[str, int]], env: list[dict],
               resources: dict, probes: dict, mounts: list[dict], paths: dict | None = None) -> dict:
    paths = paths or {}
    out = {"name": name, "image": image, "imagePullPolicy": "IfNotPresent", "command": list(launch.argv),
           "env": [{"name": k, "value": v} for k, v in launch.env] + env,
           "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports],
           "resources": resources, **{k: _probe(v, paths.get(k, "/health")) for k, v in probes.items()}}
    if not out["env"]:
        del out["env"]
    if mounts:
        out["volumeMounts"] = mounts
    return out


def _pod(containers: list[dict], volumes: list[dict], labels: dict, annotations: dict, grace: int,
         node_name: str | None, selector: dict | None = None) -> dict:
    spec: dict[str, Any] = {"containers": containers, "terminationGracePeriodSeconds": grace}
    if volumes:
        spec["volumes"] = volumes
    nodes = dict(selector or {})
    if node_name:
        nodes["kubernetes.io/hostname"] = node_name
    if nodes:
        spec["nodeSelector"] = nodes
    meta: dict[str, Any] = {"labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec}


def _calibration(config: dict | None, mounts: list[dict], volumes: list[dict], annotations: dict) -> None:
    """Mount the artifact ConfigMap's key as the file the command names (a new artifact
    changes the template's checksum annotation, which rolls the pods)."""
    if config is None:
        return
    volumes.append({"name": "calibration", "configMap": {"name": config["name"]}})
    mounts.append({"name": "calibration", "mountPath": config["path"], "subPath": config["key"], "readOnly": True})
    annotations["eldr-sglang/calibration-sha256"] = config["sha256"]


def _signature_key(cluster: Cluster, mounts: list[dict], volumes: list[dict]) -> None:
    """Mount the operator's Secret holding the signature key read-only at SIGNATURE_KEY_PATH."""
    secret = cluster.kubernetes.signature_key_secret
    if secret is None:
        return
    volumes.append({"name": "signature-key", "secret": {"secretName": secret, "defaultMode": 0o400,
                                                         "items": [{"key": SIGNATURE_KEY_ITEM,
                                                                    "path": SIGNATURE_KEY_ITEM}]}})
    mounts.append({"name": "signature-key", "mountPath": SIGNATURE_KEY_PATH, "subPath": SIGNATURE_KEY_ITEM,
                   "readOnly": True})


def _scrape(annotations: dict, port: int) -> None:
    annotations.update({"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                        "prometheus.io/path": "/metrics"})


def engine_statefulset(cluster: Cluster, role: Role, launch: Launch, metadata: dict, labels: dict, service: str,
                       image: str, config: dict | None, node_name: str | None) -> dict:
    """One server: a StatefulSet of one pod (stable name and DNS entry through ``service``)."""
    n = role.tp_size
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}]
    for name, path in (("model", cluster.model_path),
                       ("placement", role.placement_dir if "--init-expert-location" in launch.argv else None)):
        if path is not None and PurePosixPath(path).is_absolute():  # a path on the nodes; else a hub model id
            mounts.append({"name": name, "mountPath": path, "readOnly": True})
            volumes.append({"name": name, "hostPath": {"path": path, "type": "Directory"}})
    annotations: dict[str, str] = {}
    _calibration(config, mounts, volumes, annotations)
    _signature_key(cluster, mounts, volumes)
    ports = engine_ports(launch)
    if dict(ports).get("eldr-metrics"):
        _scrape(annotations, dict(ports)["eldr-metrics"])
    gpu = GPU_RESOURCE[cluster.vendor]
    kube = cluster.kubernetes
    limits = {gpu: str(n)}
    if kube.rdma_resource:
        limits[kube.rdma_resource] = str(kube.rdma_count)
    resources = {"requests": {"cpu": str(ENGINE_CPU_PER_GPU * n), "memory": f"{ENGINE_MEMORY_GI_PER_GPU * n}Gi"},
                 "limits": limits}
    container = _container(role.kind, image, launch, ports, [], resources,
                           {"startupProbe": ENGINE_STARTUP, "readinessProbe": ENGINE_READY,
                            "livenessProbe": ENGINE_LIVE}, mounts)
    if kube.rdma_resource or kube.host_network:  # RDMA memory registration pins pages
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    pod = _pod([container], volumes, labels, annotations, 60, node_name, dict(kube.node_selector))
    if kube.host_network:  # Services' DNS names still resolve
        pod["spec"].update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata,
            "spec": {"serviceName": service, "replicas": 1, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": labels}, "template": pod}}


def router_deployment(cluster: Cluster, launch: Launch, metadata: dict, labels: dict, image: str, replicas: int,
                      config: dict | None, node_name: str | None) -> dict:
    """The router: ``replicas`` pods side by side (decode load is shared through GET /v1/loads)."""
    workers = int(flag_value(launch.argv, "--workers") or RouterConfig.workers)
    drain = float(flag_value(launch.argv, "--drain-timeout") or RouterConfig.drain_timeout)
    mounts: list[dict] = []
    volumes: list[dict] = []
    annotations: dict[str, str] = {}
    _calibration(config, mounts, volumes, annotations)
    _signature_key(cluster, mounts, volumes)
    _scrape(annotations, launch.port)
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    resources = {"requests": {"cpu": str(workers), "memory": f"{ROUTER_MEMORY_GI_PER_WORKER * workers}Gi"}}
    container = _container("router", image, launch, router_ports(launch), env, resources,
                           {"readinessProbe": ROUTER_READY, "livenessProbe": ROUTER_LIVE}, mounts, ROUTER_PROBE_PATHS)
    if replicas > 1 and "--routers" not in launch.argv:  # each counts the others' unseen requests
        container["command"] += ["--routers", str(replicas)]
    pod = _pod([container], volumes, labels, annotations, int(drain) + 15, node_name)
    # replicas on different nodes where possible: one node's loss leaves the others serving
    pod["spec"]["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": labels},
                                            "topologyKey": "kubernetes.io/hostname"}}]}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata,
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": pod}}
