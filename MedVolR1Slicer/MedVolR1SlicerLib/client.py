"""Clients of the MedVol worker (``medvol serve``, protocol 1), free of Qt and of medvolcore.

:class:`StdioWorker` runs ``medvol serve --stdio`` as a child process with Slicer's Python and
keeps it for the session; :class:`.remoteworker.RemoteWorker` talks to ``medvol serve --http``
elsewhere.
Both give the same interface:

* ``submit(op, **fields) -> Job``: queue a request; returns at once.
* ``poll(timeout=0)``: deliver what arrived (progress, replies, a crash) by emitting the jobs'
  signals **on the calling thread**. The Slicer widget calls it from a ``qt.QTimer``, so GUI
  code never runs on a reader thread; a headless script calls :meth:`wait`.
* ``cancel(job)``: ask the worker to stop the request; if it has not stopped within
  ``cancel_grace_s`` the stdio worker's whole process tree is killed and the job ends as
  cancelled. The next request starts a fresh worker.

A worker that dies fails every pending job with code ``worker_crashed`` (its exit code and the
end of its log in the message); the next ``submit`` restarts it.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .signals import Signal

PROTOCOL = 1
SESSION_HEADER = "X-MedVol-Session"  # the remote worker scopes status and cancel to it
STAGES = ("load", "read", "ground", "propagate", "write")
MASK_TYPE = "application/gzip"  # asked for in ``Accept``: the worker sends the mask as the reply body
REPLY_HEADER = "X-MedVol-Reply"  # … and the reply envelope in this header
UPLOAD_GZIP_LEVEL = 1  # the fastest level: see docs/benchmarks.md for the upload figures


class WorkerError(Exception):
    """A request failed: ``code`` is the worker's error code (or ``worker_crashed``, ``worker_start``,
    ``connection``, ``cancelled``), ``message`` says what to do."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.message = message


class Job:
    """One request. ``state``: ``queued`` → ``running`` → ``done`` | ``failed`` | ``cancelled``.

    Signals: ``progress(job)`` after ``stage``/``fraction``/``message`` change;
    ``finished(job)`` once, with ``result`` (a dict) or ``error`` (a :class:`WorkerError`).
    """

    def __init__(self, rid: str, op: str, request: dict):
        self.id = rid
        self.op = op
        self.request = request
        self.state = "queued"
        self.stage: Optional[str] = None
        self.fraction = 0.0
        self.message = ""
        self.eta_s: Optional[float] = None  # the worker's estimate of the time left in the stage
        self.result: Optional[dict] = None
        self.error: Optional[WorkerError] = None
        self.cancel_requested_at: Optional[float] = None
        self.progress = Signal("progress")
        self.finished = Signal("finished")

    @property
    def done(self) -> bool:
        return self.state in ("done", "failed", "cancelled")

    def _set_progress(self, stage, fraction, message, eta_s=None) -> None:
        if self.done:
            return
        self.state = "running"
        self.eta_s = eta_s if isinstance(eta_s, (int, float)) and not isinstance(eta_s, bool) else None
        self.stage = stage
        try:
            self.fraction = min(1.0, max(0.0, float(fraction)))
        except (TypeError, ValueError):
            pass
        self.message = str(message or "")
        self.progress.emit(self)

    def _finish(self, result: Optional[dict] = None, error: Optional[WorkerError] = None) -> None:
        if self.done:
            return
        self.result, self.error = result, error
        if error is None:
            self.state = "done"
        elif error.code == "cancelled":
            self.state = "cancelled"
        else:
            self.state = "failed"
        self.finished.emit(self)

    def __repr__(self) -> str:
        return f"Job({self.id!r}, {self.op!r}, {self.state})"


def worker_command(python: str, device: str = "auto", threads: Optional[int] = None,
                   extra: Sequence[str] = ()) -> List[str]:
    """``python -m medvolcore.cli_serve --stdio …``: the command Slicer starts (its own Python)."""
    cmd = [str(python), "-m", "medvolcore.cli_serve", "--stdio", "--device", device]
    if threads:
        cmd += ["--threads", str(int(threads))]
    return cmd + list(extra)


def kill_process_tree(pid: int) -> None:
    """Kill a process and its children. The stdio worker is started as a group leader, so
    on POSIX the whole group goes; on Windows ``taskkill /T`` walks the tree."""
    if os.name == "nt":
        subprocess.run(["taskkill", "/F", "/T", "/PID", str(pid)], capture_output=True)
        return
    try:
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _BaseWorker:
    def __init__(self, cancel_grace_s: float = 5.0):
        self.cancel_grace_s = float(cancel_grace_s)
        self._inbox: "queue.Queue" = queue.Queue()
        self._jobs: Dict[str, Job] = {}
        self._ids = itertools.count(1)
        self.crashed = Signal("crashed")  # (WorkerError) when the worker died with jobs pending or not

    @property
    def pending(self) -> List[Job]:
        return [j for j in self._jobs.values() if not j.done]

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def _new_job(self, op: str, fields: dict) -> Job:
        rid = f"slicer-{next(self._ids)}"
        req = {"id": rid, "op": op}
        req.update({k: v for k, v in fields.items() if v is not None})
        job = Job(rid, op, req)
        self._jobs[rid] = job
        return job

    def _dispatch(self, msg: dict) -> None:
        job = self._jobs.get(msg.get("id")) if isinstance(msg.get("id"), str) else None
        if job is None:
            return
        if msg.get("event") == "progress":
            job._set_progress(msg.get("stage"), msg.get("fraction", 0.0), msg.get("message"), msg.get("eta_s"))
            return
        if msg.get("ok") is True:
            self._on_result(job, msg.get("result") or {})
        elif msg.get("ok") is False:
            err = msg.get("error") or {}
            job._finish(error=WorkerError(str(err.get("code") or "internal"), str(err.get("message") or "failed")))
        if job.done:
            self._jobs.pop(job.id, None)

    def _on_result(self, job: Job, result: dict) -> None:
        job._finish(result=result)

    def poll(self, timeout: float = 0.0) -> int:
        """Deliver arrived messages on this thread; returns how many were handled."""
        n = 0
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            left = deadline - time.monotonic()
            try:
                item = self._inbox.get(timeout=left) if (left > 0 and n == 0) else self._inbox.get_nowait()
            except queue.Empty:
                break
            n += 1
            kind, payload = item
            if kind == "msg":
                self._dispatch(payload)
            elif kind == "exit":
                self._on_exit(payload)
        self._check_cancel_deadlines()
        return n

    def wait(self, job: Job, timeout: Optional[float] = None) -> Job:
        """Poll until ``job`` is finished (headless use). Raises ``TimeoutError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not job.done:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{job.op} request {job.id} did not finish in {timeout:g} s")
            self.poll(0.1)
        return job

    def call(self, op: str, timeout: Optional[float] = None, **fields) -> dict:
        """Submit and wait; the result, or the job's :class:`WorkerError` raised."""
        job = self.wait(self.submit(op, **fields), timeout)
        if job.error is not None:
            raise job.error
        return job.result

    def _check_cancel_deadlines(self) -> None:
        pass

    def _on_exit(self, payload) -> None:
        pass


class StdioWorker(_BaseWorker):
    """``medvol serve --stdio`` in a child process, started on the first request."""

    def __init__(self, command: Sequence[str], env: Optional[dict] = None, cwd: Optional[str] = None,
                 cancel_grace_s: float = 5.0, stderr_lines: int = 200):
        super().__init__(cancel_grace_s)
        self.command = [str(c) for c in command]
        self.env = env
        self.cwd = cwd
        self.proc: Optional[subprocess.Popen] = None
        self.stderr_tail: "collections.deque[str]" = collections.deque(maxlen=stderr_lines)
        self.starts = 0
        self._lock = threading.Lock()
        self._generation = 0
        self.started = Signal("started")  # (pid)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        if self.running:
            return
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("PYTHONIOENCODING", "utf-8")
        kw = {}
        if os.name == "nt":
            kw["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP  # type: ignore[attr-defined]
        else:
            kw["start_new_session"] = True
        try:
            proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, cwd=self.cwd, **kw)
        except OSError as e:
            raise WorkerError("worker_start", f"cannot start the MedVol worker ({self.command[0]}): "
                                              f"{e.strerror or e}") from None
        with self._lock:
            self._generation += 1
            gen = self._generation
            self.proc = proc
        self.stderr_tail.clear()
        self.starts += 1
        threading.Thread(target=self._read_stdout, args=(proc, gen), daemon=True, name="medvol-stdout").start()
        threading.Thread(target=self._read_stderr, args=(proc,), daemon=True, name="medvol-stderr").start()
        self.started.emit(proc.pid)

    def _read_stdout(self, proc: subprocess.Popen, gen: int) -> None:
        for raw in proc.stdout:
            try:
                msg = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                self.stderr_tail.append("unreadable protocol line: " + raw[:200].decode("utf-8", "replace"))
                continue
            if isinstance(msg, dict):
                self._inbox.put(("msg", msg))
        code = proc.wait()
        self._inbox.put(("exit", (gen, code)))

    def _read_stderr(self, proc: subprocess.Popen) -> None:
        for raw in proc.stderr:
            self.stderr_tail.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def submit(self, op: str, **fields) -> Job:
        self.start()
        job = self._new_job(op, fields)
        try:
            self._send(job.request)
        except WorkerError as e:
            job._finish(error=e)
        return job

    def _send(self, obj: dict) -> None:
        data = (json.dumps(obj) + "\n").encode("utf-8")
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError, AttributeError):
            raise WorkerError("worker_crashed", "the MedVol worker is not running (it exited); "
                                                "it will be restarted on the next request" + self._log_hint()) from None

    def cancel(self, job: Job) -> None:
        """Ask the worker to cancel ``job``; kill the process tree if it has not stopped in time."""
        if job.done or job.cancel_requested_at is not None:
            return
        job.cancel_requested_at = time.monotonic()
        try:
            self._send({"id": f"{job.id}-cancel", "op": "cancel", "target": job.id})
        except WorkerError:
            pass  # it is gone: the exit handler fails the job

    def _check_cancel_deadlines(self) -> None:
        now = time.monotonic()
        late = [j for j in self.pending if j.cancel_requested_at is not None and now - j.cancel_requested_at > self.cancel_grace_s]
        if late and self.proc is not None:
            self.kill()
            for j in self.pending:
                j._finish(error=WorkerError("cancelled", f"cancelled; the worker did not stop within "
                                                         f"{self.cancel_grace_s:g} s and was stopped"))

    def _on_exit(self, payload) -> None:
        gen, code = payload
        if gen != self._generation:
            return
        pending = self.pending
        err = WorkerError("worker_crashed", f"the MedVol worker stopped (exit code {code})" + self._log_hint()
                          + "; it will be restarted on the next request")
        for j in pending:
            j._finish(error=err if j.cancel_requested_at is None else WorkerError("cancelled", "cancelled"))
        self._jobs.clear()
        if code != 0 or pending:
            self.crashed.emit(err)

    def _log_hint(self) -> str:
        lines = [l for l in self.stderr_tail if l.strip()]
        return (". Last log line: " + lines[-1].strip()) if lines else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_process_tree(self.proc.pid)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to shut down; kill it if it does not within ``timeout``."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                self._send({"id": "slicer-shutdown", "op": "shutdown"})
                proc.stdin.close()
            except (WorkerError, OSError):
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.poll()
        for j in self.pending:
            j._finish(error=WorkerError("cancelled", "the worker was stopped"))
        self._jobs.clear()


def python_for_worker() -> str:
    """The Python that runs the local worker: ``PythonSlicer`` inside Slicer, else this one."""
    found = shutil.which("PythonSlicer")
    if found:
        return found
    exe = Path(sys.executable)
    for name in ("PythonSlicer", "PythonSlicer.exe"):
        cand = exe.with_name(name)
        if cand.exists():
            return str(cand)
    return sys.executable
