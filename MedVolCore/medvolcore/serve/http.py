"""``medvol serve --http``: protocol 1 over HTTP (``POST /rpc``, ``GET /status``, ``GET /hello``).

The request and reply shapes, sessions and the trust boundary are ``docs/protocol.md``'s. What
this transport adds (``docs/architecture.md``, "Worker trust boundary"):

- binding to an address other than a loopback one needs a token (``--token-file``); with one,
  every request must carry ``Authorization: Bearer TOKEN``;
- a request whose ``Origin`` is not the server's own, whose ``Host`` is not a name of the bound
  address (or an ``--allowed-host``), or whose POST body is not ``application/json`` /
  ``application/octet-stream`` is refused before its body is read (what a web page could send to
  a server on 127.0.0.1);
- a JSON body is at most ``--max-request-mb``; a volume body (``application/octet-stream``, NIfTI
  or gzip NIfTI) is bounded by the voxel limit instead: its header is read from its first bytes
  and a volume over ``--max-voxels`` is refused before the rest is read, the body may not be
  longer than its header's voxels need, and it is streamed to a private file in the worker's
  temporary folder (removed once the request has its reply), never held in memory
  (:mod:`.upload`);
- a client that sends ``Accept: application/gzip`` gets a mask as the reply body (``.nii.gz``)
  with the reply envelope in the ``X-MedVol-Reply`` header, instead of ``mask_b64``;
- at most ``max_connections`` connections are served at once (more get 503 at once); a client
  gets ``client_timeout`` seconds to send its request line and headers, and 1 s more per 256 KB
  of body, else it is disconnected; the listen backlog is 128;
- framing is strict, so that no proxy in front can read a request differently: a body has
  exactly one ``Content-Length`` of ASCII digits; ``Transfer-Encoding`` (any), a repeated
  ``Content-Length`` or a body on GET get a 400 JSON error and the connection is closed;
- a reply's headers and body leave in one write (and ``TCP_NODELAY``): two small writes on a
  keep-alive connection would wait for the client's delayed ACK, about 40 ms a reply;
- sessions are counted per client address (an IPv6 /64 counts as one) and, once a client sends
  its session id back, per session: at most ``MAX_SESSIONS_PER_CLIENT`` new sessions and as
  many known ones per address, and a session with a request in flight is never pushed out, so
  session-less requests from one address (one address is every client behind a proxy) never
  cost another client its session (:class:`SessionTable`);
  a session idle for ``session_idle_s`` is forgotten and its queued requests are cancelled
  (its running request, if any, finishes and is answered);
- one access-log line per request goes to stderr (client address, op, id, outcome, seconds;
  never the query, paths or volumes); a refusal logs the path without its query string, and
  control characters from the client are escaped (:func:`.lifecycle.loggable`).

:class:`HttpServer` and :class:`Handler` are the transport; :func:`serve_http` runs it with a
worker until it stops. ``--port 0`` picks a free port, shown in the ready line
``medvol serve: ready (protocol 1) on http://HOST:PORT``.
"""

from __future__ import annotations

import base64
import collections
import hmac
import ipaddress
import json
import os
import re
import secrets
import select
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..errors import InputError, LimitError, MedVolError
from .lifecycle import Stop, install_signals, loggable, say, stop_worker
from .protocol import PROTOCOL, _jsonable, encode_line, error_reply, internal_reply
from .upload import WHAT as UPLOAD_WHAT
from .upload import Upload, body_bound, check_space, read_header, store_body, upload_ceiling
from .worker import MASK_BYTES_KEY
from .worker import Worker, WorkerSettings, log

__all__ = ["HttpSettings", "HttpServer", "Handler", "SessionTable", "SessionsFull", "serve_http", "read_token", "is_loopback",
           "allowed_names", "check_folders", "client_key", "DEFAULT_MAX_CONNECTIONS", "DEFAULT_CLIENT_TIMEOUT_S",
           "DEFAULT_PORT", "DEFAULT_SESSION_IDLE_S"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEFAULT_MAX_CONNECTIONS = 32
DEFAULT_CLIENT_TIMEOUT_S = 20.0
BODY_MIN_RATE = 256 << 10  # bytes/s a client must at least sustain while sending a body
LISTEN_BACKLOG = 128
MAX_SESSIONS_PER_CLIENT = 64  # one client address (an IPv6 /64) forgets its own oldest session beyond this
MAX_SESSIONS = 1 << 16  # all clients together: a bound on memory only
DEFAULT_SESSION_IDLE_S = 3600.0
SESSION_HEADER = "X-MedVol-Session"
_CONTENT_LENGTH = re.compile(r"[0-9]{1,15}")  # ASCII digits only: int() would also take '²' or '١'
_QUERY = re.compile(r"\?[^\s\"]*")
_FIRST_READ = 1 << 16  # a volume body's first read: its NIfTI header, checked before the rest is read
_DRAIN_MAX = 16 << 20  # the most of a refused volume body read (and dropped) so its client sees the reply
MASK_TYPE = "application/gzip"  # ``Accept`` this: the mask comes back as the body, the reply in a header
REPLY_HEADER = "X-MedVol-Reply"
MAX_REPLY_HEADER = 32 << 10  # a longer reply goes back as JSON with ``mask_b64`` (clients cap header lines)


def _header_id(header: str):
    """The ``id`` of the request object in a volume body's header, when it reads as one (a string
    or an integer within the wire's bounds), else None: a refusal of the body still carries it."""
    from ..request import MAX_WIRE_INT

    try:
        rid = json.loads(header).get("id")
    except (ValueError, AttributeError, RecursionError):
        return None
    if isinstance(rid, str) and len(rid) <= 200:
        return rid
    if isinstance(rid, int) and not isinstance(rid, bool) and -MAX_WIRE_INT < rid < MAX_WIRE_INT:
        return rid
    return None


@dataclass
class HttpSettings:
    """The HTTP transport's settings (``medvol serve --http`` options).

    ``token_file``: the bearer token every request must carry (required off loopback).
    ``allowed_hosts``: more names clients may put in ``Host`` (a proxy's DNS name).
    ``client_timeout``: seconds for a request's line and headers (a body gets 1 s more per 256 KB).
    ``session_idle_s``: a session without a request for this long is forgotten and its queued
    requests are cancelled.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    token_file: Optional[str] = None
    allowed_hosts: Sequence[str] = ()
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT_S
    session_idle_s: float = DEFAULT_SESSION_IDLE_S


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


def client_key(address: str) -> str:
    """The client a session is counted under: its IPv4 address, or its IPv6 /64 (one machine
    usually holds a whole /64, so counting single IPv6 addresses would not bound anything)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class SessionsFull(Exception):
    """Every session a client address may hold has a request in flight: no new one is issued."""


class SessionTable:
    """The session ids this server issued, per client address (:func:`client_key`), least
    recently used first, in two pools per address. A session is *fresh* until its client sends
    its id back, then *known*: the session secret is the client's identity (the server's one
    token is shared by all its clients, and one address is every client behind a proxy or a
    tunnel). Each pool holds at most ``per_client`` sessions per address: a new fresh session
    beyond that pushes out that address's least recently used fresh one, a session becoming
    known pushes out its least recently used known one, and never a session with a request
    queued or running (``busy(sid)``): when every candidate is busy, :meth:`session` raises
    :class:`SessionsFull`. So session-less requests (``GET /hello``, ``status``) from one
    address never push out a client that uses its session. ``total`` bounds the memory of all
    of them (then the address holding the most sessions loses its oldest idle one, fresh ones
    first). Thread-safe."""

    def __init__(self, per_client: int = MAX_SESSIONS_PER_CLIENT, total: int = MAX_SESSIONS,
                 busy: Optional[Callable[[str], bool]] = None):
        self.per_client = int(per_client)
        self.total = int(total)
        self.busy = busy or (lambda sid: False)
        self._lock = threading.Lock()
        self._last = {}  # session id -> [client, last request (monotonic s), known]
        self._pools: "dict[tuple, collections.OrderedDict]" = {}  # (client, known) -> sessions, LRU first

    def __len__(self) -> int:
        return len(self._last)

    def session(self, sid: Optional[str], client: str) -> str:
        """``sid`` when this server issued it and still knows it (now its most recent use, and
        known), else a new fresh session of ``client``."""
        now = time.monotonic()
        with self._lock:
            entry = self._last.get(sid) if sid else None
            if entry is not None:
                entry[1] = now
                if not entry[2]:  # sent back by its client: now a known session
                    self._pools[(entry[0], False)].pop(sid, None)
                    self._drop_empty((entry[0], False))
                    entry[2] = True
                    known = self._pools.setdefault((entry[0], True), collections.OrderedDict())
                    known[sid] = None
                    self._trim(known, keep=sid)
                else:
                    self._pools[(entry[0], True)].move_to_end(sid)
                return sid
            fresh = self._pools.setdefault((client, False), collections.OrderedDict())
            if len(fresh) >= self.per_client and self._idle(fresh) is None:
                self._drop_empty((client, False))
                raise SessionsFull(f"this address already holds {len(fresh)} new sessions with requests in flight; "
                                   "send your session id (X-MedVol-Session) or wait for a reply")
            sid = secrets.token_urlsafe(18)
            fresh[sid] = None
            self._last[sid] = [client, now, False]
            self._trim(fresh, keep=sid)
            while len(self._last) > self.total:
                pools = sorted(self._pools.values(), key=len, reverse=True)
                victim = next((v for pool in pools for v in [self._idle(pool)] if v is not None and v != sid), None)
                if victim is None:
                    break
                self._forget(victim)
            return sid

    def _idle(self, pool) -> Optional[str]:
        """The least recently used session of ``pool`` with no request in flight, or None."""
        return next((sid for sid in pool if not self.busy(sid)), None)

    def _trim(self, pool, keep: str) -> None:
        while len(pool) > self.per_client:
            victim = next((s for s in pool if s != keep and not self.busy(s)), None)
            if victim is None:
                return  # every other one is busy: kept (the bound is exceeded by busy sessions only)
            self._forget(victim)

    def touch(self, sid: Optional[str]) -> None:
        """Mark ``sid`` as used now (a reply was delivered to it)."""
        with self._lock:
            entry = self._last.get(sid) if sid else None
            if entry is not None:
                entry[1] = time.monotonic()

    def expire(self, idle_s: float) -> list:
        """Forget the sessions unused for more than ``idle_s`` seconds; returns their ids."""
        cutoff = time.monotonic() - idle_s
        with self._lock:
            old = [sid for sid, (_, t, _k) in self._last.items() if t < cutoff]
            for sid in old:
                self._forget(sid)
        return old

    def _forget(self, sid: str) -> None:
        client, _, known = self._last.pop(sid)
        pool = self._pools.get((client, known))
        if pool is not None:
            pool.pop(sid, None)
        self._drop_empty((client, known))

    def _drop_empty(self, key) -> None:
        if not self._pools.get(key):
            self._pools.pop(key, None)


def check_folders(settings: WorkerSettings) -> None:
    """``--data-dir`` and ``--out-dir`` must be folders, and must not overlap (the same folder,
    or one inside the other): a client writing to the output folder can then never replace a
    volume of the data folder. Raises :class:`InputError`; resolves both in ``settings``."""
    for option, attr in (("--data-dir", "data_dir"), ("--out-dir", "out_dir")):
        value = getattr(settings, attr)
        if value is None:
            continue
        d = Path(value).expanduser()
        if not d.is_dir():
            raise InputError(f"{option} {d} is not a folder")
        setattr(settings, attr, d)
    if settings.data_dir is not None and settings.out_dir is not None:
        data, out = os.path.realpath(settings.data_dir), os.path.realpath(settings.out_dir)
        if os.path.commonpath([data, out]) in (data, out):
            how = "is" if data == out else "is inside" if os.path.commonpath([data, out]) == data else "holds"
            raise InputError(f"--out-dir {settings.out_dir} {how} the data folder --data-dir {settings.data_dir}; give "
                             "the masks a folder of their own, outside the data folder, so that no client can "
                             "replace a volume")


class Handler(BaseHTTPRequestHandler):
    """One connection: checks on the headers, then one request at a time handed to the worker."""

    server_version = "medvol-serve/1"
    protocol_version = "HTTP/1.1"
    session = None
    nodelay = True
    server: "HttpServer"

    def setup(self):
        self.timeout = self.server.settings.client_timeout  # a read that waits longer drops the connection
        super().setup()
        if self.nodelay:
            try:
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def log_message(self, fmt, *a):  # noqa: D401
        if self.server.debug:  # the request line's query (a token put there) never reaches the log
            say("http: " + loggable(_QUERY.sub("?…", fmt % a), 300))

    def _log_path(self) -> str:
        """The request's path for the log: without its query string, control characters escaped."""
        path = getattr(self, "path", "") or ""
        return loggable(path.split("?", 1)[0], 100) + ("?…" if "?" in path else "")

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
        self._write_reply(body)

    def _write_reply(self, body: bytes) -> None:
        """The buffered headers, the blank line and ``body`` in one write: a second small write
        on a keep-alive connection would wait for the client's delayed ACK (Nagle), ~40 ms."""
        head = getattr(self, "_headers_buffer", None)
        data = (b"".join(head) + b"\r\n" if head is not None else b"") + body  # HTTP/0.9 has no headers
        self._headers_buffer = []
        try:
            self.wfile.write(data)
        except OSError:
            pass

    def send_error(self, code, message=None, explain=None):
        """The base class's own refusals (a malformed request line, headers too long, an unknown
        method) as a JSON error envelope like every other reply; the connection is closed."""
        try:
            status = HTTPStatus(int(code))
        except ValueError:
            status = HTTPStatus.BAD_REQUEST
        kind = "too_large" if status in (HTTPStatus.REQUEST_URI_TOO_LONG,
                                          HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE) else "bad_request"
        self._send(status.value, error_reply(None, kind, str(message or status.phrase)[:200]), close=True)

    def _refuse(self, status: int, code: str, message: str, rid=None) -> None:
        log.warning("http %s %s %s refused: %s", self.client_address[0], loggable(self.command or "-", 20),
                    self._log_path(), loggable(message, 300))
        self._send(status, error_reply(rid, code, message), close=True)

    def _framing_error(self) -> Optional[str]:
        """Why this request's framing is refused, or None. A body has exactly one Content-Length
        of ASCII digits; no Transfer-Encoding (chunked or any other); no body on GET. Anything
        else is read differently by different servers and proxies (request smuggling)."""
        if self.headers.get_all("Transfer-Encoding"):
            return "Transfer-Encoding is not supported; send the body with one Content-Length header"
        lengths = self.headers.get_all("Content-Length") or []
        if len(lengths) > 1:
            return "a request may carry one Content-Length header, not several"
        if lengths and not _CONTENT_LENGTH.fullmatch(lengths[0].strip(" \t")):
            return "Content-Length must be a number of at most 15 ASCII digits"
        if lengths and self.command != "POST" and int(lengths[0].strip(" \t")) != 0:
            return f"a {self.command} request has no body; POST requests go to /rpc"
        return None

    # -- checks done on the headers alone, before any body is read --
    def _checks(self) -> bool:
        self.server.watchdog.disarm(self.connection)  # the headers are in; a body gets its own deadline
        framing = self._framing_error()
        if framing is not None:
            self._refuse(400, "bad_request", framing)
            return False
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
        try:
            self.session = self._session()
        except SessionsFull as e:
            self._refuse(429, "busy", str(e))
            return False
        return True

    def _session(self) -> str:
        """The caller's session id: the one it sent if the server issued it, else a new one
        counted under the caller's address."""
        sid = (self.headers.get(SESSION_HEADER) or "").strip()[:64]
        return self.server.sessions.session(sid, client_key(self.client_address[0]))

    def _client_gone(self) -> bool:
        """True when the client closed its side (a blocking POST /rpc was abandoned)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def wants_mask_bytes(self) -> bool:
        """True when the client asked for the mask as the reply body (``Accept: application/gzip``)."""
        accept = self.headers.get("Accept") or ""
        return any(part.split(";")[0].strip().lower() == MASK_TYPE for part in accept.split(","))

    def _call(self, raw, body=None) -> None:
        t0 = time.monotonic()
        done = threading.Event()
        box = {}
        upload = body if isinstance(body, Upload) else None

        def reply(obj):
            if "event" in obj:
                return
            if upload is not None:  # the worker is done with it: its one final reply
                upload.remove()
            box["reply"] = obj
            done.set()

        try:
            job = self.server.worker.handle_line(raw, reply=reply, body=body, transport="http", session=self.session,
                                                 mask_bytes=self.wants_mask_bytes())
        finally:
            if upload is not None and done.is_set():
                upload.remove()
        while not done.wait(0.25):
            if job is not None and self._client_gone():
                self.server.worker.abandon(job)  # its reply, when it comes, removes the upload
                self._access(job.op, job.id, "client disconnected: cancelled", t0)
                self.close_connection = True
                return
        r = box["reply"]
        op = job.op if job is not None else "-"
        self._access(op, r.get("id"), "ok" if r.get("ok") else r.get("error", {}).get("code"), t0)
        self.server.sessions.touch(self.session)
        mask = (r.get("result") or {}).pop(MASK_BYTES_KEY, None) if r.get("ok") else None
        if mask is not None:
            self._send_mask(r, mask)
        else:
            self._send(200, r)
        if self.server.worker.stopped.is_set():
            threading.Thread(target=self.server.shutdown, daemon=True).start()

    def _send_mask(self, r: dict, mask: bytes) -> None:
        """A reply whose mask the client asked for as bytes: the mask (``.nii.gz``) is the body,
        the reply envelope (without the mask) the ``X-MedVol-Reply`` header, ASCII JSON. A reply
        too long for one header line goes as JSON with ``mask_b64``, as to an old client."""
        head = json.dumps(_jsonable(r), ensure_ascii=True, separators=(",", ":"), allow_nan=False)
        if len(head) > MAX_REPLY_HEADER:
            r["result"]["mask_b64"] = base64.b64encode(mask).decode("ascii")
            self._send(200, r)
            return
        self.send_response(200)
        self.send_header("Content-Type", MASK_TYPE)
        self.send_header("Content-Length", str(len(mask)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        self.send_header(REPLY_HEADER, head)
        if self.session:
            self.send_header(SESSION_HEADER, self.session)
        self._write_reply(mask)

    def _guarded(self, method) -> None:
        try:
            method()
        except (ConnectionError, socket.timeout):
            self.close_connection = True
        except Exception:  # noqa: BLE001 - a bad request never kills the server or goes unanswered
            self.close_connection = True
            try:
                self._send(500, internal_reply(None, f"HTTP {loggable(self.command or '-', 20)} {self._log_path()}"),
                           close=True)
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
        length = self.headers.get("Content-Length")  # one, of ASCII digits (checked in _checks)
        if length is None:
            self._send(411, error_reply(None, "bad_request", "a Content-Length header is required"), close=True)
            return
        n = int(length.strip(" \t"))
        if ctype == "application/octet-stream":
            self._post_volume(n)
            return
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
        self._call(data)

    def _refuse_body(self, status: int, code: str, message: str, unread: int, rid=None) -> None:
        """Refuse a volume body of which ``unread`` bytes were not read: the reply goes first, then
        up to 16 MB of the rest are read and dropped (so that a client still sending its body sees
        the reply, not a reset) and the connection is closed; a bigger rest is never read. ``rid``:
        the request's ``id`` from its header, so the client can match the refusal to its request."""
        self._refuse(status, code, message, rid)
        if 0 < unread <= _DRAIN_MAX:
            self.server.watchdog.arm(self.connection, self.server.settings.client_timeout + unread / BODY_MIN_RATE)
            while unread > 0:
                chunk = self.rfile.read(min(unread, 1 << 20))
                if not chunk:
                    break
                unread -= len(chunk)

    def _post_volume(self, n: int) -> None:
        """A volume body (``application/octet-stream``, NIfTI bytes, ``.nii`` or ``.nii.gz``): bounded
        by the voxel limit from its header, streamed to a private file (:mod:`.upload`), never held
        in memory. The request object rides in the ``X-MedVol-Request`` header."""
        worker = self.server.worker
        header = self.headers.get("X-MedVol-Request")
        if header is None:
            self._refuse_body(400, "bad_request", "a volume body needs the request object in the X-MedVol-Request "
                                                  "header", n)
            return
        rid = _header_id(header)
        ceiling = upload_ceiling(worker.max_voxels)
        if ceiling is not None and n > ceiling:
            self._refuse_body(413, "too_large", f"a volume body of {n:,} bytes is more than --max-voxels "
                                                f"{worker.max_voxels:,} allows ({ceiling:,} bytes)", n, rid)
            return
        self.server.watchdog.arm(self.connection, self.server.settings.client_timeout + n / BODY_MIN_RATE)
        prefix, info = b"", None
        try:
            while info is None:  # the header first: refused from it before the rest is read
                # read1: what has arrived (at most 64 kB), so the header is checked as soon as it is here
                chunk = self.rfile.read1(min(n - len(prefix), _FIRST_READ))
                if not chunk and len(prefix) < n:
                    self.close_connection = True
                    return
                prefix += chunk
                info = read_header(prefix, len(prefix) >= n, worker.max_voxels)
            bound = body_bound(info)
            if n > bound:
                raise LimitError(f"the {UPLOAD_WHAT} is {n:,} bytes, more than the {info.raw_bytes:,} bytes its "
                                 f"header declares need")
            check_space(worker.tmp_dir, n)
            upload = store_body(prefix, self.rfile.read, n, info, worker.tmp_dir)
        except MedVolError as e:
            self._refuse_body(413 if e.code == "too_large" else 400, e.code, str(e), n - len(prefix), rid)
            return
        finally:
            self.server.watchdog.disarm(self.connection)
        if upload is None:  # the client stopped sending (or was too slow)
            self.close_connection = True
            return
        self._call(header, body=upload)

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
        self.sessions = SessionTable(busy=worker.session_busy)
        self._reaper_stop = threading.Event()
        worker.hello_extra = {"session_idle_s": settings.session_idle_s}
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
        threading.Thread(target=self._reap_sessions, name="medvol-http-sessions", daemon=True).start()

    def _reap_sessions(self) -> None:
        """Forget sessions idle for ``session_idle_s`` and cancel their queued requests. A running
        request of such a session is left to finish: its client still waits on its connection
        for the reply (a client that went away was already cancelled by its handler)."""
        idle = float(self.settings.session_idle_s)
        while not self._reaper_stop.wait(max(0.2, min(30.0, idle / 4))):
            expired = self.sessions.expire(idle)
            cancelled = sum(self.worker.cancel_session(sid, f"its session was idle for more than {idle:g} s")
                            for sid in expired)
            if cancelled:
                log.info("http: %d session(s) idle for more than %g s forgotten; %d queued request(s) cancelled",
                         len(expired), idle, cancelled)

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
        self._reaper_stop.set()
        super().server_close()


def serve_http(settings: WorkerSettings, http: HttpSettings) -> int:
    """Serve HTTP until the worker stops (``shutdown``, SIGINT, SIGTERM); returns the exit code."""
    token = read_token(http.token_file) if http.token_file else None
    if token is None and not is_loopback(http.host):
        raise InputError(f"refusing to listen on {http.host} without a token: binding to a non-loopback address "
                         "needs --token-file FILE (every request must then send 'Authorization: Bearer TOKEN')")
    check_folders(settings)
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
            + (f"; data folder {worker.data_dir}" if worker.data_dir
               else "; no server paths (volumes come in requests)")
            + (f"; output folder {worker.out_dir}" if worker.out_dir else "; masks come back in the replies"))
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
