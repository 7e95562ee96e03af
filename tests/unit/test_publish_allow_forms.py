"""``--eldr-publish-allow`` against the forms a host can take:
trailing dots are connected to as checked, addresses only in their canonical form,
and a kept connection is checked again when its name re-resolves elsewhere."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from eldr_sglang.core import wire
from eldr_sglang.patches.publish import SignaturePublisher
from eldr_sglang.patches.publish_allow import DestinationAllowList, parse_entries


@pytest.mark.parametrize("host", ["2130706433", "127.1", "0x7f.0.0.1", "0177.0.0.1", "0x7f000001",
                                  "127.0.1", "2130706433.", "127.1."])
def test_addresses_in_other_forms_are_refused(host):
    local = DestinationAllowList.local()
    assert not local.allows(host)
    assert not DestinationAllowList(parse_entries("127.0.0.0/8,localhost")).allows(host)
    with pytest.raises(ValueError, match="usual form"):
        parse_entries(host)


def test_trailing_dots_are_normalised_to_what_was_checked():
    allow = DestinationAllowList(parse_entries("127.0.0.0/8,localhost"))
    assert allow.canonical("127.0.0.1.") == "127.0.0.1"
    assert allow.canonical("LOCALHOST.") == "localhost"
    assert allow.canonical("localhost..") == "localhost"
    assert allow.canonical("evil.example.") is None


class Sink:
    """A TCP listener that counts the lines it gets."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.lines = 0
        self.conns = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn) -> None:
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                self.lines += data.count(b"\n")


def wait(pred, what, timeout=30.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_kept_destination_is_checked_again_when_its_name_re_resolves():
    sink = Sink()
    addresses = {"router": {"127.0.0.1"}}
    now = [0.0]
    allow = DestinationAllowList(parse_entries("router"), resolve=lambda n: addresses.get(n, set()),
                                 ttl=30, clock=lambda: now[0])
    pub = SignaturePublisher(None, allow=allow)
    dest = f"tcp://127.0.0.1:{sink.port}"
    msg = wire.build_message(1, "r", 1, 0, [0], [[1, 2]])
    pub.submit(msg, dest)
    wait(lambda: sink.lines == 1, "the first message")
    addresses["router"] = {"10.1.2.3"}  # the name moved
    now[0] = 31.0
    pub.submit(msg, dest)
    wait(lambda: pub.refused_destinations == 1, "the kept destination refused")
    assert sink.lines == 1 and pub.destinations == []


def test_a_trailing_dot_destination_is_connected_to_as_checked():
    sink = Sink()
    pub = SignaturePublisher(None, allow=DestinationAllowList(parse_entries("127.0.0.0/8")))
    pub.submit(wire.build_message(1, "r", 1, 0, [0], [[1, 2]]), f"tcp://127.0.0.1.:{sink.port}")
    wait(lambda: sink.lines == 1, "the message")
    assert pub._endpoints[f"tcp://127.0.0.1.:{sink.port}"].host == "127.0.0.1"
