"""The transport registry by URL scheme (:mod:`eldr_sglang.transports` describes it)."""

from __future__ import annotations

import importlib
import re
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

__all__ = ["Destination", "Sender", "Listener", "Transport", "register_transport", "unregister_transport",
           "transport_for", "scheme_of", "parse", "sender_for", "listener_for", "deliver", "schemes",
           "usage", "RECONNECT"]

# A kept-open connection the peer closed while idle: reopened once (http.client's
# RemoteDisconnected is a ConnectionResetError).
RECONNECT = (BrokenPipeError, ConnectionResetError)
PACKAGE = "eldr_sglang.transports"  # where a scheme's module is looked for
_SCHEME_RE = re.compile(r"[a-z][a-z0-9]*\Z")


@dataclass(frozen=True)
class Destination:
    """A parsed signature address: ``url`` as given, its transport's ``scheme``, and
    ``host``/``port``/``path`` as that transport reads them."""

    url: str
    scheme: str
    host: str
    port: int
    path: str = ""


class Sender(Protocol):
    connects: int

    def send(self, batch: list[dict]) -> None: ...

    def close(self) -> None: ...


class Listener(Protocol):
    port: Optional[int]

    async def start(self, host: str, port: int) -> int: ...

    def address(self, host: str) -> str: ...

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


def host_port(url: str, parts: urllib.parse.SplitResult) -> Destination:
    """The default parser: ``scheme://host:port`` (both required)."""
    if not parts.hostname or not parts.port:
        raise ValueError("no host or no port")
    return Destination(url, parts.scheme, parts.hostname, parts.port, parts.path)


@dataclass(frozen=True)
class Transport:
    scheme: str
    sender_factory: Callable[[Destination, float, Optional[bytes]], Sender]
    listener_factory: Optional[Callable[[Any], Listener]]
    parse: Callable[[str, urllib.parse.SplitResult], Destination] = host_port
    example: str = ""  # how its URLs look, for error messages


_registry: dict[str, Transport] = {}
_lock = threading.Lock()


def register_transport(scheme: str, sender_factory: Callable[[Destination, float, Optional[bytes]], Sender],
                       listener_factory: Optional[Callable[[Any], Listener]] = None, *,
                       parse: Callable[[str, urllib.parse.SplitResult], Destination] = host_port,
                       example: str = "") -> Transport:
    """Register (or replace) the transport of URLs ``scheme://...``. ``parse(url, parts)``
    returns its :class:`Destination` or raises ValueError (default: host and port required)."""
    scheme = scheme.lower()
    if not _SCHEME_RE.match(scheme):
        raise ValueError(f"transport scheme must be lowercase letters and digits, got {scheme!r}")
    t = Transport(scheme, sender_factory, listener_factory, parse, example or f"{scheme}://host:port")
    with _lock:
        _registry[scheme] = t
    return t


def unregister_transport(scheme: str) -> None:
    with _lock:
        _registry.pop(scheme.lower(), None)


def schemes() -> tuple[str, ...]:
    """The registered schemes, in registration order."""
    return tuple(_registry)


def usage() -> str:
    """How the registered transports' URLs look (``http(s)://host[:port]/path or tcp://host:port``)."""
    examples = list(dict.fromkeys(t.example for t in _registry.values()))
    return " or ".join([", ".join(examples[:-1])] + examples[-1:]) if len(examples) > 1 else "".join(examples)


def transport_for(scheme: str) -> Transport:
    """The transport of ``scheme``, importing ``eldr_sglang.transports.<scheme>`` the first
    time; ValueError naming the scheme if there is none."""
    scheme = scheme.lower()
    t = _registry.get(scheme)
    if t is None and _SCHEME_RE.match(scheme):
        try:
            importlib.import_module(f"{PACKAGE}.{scheme}")
        except ModuleNotFoundError as e:
            if e.name != f"{PACKAGE}.{scheme}":
                raise
        t = _registry.get(scheme)
    if t is None:
        raise ValueError(f"unknown signature transport {scheme!r} (known: {', '.join(schemes())})")
    return t


def scheme_of(url: Any) -> str:
    """The registered scheme of ``url``; ValueError naming the URL and its scheme otherwise."""
    if not isinstance(url, str):
        raise ValueError(f"signature address must be a URL string, got {url!r}")
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if not scheme:
        raise ValueError(f"signature address {url!r} has no scheme; expected {usage()}")
    try:
        transport_for(scheme)
    except ValueError:
        raise ValueError(f"signature address {url!r}: unknown scheme {scheme!r}; expected {usage()}") from None
    return scheme


def parse(url: Any) -> Destination:
    """``url``'s :class:`Destination`; ValueError naming the URL if its scheme is unknown
    or its transport refuses it."""
    t = transport_for(scheme_of(url))
    try:
        return t.parse(url, urllib.parse.urlsplit(url))
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"signature address {url!r} is not a valid {t.example} ({e})") from None


def sender_for(dest: str | Destination, timeout: float = 2.0, key: Optional[bytes] = None) -> Sender:
    """A sender to ``dest`` (a URL or a parsed :class:`Destination`); it connects on its first send."""
    d = parse(dest) if isinstance(dest, str) else dest
    return transport_for(d.scheme).sender_factory(d, timeout, key)


def listener_for(scheme: str, intake: Any) -> Listener:
    """A listener of ``scheme`` feeding ``intake``; ValueError if the transport has none."""
    t = transport_for(scheme)
    if t.listener_factory is None:
        raise ValueError(f"signature transport {t.scheme!r} has no listener")
    return t.listener_factory(intake)


def deliver(sender: Sender, batch: list[dict]) -> None:
    """``sender.send(batch)``; a kept-open connection the peer closed meanwhile is reopened once."""
    try:
        sender.send(batch)
    except RECONNECT:
        sender.close()
        sender.send(batch)

