"""``medvol serve --stdio``: protocol 1 as JSON lines on stdin and stdout (how Slicer runs the worker).

stdout carries only protocol lines: the process keeps a private handle on it and sends file
descriptor 1 to stderr, so a stray ``print`` in any library (Python or C) cannot corrupt the
protocol. A line longer than the request limit is skipped with one ``too_large`` reply. The
worker stops on ``shutdown``, at end of input (after the queued requests), when stdout closes,
or on SIGINT/SIGTERM (cancelling what runs).
"""

from __future__ import annotations

import os
import sys
import threading

from .lifecycle import Stop, install_signals, say, stop_worker
from .protocol import PROTOCOL, encode_line, error_reply
from .worker import Worker, WorkerSettings

__all__ = ["serve_stdio"]


def _read_lines(stream, limit: int):
    """Yield each line (bytes) of ``stream``, or None for a line longer than ``limit`` bytes (skipped)."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while True:  # discard the rest of the oversized line
                chunk = stream.readline(1 << 20)
                if not chunk or chunk.endswith(b"\n"):
                    break
            yield None
            continue
        yield line



def serve_stdio(settings: WorkerSettings, stdin=None) -> int:
    """Serve stdin/stdout until the worker stops; returns the exit code."""
    # stdout is the protocol channel: keep a private handle on it and send fd 1 to stderr, so a
    # stray print() in any library (Python or C) can never corrupt the protocol.
    sys.stdout.flush()
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    write_lock = threading.Lock()
    broken = threading.Event()

    def emit(obj: dict) -> None:
        data = encode_line(obj)
        with write_lock:
            if broken.is_set():
                return
            try:
                proto.write(data)
                proto.flush()
            except (BrokenPipeError, OSError, ValueError):
                broken.set()

    limit = settings.max_request_bytes
    worker = Worker.from_settings(settings, "stdio", emit)
    stream = stdin if stdin is not None else sys.stdin.buffer
    old = install_signals()
    code, how = 0, "end of input"
    try:
        say(f"ready (protocol {PROTOCOL}) on stdio; temp dir {worker.tmp_dir}")
        for raw in _read_lines(stream, limit):
            if raw is None:
                emit(error_reply(None, "too_large",
                                 f"request line longer than --max-request-mb {settings.max_request_mb:g} MB; ignored"))
            elif raw.strip():
                worker.handle_line(raw)
            if worker.stopped.is_set():
                how = "shutdown"
                break
            if broken.is_set():
                how = "closed stdout"
                break
        if how == "end of input":
            worker.drain()
            while not worker.join(0.5):
                pass
    except Stop:
        how = "SIGTERM"
    except KeyboardInterrupt:
        how = "SIGINT"
    finally:
        done = stop_worker(worker, how, old)
        try:
            proto.close()
        except OSError:
            pass
    if not done:  # a request that cannot be interrupted (e.g. mid-generation): do not wait for it
        sys.stderr.flush()
        os._exit(code)
    return code
