"""Where a prefill server may publish (``--eldr-publish-allow``), the signing key's
flags on the engine, the router and the stub worker, and their one-line errors."""

from __future__ import annotations

import socket

import pytest

from eldr_sglang.core import wire
from eldr_sglang.patches.flags import EngineConfig, FlagError, parse_eldr_flags
from eldr_sglang.patches.publish import publisher_for
from eldr_sglang.patches.publish_allow import DestinationAllowList, parse_entries
from eldr_sglang.router import cli as router_cli
from eldr_sglang.testing import stub_worker

WORKERS = ["--prefill", "http://127.0.0.1:30000", "8998", "--decode", "http://127.0.0.1:30001",
           "--policy", "round_robin"]


def test_cidrs_and_addresses_allow_addresses_inside_them():
    allow = DestinationAllowList(parse_entries("10.0.0.0/8, 192.168.1.7,fd00::/8"))
    assert allow.allows("10.3.2.1") and allow.allows("192.168.1.7") and allow.allows("fd00::1")
    assert not allow.allows("11.0.0.1") and not allow.allows("192.168.1.8") and not allow.allows("::1")


def test_host_names_allow_the_name_and_its_addresses_but_unlisted_names_are_never_resolved():
    asked = []

    def resolve(name):
        asked.append(name)
        return {"10.9.0.4", "10.9.0.5"} if name == "eldr-router" else set()

    now = [0.0]
    allow = DestinationAllowList(parse_entries("Eldr-Router."), resolve=resolve, ttl=30, clock=lambda: now[0])
    assert allow.allows("eldr-router") and allow.allows("ELDR-ROUTER.")
    assert allow.allows("10.9.0.5") and not allow.allows("10.9.0.6")
    assert not allow.allows("evil.example.com") and asked == ["eldr-router"]  # resolved once, evil never
    allow.allows("10.9.0.4")
    now[0] = 31.0
    allow.allows("10.9.0.4")
    assert asked == ["eldr-router", "eldr-router"]  # again after the ttl


@pytest.mark.parametrize("value", ["", "10.0.0.0/33", "http://router:8001", "a b", "router:8001", ","])
def test_bad_allow_entries_are_named(value):
    with pytest.raises(ValueError):
        parse_entries(value)


def test_publish_allow_flag():
    config = parse_eldr_flags(["--eldr-publish", "request", "--eldr-publish-allow", "10.0.0.0/8,eldr-router"])
    assert config.publish_allow == ("10.0.0.0/8", "eldr-router")
    assert EngineConfig.from_env({"ELDR_ENGINE_CONFIG": config.to_env()}) == config  # through the children's env
    with pytest.raises(FlagError, match="--eldr-publish-allow: 'not a host'"):
        parse_eldr_flags(["--eldr-publish", "request", "--eldr-publish-allow", "10.0.0.0/8,not a host"])
    with pytest.raises(FlagError, match="--eldr-publish-allow: only with --eldr-publish"):
        parse_eldr_flags(["--eldr-layers", "0", "--eldr-publish-allow", "10.0.0.0/8"])


def test_default_allow_lists(monkeypatch):
    monkeypatch.delenv(wire.KEY_ENV, raising=False)
    local = publisher_for(parse_eldr_flags(["--eldr-publish", "request"])).allow
    assert local.allows("127.0.0.1") and local.allows("localhost") and local.allows(socket.gethostname())
    assert not local.allows("10.1.2.3") and not local.allows("router.example.com")
    url = publisher_for(parse_eldr_flags(["--eldr-publish", "tcp://router-a:8001"])).allow
    assert url.allows("10.1.2.3") and url.allows("anything.example.com")  # as before: warned at start
    listed = publisher_for(parse_eldr_flags(["--eldr-publish", "tcp://router-a:8001",
                                             "--eldr-publish-allow", "10.0.0.0/8"])).allow
    assert listed.allows("router-a") and listed.allows("10.1.2.3") and not listed.allows("router-b")
    assert not listed.allows("127.0.0.1")  # an explicit list is the whole list


def test_engine_key_file_flag(tmp_path, monkeypatch):
    monkeypatch.delenv(wire.KEY_ENV, raising=False)
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    config = parse_eldr_flags(["--eldr-publish", "request", "--eldr-signature-key-file", str(key)])
    assert publisher_for(config).key == b"s3cret"
    assert publisher_for(parse_eldr_flags(["--eldr-publish", "request"])).key is None
    monkeypatch.setenv(wire.KEY_ENV, "from-env")
    assert publisher_for(parse_eldr_flags(["--eldr-publish", "request"])).key == b"from-env"
    (tmp_path / "empty").write_text("\n")
    for path, wanted in ((tmp_path / "missing", "cannot read"), (tmp_path / "empty", "is empty")):
        with pytest.raises(FlagError, match=f"--eldr-signature-key-file: .*{wanted}"):
            parse_eldr_flags(["--eldr-publish", "request", "--eldr-signature-key-file", str(path)])
    monkeypatch.setenv(wire.KEY_ENV, " ")
    with pytest.raises(FlagError, match="ELDR_SIGNATURE_KEY is set but empty"):
        parse_eldr_flags(["--eldr-publish", "request"])


def _refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("content", [None, ""])
def test_router_and_stub_key_file_errors_are_one_line_naming_the_flag(tmp_path, capsys, monkeypatch, content):
    monkeypatch.delenv(wire.KEY_ENV, raising=False)
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    err = _refused(router_cli.main, [*WORKERS, "--signature-key-file", str(path)], capsys)
    assert "--signature-key-file" in err and str(path) in err, err
    err = _refused(stub_worker.main, ["--role", "prefill", "--signature-key-file", str(path)], capsys)
    assert "--signature-key-file" in err, err


def test_router_key_from_file_or_env(tmp_path, monkeypatch):
    monkeypatch.delenv(wire.KEY_ENV, raising=False)
    path = tmp_path / "key"
    path.write_bytes(b"  router-key \n")
    args = router_cli.parse_args([*WORKERS, "--signature-key-file", str(path)])
    assert args.router_config.signature_key() == b"router-key"
    assert router_cli.parse_args(WORKERS).router_config.signature_key() is None
    monkeypatch.setenv(wire.KEY_ENV, "env-key")
    assert router_cli.parse_args(WORKERS).router_config.signature_key() == b"env-key"
