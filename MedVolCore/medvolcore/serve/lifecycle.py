"""What both transports share: the server's stderr log, its signals, its temporary folder, and
stopping the worker.

The ready line, logs and the stop line go to stderr as ``medvol serve: …``, with control
characters escaped (:func:`loggable`), so text a client controls cannot forge log lines or send
terminal escapes. SIGTERM unwinds the main thread like Ctrl-C so that :func:`stop_worker`
cancels what runs, waits up to ``STOP_GRACE_S`` and removes the worker's temporary folder.

A worker's temporary folder is ``medvol-serve-<pid>-<random>`` and holds a lock file the worker
keeps locked while it lives (:func:`make_tmp_dir`). A worker killed with SIGKILL cannot remove
its folder, so each new worker removes the folders of dead ones (:func:`remove_stale_tmp_dirs`):
only folders of this user, whose process is gone and whose lock nobody holds.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional, Tuple

__all__ = ["PROG", "STOP_GRACE_S", "TMP_PREFIX", "Stop", "say", "setup_logging", "install_signals", "stop_worker",
           "loggable", "make_tmp_dir", "remove_stale_tmp_dirs", "release_tmp_dir"]

PROG = "medvol serve"
STOP_GRACE_S = 15.0
TMP_PREFIX = "medvol-serve-"
TMP_LOCK_NAME = ".medvol-serve.lock"
_STALE_RE = re.compile(r"^medvol-serve-([0-9]+)-[A-Za-z0-9_]+$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_BUT_NEWLINE_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match) -> str:
    c = ord(match.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def loggable(text, limit: int = 200) -> str:
    """``text`` fit for one log line: control characters (ESC, CR, LF, …) escaped as ``\\xNN``,
    cut to ``limit`` characters. For anything a client controls (a path, a header, an id)."""
    text = str(text)
    cut = len(text) > limit
    return _CONTROL_RE.sub(_escape, text[:limit]) + ("…" if cut else "")


class Stop(BaseException):
    """Raised in the main thread by SIGTERM (SIGINT raises KeyboardInterrupt)."""


def say(text: str) -> None:
    sys.stderr.write(f"{PROG}: {text}\n")
    sys.stderr.flush()


class _StderrLog(logging.Handler):
    def emit(self, record):
        try:
            # a traceback keeps its lines; no terminal escape or carriage return reaches the terminal
            text = _CONTROL_BUT_NEWLINE_RE.sub(_escape, record.getMessage())
            sys.stderr.write(f"{PROG}: {record.levelname.lower()}: {text}\n")
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


EXIT_CODES = {"SIGTERM": 143, "SIGINT": 130}  # an HTTP server stopped by a signal exits as a shell reports it


def restore_signals(old: dict) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)


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


# ---- the worker's temporary folder ---------------------------------------------------------

def make_tmp_dir() -> Tuple[Path, Optional[int]]:
    """A new private temporary folder ``medvol-serve-<pid>-<random>`` and the descriptor of the
    lock file inside it, locked for as long as this process keeps it open (None where file
    locks are not available). Stale folders of dead workers are removed first."""
    remove_stale_tmp_dirs()
    folder = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
    return folder, _lock(folder / TMP_LOCK_NAME, create=True)


def _lock(path: Path, create: bool = False) -> Optional[int]:
    """An exclusive, non-blocking lock on ``path`` (its descriptor), or None when another process
    holds it or locks are unavailable (not POSIX)."""
    try:
        import fcntl
    except ImportError:
        return None
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process (or not a pid we can ask about): leave it alone
    return True


def remove_stale_tmp_dirs(root=None) -> list:
    """Remove the temporary folders that dead workers left (killed with SIGKILL, a crash).

    A folder in ``root`` (default: the system's temporary folder) is removed only when all of
    these hold: its name is ``medvol-serve-<pid>-<random>``; it is a real folder (not a link)
    owned by this user; no process ``<pid>`` is alive; and its lock file exists and nobody holds
    its lock (a live worker holds its own, whatever its pid namespace). Returns the folders removed.
    """
    if os.name != "posix":
        return []
    root = Path(root or tempfile.gettempdir())
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    me = os.getpid()
    for entry in entries:
        m = _STALE_RE.match(entry.name)
        if not m or int(m.group(1)) == me:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or _pid_alive(int(m.group(1))):
            continue
        fd = _lock(Path(entry.path) / TMP_LOCK_NAME)
        if fd is None:  # no lock file (not a worker's folder as we make them) or a live holder
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)
        if not os.path.lexists(entry.path):
            removed.append(Path(entry.path))
    if removed:
        logging.getLogger("medvolcore.serve").info("removed %d temporary folder(s) of stopped workers", len(removed))
    return removed


def release_tmp_dir(folder: Path, lock_fd: Optional[int]) -> None:
    """Remove the worker's temporary folder and release its lock."""
    shutil.rmtree(folder, ignore_errors=True)
    if lock_fd is not None:
        try:
            os.close(lock_fd)
        except OSError:
            pass
