"""The shared signature key in the Kubernetes manifests (``kubernetes.signature_key_secret``)
and the ``kubernetes:`` keys' table in docs/DEPLOY.md, generated from the spec."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from eldr_sglang.deploy import load_description
from eldr_sglang.deploy.__main__ import main as deploy_main
from eldr_sglang.deploy.k8s_pods import (ENGINE_KEY_FLAG, ROUTER_KEY_FLAG, SIGNATURE_KEY_ITEM, SIGNATURE_KEY_PATH,
                                         flag_value)
from eldr_sglang.deploy.keys_doc import BEGIN, END, kubernetes_keys_table
from eldr_sglang.deploy.spec import Kubernetes
from tests.unit.test_deploy_k8s import generate, pod_spec, to_model, write_artifact

ROOT = Path(__file__).resolve().parents[2]
PRESET = "qwen3-30b-a3b-8p16d-mi300x"


def description(tmp_path: Path, **kubernetes) -> Path:
    doc = load_description(preset=PRESET)
    doc["kubernetes"].update(kubernetes)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def workloads(files: dict[str, list[dict]]) -> list[dict]:
    return [d for docs in files.values() for d in docs if d["kind"] in ("StatefulSet", "Deployment")]


def test_the_secret_is_mounted_and_passed_to_engines_and_routers(tmp_path, capsys):
    files = generate(tmp_path, [str(description(tmp_path, signature_key_secret="eldr-signature-key"))], clusters=16)
    assert "UNAUTHENTICATED" not in capsys.readouterr().err
    found = workloads(files)
    assert {w["kind"] for w in found} == {"StatefulSet", "Deployment"} and len(found) == 8 + 16 + 1
    for w in found:
        to_model(w)
        spec = pod_spec(w)
        (c,) = spec["containers"]
        flag = ROUTER_KEY_FLAG if w["kind"] == "Deployment" else ENGINE_KEY_FLAG
        assert flag_value(c["command"], flag) == SIGNATURE_KEY_PATH, w["metadata"]["name"]
        assert c["command"].count(flag) == 1
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == SIGNATURE_KEY_PATH]
        assert mount["readOnly"] is True and mount["subPath"] == SIGNATURE_KEY_ITEM
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "eldr-signature-key"
        assert volume["secret"]["items"] == [{"key": SIGNATURE_KEY_ITEM, "path": SIGNATURE_KEY_ITEM}]


def test_without_a_secret_the_intake_is_flagged_unauthenticated(tmp_path, capsys):
    files = generate(tmp_path, ["--preset", PRESET], clusters=16)
    err = capsys.readouterr().err
    assert "warning: kubernetes.signature_key_secret is not set" in err and "UNAUTHENTICATED" in err
    for w in workloads(files):
        (c,) = pod_spec(w)["containers"]
        assert ROUTER_KEY_FLAG not in c["command"] and ENGINE_KEY_FLAG not in c["command"]
        assert all(m["mountPath"] != SIGNATURE_KEY_PATH for m in c.get("volumeMounts", []))
    assert deploy_main(["check", "--preset", PRESET, "--skip-files"]) == 0
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_a_key_file_given_by_hand_is_kept(tmp_path, capsys):
    """A description whose router already names a key file is not warned about, and the
    generator does not add a second flag."""
    doc = load_description(preset=PRESET)
    doc["router"]["extra_args"] = [ROUTER_KEY_FLAG, "/keys/k"]
    doc["kubernetes"]["signature_key_secret"] = "s"
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    files = generate(tmp_path, [str(path)], clusters=16)
    (router,) = files["50-router.yaml"]
    (c,) = pod_spec(router)["containers"]
    assert flag_value(c["command"], ROUTER_KEY_FLAG) == "/keys/k" and c["command"].count(ROUTER_KEY_FLAG) == 1
    assert "UNAUTHENTICATED" not in capsys.readouterr().err


@pytest.mark.parametrize("value", ["Bad_Name", "", 7, "a" * 254])
def test_a_bad_secret_name_is_one_line_naming_the_field(tmp_path, capsys, value):
    path = description(tmp_path, signature_key_secret=value)
    artifact = write_artifact(tmp_path / "artifact.json", 16)
    assert deploy_main(["k8s", str(path), "--out", str(tmp_path / "out"), "--artifact", str(artifact)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: kubernetes.signature_key_secret:") and err.count("\n") == 1


def test_docs_list_every_kubernetes_key_as_generated():
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    assert BEGIN in text and END in text, "docs/DEPLOY.md lacks the generated kubernetes keys table"
    current = text[text.index(BEGIN): text.index(END) + len(END)]
    assert current == kubernetes_keys_table(), "regenerate: python -m eldr_sglang.deploy.keys_doc"
    table = kubernetes_keys_table()
    assert all(f"| `{f.name}` |" in table for f in fields(Kubernetes))
    assert SIGNATURE_KEY_PATH in table and f"`{SIGNATURE_KEY_ITEM}`" in table  # the help names the real path


def test_the_generated_key_flags_parse_with_the_engine_and_router_parsers(tmp_path):
    """The flags the pods run are the ones the engine plugin and the router take, and both
    read the key from the mounted file (here a local stand-in at the same place in argv)."""
    from eldr_sglang.patches.flags import parse_eldr_flags, split_argv
    from eldr_sglang.router.cli import parse_args

    files = generate(tmp_path, [str(description(tmp_path, signature_key_secret="k"))], clusters=16)
    key = tmp_path / "signature.key"
    key.write_text("s3cret\n")
    calibration = load_description(preset=PRESET)["calibration"]
    local = {SIGNATURE_KEY_PATH: str(key), calibration: str(tmp_path / "artifact.json"), "$(POD_IP)": "127.0.0.1"}
    for w in workloads(files):
        (c,) = pod_spec(w)["containers"]
        argv = [local.get(a, a) for a in c["command"]]
        if w["kind"] == "Deployment":
            assert argv[:3] == ["python", "-m", "eldr_sglang.router"]
            assert parse_args(argv[3:]).router_config.signature_key() == b"s3cret"
        else:
            engine = parse_eldr_flags(split_argv(argv)[0])
            assert engine.signature_key_file == str(key.resolve()), w["metadata"]["name"]
