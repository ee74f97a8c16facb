"""``Signal``, the plain-Python signal that keeps the worker code free of Qt: an error raised by
a slot reaches the emitter (after every slot ran), instead of being swallowed."""

from __future__ import annotations

import pytest
from MedVolR1SlicerLib.signals import Signal


def test_a_failing_slot_raises_to_the_emitter_after_every_slot_ran():
    s = Signal("finished")
    ran = []

    def bad(x):
        ran.append(("bad", x))
        raise ValueError("the mask does not fit")

    def worse(x):
        ran.append(("worse", x))
        raise KeyError("later")

    s.connect(lambda x: ran.append(("first", x)))
    s.connect(bad)
    s.connect(worse)
    s.connect(lambda x: ran.append(("last", x)))
    with pytest.raises(ValueError, match="the mask does not fit"):  # the first error, not swallowed
        s.emit(7)
    assert ran == [("first", 7), ("bad", 7), ("worse", 7), ("last", 7)]
    s.disconnect(bad)
    s.disconnect(worse)
    s.emit(8)  # no error: nothing raised
    assert ran[-2:] == [("first", 8), ("last", 8)]
