"""The decision log behind ``GET /eldr/decisions``: the last ``decisions_kept``
routing decisions, one typed :class:`DecisionRecord` each, rendered when read."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from eldr_sglang.core.policies import Decision

DECISION_COUNTS_MAX = 64 << 10  # bytes of counts a decision log entry keeps per message


def _counts_bytes(msg: dict) -> int:
    counts = msg.get("counts")
    return counts.nbytes if isinstance(counts, np.ndarray) else 0


@dataclass(slots=True)
class DecisionRecord:
    """One routing decision as it was made (references, no copies; never changed
    afterwards: a frozen dataclass costs several times more to build per request)."""

    time: float
    rids: list[str]
    rooms: list[int]
    label: Optional[str]
    policy: str
    decode: str  # the chosen decode server's URL
    decodes: list[Any]  # the decode workers then, in pool order
    loads: list[int]  # their loads as the policy saw them
    messages: list[dict]  # the signature messages that had arrived
    decision: Decision
    shadow: Optional[dict] = None  # the shadow policy's pick (filled in when it comes)

    def render(self) -> dict:
        loads = [(x.url, n) for x, n in zip(self.decodes, self.loads)]
        messages = [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in m.items()}
                    for m in self.messages]
        dec = self.decision
        out = {"time": self.time, "rids": self.rids, "rooms": self.rooms, "label": self.label,
               "policy": self.policy, "decode": self.decode, "loads": dict(loads),
               "messages": messages, "reason": dec.reason}
        if self.shadow is not None:
            out["shadow"] = dict(self.shadow)
        if dec.band is not None:
            out["band"] = [loads[i][0] for i in dec.band if i < len(loads)]
            out["best_similarity"] = dec.best_similarity
        if dec.centroid_similarities is not None:
            out["similarities"] = dec.centroid_similarities.tolist()
            if dec.server_similarities is not None:  # region similarity of each decode server
                out["server_similarities"] = {u: float(s) for (u, _), s in zip(loads, dec.server_similarities)}
        return out


class DecisionLog:
    """A bounded deque of :class:`DecisionRecord`."""

    def __init__(self, kept: int) -> None:
        self.records: deque[DecisionRecord] = deque(maxlen=kept)

    @property
    def maxlen(self) -> int:
        return self.records.maxlen or 0

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[DecisionRecord]:
        return iter(self.records)

    def record(self, rids: list[str], rooms: list[int], label: Optional[str],
               waiters: Sequence[asyncio.Future], d: Any, dec: Decision, loads: list[int],
               decodes: Sequence[Any], shadow: Optional[dict] = None) -> None:
        """Keep one decision: O(K + N) numbers (similarities, loads) and the signature
        messages, whose counts are kept (a reference, no copy) up to
        ``DECISION_COUNTS_MAX`` bytes each, so the log holds at most ``decisions_kept``
        x 64 KiB of counts."""
        messages = [m if _counts_bytes(m) <= DECISION_COUNTS_MAX else
                    {k: v for k, v in m.items() if k != "counts"}
                    for m in (w.result() for w in waiters
                              if w.done() and not w.cancelled() and w.exception() is None)]
        self.records.append(DecisionRecord(time.time(), rids, rooms, label, dec.policy, d.url,
                                           list(decodes), loads, messages, dec, shadow))

    def recent(self, last: int) -> list[dict]:
        """The last ``last`` records (at most the log's size), rendered."""
        recent = list(self.records)[-min(last, self.maxlen):] if last else []
        return [rec.render() for rec in recent]
