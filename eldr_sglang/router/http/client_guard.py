"""Client connections: a time limit on request headers, and a deep listen backlog.

aiohttp waits for a request's headers forever: a client that connects and sends
nothing, or half its headers, holds a connection (a file descriptor) for good.
:class:`HeaderTimeout` wraps each connection's protocol and closes it when no
complete request head (up to the blank line) arrived within ``timeout`` seconds of
the connection opening or of the first byte of its next request (an idle keep-alive
connection is left to aiohttp's keep-alive limit). The bytes are looked at as they
arrive, before the router's busy event loop gets to the request, so a router behind
on its work never closes a client that sent its head in time. The router's middleware
tells it when a request starts and ends (:meth:`ClientGuards.started` /
:meth:`ClientGuards.ended`): the body is the body limit's business.

:class:`GuardedSite` is aiohttp's TCP site with these protocols and a listen backlog
deep enough for a burst of connections (aiohttp's default is 128).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Callable, Optional

from aiohttp import web

LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn


class HeaderTimeout(asyncio.Protocol):
    """One client connection: forwards everything to aiohttp's protocol, closes the
    connection when a request head takes longer than ``timeout``."""

    def __init__(self, inner: asyncio.Protocol, guards: "ClientGuards") -> None:
        self.inner, self.guards = inner, guards
        self.transport: Optional[asyncio.Transport] = None
        self.timer: Optional[asyncio.TimerHandle] = None
        self.busy = 0  # requests of this connection being handled
        self.head_seen = False  # the current request's head arrived whole
        self.started = False  # a byte of the current request's head came (not an empty line)
        self._tail = b""  # the last bytes of the head so far (a blank line split in two)

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.guards.live[transport] = self
        self.inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self.head_seen:
            if not self.busy and self.timer is None:
                self._arm()  # the first byte of the next request
            head = data
            if not self.started:  # empty lines before a request line are no part of its head
                head = data.lstrip(b"\r\n")
                self.started = bool(head)
            if head:
                window = self._tail + head
                if b"\r\n\r\n" in window:
                    self.head_seen, self._tail = True, b""
                    self._disarm()
                else:
                    self._tail = window[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._disarm()
        self.guards.live.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def _arm(self) -> None:
        timeout = self.guards.timeout
        if timeout and timeout > 0:
            self.timer = asyncio.get_running_loop().call_later(timeout, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        if (not self.busy and not self.head_seen and self.transport is not None
                and not self.transport.is_closing()):
            self.guards.closed += 1
            if self.guards.on_close is not None:
                self.guards.on_close()
            self.transport.abort()


class ClientGuards:
    """The guarded connections of one router (by transport) and the header limit."""

    def __init__(self, timeout: Optional[float], on_close: Optional[Callable[[], None]] = None) -> None:
        self.timeout = timeout
        self.on_close = on_close  # called for each connection closed for slow headers
        self.live: dict[object, HeaderTimeout] = {}
        self.closed = 0

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: HeaderTimeout(factory(), self)

    def started(self, request: web.Request) -> None:
        guard = self.live.get(request.transport)
        if guard is not None:
            guard.busy += 1
            guard._disarm()

    def ended(self, request: web.Request) -> None:
        guard = self.live.get(request.transport)
        if guard is not None:
            guard.busy = max(0, guard.busy - 1)
            if not guard.busy:
                guard.head_seen = guard.started = False


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through ``guards`` (``reuse_port``: SO_REUSEPORT)."""

    def __init__(self, runner: web.BaseRunner, guards: ClientGuards, host: str, port: int,
                 reuse_port: bool = False, backlog: int = LISTEN_BACKLOG) -> None:
        super().__init__(runner, backlog=backlog)
        self.guards = guards
        self.host, self.port, self.reuse_port = host, port, reuse_port

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.guards.wrap(server), self.host, self.port, backlog=self._backlog,
            reuse_address=True, reuse_port=self.reuse_port or None)

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self._server.sockets) if self._server is not None else []
