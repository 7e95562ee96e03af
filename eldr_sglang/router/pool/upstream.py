"""Keep-alive HTTP/1.1 POSTs to the workers, the router's hot path.

The two requests of every routed request (prefill, then decode) go through this
small client instead of aiohttp's: an asyncio protocol per connection, responses
parsed by ``httptools`` (llhttp, the parser uvicorn uses), idle connections kept per
worker. It costs about 0.15 ms less per request than ``aiohttp.ClientSession.post``
on these machines (``git show f0ce8c6:benchmark/bench_router_vs_sglang_router.py``, since removed). Everything else
the router sends (aborts, health checks, admin fan-outs) stays on aiohttp.

Time limits, per client and per request: ``timeout`` (the whole answer),
``first_byte_timeout`` (status line and headers, from the request's write) and
``idle_timeout`` (each wait for more body bytes: a stream that stalls). Idle
connections are closed by a timer once idle for ``keepalive`` seconds.

Connections per worker are capped (``max_per_worker``, and ``CONNECTS_PER_WORKER``
attempts in flight): above it a request waits in a FIFO queue for a connection to
come free (handed over directly) or to close, so a burst queues in the router
instead of flooding the worker's listen queue; a request that waits past its
deadline fails with :class:`Saturated`, the router's own limit, never the worker's
fault. So does a connect whose time limit ran out only because the router's event
loop was too busy to see the answer in time (its timer fired late by more than half
the limit).

Errors say whether the worker can have seen the request:
:class:`ConnectError` (never connected: safe to send elsewhere),
:class:`Disconnected` (connection lost after sending) and :class:`Timeout` (with the
``phase`` that ran out). :class:`LocalResourceError` is the router's own fault (out of
file descriptors or memory while connecting, or no connection came free in time),
not the worker's. Each error's ``public`` text names no address (client answers).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import os
import ssl
import time
import urllib.parse
from typing import AsyncIterator, Callable, Optional, Sequence

import httptools

__all__ = ["UpstreamError", "ConnectError", "LocalResourceError", "Saturated", "Disconnected",
           "Timeout", "UpstreamResponse", "UpstreamClient"]

PAUSE_BYTES = 1 << 20  # stop reading a connection holding this much unread body
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class UpstreamError(Exception):
    """A worker request failed below HTTP; ``public``: the same without addresses."""

    def __init__(self, message: str = "worker request failed", public: Optional[str] = None) -> None:
        super().__init__(message)
        self.public = public or message


class ConnectError(UpstreamError):
    """No connection (refused, unreachable, connect timeout): the worker never saw the request."""


class LocalResourceError(UpstreamError):
    """No connection because the router ran out of file descriptors or memory."""


class Saturated(LocalResourceError):
    """Every connection to the worker stayed busy until the request's deadline."""


class Disconnected(UpstreamError):
    """The connection broke after the request was sent (or the answer was not HTTP)."""


class Timeout(UpstreamError, asyncio.TimeoutError):
    """A time limit ran out; ``phase`` says which: "first_byte", "idle" or "total"."""

    def __init__(self, message: str = "worker answer timed out", phase: str = "total") -> None:
        super().__init__(message, message)
        self.phase = phase


def _limit(value: Optional[float], default: Optional[float] = None) -> Optional[float]:
    """``value``, or ``default`` when None; 0 or negative means no limit (None)."""
    value = default if value is None else value
    return value if value is not None and value > 0 else None


class _Conn(asyncio.Protocol):
    """One connection; parses one response at a time into an :class:`UpstreamResponse`."""

    def __init__(self, live: set[_Conn], on_closed: Optional[Callable[[_Conn], None]] = None) -> None:
        self.live = live  # the client's open connections
        self.on_closed = on_closed  # called once, when the connection closes
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
        self._closing()
        if self.resp is not None:
            self.resp._eof()

    def _closing(self) -> None:
        self.closed = True
        self.live.discard(self)
        callback, self.on_closed = self.on_closed, None
        if callback is not None:
            callback(self)

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
        self._closing()
        if self.transport is not None:
            self.transport.close()


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


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
        # one timer that fails ``fut`` (cheaper than a timeout context, which cancels the task)
        timer = asyncio.get_running_loop().call_at(deadline, _expire, fut) if deadline is not None else None
        try:
            await fut
        except UpstreamError:
            raise
        except TimeoutError:
            raise Timeout(f"worker answer timed out: {message}", phase) from None
        finally:
            if timer is not None:
                timer.cancel()

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


_PERMIT = object()  # a waiter may open a new connection (its slot is counted already)
CONNECTS_PER_WORKER = 64  # connection attempts in flight to one worker at once


class UpstreamClient:
    """Keep-alive POSTs: ``resp = await client.post(url, body)``, then read and release.

    Limits in seconds; None, 0 or negative: no limit. ``max_per_worker``: connections
    open at once to one worker (None or 0: no cap). ``api_key``: sent as
    ``Authorization: Bearer`` with every request."""

    def __init__(self, timeout: Optional[float] = None, connect_timeout: Optional[float] = None,
                 keepalive: float = 3.0, user_agent: str = "eldr-router", *,
                 first_byte_timeout: Optional[float] = None,
                 idle_timeout: Optional[float] = None, max_per_worker: Optional[int] = None,
                 api_key: Optional[str] = None) -> None:
        self.timeout = _limit(timeout)
        self.connect_timeout = _limit(connect_timeout)
        self.first_byte_timeout = _limit(first_byte_timeout)
        self.idle_timeout = _limit(idle_timeout)
        self.keepalive = keepalive
        self.user_agent = user_agent
        self.max_per_worker = max_per_worker if max_per_worker and max_per_worker > 0 else None
        self._auth = b"Authorization: Bearer %s\r\n" % api_key.encode() if api_key else b""
        self._idle: dict[tuple, list[_Conn]] = {}  # oldest first
        self._live: set[_Conn] = set()
        self._count: dict[tuple, int] = {}  # connections per worker: open, in use or connecting
        self._connecting: dict[tuple, int] = {}  # connection attempts in flight per worker
        self._waiting: dict[tuple, collections.deque[asyncio.Future]] = {}
        self.queued = 0  # requests that waited for a connection
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

    @property
    def waiting(self) -> int:
        """Requests waiting now for a connection to a worker."""
        return sum(len(q) for q in self._waiting.values())

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

    # ------------------------------------------------------------ connection slots
    def _put(self, key: tuple, conn: _Conn) -> None:
        """A connection came free: to the first waiter, else into the idle pool."""
        queue = self._waiting.get(key)
        while queue:
            fut = queue.popleft()
            if not fut.done():
                fut.set_result(conn)
                return
        if self.keepalive <= 0:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(key, []).append(conn)
        if self._sweeper is None:
            self._arm_sweeper()

    def _closed(self, key: tuple, conn: _Conn) -> None:
        """A connection closed: its slot goes to the first waiter (to connect anew)."""
        self._count[key] = max(0, self._count.get(key, 1) - 1)
        self._wake(key)

    def _may_open(self, key: tuple) -> bool:
        return ((self.max_per_worker is None or self._count.get(key, 0) < self.max_per_worker)
                and self._connecting.get(key, 0) < CONNECTS_PER_WORKER)

    def _permit(self, key: tuple) -> object:
        self._count[key] = self._count.get(key, 0) + 1
        self._connecting[key] = self._connecting.get(key, 0) + 1
        return _PERMIT

    def _unpermit(self, key: tuple, connected: bool) -> None:
        """A permit's attempt ended (``connected``: the connection now holds the slot)."""
        self._connecting[key] = max(0, self._connecting.get(key, 1) - 1)
        if not connected:
            self._count[key] = max(0, self._count.get(key, 1) - 1)
        self._wake(key)

    def _wake(self, key: tuple) -> None:
        queue = self._waiting.get(key)
        while queue and self._may_open(key):
            fut = queue.popleft()
            if not fut.done():
                fut.set_result(self._permit(key))

    def _get(self, key: tuple) -> Optional[_Conn]:
        pool = self._idle.get(key)
        now = time.monotonic()
        while pool:
            conn = pool.pop()  # newest first: least likely closed by the server
            if not conn.closed and now - conn.idle_since < self.keepalive:
                return conn
            conn.close()
        return None

    def _take(self, key: tuple) -> object:
        """An idle connection, a permit to open one, or None (wait)."""
        conn = self._get(key)
        if conn is not None:
            return conn
        return self._permit(key) if self._may_open(key) else None

    def _give_back(self, key: tuple, got: object) -> None:
        """Return what a waiter got but will not use."""
        if got is _PERMIT:
            self._unpermit(key, connected=False)
        elif isinstance(got, _Conn) and not got.closed:
            self._put(key, got)

    async def _acquire(self, key: tuple, host: str, port: int, secure: bool,
                       deadline: Optional[float]) -> _Conn:
        while True:
            got = self._take(key)
            if got is None:  # every connection busy: queue (FIFO)
                fut = asyncio.get_running_loop().create_future()
                self._waiting.setdefault(key, collections.deque()).append(fut)
                self.queued += 1
                try:
                    async with asyncio.timeout_at(deadline):
                        got = await fut
                except TimeoutError:
                    raise Saturated(
                        f"all {self.max_per_worker} connections to {host}:{port} stayed busy",
                        f"all {self.max_per_worker} connections to the worker stayed busy "
                        "(the router's limit: --worker-max-connections)") from None
                except BaseException:
                    if fut.done() and not fut.cancelled():
                        self._give_back(key, fut.result())
                    raise
                finally:
                    queue = self._waiting.get(key)
                    if queue is not None and fut in queue:
                        queue.remove(fut)
            if got is _PERMIT:
                try:
                    conn = await self._connect(key, host, port, secure)
                except BaseException:
                    self._unpermit(key, connected=False)
                    raise
                self._unpermit(key, connected=True)
                return conn
            conn = got
            if not conn.closed and not conn.transport.is_closing():
                return conn

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

    async def _connect(self, key: tuple, host: str, port: int, secure: bool) -> _Conn:
        loop = asyncio.get_running_loop()
        if secure and self._ssl is None:
            self._ssl = ssl.create_default_context()
        conn = _Conn(self._live, lambda c: self._closed(key, c))
        start = loop.time()
        try:
            try:
                async with asyncio.timeout(self.connect_timeout):
                    await loop.create_connection(lambda: conn, host, port,
                                                 ssl=self._ssl if secure else None)
            except BaseException:
                # failed or cancelled, maybe after connection_made: the caller gives the
                # slot back (never also this connection's close), and a transport made
                # meanwhile is closed here (uvloop keeps it open otherwise)
                conn.on_closed = None
                conn.close()
                raise
        except TimeoutError:
            late = loop.time() - start - self.connect_timeout
            if late > self.connect_timeout / 2:  # the loop was busy: the router's own fault
                raise Saturated(f"connect to {host}:{port}: the router's event loop was "
                                f"{late:.1f} s late", "the router is overloaded (not the "
                                "worker's fault)") from None
            raise ConnectError(f"connect to {host}:{port} timed out",
                               "connection to the worker timed out") from None
        except OSError as e:
            if e.errno in LOCAL_ERRNOS:
                raise LocalResourceError(f"router's own limit reached (not the worker's fault) "
                                         f"connecting to {host}:{port}: {e}",
                                         "router out of file descriptors or memory (not the "
                                         "worker's fault)") from None
            raise ConnectError(f"cannot connect to {host}:{port}: {e}",
                               f"cannot connect to the worker ({os.strerror(e.errno) if e.errno else type(e).__name__})") from None
        return conn

    async def post(self, url: str, body: bytes, content_type: bytes = b"application/json",
                   timeout: Optional[float] = None, *, first_byte_timeout: Optional[float] = None,
                   idle_timeout: Optional[float] = None,
                   headers: Sequence[tuple[str, str]] = (),
                   on_sent: Optional[Callable[[], None]] = None) -> UpstreamResponse:
        """Send ``body``; returns once the status line and headers arrived. ``on_sent``
        is called once the request is written (the worker may have seen it).

        Each limit overrides the client's when not None (0 or negative: no limit)."""
        host, port, secure, path, netloc = self._target(url)
        key = (host, port, secure)
        total = _limit(timeout, self.timeout)
        deadline = asyncio.get_running_loop().time() + total if total else None
        conn = await self._acquire(key, host, port, secure, deadline)
        resp = UpstreamResponse(self, key, conn, deadline, total,
                                _limit(idle_timeout, self.idle_timeout))
        conn.resp = resp
        conn.parser = httptools.HttpResponseParser(conn)
        extra = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in headers)
        conn.transport.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: %s\r\n%s%s"
                             b"Content-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
                                 path.encode(), netloc.encode(), self.user_agent.encode(),
                                 self._auth, extra, content_type, len(body), body))
        if on_sent is not None:
            on_sent()
        await resp._start(_limit(first_byte_timeout, self.first_byte_timeout))
        return resp

    def close(self) -> None:
        """Close the idle connections and stop the sweeper (connections in use stay open)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for pool in self._idle.values():
            for conn in list(pool):
                conn.close()
        self._idle.clear()
