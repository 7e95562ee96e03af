"""The signature intake's memory: replay rooms on the wall clock, refusals for operators."""

from __future__ import annotations

from eldr_sglang.router.signals.intake_state import IntakeHealth, SeenRooms


def test_a_room_is_remembered_exactly_while_its_message_could_pass_the_age_check():
    now = [1000.0]
    seen = SeenRooms(max_age=60, clock=lambda: now[0])
    assert seen.add(1, ts=1000.0) and not seen.add(1, ts=1000.0)
    now[0] = 1060.0  # |now - ts| == max age: still taken by the age check, so still refused
    assert not seen.add(1, ts=1000.0)
    now[0] = 1060.5  # the age check refuses it from here on: forgotten
    assert seen.add(1, ts=1060.0) and len(seen) == 1
    assert seen.add(2, ts=1100.0)  # a message from the future is kept until its own ts + max age
    now[0] = 1159.0
    assert not seen.add(2, ts=1100.0)


def test_at_the_cap_the_soonest_to_expire_goes_first_and_is_counted():
    seen = SeenRooms(max_age=60, clock=lambda: 1000.0, cap=3)
    for room, ts in ((1, 990.0), (2, 1000.0), (3, 980.0), (4, 1000.0)):
        assert seen.add(room, ts)
    assert seen.evicted == 1 and 3 not in seen.expiry and not seen.add(1, 990.0)


def test_health_names_the_skew_and_forgets_after_the_window():
    t = [0.0]
    h = IntakeHealth(max_age=60, clock=lambda: t[0])
    assert not h.describe()["degraded"]
    h.note("stale", skew=-61.4)
    h.note("bad_mac", 2)
    d = h.describe()
    assert d["degraded"] and d["refused"] == {"stale": 1, "bad_mac": 2} and d["last_skew_s"] == -61.4
    assert any("engine clock 61 s behind this router's" in c for c in d["causes"])
    t[0] = 61.0
    assert not h.describe()["degraded"] and h.describe()["refused"]["bad_mac"] == 2
