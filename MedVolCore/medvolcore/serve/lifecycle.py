"""What both transports share: the server's stderr log, its signals, and stopping the worker.

The ready line, logs and the stop line go to stderr as ``medvol serve: …``; SIGTERM unwinds the
main thread like Ctrl-C so that :func:`stop_worker` cancels what runs, waits up to
``STOP_GRACE_S`` and removes the worker's temporary folder.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

__all__ = ["PROG", "STOP_GRACE_S", "Stop", "say", "setup_logging", "install_signals", "stop_worker"]

PROG = "medvol serve"
STOP_GRACE_S = 15.0


class Stop(BaseException):
    """Raised in the main thread by SIGTERM (SIGINT raises KeyboardInterrupt)."""


def say(text: str) -> None:
    sys.stderr.write(f"{PROG}: {text}\n")
    sys.stderr.flush()


class _StderrLog(logging.Handler):
    def emit(self, record):
        try:
            sys.stderr.write(f"{PROG}: {record.levelname.lower()}: {record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            pass


def setup_logging(debug: bool) -> None:
    logger = logging.getLogger("medvolcore")
    for h in list(logger.handlers):  # the server owns stderr logging (no duplicate lines from the CLI's handler)
        logger.removeHandler(h)
    logger.addHandler(_StderrLog(level=logging.DEBUG if debug else logging.INFO))
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    logger.propagate = False


def install_signals() -> dict:
    """SIGTERM raises _Stop in the main thread; SIGINT stays KeyboardInterrupt."""
    old = {}

    def _term(signum, frame):
        raise Stop()

    if threading.current_thread() is threading.main_thread():
        old[signal.SIGTERM] = signal.signal(signal.SIGTERM, _term)
        old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    return old


def _quiet_signals() -> None:
    """During the clean-up a second signal must not interrupt it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)



def stop_worker(worker, how: str, old_signals: dict, before_close=None) -> bool:
    """Cancel what runs, wait up to STOP_GRACE_S, clean up and restore the signal handlers.

    Returns whether the worker thread finished in time.
    """
    _quiet_signals()
    worker.stop(f"the worker is stopping ({how})")
    done = worker.join(STOP_GRACE_S)
    if before_close is not None:
        before_close()
    worker.close(0)
    say(f"stopped ({how})")
    for sig, handler in old_signals.items():
        signal.signal(sig, handler)
    return done
