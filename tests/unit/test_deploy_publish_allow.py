"""Where generated prefill servers may publish signatures (``--eldr-publish-allow``):
the router's host in the scripts, ``kubernetes.publish_allow`` in the manifests."""

from __future__ import annotations

import pytest
import yaml

from eldr_sglang.deploy import load_description
from eldr_sglang.deploy.__main__ import main as deploy_main
from eldr_sglang.deploy.commands import build_launches
from eldr_sglang.deploy.k8s_pods import flag_value
from eldr_sglang.deploy.spec import parse_cluster
from eldr_sglang.patches.publish_allow import DestinationAllowList, parse_entries
from tests.unit.test_deploy_k8s import generate, pod_spec, write_artifact
from tests.unit.test_deploy_signature_key import PRESET, description, workloads

FLAG = "--eldr-publish-allow"


def prefill_flags(doc: dict) -> list[str | None]:
    return [flag_value(list(l.argv), FLAG) for l in build_launches(parse_cluster(doc)) if l.name.startswith("prefill")]


def test_scripts_allow_only_the_router_host():
    doc = load_description(preset=PRESET)
    router_host = next(n["host"] for n in doc["nodes"] if n["name"] == doc["router"]["node"])
    got = prefill_flags(doc)
    assert got and set(got) == {router_host}
    allow = DestinationAllowList(parse_entries(got[0]), resolve=lambda name: set())  # as the engine reads it
    assert allow.allows(router_host) and not allow.allows("203.0.113.9")


def test_the_router_advertises_the_host_the_list_allows():
    """Bound on 0.0.0.0, the router would advertise whatever its host name resolves to
    (127.0.1.1 on many hosts), which the list would refuse."""
    doc = load_description(preset=PRESET)
    launches = build_launches(parse_cluster(doc))
    (router,) = [l for l in launches if l.name == "router"]
    allowed = {flag_value(list(l.argv), FLAG) for l in launches if l.name.startswith("prefill")}
    assert allowed == {flag_value(list(router.argv), "--advertise-host")} == {router.host}


def test_an_advertised_router_host_is_allowed_too_and_a_hand_given_list_is_kept():
    doc = load_description(preset=PRESET)
    router_host = next(n["host"] for n in doc["nodes"] if n["name"] == doc["router"]["node"])
    doc["router"]["extra_args"] = ["--advertise-host", "router.example"]
    assert set(prefill_flags(doc)) == {f"{router_host},router.example"}
    (router,) = [l for l in build_launches(parse_cluster(doc)) if l.name == "router"]
    assert list(router.argv).count("--advertise-host") == 1
    doc["prefill"]["extra_args"] = [FLAG, "10.0.0.0/8"]
    launches = [l for l in build_launches(parse_cluster(doc)) if l.name.startswith("prefill")]
    assert all(list(l.argv).count(FLAG) == 1 and flag_value(list(l.argv), FLAG) == "10.0.0.0/8" for l in launches)


def test_manifests_take_kubernetes_publish_allow(tmp_path, capsys):
    files = generate(tmp_path, [str(description(tmp_path, publish_allow=["10.244.0.0/16", "eldr-router"]))],
                     clusters=16)
    assert "kubernetes.publish_allow is not set" not in capsys.readouterr().err
    prefill = [w for w in workloads(files) if "-prefill-" in w["metadata"]["name"]]
    assert prefill
    for w in prefill:
        (c,) = pod_spec(w)["containers"]
        assert flag_value(c["command"], FLAG) == "10.244.0.0/16,eldr-router" and c["command"].count(FLAG) == 1


def test_manifests_without_the_key_warn_and_set_no_list(tmp_path, capsys):
    """Router replicas advertise their pod IPs, so the router's host alone would refuse them."""
    files = generate(tmp_path, ["--preset", PRESET], clusters=16)
    assert "warning: kubernetes.publish_allow is not set" in capsys.readouterr().err
    for w in workloads(files):
        (c,) = pod_spec(w)["containers"]
        assert FLAG not in c["command"]


@pytest.mark.parametrize("value", ["10.0.0.0/8", ["not a host!"], [7], ["10.0.0.0/33"]])
def test_a_bad_list_is_one_line_naming_the_field(tmp_path, capsys, value):
    path = description(tmp_path, publish_allow=value)
    artifact = write_artifact(tmp_path / "artifact.json", 16)
    assert deploy_main(["k8s", str(path), "--out", str(tmp_path / "out"), "--artifact", str(artifact)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: kubernetes.publish_allow:") and err.count("\n") == 1, err
