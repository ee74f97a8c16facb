"""The workers behind ``medvol serve --http --devices``: one ``medvol serve --http`` process per
device on a private loopback port, started, watched and restarted here (:class:`Pool`).

Each worker is this Python running ``medvolcore.cli_serve`` with the front's options, bound to
``127.0.0.1`` on a port of its own choosing, answering only the front's private token (a file in
the front's private temporary folder). A ``cuda:N`` worker sees only GPU N
(``CUDA_VISIBLE_DEVICES=N``, ``--device cuda``); CPU workers share the CPUs this process may use
(``--threads`` each: those CPUs divided among them, unless ``--threads`` was given). A worker's
log lines come out on the front's stderr named by its device (``medvol serve [1 cuda:1]: …``).

A worker that exits is out of the ring at once (:meth:`Pool.pick` never chooses it) and is started
again after 1 s, then 2, 4, … up to 60 s while it keeps failing (the delay starts over once a
worker has served for 5 minutes). A worker started with the parent's death signal set
(Linux) stops when the front dies, even when the front is killed with SIGKILL.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence

from ..errors import InputError
from .lifecycle import PROG, say

__all__ = ["Member", "Pool", "parse_devices", "MAX_DEVICES"]

MAX_DEVICES = 32
START_TIMEOUT_S = 900.0  # a real preset loads its weights before the worker says it is ready
_DEVICE = re.compile(r"cpu|cuda(?::[0-9]{1,3})?")
_READY = re.compile(r"ready \(protocol 1\) on http://127\.0\.0\.1:([0-9]{1,5})\b")
_BACKOFF_MAX_S = 60.0
_STABLE_S = 300.0


def parse_devices(text: str) -> List[str]:
    """``--devices``: a comma-separated list of ``cpu`` and ``cuda:N`` (``cuda`` is ``cuda:0``);
    a device may be named more than once (two workers on one GPU, when its memory allows)."""
    items = [d.strip().lower() for d in str(text).split(",")]
    if not items or any(not d for d in items):
        raise InputError(f"--devices {text!r}: give a comma-separated list such as cuda:0,cuda:1 or cpu,cpu")
    for d in items:
        if not _DEVICE.fullmatch(d):
            raise InputError(f"--devices: {d!r} is not a device; use cpu or cuda:N (e.g. cuda:0,cuda:1)")
    if len(items) > MAX_DEVICES:
        raise InputError(f"--devices names {len(items)} workers; at most {MAX_DEVICES}")
    return ["cuda:0" if d == "cuda" else d for d in items]


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the front stops its workers itself
        pass


class Member:
    """One worker process: its ``device``, ``index`` (its place in the ring, kept across
    restarts), ``port`` once ready, and how often it was restarted."""

    def __init__(self, index: int, device: str, argv: Sequence[str], env: dict):
        self.index = index
        self.device = device
        self.argv = list(argv)
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None
        self.up = False
        self.restarts = 0
        self.started_at = 0.0
        self.next_start = 0.0
        self.backoff = 1.0
        self.last_exit: Optional[int] = None
        self.ready = threading.Event()
        self.tail = collections.deque(maxlen=20)  # its last log lines, for an error at start
        self.name = f"{index} {device}"

    def start(self) -> None:
        self.ready.clear()
        self.up, self.port = False, None
        self.tail.clear()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=_set_parent_death_signal if sys.platform.startswith("linux") else None)
        threading.Thread(target=self._read_log, args=(self.proc,), name=f"medvol-worker-{self.index}",
                         daemon=True).start()

    def _read_log(self, proc: subprocess.Popen) -> None:
        """Its stderr: the ready line gives the port (and is not passed on: the front says its
        own); every other line goes to the front's stderr, named by the device."""
        prefix = f"{PROG}: "
        for raw in iter(proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if not self.ready.is_set():
                m = _READY.search(line)
                if m:
                    self.port = int(m.group(1))
                    self.up = True
                    self.ready.set()
                    continue
                self.tail.append(line)
            text = line[len(prefix):] if line.startswith(prefix) else line
            sys.stderr.write(f"{PROG} [{self.name}]: {text}\n")
            sys.stderr.flush()
        proc.stderr.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, wait_s: float) -> None:
        """SIGTERM (the worker cancels what runs and removes its folder), SIGKILL after ``wait_s``."""
        self.up = False
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        except OSError:
            pass


class Pool:
    """The workers of one front, and the choice of a worker for a request (:meth:`pick`)."""

    def __init__(self, devices: Sequence[str], worker_args: Sequence[str], token_file: str,
                 threads: Optional[int] = None):
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n_cpu = sum(d == "cpu" for d in devices)
        self.members: List[Member] = []
        for i, device in enumerate(devices):
            env = dict(os.environ)
            args = [sys.executable, "-m", "medvolcore.cli_serve", "--http", "--host", "127.0.0.1", "--port", "0",
                    "--token-file", token_file, "--behind-front", *worker_args]
            if device == "cpu":
                args += ["--device", "cpu", "--threads", str(threads or max(1, cpus // max(1, n_cpu)))]
            else:
                env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
                args += ["--device", "cuda"] + (["--threads", str(threads)] if threads else [])
            self.members.append(Member(i, device, args, env))
        self._stopping = threading.Event()
        self._rr = itertools.count()
        self._watch = threading.Thread(target=self._supervise, name="medvol-workers", daemon=True)

    # -- lifecycle --
    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start every worker and wait until each is ready; raises :class:`InputError` (all
        stopped) naming the first that exits or does not get ready."""
        for m in self.members:
            m.start()
        deadline = time.monotonic() + timeout_s
        for m in self.members:
            while not m.ready.wait(0.2):
                if not m.alive() or time.monotonic() > deadline:
                    why = next((line for line in reversed(m.tail) if line.strip()), "")
                    self.stop(5)
                    how = (f"exited with code {m.proc.returncode}" if not m.alive()
                           else f"was not ready after {timeout_s:g} s")
                    raise InputError(f"the worker for {m.device} {how}" + (f": {why}" if why else ""))
        self._watch.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(0.25):
            now = time.monotonic()
            for m in self.members:
                if m.proc is not None and m.proc.poll() is not None and (m.up or not m.next_start):
                    m.up = False
                    m.last_exit = m.proc.returncode
                    if now - m.started_at > _STABLE_S:
                        m.backoff = 1.0
                    m.next_start = now + m.backoff
                    say(f"the worker for {m.device} ({m.name}) exited with code {m.last_exit}; "
                        f"starting it again in {m.backoff:g} s")
                    m.backoff = min(_BACKOFF_MAX_S, m.backoff * 2)
                elif m.next_start and now >= m.next_start and not self._stopping.is_set():
                    m.next_start = 0.0
                    m.restarts += 1
                    m.start()

    def stop(self, wait_s: float = 20.0) -> None:
        """Stop every worker (in parallel); none is started again."""
        self._stopping.set()
        threads = [threading.Thread(target=m.stop, args=(wait_s,), daemon=True) for m in self.members]
        for t in threads:
            t.start()
        for t in threads:
            t.join(wait_s + 15)

    def mark_gone(self, member: Member) -> None:
        """A connection to ``member`` failed: out of the ring if its process has exited."""
        if not member.alive():
            member.up = False

    # -- choosing --
    def up(self) -> List[Member]:
        return [m for m in self.members if m.up and m.port is not None]

    def pick(self, key: Optional[str], exclude=()) -> Optional[Member]:
        """The worker for ``key``: of the workers up and not in ``exclude``, the one scoring highest
        for it (rendezvous hashing: a key keeps its worker while that one is up, and only the keys
        of a worker that goes move). Without a key, the next worker in turn. None when none is up."""
        candidates = [m for m in self.up() if m not in exclude]
        if not candidates:
            return None
        if not key:
            return candidates[next(self._rr) % len(candidates)]
        return max(candidates, key=lambda m: hashlib.blake2b(f"{m.index}\0{key}".encode("utf-8", "replace"),
                                                              digest_size=8).digest())

    def summary(self) -> list:
        """Each worker as ``/status`` reports it: device, up, restarts, last exit code."""
        return [{"device": m.device, "up": m.up, "restarts": m.restarts, "last_exit": m.last_exit}
                for m in self.members]
