"""Real clients of ``medvol serve`` for the tests: a child process over stdio and over HTTP.

Imported by the worker tests as ``core.worker_clients`` (pytest puts ``Testing/`` on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

SERVE = [sys.executable, "-m", "medvolcore.cli_serve"]
TIMEOUT = 120


def reap(proc, timeout: float = 30) -> None:
    """Wait for a worker process to exit; kill it if it does not within ``timeout``."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class StdioClient:
    """A JSON-lines client of ``medvol serve --stdio`` running as a child process."""

    def __init__(self, *args):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(SERVE + ["--stdio", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env)
        self.lines: "queue.Queue" = queue.Queue()
        self.stderr: list = []
        self.raw_stdout: list = []
        threading.Thread(target=self._read_out, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read_out(self):
        for line in self.proc.stdout:
            self.raw_stdout.append(line)
            self.lines.put(json.loads(line))  # every stdout line must be JSON: fails loudly otherwise
        self.lines.put(None)

    def _read_err(self):
        for line in self.proc.stderr:
            self.stderr.append(line.decode("utf-8", "replace"))

    def send_raw(self, data: bytes) -> None:
        self.proc.stdin.write(data if data.endswith(b"\n") else data + b"\n")
        self.proc.stdin.flush()

    def send(self, obj) -> None:
        self.send_raw(json.dumps(obj).encode("utf-8"))

    def next(self, timeout=TIMEOUT):
        msg = self.lines.get(timeout=timeout)
        assert msg is not None, "the worker closed stdout; stderr:\n" + "".join(self.stderr[-20:])
        return msg

    def reply(self, rid, timeout=TIMEOUT, events=None):
        """Messages until the final reply of ``rid`` (progress events of ``rid`` go to ``events``)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.next(max(0.1, deadline - time.monotonic()))
            if msg.get("id") == rid and "event" in msg:
                if events is not None:
                    events.append(msg)
                continue
            if "event" not in msg:
                assert msg.get("id") == rid, f"expected the reply to {rid!r}, got {msg}"
                return msg

    def call(self, obj, **kw):
        self.send(obj)
        return self.reply(obj.get("id"), **kw)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            reap(self.proc)


class HttpServer:
    """``medvol serve --http`` on 127.0.0.1 with a free port, as a child process.

    ``request`` keeps the session id the server issues (``X-MedVol-Session``) unless told not to.
    """

    def __init__(self, *args):
        self.proc = subprocess.Popen(SERVE + ["--http", "--host", "127.0.0.1", "--port", "0", *args],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.port = None
        self.stderr: list = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline().decode("utf-8", "replace")
            if not line:
                break
            self.stderr.append(line)
            if "ready (protocol 1) on http://127.0.0.1:" in line:
                self.port = int(line.split("http://127.0.0.1:")[1].split()[0].rstrip("/;"))
                break
        assert self.port, "no ready line from medvol serve --http:\n" + "".join(self.stderr)
        threading.Thread(target=self._read_err, daemon=True).start()
        self.session = None

    def _read_err(self):
        for line in self.proc.stderr:
            self.stderr.append(line.decode("utf-8", "replace"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method, path, obj=None, token=None, timeout=TIMEOUT, headers=None, data=None,
                session=True, with_headers=False):
        """``(status, reply)`` (or ``(status, reply, headers)``); ``session``: True sends and keeps
        this client's session, a string sends that one, False sends none."""
        if data is None and obj is not None:
            data = json.dumps(obj).encode()
        h = {"Content-Type": "application/json"}
        if session is True and self.session:
            h["X-MedVol-Session"] = self.session
        elif isinstance(session, str):
            h["X-MedVol-Session"] = session
        h.update(headers or {})
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, body, rh = resp.status, resp.read(), resp.headers
        except urllib.error.HTTPError as e:
            status, body, rh = e.code, e.read(), e.headers
        if session is True and rh.get("X-MedVol-Session"):
            self.session = rh["X-MedVol-Session"]
        reply = json.loads(body)
        return (status, reply, rh) if with_headers else (status, reply)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            reap(self.proc)
