"""Kubernetes manifests of the deploy generator (``python -m eldr_sglang.deploy k8s``).

Every shipped preset's objects load into the kubernetes client's models (required
fields, types, no unknown keys) and their cross-references hold: selectors, ports
and probes, the artifact ConfigMap and its mounts, DNS names, and each container's
command against the server's launch command."""

from __future__ import annotations

import copy
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from kubernetes.client import ApiClient

from eldr_sglang.core.artifact import CalibrationArtifact
from eldr_sglang.core.traces import ModelSpec
from eldr_sglang.deploy import build_launches, load_description, parse_cluster, preset_names
from eldr_sglang.deploy import k8s as k8s_module
from eldr_sglang.deploy.__main__ import main as deploy_main
from eldr_sglang.deploy.image import default_image
from eldr_sglang.deploy.k8s import in_cluster
from eldr_sglang.deploy.models import target_model

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"StatefulSet": "V1StatefulSet", "Deployment": "V1Deployment", "Service": "V1Service",
          "ConfigMap": "V1ConfigMap", "Namespace": "V1Namespace", "NetworkPolicy": "V1NetworkPolicy",
          "PodDisruptionBudget": "V1PodDisruptionBudget"}
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # IANA_SVC_NAME, at most 15
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
PORT_FLAGS = {"--port": "http", "--disaggregation-bootstrap-port": "bootstrap", "--eldr-metrics-port": "eldr-metrics"}


def write_artifact(path: Path, clusters: int, num_layers: int = 48) -> Path:
    """A valid calibration artifact with ``clusters`` centroids (4 selected layers of a model of
    ``num_layers`` layers x 128 experts, top-8: Qwen3-30B-A3B by default, 94 for Qwen3-235B-A22B)."""
    rng = np.random.default_rng(clusters)
    c = rng.random((clusters, 4 * 128)).astype(np.float32)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    layers = [0, 10, 20, 30] if num_layers > 30 else [0, 1, 2, 3]
    CalibrationArtifact(ModelSpec("m", num_layers, 128, 8), "idf", layers, np.ones((4, 128)), c).save(path)
    return path


def layers_of(preset: str) -> int:
    return target_model(cluster_of(preset).model_path).num_layers


def to_model(doc: dict):
    """The object as the kubernetes client's model: raises when a required field is missing
    or a value has the wrong type; AssertionError when a key is not part of the model."""
    api = ApiClient()
    kind = MODELS[doc["kind"]]
    if list(inspect.signature(api.deserialize).parameters)[0] == "response":  # clients before 37
        obj = api.deserialize(SimpleNamespace(data=json.dumps(doc)), kind)
    else:
        obj = api.deserialize(json.dumps(doc), kind, None)
    assert api.sanitize_for_serialization(obj) == doc, f"{doc['kind']} {doc['metadata']['name']}: unknown keys"
    return obj


def generate(tmp_path: Path, source: list[str], *extra: str, clusters: int | None = None,
             num_layers: int = 48) -> dict[str, list[dict]]:
    """Run the ``k8s`` subcommand; {file name: documents}."""
    out = tmp_path / "k8s"
    args = ["k8s", *source, "--out", str(out), *extra]
    if clusters is not None:
        args += ["--artifact", str(write_artifact(tmp_path / "artifact.json", clusters, num_layers))]
    assert deploy_main(args) == 0
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted(out.glob("*.yaml"))}


def cluster_of(preset: str):
    return parse_cluster(load_description(preset=preset))


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container_ports(workload: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in pod_spec(workload)["containers"] for p in c["ports"]}


def check_object_rules(docs: list[dict], namespace: str) -> None:
    """Names, labels and port names the API server would accept; every object loads."""
    for doc in docs:
        to_model(doc)
        meta = doc["metadata"]
        name = meta["name"]
        if doc["kind"] == "Namespace":
            assert DNS_1123_LABEL.match(name) and len(name) <= 63
            continue
        assert meta["namespace"] == namespace
        if doc["kind"] == "Service":
            assert DNS_1035_LABEL.match(name) and len(name) <= 63, name
        elif doc["kind"] == "StatefulSet":
            assert DNS_1123_LABEL.match(name) and len(name) <= 52, name
        else:
            assert DNS_1123_SUBDOMAIN.match(name) and len(name) <= 253, name
        template = doc.get("spec", {}).get("template", {})
        for labels in (meta.get("labels", {}), template.get("metadata", {}).get("labels", {})):
            assert all(LABEL_VALUE.match(v) and len(v) <= 63 for v in labels.values()), labels
        ports = doc["spec"]["ports"] if doc["kind"] == "Service" else (
            [p for c in pod_spec(doc)["containers"] for p in c["ports"]] if "template" in doc.get("spec", {}) else [])
        assert all(PORT_NAME.match(p["name"]) and len(p["name"]) <= 15 for p in ports), ports


def check_cross_references(docs: list[dict]) -> None:
    """Selectors, Services, probes, volumes and ConfigMaps refer to objects that exist."""
    workloads = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = container_ports(w)
        spec = pod_spec(w)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:  # the router is ready with healthy workers (/ready), alive on /health
                    router_ready = w["kind"] == "Deployment" and probe == "readinessProbe"
                    assert c[probe]["httpGet"]["path"] == ("/ready" if router_ready else "/health")
                    port = c[probe]["httpGet"]["port"]
                    assert port in ports or port in ports.values(), (w["metadata"]["name"], probe, port)
            assert "readinessProbe" in c and "livenessProbe" in c
            for mount in c.get("volumeMounts", []):
                volume = volumes[mount["name"]]
                if "configMap" in volume:
                    assert mount["subPath"] in configmaps[volume["configMap"]["name"]]["data"]
        if w["kind"] == "StatefulSet":
            headless = services[w["spec"]["serviceName"]]["spec"]
            assert headless["clusterIP"] == "None" and headless["selector"].items() <= labels.items(), \
                f"{w['metadata']['name']}: its serviceName does not select it"
    for name, svc in services.items():
        selected = [w for w in workloads
                    if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert selected, f"Service {name} selects no pods"
        for w in selected:
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(container_ports(w)), name
    for doc in docs:
        if doc["kind"] not in ("NetworkPolicy", "PodDisruptionBudget"):
            continue
        selector = doc["spec"]["podSelector" if doc["kind"] == "NetworkPolicy" else "selector"]
        assert [w for w in workloads if selects(selector, w)], f"{doc['kind']} {doc['metadata']['name']} selects no pods"
        for rule in doc["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    assert [w for w in workloads if selects(peer["podSelector"], w)], doc["metadata"]["name"]


def selects(selector: dict, workload: dict) -> bool:
    """A label selector (matchLabels, matchExpressions with In) matches the workload's pods."""
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return selector.get("matchLabels", {}).items() <= labels.items() and all(
        e["operator"] == "In" and labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def pod_url(docs: list[dict], scheme: str, workload: dict, port: str, namespace: str) -> str:
    """The URL the generated DNS name of a workload's (first) pod gives for a named port."""
    name = workload["metadata"]["name"]
    if workload["kind"] == "StatefulSet":
        host = f"{name}-0.{workload['spec']['serviceName']}.{namespace}.svc.cluster.local"
        return f"{scheme}://{host}:{container_ports(workload)[port]}"
    svc = next(d for d in docs if d["kind"] == "Service" and d["spec"].get("type") == "ClusterIP")
    number = next(p["port"] for p in svc["spec"]["ports"] if p["targetPort"] == port)
    return f"{scheme}://{svc['metadata']['name']}.{namespace}.svc.cluster.local:{number}"


def check_commands(docs: list[dict], preset: str, namespace: str) -> None:
    """Each container runs its server's launch command (the argv ``dry-run`` prints for the
    description) with only addresses changed, every one pointing at a generated object."""
    cluster = cluster_of(preset)
    original = {l.name: l for l in build_launches(cluster)}
    generated = {l.name: l for l in build_launches(in_cluster(cluster, namespace))}
    workloads = {d["metadata"]["name"].removeprefix(cluster.name + "-"): d
                 for d in docs if d["kind"] in ("StatefulSet", "Deployment")}
    assert set(workloads) == set(original)
    router = workloads["router"]
    for name, launch in original.items():
        w = workloads[name]
        (c,) = pod_spec(w)["containers"]
        command = c["command"]
        assert tuple(command) == generated[name].argv
        if name == "router":
            assert command[-2:] == ["--advertise-host", "$(POD_IP)"]
            assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
            command = command[:-2]
        argv = list(launch.argv)
        if name == "router":  # dry-run: the router's node host, the one the prefill allow-list names
            assert argv[-2:] == ["--advertise-host", launch.host]
            del argv[-2:]
        if name.startswith("prefill"):  # dry-run pins the router's host; pods: kubernetes.publish_allow
            k = argv.index("--eldr-publish-allow")
            assert argv[k + 1] == cluster.node(cluster.router.node).host and "--eldr-publish-allow" not in command
            del argv[k:k + 2]
        assert len(command) == len(argv), name
        mine = container_ports(w)
        i = 0
        while i < len(command):
            flag, ours = argv[i], command[i]
            if i and argv[i - 1] in PORT_FLAGS:
                assert int(ours) == mine[PORT_FLAGS[argv[i - 1]]]
            elif i and argv[i - 1] == "--eldr-publish":
                assert ours == pod_url(docs, "tcp", router, "signature", namespace)
            elif i and argv[i - 1] == "--engine-metrics":  # each decode pod's plugin endpoint
                pods = [workloads[f"decode-{k}"] for k in range(len(ours.split(",")))]
                assert ours.split(",") == [pod_url(docs, "http", d, "eldr-metrics", namespace) + "/metrics"
                                           for d in pods]
            elif flag in ("--prefill", "--decode"):
                server = workloads[f"{flag[2:]}-{sum(a == flag for a in argv[:i])}"]
                assert command[i + 1] == pod_url(docs, "http", server, "http", namespace)
                if flag == "--prefill":
                    assert int(command[i + 2]) == container_ports(server)["bootstrap"]
                    i += 1
                i += 1
            else:
                assert ours == flag, (name, i, ours, flag)
            i += 1
        env = dict((e["name"], e.get("value")) for e in c.get("env", []))
        if name != "router":
            tp = len(launch.gpus)
            assert env["HIP_VISIBLE_DEVICES"] == ",".join(map(str, range(tp)))
            assert c["resources"]["limits"] == {"amd.com/gpu": str(tp), "rdma/hca_shared_devices_a": "1"}
            assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}  # RDMA pins memory


GPU_PRESETS = [p for p in preset_names() if load_description(preset=p)["vendor"] != "cpu"]


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_preset_manifests(tmp_path, preset):
    cluster = cluster_of(preset)
    files = generate(tmp_path, ["--preset", preset], clusters=cluster.decode.count, num_layers=layers_of(preset))
    assert list(files) == ["10-calibration.yaml", "20-services.yaml", "30-prefill.yaml", "40-decode.yaml",
                           "50-router.yaml", "60-policies.yaml"]
    docs = [d for ds in files.values() for d in ds]
    check_object_rules(docs, "default")
    check_cross_references(docs)
    check_commands(docs, preset, "default")
    kinds = [d["kind"] for d in docs]
    assert kinds.count("StatefulSet") == cluster.prefill.count + cluster.decode.count
    assert kinds.count("Deployment") == kinds.count("ConfigMap") == 1 and kinds.count("Service") == 3
    assert kinds.count("NetworkPolicy") == 2 and kinds.count("PodDisruptionBudget") == 3
    assert all(d["spec"]["replicas"] == 1 for d in docs if d["kind"] in ("StatefulSet", "Deployment"))
    (configmap,) = files["10-calibration.yaml"]
    assert list(configmap["data"].values()) == [(tmp_path / "artifact.json").read_text()]
    for d in docs:
        if d["kind"] not in ("StatefulSet", "Deployment"):
            continue
        (c,) = pod_spec(d)["containers"]
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        role = d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        path = {"prefill": "--eldr-calibration", "router": "--calibration"}.get(role)
        assert (cluster.calibration in mounts) == (path is not None), (role, mounts)
        if path:
            assert c["command"][c["command"].index(path) + 1] == cluster.calibration
        if role != "router":
            assert c["startupProbe"]["initialDelaySeconds"] + c["startupProbe"]["periodSeconds"] * \
                c["startupProbe"]["failureThreshold"] >= 20 * 60  # model loading takes minutes


def test_namespace_replicas_cuda_and_pinning(tmp_path):
    preset = "qwen3-30b-a3b-8p16d-mi300x"
    doc = copy.deepcopy(load_description(preset=preset))
    doc["vendor"] = "cuda"
    (tmp_path / "cuda.yaml").write_text(yaml.safe_dump(doc))
    files = generate(tmp_path, [str(tmp_path / "cuda.yaml")], "--namespace", "eldr", "--router-replicas", "3",
                     "--pin-nodes", "--image", "registry.local/eldr:1", clusters=16)
    assert files["00-namespace.yaml"] == [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "eldr"}}]
    docs = [d for ds in files.values() for d in ds]
    check_object_rules(docs, "eldr")
    check_cross_references(docs)
    (router,) = files["50-router.yaml"]
    assert router["spec"]["replicas"] == 3
    assert pod_spec(router)["containers"][0]["command"][-2:] == ["--routers", "3"]
    nodes = {l.name: l.node for l in build_launches(parse_cluster(doc))}
    for w in files["30-prefill.yaml"] + files["40-decode.yaml"]:
        (c,) = pod_spec(w)["containers"]
        assert c["image"] == "registry.local/eldr:1"
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "1", "rdma/hca_shared_devices_a": "1"}
        assert {e["name"]: e["value"] for e in c["env"]}["CUDA_VISIBLE_DEVICES"] == "0"
        server = w["metadata"]["name"].removeprefix(doc["name"] + "-")
        assert pod_spec(w)["nodeSelector"] == {"kubernetes.io/hostname": nodes[server], "eldr-sglang/models": "true"}
        assert ".eldr.svc.cluster.local" in " ".join(c["command"]) or server.startswith("decode")


def test_model_check_refuses_broken_objects(tmp_path):
    """The model check the tests rely on does fail: a missing required field, a wrong type
    and a misspelt key are each refused."""
    files = generate(tmp_path, ["--preset", "qwen3-235b-a22b-tp4ep4-mi300x"], clusters=6, num_layers=94)
    sts = files["40-decode.yaml"][0]
    to_model(sts)
    no_name = copy.deepcopy(sts)
    del pod_spec(no_name)["containers"][0]["name"]
    wrong_type = copy.deepcopy(sts)
    wrong_type["spec"]["replicas"] = "one"
    misspelt = copy.deepcopy(sts)
    pod_spec(misspelt)["containers"][0]["readinesProbe"] = pod_spec(misspelt)["containers"][0].pop("readinessProbe")
    for broken in (no_name, wrong_type, misspelt):
        with pytest.raises((ValueError, AssertionError)):
            to_model(broken)
    dangling = copy.deepcopy([d for ds in files.values() for d in ds])
    router_service = next(d for d in dangling if d["kind"] == "Service" and d["spec"].get("type") == "ClusterIP")
    router_service["spec"]["selector"]["app.kubernetes.io/component"] = "nope"
    with pytest.raises(AssertionError, match="selects no pods"):
        check_cross_references(dangling)


def _bad(doc: dict, key: str, value) -> dict:
    doc = copy.deepcopy(doc)
    doc[key] = value
    return doc


BAD = [
    ("vendor", "metal", [], "vendor: 'metal' is not one of"),
    ("name", "Qwen3_Big", [], "name: 'Qwen3_Big' cannot prefix Kubernetes names"),
    ("name", "q" * 60, [], "at most 42 characters"),
    ("calibration", "artifact.json", [], "calibration: 'artifact.json' must be an absolute path"),
    (None, None, ["--namespace", "Bad_NS"], "namespace: 'Bad_NS' is not a DNS-1123 label"),
    (None, None, ["--router-replicas", "0"], "router_replicas: 0"),
]


@pytest.mark.parametrize("key,value,extra,message", BAD, ids=[b[3].split(":")[0] + str(i) for i, b in enumerate(BAD)])
def test_bad_description_refused_naming_the_field(tmp_path, capsys, key, value, extra, message):
    doc = load_description(preset="qwen3-30b-a3b-8p16d-mi300x")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_bad(doc, key, value) if key else doc))
    art = write_artifact(tmp_path / "a.json", 16)
    assert deploy_main(["k8s", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out"), "--artifact", str(art),
                        *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_artifact_missing_unfit_or_too_large(tmp_path, capsys, monkeypatch):
    """Like ``check``: the artifact must exist and fit the decode servers (exit status 2 from
    the command line); a ConfigMap cannot hold more than about 1 MiB."""
    done = subprocess.run([sys.executable, "-m", "eldr_sglang.deploy", "k8s", "--preset", "qwen3-30b-a3b-8p16d-mi300x",
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: calibration: /shared/eldr/qwen3-30b-a3b/artifact.json: cannot read")
    assert "--artifact FILE" in done.stderr and not (tmp_path / "out").exists()
    art = write_artifact(tmp_path / "a5.json", 5, num_layers=94)
    assert deploy_main(["k8s", "--preset", "qwen3-235b-a22b-tp4ep4-mi300x", "--out", str(tmp_path / "o"),
                        "--artifact", str(art)]) == 2
    assert "calibration: the artifact has 5 centroids for 6 decode servers" in capsys.readouterr().err
    monkeypatch.setattr(k8s_module, "CONFIGMAP_MAX_BYTES", 1000)
    assert deploy_main(["k8s", "--preset", "qwen3-30b-a3b-8p16d-mi300x", "--out", str(tmp_path / "o"),
                        "--artifact", str(write_artifact(tmp_path / "a16.json", 16))]) == 2
    assert "a ConfigMap holds at most about 1 MiB" in capsys.readouterr().err


def _k8s_refusal(tmp_path, capsys, doc: dict, *extra: str, clusters: int = 16, num_layers: int = 48) -> str:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    art = write_artifact(tmp_path / f"a{clusters}-{num_layers}.json", clusters, num_layers)
    assert deploy_main(["k8s", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out"), "--artifact", str(art),
                        *extra]) == 2
    assert not (tmp_path / "out").exists()
    return capsys.readouterr().err


def test_artifact_that_cannot_fit_the_cluster_is_refused(tmp_path, capsys):
    """16 TP1 decode servers: 3 centroids split them unevenly; a 4-layer artifact is another
    model than Qwen3-30B-A3B (48 layers); 8 centroids (2 servers per region) pass with a note."""
    doc = load_description(preset="qwen3-30b-a3b-8p16d-mi300x")
    err = _k8s_refusal(tmp_path, capsys, doc, clusters=3)
    assert err.startswith("error: calibration: the artifact has 3 centroids for 16 decode servers")
    assert "do not split evenly" in err
    err = _k8s_refusal(tmp_path, capsys, doc, num_layers=4)
    assert err.startswith("error: calibration: the artifact is for model 'm' (4 layers, 128 experts, top-8), "
                          "model_path /models/Qwen3-30B-A3B has 48 layers")
    assert _k8s_refusal(tmp_path, capsys, doc, clusters=1).startswith("error: calibration: the artifact has 1 ")
    files = generate(tmp_path, ["--preset", "qwen3-30b-a3b-8p16d-mi300x"], clusters=8)
    assert "each region is shared by 2 servers" in capsys.readouterr().err and files


def test_a_model_folder_with_its_config_decides_the_identity(tmp_path, capsys):
    model = tmp_path / "my-moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "num_experts": 128,
                                                   "num_experts_per_tok": 8}))
    doc = copy.deepcopy(load_description(preset="qwen3-30b-a3b-8p16d-mi300x"))
    doc["model_path"] = str(model)
    assert "48 layers" in _k8s_refusal(tmp_path, capsys, doc)  # the artifact's 48 against the folder's 4
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    assert generate(tmp_path, [str(tmp_path / "c.yaml")], clusters=16, num_layers=4)


def test_mooncake_without_rdma_in_the_pods_is_refused(tmp_path, capsys):
    doc = copy.deepcopy(load_description(preset="qwen3-30b-a3b-8p16d-mi300x"))
    del doc["kubernetes"]["rdma_resource"]
    err = _k8s_refusal(tmp_path, capsys, doc)
    assert err.startswith("error: kubernetes.rdma_resource: transfer_backend mooncake moves KV caches over RDMA")
    assert "ib_device is null" in err and "mooncake_tcp" in err
    doc["ib_device"] = "rdma0"
    assert "ib_device rdma0 is not visible inside a pod" in _k8s_refusal(tmp_path, capsys, doc)
    tcp = {**doc, "transfer_backend": "mooncake_tcp", "ib_device": None}
    (tmp_path / "tcp.yaml").write_text(yaml.safe_dump(tcp))
    files = generate(tmp_path, [str(tmp_path / "tcp.yaml")], clusters=16)
    (c,) = pod_spec(files["30-prefill.yaml"][0])["containers"]
    assert set(c["resources"]["limits"]) == {"amd.com/gpu"} and "securityContext" not in c
    host = {**doc, "kubernetes": {**doc["kubernetes"], "host_network": True}}
    (tmp_path / "host.yaml").write_text(yaml.safe_dump(host))
    files = generate(tmp_path, [str(tmp_path / "host.yaml")], clusters=16)
    assert "at most one prefill and one decode pod fit on a node" in capsys.readouterr().err
    for w in files["30-prefill.yaml"] + files["40-decode.yaml"]:
        assert pod_spec(w)["hostNetwork"] is True and pod_spec(w)["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "hostNetwork" not in pod_spec(files["50-router.yaml"][0])


def test_host_path_mounts_need_node_pinning(tmp_path, capsys):
    doc = copy.deepcopy(load_description(preset="qwen3-30b-a3b-8p16d-mi300x"))
    del doc["kubernetes"]["node_selector"]
    err = _k8s_refusal(tmp_path, capsys, doc)
    assert err.startswith("error: kubernetes.node_selector: model_path /models/Qwen3-30B-A3B is mounted from the "
                          "nodes (hostPath)")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    files = generate(tmp_path, [str(tmp_path / "c.yaml")], "--pin-nodes", clusters=16)
    assert all(set(pod_spec(w)["nodeSelector"]) == {"kubernetes.io/hostname"} for w in files["40-decode.yaml"])
    hub = {**doc, "model_path": "Qwen/Qwen3-30B-A3B"}  # a hub id: downloaded in the pod, no hostPath
    (tmp_path / "hub.yaml").write_text(yaml.safe_dump(hub))
    files = generate(tmp_path, [str(tmp_path / "hub.yaml")], clusters=16)
    assert all("nodeSelector" not in pod_spec(w) for w in files["40-decode.yaml"])
    bad = copy.deepcopy(load_description(preset="qwen3-30b-a3b-8p16d-mi300x"))
    bad["kubernetes"]["node_selector"] = {"disk": 1}
    assert "kubernetes.node_selector: expected a mapping" in _k8s_refusal(tmp_path, capsys, bad)


def test_metrics_probes_and_policies(tmp_path):
    """Every engine runs SGLang's --enable-metrics and is scraped (prefill included: signatures
    sent and dropped); the router is ready on /ready; replicas spread over nodes; the network
    policies let clients reach only the router, signatures come only from prefill pods."""
    files = generate(tmp_path, ["--preset", "qwen3-30b-a3b-8p16d-mi300x"], "--router-replicas", "2", clusters=16)
    for w in files["30-prefill.yaml"] + files["40-decode.yaml"]:
        (c,) = pod_spec(w)["containers"]
        assert "--enable-metrics" in c["command"]
        notes = w["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == container_ports(w)["eldr-metrics"]
    (router,) = files["50-router.yaml"]
    (c,) = pod_spec(router)["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    (term,) = pod_spec(router)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    assert c["image"] == default_image("rocm")
    policies = {d["metadata"]["name"]: d for d in files["60-policies.yaml"] if d["kind"] == "NetworkPolicy"}
    engines = policies["qwen3-30b-a3b-8p16d-mi300x-engines"]["spec"]
    open_rules = [r for r in engines["ingress"] if "from" not in r]
    assert [p["port"] for r in open_rules for p in r["ports"]] == ["eldr-metrics"]  # HTTP is not open to all
    router_rules = policies["qwen3-30b-a3b-8p16d-mi300x-router"]["spec"]["ingress"]
    signature = next(r for r in router_rules if r["ports"][0]["port"] == "signature")
    (peer,) = signature["from"]
    prefill = files["30-prefill.yaml"][0]
    assert selects(peer["podSelector"], prefill) and not selects(peer["podSelector"], files["40-decode.yaml"][0])
    budgets = [d for d in files["60-policies.yaml"] if d["kind"] == "PodDisruptionBudget"]
    assert all(d["spec"]["maxUnavailable"] == 1 for d in budgets)


def test_the_cpu_preset_is_refused_for_kubernetes(tmp_path, capsys):
    rc = deploy_main(["k8s", "--preset", "cpu-1p2d-loopback", "--out", str(tmp_path / "k8s")])
    assert rc == 2 and "vendor: 'cpu': Kubernetes manifests request GPUs" in capsys.readouterr().err
