"""Round three of the hostile matrix: every byte from the network bounded,
every signature fresh, nothing leaks (stub workers)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from eldr_sglang.core import wire
from eldr_sglang.testing.stub_worker import topic_counts
from tests.integration.helpers import cluster, post, until

pytestmark = pytest.mark.timeout(90)


async def raw_request(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One raw HTTP/1.1 request (bytes as given, non-ASCII included): (status, whole answer)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(head + body)
        await w.drain()
        data = await asyncio.wait_for(r.read(), 30)
    finally:
        w.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, data


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# ------------------------------------------------------------------ 7. non-ASCII Authorization
async def test_non_ascii_authorization_is_refused_never_a_500():
    async with cluster(n_decode=2, api_key="ck", admin_token="at") as (router, url, prefill, decodes, http):
        body = b'{"text": "topic:0"}'
        for path in (b"/generate", b"/v1/completions"):
            st, raw = await raw_request(port_of(url), b"POST " + path + b" HTTP/1.1\r\nHost: x\r\n"
                                        b"Authorization: Bearer \xff\xfe\r\nConnection: close\r\n"
                                        b"Content-Length: %d\r\n\r\n" % len(body), body)
            assert st == 401, raw
            assert b"Traceback" not in raw and b"internal" not in raw
        st, raw = await raw_request(port_of(url), b"GET /eldr/status HTTP/1.1\r\nHost: x\r\n"
                                    b"Authorization: Bearer \xc3\xa9\xff\r\nConnection: close\r\n\r\n")
        assert st == 403, raw
        assert not prefill.requests


# ------------------------------------------------------------------ 8. JSON too deep to re-serialise
def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [300, 600, 1000])
async def test_json_nested_deeper_than_it_can_be_forwarded_is_a_400(depth):
    async with cluster(n_decode=2) as (router, url, prefill, decodes, http):
        try:
            orjson.loads(nested(depth))
        except orjson.JSONDecodeError:
            pytest.skip(f"orjson refuses depth {depth} itself")
        cases = [("/generate", b'{"text": "topic:0", "junk": ' + nested(depth) + b"}"),
                 ("/generate", b'{"text": "topic:0", "sampling_params": {"x": ' + nested(depth) + b"}}"),
                 ("/v1/completions", b'{"prompt": "a", "junk": ' + nested(depth) + b"}"),
                 ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + nested(depth) + b"}]}")]
        for path, body in cases:
            st, raw = await post(http, url + path, body)
            assert st == 400, (path, st, raw)
            err = orjson.loads(raw)["error"]
            message = err["message"] if path.startswith("/v1/") else err
            assert "nested" in message or "JSON" in message, message
        router.parser.off_loop_bytes = 100  # the same through the parser process
        st, raw = await post(http, url + "/generate", cases[0][1])
        assert st == 400, raw
        # a signature message with a deep model object: 400, not a 500
        msg = b'{"bootstrap_room": 1, "layers": [0, 1], "counts": [[1], [1]], "model": {"x": ' + nested(depth) + b"}}"
        st, raw = await post(http, url + "/eldr/signature", msg)
        assert st == 400, raw
        assert not prefill.requests
        assert router.metrics.value("errors", kind="bad_request") >= 4


# ------------------------------------------------------------------ 12. GET /eldr/calibration
async def test_calibration_view_needs_a_key_and_hides_the_path_from_non_admins(tmp_path):
    from tests.integration.helpers import save_artifact

    path = save_artifact(tmp_path / "secret-dir" / "art.json", 2) if (tmp_path / "secret-dir").mkdir() is None else None
    async with cluster(n_decode=2, artifact=None, calibration=path, api_key="ck",
                       admin_token="at") as (router, url, prefill, decodes, http):
        async with http.get(f"{url}/eldr/calibration") as r:
            raw = await r.read()
            assert r.status in (401, 403) and b"secret-dir" not in raw, raw
        async with http.get(f"{url}/eldr/calibration", headers={"Authorization": "Bearer ck"}) as r:
            raw = await r.read()
            assert r.status == 200 and b"secret-dir" not in raw and b"art.json" not in raw, raw
            assert orjson.loads(raw)["policy"] == "eldr"
        async with http.get(f"{url}/eldr/calibration", headers={"Authorization": "Bearer at"}) as r:
            raw = await r.read()
            assert r.status == 200 and orjson.loads(raw)["path"] == path, raw


# ------------------------------------------------------------------ 6. open intake
def test_an_open_signature_intake_is_named_at_start(caplog):
    from eldr_sglang.router.app import Router

    with caplog.at_level("WARNING", logger="eldr_sglang.router"):
        Router([("http://127.0.0.1:1", 8998)], ["http://127.0.0.1:2"], "round_robin", signature_port=0)
    open_warnings = [r for r in caplog.records if "signature intake" in r.getMessage()]
    assert len(open_warnings) == 1 and open_warnings[0].levelname == "WARNING"
    assert "OPEN" in open_warnings[0].getMessage() and "--signature-port" in open_warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="eldr_sglang.router"):
        Router([("http://127.0.0.1:1", 8998)], ["http://127.0.0.1:2"], "round_robin",
               signature_key_file=__file__)
    assert not [r for r in caplog.records if "signature intake" in r.getMessage()]


async def test_with_an_api_key_and_no_signature_key_the_intake_needs_the_api_key():
    async with cluster(n_decode=2, api_key="ck", signature_port=0, prefill_kw={"send_signature": False}) as (
            router, url, prefill, decodes, http):
        msg = wire.build_message(11, "r", 4, 0, [0, 1], topic_counts("topic:1"), packed=True)
        body, headers = wire.http_body(msg)
        async with http.post(f"{url}/eldr/signature", data=body, headers=headers) as r:
            assert r.status == 401 and "Bearer" in (await r.json())["error"]
        async with http.post(f"{url}/eldr/signature", data=body,
                             headers={**headers, "Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        assert router.metrics.value("signature_messages") == 0 and not router.board.buffer
        async with http.post(f"{url}/eldr/signature", data=body,
                             headers={**headers, "Authorization": "Bearer ck"}) as r:
            assert r.status == 200, await r.text()
        body, headers = wire.http_body(wire.build_message(12, "r", 4, 0, [0, 1], topic_counts("topic:1"),
                                                          packed=True), b"ck")
        async with http.post(f"{url}/eldr/signature", data=body, headers=headers) as r:
            assert r.status == 200, await r.text()  # signed with the API key
        _, w = await asyncio.open_connection("127.0.0.1", router.intake.port)
        w.write(wire.stream_lines([wire.build_message(13, "r", 4, 0, [0, 1], topic_counts("topic:1"))]))
        w.write(wire.stream_lines([wire.build_message(14, "r", 4, 0, [0, 1], topic_counts("topic:1"))], b"ck"))
        await w.drain()
        await until(lambda: 14 in router.board.buffer, what="the signed line taken")
        w.close()
        assert 13 not in router.board.buffer
        assert router.metrics.value("signature_auth_refused", reason="unsigned") >= 2


# ------------------------------------------------------------------ 5. online window shape
async def test_one_message_of_another_shape_first_never_fixes_the_online_window():
    async with cluster(n_decode=2, policy="eldr", artifact=None, online=True, online_min_signatures=20,
                       online_fit_in="thread", health_interval=0, load_interval=0) as (
            router, url, prefill, decodes, http):
        foreign = {"bootstrap_room": 5, "layers": [3, 4, 5], "counts": [[1] * 5] * 3}
        st, raw = await post(http, f"{url}/eldr/signature", foreign)
        assert st == 200, raw
        for i in range(24):
            st, raw = await post(http, f"{url}/generate", {"text": f"topic:{i % 2} {i}"})
            assert st == 200, raw
        window = router.online.calibrator.window
        await until(lambda: len(window) == 24, what="every legitimate signature in the window")
        assert window.layers == [0, 1] and window.resets == 0
        assert router.online.refused == 1  # the foreign one, counted
        assert router.metrics.value("errors", kind="signature_online_mismatch") == 1
        await until(lambda: router.online.calibrator.generation >= 1, what="the first fit")


# ------------------------------------------------------------------ 4. replay
KEY = b"round-three-key-0123456789"


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "signature.key"
    path.write_bytes(KEY)
    return str(path)


async def test_a_signed_message_is_taken_once_fresh_and_never_replayed(key_file):
    async with cluster(n_decode=2, policy="eldr", artifact=None, online=True, online_min_signatures=50,
                       online_fit_in="thread", signature_port=0, signature_key_file=key_file,
                       signature_max_age=30, prefill_kw={"send_signature": False}) as (
            router, url, prefill, decodes, http):
        msg = wire.build_message(21, "r", 4, 0, [0, 1], topic_counts("topic:1"), packed=True)
        body, headers = wire.http_body(msg, KEY)
        assert b'"ts":' in body  # stamped inside what the MAC covers
        async with http.post(f"{url}/eldr/signature", data=body, headers=headers) as r:
            assert r.status == 200, await r.text()
        for _ in range(20):  # the same bytes again: a replay
            async with http.post(f"{url}/eldr/signature", data=body, headers=headers) as r:
                assert r.status == 400 and "replay" in (await r.json())["error"]
        line = wire.stream_lines([msg], KEY)
        _, w = await asyncio.open_connection("127.0.0.1", router.intake.port)
        w.write(line * 200)
        await w.drain()
        await until(lambda: router.metrics.value("errors", kind="signature_replay") == 220,
                    what="every replay refused and counted")
        w.close()
        online = router.online
        assert len(online.calibrator.window) + len(online.pending) == 1  # one copy in the fit
        # stale or from the future, or without a stamp: refused
        for ts in (wire.time.time() - 3600, wire.time.time() + 3600):
            body, headers = wire.http_body({**msg, "bootstrap_room": 22, "ts": ts}, KEY)
            async with http.post(f"{url}/eldr/signature", data=body, headers=headers) as r:
                assert r.status == 400 and "signature-max-age" in (await r.json())["error"]
        raw = orjson.dumps({**msg, "bootstrap_room": 23})
        async with http.post(f"{url}/eldr/signature", data=raw,
                             headers={wire.MAC_HEADER: wire.mac(KEY, raw).decode()}) as r:
            assert r.status == 400 and "'ts'" in (await r.json())["error"]
        assert router.metrics.value("errors", kind="signature_stale") == 2
        assert router.metrics.value("errors", kind="signature_unstamped") == 1
        assert len(online.calibrator.window) + len(online.pending) == 1


async def test_the_engine_publisher_stamps_what_it_signs(key_file):
    from eldr_sglang.patches.publish import SignaturePublisher

    async with cluster(n_decode=2, signature_port=0, signature_key_file=key_file,
                       prefill_kw={"send_signature": False}) as (router, url, prefill, decodes, http):
        pub = SignaturePublisher(f"tcp://127.0.0.1:{router.intake.port}", key=KEY)
        pub.submit(wire.build_message(31, "r", 4, 0, [0, 1], topic_counts("topic:1"), packed=True))
        pub.submit(wire.build_message(32, "r", 4, 0, [0, 1], topic_counts("topic:1"), packed=True),
                   f"{url}/eldr/signature")
        await until(lambda: 31 in router.board.buffer and 32 in router.board.buffer,
                    what="both messages taken")
        assert router.metrics.value("signature_auth_refused") == 0


# ------------------------------------------------------------------ 3. the signature TCP port
async def test_signature_port_drops_unsigned_lines_as_they_come_and_times_out_slow_ones(key_file):
    async with cluster(n_decode=2, signature_port=0, signature_key_file=key_file,
                       signature_line_timeout=0.5, signature_stream_idle=60) as (
            router, url, prefill, decodes, http):
        r, w = await asyncio.open_connection("127.0.0.1", router.intake.port)
        w.write(b'{"bootstrap_room": 1, "junk": "' + b"x" * 500_000)  # no MAC, no newline
        await w.drain()
        await until(lambda: router.metrics.value("signature_auth_refused", reason="unsigned") == 1,
                    what="the unsigned line refused before its end")
        assert router.intake.partial_bytes < 1000  # nothing of it buffered
        # a line with a MAC prefix that never ends: closed after the line limit
        r2, w2 = await asyncio.open_connection("127.0.0.1", router.intake.port)
        w2.write(b"sha256=" + b"0" * 64 + b' {"bootstrap_room": 2, ')
        await w2.drain()
        assert await asyncio.wait_for(r2.read(), 30) == b""  # closed by the router
        assert await asyncio.wait_for(r.read(), 30) == b""  # the dropped line timed out too
        assert router.metrics.value("errors", kind="signature_line_timeout") == 2
        await until(lambda: not router.intake.streams and router.intake.partial_bytes == 0,
                    what="no stream left")
        w.close()
        w2.close()


async def test_signature_port_caps_connections_and_closes_idle_ones():
    async with cluster(n_decode=2, signature_port=0, signature_max_streams=8,
                       signature_stream_idle=0.5) as (router, url, prefill, decodes, http):
        conns = [await asyncio.open_connection("127.0.0.1", router.intake.port) for _ in range(20)]
        closed = await asyncio.gather(*(asyncio.wait_for(r.read(), 30) for r, _ in conns))
        assert closed == [b""] * 20  # 12 at once (over the cap), the 8 others once idle
        assert router.metrics.value("errors", kind="signature_streams_full") == 12
        await until(lambda: not router.intake.streams, what="no stream left")
        st, raw = await post(http, f"{url}/generate", {"text": "topic:1"})
        assert st == 200, raw  # the client port never noticed
        for _, w in conns:
            w.close()


# ------------------------------------------------------------------ 9. header timeout
async def test_leading_empty_lines_do_not_disarm_the_header_timeout():
    async with cluster(n_decode=2, client_header_timeout=0.5) as (router, url, prefill, decodes, http):
        r, w = await asyncio.open_connection("127.0.0.1", port_of(url))
        w.write(b"\r\n\r\n\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
        await w.drain()
        assert await asyncio.wait_for(r.read(), 30) == b""  # closed by the header limit
        assert router.metrics.value("errors", kind="header_timeout") == 1
        w.close()
        # empty lines before a whole head are fine
        st, raw = await raw_request(port_of(url), b"\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n"
                                    b"Connection: close\r\n\r\n")
        assert st == 200, raw


# ------------------------------------------------------------------ 2. the event loop
class LoopWatch:
    """The longest the event loop went without running a 5 ms ticker (a stall)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.task: asyncio.Task | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.005)
            now = loop.time()
            self.worst = max(self.worst, now - last - 0.005)
            last = now

    def __enter__(self) -> "LoopWatch":
        self.task = asyncio.ensure_future(self._tick())
        return self

    def __exit__(self, *exc) -> None:
        self.task.cancel()


async def sink_worker():
    """A worker that reads each request's bytes without parsing them and answers a
    small JSON object (the stub workers would parse a 24 MB body on this same loop)."""
    async def serve(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                left = length
                while left:
                    left -= len(await reader.read(min(left, 1 << 20)))
                body = b'{"text": "ok", "meta_info": {"id": "x"}}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        except (asyncio.IncompleteReadError, ConnectionError, IndexError):
            pass
        writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


BIG_BODIES = {
    "junk_lists": lambda: b'{"text": "topic:1", "junk": [' + b"[]," * 7_000_000 + b"[]]}",
    "sampling_ints": lambda: (b'{"text": "topic:1", "sampling_params": {"max_new_tokens": 4, "stop_token_ids": ['
                              + b"1234567," * 2_700_000 + b"1]}}"),
    "many_keys": lambda: b'{"text": "topic:1", ' + b"".join(b'"k%d": 1, ' % i for i in range(1_500_000)) + b'"z": 0}',
}


@pytest.mark.parametrize("shape", sorted(BIG_BODIES))
async def test_no_big_body_stalls_the_event_loop(shape):
    from eldr_sglang.router import Router, start_router

    prefill, purl = await sink_worker()
    decode, durl = await sink_worker()
    router = Router([(purl, 8998)], [durl], "round_robin", health_interval=0, load_interval=0)
    runner, port = await start_router(router)
    body = BIG_BODIES[shape]()
    assert 20 << 20 < len(body) < 32 << 20
    try:
        import aiohttp
        async with aiohttp.ClientSession() as http:
            st, raw = await post(http, f"http://127.0.0.1:{port}/generate", b'{"text": "warm"}' + b" " * (300 << 10))
            assert st == 200, raw  # the parser process started
            with LoopWatch() as watch:
                st, raw = await post(http, f"http://127.0.0.1:{port}/generate", body)
        print(f"{shape}: worst loop stall {watch.worst:.3f} s")
        # a 24 MB body costs a few copies on the loop, never its objects (seconds before)
        assert watch.worst < 0.5, f"the event loop stalled {watch.worst:.3f} s"
        if shape == "many_keys":
            assert st == 400 and "too many small fields" in orjson.loads(raw)["error"]
        else:
            assert st == 200, raw
    finally:
        await runner.cleanup()
        for s in (prefill, decode):
            s.close()


@pytest.mark.parametrize("shape", ["junk_lists", "sampling_ints"])
async def test_no_big_body_stalls_the_colocated_router(shape):
    """The co-located router forwards the raw bytes: a big body is parsed in the parser
    process and only the fields routing reads come back."""
    from eldr_sglang.router.http.serve import start_router
    from eldr_sglang.router.colocated import ColocatedRouter

    server, url = await sink_worker()
    router = ColocatedRouter([url], health_interval=0, load_interval=0, policy="round_robin")
    runner, port = await start_router(router)
    try:
        import aiohttp
        async with aiohttp.ClientSession() as http:
            st, raw = await post(http, f"http://127.0.0.1:{port}/generate",
                                 b'{"input_ids": [1, 2, 3]}' + b" " * (300 << 10))
            assert st == 200, raw  # the parser process started
            body = BIG_BODIES[shape]().replace(b'"text": "topic:1"', b'"input_ids": [1, 2, 3]')
            with LoopWatch() as watch:
                st, raw = await post(http, f"http://127.0.0.1:{port}/generate", body)
        print(f"colocated {shape}: worst loop stall {watch.worst:.3f} s")
        assert watch.worst < 0.5, f"the event loop stalled {watch.worst:.3f} s"
        assert st == 200, raw
    finally:
        await runner.cleanup()
        server.close()


async def test_signature_lines_of_any_shape_do_not_stall_the_event_loop():
    async with cluster(n_decode=2, signature_port=0) as (router, url, prefill, decodes, http):
        ragged = (b'{"bootstrap_room": 1, "layers": [0, 1], "counts": [['
                  + b"7," * 480_000 + b'7], [1]]}\n')
        valid_big = (b'{"bootstrap_room": 2, "layers": [0, 1], "counts": [['
                     + b"7," * 240_000 + b"7], [" + b"7," * 240_000 + b'7]]}\n')
        assert len(ragged) < 1 << 20 and len(valid_big) < 1 << 20
        _, w = await asyncio.open_connection("127.0.0.1", router.intake.port)
        with LoopWatch() as watch:
            for i in range(10):
                w.write(ragged + valid_big.replace(b'"bootstrap_room": 2', b'"bootstrap_room": %d' % (100 + i)))
                await w.drain()
            await until(lambda: router.metrics.value("signature_messages") >= 20,
                        what="every line looked at")
        w.close()
        print(f"signature lines: worst loop stall {watch.worst:.3f} s")
        assert watch.worst < 0.5, f"the event loop stalled {watch.worst:.3f} s"
        # many small lines at once: handled with pauses for the rest of the loop
        _, w = await asyncio.open_connection("127.0.0.1", router.intake.port)
        before = router.metrics.value("signature_messages")
        with LoopWatch() as watch:
            w.write(b'{"bootstrap_room": "not a room"}\n' * 30_000)
            await w.drain()
            await until(lambda: router.metrics.value("signature_messages") >= before + 30_000,
                        what="every small line looked at")
        w.close()
        print(f"30,000 small lines: worst loop stall {watch.worst:.3f} s")
        assert watch.worst < 0.5, f"the event loop stalled {watch.worst:.3f} s"
        # a body of more messages than any publisher sends at once: refused whole
        many = [{"bootstrap_room": 1000 + i, "layers": [0], "counts": [[1]]} for i in range(300)]
        st, raw = await post(http, f"{url}/eldr/signature", many)
        assert st == 400 and "at most 256" in orjson.loads(raw)["error"], raw


async def test_idle_signature_connections_never_take_the_client_ports_descriptors():
    """A router limited to 256 open files; 400 idle connections to its signature port;
    client requests are still served (1,010 idle connections under
    ``ulimit -n 1024`` made every client request fail)."""
    import resource
    import subprocess
    import sys

    from eldr_sglang.testing.local_cluster import free_port
    from eldr_sglang.testing.stub_worker import StubWorker

    prefill, decode = StubWorker("prefill", send_signature=False), StubWorker("decode")
    purl, durl = await prefill.start(), await decode.start()
    port, sig_port = free_port(), free_port()

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    proc = subprocess.Popen([sys.executable, "-m", "eldr_sglang.router", "--prefill", purl, "8998",
                             "--decode", durl, "--policy", "round_robin", "--host", "127.0.0.1",
                             "--port", str(port), "--signature-port", str(sig_port),
                             "--health-interval", "0", "--load-interval", "0", "--log-level", "error"],
                            preexec_fn=limit, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    conns = []
    try:
        import aiohttp
        async with aiohttp.ClientSession() as http:
            async def ready():
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return proc.poll() is not None
            await until(ready, what="the router up")
            assert proc.poll() is None, proc.stderr.read()
            for _ in range(400):
                conns.append(await asyncio.open_connection("127.0.0.1", sig_port))
            for i in range(20):
                st, raw = await post(http, f"http://127.0.0.1:{port}/generate", {"text": f"hello {i}"})
                assert st == 200, raw
            async with http.get(f"http://127.0.0.1:{port}/eldr/status") as r:
                streams = (await r.json())["signature_streams"]
            assert streams <= (256 - 64) // 8
    finally:
        for _, w in conns:
            w.close()
        proc.terminate()
        proc.wait(15)
        await prefill.stop()
        await decode.stop()
