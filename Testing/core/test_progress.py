"""Progress events (medvolcore.progress): a stage's elapsed time and time left, a stage split in equal
parts, the one form of a cancel, and the clock's text."""

from __future__ import annotations

import threading

import pytest

from medvolcore.errors import InputError
from medvolcore.progress import StageClock, cancel_checker, clock_text, part_of


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_time_left_is_the_pace_so_far_over_the_rest_of_the_stage():
    t = _Clock()
    clock = StageClock(t)
    assert clock.update("ground", 0.0) == (0.0, None, True)  # a new stage: no estimate yet
    t.now = 110.0
    assert clock.update("ground", 0.25) == (10.0, 30.0, False)  # 10 s for a quarter: 30 s for the rest
    t.now = 130.0
    assert clock.update("ground", 0.8) == (30.0, pytest.approx(7.5), False)
    t.now = 131.0
    assert clock.update("ground", 0.005) == (31.0, None, False)  # under 1 % done: no estimate
    assert clock.update("ground", 1.7)[1] == 0.0 and clock.update("ground", -1)[1] is None  # clamped to 0..1
    t.now = 140.0
    assert clock.update("propagate", 0.5) == (0.0, None, True)  # the next stage's clock starts at its first event
    t.now = 146.0
    assert clock.update("propagate", 0.75) == (6.0, 2.0, False)


def test_parts_of_a_stage_cover_it_in_order_and_say_which_part_speaks():
    events = []
    progress = lambda *e: events.append(e)  # noqa: E731
    parts = [part_of(progress, i, 4, "sample") for i in range(4)]
    for part in parts:
        part("ground", 0.0, "start")
        part("ground", 0.5, "decoding")
        part("ground", 1.0, "done")
    fractions = [f for _, f, _ in events]
    assert fractions == [0.0, 0.125, 0.25, 0.25, 0.375, 0.5, 0.5, 0.625, 0.75, 0.75, 0.875, 1.0]
    assert events[4] == ("ground", 0.375, "sample 2/4: decoding") and events[-1][2] == "sample 4/4: done"
    assert part_of(progress, 0, 1, "sample") is progress  # one part: the stage itself, unprefixed
    assert part_of(None, 2, 4, "query") is None


def test_a_cancel_is_an_event_a_callable_or_none():
    assert cancel_checker(None)() is False
    event = threading.Event()
    check = cancel_checker(event)
    assert check() is False
    event.set()
    assert check() is True
    asked = []
    check = cancel_checker(lambda: asked.append(1) or len(asked) > 1)
    assert (check(), check()) == (False, True)
    with pytest.raises(InputError, match="threading.Event or a zero-argument callable, got str"):
        cancel_checker("stop")


def test_clock_text():
    assert [clock_text(s) for s in (None, 0, 59.4, 59.6, 61, 3599, 3661)] == [
        "?", "0:00", "0:59", "1:00", "1:01", "59:59", "1:01:01"]
