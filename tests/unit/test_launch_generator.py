"""Cluster launch generator: presets' dry runs, refused descriptions (CLI exit 2),
file checks, and the generated flags against SGLang 0.5.23's own parser."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eldr_sglang.deploy import build_launches, load_description, parse_cluster, preset_names
from eldr_sglang.deploy.__main__ import main as deploy_main
from eldr_sglang.patches.flags import split_argv

ROOT = Path(__file__).resolve().parents[2]
P30B, P235B = "qwen3-30b-a3b-8p16d-mi300x", "qwen3-235b-a22b-tp4ep4-mi300x"


def launches_of(preset: str):
    return build_launches(parse_cluster(load_description(preset=preset)))


def flag(argv, name: str) -> str:
    return argv[argv.index(name) + 1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eldr_sglang.deploy", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_presets_are_shipped():
    assert {P30B, P235B} <= set(preset_names())


@pytest.mark.parametrize("preset,n_prefill,n_decode,tp,ep", [(P30B, 8, 16, 1, 1), (P235B, 4, 6, 4, 4)])
def test_preset_commands(preset, n_prefill, n_decode, tp, ep):
    launches = launches_of(preset)
    prefill = [l for l in launches if l.name.startswith("prefill-")]
    decode = [l for l in launches if l.name.startswith("decode-")]
    router = [l for l in launches if l.name == "router"]
    assert (len(prefill), len(decode), len(router)) == (n_prefill, n_decode, 1)
    gpus = [(l.node, g) for l in prefill + decode for g in l.gpus]
    assert len(gpus) == len(set(gpus)) == (n_prefill + n_decode) * tp
    for l in prefill + decode:
        env = dict(l.env)
        assert env["HIP_VISIBLE_DEVICES"] == ",".join(map(str, l.gpus)) and "CUDA_VISIBLE_DEVICES" not in env
        a = list(l.argv)
        assert a[1:3] == ["-m", "sglang.launch_server"]
        assert flag(a, "--disaggregation-decode-allocation-policy") == "prefill_complete"
        assert flag(a, "--disaggregation-transfer-backend") == "mooncake"
        assert flag(a, "--tp-size") == str(tp)
        assert ("--attn-dp-size" in a) == (tp > 1) and (tp == 1 or flag(a, "--attn-dp-size") == str(tp))
        assert "--attention-backend" not in a  # aiter is already SGLang's default on ROCm for MHA models
    for l in prefill:
        a = list(l.argv)
        assert flag(a, "--disaggregation-mode") == "prefill"
        assert flag(a, "--eldr-calibration").endswith("artifact.json")
        assert flag(a, "--eldr-publish") == "tcp://10.0.0.10:8001"
        assert "--disaggregation-bootstrap-port" in a
    for k, l in enumerate(decode):
        a = list(l.argv)
        assert flag(a, "--disaggregation-mode") == "decode"
        assert not any(x.startswith("--eldr-calibration") for x in a)
        if ep > 1:
            assert flag(a, "--ep-size") == str(ep)
            assert flag(a, "--init-expert-location").endswith(f"placements/server-{k:02d}.json")
        else:
            assert "--ep-size" not in a and "--init-expert-location" not in a
    r = list(router[0].argv)
    assert r[1:3] == ["-m", "eldr_sglang.router"]
    assert [r[i + 1] for i, x in enumerate(r) if x == "--decode"] == [l.url for l in decode]
    boots = [(r[i + 1], r[i + 2]) for i, x in enumerate(r) if x == "--prefill"]
    assert boots == [(l.url, flag(list(l.argv), "--disaggregation-bootstrap-port")) for l in prefill]
    assert (flag(r, "--policy"), flag(r, "--port")) == ("eldr", "8000")
    assert "--tau" not in r  # the artifact's tau applies unless the description sets one
    assert flag(r, "--signature-port") == "8001"
    assert flag(r, "--calibration") == flag(list(prefill[0].argv), "--eldr-calibration")


def test_router_command_parses_with_the_router_cli():
    from eldr_sglang.router.cli import parse_args

    argv = list(launches_of(P235B)[-1].argv)[3:]
    args = parse_args(argv)
    assert len(args.prefill) == 4 and len(args.decode) == 6 and args.tau is None


def test_dry_run_cli_and_scripts(tmp_path):
    # docs/DEPLOY.md: python -m eldr_sglang.deploy dry-run --preset ...
    done = run_cli("dry-run", "--preset", P30B, "--skip-files")  # the presets' paths are placeholders
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("sglang.launch_server") == 24 and done.stdout.count("eldr_sglang.router") == 1
    assert "24 of 40 GPUs" in done.stdout
    big = run_cli("dry-run", "--preset", P235B, "--skip-files")
    assert big.returncode == 0 and "40 of 40 GPUs" in big.stdout
    assert "refuses" in big.stderr and "attn-dp-size 4" in big.stderr  # the late-binding warning is loud
    assert run_cli("presets").stdout.split() == sorted([P235B, P30B] + [p for p in preset_names()
                                                                        if p not in (P30B, P235B)])
    # docs/DEPLOY.md: python -m eldr_sglang.deploy scripts --preset ... --out DIR
    assert deploy_main(["scripts", "--preset", P30B, "--out", str(tmp_path), "--skip-files"]) == 0
    scripts = sorted(p.name for p in tmp_path.glob("*.sh"))
    assert scripts == sorted([f"mi300x-{i}.sh" for i in range(5)] + [f"mi300x-{i}-stop.sh" for i in range(5)])
    node0 = (tmp_path / "mi300x-0.sh").read_text()
    assert node0.count("sglang.launch_server") == 8 and "eldr_sglang.router" in node0
    assert node0.index("wait_healthy http://10.0.0.11") < node0.index("eldr_sglang.router")
    for path in tmp_path.glob("*.sh"):  # valid bash
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, path.name


@pytest.mark.parametrize("command", ["dry-run", "scripts"])
def test_every_subcommand_checks_the_artifact(tmp_path, command, files_235b):
    """dry-run and scripts refuse a missing artifact like check does (the placeholders need --skip-files)."""
    out = ["--out", str(tmp_path / "out")] if command == "scripts" else []
    missing = run_cli(command, "--preset", P30B, *out)
    assert missing.returncode == 2 and missing.stderr.startswith("error: calibration: "), missing.stderr
    work, doc = files_235b
    assert run_cli(command, str(write(tmp_path, doc)), *out).returncode == 0
    other = tmp_path / "other-model"  # the artifact was calibrated on another model
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"num_hidden_layers": 94, "num_experts": 128,
                                                   "num_experts_per_tok": 8}))
    bad = run_cli(command, str(write(tmp_path, {**doc, "model_path": str(other)}, "other.yaml")), *out)
    assert bad.returncode == 2 and "calibration: the artifact is for model" in bad.stderr, bad.stderr


@pytest.mark.parametrize("role,args,message", [
    ("prefill", ["--disaggregation-decode-allocation-policy", "early"],
     "prefill.extra_args: --disaggregation-decode-allocation-policy is generated"),
    ("decode", ["--port=31999"], "decode.extra_args: --port is generated"),
    ("router", ["--policy", "jsq"], "router.extra_args: --policy is generated"),
])
def test_extra_args_that_repeat_a_generated_flag_are_refused(tmp_path, role, args, message):
    doc = preset_doc(P30B)
    doc[role]["extra_args"] = args
    done = run_cli("check", str(write(tmp_path, doc)), "--skip-files")
    assert done.returncode == 2 and message in done.stderr, done.stderr


def preset_doc(name: str) -> dict:
    return copy.deepcopy(load_description(preset=name))


def write(tmp_path: Path, doc: dict, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def _set(doc: dict, path: str, value) -> dict:
    *parents, leaf = path.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return doc


_DELETE = object()
BAD = [
    (P235B, "decode.ep_size", 3, "decode.ep_size: 3 does not divide tp_size 4"),
    (P235B, "decode.placement_dir", _DELETE, "decode.placement_dir: required when ep_size > 1"),
    (P235B, "attention_dp_late_binding", False, "prefill.tp_size: 4: late binding"),
    (P30B, "decode.servers.3.gpus", [0], "decode.servers[3].gpus: GPU 0 of mi300x-1 is used twice"),
    (P30B, "decode.servers.3.gpus", [9], "decode.servers[3].gpus: GPU 9 does not exist on mi300x-1"),
    (P30B, "decode.metrics_port", 31000, "decode.metrics_port: port 31000 on 10.0.0.11 (decode-0) collides with decode-0"),
    (P30B, "prefill.bootstrap_port", 30004, "prefill.port: port 30004 on 10.0.0.10 (prefill-4) collides with prefill-0 (prefill.bootstrap_port)"),
    (P30B, "prefill.count", 9, "prefill.count: 9 servers of tp_size 1 do not fit"),
    (P30B, "decode.gpus_per_server", 2, "decode.gpus_per_server: unknown key"),
    (P30B, "colour", "blue", "colour: unknown key"),
    (P30B, "vendor", "metal", "vendor: 'metal' is not one of"),
    (P30B, "transfer_backend", "nixl", "transfer_backend: 'nixl'"),
    (P30B, "router.node", "mi300x-9", "router.node: unknown node 'mi300x-9'"),
    (P30B, "router.port", 30000, "router.port: port 30000 on 10.0.0.10"),
    (P30B, "router.signature_port", 8000, "router.signature_port: port 8000 on 10.0.0.10 (router) collides with router"),
    (P30B, "router.signature_port", "fast", "router.signature_port"),
]


def test_signature_port_null_publishes_over_http(tmp_path):
    from eldr_sglang.deploy.commands import build_launches
    from eldr_sglang.deploy.spec import parse_cluster

    ls = build_launches(parse_cluster(_set(preset_doc(P30B), "router.signature_port", None)))
    prefill = [l for l in ls if l.name.startswith("prefill-")]
    assert all(flag(list(l.argv), "--eldr-publish") == "http://10.0.0.10:8000/eldr/signature" for l in prefill)
    assert "--signature-port" not in ls[-1].argv


@pytest.mark.parametrize("preset,path,value,message", BAD, ids=[f"{b[1]}={b[2]}" if b[2] is not _DELETE else f"{b[1]}=deleted" for b in BAD])
def test_bad_description_refused_naming_the_field(tmp_path, preset, path, value, message):
    desc = write(tmp_path, _set(preset_doc(preset), path, value))
    done = run_cli("check", str(desc), "--skip-files")
    assert done.returncode == 2, done.stdout
    assert message in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr


def test_unreadable_description_refused(tmp_path):
    (tmp_path / "broken.yaml").write_text("nodes: [\n")
    done = run_cli("dry-run", str(tmp_path / "broken.yaml"))
    assert done.returncode == 2 and "not valid YAML" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def files_235b(tmp_path_factory):
    """A calibration artifact (K = 6) and placement files for the 235B preset's decode servers
    (synthetic traces with the real model's 128 experts, few layers to stay fast)."""
    from eldr_sglang import calibrate
    from eldr_sglang.core.synthetic import make_synthetic_traces
    from eldr_sglang.core.traces import write_traces
    from eldr_sglang.placement.__main__ import main as placement_main

    work = tmp_path_factory.mktemp("deploy-files")
    syn = make_synthetic_traces(n_requests=300, num_layers=3, num_experts=128, top_k=8, include_gates=False, seed=2)
    write_traces(syn.traces, work / "traces")
    calibrate.main(["--traces", str(work / "traces"), "--clusters", "6", "--out", str(work / "artifact.json"),
                    "--layers", "0,1,2", "--n-init", "1"])
    assert placement_main(["optimize", "--artifact", str(work / "artifact.json"), "--traces", str(work / "traces"),
                           "--ep-size", "4", "--out", str(work / "placements")]) == 0
    model = work / "model"  # the 3-layer stand-in the artifact was calibrated for
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "num_experts": 128,
                                                   "num_experts_per_tok": 8}))
    doc = preset_doc(P235B)
    doc["model_path"] = str(model)
    doc["calibration"] = str(work / "artifact.json")
    doc["decode"]["placement_dir"] = str(work / "placements")
    return work, doc


def test_check_with_files(tmp_path, files_235b):
    work, doc = files_235b
    # docs/DEPLOY.md: python -m eldr_sglang.deploy check CLUSTER.yaml
    done = run_cli("check", str(write(tmp_path, doc)))
    assert done.returncode == 0, done.stderr
    assert "ok qwen3-235b-a22b-tp4ep4-mi300x: 4 prefill + 6 decode servers" in done.stdout

    doc5 = _set(copy.deepcopy(doc), "decode.count", 5)
    doc5["decode"]["nodes"] = ["mi300x-2", "mi300x-3", "mi300x-4"]
    bad = run_cli("check", str(write(tmp_path, doc5, "five.yaml")))
    assert bad.returncode == 2 and "calibration: the artifact has 6 centroids for 5 decode servers" in bad.stderr

    redundant = _set(copy.deepcopy(doc), "decode.num_redundant_experts", 4)
    bad = run_cli("check", str(write(tmp_path, redundant, "redundant.yaml")))
    assert bad.returncode == 2 and "decode.num_redundant_experts: 4, but" in bad.stderr

    (work / "placements" / "server-05.json").rename(work / "server-05.moved")
    try:
        bad = run_cli("check", str(write(tmp_path, doc, "missing.yaml")))
        assert bad.returncode == 2 and "server-05.json missing" in bad.stderr
    finally:
        (work / "server-05.moved").rename(work / "placements" / "server-05.json")


def sglang_server_args(argv: list[str]):
    """The generated flags through SGLang 0.5.23's own argument parser (``--eldr-*`` taken out
    first, as the plugin does at start-up)."""
    from sglang.srt.server_args import ServerArgs

    _, theirs = split_argv(argv)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(theirs))


def test_generated_flags_parse_with_sglang_and_late_binding_check():
    """TP1 servers pass SGLang's late-binding validation; TP4 with --attn-dp-size 4 is refused
    by stock SGLang 0.5.23 (why the 235B preset needs attention_dp_late_binding: true)."""
    from sglang.srt.arg_groups.parallel_hook import handle_deprecated_dp_attention
    from sglang.srt.arg_groups.pd_disaggregation_hook import _validate_prefill_complete

    small = {l.name: l for l in launches_of(P30B)}
    for name in ("prefill-0", "decode-0"):
        args = sglang_server_args(list(small[name].argv[3:]))
        assert args.disaggregation_decode_allocation_policy == "prefill_complete"
        _validate_prefill_complete(args)
    big = {l.name: l for l in launches_of(P235B)}
    args = sglang_server_args(list(big["decode-2"].argv[3:]))
    assert (args.tp_size, args.ep_size, args.attn_dp_size) == (4, 4, 4)
    assert args.init_expert_location.endswith("server-02.json")
    handle_deprecated_dp_attention(args)
    with pytest.raises(ValueError, match="attention tensor parallelism greater than one"):
        _validate_prefill_complete(args)


@pytest.mark.parametrize("policy", [None, "eldr_balanced", "balanced", "state_aware", "eldr"])
def test_router_gets_the_artifact_for_every_policy_that_reads_one(policy):
    """The default policy (eldr_balanced, also when the description omits the policy)
    routes by the artifact's centroids: without --calibration it runs signature-blind."""
    doc = load_description(preset=P30B)
    if policy is None:
        doc["router"].pop("policy")
    else:
        doc["router"]["policy"] = policy
    r = list(build_launches(parse_cluster(doc))[-1].argv)
    assert flag(r, "--calibration") == doc["calibration"]


@pytest.mark.parametrize("policy", ["round_robin", "jsq"])
def test_blind_policies_get_no_artifact(policy):
    doc = load_description(preset=P30B)
    doc["router"]["policy"] = policy
    assert "--calibration" not in build_launches(parse_cluster(doc))[-1].argv


def test_router_reads_the_decode_engines_reports():
    """Decode servers with --eldr-metrics-port: the router gets their endpoints, in decode
    order (live batches and step laws with the load poll)."""
    launches = launches_of(P30B)
    decode = [l for l in launches if l.name.startswith("decode-")]
    want = [f"http://{l.host}:{flag(list(l.argv), '--eldr-metrics-port')}/metrics" for l in decode]
    assert flag(list(launches[-1].argv), "--engine-metrics").split(",") == want
