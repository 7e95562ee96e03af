"""The circuit breaker state machine: every way a half-open trial can end ends it."""

import pytest

from eldr_sglang.router.pool.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, Ticket


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def opened(threshold=3, cooldown=10.0):
    clock = Clock()
    b = CircuitBreaker(threshold, cooldown, clock)
    for _ in range(threshold):
        assert b.allows()
        b.ticket().failure()
    assert b.state == OPEN and not b.allows()
    return b, clock


def test_threshold_failures_open_and_a_hard_failure_opens_at_once():
    b, _ = opened(threshold=3)
    c = CircuitBreaker(5, 10.0, Clock())
    c.ticket().failure(hard=True)
    assert c.state == OPEN
    d = CircuitBreaker(3, 10.0, Clock())
    d.ticket().failure()
    d.ticket().success()  # a success resets the consecutive count
    d.ticket().failure()
    d.ticket().failure()
    assert d.state == CLOSED


def test_cooldown_then_exactly_one_trial():
    b, clock = opened()
    clock.t += 10.0
    assert b.allows()
    t = b.ticket()
    assert t.trial and b.state == HALF_OPEN
    assert not b.allows()  # one trial at a time


def test_health_check_pass_lets_the_trial_through_before_the_cooldown():
    b, _ = opened()
    b.probe_passed()
    assert b.allows()


@pytest.mark.parametrize("outcome, state, allows_after", [
    ("success", CLOSED, True),        # 2xx, and 4xx: the server answered
    ("failure", OPEN, False),         # 5xx, broken answer: cooldown again
    ("close", HALF_OPEN, True),       # client gone, cancelled, prefill failed first
])
def test_every_trial_outcome_ends_the_trial(outcome, state, allows_after):
    b, clock = opened()
    clock.t += 10.0
    t = b.ticket()
    getattr(t, outcome)()
    assert b.state == state
    assert b.allows() is allows_after
    # ending twice changes nothing
    t.failure()
    t.success()
    assert b.state == state


def test_stale_request_ending_during_a_trial_leaves_the_trial_alone():
    b, clock = opened()
    clock.t += 10.0
    trial = b.ticket()
    # a request sent while closed that ends now without verdict does not free the trial
    Ticket(b, trial=False).close()
    assert not b.allows()
    trial.success()
    assert b.state == CLOSED
