"""``medvol serve``: the persistent worker over stdio or HTTP (protocol 1, see :mod:`medvolcore.worker`).

    medvol serve --stdio [--preset P] [--device cpu|cuda|auto] [--max-request-mb N]
    medvol serve --http [--host 127.0.0.1] [--port N] [--token-file F] [...]

Over stdio, stdout carries only protocol lines (anything else a library prints is sent to
stderr); the ready line and logs go to stderr. Over HTTP, binding to an address other than a
loopback one needs ``--token-file``; ``--port 0`` picks a free port, shown in the ready line
``medvol serve: ready (protocol 1) on http://HOST:PORT``.

HTTP hardening (see the worker's docstring for the trust boundary): a request whose ``Origin``
is not the server's own, whose ``Host`` is not a name of the bound address (or an
``--allowed-host``), or whose POST body is not ``application/json`` / ``application/octet-stream``
is refused before it is read (what a web page could send to a server on 127.0.0.1); at most
``--max-connections`` connections are served at once (more get 503 at once); a client gets
``--client-timeout`` seconds to send a request's line and headers (and proportionally more for
a body), else it is disconnected; the listen backlog is 128. One access-log line per request
goes to stderr (client address, op, id, outcome, seconds; never the query, paths or volumes).
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import json
import logging
import os
import secrets
import select
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

from .errors import InputError
from .worker import (DEFAULT_CACHE_SIZE, DEFAULT_MAX_REQUEST_MB, DEFAULT_MAX_VOXELS, PROTOCOL, Worker, encode_line,
                     error_reply)

PROG = "medvol serve"
log = logging.getLogger("medvolcore")
STOP_GRACE_S = 15.0
DEFAULT_MAX_CONNECTIONS = 32
DEFAULT_CLIENT_TIMEOUT_S = 20.0
BODY_MIN_RATE = 256 << 10  # bytes/s a client must at least sustain while sending a body
LISTEN_BACKLOG = 128
MAX_SESSIONS = 4096
SESSION_HEADER = "X-MedVol-Session"


class _Stop(BaseException):
    """Raised in the main thread by SIGTERM (SIGINT raises KeyboardInterrupt)."""


def _say(text: str) -> None:
    sys.stderr.write(f"{PROG}: {text}\n")
    sys.stderr.flush()


class _StderrLog(logging.Handler):
    def emit(self, record):
        try:
            sys.stderr.write(f"{PROG}: {record.levelname.lower()}: {record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            pass


def _setup_logging(debug: bool) -> None:
    logger = logging.getLogger("medvolcore")
    for h in list(logger.handlers):  # the server owns stderr logging (no duplicate lines from the CLI's handler)
        logger.removeHandler(h)
    logger.addHandler(_StderrLog(level=logging.DEBUG if debug else logging.INFO))
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    logger.propagate = False


def _install_signals() -> dict:
    """SIGTERM raises _Stop in the main thread; SIGINT stays KeyboardInterrupt."""
    old = {}

    def _term(signum, frame):
        raise _Stop()

    if threading.current_thread() is threading.main_thread():
        old[signal.SIGTERM] = signal.signal(signal.SIGTERM, _term)
        old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    return old


def _quiet_signals() -> None:
    """During the clean-up a second signal must not interrupt it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


# ---- stdio ----------------------------------------------------------------------------------


def _stop_worker(worker, how: str, old_signals: dict, before_close=None) -> bool:
    """Cancel what runs, wait up to STOP_GRACE_S, clean up and restore the signal handlers.

    Returns whether the worker thread finished in time.
    """
    _quiet_signals()
    worker.stop(f"the worker is stopping ({how})")
    done = worker.join(STOP_GRACE_S)
    if before_close is not None:
        before_close()
    worker.close(0)
    _say(f"stopped ({how})")
    for sig, handler in old_signals.items():
        signal.signal(sig, handler)
    return done


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


def serve_stdio(args, stdin=None) -> int:
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

    limit = int(args.max_request_mb * (1 << 20))
    worker = Worker(emit, default_preset=args.preset, device=args.device, cache_size=args.cache_size,
                    transport="stdio", max_request_bytes=limit, threads=args.threads, max_voxels=args.max_voxels)
    if args.preset:
        worker.preload(args.preset, getattr(args, "adapter", None))
    stream = stdin if stdin is not None else sys.stdin.buffer
    old = _install_signals()
    code, how = 0, "end of input"
    try:
        _say(f"ready (protocol {PROTOCOL}) on stdio; temp dir {worker.tmp_dir}")
        for raw in _read_lines(stream, limit):
            if raw is None:
                emit(error_reply(None, "too_large",
                                 f"request line longer than --max-request-mb {args.max_request_mb:g} MB; ignored"))
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
    except _Stop:
        how = "SIGTERM"
    except KeyboardInterrupt:
        how = "SIGINT"
    finally:
        done = _stop_worker(worker, how, old)
        try:
            proto.close()
        except OSError:
            pass
    if not done:  # a request that cannot be interrupted (e.g. mid-generation): do not wait for it
        sys.stderr.flush()
        os._exit(code)
    return code


# ---- HTTP -----------------------------------------------------------------------------------

def _is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _read_token(path) -> str:
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
    if _is_loopback(h):
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


def make_http_server(args, worker: Worker, token: Optional[str]):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    limit = int(args.max_request_mb * (1 << 20))
    debug = bool(getattr(args, "debug", False))
    client_timeout = float(getattr(args, "client_timeout", DEFAULT_CLIENT_TIMEOUT_S))
    max_connections = int(getattr(args, "max_connections", DEFAULT_MAX_CONNECTIONS))
    allowed = _host_names(args.host)
    extra_hosts = {h.strip().lower() for h in (getattr(args, "allowed_host", None) or [])}
    if allowed is not None or extra_hosts:
        allowed = (allowed or set()) | extra_hosts
    watchdog = _Watchdog()
    sessions: "collections.OrderedDict[str, float]" = collections.OrderedDict()
    sessions_lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        server_version = "medvol-serve/1"
        protocol_version = "HTTP/1.1"
        timeout = client_timeout  # a single read that waits longer than this drops the connection
        session = None

        def log_message(self, fmt, *a):  # noqa: D401
            if debug:
                _say("http: " + (fmt % a))

        def _access(self, op, rid, outcome, t0) -> None:
            log.info("http %s %s id=%s -> %s (%.2f s)", self.client_address[0], op, json.dumps(rid)[:40], outcome,
                     time.monotonic() - t0)

        # -- connection life: deadlines while we wait for the client --
        def handle_one_request(self):
            watchdog.arm(self.connection, client_timeout)  # request line + headers (and keep-alive idle)
            try:
                super().handle_one_request()
            finally:
                watchdog.disarm(self.connection)

        def finish(self):
            watchdog.disarm(self.connection)
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
            watchdog.disarm(self.connection)  # the headers are in; a body gets its own deadline
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
            with sessions_lock:
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

            job = worker.handle_line(raw, reply=reply, body=body, transport="http", session=self.session)
            while not done.wait(0.25):
                if job is not None and self._client_gone():
                    worker.abandon(job)
                    self._access(job.op, job.id, "client disconnected: cancelled", t0)
                    self.close_connection = True
                    return
            r = box["reply"]
            op = job.op if job is not None else "-"
            self._access(op, r.get("id"), "ok" if r.get("ok") else r.get("error", {}).get("code"), t0)
            self._send(200, r)
            if worker.stopped.is_set():
                threading.Thread(target=self.server.shutdown, daemon=True).start()

        def _guarded(self, method) -> None:
            try:
                method()
            except (ConnectionError, socket.timeout):
                self.close_connection = True
            except Exception:  # noqa: BLE001 - a bad request never kills the server or goes unanswered
                self.close_connection = True
                try:
                    self._send(500, Worker._internal_reply(None, f"HTTP {self.command} {self.path[:80]}"), close=True)
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
            if n > limit:
                # read (and drop) a moderately oversized body so the client sees the reply, not a reset
                left = n if n <= 4 * limit + (16 << 20) else 0
                watchdog.arm(self.connection, client_timeout + left / BODY_MIN_RATE)
                while left > 0:
                    chunk = self.rfile.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    left -= len(chunk)
                self._send(413, error_reply(None, "too_large", f"request body of {n} bytes is over --max-request-mb "
                                                                f"{args.max_request_mb:g} MB"), close=True)
                return
            watchdog.arm(self.connection, client_timeout + n / BODY_MIN_RATE)
            data = self.rfile.read(n)
            watchdog.disarm(self.connection)
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

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        allow_reuse_address = True
        request_queue_size = LISTEN_BACKLOG

        def __init__(self, *a, **kw):
            self._active = 0
            self._active_lock = threading.Lock()
            self.peak_connections = 0
            super().__init__(*a, **kw)

        def process_request(self, request, client_address):
            with self._active_lock:
                full = self._active >= max_connections
                if not full:
                    self._active += 1
                    self.peak_connections = max(self.peak_connections, self._active)
            if full:  # answer at once from the accept loop, without a thread
                body = encode_line(error_reply(None, "busy", f"the server already serves {max_connections} "
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
            watchdog.close()
            super().server_close()

    host = args.host
    if ":" in host.strip("[]"):
        Server.address_family = socket.AF_INET6
        host = host.strip("[]")
    return Server((host, args.port), Handler)


def serve_http(args) -> int:
    token = _read_token(args.token_file) if args.token_file else None
    if token is None and not _is_loopback(args.host):
        raise InputError(f"refusing to listen on {args.host} without a token: binding to a non-loopback address "
                         "needs --token-file FILE (every request must then send 'Authorization: Bearer TOKEN')")
    data_dir = getattr(args, "data_dir", None)
    if data_dir is not None:
        d = Path(data_dir).expanduser()
        if not d.is_dir():
            raise InputError(f"--data-dir {d} is not a folder")
        data_dir = d
    limit = int(args.max_request_mb * (1 << 20))
    worker = Worker(None, default_preset=args.preset, device=args.device, cache_size=args.cache_size,
                    transport="http", max_request_bytes=limit, threads=args.threads, data_dir=data_dir,
                    max_voxels=args.max_voxels)
    try:
        server = make_http_server(args, worker, token)
    except OSError as e:
        worker.close(0)
        raise InputError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    if args.preset:
        worker.preload(args.preset, getattr(args, "adapter", None))
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    old = _install_signals()
    how = "shutdown"
    try:
        _say(f"ready (protocol {PROTOCOL}) on http://{shown}:{port}" + (" (token required)" if token else "")
             + (f"; data folder {worker.data_dir}" if worker.data_dir else "; no server paths (volumes come in requests)"))
        server.serve_forever(poll_interval=0.25)
    except _Stop:
        how = "SIGTERM"
    except KeyboardInterrupt:
        how = "SIGINT"
    finally:
        done = _stop_worker(worker, how, old, before_close=server.server_close)
    if not done:
        sys.stderr.flush()
        os._exit(0)
    return 0


# ---- command --------------------------------------------------------------------------------

def cmd_serve(args) -> int:
    if args.max_request_mb <= 0:
        raise InputError(f"--max-request-mb must be positive, got {args.max_request_mb:g}")
    if args.max_voxels < 1:
        raise InputError(f"--max-voxels must be positive, got {args.max_voxels}")
    http_only = (args.token_file or args.port is not None or args.host is not None or args.data_dir is not None
                 or args.allowed_host or args.max_connections is not None or args.client_timeout is not None)
    if not args.http and http_only:
        raise InputError("--host, --port, --token-file, --data-dir, --allowed-host, --max-connections and "
                         "--client-timeout apply to --http only")
    if args.http:
        args.max_connections = DEFAULT_MAX_CONNECTIONS if args.max_connections is None else args.max_connections
        args.client_timeout = DEFAULT_CLIENT_TIMEOUT_S if args.client_timeout is None else args.client_timeout
        if args.max_connections < 1:
            raise InputError(f"--max-connections must be at least 1, got {args.max_connections}")
        if not args.client_timeout > 0:
            raise InputError(f"--client-timeout must be positive, got {args.client_timeout:g}")
    _setup_logging(bool(getattr(args, "debug", False)))
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) - 1)
    elif args.threads < 1:
        raise InputError(f"--threads must be at least 1, got {args.threads}")
    if args.http:
        args.host = args.host or "127.0.0.1"
        args.port = 8765 if args.port is None else args.port
        if not 0 <= args.port <= 65535:
            raise InputError(f"--port must be 0..65535, got {args.port}")
        return serve_http(args)
    return serve_stdio(args)


def _add_arguments(sp) -> None:
    mode = sp.add_mutually_exclusive_group(required=True)
    mode.add_argument("--stdio", action="store_true", help="JSON lines on stdin/stdout (how Slicer runs it)")
    mode.add_argument("--http", action="store_true", help="HTTP: POST /rpc with one JSON request, GET /status")
    sp.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1; others need --token-file)")
    sp.add_argument("--port", type=int, default=None, help="port (default 8765; 0 picks a free one, shown in the ready line)")
    sp.add_argument("--token-file", metavar="FILE", help="file holding the bearer token every HTTP request must carry")
    sp.add_argument("--preset", default=None, help="model preset to load at start and use by default (default: load "
                                                   "the default preset on the first request)")
    sp.add_argument("--adapter", metavar="PATH", help="LoRA adapter folder for --preset")
    sp.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto", help="cpu, cuda or auto (default)")
    sp.add_argument("--max-request-mb", type=float, default=DEFAULT_MAX_REQUEST_MB,
                    help=f"largest request line / HTTP body in MB (default {DEFAULT_MAX_REQUEST_MB})")
    sp.add_argument("--threads", type=int, default=None, metavar="N",
                    help="CPU threads for the models (default: all cores but one, leaving one to Slicer; "
                         "fewer threads are much faster when the CPU is shared)")
    sp.add_argument("--cache-size", type=int, default=DEFAULT_CACHE_SIZE,
                    help=f"volumes kept in memory, by content hash (default {DEFAULT_CACHE_SIZE})")
    sp.add_argument("--max-voxels", type=int, default=DEFAULT_MAX_VOXELS, metavar="N",
                    help="largest volume accepted, checked in its header before reading it (default "
                         f"{DEFAULT_MAX_VOXELS:,}: a 1024×1024 CT of 2000 slices)")
    sp.add_argument("--data-dir", metavar="DIR", default=None,
                    help="HTTP only: the one folder whose files clients may name as 'volume' or 'out' (paths "
                         "resolved inside it, symbolic links followed); default: no server paths at all")
    sp.add_argument("--allowed-host", action="append", metavar="NAME",
                    help="HTTP only: another name clients may use in the Host header (e.g. the machine's DNS name "
                         "behind a proxy); repeatable")
    sp.add_argument("--max-connections", type=int, default=None, metavar="N",
                    help=f"HTTP only: connections served at once; more get 503 (default {DEFAULT_MAX_CONNECTIONS})")
    sp.add_argument("--client-timeout", type=float, default=None, metavar="S",
                    help="HTTP only: seconds a client has to send a request's line and headers before it is "
                         f"disconnected (default {DEFAULT_CLIENT_TIMEOUT_S:g}; bodies get this plus 1 s per 256 KB)")


SERVE_HELP = "Run a persistent worker that keeps the models loaded (protocol 1 over --stdio or --http)."


def add_serve_command(sub, add):
    """Register ``medvol serve`` with the main parser (``add`` as in :func:`medvolcore.cli.build_parser`)."""
    sp = add("serve", SERVE_HELP, cmd_serve)
    _add_arguments(sp)
    return sp


def main_serve(argv: Optional[List[str]] = None) -> int:
    """``medvol serve`` on its own (``python -m medvolcore.cli_serve ARGS``)."""
    from .cli import main

    argv = list(sys.argv[1:] if argv is None else argv)
    return main(["serve"] + [str(a) for a in argv])


if __name__ == "__main__":
    sys.exit(main_serve())
