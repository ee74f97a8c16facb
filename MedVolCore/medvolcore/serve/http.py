"""``medvol serve --http``: protocol 1 over HTTP (``POST /rpc``, ``GET /status``, ``GET /hello``).

The request and reply shapes, sessions and the trust boundary are ``docs/protocol.md``'s. What
this transport adds (``docs/architecture.md``, "Worker trust boundary"):

- binding to an address other than a loopback one needs a token (``--token-file``); with one,
  every request must carry ``Authorization: Bearer TOKEN``;
- a request whose ``Origin`` is not the server's own, whose ``Host`` is not a name of the bound
  address (or an ``--allowed-host``), or whose POST body is not ``application/json`` /
  ``application/octet-stream`` is refused before its body is read (what a web page could send to
  a server on 127.0.0.1);
- at most ``max_connections`` connections are served at once (more get 503 at once); a client
  gets ``client_timeout`` seconds to send its request line and headers, and 1 s more per 256 KB
  of body, else it is disconnected; the listen backlog is 128;
- one access-log line per request goes to stderr (client address, op, id, outcome, seconds;
  never the query, paths or volumes).

:class:`HttpServer` and :class:`Handler` are the transport; :func:`serve_http` runs it with a
worker until it stops. ``--port 0`` picks a free port, shown in the ready line
``medvol serve: ready (protocol 1) on http://HOST:PORT``.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import json
import os
import secrets
import select
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional, Sequence

from ..errors import InputError
from .lifecycle import Stop, install_signals, say, stop_worker
from .protocol import PROTOCOL, encode_line, error_reply, internal_reply
from .worker import Worker, WorkerSettings, log

__all__ = ["HttpSettings", "HttpServer", "Handler", "serve_http", "read_token", "is_loopback", "allowed_names",
           "DEFAULT_MAX_CONNECTIONS", "DEFAULT_CLIENT_TIMEOUT_S", "DEFAULT_PORT"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEFAULT_MAX_CONNECTIONS = 32
DEFAULT_CLIENT_TIMEOUT_S = 20.0
BODY_MIN_RATE = 256 << 10  # bytes/s a client must at least sustain while sending a body
LISTEN_BACKLOG = 128
MAX_SESSIONS = 4096
SESSION_HEADER = "X-MedVol-Session"


@dataclass
class HttpSettings:
    """The HTTP transport's settings (``medvol serve --http`` options).

    ``token_file``: the bearer token every request must carry (required off loopback).
    ``allowed_hosts``: more names clients may put in ``Host`` (a proxy's DNS name).
    ``client_timeout``: seconds for a request's line and headers (a body gets 1 s more per 256 KB).
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    token_file: Optional[str] = None
    allowed_hosts: Sequence[str] = ()
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT_S


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(path) -> str:
    p = Path(path)
    try:
        token = p.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise InputError(f"cannot read --token-file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise InputError(f"--token-file {p} is not text") from None
    if not token or any(c.isspace() for c in token):
        raise InputError(f"--token-file {p} must hold one token (a single line without spaces)")
    if len(token) < 16:
        raise InputError(f"--token-file {p}: the token is {len(token)} characters; use at least 16 "
                         "(e.g. `python -c \"import secrets; print(secrets.token_urlsafe(32))\"`)")
    try:
        mode = p.stat().st_mode
    except OSError:
        mode = 0
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("--token-file %s can be read by other users of this machine (mode %s); run `chmod 600 %s`",
                    p, oct(stat.S_IMODE(mode)), p)
    return token


def _host_names(host: str) -> Optional[set]:
    """Names a ``Host``/``Origin`` may carry for a server bound to ``host`` (None: any, for a wildcard bind)."""
    h = host.strip("[]").lower()
    if h in ("0.0.0.0", "::", ""):
        return None
    names = {h}
    if is_loopback(h):
        names |= {"localhost", "127.0.0.1", "::1"}
    return names


def _split_host(value: str) -> str:
    """``name[:port]`` or ``[v6]:port`` → the lower-case name without brackets or port."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


class _Watchdog:
    """Disconnects clients that are too slow: each connection has a deadline while the server
    waits for its request line, headers or body; past it the socket is shut down, which ends
    the blocked read in the handler thread (a slow-drip client cannot hold a thread for ever)."""

    def __init__(self):
        self._deadlines = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="medvol-http-watchdog", daemon=True).start()

    def arm(self, conn, seconds: float) -> None:
        with self._lock:
            self._deadlines[conn] = time.monotonic() + seconds

    def disarm(self, conn) -> None:
        with self._lock:
            self._deadlines.pop(conn, None)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                late = [c for c, t in self._deadlines.items() if t < now]
                for c in late:
                    del self._deadlines[c]
            for c in late:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()

def allowed_names(host: str, extra: Sequence[str] = ()) -> Optional[set]:
    """Every name a ``Host`` header may carry for a server bound to ``host`` plus ``extra`` (None:
    any, for a wildcard bind without extra names)."""
    allowed = _host_names(host)
    extra_hosts = {h.strip().lower() for h in (extra or ())}
    if allowed is not None or extra_hosts:
        allowed = (allowed or set()) | extra_hosts
    return allowed


class Handler(BaseHTTPRequestHandler):
    """One connection: checks on the headers, then one request at a time handed to the worker."""

    server_version = "medvol-serve/1"
    protocol_version = "HTTP/1.1"
    session = None
    server: "HttpServer"

    def setup(self):
        self.timeout = self.server.settings.client_timeout  # a read that waits longer drops the connection
        super().setup()

    def log_message(self, fmt, *a):  # noqa: D401
        if self.server.debug:
            say("http: " + (fmt % a))

    def _access(self, op, rid, outcome, t0) -> None:
        log.info("http %s %s id=%s -> %s (%.2f s)", self.client_address[0], op, json.dumps(rid)[:40], outcome,
                 time.monotonic() - t0)

    # -- connection life: deadlines while we wait for the client --
    def handle_one_request(self):
        self.server.watchdog.arm(self.connection, self.server.settings.client_timeout)  # request line + headers (and keep-alive idle)
        try:
            super().handle_one_request()
        finally:
            self.server.watchdog.disarm(self.connection)

    def finish(self):
        self.server.watchdog.disarm(self.connection)
        super().finish()

    def _send(self, status: int, obj: dict, close: bool = False) -> None:
        body = encode_line(obj)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        if self.session:
            self.send_header(SESSION_HEADER, self.session)
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="medvol"')
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def _refuse(self, status: int, code: str, message: str) -> None:
        log.warning("http %s %s %s refused: %s", self.client_address[0], self.command, self.path[:80], message)
        self._send(status, error_reply(None, code, message), close=True)

    # -- checks done on the headers alone, before any body is read --
    def _checks(self) -> bool:
        self.server.watchdog.disarm(self.connection)  # the headers are in; a body gets its own deadline
        allowed = self.server.allowed
        if allowed is not None:
            host = self.headers.get("Host")
            if host is not None and _split_host(host) not in allowed:
                self._refuse(403, "forbidden", f"Host {host[:100]!r} is not this server's name; "
                                               "start it with --allowed-host NAME to accept it")
                return False
        origin = self.headers.get("Origin")
        if origin is not None:
            o = origin.strip().lower()
            port = self.server.server_address[1]
            names = allowed if allowed is not None else {_split_host(self.headers.get("Host", ""))}
            own = {f"{scheme}://{n if ':' not in n else '[' + n + ']'}:{port}" for n in names
                   for scheme in ("http", "https")}
            if o not in own:
                self._refuse(403, "forbidden", f"cross-origin requests are refused (Origin {origin[:100]!r})")
                return False
        token = self.server.token
        if token is not None:
            got = self.headers.get("Authorization", "")
            scheme, _, value = got.partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())):
                self._refuse(401, "unauthorized", "missing or wrong token: send 'Authorization: Bearer TOKEN'")
                return False
        self.session = self._session()
        return True

    def _session(self) -> str:
        """The caller's session id: the one it sent if the server issued it, else a new one."""
        sid = (self.headers.get(SESSION_HEADER) or "").strip()
        sessions = self.server.sessions
        with self.server.sessions_lock:
            if sid in sessions:
                sessions.move_to_end(sid)
                return sid
            sid = secrets.token_urlsafe(18)
            sessions[sid] = time.time()
            while len(sessions) > MAX_SESSIONS:
                sessions.popitem(last=False)
            return sid

    def _client_gone(self) -> bool:
        """True when the client closed its side (a blocking POST /rpc was abandoned)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _call(self, raw, body=None) -> None:
        t0 = time.monotonic()
        done = threading.Event()
        box = {}

        def reply(obj):
            if "event" in obj:
                return
            box["reply"] = obj
            done.set()

        job = self.server.worker.handle_line(raw, reply=reply, body=body, transport="http", session=self.session)
        while not done.wait(0.25):
            if job is not None and self._client_gone():
                self.server.worker.abandon(job)
                self._access(job.op, job.id, "client disconnected: cancelled", t0)
                self.close_connection = True
                return
        r = box["reply"]
        op = job.op if job is not None else "-"
        self._access(op, r.get("id"), "ok" if r.get("ok") else r.get("error", {}).get("code"), t0)
        self._send(200, r)
        if self.server.worker.stopped.is_set():
            threading.Thread(target=self.server.shutdown, daemon=True).start()

    def _guarded(self, method) -> None:
        try:
            method()
        except (ConnectionError, socket.timeout):
            self.close_connection = True
        except Exception:  # noqa: BLE001 - a bad request never kills the server or goes unanswered
            self.close_connection = True
            try:
                self._send(500, internal_reply(None, f"HTTP {self.command} {self.path[:80]}"), close=True)
            except Exception:  # noqa: BLE001
                pass

    def do_GET(self):  # noqa: N802
        self._guarded(self._get)

    def do_POST(self):  # noqa: N802
        self._guarded(self._post)

    def _get(self):
        if not self._checks():
            return
        path = self.path.split("?", 1)[0].rstrip("/")
        if path in ("/status", "/hello"):
            self._call(json.dumps({"id": None, "op": path[1:]}))
        else:
            self._send(404, error_reply(None, "not_found", "no such path; use POST /rpc, GET /status or GET /hello"))

    def _post(self):
        if not self._checks():
            return
        if self.path.split("?", 1)[0].rstrip("/") != "/rpc":
            self._send(404, error_reply(None, "not_found", "no such path; POST requests go to /rpc"), close=True)
            return
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype not in ("application/json", "application/octet-stream"):
            self._refuse(415, "bad_request", f"Content-Type must be application/json (a request) or "
                                             f"application/octet-stream (a volume), got {ctype or 'none'!r}")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit() or len(length.strip()) > 15:
            self._send(411, error_reply(None, "bad_request", "a Content-Length header is required"), close=True)
            return
        n = int(length)
        limit = self.server.limit
        if n > limit:
            # read (and drop) a moderately oversized body so the client sees the reply, not a reset
            left = n if n <= 4 * limit + (16 << 20) else 0
            self.server.watchdog.arm(self.connection, self.server.settings.client_timeout + left / BODY_MIN_RATE)
            while left > 0:
                chunk = self.rfile.read(min(left, 1 << 20))
                if not chunk:
                    break
                left -= len(chunk)
            self._send(413, error_reply(None, "too_large", f"request body of {n} bytes is over --max-request-mb "
                                                            f"{limit / (1 << 20):g} MB"), close=True)
            return
        self.server.watchdog.arm(self.connection, self.server.settings.client_timeout + n / BODY_MIN_RATE)
        data = self.rfile.read(n)
        self.server.watchdog.disarm(self.connection)
        if len(data) < n:
            self.close_connection = True
            return
        if ctype == "application/json":
            self._call(data)
        else:  # raw volume bytes; the request object rides in a header
            header = self.headers.get("X-MedVol-Request")
            if header is None:
                self._send(200, error_reply(None, "bad_request", "a volume body needs the request object in the "
                                                                 "X-MedVol-Request header"))
                return
            self._call(header, body=data)

    def do_PUT(self):  # noqa: N802
        self._send(405, error_reply(None, "bad_request", "use POST /rpc"), close=True)

    do_DELETE = do_PATCH = do_PUT


class HttpServer(ThreadingHTTPServer):
    """The HTTP transport of one worker: a thread per connection, at most ``max_connections`` at once."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, settings: "HttpSettings", worker: Worker, token: Optional[str], debug: bool = False):
        self.settings = settings
        self.worker = worker
        self.token = token
        self.debug = bool(debug)
        self.limit = worker.max_request_bytes
        self.allowed = allowed_names(settings.host, settings.allowed_hosts)
        self.watchdog = _Watchdog()
        self.sessions: "collections.OrderedDict[str, float]" = collections.OrderedDict()
        self.sessions_lock = threading.Lock()
        self._active = 0
        self._active_lock = threading.Lock()
        self.peak_connections = 0
        host = settings.host
        if ":" in host.strip("[]"):
            self.address_family = socket.AF_INET6
            host = host.strip("[]")
        try:
            super().__init__((host, settings.port), Handler)
        except BaseException:
            self.watchdog.close()
            raise

    def process_request(self, request, client_address):
        with self._active_lock:
            full = self._active >= self.settings.max_connections
            if not full:
                self._active += 1
                self.peak_connections = max(self.peak_connections, self._active)
        if full:  # answer at once from the accept loop, without a thread
            body = encode_line(error_reply(None, "busy", f"the server already serves {self.settings.max_connections} "
                                                         "connections; try again later"))
            head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 5\r\n\r\n").encode()
            try:
                request.setblocking(False)
                request.send(head + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._active_lock:
                self._active -= 1

    @property
    def active_connections(self) -> int:
        return self._active

    def server_close(self):
        self.watchdog.close()
        super().server_close()


def serve_http(settings: WorkerSettings, http: HttpSettings) -> int:
    """Serve HTTP until the worker stops (``shutdown``, SIGINT, SIGTERM); returns the exit code."""
    token = read_token(http.token_file) if http.token_file else None
    if token is None and not is_loopback(http.host):
        raise InputError(f"refusing to listen on {http.host} without a token: binding to a non-loopback address "
                         "needs --token-file FILE (every request must then send 'Authorization: Bearer TOKEN')")
    if settings.data_dir is not None:
        d = Path(settings.data_dir).expanduser()
        if not d.is_dir():
            raise InputError(f"--data-dir {d} is not a folder")
        settings.data_dir = d
    worker = Worker.from_settings(settings, "http", preload=False)  # the preset loads once the port is ours
    try:
        server = HttpServer(http, worker, token, debug=settings.debug)
    except OSError as e:
        worker.close(0)
        raise InputError(f"cannot listen on {http.host}:{http.port}: {e.strerror or e}") from None
    if settings.preset:
        worker.preload(settings.preset, settings.adapter)
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    old = install_signals()
    how = "shutdown"
    try:
        say(f"ready (protocol {PROTOCOL}) on http://{shown}:{port}" + (" (token required)" if token else "")
            + (f"; data folder {worker.data_dir}" if worker.data_dir else "; no server paths (volumes come in requests)"))
        server.serve_forever(poll_interval=0.25)
    except Stop:
        how = "SIGTERM"
    except KeyboardInterrupt:
        how = "SIGINT"
    finally:
        done = stop_worker(worker, how, old, before_close=server.server_close)
    if not done:
        sys.stderr.flush()
        os._exit(0)
    return 0
