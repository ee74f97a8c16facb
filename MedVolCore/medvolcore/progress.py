"""Elapsed time and an estimate of the time left per stage, from ``progress(stage, fraction, message)``
events (:data:`medvolcore.pipeline.Progress`): what the CLI's non-terminal lines and the worker's
``progress`` events add to a fraction. The estimate assumes the rest of the stage goes at the
average pace so far; it is rough where a stage's steps differ in speed (see
:mod:`medvolcore.grounder.progress` for how the grounding stage is divided). Also
:func:`cancel_checker`, the one form of a cancel that the grounder and the propagator check, and
:func:`part_of`, one of several equal parts of a stage (a consensus's samples, several queries), and
:data:`Progress`, the callback's type."""

from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

from .errors import InputError

Progress = Callable[[str, float, str], None]  # progress(stage, fraction 0..1, message): a job's progress events


def cancel_checker(cancel) -> Callable[[], bool]:
    """``cancel`` (None, a ``threading.Event`` or a zero-argument callable) as a callable: the one
    form the grounder and the propagator check between their steps."""
    if cancel is None:
        return lambda: False
    if hasattr(cancel, "is_set"):
        return cancel.is_set
    if callable(cancel):
        return lambda: bool(cancel())
    raise InputError(f"cancel must be a threading.Event or a zero-argument callable, got {type(cancel).__name__}")


def part_of(progress, index: int, count: int, what: str):
    """``progress`` for part ``index`` of ``count`` equal parts of a stage: its fraction mapped into
    the whole and its messages prefixed ``"<what> i/n: "`` (``progress`` as is for one part)."""
    if progress is None or count <= 1:
        return progress

    def part(stage, fraction, message):
        progress(stage, (index + float(fraction)) / count, f"{what} {index + 1}/{count}: {message}")

    return part


class StageClock:
    """Times each stage from its first event; ``update(stage, fraction)`` →
    ``(elapsed_s, eta_s, new_stage)``; ``eta_s`` is None until 1 % of the stage is done."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.stage: Optional[str] = None
        self.started = 0.0

    def update(self, stage: str, fraction: float) -> Tuple[float, Optional[float], bool]:
        now = self.clock()
        new = stage != self.stage
        if new:
            self.stage, self.started = stage, now
        elapsed = now - self.started
        f = min(max(float(fraction), 0.0), 1.0)
        eta = elapsed * (1.0 - f) / f if f >= 0.01 and not new else None
        return elapsed, eta, new


def clock_text(seconds: Optional[float]) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour on); ``?`` for None."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
