"""The router's worker client (eldr_sglang/router/pool/upstream.py) against real sockets."""

import asyncio
import errno
import os
import subprocess
import sys
import textwrap
import time

import pytest
from aiohttp import web

from eldr_sglang.router.pool import upstream
from tests.helpers import until

pytestmark = pytest.mark.timeout(30)


async def aiohttp_server(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def raw_server(handler):
    """A scripted server: ``handler(request_bytes, writer)`` answers as it likes."""
    conns = []

    async def on_conn(reader, writer):
        conns.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0]
                             .split(b":")[1])
                body = await reader.readexactly(length)
                if await handler(head + body, writer) is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", conns


async def test_keep_alive_content_length_and_chunked_stream():
    peers = set()

    async def echo(request):
        peers.add(request.transport.get_extra_info("peername"))
        return web.Response(body=b"got " + await request.read(), status=201)

    async def stream(request):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(5):
            await out.write(b"data: %d\n\n" % i)
            await asyncio.sleep(0.01)
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/stream", stream)
    runner, url = await aiohttp_server(app)
    client = upstream.UpstreamClient(timeout=5)
    try:
        for i in range(3):
            r = await client.post(f"{url}/echo", b'{"i": %d}' % i)
            assert (r.status, await r.read()) == (201, b'got {"i": %d}' % i)
            r.release()
        assert len(peers) == 1  # one kept-alive connection for all three
        r = await client.post(f"{url}/stream", b"{}")
        assert r.status == 200 and (b"content-type", b"text/event-stream") in \
            [(k.lower(), v) for k, v in r.headers]
        chunks = [c async for c in r.iter_chunks()]
        r.release()
        assert b"".join(chunks) == b"".join(b"data: %d\n\n" % i for i in range(5))
        assert len(chunks) >= 2  # arrived as written, not at the end
        r = await client.post(f"{url}/echo", b"again")
        assert await r.read() == b"got again" and len(peers) == 1
        r.release()
    finally:
        client.close()
        await runner.cleanup()


async def test_errors_say_whether_the_worker_saw_the_request():
    client = upstream.UpstreamClient(timeout=0.5)
    # nothing listens: never connected
    server, url, _ = await raw_server(None)
    server.close()
    await server.wait_closed()
    with pytest.raises(upstream.ConnectError):
        await client.post(f"{url}/x", b"{}")

    async def drop(req, writer):  # reads the request, closes without a byte
        return False
    server, url, _ = await raw_server(drop)
    with pytest.raises(upstream.Disconnected):
        await client.post(f"{url}/x", b"{}")
    server.close()

    async def half(req, writer):  # headers and half the body, then gone
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabcde")
        await writer.drain()
        return False
    server, url, _ = await raw_server(half)
    r = await client.post(f"{url}/x", b"{}")
    with pytest.raises(upstream.Disconnected):
        await r.read()
    r.release()
    server.close()

    async def silent(req, writer):  # never answers
        await asyncio.sleep(10)
    server, url, _ = await raw_server(silent)
    t0 = time.monotonic()
    with pytest.raises(upstream.Timeout):
        await client.post(f"{url}/x", b"{}")
    assert 0.4 < time.monotonic() - t0 < 2
    assert isinstance(upstream.Timeout(), asyncio.TimeoutError)
    server.close()

    async def garbage(req, writer):
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
    server, url, _ = await raw_server(garbage)
    with pytest.raises(upstream.Disconnected):
        await client.post(f"{url}/x", b"{}")
    server.close()
    client.close()


async def test_close_delimited_body_large_body_and_server_closed_idle_connection():
    big = bytes(range(256)) * (3 * upstream.PAUSE_BYTES // 256)  # > the pause threshold

    async def answer(req, writer):
        if b"/eof" in req:  # no length: the body ends with the connection
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
            await writer.drain()
            return False
        if b"/big" in req:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
    server, url, conns = await raw_server(answer)
    client = upstream.UpstreamClient(timeout=5)
    r = await client.post(f"{url}/eof", b"{}")
    assert await r.read() == b"until the end"
    r.release()
    r = await client.post(f"{url}/big", b"{}")
    assert await r.read() == big
    r.release()
    n = len(conns)
    for w in conns:  # the server closes its idle connections
        w.close()
    await until(lambda: client.idle_connections == 0, 10, "the client to see the server's closes")
    r = await client.post(f"{url}/ok", b"{}")
    assert await r.read() == b"ok" and len(conns) == n + 1  # a fresh one, no error
    r.release()
    # an answer released unread closes its connection instead of reusing it
    r = await client.post(f"{url}/big", b"{}")
    r.release()
    r = await client.post(f"{url}/ok", b"{}")
    assert await r.read() == b"ok" and len(conns) == n + 2
    r.release()
    client.close()
    server.close()


async def test_bad_url_is_refused():
    client = upstream.UpstreamClient()
    with pytest.raises(ValueError):
        await client.post("ftp://x/y", b"")


async def test_first_byte_timeout_ends_long_before_the_total():
    async def silent(req, writer):  # reads the request, never answers
        await asyncio.sleep(30)
    server, url, _ = await raw_server(silent)
    client = upstream.UpstreamClient(30, first_byte_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(upstream.Timeout) as e:
        await client.post(f"{url}/x", b"{}")
    assert e.value.phase == "first_byte" and "no answer headers within 0.3 s" in str(e.value)
    assert 0.25 < time.monotonic() - t0 < 10
    # per call: no first-byte limit (0) under a short total
    t0 = time.monotonic()
    with pytest.raises(upstream.Timeout) as e:
        await client.post(f"{url}/x", b"{}", timeout=0.5, first_byte_timeout=0)
    assert e.value.phase == "total" and "0.5 s" in str(e.value)
    assert 0.45 < time.monotonic() - t0 < 10
    # per call: a first-byte limit the client does not have
    with pytest.raises(upstream.Timeout) as e:
        await upstream.UpstreamClient(30).post(f"{url}/x", b"{}", first_byte_timeout=0.2)
    assert e.value.phase == "first_byte" and "0.2 s" in str(e.value)
    client.close()
    server.close()


async def test_idle_timeout_on_a_stalled_stream_and_a_stalled_body():
    async def stall(req, writer):  # headers and some body, then nothing
        if b"/stream" in req:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabcde")
        await writer.drain()
        await asyncio.sleep(30)
    server, url, _ = await raw_server(stall)
    client = upstream.UpstreamClient(30, idle_timeout=0.3)
    r = await client.post(f"{url}/stream", b"{}")
    chunks = []
    t0 = time.monotonic()
    with pytest.raises(upstream.Timeout) as e:
        async for c in r.iter_chunks():
            chunks.append(c)
    r.release()
    assert chunks == [b"first"] and e.value.phase == "idle" and "0.3 s" in str(e.value)
    assert 0.25 < time.monotonic() - t0 < 10
    r = await client.post(f"{url}/body", b"{}")
    t0 = time.monotonic()
    with pytest.raises(upstream.Timeout) as e:
        await r.read()
    r.release()
    assert e.value.phase == "idle" and 0.25 < time.monotonic() - t0 < 10
    client.close()
    server.close()


async def test_slow_steady_stream_is_not_idle_but_the_total_still_applies():
    async def steady(req, writer):  # 20 chunks, one every 0.05 s
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(20):
            await asyncio.sleep(0.05)
            writer.write(b"2\r\n%02d\r\n" % i)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    server, url, _ = await raw_server(steady)
    client = upstream.UpstreamClient(30, first_byte_timeout=0.5, idle_timeout=0.5)
    r = await client.post(f"{url}/x", b"{}")
    chunks = [c async for c in r.iter_chunks()]
    r.release()
    assert b"".join(chunks) == b"".join(b"%02d" % i for i in range(20)) and len(chunks) >= 10
    r = await client.post(f"{url}/x", b"{}", timeout=0.4)  # shorter than the stream
    with pytest.raises(upstream.Timeout) as e:
        await r.read()
    r.release()
    assert e.value.phase == "total" and "0.4 s" in str(e.value)
    client.close()
    server.close()


@pytest.mark.parametrize("code, error", [
    (errno.EMFILE, upstream.LocalResourceError), (errno.ENFILE, upstream.LocalResourceError),
    (errno.ENOBUFS, upstream.LocalResourceError), (errno.ENOMEM, upstream.LocalResourceError),
    (errno.ECONNREFUSED, upstream.ConnectError)])
async def test_router_out_of_resources_is_not_the_workers_fault(code, error):
    async def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    asyncio.get_running_loop().create_connection = fail
    with pytest.raises(upstream.UpstreamError) as e:
        await upstream.UpstreamClient(5).post("http://127.0.0.1:9/x", b"{}")
    assert type(e.value) is error
    if error is upstream.LocalResourceError:
        assert "router's own limit" in str(e.value)


def test_out_of_file_descriptors_for_real():
    script = textwrap.dedent("""
        import asyncio, importlib.util, os, resource, sys
        spec = importlib.util.spec_from_file_location("upstream", sys.argv[1])
        upstream = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(upstream)

        async def main():
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            held = []
            try:
                while True:
                    held.append(open(os.devnull))
            except OSError:
                pass
            try:
                await upstream.UpstreamClient(5).post("http://127.0.0.1:9/x", b"{}")
            except upstream.UpstreamError as e:
                print(type(e).__name__)
        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script, upstream.__file__], capture_output=True,
                         text=True, timeout=20)
    assert out.stdout.strip() == "LocalResourceError", out.stderr


async def test_idle_connections_are_closed_by_a_timer():
    async def ok(req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
    server, url, conns = await raw_server(ok)
    client = upstream.UpstreamClient(30, keepalive=0.2)

    async def one():
        r = await client.post(f"{url}/x", b"{}")
        try:
            return await r.read()
        finally:
            r.release()

    def all_closed():
        return client.open_connections == 0 and all(w.is_closing() for w in conns)

    assert await asyncio.gather(*(one() for _ in range(50))) == [b"ok"] * 50
    assert len(conns) == 50  # a burst: one connection each
    assert client.open_connections == client.idle_connections >= 1
    await until(all_closed)  # closed by the timer, nothing touched the pool
    assert all_closed() and client.idle_connections == 0
    assert client._sweeper is None  # nothing idle: the timer stopped
    assert await one() == b"ok" and len(conns) == 51  # a fresh connection...
    assert client.idle_connections == client.open_connections == 1
    await until(all_closed)  # ...closed by the restarted timer
    assert all_closed()
    assert await one() == b"ok" and client._sweeper is not None
    client.close()
    assert client._sweeper is None and client.open_connections == 0
    server.close()
