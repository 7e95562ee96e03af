"""Send signature messages to routers from a daemon thread.

The scheduler only does ``queue.put_nowait`` (microseconds); the thread
sends whatever is queued (counts packed as base64 arrays) over one kept-open
connection per destination:

* ``http://router:8000/eldr/signature``: one ``POST`` (a JSON list) per batch;
* ``tcp://router:PORT`` (the router's ``--signature-port``): newline-delimited
  JSON, no answers -- the cheapest hop for the router, which waits for it.

A request's destination is the return address its router put in
``custom_params[RETURN_ADDRESS_KEY]``, else the configured ``--eldr-publish``
address, so several routers can share prefill servers.

A router that is down costs dropped messages (counted, logged once a minute
per destination), never a blocked scheduler: the router then falls back to
least-loaded routing for those requests. A send that failed after ``t``
seconds (a silent host: the timeout) skips its destination for ``20 t``, so a
dead router delays the others' messages by at most ~5% of the time.

With a shared key (``--eldr-signature-key-file`` or ``ELDR_SIGNATURE_KEY``) every
HTTP body and TCP line carries its HMAC. A request's destination outside
``--eldr-publish-allow`` (:mod:`~eldr_sglang.patches.publish_allow`) is never
connected to: its message goes to the default address instead (or is dropped),
counted in ``refused_destinations`` and logged once per destination.

The message and its framing are :mod:`eldr_sglang.core.wire`'s; how it travels is the
destination scheme's transport (:mod:`eldr_sglang.transports`: its sender, and the one
reconnect rule). Imports neither SGLang nor torch.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import replace

from eldr_sglang import transports
from eldr_sglang.core import wire
from eldr_sglang.core.wire import RETURN_ADDRESS_KEY  # noqa: F401 (where a request's router wants it)
from eldr_sglang.patches.publish_allow import DestinationAllowList

logger = logging.getLogger("eldr_sglang.publish")

MAX_DESTINATIONS = 32  # kept-open connections besides the default one (least recently used closed first)
MAX_REFUSED_LOGGED = 1024  # refused destinations remembered (each logged once)
_BACKOFF = 20  # a send failing after t seconds skips its destination for _BACKOFF * t
_LOG_EVERY = 60.0


def parse_destination(url: str) -> transports.Destination:
    """``url``'s :class:`~eldr_sglang.transports.Destination` (any registered transport:
    ``tcp://host:port``, ``http(s)://host[:port]/path``, ...); ValueError naming the URL otherwise."""
    try:
        return transports.parse(url)
    except ValueError as e:
        raise ValueError(f"publish URL: {e}") from None


class _Endpoint:
    """One destination and its sender, which keeps its connection open (touched by the
    sender thread only)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.dest = parse_destination(url)
        self.host = self.given_host = self.dest.host  # host: as allowed, given_host: as named
        self.sender: transports.Sender | None = None  # made at the first send, to self.host
        self.retry_at = 0.0  # skipped (messages dropped) until then, after a slow failure
        self.last_log = 0.0

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class SignaturePublisher:
    """Delivers ``submit``-ted messages to each one's destination (or the default ``url``)."""

    def __init__(self, url: str | None = None, timeout: float = 2.0, max_batch: int = 64,
                 max_queue: int = 10_000, max_destinations: int = MAX_DESTINATIONS,
                 key: bytes | None = None, allow: DestinationAllowList | None = None) -> None:
        if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(f"--eldr-publish-timeout must be a positive number of seconds, got {timeout!r}")
        self.url = url
        self._default = _Endpoint(url) if url else None  # ValueError for a bad URL
        self.key = key  # signs every body / line (HMAC-SHA256) when set
        self.allow = allow or DestinationAllowList(None)
        self.refused_destinations = 0  # messages whose destination the allow-list refused
        self._refused_logged: set[str] = set()
        self._endpoints: OrderedDict[str, _Endpoint] = OrderedDict()  # per-request destinations, LRU order
        self.max_destinations = max_destinations
        self.timeout = timeout
        self.max_batch = max_batch
        self.queue: queue.Queue[tuple[dict, str | None]] = queue.Queue(max_queue)
        self.connections = 0  # connections opened (stays 1 per destination while its router keeps it open)
        self.sent = 0
        self.dropped = 0
        self.errors = 0
        self.invalid_destinations = 0  # messages whose destination was malformed (sent to the default)
        self._last_invalid_log = 0.0
        self._thread = threading.Thread(target=self._run, name="eldr-publisher", daemon=True)
        self._thread.start()

    def submit(self, message: dict, dest: str | None = None) -> None:
        """Queue ``message`` for ``dest`` (None: the default address); never blocks (full: dropped)."""
        try:
            self.queue.put_nowait((message, dest))
        except queue.Full:
            self.dropped += 1

    @property
    def destinations(self) -> list[str]:
        """Per-request destinations held, least recently used first."""
        return list(self._endpoints)

    def _run(self) -> None:
        while True:
            items = [self.queue.get()]
            while len(items) < self.max_batch:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            batches: dict[_Endpoint | None, list[dict]] = {}
            for message, dest in items:
                batches.setdefault(self._endpoint(dest), []).append(message)
            for ep, batch in batches.items():
                if ep is None:
                    self.dropped += len(batch)  # no valid destination and no default address
                    continue
                self._post(ep, batch)
                if ep is not self._default and self._endpoints.get(ep.url) is not ep:
                    ep.close()  # evicted meanwhile (more destinations than max_destinations in one batch)

    def _endpoint(self, dest: str | None) -> _Endpoint | None:
        """The endpoint for ``dest``: held (most recently used now), new (validated once), or the default."""
        if dest is None or dest == self.url:
            return self._default
        ep = self._endpoints.get(dest)
        if ep is not None:
            if self.allow.canonical(ep.given_host) != ep.host:  # a listed name re-resolved elsewhere
                del self._endpoints[dest]
                ep.close()
                return self._refuse(dest)
            self._endpoints.move_to_end(dest)
            return ep
        try:
            ep = _Endpoint(dest)
            host = self.allow.canonical(ep.host)
            if host is None:
                return self._refuse(dest)
            ep.host = host  # connected to as checked ("localhost." as "localhost")
        except ValueError:
            self.invalid_destinations += 1
            now = time.monotonic()
            if now - self._last_invalid_log > _LOG_EVERY:
                self._last_invalid_log = now
                logger.warning("eldr-sglang: invalid signature return address %r; sending to %s instead",
                               dest, self.url or "nowhere (dropped)")
            return self._default
        self._endpoints[dest] = ep
        if len(self._endpoints) > self.max_destinations:
            self._endpoints.popitem(last=False)[1].close()
        return ep

    def _refuse(self, dest: str) -> _Endpoint | None:
        self.refused_destinations += 1
        if dest not in self._refused_logged and len(self._refused_logged) < MAX_REFUSED_LOGGED:
            self._refused_logged.add(dest)
            logger.warning("eldr-sglang: signature return address %r is outside --eldr-publish-allow (%s); "
                           "not connecting, sending to %s instead", dest, self.allow.describe(),
                           self.url or "nowhere (dropped)")
        return self._default

    def _post(self, ep: _Endpoint, batch: list[dict]) -> None:
        t0 = time.monotonic()
        if t0 < ep.retry_at:
            self.dropped += len(batch)
            return
        if ep.sender is None:
            ep.sender = transports.sender_for(replace(ep.dest, host=ep.host), self.timeout, self.key)
        connects = ep.sender.connects
        try:
            transports.deliver(ep.sender, batch)  # a connection the router closed: one retry
            self.sent += len(batch)
        except Exception as exc:
            ep.close()
            self.errors += 1
            self.dropped += len(batch)
            now = time.monotonic()
            ep.retry_at = now + _BACKOFF * (now - t0)
            if now - ep.last_log > _LOG_EVERY:
                ep.last_log = now
                logger.warning("eldr-sglang: could not publish %d signature(s) to %s: %s",
                               len(batch), ep.url, exc)
        finally:
            self.connections += ep.sender.connects - connects


def publisher_for(config) -> SignaturePublisher:
    """The publisher an :class:`~eldr_sglang.patches.flags.EngineConfig` describes (its
    key, allow-list and default address), saying at start what it may connect to."""
    from eldr_sglang.patches.flags import REQUEST_ONLY

    default = None if config.publish == REQUEST_ONLY else config.publish
    always = [parse_destination(default).host] if default else []
    if config.publish_allow is not None:
        allow = DestinationAllowList(config.publish_allow, always)
    elif default is None:
        allow = DestinationAllowList.local()
        logger.warning("eldr-sglang: --eldr-publish request without --eldr-publish-allow: signatures go only "
                       "to routers on this machine (%s); name the routers' hosts or CIDRs with "
                       "--eldr-publish-allow", allow.describe())
    else:
        allow = DestinationAllowList(None)
        logger.warning("eldr-sglang: no --eldr-publish-allow: a request's signature return address may name "
                       "any host (a client reaching this server directly can make it connect anywhere); "
                       "set --eldr-publish-allow to the routers' hosts or CIDRs")
    key = wire.load_key(config.signature_key_file, "--eldr-signature-key-file")
    if key is None:
        logger.info("eldr-sglang: signature messages are not signed (no --eldr-signature-key-file or %s)",
                    wire.KEY_ENV)
    return SignaturePublisher(default, timeout=config.publish_timeout, key=key, allow=allow)
