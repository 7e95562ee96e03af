"""Bad input to the console scripts: one line naming the flag or field, exit status 2,
no traceback. Each case runs the script's ``main(argv)``; one runs as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import yaml

from eldr_sglang import ab, calibrate, collect_traces
from eldr_sglang.deploy import load_description
from eldr_sglang.deploy.__main__ import main as deploy_main
from eldr_sglang.router import cli as router_cli

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "eldr-tiny-moe"
WORKERS = ["--prefill", "http://127.0.0.1:30000", "8998", "--decode", "http://127.0.0.1:30001",
           "--policy", "round_robin"]


def refused(main: Callable, argv: list[str], capsys) -> str:
    """stderr of ``main(argv)``, which must end with status 2 (SystemExit or return value)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2, rc
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("name,text,wanted", [
    ("bad.json", '{"online": true,\n "port": }', ["--config", "not valid JSON", "line 2"]),
    ("bad.yaml", "online: [1,\n", ["--config", "not valid YAML", "line 2"]),
    ("maybe.yaml", 'online: "maybe"\n', ["--config", "online:", "'maybe'"]),
    ("port.yaml", "port: many\n", ["--config", "port:", "'many'"]),
    ("key.yaml", "signature_timeuot: 3\n", ["--config", "signature_timeuot: unknown config key"]),
])
def test_router_config_file_errors(tmp_path, capsys, name, text, wanted):
    err = refused(router_cli.main, ["--config", write(tmp_path / name, text), *WORKERS], capsys)
    assert all(w in err for w in wanted), err


def test_router_config_booleans_parse_strictly(tmp_path):
    for text, value in (('online: "no"', False), ("online: off", False), ("online: 0", False),
                        ('log_decisions: "yes"', True)):
        key = text.split(":")[0]
        args = router_cli.parse_args(["--config", write(tmp_path / "c.yaml", text + "\n"), *WORKERS])
        assert getattr(args.router_config, key) is value, text
        assert getattr(args, key) is value, text


@pytest.mark.parametrize("extra,wanted", [
    (["--log-level", "chatty"], ["--log-level", "chatty"]),
    (["--ab-policies", "eldr,nope"], ["--ab-policies", "'nope'"]),
    (["--policy", "domain", "--domain-map", "{bad"], ["--domain-map", "not JSON"]),
    (["--shadow-policy", "nope"], ["--shadow-policy", "'nope'"]),
])
def test_router_flag_errors(capsys, extra, wanted):
    err = refused(router_cli.main, [*WORKERS, *extra], capsys)
    assert all(w in err for w in wanted), err


@pytest.mark.parametrize("argv,wanted", [
    (["--prefill", "http://127.0.0.1:30000", "abc", "--decode", "http://127.0.0.1:30001"],
     ["--prefill", "bootstrap port 'abc'"]),
    (["--prefill", "http://127.0.0.1:30000", "8998", "--decode", "ftp://d0"], ["--decode", "scheme"]),
    (["--prefill", "p0:30000", "--decode", "http://127.0.0.1:30001"], ["--prefill", "'p0:30000'"]),
])
def test_router_worker_errors(capsys, argv, wanted):
    err = refused(router_cli.main, [*argv, "--policy", "round_robin"], capsys)
    assert all(w in err for w in wanted), err


def test_router_error_from_a_real_process(tmp_path):
    done = subprocess.run([sys.executable, "-m", "eldr_sglang.router", "--config",
                           write(tmp_path / "bad.yaml", "online: [1,\n"), *WORKERS],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("eldr-router: error: --config ") and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("line,wanted", [
    ('{"arm": "eldr", "start": 1, "requests": "many"}', "r.jsonl:2: requests:"),
    ('{"arm": "eldr", "start": "noon"}', "r.jsonl:2: start:"),
    ('{"arm": "eldr"}', "r.jsonl:2: start: field required"),
    ('{"arm": 3, "start": 1}', "r.jsonl:2: arm:"),
    ('{"arm": "eldr", "start": 1, "unique_per_step": [1]}', "r.jsonl:2: unique_per_step:"),
    ("[1, 2]", "r.jsonl:2: not a slice record"),
])
def test_ab_record_errors(tmp_path, capsys, line, wanted):
    good = '{"arm": "jsq", "start": 0, "requests": 3}\n'
    err = refused(ab.main, [write(tmp_path / "r.jsonl", good + line + "\n")], capsys)
    assert wanted in err, err


def test_collect_traces_errors(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    base = ["--model", str(MODEL), "--out", str(tmp_path / "out")]
    err = refused(collect_traces.main, ["--logs", str(logs), *base, "--labels", str(tmp_path / "missing.jsonl")], capsys)
    assert "--labels: cannot read" in err and "missing.jsonl" in err
    err = refused(collect_traces.main, ["--logs", str(tmp_path / "nope"), *base], capsys)
    assert "--logs:" in err and "is not a directory" in err
    err = refused(collect_traces.main, ["--logs", str(logs), *base], capsys)
    assert "--logs: found 0 prefill and 0 decode records" in err
    write(logs / "prefill-0.jsonl", '{"rid": "a", "layers": [0, 1, 2, 3], "counts": [], "prompt_tokens": 1}\n')
    write(logs / "decode-0.jsonl", '{"no_rid": 1}\n')
    err = refused(collect_traces.main, ["--logs", str(logs), *base], capsys)
    assert "--logs:" in err and "decode-0.jsonl:1: rid: required" in err
    write(logs / "decode-0.jsonl", '{"rid": "a"}\n')
    err = refused(collect_traces.main, ["--logs", str(logs), *base], capsys)
    assert "--logs: request a: decode decode_counts, decode output_tokens: required" in err
    assert not (tmp_path / "out").exists()


def test_collect_traces_counts_records_without_a_label(tmp_path, capsys):
    """--labels joins on rid: records it has no line for (a warm-up request, bench_serving's
    random rids) are counted aloud, not silently left unlabelled."""
    logs = tmp_path / "logs"
    logs.mkdir()
    counts = json.dumps([[1] * 128] * 4)  # the shipped model: 4 layers x 128 experts
    pre = ''.join(f'{{"rid": "{r}", "layers": [0, 1, 2, 3], "counts": {counts}, "prompt_tokens": 4}}\n'
                  for r in ("a", "b", "warmup"))
    dec = ''.join(f'{{"rid": "{r}", "decode_counts": {counts}, "output_tokens": 2}}\n' for r in ("a", "b", "warmup"))
    write(logs / "prefill-0.jsonl", pre)
    write(logs / "decode-0.jsonl", dec)
    labels = write(tmp_path / "labels.jsonl", '{"rid": "a", "task": "x"}\n{"rid": "b", "task": "y"}\n')
    assert collect_traces.main(["--logs", str(logs), "--model", str(MODEL), "--out", str(tmp_path / "out"),
                                "--labels", labels]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 of 3 records have no line in" in err, err


def test_calibrate_out_in_a_missing_directory(tmp_path, capsys):
    out = tmp_path / "nonexistent" / "dir" / "x.json"
    try:
        rc = calibrate.main(["--traces", str(tmp_path), "--clusters", "2", "--out", str(out)])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "--out" in err and "does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "nonexistent").exists()


@pytest.mark.parametrize("command", ["check", "dry-run"])
def test_deploy_unknown_router_policy(tmp_path, capsys, command):
    doc = load_description(preset="qwen3-30b-a3b-8p16d-mi300x")
    doc["router"]["policy"] = "nope"
    err = refused(deploy_main, [command, write(tmp_path / "c.yaml", yaml.safe_dump(doc))], capsys)
    assert err.startswith("error: router.policy: unknown policy 'nope'"), err


@pytest.mark.parametrize("extra,named", [
    (["--online"], "--online"),
    (["--shadow-policy", "jsq"], "--shadow-policy"),
    (["--signature-port", "0"], "--signature-port"),
])
def test_colocated_mode_refuses_the_pd_flows_signature_settings(capsys, extra, named):
    """They read measured signature messages, which co-located servers never send: refused
    by name, not silently ignored."""
    err = refused(router_cli.main, ["--mode", "colocated", "--worker", "http://127.0.0.1:30001",
                                    "--policy", "round_robin", *extra], capsys)
    assert named in err and "PD flow" in err, err
