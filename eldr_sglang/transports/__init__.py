"""Signature transports: how a signature message travels from an engine to a router.

One registry by URL scheme. Each entry is a *transport*: a parser of its URLs (a
:class:`Destination`), a sender factory (the engine side) and a listener factory (the
router side). The built-in transports are ``http``/``https`` (:mod:`.http`: a ``POST``
per batch on a kept-alive connection) and ``tcp`` (:mod:`.tcp`: JSON lines on one
kept-open connection). The message, its framing and its HMAC are
:mod:`eldr_sglang.core.wire`'s; a transport only moves the bytes.

A **sender** (``sender_factory(dest, timeout, key)``) is blocking and used by one
thread at a time (the engine's publisher thread): ``send(batch)`` delivers a list of
messages (signed with ``key`` when set) or raises; it connects lazily and keeps its
connection open between sends; ``close()`` drops the connection (the next ``send``
reconnects); ``connects`` counts the connections it opened. :func:`deliver` is the one
retry rule every user shares: a kept-open connection the peer closed is reopened once.

A **listener** (``listener_factory(intake)``) feeds a router's signature intake
(:class:`~eldr_sglang.router.signals.intake.SignatureIntake`): stream transports hand it
each line (``await intake.line(line)``, or a ``SignatureStream(intake)`` protocol for an
asyncio stream server, which also applies the port's connection rules), request
transports its ``h_signature`` handler. ``await start(host, port)`` binds and returns
the port, ``address(host)`` is the URL an engine sends to (a router's return address),
``close()`` stops accepting, ``await wait_closed()`` waits until it has.

A new transport (a Unix socket, ZMQ) is one module in this package named after its
scheme (``eldr_sglang/transports/unix.py`` calling :func:`register_transport`): the
first URL with that scheme imports it. Code outside the package may also call
:func:`register_transport` itself. Nothing here imports aiohttp or sglang at import
time (listeners import the router's parts when they start).
"""

from eldr_sglang.transports.registry import (  # noqa: F401 (the package's API)
    RECONNECT, Destination, Listener, Sender, Transport, deliver, host_port, listener_for, parse,
    register_transport, scheme_of, schemes, sender_for, transport_for, unregister_transport, usage)
from eldr_sglang.transports import http as _http, tcp as _tcp  # noqa: E402,F401 (the built-in entries)

__all__ = ["Destination", "Sender", "Listener", "Transport", "register_transport", "unregister_transport",
           "transport_for", "scheme_of", "parse", "sender_for", "listener_for", "deliver", "schemes",
           "usage", "RECONNECT", "host_port"]
