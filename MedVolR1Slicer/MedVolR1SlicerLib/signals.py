"""A minimal signal in plain Python, so the worker code needs no Qt."""

from __future__ import annotations

import logging
from typing import Callable, List

log = logging.getLogger(__name__)


class Signal:
    """``connect`` callables; ``emit`` calls each in order on the caller's thread.

    A failing slot is logged and does not stop the others (a GUI callback that raises must not
    leave a request looking unfinished).
    """

    def __init__(self, name: str = "signal"):
        self.name = name
        self._slots: List[Callable] = []

    def connect(self, slot: Callable) -> None:
        if slot not in self._slots:
            self._slots.append(slot)

    def disconnect(self, slot: Callable = None) -> None:
        if slot is None:
            self._slots.clear()
        elif slot in self._slots:
            self._slots.remove(slot)

    def emit(self, *args) -> None:
        for slot in list(self._slots):
            try:
                slot(*args)
            except Exception:  # noqa: BLE001 - a slot's bug must not break the caller
                log.exception("a %s slot failed", self.name)

    def __len__(self) -> int:
        return len(self._slots)
