"""A minimal signal in plain Python, so the worker code needs no Qt."""

from __future__ import annotations

import logging
from typing import Callable, List

log = logging.getLogger(__name__)


class Signal:
    """``connect`` callables; ``emit`` calls each in order on the caller's thread.

    Every slot runs even when an earlier one raises (a failing GUI callback must not keep the
    session from going back to idle), and then the first error is raised again to the caller of
    ``emit``, so it is never lost: a headless caller sees it as an exception, the Slicer timer
    that polls the worker shows it in the Python console. Later errors are logged.
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
        first = None
        for slot in list(self._slots):
            try:
                slot(*args)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other slots ran
                if first is None:
                    first = e
                else:
                    log.exception("a %s slot failed as well", self.name)
        if first is not None:
            raise first

    def __len__(self) -> int:
        return len(self._slots)
