"""Routing keys for SMG's manual policy, and the evidence that each is where we think.

SMG 0.3.2 exports ``smg_worker_routing_keys_active{worker=URL}``: how many distinct
routing keys have a request in flight at that worker (checked with stub workers:
three in-flight requests of one key count 1, an unkeyed request counts 0). Unkeyed
traffic, however heavy, never moves it, so it is the evidence for both learning a
key (a probe's key shows up at one decode worker) and verifying it afterwards (a key
of ours that has a request in flight must show up at the worker we pin it for).

:class:`KeyBook` holds the key in use per worker, the pre-router's in-flight count
per key, and per key the recent observations: a *hit* (the key busy, its worker's
gauge at least the keys we believe there) or a *miss* (its worker's gauge below the
keys of ours busy there: one of them is elsewhere). A key is *wrong* once it has
``miss_limit`` misses and more misses than hits among its last ``window``
observations. Observations are taken only where the key's in-flight state did not
change around the scrape (see :meth:`KeyBook.snapshot`).
"""

from __future__ import annotations

import collections
import re
import time
from dataclasses import dataclass, field
from typing import Optional

GAUGE = "smg_worker_routing_keys_active"
_LINE = re.compile(r'^smg_worker_routing_keys_active\{([^}]*)\}\s+([0-9.eE+-]+)')
_WORKER = re.compile(r'worker="([^"]*)"')


def parse_keys_active(text: str) -> Optional[dict[str, float]]:
    """Distinct keys in flight per worker URL (a worker not listed: 0; SMG exports the
    gauge only once a keyed request went through); None when the text is not SMG's."""
    out: dict[str, float] = {}
    smg = False
    for line in text.splitlines():
        smg = smg or line.startswith("smg_")
        m = _LINE.match(line)
        if m:
            w = _WORKER.search(m.group(1))
            if w:
                out[w.group(1).rstrip("/")] = float(m.group(2))
    return out if smg else None


@dataclass
class Key:
    key: str
    worker: str
    learned: float = field(default_factory=time.monotonic)
    used: float = field(default_factory=time.monotonic)
    seen: collections.deque = field(default_factory=lambda: collections.deque(maxlen=32))  # True hit, False miss

    @property
    def hits(self) -> int:
        return sum(self.seen)

    @property
    def misses(self) -> int:
        return len(self.seen) - self.hits


class KeyBook:
    """Keys in use (one per decode worker) and their in-flight requests."""

    def __init__(self, miss_limit: int = 3) -> None:
        self.miss_limit = miss_limit
        self.active: dict[str, Key] = {}  # worker URL -> its key
        self.inflight: collections.Counter = collections.Counter()  # key -> pinned requests in flight
        self.seq: collections.Counter = collections.Counter()  # key -> idle/busy transitions

    def key_for(self, worker: str) -> Optional[str]:
        k = self.active.get(worker)
        return k.key if k else None

    def bind(self, key: str, worker: str) -> None:
        self.active[worker] = Key(key, worker)

    def drop(self, worker: str) -> Optional[Key]:
        return self.active.pop(worker, None)

    def started(self, key: str) -> None:
        self.inflight[key] += 1
        if self.inflight[key] == 1:  # idle -> busy: what SMG's gauge can see
            self.seq[key] += 1
        for k in self.active.values():
            if k.key == key:
                k.used = time.monotonic()

    def ended(self, key: str) -> None:
        self.inflight[key] -= 1
        if self.inflight[key] <= 0:  # busy -> idle
            del self.inflight[key]
            self.seq[key] += 1

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """(in flight, idle/busy transitions) per key: a key with the same transitions before
        and after a scrape was busy (or idle) all the while SMG was read."""
        return {k: (self.inflight.get(k, 0), self.seq.get(k, 0)) for k in set(self.inflight) | set(self.seq)}

    def steady(self, before: dict, after: dict) -> bool:
        """No key of ours went busy or idle between the two snapshots."""
        return {k: v[1] for k, v in before.items()} == {k: v[1] for k, v in after.items()}

    def observe(self, gauge: dict[str, float], before: dict, after: dict) -> list[Key]:
        """Score every active key that was steadily busy around a gauge read; return the keys
        now judged wrong (already removed from :attr:`active`)."""
        busy = {k.worker: k for k in self.active.values()
                if before.get(k.key, (0, 0))[1] == after.get(k.key, (0, 0))[1] and after.get(k.key, (0, 0))[0] > 0}
        wrong = []
        for worker, k in busy.items():
            k.seen.append(gauge.get(worker, 0.0) >= 1)
            if k.misses >= self.miss_limit and k.misses > k.hits:
                wrong.append(self.active.pop(worker))
        return wrong

    def describe(self) -> dict:
        now = time.monotonic()
        return {w: {"key": k.key, "age_s": round(now - k.learned, 1), "hits": k.hits, "misses": k.misses}
                for w, k in self.active.items()}
