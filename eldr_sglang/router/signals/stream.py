"""One ``--signature-port`` connection (:class:`SignatureStream`) and the rules that keep
the port for engines (:class:`StreamGate`).

A connection is *proven* once it sent a line whose MAC checks (without a key: a line
the intake took). Until then it holds a slot and buffer on credit:

* it is closed ``AUTH_GRACE_S`` seconds after connecting, however busy it keeps itself;
* a host holds at most ``UNPROVEN_PER_HOST`` unproven connections, and when all
  ``max_streams`` slots are taken a new connection closes the oldest unproven one (of
  its host first), so an engine that reconnects always gets in; proven connections are
  never closed for a newcomer (with every slot proven, the newcomer is);
* when partial lines over all connections pass the budget, unproven connections with
  partial lines are closed, oldest first (the one adding to them included); a proven
  connection is closed only when the proven ones alone pass it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
from typing import Any, Optional

from eldr_sglang.core import wire

logger = logging.getLogger("eldr_sglang.router")
UNPROVEN_PER_HOST = 64  # unproven connections one host may hold
AUTH_GRACE_S = 5.0  # seconds a connection has to send a line whose MAC checks
MAC_RE = re.compile(rb"sha256=[0-9a-fA-F]{64}")
MAC_LEN = len(wire.MAC_PREFIX) + 64


class StreamGate:
    """The open connections, the unproven ones in connecting order, per host."""

    def __init__(self, intake: Any, max_streams: int, grace: Optional[float]) -> None:
        self.intake, self.max_streams, self.grace = intake, max_streams, grace
        self.streams: set[SignatureStream] = set()
        self.unproven: "collections.OrderedDict[SignatureStream, None]" = collections.OrderedDict()
        self.by_host: collections.Counter[Any] = collections.Counter()
        self.closed = collections.Counter()  # why connections were closed by these rules

    def _oldest(self, host: Any = None) -> Optional["SignatureStream"]:
        return next((s for s in self.unproven if host is None or s.host == host), None)

    def admit(self, s: "SignatureStream") -> bool:
        """Take ``s`` (closing an unproven one to make room), or False: refuse it."""
        it = self.intake
        victim = None
        if self.by_host[s.host] >= UNPROVEN_PER_HOST:
            victim = self._oldest(s.host)
        elif len(self.streams) >= self.max_streams:
            victim = self._oldest()
            if victim is None:  # every slot proven: the newcomer waits for one to close
                it.metrics.errors.labels("signature_streams_full").inc()
                it.log.warn("streams_full", "signature stream from %s refused: %d proven connections "
                            "open (--signature-max-streams)", s.peer, len(self.streams))
                return False
        if victim is not None:
            it.metrics.errors.labels("signature_streams_full").inc()
            it.metrics.event("signature_streams_evicted")
            it.log.warn("streams_evict", "signature stream from %s closed for a newcomer: it never "
                        "sent a valid MAC (%d connections open, %d of %s unproven)", victim.peer,
                        len(self.streams), self.by_host[victim.host], victim.host)
            self.closed["evicted"] += 1
            victim.drop()
        self.streams.add(s)
        self.unproven[s] = None
        self.by_host[s.host] += 1
        return True

    def prove(self, s: "SignatureStream") -> None:
        if self.unproven.pop(s, 0) is None:
            self._uncount(s.host)

    def _uncount(self, host: Any) -> None:
        self.by_host[host] -= 1
        if self.by_host[host] <= 0:
            del self.by_host[host]

    def forget(self, s: "SignatureStream") -> None:
        self.streams.discard(s)
        if self.unproven.pop(s, 0) is None:
            self._uncount(s.host)

    def make_room(self, adder: "SignatureStream") -> bool:
        """Partial lines over the budget: close unproven holders, oldest first; False
        when ``adder`` itself was closed."""
        it = self.intake
        for s in [s for s in self.unproven if s.buf]:
            if it.partial_bytes <= it.buffer_budget:
                break
            self.closed["buffer"] += 1
            s.drop("stream_buffer", f"partial lines of all streams over {it.buffer_budget} bytes; "
                   "closing the oldest connection that never sent a valid MAC")
            if s is adder:
                return False
        if it.partial_bytes > it.buffer_budget:  # the proven ones alone
            adder.drop("stream_buffer", f"partial lines of all streams over {it.buffer_budget} "
                       "bytes; closing the one adding to them")
            return False
        return True

    def describe(self) -> dict:
        return {"open": len(self.streams), "proven": len(self.streams) - len(self.unproven),
                "unproven": len(self.unproven), "closed": dict(self.closed),
                "max": self.max_streams, "auth_grace_s": self.grace}


class SignatureStream(asyncio.Protocol):
    """One ``--signature-port`` connection: newline-delimited messages, nothing answered.

    A bad line is counted and logged (rate-limited); a line over the byte cap, a line
    not finished within ``line_timeout``, silence for ``stream_idle``, no valid MAC
    within the grace or the gate's rules close it. With a key, a line that does not
    start with a MAC prefix is counted at once and the rest of it dropped as it arrives
    (the connection stays). Complete lines are handled in order by one task; reading
    pauses while more than a line's cap of them wait."""

    def __init__(self, intake: Any) -> None:
        self.intake = intake
        self.transport: Optional[asyncio.Transport] = None
        self.peer: Any = None
        self.host: Any = None
        self.proven = False
        self.opened = 0.0
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
        self.host = self.peer[0] if isinstance(self.peer, tuple) else self.peer
        if not it.gate.admit(self):
            transport.abort()
            return
        self.transport = transport
        it.metrics.event("signature_streams")
        self.last = self.opened = asyncio.get_running_loop().time()
        self._arm()

    def _start_consumer(self) -> None:
        """The line handler, started with the first complete line (most connections that
        never prove themselves never send one)."""
        it = self.intake
        self.task = asyncio.get_running_loop().create_task(self._consume())
        it.tasks.add(self.task)
        self.task.add_done_callback(it.tasks.discard)

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if self.transport is None:
            return  # refused at the door
        self._forget()
        self._wake()  # the lines that came whole before the end are still handled

    def _forget(self) -> None:
        self.closed = True
        self.intake.gate.forget(self)
        self._clear()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def prove(self) -> None:
        if not self.proven and not self.closed:
            self.proven = True
            self.intake.gate.prove(self)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def drop(self, kind: Optional[str] = None, detail: str = "") -> None:
        """Close now, its slot and partial line given back at once."""
        self.abort(kind, detail)
        if self.transport is not None and not self.closed:
            self._forget()
            self._wake()

    def abort(self, kind: Optional[str] = None, detail: str = "") -> None:
        if kind is not None:
            self.intake.refused(kind, detail, self.peer)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    # ------------------------------------------------------------ timers
    def _arm(self) -> None:
        it, grace = self.intake, self.intake.gate.grace
        limits = [x for x in (it.stream_idle, it.line_timeout, None if self.proven else grace) if x]
        if limits:
            self.timer = asyncio.get_running_loop().call_later(min(limits), self._check)

    def _check(self) -> None:
        self.timer = None
        it, now, grace = self.intake, asyncio.get_running_loop().time(), self.intake.gate.grace
        if self.line_started and it.line_timeout and now - self.line_started >= it.line_timeout:
            self.drop("line_timeout", f"a line not finished within {it.line_timeout:g} s; closing")
            return
        if not self.proven and grace and now - self.opened >= grace:
            it.gate.closed["grace"] += 1
            self.drop("unproven", f"no valid MAC within {grace:g} s of connecting; closing")
            return
        if (it.stream_idle and now - self.last >= it.stream_idle and not self.lines
                and not self.line_started):
            it.metrics.event("signature_streams_idle_closed")
            self.drop()
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
        head = bytes(self.buf[:MAC_LEN + 16]).lstrip()
        if not head.startswith(wire.MAC_PREFIX[:len(head)]):
            return "unsigned"
        if len(head) < MAC_LEN:
            return None
        self.checked = True
        return None if MAC_RE.match(head) else "bad_mac"

    def data_received(self, data: bytes) -> None:
        it = self.intake
        if self.closed:
            return
        self.last = asyncio.get_running_loop().time()
        start, n = 0, len(data)
        while start < n:
            nl = data.find(b"\n", start)
            end = n if nl < 0 else nl + 1
            if not self.line_started:
                self.line_started = self.last
            if not self.dropping and not self._take(data, start, end):
                return
            start = end
            if nl >= 0:  # the line is complete
                line = bytes(self.buf)
                self._clear()
                if line and not line.isspace():
                    self.lines.append(line)
                    self.queued += len(line)
                    if self.task is None:
                        self._start_consumer()
                    self._wake()
        if self.queued > it.max_bytes and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _take(self, data: bytes, start: int, end: int) -> bool:
        """Buffer ``data[start:end]`` of the current line; False when this closed the connection."""
        it = self.intake
        self.buf += data[start:end]
        it.partial_bytes += end - start
        if len(self.buf) > it.max_bytes:
            self.drop("too_large", f"line over {it.max_bytes} bytes; closing")
            return False
        if it.partial_bytes > it.buffer_budget and not it.gate.make_room(self):
            return False
        if it.key is not None and not self.checked and not self.buf.isspace():
            why = self._prefix()
            if why is not None:  # counted once, dropped as it comes
                it.auth_refused(why, self.peer, "no HMAC" if why == "unsigned" else "malformed HMAC prefix")
                started = self.line_started
                self._clear()
                self.dropping, self.line_started = True, started  # still timed
        return True

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
                await self.intake.line(line, self)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bad line must not end the stream's task silently
                logger.exception("signature stream line from %s", self.peer)
            self.last = asyncio.get_running_loop().time()
            if self.paused and self.queued <= self.intake.max_bytes // 2:
                self.paused = False
                if not self.closed:
                    self.transport.resume_reading()
