"""What the signature intake remembers: the rooms it took (replay refusal) and what it
refused (health for operators).

:class:`SeenRooms` keeps each room until its message could no longer pass the age
check: ``ts + max_age`` on the wall clock, the clock ``ts`` is checked against, so a
wall-clock step never reopens a replay and its size follows the observed rate
(rate x up to 2 x max age), up to ``SEEN_ROOMS_MAX``.

:class:`IntakeHealth` counts refused messages by reason (since start and over the last
``WINDOW`` seconds), the requests they woke and the last clock skew seen, and words the
causes an operator acts on ("engine clock 61 s ahead of this router's").
"""

from __future__ import annotations

import collections
import heapq
import time
from typing import Callable, Optional

SEEN_ROOMS_MAX = 1 << 20  # rooms remembered at most (~190 MB): 8,700 signatures/s at the default age
WINDOW = 60.0  # seconds of refusals /ready and /eldr/status call recent

# what an operator does about each refusal, by reason
ADVICE = {
    "unsigned": "signature messages arrive without an HMAC: give the engines the key "
                "(--eldr-signature-key-file), or find who posts them",
    "bad_mac": "signature messages carry an HMAC of another key (or were altered): check the "
               "engines' --eldr-signature-key-file, or find who posts them",
    "unstamped": "signed signature messages without 'ts': the engines are older than this router; "
                 "upgrade them",
    "replay": "signature messages for rooms already taken (replays)",
    "layer_mismatch": "engines publish other layers than the calibration artifact's",
    "bad_counts": "engines publish counts of another shape than the calibration artifact's",
    "unproven": "signature stream connections closed: no valid MAC within the grace",
    "stream_buffer": "signature stream connections closed: partial lines over the budget",
    "line_timeout": "signature stream connections closed: a line not finished in time",
}


class SeenRooms:
    """Bootstrap rooms of the messages taken, each until ``ts + max_age`` on ``clock``
    (a message without ``ts``: 2 x max_age from now). At ``cap`` the soonest to expire
    is forgotten first, counted in ``evicted``."""

    def __init__(self, max_age: float, clock: Callable[[], float] = time.time,
                 cap: int = SEEN_ROOMS_MAX) -> None:
        self.max_age, self.clock, self.cap = max_age, clock, cap
        self.expiry: dict[int, float] = {}
        self.heap: list[tuple[float, int]] = []  # (expiry, room), one per remembered room
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.expiry)

    def _pop(self) -> None:
        t, room = heapq.heappop(self.heap)
        if self.expiry.get(room) == t:
            del self.expiry[room]

    def add(self, room: int, ts: Optional[float] = None) -> bool:
        """Remember ``room``; False when it is remembered already (a replay)."""
        now = self.clock()
        heap = self.heap
        while heap and heap[0][0] < now:
            self._pop()
        if room in self.expiry:
            return False
        while len(self.expiry) >= self.cap:
            self._pop()
            self.evicted += 1
        until = (now + self.max_age if ts is None else ts) + self.max_age
        self.expiry[room] = until
        heapq.heappush(heap, (until, room))
        return True

    def describe(self) -> dict:
        return {"remembered": len(self.expiry), "cap": self.cap, "evicted_fresh": self.evicted,
                "rate_per_s": round(len(self.expiry) / self.max_age, 1)}  # rooms live ~max age


class IntakeHealth:
    """Refused messages by reason, the requests they woke, the last clock skew."""

    def __init__(self, max_age: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age, self.clock = max_age, clock
        self.refused: collections.Counter[str] = collections.Counter()
        self.woken: collections.Counter[str] = collections.Counter()
        self.recent: dict[str, collections.deque] = {}  # reason -> [second, count] pairs
        self.last_skew: Optional[float] = None  # the sender's clock minus this router's (s)
        self.last_skew_at = 0.0

    def note(self, reason: str, n: int = 1, skew: Optional[float] = None) -> None:
        self.refused[reason] += n
        now = int(self.clock())
        q = self.recent.setdefault(reason, collections.deque())
        if q and q[-1][0] == now:
            q[-1][1] += n
        else:
            q.append([now, n])
            while q and q[0][0] <= now - WINDOW:
                q.popleft()
        if skew is not None:
            self.last_skew, self.last_skew_at = skew, self.clock()

    def recent_counts(self) -> dict[str, int]:
        since = self.clock() - WINDOW
        out = {r: sum(n for t, n in q if t > since) for r, q in self.recent.items()}
        return {r: n for r, n in out.items() if n}

    @staticmethod
    def skew_words(skew: float) -> str:
        return f"engine clock {abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} this router's"

    def causes(self) -> list[str]:
        """What went wrong in the last ``WINDOW`` seconds, in words an operator acts on."""
        out = []
        for reason, n in sorted(self.recent_counts().items()):
            if reason == "stale" and self.last_skew is not None:
                what = (f"{self.skew_words(self.last_skew)} (more than --signature-max-age "
                        f"{self.max_age:g} s): its signatures are refused and their requests routed "
                        "by load; sync the clocks (NTP)")
            else:
                what = ADVICE.get(reason, f"signature messages refused ({reason})")
            out.append(f"{n} in the last {WINDOW:.0f} s: {what}")
        return out

    def describe(self) -> dict:
        causes = self.causes()
        skew_age = None if self.last_skew is None else round(self.clock() - self.last_skew_at, 1)
        return {"degraded": bool(causes), "causes": causes, "refused": dict(self.refused),
                "refused_recent": self.recent_counts(), "woken": dict(self.woken),
                "last_skew_s": None if self.last_skew is None else round(self.last_skew, 1),
                "last_skew_age_s": skew_age}
