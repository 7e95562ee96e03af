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
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

import orjson
from aiohttp import web

from eldr_sglang.router.bodies import BodyError, BodyParser, read_body
from eldr_sglang.router.clients import bearer_matches
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.core import wire
from eldr_sglang.core.wire import parse_message, preparse
from eldr_sglang.router.signatures import SignatureBoard, SignatureEncoder, SignatureError

logger = logging.getLogger("eldr_sglang.router")
LOG_EVERY = 10.0


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
                 key: Optional[bytes] = None, api_key: Optional[str] = None) -> None:
        self.board, self.metrics, self.max_bytes = board, metrics, max_bytes
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
        self.streams: set[asyncio.StreamWriter] = set()
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
                self.metrics.signatures.labels("delivered").inc()
            else:
                buffered += 1
                self.metrics.signatures.labels("unclaimed").inc()
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
            data = await self.parser.run(preparse, raw)
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
        self.server = await asyncio.start_server(self.stream, host, port, limit=self.max_bytes)
        self.port = self.server.sockets[0].getsockname()[1]
        logger.info("signature stream on %s:%d", host, self.port)
        return self.port

    async def stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Newline-delimited JSON messages on a kept-open connection; nothing is answered.
        A bad line is counted and logged (rate-limited); a line over the limit closes
        the connection (the rest of that line cannot be framed)."""
        peer = writer.get_extra_info("peername")
        self.streams.add(writer)
        self.metrics.event("signature_streams")
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # longer than the limit
                    self.refused("too_large", f"line over {self.max_bytes} bytes; closing", peer)
                    break
                if not line:
                    break
                if line.isspace():
                    continue
                given, line = wire.split_line(line)
                if self.authentic(line, given, peer) is not None:
                    continue
                try:
                    data = await self.parser.run(preparse, line)
                except orjson.JSONDecodeError as e:
                    self.refused("bad_json", str(e), peer)
                    continue
                self.accept(data, peer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.streams.discard(writer)
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for w in list(self.streams):
                w.close()
            await self.server.wait_closed()


def _json(obj: Any, status: int = 200, headers: Optional[dict] = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json",
                        headers=headers)
