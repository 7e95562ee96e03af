"""Signature intake: ``POST /eldr/signature`` and the TCP stream of ``--signature-port``.

Both validate each message (:func:`~eldr_sglang.core.wire.parse_message`,
then against the artifact's layers x experts when there is one) before it reaches
the board, refuse messages over ``signature_max_kb``, count every refusal and log
refusals at most once per ``LOG_EVERY`` seconds per kind (a misconfigured engine
must not flood the log). Bodies and lines of ``OFF_LOOP_BYTES`` or more are parsed
and validated in the parser process, off the event loop.

With a shared key (``--signature-key-file`` or ``ELDR_SIGNATURE_KEY``) a body or line
must carry its HMAC (:mod:`eldr_sglang.core.wire`): unsigned is refused (HTTP 401),
wrongly signed too (403), both counted in ``eldr_router_signature_auth_refused``,
before anything is parsed: a refused message never reaches the board or the online
window. Without a key, a signed body or line is taken as it is (its MAC unchecked).

Without a signature key but with the client API key (``--api-key``), the intake needs
that key: ``Authorization: Bearer <api key>`` on ``POST /eldr/signature``, or the
HMAC made with the API key as the signing key (HTTP header or TCP line prefix; the
engines' ``--eldr-signature-key-file`` holding the API key). With neither key the
intake is open to anyone who reaches it, and the router says so at start.

Every message must be fresh: its ``ts`` (stamped by the sender inside the MAC) within
``max_age`` seconds of this router's clock, and the first for its bootstrap room
(:class:`SeenRooms`); a replay or a stale message is refused and counted before it
reaches the board or the online window. With a key, a message without ``ts`` too.

The TCP stream (:class:`SignatureStream`) is bounded like the client port: at most
``max_streams`` connections (more are closed at once, so this port never takes the
file descriptors client connections need), an idle limit, a time limit on each line
once started, a byte cap per line and on all partial lines together; with a key, a
line whose start is not a MAC prefix is dropped as it arrives, never buffered.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import resource
import time
from typing import Any, Callable, Optional

import orjson
from aiohttp import web

from eldr_sglang.router.http.bodies import BodyError, BodyParser, read_body
from eldr_sglang.router.http.clients import bearer_matches
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.core import wire
from eldr_sglang.core.wire import parse_message, preparse
from eldr_sglang.router.signals.signatures import SignatureBoard, SignatureEncoder, SignatureError

logger = logging.getLogger("eldr_sglang.router")
LOG_EVERY = 10.0
OFF_LOOP_BYTES = 64 << 10  # signature bodies and lines this large are parsed off the loop
SEEN_ROOMS = 1 << 17  # bootstrap rooms remembered for replay detection (~13 MB)
STREAM_BUFFER_BYTES = 64 << 20  # partial lines buffered over all stream connections
_MAC_RE = re.compile(rb"sha256=[0-9a-fA-F]{64}")
_MAC_LEN = len(wire.MAC_PREFIX) + 64


class SeenRooms:
    """Bootstrap rooms of the messages taken in the last ``horizon`` seconds (at most
    ``cap``, the oldest forgotten first, counted in ``evicted``)."""

    def __init__(self, horizon: float, cap: int = SEEN_ROOMS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.horizon, self.cap, self.clock = horizon, cap, clock
        self.rooms: "collections.OrderedDict[int, float]" = collections.OrderedDict()
        self.evicted = 0

    def add(self, room: int) -> bool:
        """Remember ``room``; False when it was seen already (a replay)."""
        now, rooms = self.clock(), self.rooms
        while rooms:
            first, t = next(iter(rooms.items()))
            fresh = now - t < self.horizon
            if fresh and len(rooms) < self.cap:
                break
            rooms.popitem(last=False)
            self.evicted += fresh
        if room in rooms:
            return False
        rooms[room] = now
        return True


class RateLimitedLog:
    """``warn(kind, msg)`` logs at most once per ``every`` s per kind, with the count suppressed."""

    def __init__(self, every: float = LOG_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.clock = every, clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, kind: str, msg: str, *args: Any) -> bool:
        now = self.clock()
        if now - self._last.get(kind, -self.every) < self.every:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return False
        self._last[kind] = now
        n = self._suppressed.pop(kind, 0)
        logger.warning(msg + (f" ({n} more like it not logged)" if n else ""), *args)
        return True


class SignatureIntake:
    def __init__(self, board: SignatureBoard, metrics: RouterMetrics, max_bytes: int,
                 encoder: Callable[[], Optional[SignatureEncoder]],
                 buffering: Callable[[], bool],
                 observer: Optional[Callable[[dict], None]] = None,
                 parser: Optional[BodyParser] = None, body_timeout: Optional[float] = None,
                 key: Optional[bytes] = None, api_key: Optional[str] = None,
                 max_age: float = 60.0, max_streams: int = 256, stream_idle: Optional[float] = 300.0,
                 line_timeout: Optional[float] = 10.0,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.board, self.metrics, self.max_bytes = board, metrics, max_bytes
        self._delivered, self._unclaimed = (metrics.signatures.labels("delivered"),
                                            metrics.signatures.labels("unclaimed"))
        self.max_age, self.wall_clock = max_age, wall_clock
        # a replayed message passes the age check for at most 2 x max_age after the first
        self.seen = SeenRooms(2 * max_age)
        self.max_streams = min(max_streams, max(8, (_nofile() - 64) // 8))
        self.stream_idle, self.line_timeout = stream_idle, line_timeout
        self.partial_bytes = 0  # partial lines buffered by all stream connections
        # shared signing key: messages without its HMAC are refused; without one, the
        # client API key stands in (as a Bearer token on HTTP, or as the HMAC key)
        self.bearer = api_key if key is None and api_key else None
        self.key = key if key is not None else api_key.encode() if api_key else None
        self.parser = parser or BodyParser()
        self.body_timeout = body_timeout
        self.encoder = encoder  # the router's current encoder (it changes on reloads)
        self.buffering = buffering  # whether unclaimed messages are worth keeping
        self.observer = observer  # sees every well-formed message (online calibration)
        self.log = RateLimitedLog()
        self.streams: set[SignatureStream] = set()
        self.tasks: set[asyncio.Task] = set()  # the streams' line handlers
        self.server: Optional[asyncio.AbstractServer] = None
        self.port: Optional[int] = None

    # ------------------------------------------------------------ validation
    def refused(self, kind: str, detail: str, peer: Any = None, n: int = 1) -> None:
        self.metrics.signatures.labels("invalid").inc(n)
        self.metrics.errors.labels(f"signature_{kind}").inc(n)
        self.log.warn(kind, "signature message refused (%s) from %s: %s", kind, peer or "?", detail)

    def authentic(self, data: bytes, given: Optional[bytes | str], peer: Any = None) -> Optional[str]:
        """None if ``data`` may be parsed (no key, or its MAC checks), else why not
        ("unsigned" or "bad_mac"), counted and logged."""
        if self.key is None:
            return None
        reason = "unsigned" if given is None else None if wire.verify(self.key, data, given) else "bad_mac"
        if reason is not None:
            self.metrics.signature_auth_refused.labels(reason).inc()
            self.log.warn(f"auth_{reason}", "signature message refused (%s) from %s: %s", reason,
                          peer or "?", "no HMAC" if reason == "unsigned" else "HMAC does not match the key")
        return reason

    def fresh(self, msg: dict) -> None:
        """SignatureError unless ``msg`` is recent (its ``ts``) and the first for its room."""
        ts = msg.get(wire.TS_FIELD)
        if ts is None:
            if self.key is not None:
                raise SignatureError("unstamped", f"signed messages must carry '{wire.TS_FIELD}' "
                                     "(the sender's clock, inside the MAC)")
        else:
            skew = self.wall_clock() - ts
            if abs(skew) > self.max_age:
                raise SignatureError("stale", f"'{wire.TS_FIELD}' is {abs(skew):.0f} s "
                                     f"{'old' if skew > 0 else 'ahead'}; at most {self.max_age:g} s "
                                     "(--signature-max-age)")
        if not self.seen.add(msg["bootstrap_room"]):
            raise SignatureError("replay", f"a message for bootstrap room {msg['bootstrap_room']} "
                                 "was taken already (replayed)")

    def accept(self, data: Any, peer: Any = None) -> tuple[int, int, list[str]]:
        """Validate and deliver one message or a list; (delivered, buffered, errors)."""
        msgs = data if isinstance(data, list) else [data]
        delivered = buffered = 0
        errors = []
        enc = self.encoder()
        for m in msgs:
            if isinstance(m, wire.Malformed):
                errors.append(str(m))
                self.refused("malformed", str(m), peer)
                continue
            try:
                parse_message(m)
                self.fresh(m)
                if self.observer is not None:
                    self.observer(m)
                if enc is not None and m["bootstrap_room"] not in self.board.waiters:
                    enc.check(m)  # a waiting request gets it anyway: it falls back, with the reason
            except SignatureError as e:
                errors.append(str(e))
                self.refused(e.reason, str(e), peer)
                continue
            except ValueError as e:
                errors.append(str(e))
                self.refused("malformed", str(e), peer)
                continue
            if self.board.post(m, buffer=self.buffering()):
                delivered += 1
                self._delivered.inc()
            else:
                buffered += 1
                self._unclaimed.inc()
        return delivered, buffered, errors

    # ------------------------------------------------------------ HTTP
    async def h_signature(self, request: web.Request) -> web.Response:
        try:
            raw = await read_body(request, self.max_bytes, self.body_timeout)
        except BodyError as e:
            self.refused("too_large" if e.status == 413 else "body_timeout", str(e), request.remote)
            return _json({"error": f"signature body: {e}"}, e.status)
        if self.bearer is not None and bearer_matches(request, self.bearer):
            refused = None
        else:
            refused = self.authentic(raw, request.headers.get(wire.MAC_HEADER), request.remote)
        if refused == "unsigned":
            need = (f"{wire.MAC_HEADER} header missing" if self.bearer is None else
                    f"send 'Authorization: Bearer <api key>' or the {wire.MAC_HEADER} header")
            return _json({"error": f"signature messages must be signed: {need}"}, 401,
                         {"WWW-Authenticate": "Bearer"} if self.bearer else None)
        if refused is not None:
            return _json({"error": f"{wire.MAC_HEADER} does not match the body under this router's key"}, 403)
        try:
            data = await self.parser.run(preparse, raw, off_loop_bytes=OFF_LOOP_BYTES)
        except orjson.JSONDecodeError as e:
            self.refused("bad_json", str(e), request.remote)
            return _json({"error": f"invalid JSON body: {e}"}, 400)
        delivered, buffered, errors = self.accept(data, request.remote)
        out = {"accepted": delivered + buffered, "delivered": delivered,
               "buffered": buffered, "rejected": len(errors), "errors": errors[:10]}
        if errors and not (delivered + buffered):
            return _json({"error": errors[0], **out}, 400)
        return _json(out)

    # ------------------------------------------------------------ TCP stream
    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: SignatureStream(self), host, port)
        self.port = self.server.sockets[0].getsockname()[1]
        logger.info("signature stream on %s:%d (at most %d connections)", host, self.port,
                    self.max_streams)
        return self.port

    async def line(self, line: bytes, peer: Any) -> None:
        """One complete stream line: MAC, parse (off the loop when big), deliver."""
        given, body = wire.split_line(line)
        if not body or self.authentic(body, given, peer) is not None:
            return
        try:
            data = await self.parser.run(preparse, body, off_loop_bytes=OFF_LOOP_BYTES)
        except orjson.JSONDecodeError as e:
            self.refused("bad_json", str(e), peer)
            return
        self.accept(data, peer)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for s in list(self.streams):
                s.abort()
            for t in list(self.tasks):
                t.cancel()
            await self.server.wait_closed()


class SignatureStream(asyncio.Protocol):
    """One ``--signature-port`` connection: newline-delimited messages, nothing answered.

    A bad line is counted and logged (rate-limited); a line over the byte cap, a line
    not finished within ``line_timeout``, silence for ``stream_idle`` or partial lines
    over ``STREAM_BUFFER_BYTES`` on all connections close it. With a key, a line that
    does not start with a MAC prefix is counted at once and the rest of it dropped as
    it arrives (the connection stays). Complete lines are handled in order by one task;
    reading pauses while more than a line's cap of them wait."""

    def __init__(self, intake: SignatureIntake) -> None:
        self.intake = intake
        self.transport: Optional[asyncio.Transport] = None
        self.peer: Any = None
        self.buf = bytearray()  # the line so far (counted in intake.partial_bytes)
        self.checked = False  # this line's MAC prefix was looked at
        self.dropping = False  # the rest of a refused line is dropped as it arrives
        self.line_started = 0.0  # loop time of this line's first byte (0: none pending)
        self.last = 0.0  # loop time of the last bytes
        self.lines: collections.deque[bytes] = collections.deque()
        self.queued = 0  # bytes in self.lines
        self.paused = False
        self.wakeup: Optional[asyncio.Future] = None
        self.task: Optional[asyncio.Task] = None
        self.timer: Optional[asyncio.TimerHandle] = None
        self.closed = False

    # ------------------------------------------------------------ connection
    def connection_made(self, transport) -> None:
        it = self.intake
        self.peer = transport.get_extra_info("peername")
        if len(it.streams) >= it.max_streams:
            it.metrics.errors.labels("signature_streams_full").inc()
            it.log.warn("streams_full", "signature stream from %s refused: %d connections "
                        "open (--signature-max-streams)", self.peer, len(it.streams))
            transport.abort()
            return
        self.transport = transport
        it.streams.add(self)
        it.metrics.event("signature_streams")
        loop = asyncio.get_running_loop()
        self.last = loop.time()
        self.task = loop.create_task(self._consume())
        it.tasks.add(self.task)
        self.task.add_done_callback(it.tasks.discard)
        self._arm()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if self.transport is None:
            return  # refused at the door
        self.closed = True
        self.intake.streams.discard(self)
        self._clear()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._wake()  # the lines that came whole before the end are still handled

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self, kind: Optional[str] = None, detail: str = "") -> None:
        if kind is not None:
            self.intake.refused(kind, detail, self.peer)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    # ------------------------------------------------------------ timers
    def _arm(self) -> None:
        it = self.intake
        limits = [x for x in (it.stream_idle, it.line_timeout) if x]
        if limits:
            self.timer = asyncio.get_running_loop().call_later(min(limits), self._check)

    def _check(self) -> None:
        self.timer = None
        it, now = self.intake, asyncio.get_running_loop().time()
        if self.line_started and it.line_timeout and now - self.line_started >= it.line_timeout:
            self.abort("line_timeout", f"a line not finished within {it.line_timeout:g} s; closing")
            return
        if (it.stream_idle and now - self.last >= it.stream_idle and not self.lines
                and not self.line_started):
            it.metrics.event("signature_streams_idle_closed")
            self.abort()
            return
        self._arm()

    # ------------------------------------------------------------ reading
    def _clear(self) -> None:
        self.intake.partial_bytes -= len(self.buf)
        self.buf = bytearray()
        self.checked = self.dropping = False
        self.line_started = 0.0

    def _prefix(self) -> Optional[str]:
        """With a key: None while the line may be signed, else why not (looked at once
        the line has enough bytes for a MAC prefix, or is complete)."""
        head = bytes(self.buf[:_MAC_LEN + 16]).lstrip()
        if not head.startswith(wire.MAC_PREFIX[:len(head)]):
            return "unsigned"
        if len(head) < _MAC_LEN:
            return None
        self.checked = True
        return None if _MAC_RE.match(head) else "bad_mac"

    def data_received(self, data: bytes) -> None:
        it = self.intake
        self.last = asyncio.get_running_loop().time()
        start, n = 0, len(data)
        while start < n:
            nl = data.find(b"\n", start)
            end = n if nl < 0 else nl + 1
            if not self.line_started:
                self.line_started = self.last
            if not self.dropping:
                self.buf += data[start:end]
                it.partial_bytes += end - start
                if len(self.buf) > it.max_bytes:
                    self.abort("too_large", f"line over {it.max_bytes} bytes; closing")
                    return
                if it.partial_bytes > STREAM_BUFFER_BYTES:
                    self.abort("stream_buffer", f"partial lines of all streams over "
                               f"{STREAM_BUFFER_BYTES} bytes; closing the one adding to them")
                    return
                if it.key is not None and not self.checked and not self.buf.isspace():
                    why = self._prefix()
                    if why is not None:  # counted once, dropped as it comes
                        it.metrics.signature_auth_refused.labels(why).inc()
                        it.log.warn(f"auth_{why}", "signature message refused (%s) from %s: %s", why,
                                    self.peer, "no HMAC" if why == "unsigned" else "malformed HMAC prefix")
                        started = self.line_started
                        self._clear()
                        self.dropping, self.line_started = True, started  # still timed
            start = end
            if nl >= 0:  # the line is complete
                line = bytes(self.buf)
                self._clear()
                if line and not line.isspace():
                    self.lines.append(line)
                    self.queued += len(line)
                    self._wake()
        if self.queued > it.max_bytes and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _wake(self) -> None:
        w, self.wakeup = self.wakeup, None
        if w is not None and not w.done():
            w.set_result(None)

    async def _consume(self) -> None:
        handled = 0
        while True:
            handled += 1
            if handled % 16 == 0:
                await asyncio.sleep(0)  # small lines are handled without a pause: let others run
            if not self.lines:
                if self.closed:
                    return
                self.wakeup = asyncio.get_running_loop().create_future()
                await self.wakeup
                continue
            line = self.lines.popleft()
            self.queued -= len(line)
            try:
                await self.intake.line(line, self.peer)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bad line must not end the stream's task silently
                logger.exception("signature stream line from %s", self.peer)
            self.last = asyncio.get_running_loop().time()
            if self.paused and self.queued <= self.intake.max_bytes // 2:
                self.paused = False
                if not self.closed:
                    self.transport.resume_reading()


def _nofile() -> int:
    try:
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return 1024


def _json(obj: Any, status: int = 200, headers: Optional[dict] = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json",
                        headers=headers)
