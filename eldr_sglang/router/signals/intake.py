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

A refused message that passed authentication (its MAC checks, or no key is set) names
its room truthfully: a request waiting for that room is woken at once and falls back
with the reason (``stale``, ``unstamped``), instead of waiting out its signature
timeout. A message whose MAC fails is never trusted to name a room: its request keeps
waiting. Refusals are kept for operators (:class:`~.intake_state.IntakeHealth`:
``/eldr/status`` ``signature_intake``, the ``eldr`` field of ``/ready``).

The TCP stream (:mod:`~.stream`) is bounded like the client port: at most
``max_streams`` connections (so this port never takes the file descriptors client
connections need), an idle limit, a time limit on each line once started, a byte cap
per line and on all partial lines together; with a key, a line whose start is not a
MAC prefix is dropped as it arrives, never buffered. Connections that have not proven
themselves (a valid MAC) give way to newcomers and to proven connections' lines, and
are closed after ``auth_grace`` seconds (``stream.AUTH_GRACE_S``).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any, Callable, Optional

import orjson
from aiohttp import web

from eldr_sglang import transports
from eldr_sglang.router.http.bodies import BodyError, BodyParser, read_body
from eldr_sglang.router.http.clients import bearer_matches
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.core import wire
from eldr_sglang.core.wire import parse_message, preparse
from eldr_sglang.router.signals.intake_state import IntakeHealth, SeenRooms
from eldr_sglang.router.signals.signatures import SignatureBoard, SignatureEncoder, SignatureError
from eldr_sglang.router.signals.stream import AUTH_GRACE_S, SignatureStream, StreamGate

logger = logging.getLogger("eldr_sglang.router")
LOG_EVERY = 10.0
OFF_LOOP_BYTES = 64 << 10  # signature bodies and lines this large are parsed off the loop
STREAM_BUFFER_BYTES = 64 << 20  # partial lines buffered over all stream connections


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
                 line_timeout: Optional[float] = 10.0, auth_grace: Optional[float] = AUTH_GRACE_S,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.board, self.metrics, self.max_bytes = board, metrics, max_bytes
        self._delivered, self._unclaimed = (metrics.signatures.labels("delivered"),
                                            metrics.signatures.labels("unclaimed"))
        self.max_age, self.wall_clock = max_age, wall_clock
        # a room is remembered while its message could pass the age check, on the same clock
        self.seen = SeenRooms(max_age, clock=lambda: self.wall_clock())
        self.health = IntakeHealth(max_age)
        self.stream_idle, self.line_timeout = stream_idle, line_timeout
        self.gate = StreamGate(self, min(max_streams, max(8, (_nofile() - 64) // 8)), auth_grace)
        self.partial_bytes = 0  # partial lines buffered by all stream connections
        self.buffer_budget = STREAM_BUFFER_BYTES
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
        self.tasks: set[asyncio.Task] = set()  # the streams' line handlers
        self.listener: Optional[transports.Listener] = None  # the --signature-port listener
        self.port: Optional[int] = None

    @property
    def streams(self) -> set[SignatureStream]:
        return self.gate.streams

    @property
    def max_streams(self) -> int:
        return self.gate.max_streams

    def describe(self) -> dict:
        """``/eldr/status`` ``signature_intake``: refusals, woken requests, skew, streams, rooms."""
        return {**self.health.describe(), "streams": self.gate.describe(),
                "partial_bytes": self.partial_bytes, "replay_rooms": self.seen.describe()}

    # ------------------------------------------------------------ validation
    def refused(self, kind: str, detail: str, peer: Any = None, n: int = 1,
                skew: Optional[float] = None, count_error: bool = True) -> None:
        self.metrics.signatures.labels("invalid").inc(n)
        if count_error:
            self.metrics.errors.labels(f"signature_{kind}").inc(n)
        self.health.note(kind, n, skew)
        self.log.warn(kind, "signature message refused (%s) from %s: %s", kind, peer or "?", detail)

    def auth_refused(self, reason: str, peer: Any, detail: str) -> None:
        self.metrics.signature_auth_refused.labels(reason).inc()
        self.health.note(reason)
        self.log.warn(f"auth_{reason}", "signature message refused (%s) from %s: %s", reason,
                      peer or "?", detail)

    def authentic(self, data: bytes, given: Optional[bytes | str], peer: Any = None) -> Optional[str]:
        """None if ``data`` may be parsed (no key, or its MAC checks), else why not
        ("unsigned" or "bad_mac"), counted and logged."""
        if self.key is None:
            return None
        reason = "unsigned" if given is None else None if wire.verify(self.key, data, given) else "bad_mac"
        if reason is not None:
            self.auth_refused(reason, peer, "no HMAC" if reason == "unsigned" else
                              "HMAC does not match the key")
        return reason

    def fresh(self, msg: dict) -> None:
        """SignatureError unless ``msg`` is recent (its ``ts``) and the first for its room."""
        ts = msg.get(wire.TS_FIELD)
        if ts is None:
            if self.key is not None:
                raise SignatureError("unstamped", f"signed messages must carry '{wire.TS_FIELD}' "
                                     "(the sender's clock, inside the MAC)")
        else:
            skew = ts - self.wall_clock()  # the sender's clock minus this router's
            if abs(skew) > self.max_age:
                e = SignatureError("stale", f"{IntakeHealth.skew_words(skew)}: '{wire.TS_FIELD}' "
                                   f"is {abs(skew):.0f} s {'ahead' if skew > 0 else 'old'}; at most "
                                   f"{self.max_age:g} s (--signature-max-age); sync the clocks (NTP)")
                e.skew = skew
                raise e
        if not self.seen.add(msg["bootstrap_room"], ts):
            raise SignatureError("replay", f"a message for bootstrap room {msg['bootstrap_room']} "
                                 "was taken already (replayed)")

    def _wake(self, msg: dict, e: SignatureError, enc: Any) -> bool:
        """Wake the request waiting for the room of an authenticated but refused message
        (it falls back at once, with the reason; replays never: their room's message was
        taken already). True when the dispatch counts the refusal (a waiter woken while an
        encoder is live), so the intake does not count it twice."""
        if e.reason == "replay" or not self.board.refuse(msg["bootstrap_room"], e.reason, str(e),
                                                         msg.get("layers")):
            return False
        self.health.woken[e.reason] += 1
        return enc is not None  # the dispatch counts errors{signature_<reason>} for it

    def accept(self, data: Any, peer: Any = None) -> tuple[int, int, list[str]]:
        """Validate and deliver one message or a list (authenticated already); (delivered,
        buffered, errors)."""
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
                counted = self._wake(m, e, enc)
                self.refused(e.reason, str(e), peer, skew=getattr(e, "skew", None), count_error=not counted)
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

    # ------------------------------------------------------------ --signature-port listener
    async def start(self, host: str, port: int, scheme: str = "tcp") -> int:
        """Listen on ``host:port`` with ``scheme``'s listener (:mod:`eldr_sglang.transports`;
        the ``tcp`` one serves :class:`SignatureStream` connections); its port."""
        self.listener = transports.listener_for(scheme, self)
        self.port = await self.listener.start(host, port)
        logger.info("signature %s listener on %s:%d (at most %d stream connections)", scheme, host,
                    self.port, self.max_streams)
        return self.port

    def address(self, host: str) -> Optional[str]:
        """The URL engines send signatures to (reaching this router as ``host``); None
        before :meth:`start`."""
        return self.listener.address(host) if self.listener is not None else None

    async def line(self, line: bytes, stream: Optional[SignatureStream] = None) -> None:
        """One complete stream line: MAC, parse (off the loop when big), deliver. A line
        whose MAC checks (without a key: one taken) proves its connection."""
        peer = stream.peer if stream is not None else None
        given, body = wire.split_line(line)
        if not body or self.authentic(body, given, peer) is not None:
            return
        if stream is not None and self.key is not None:
            stream.prove()
        try:
            data = await self.parser.run(preparse, body, off_loop_bytes=OFF_LOOP_BYTES)
        except orjson.JSONDecodeError as e:
            self.refused("bad_json", str(e), peer)
            return
        delivered, buffered, _ = self.accept(data, peer)
        if stream is not None and delivered + buffered:
            stream.prove()

    async def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            for s in list(self.streams):
                s.abort()
            for t in list(self.tasks):
                t.cancel()
            await self.listener.wait_closed()


def _nofile() -> int:
    try:
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return 1024


def _json(obj: Any, status: int = 200, headers: Optional[dict] = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json",
                        headers=headers)
