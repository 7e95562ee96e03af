"""The worker client never leaks a connection nor a slot when a request is cancelled
while it connects (a prefill failing after its signature cancels
the decode POST), on asyncio and uvloop alike."""

from __future__ import annotations

import asyncio

import pytest

from eldr_sglang.router.pool import upstream

pytestmark = pytest.mark.timeout(60)


async def wait_for(pred, what, timeout=20.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def scenario(monkeypatch) -> None:
    async def answer(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/generate"
    client = upstream.UpstreamClient(max_per_worker=2, keepalive=30)
    key = ("127.0.0.1", server.sockets[0].getsockname()[1], False)
    victim: list[asyncio.Task] = []
    made = upstream._Conn.connection_made

    def cancel_when_connected(self, transport):  # the cancel lands between connect and use
        made(self, transport)
        if victim:
            victim.pop().cancel()

    monkeypatch.setattr(upstream._Conn, "connection_made", cancel_when_connected)
    for _ in range(30):
        task = asyncio.ensure_future(client.post(url, b"{}"))
        victim.append(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client._count.get(key, 0) >= 0
    monkeypatch.setattr(upstream._Conn, "connection_made", made)
    await wait_for(lambda: client.open_connections == 0, "no connection left open")
    assert client._count.get(key, 0) == 0 and client._connecting.get(key, 0) == 0
    # the cap still holds: 6 requests at once, never more than 2 connections
    peak = 0

    async def one():
        nonlocal peak
        resp = await client.post(url, b"{}")
        peak = max(peak, client._count[key], client.open_connections)
        assert await resp.read() == b"ok"
        resp.release()
    await asyncio.gather(*(one() for _ in range(6)))
    assert peak <= 2
    client.close()
    await wait_for(lambda: client.open_connections == 0 and client._count.get(key, 0) == 0,
                   "every connection closed")
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_request_cancelled_while_connecting_leaks_nothing(loop, monkeypatch):
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(scenario(monkeypatch))
    else:
        asyncio.run(scenario(monkeypatch))
