"""Where a prefill server may publish signatures: ``--eldr-publish-allow``.

A request names its signature's destination (the router's return address), so a
client that reaches a prefill server directly could make it connect anywhere. The
publisher connects only to destinations this list allows:

* an entry that is a CIDR (``10.0.0.0/8``) or an address allows destinations given
  as an address inside it;
* an entry that is a host name (``eldr-router``) allows that name, and destinations
  given as one of its addresses (resolved at most every ``ttl`` s: a headless Service
  name allows every router pod);
* a destination given by an unlisted name is refused without resolving it;
* a name that the resolver would read as an address ("2130706433", "127.1",
  "0x7f.0.0.1") is refused, as an entry and as a destination: only an address's
  canonical form is one;
* the host a destination is connected to is the one that was checked, normalised
  (lower case, no trailing dot: "localhost." is connected to as "localhost");
  the publisher checks a kept connection's destination again at every use, so one
  allowed through a listed name's address stops when that name re-resolves elsewhere.

Without ``--eldr-publish-allow``: with ``--eldr-publish request`` only this machine
(loopback, its host name and addresses); with ``--eldr-publish URL`` any destination,
as before (a warning says so). The ``--eldr-publish URL`` host is always allowed.
Imports neither SGLang nor torch.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import time
from typing import Callable, Iterable, Optional

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_HOST_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*\.?$")


_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")


def numeric_form(host: str) -> bool:
    """Whether ``host`` (lower case, no trailing dot) is an address in a form other than
    the canonical one that ``inet_aton`` still takes ("2130706433", "127.1", "0x7f.1")."""
    labels = host.split(".")
    return 1 <= len(labels) <= 4 and all(_NUMERIC_LABEL.match(x) for x in labels)


def parse_entries(value: str) -> tuple[str, ...]:
    """``CIDR_OR_HOST[,...]`` validated (ValueError naming the bad entry), normalised."""
    out = []
    for raw in value.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        try:
            out.append(str(ipaddress.ip_network(entry, strict=False)))
            continue
        except ValueError:
            pass
        name = entry.rstrip(".")
        if "/" in entry or ":" in entry or not _HOST_NAME.match(entry) or numeric_form(name):
            raise ValueError(f"{raw.strip()!r} is neither a CIDR, an address (in its usual "
                             "form) nor a host name")
        out.append(name)
    if not out:
        raise ValueError("expected CIDRs or host names, comma-separated")
    return tuple(out)


def _addresses(name: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()


class DestinationAllowList:
    """``allows(host)`` for a destination's host; ``None`` entries allow everything."""

    def __init__(self, entries: Optional[Iterable[str]], always: Iterable[str] = (),
                 resolve: Callable[[str], set[str]] = _addresses, ttl: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.open = entries is None
        self.networks: list[Network] = []
        self.names: set[str] = set()
        for entry in [*(entries or ()), *always]:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.add(entry.lower().rstrip("."))
        self.resolve, self.ttl, self.clock = resolve, ttl, clock
        self._resolved: set[str] = set()
        self._resolved_at = -float("inf")

    @classmethod
    def local(cls, always: Iterable[str] = (), **kw) -> "DestinationAllowList":
        """This machine only: loopback, its host name and that name's addresses."""
        return cls([str(n) for n in LOOPBACK] + ["localhost", socket.gethostname()], always, **kw)

    def _name_addresses(self) -> set[str]:
        now = self.clock()
        if now - self._resolved_at >= self.ttl:
            self._resolved_at = now
            self._resolved = set().union(*(self.resolve(n) for n in self.names)) if self.names else set()
        return self._resolved

    def canonical(self, host: str) -> Optional[str]:
        """The host to connect to for a destination's ``host`` when allowed (lower case,
        no trailing dot, an address in its canonical form), else None. Addresses in
        other forms are refused, even with an open list."""
        host = host.lower().rstrip(".")
        try:
            addr = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            if not host or numeric_form(host):
                return None
            return host if self.open or host in self.names else None  # an unlisted name is never resolved
        if self.open or any(addr in n for n in self.networks) or str(addr) in self._name_addresses():
            return str(addr)
        return None

    def allows(self, host: str) -> bool:
        return self.canonical(host) is not None

    def describe(self) -> str:
        return "any" if self.open else ", ".join([*map(str, self.networks), *sorted(self.names)])
