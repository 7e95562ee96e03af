"""The signature transport seam (:mod:`eldr_sglang.transports`): every registered
transport's sender delivers a signed message to its listener (a router's intake, which
refuses one signed with another key), an unknown scheme is a ValueError naming it, and a
transport registered by a test alone (in memory) is used by the engine's flags and
publisher, the stub worker and the router's intake with no edit anywhere else."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import pkgutil
import re
import subprocess
import sys
import urllib.parse

import aiohttp
import pytest

from eldr_sglang import transports
from eldr_sglang.core import wire
from eldr_sglang.core.counts_codec import pack_counts
from eldr_sglang.patches.flags import FlagError, parse_eldr_flags
from eldr_sglang.patches.publish import SignaturePublisher
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.signals.intake import SignatureIntake
from eldr_sglang.router.signals.signatures import SignatureBoard
from eldr_sglang.testing.stub_worker import StubWorker
from tests.helpers import until

KEY = b"transport-contract-key"


def _registered() -> list[str]:
    """Every transport: the built-ins and every module of the package (each registers itself)."""
    for m in pkgutil.iter_modules(transports.__path__):
        importlib.import_module(f"{transports.__name__}.{m.name}")
    return list(transports.schemes())


def message(room: int) -> dict:
    return wire.build_message(room, f"r{room}", 3, 0, [0, 1], [[room % 7, 1, 0], [0, 2, 1]], packed=True)


def make_intake() -> SignatureIntake:
    return SignatureIntake(SignatureBoard(), RouterMetrics(), 1 << 20, encoder=lambda: None,
                           buffering=lambda: True, key=KEY)


@pytest.mark.parametrize("scheme", _registered())
async def test_every_transport_delivers_a_signed_message_to_its_listener(scheme):
    if scheme == "https":
        assert transports.transport_for("https").sender_factory is transports.transport_for("http").sender_factory
        pytest.skip("https is the http transport over TLS (no certificate here)")
    intake = make_intake()
    try:
        await intake.start("127.0.0.1", 0, scheme=scheme)
        url = intake.address("127.0.0.1")
        assert transports.scheme_of(url) == scheme
        sender = transports.sender_for(url, 2.0, KEY)
        await asyncio.to_thread(transports.deliver, sender, [message(11), message(12)])
        await until(lambda: {11, 12} <= set(intake.board.buffer), 10, f"{scheme}: both messages delivered")
        await asyncio.to_thread(transports.deliver, sender, [message(13)])  # the kept-open connection
        await until(lambda: 13 in intake.board.buffer, 10, f"{scheme}: a second send")
        assert sender.connects == 1
        # signed with another key: refused by the intake, never on the board
        forged = transports.sender_for(url, 2.0, b"not-the-key")
        try:
            await asyncio.to_thread(transports.deliver, forged, [message(14)])
        except Exception:
            pass  # a transport with answers says so (HTTP 403)
        await until(lambda: intake.health.refused["bad_mac"] == 1, 10, f"{scheme}: the forged message refused")
        assert 14 not in intake.board.buffer
        sender.close()
        forged.close()
    finally:
        await intake.close()


@pytest.mark.parametrize("url", ["zmq://router:5555", "unix:///tmp/eldr.sock", "router:8001"])
def test_an_unknown_scheme_is_a_value_error_naming_it(url):
    scheme = url.split("://")[0] if "://" in url else None
    for call in (transports.scheme_of, transports.parse, transports.sender_for):
        with pytest.raises(ValueError, match=re.escape(repr(url))) as e:
            call(url)
        assert scheme is None or repr(scheme) in str(e.value)
    with pytest.raises(ValueError, match="publish URL"):
        SignaturePublisher(url)
    with pytest.raises(FlagError, match="--eldr-publish"):
        parse_eldr_flags(["--eldr-layers", "1", "--eldr-publish", url])
    if scheme:
        with pytest.raises(ValueError, match=repr(scheme)):
            transports.listener_for(scheme, None)


def test_a_known_scheme_with_a_bad_address_names_it():
    with pytest.raises(ValueError, match="'tcp://router'.*tcp://host:port"):
        transports.parse("tcp://router")
    with pytest.raises(ValueError, match="'http:///eldr/signature'"):
        transports.sender_for("http:///eldr/signature")


def test_the_registry_imports_no_web_or_engine_stack():
    code = ("from eldr_sglang import transports\n"
            "transports.sender_for('tcp://127.0.0.1:9'); transports.sender_for('http://h/eldr/signature')\n"
            "import sys; print(' '.join(sys.modules))")
    mods = {m.split(".")[0] for m in subprocess.run([sys.executable, "-c", code], capture_output=True,
                                                    text=True, check=True).stdout.split()}
    assert not mods & {"aiohttp", "sglang", "torch"}


# ------------------------------------------------------------------ a third transport, in memory
_BOXES: dict[str, object] = {}  # listener name -> its deliver(bytes), callable from any thread
_ids = itertools.count(1)


class MemorySender:
    def __init__(self, dest: transports.Destination, timeout: float, key: bytes | None) -> None:
        self.dest, self.key = dest, key
        self.connects = 0
        self.open = False

    def send(self, batch: list[dict]) -> None:
        box = _BOXES.get(self.dest.host)
        if box is None:
            raise ConnectionRefusedError(f"no listener at {self.dest.url}")
        if not self.open:
            self.open = True
            self.connects += 1
        box(wire.stream_lines(batch, self.key))

    def close(self) -> None:
        self.open = False


class MemoryListener:
    """Lines into ``intake.line`` on the listener's loop."""

    def __init__(self, intake) -> None:
        self.intake, self.port, self.name = intake, None, ""

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.port = port or next(_ids)
        self.name = f"box{self.port}"
        _BOXES[self.name] = lambda data: loop.call_soon_threadsafe(self._feed, data)
        return self.port

    def _feed(self, data: bytes) -> None:
        for line in data.splitlines():
            t = asyncio.ensure_future(self.intake.line(line))
            self.intake.tasks.add(t)
            t.add_done_callback(self.intake.tasks.discard)

    def address(self, host: str) -> str:
        return f"mem://{self.name}"

    def close(self) -> None:
        _BOXES.pop(self.name, None)

    async def wait_closed(self) -> None:
        pass


def _parse_mem(url: str, parts: urllib.parse.SplitResult) -> transports.Destination:
    if not parts.hostname:
        raise ValueError("no mailbox name")
    return transports.Destination(url, "mem", parts.hostname, 0)


@pytest.fixture
def mem_transport():
    transports.register_transport("mem", MemorySender, MemoryListener, parse=_parse_mem,
                                  example="mem://mailbox")
    yield
    transports.unregister_transport("mem")


async def test_a_registered_transport_is_used_by_flags_publisher_stub_and_router(mem_transport):
    intake = make_intake()
    try:
        await intake.start("127.0.0.1", 0, scheme="mem")  # the router side
        url = intake.address("127.0.0.1")
        assert url.startswith("mem://")
        config = parse_eldr_flags(["--eldr-layers", "0,1", "--eldr-publish", url])  # the engine's flags
        assert config.publish == url

        pub = SignaturePublisher(config.publish, key=KEY)  # default address and a request's own
        pub.submit(message(21))
        pub.submit(message(22), dest=url + "/")
        await until(lambda: {21, 22} <= set(intake.board.buffer), 10, "the publisher's messages")
        assert (pub.sent, pub.dropped, pub.errors, pub.connections) == (2, 0, 0, 2)
        assert pub.destinations == [url + "/"]

        stub = StubWorker("prefill", signature_url=url, signature_key=KEY)  # the harness
        await stub.start()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{stub.url}/generate",
                                     json={"text": "topic:1 hello", "bootstrap_room": 23, "rid": "r23"}) as r:
                    assert r.status == 200
            await until(lambda: 23 in intake.board.buffer, 10, "the stub worker's message")
        finally:
            await stub.stop()
        assert intake.health.refused == {}
    finally:
        await intake.close()
    transports.unregister_transport("mem")
    with pytest.raises(ValueError, match="unknown scheme 'mem'"):
        transports.scheme_of(url)


def test_a_transport_module_named_after_its_scheme_is_found(tmp_path, monkeypatch):
    """A new transport is one file: ``eldr_sglang/transports/<scheme>.py`` registering itself."""
    (tmp_path / "zz9.py").write_text(
        "from eldr_sglang.transports import register_transport\n"
        "class S:\n"
        "    connects = 0\n"
        "    def __init__(self, dest, timeout, key): self.dest = dest\n"
        "    def send(self, batch): pass\n"
        "    def close(self): pass\n"
        "register_transport('zz9', S, None)\n")
    monkeypatch.setattr(transports, "__path__", [*transports.__path__, str(tmp_path)])
    try:
        assert transports.sender_for("zz9://h:1").dest.port == 1
        assert "zz9" in transports.schemes()
        with pytest.raises(ValueError, match="'zz9' has no listener"):
            transports.listener_for("zz9", None)
    finally:
        transports.unregister_transport("zz9")
        sys.modules.pop(f"{transports.__name__}.zz9", None)
