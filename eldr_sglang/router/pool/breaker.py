"""A worker's circuit breaker: one small state machine.

::

    closed --(threshold consecutive failures, or one connection-level failure)--> open
    open --(cooldown passed, or a health check passed)--> ready for one trial
    trial --success--> closed        trial --failure--> open (cooldown again)
    trial --no verdict (client gone, cancelled, ended elsewhere)--> ready for a trial again

Every request sent to a worker takes a :class:`Ticket` and ends it exactly once
(:meth:`Ticket.success`, :meth:`Ticket.failure`, or :meth:`Ticket.close` without a
verdict), so a half-open trial always ends, whatever happens to the request.
"""

from __future__ import annotations

import time
from typing import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class CircuitBreaker:
    def __init__(self, threshold: int = 5, cooldown: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = max(1, int(threshold))
        self.cooldown = cooldown
        self.clock = clock
        self.state = CLOSED
        self.failures = 0  # consecutive
        self.open_until = 0.0
        self.trial_out = False  # half-open: the one trial request is in flight

    def allows(self) -> bool:
        """A request may be sent now."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN and self.clock() < self.open_until:
            return False
        return not self.trial_out

    def ticket(self) -> "Ticket":
        """Take a ticket for one request (the half-open trial when not closed)."""
        trial = self.state != CLOSED
        if trial:
            self.state, self.trial_out = HALF_OPEN, True
        return Ticket(self, trial)

    def probe_passed(self) -> None:
        """A health check passed: an open breaker lets its trial through now."""
        if self.state == OPEN:
            self.open_until = 0.0

    def _success(self, trial: bool) -> bool:
        self.failures = 0
        if self.state != CLOSED and (trial or not self.trial_out):
            self.state, self.trial_out = CLOSED, False
            return True
        return False

    def _failure(self, hard: bool, trial: bool) -> bool:
        self.failures += 1
        if hard or trial or self.state != CLOSED or self.failures >= self.threshold:
            opened = self.state != OPEN
            self.state, self.trial_out = OPEN, False
            self.open_until = self.clock() + self.cooldown
            return opened
        return False

    def _no_verdict(self, trial: bool) -> None:
        if trial and self.state == HALF_OPEN:
            self.trial_out = False

    def describe(self) -> dict:
        return {"state": self.state, "consecutive_failures": self.failures}


class Ticket:
    """One request's pass through a breaker; ended exactly once (later calls are no-ops)."""

    __slots__ = ("breaker", "trial", "ended")

    def __init__(self, breaker: CircuitBreaker, trial: bool) -> None:
        self.breaker, self.trial, self.ended = breaker, trial, False

    def success(self) -> bool:
        """The worker answered (any HTTP status it chose); True if the breaker closed."""
        if self.ended:
            return False
        self.ended = True
        return self.breaker._success(self.trial)

    def failure(self, hard: bool = False) -> bool:
        """The worker failed (5xx, broken answer; ``hard``: unreachable); True if it opened."""
        if self.ended:
            return False
        self.ended = True
        return self.breaker._failure(hard, self.trial)

    def close(self) -> None:
        """End without a verdict (client gone, cancelled, decided elsewhere)."""
        if not self.ended:
            self.ended = True
            self.breaker._no_verdict(self.trial)
