"""Signature intake under attack and misconfiguration (issue 47): no stranger, skewed
clock or process layout can switch ELDR off. Stub workers, loopback only.

1. slots: connections that never prove themselves (a valid MAC) cannot lock an engine out;
2. partial lines: a flood of half-lines evicts its own senders, never an engine's line;
3. a refused but authenticated message (stale or future ``ts``, no ``ts``) wakes the
   request waiting for its room at once, and the router says why (status, /ready, log);
4. ``--workers N`` with the HTTP intake is refused at start (a message could land in
   the process that does not wait for it);
5. replay memory follows the rate and the wall clock ``ts`` is checked against.
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from eldr_sglang.core import wire
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.signals import intake as intake_mod
from eldr_sglang.router.signals.intake import SignatureIntake
from eldr_sglang.router.signals.signatures import SignatureBoard, SignatureError
from eldr_sglang.testing.stub_worker import topic_counts
from tests.integration.helpers import cluster, post, until

pytestmark = pytest.mark.timeout(90)

KEY = b"k3y-for-attack-tests-0123456789"
WITHIN = 10.0  # generous bound on one request that must not wait out its signature timeout
TIMEOUT = 30.0  # --signature-timeout in these tests: waiting it out fails the bound above


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "signature.key"
    path.write_bytes(KEY)
    return str(path)


def tcp_engine(key_file: str, **kw) -> dict:
    """Cluster settings: the prefill stub signs and publishes to the router's TCP port."""
    return {"signature_port": 0, "push_url": False, "prefill_kw": {"signature_key": KEY},
            "signature_key_file": key_file, "signature_timeout": TIMEOUT,
            "signature_timeout_min": TIMEOUT, **kw}


async def routed_by_signature(http, url: str, topic: int) -> bytes:
    """One request that must come back within WITHIN seconds, routed to ``d<topic>``."""
    st, raw = await asyncio.wait_for(post(http, f"{url}/generate", {"text": f"topic:{topic} x"}), WITHIN)
    assert st == 200 and orjson.loads(raw)["meta_info"]["server"] == f"d{topic}", raw
    return raw


# ------------------------------------------------------------------ 1. slots
async def test_unproven_connections_holding_every_slot_cannot_lock_out_an_engine(key_file):
    async with cluster(**tcp_engine(key_file, signature_max_streams=16)) as (
            router, url, prefill, decodes, http):
        conns = []
        for _ in range(24):  # more than the cap, each keeping itself busy with a newline
            r, w = await asyncio.open_connection("127.0.0.1", router.intake.port)
            w.write(b"\n")
            conns.append((r, w))
        await until(lambda: len(router.intake.streams) == 16, what="every slot taken")
        for topic in (1, 2):  # the engine connects now (as after its restart) and must get in
            await routed_by_signature(http, url, topic)
        assert router.metrics.value("fallbacks") == 0
        for _, w in conns:
            w.close()


async def test_one_host_holds_few_unproven_connections(key_file, monkeypatch):
    monkeypatch.setattr("eldr_sglang.router.signals.stream.UNPROVEN_PER_HOST", 4)
    async with cluster(**tcp_engine(key_file)) as (router, url, prefill, decodes, http):
        port = router.intake.port
        a = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0)) for _ in range(6)]
        b = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0)) for _ in range(3)]
        assert [await asyncio.wait_for(r.read(), 20) for r, _ in a[:2]] == [b"", b""]  # its oldest two
        await until(lambda: router.intake.gate.by_host["127.0.0.2"] == 4, what="4 left of 127.0.0.2")
        assert router.intake.gate.by_host["127.0.0.3"] == 3
        await routed_by_signature(http, url, 1)
        for _, w in a + b:
            w.close()


async def test_a_connection_without_a_valid_mac_within_the_grace_is_closed(key_file):
    async with cluster(**tcp_engine(key_file)) as (router, url, prefill, decodes, http):
        router.intake.gate.grace = 0.5  # stream.AUTH_GRACE_S: 5 s
        r, w = await asyncio.open_connection("127.0.0.1", router.intake.port)
        for _ in range(3):
            w.write(b"\n")  # whitespace keeps a connection from being idle, not from proving itself
            await w.drain()
        assert await asyncio.wait_for(r.read(), 20) == b""
        await routed_by_signature(http, url, 3)  # the engine's own connection proves itself and stays
        assert len(router.intake.streams) == 1 and router.intake.describe()["streams"]["proven"] == 1
        w.close()


# ------------------------------------------------------------------ 2. partial lines
async def test_half_lines_with_a_mac_prefix_cannot_get_an_engine_line_closed(key_file, monkeypatch):
    budget = 2 << 20
    monkeypatch.setattr(intake_mod, "STREAM_BUFFER_BYTES", budget)
    async with cluster(**tcp_engine(key_file)) as (router, url, prefill, decodes, http):
        fake = b"sha256=" + b"ab" * 32 + b" "  # well-formed, wrong: it cannot be told before the line ends
        conns, left = [], budget - 60  # the engine's line tips the budget over
        for _ in range(3):
            n = min(left, 800_000)
            _, w = await asyncio.open_connection("127.0.0.1", router.intake.port)
            w.write(fake + b"x" * (n - len(fake)))
            await w.drain()
            conns.append(w)
            left -= n
        await until(lambda: router.intake.partial_bytes == budget - 60, what="the budget held")
        await routed_by_signature(http, url, 2)
        await routed_by_signature(http, url, 1)
        assert router.metrics.value("fallbacks") == 0
        for w in conns:
            w.close()


# ------------------------------------------------------------------ 3. refused messages wake their request
@pytest.mark.parametrize("skew,transport", [(61, "http"), (-61, "http"), (600, "http"), (61, "tcp")])
async def test_a_skewed_engine_costs_no_request_its_signature_wait(key_file, skew, transport):
    """``skew``: the engine's clock minus the router's."""
    kw = (tcp_engine(key_file) if transport == "tcp" else
          {"prefill_kw": {"signature_key": KEY}, "signature_key_file": key_file,
           "signature_timeout": TIMEOUT, "signature_timeout_min": TIMEOUT})
    async with cluster(**kw) as (router, url, prefill, decodes, http):
        router.intake.wall_clock = lambda: time.time() - skew
        for i in range(3):
            st, raw = await asyncio.wait_for(post(http, f"{url}/generate", {"text": f"topic:{i} x"}), WITHIN)
            assert st == 200, raw
        assert router.metrics.value("fallbacks", reason="stale") == 3
        assert router.metrics.value("errors", kind="signature_stale") == 3  # once per message
        async with http.get(f"{url}/eldr/status") as r:
            health = (await r.json())["signature_intake"]
        assert health["refused"]["stale"] == 3 and health["woken"]["stale"] == 3
        assert round(health["last_skew_s"]) == skew and health["degraded"]
        async with http.get(f"{url}/ready") as r:
            assert r.status == 200  # served (routed by load): not a reason to leave the balancer
            eldr = (await r.json())["eldr"]
        ahead = "ahead of" if skew > 0 else "behind"
        assert eldr["degraded"] and any(f"{abs(skew)} s {ahead}" in c for c in eldr["causes"]), eldr


async def test_an_unstamped_signed_message_wakes_its_request(key_file):
    """An engine older than the stamp (no ``ts``) behind a keyed router."""
    async with cluster(prefill_kw={"send_signature": False}, signature_key_file=key_file,
                       signature_timeout=TIMEOUT, signature_timeout_min=TIMEOUT) as (
            router, url, prefill, decodes, http):
        task = asyncio.ensure_future(post(http, f"{url}/generate", {"text": "topic:1 x"}))
        await until(lambda: prefill.requests and router.board.waiters, what="the request waiting")
        room = prefill.requests[-1]["bootstrap_room"]
        body = orjson.dumps(wire.build_message(room, "r", 4, 0, [0, 1], topic_counts("topic:1"), packed=True))
        st, _ = await post(http, f"{url}/eldr/signature", body, headers={wire.MAC_HEADER: wire.mac(KEY, body).decode()})
        assert st == 400
        st, raw = await asyncio.wait_for(task, WITHIN)
        assert st == 200 and router.metrics.value("fallbacks", reason="unstamped") == 1


async def test_a_forged_stale_message_does_not_wake_a_request(key_file):
    """A message whose MAC fails cannot be trusted to name a room: its request keeps waiting."""
    async with cluster(prefill_kw={"send_signature": False}, signature_key_file=key_file,
                       signature_timeout=1.0, signature_timeout_min=1.0) as (router, url, prefill, decodes, http):
        task = asyncio.ensure_future(post(http, f"{url}/generate", {"text": "topic:1 x"}))
        await until(lambda: prefill.requests and router.board.waiters, what="the request waiting")
        room = prefill.requests[-1]["bootstrap_room"]
        msg = {**wire.build_message(room, "r", 4, 0, [0, 1], topic_counts("topic:1"), packed=True),
               "ts": time.time() - 600}
        body, headers = wire.http_body(msg, b"not-the-key")
        st, _ = await post(http, f"{url}/eldr/signature", body, headers=headers)
        assert st == 403
        st, _ = await task
        assert st == 200 and router.metrics.value("fallbacks", reason="timeout") == 1
        assert router.metrics.value("fallbacks", reason="stale") == 0


# ------------------------------------------------------------------ 4. --workers N
def test_workers_with_the_http_intake_are_refused_at_start():
    with pytest.raises(ValueError, match="signature_port"):
        RouterConfig(workers=2, port=8000)
    RouterConfig(workers=2, port=8000, signature_port=0)  # each process its own TCP port
    RouterConfig(workers=1, port=8000)


def test_the_cli_says_what_to_use_instead(capsys):
    from eldr_sglang.router.cli import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                    "--policy", "round_robin", "--port", "8000", "--workers", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--signature-port" in err and "--workers" in err


# ------------------------------------------------------------------ 5. replay memory
def bare_intake(max_age: float = 60.0, wall=time.time) -> SignatureIntake:
    return SignatureIntake(SignatureBoard(), RouterMetrics(), 1 << 20, encoder=lambda: None,
                           buffering=lambda: False, max_age=max_age, wall_clock=wall)


def test_replays_are_refused_above_a_thousand_signatures_a_second():
    """131,072 fresh rooms in a few seconds: each must still be remembered."""
    it = bare_intake()
    now = time.time()
    for room in range(140_000):
        it.fresh({"bootstrap_room": room, "ts": now})
    with pytest.raises(SignatureError, match="replay"):
        it.fresh({"bootstrap_room": 0, "ts": now})


def test_a_backwards_wall_clock_step_does_not_reopen_replays():
    wall = [1_000_000.0]
    it = bare_intake(max_age=0.05, wall=lambda: wall[0])
    it.fresh({"bootstrap_room": 7, "ts": wall[0]})
    t0 = time.monotonic()
    while time.monotonic() < t0 + 0.15:  # the monotonic clock passes 2 x max age ...
        time.sleep(0.01)
    wall[0] += 0.02  # ... while the wall clock stepped back: the message is still fresh
    with pytest.raises(SignatureError, match="replay"):
        it.fresh({"bootstrap_room": 7, "ts": 1_000_000.0})
