"""Keep-alive HTTP/1.1 POSTs to the workers, the router's hot path.

The two requests of every routed request (prefill, then decode) go through this
small client instead of aiohttp's: an asyncio protocol per connection, responses
parsed by ``httptools`` (llhttp, the parser uvicorn uses), idle connections kept per
worker. It costs about 0.15 ms less per request than ``aiohttp.ClientSession.post``
on these machines (``benchmark/bench_router_vs_sglang_router.py``). Everything else
the router sends (aborts, health checks, admin fan-outs) stays on aiohttp.

Time limits, per client and per request: ``timeout`` (the whole answer),
``first_byte_timeout`` (status line and headers, from the request's write) and
``idle_timeout`` (each wait for more body bytes: a stream that stalls). Idle
connections are closed by a timer once idle for ``keepalive`` seconds.

Errors say whether the worker can have seen the request:
:class:`ConnectError` (never connected: safe to send elsewhere),
:class:`Disconnected` (connection lost after sending) and :class:`Timeout` (with the
``phase`` that ran out). :class:`LocalResourceError` is the router's own fault (out of
file descriptors or memory while connecting), not the worker's.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import ssl
import time
import urllib.parse
from typing import AsyncIterator, Optional

import httptools

__all__ = ["UpstreamError", "ConnectError", "LocalResourceError", "Disconnected", "Timeout",
           "UpstreamResponse", "UpstreamClient"]

PAUSE_BYTES = 1 << 20  # stop reading a connection holding this much unread body
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class UpstreamError(Exception):
    """A worker request failed below HTTP."""


class ConnectError(UpstreamError):
    """No connection (refused, unreachable, connect timeout): the worker never saw the request."""


class LocalResourceError(UpstreamError):
    """No connection because the router ran out of file descriptors or memory."""


class Disconnected(UpstreamError):
    """The connection broke after the request was sent (or the answer was not HTTP)."""


class Timeout(UpstreamError, asyncio.TimeoutError):
    """A time limit ran out; ``phase`` says which: "first_byte", "idle" or "total"."""

    def __init__(self, message: str = "worker answer timed out", phase: str = "total") -> None:
        super().__init__(message)
        self.phase = phase


def _limit(value: Optional[float], default: Optional[float] = None) -> Optional[float]:
    """``value``, or ``default`` when None; 0 or negative means no limit (None)."""
    value = default if value is None else value
    return value if value is not None and value > 0 else None


class _Conn(asyncio.Protocol):
    """One connection; parses one response at a time into an :class:`UpstreamResponse`."""

    def __init__(self, live: set[_Conn]) -> None:
        self.live = live  # the client's open connections
        self.transport: Optional[asyncio.Transport] = None
        self.parser: Optional[httptools.HttpResponseParser] = None  # a new one per request
        self.resp: Optional[UpstreamResponse] = None
        self.closed = False
        self.idle_since = 0.0

    # protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.live.add(self)

    def data_received(self, data: bytes) -> None:
        if self.resp is None:  # bytes nobody asked for: the connection is unusable
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.resp._fail(Disconnected(f"bad HTTP answer: {e}"))
            self.close()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.closed = True
        self.live.discard(self)
        if self.resp is not None:
            self.resp._eof()

    # parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.resp.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.resp._headers_done(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.resp._feed(body)

    def on_message_complete(self) -> None:
        resp, self.resp = self.resp, None
        resp._complete(self.parser.should_keep_alive())

    def close(self) -> None:
        self.closed = True
        self.live.discard(self)
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """Status and headers once received; the body by :meth:`read` or :meth:`iter_chunks`.

    Always :meth:`release` it (a fully read answer gives the connection back)."""

    def __init__(self, client: UpstreamClient, key: tuple, conn: _Conn, deadline: Optional[float],
                 total: Optional[float], idle: Optional[float]) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._client, self._key, self._conn = client, key, conn
        self._deadline, self._total, self._idle = deadline, total, idle  # loop time; seconds
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False
        self._keep_alive = False
        self._error: Optional[UpstreamError] = None
        self._waiter: Optional[asyncio.Future] = None
        self._head: asyncio.Future = asyncio.get_running_loop().create_future()
        self._released = False

    # fed by the connection
    def _wake(self) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def _headers_done(self, status: int) -> None:
        self.status = status
        if not self._head.done():
            self._head.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > PAUSE_BYTES and self._conn.transport is not None:
            self._conn.transport.pause_reading()
        self._wake()

    def _complete(self, keep_alive: bool) -> None:
        self._done, self._keep_alive = True, keep_alive
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._done or self._error is not None:
            return
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
        self._wake()

    def _eof(self) -> None:
        if self._head.done() and not self._done and self.status and not self._length_known():
            self._complete(False)  # a body delimited by the connection's end
        else:
            self._fail(Disconnected("connection closed before the answer was complete"))

    def _length_known(self) -> bool:
        for name, value in self.headers:
            n = name.lower()
            if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
                return True
        return False

    async def _wait(self, fut: asyncio.Future, limit: Optional[float], phase: str) -> None:
        """Await ``fut`` within ``limit`` seconds (for ``phase``) and the total deadline."""
        end = asyncio.get_running_loop().time() + limit if limit is not None else None
        if end is not None and (self._deadline is None or end < self._deadline):
            deadline = end
            message = (f"no answer headers within {limit} s" if phase == "first_byte"
                       else f"no body bytes for {limit} s")
        else:
            deadline, phase = self._deadline, "total"
            message = f"no complete answer within {self._total} s"
        try:
            async with asyncio.timeout_at(deadline):
                await fut
        except UpstreamError:
            raise
        except TimeoutError:
            raise Timeout(f"worker answer timed out: {message}", phase) from None

    async def _start(self, first_byte: Optional[float]) -> None:
        try:
            await self._wait(self._head, first_byte, "first_byte")
        except BaseException:
            self.release()
            raise

    # reading
    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked transfer decoded)."""
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._buffered <= PAUSE_BYTES // 2 and self._conn.transport is not None:
                    self._conn.transport.resume_reading()
                yield data
                continue
            if self._done:
                return
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            await self._wait(self._waiter, self._idle, "idle")

    async def read(self) -> bytes:
        if self._done and len(self._chunks) <= 1:
            data = self._chunks.popleft() if self._chunks else b""
            self._buffered = 0
            return data
        return b"".join([c async for c in self.iter_chunks()])

    def release(self) -> None:
        """Give the connection back (answer complete, keep-alive) or close it."""
        if self._released:
            return
        self._released = True
        if self._done and self._keep_alive and not self._conn.closed and not self._chunks:
            self._client._put(self._key, self._conn)
        else:
            if self._conn.resp is self:
                self._conn.resp = None
            self._conn.close()


class UpstreamClient:
    """Keep-alive POSTs: ``resp = await client.post(url, body)``, then read and release.

    Limits in seconds; None, 0 or negative: no limit."""

    def __init__(self, timeout: Optional[float] = None, connect_timeout: Optional[float] = None,
                 keepalive: float = 3.0, user_agent: str = "eldr-router", *,
                 first_byte_timeout: Optional[float] = None,
                 idle_timeout: Optional[float] = None) -> None:
        self.timeout = _limit(timeout)
        self.connect_timeout = _limit(connect_timeout)
        self.first_byte_timeout = _limit(first_byte_timeout)
        self.idle_timeout = _limit(idle_timeout)
        self.keepalive = keepalive
        self.user_agent = user_agent
        self._idle: dict[tuple, list[_Conn]] = {}  # oldest first
        self._live: set[_Conn] = set()
        self._sweeper: Optional[asyncio.TimerHandle] = None
        self._targets: dict[str, tuple] = {}  # url -> (host, port, ssl, path, host header)
        self._ssl: Optional[ssl.SSLContext] = None

    @property
    def idle_connections(self) -> int:
        """Open connections waiting in the pool."""
        return sum(not c.closed for pool in self._idle.values() for c in pool)

    @property
    def open_connections(self) -> int:
        """Open connections, idle or in use."""
        return len(self._live)

    def _target(self, url: str) -> tuple:
        t = self._targets.get(url)
        if t is None:
            u = urllib.parse.urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ValueError(f"not an http(s) URL: {url!r}")
            secure = u.scheme == "https"
            port = u.port or (443 if secure else 80)
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            t = self._targets[url] = (u.hostname, port, secure, path, u.netloc)
            if len(self._targets) > 4096:  # worker URLs only; bounded all the same
                self._targets.clear()
        return t

    def _put(self, key: tuple, conn: _Conn) -> None:
        if self.keepalive <= 0:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(key, []).append(conn)
        if self._sweeper is None:
            self._arm_sweeper()

    def _get(self, key: tuple) -> Optional[_Conn]:
        pool = self._idle.get(key)
        now = time.monotonic()
        while pool:
            conn = pool.pop()  # newest first: least likely closed by the server
            if not conn.closed and now - conn.idle_since < self.keepalive:
                return conn
            conn.close()
        return None

    def _sweep(self) -> None:
        """Close the connections idle for ``keepalive``; runs again while any stay idle."""
        self._sweeper = None
        now = time.monotonic()
        for key, pool in list(self._idle.items()):
            for conn in pool:
                if now - conn.idle_since >= self.keepalive:
                    conn.close()
            pool[:] = [c for c in pool if not c.closed]
            if not pool:
                del self._idle[key]
        if self._idle:
            self._arm_sweeper()

    def _arm_sweeper(self) -> None:
        self._sweeper = asyncio.get_running_loop().call_later(max(self.keepalive / 2, 0.05),
                                                              self._sweep)

    async def _connect(self, host: str, port: int, secure: bool) -> _Conn:
        loop = asyncio.get_running_loop()
        if secure and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(self._live), host, port, ssl=self._ssl if secure else None)
        except TimeoutError:
            raise ConnectError(f"connect to {host}:{port} timed out") from None
        except OSError as e:
            if e.errno in LOCAL_ERRNOS:
                raise LocalResourceError(f"router's own limit reached (not the worker's fault) "
                                         f"connecting to {host}:{port}: {e}") from None
            raise ConnectError(f"cannot connect to {host}:{port}: {e}") from None
        return conn

    async def post(self, url: str, body: bytes, content_type: bytes = b"application/json",
                   timeout: Optional[float] = None, *, first_byte_timeout: Optional[float] = None,
                   idle_timeout: Optional[float] = None) -> UpstreamResponse:
        """Send ``body``; returns once the status line and headers arrived.

        Each limit overrides the client's when not None (0 or negative: no limit)."""
        host, port, secure, path, netloc = self._target(url)
        key = (host, port, secure)
        total = _limit(timeout, self.timeout)
        deadline = asyncio.get_running_loop().time() + total if total else None
        conn = self._get(key)
        if conn is None or conn.transport.is_closing():
            conn = await self._connect(host, port, secure)
        resp = UpstreamResponse(self, key, conn, deadline, total,
                                _limit(idle_timeout, self.idle_timeout))
        conn.resp = resp
        conn.parser = httptools.HttpResponseParser(conn)
        conn.transport.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: %s\r\n"
                             b"Content-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
                                 path.encode(), netloc.encode(), self.user_agent.encode(),
                                 content_type, len(body), body))
        await resp._start(_limit(first_byte_timeout, self.first_byte_timeout))
        return resp

    def close(self) -> None:
        """Close the idle connections and stop the sweeper (connections in use stay open)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for pool in self._idle.values():
            for conn in pool:
                conn.close()
        self._idle.clear()
