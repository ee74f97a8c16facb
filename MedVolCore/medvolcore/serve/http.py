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
- every bound is :mod:`.limits`' (one declaration, shown in ``docs/security.md``): a request
  target, header line, header count or head over its bound gets 414/431 and the connection is
  closed before the token is read (:mod:`.http_conn`); a JSON body's keys and values are counted
  as it arrives and it is parsed in a worker thread;
- a reply's headers and body leave in one write (and ``TCP_NODELAY``): two small writes on a
  keep-alive connection would wait for the client's delayed ACK, about 40 ms a reply;
- sessions are counted per client address (an IPv6 /64 counts as one) and, once a client sends
  its session id back, per session: at most ``MAX_SESSIONS_PER_CLIENT`` new sessions and as
  many known ones per address, and a session with a request in flight is never pushed out, so
  session-less requests from one address (one address is every client behind a proxy) never
  cost another client its session (:class:`SessionTable`); a worker of ``--devices``
  (``behind_front``) counts them under the client its front names in ``X-MedVol-Client``;
  a session idle for ``session_idle_s`` is forgotten and its queued requests are cancelled
  (its running request, if any, finishes and is answered);
- one access-log line per request goes to stderr (client address, op, id, outcome, seconds;
  never the query, paths or volumes); a refusal logs the path without its query string, and
  control characters from the client are escaped (:func:`.lifecycle.loggable`).

:class:`HttpServer` and :class:`Handler` are the transport; :func:`serve_http` runs it with a
worker until it stops. ``--port 0`` picks a free port, shown in the ready line
``medvol serve: ready (protocol 1) on http://HOST:PORT``. With ``--monailabel NAME`` the same
server also answers MONAI Label's REST contract and serves the OHIF viewer (:mod:`.monailabel`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..errors import DependencyError, InputError
from .limits import limit
from .lifecycle import EXIT_CODES, Stop, install_signals, restore_signals, say, stop_worker
from .protocol import PROTOCOL
from .sessions import MAX_SESSIONS, MAX_SESSIONS_PER_CLIENT, SessionsFull, SessionTable, client_key
from .worker import Worker, WorkerSettings, log

__all__ = ["HttpSettings", "HttpServer", "SessionTable", "SessionsFull", "serve_http", "read_token", "is_loopback",
           "allowed_names", "check_folders", "client_key", "DEFAULT_MAX_CONNECTIONS", "DEFAULT_CLIENT_TIMEOUT_S",
           "DEFAULT_PORT", "DEFAULT_SESSION_IDLE_S", "listening_token", "serve_until_stopped"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEFAULT_MAX_CONNECTIONS = int(limit("connections").default)
DEFAULT_CLIENT_TIMEOUT_S = float(limit("client_timeout").default)
LISTEN_BACKLOG = 128
DEFAULT_SESSION_IDLE_S = float(limit("session_idle").default)


@dataclass
class HttpSettings:
    """The HTTP transport's settings (``medvol serve --http`` options).

    ``token_file``: the bearer token every request must carry (required off loopback).
    ``allowed_hosts``: more names clients may put in ``Host`` (a proxy's DNS name).
    ``client_timeout``: seconds for a request's line and headers (a body gets 1 s more per 256 KB).
    ``session_idle_s``: a session without a request for this long is forgotten and its queued
    requests are cancelled.
    ``tls_cert``/``tls_key``: PEM files; with them the server speaks HTTPS.
    ``behind_front``: a worker of ``--devices`` (on 127.0.0.1, with the front's private token):
    its sessions are counted under the client the front names in ``X-MedVol-Client``.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    token_file: Optional[str] = None
    allowed_hosts: Sequence[str] = ()
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT_S
    session_idle_s: float = DEFAULT_SESSION_IDLE_S
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    monailabel: Optional[str] = None  # answer MONAI Label's contract for series of this --allow-pacs server
    ohif_dir: Optional[str] = None  # the OHIF viewer served at /ohif/ (default: where bootstrap.py put it)
    behind_front: bool = False


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


def listening_token(http: "HttpSettings") -> Optional[str]:
    """The token of ``--token-file`` (None without one); binding to an address other than a
    loopback one without a token raises :class:`InputError`."""
    token = read_token(http.token_file) if http.token_file else None
    if token is None and not is_loopback(http.host):
        raise InputError(f"refusing to listen on {http.host} without a token: binding to a non-loopback address "
                         "needs --token-file FILE (every request must then send 'Authorization: Bearer TOKEN')")
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


def allowed_names(host: str, extra: Sequence[str] = ()) -> Optional[set]:
    """Every name a ``Host`` header may carry for a server bound to ``host`` plus ``extra`` (None:
    any, for a wildcard bind without extra names)."""
    allowed = _host_names(host)
    extra_hosts = {h.strip().lower() for h in (extra or ())}
    if allowed is not None or extra_hosts:
        allowed = (allowed or set()) | extra_hosts
    return allowed


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


class HttpServer:
    """The HTTP transport of one worker: uvicorn serving :class:`.http_app.Transport` with the
    connection rules of :class:`.http_conn.Connection`, on a socket bound here (``server_address``
    is known at once, ``--port 0`` included). :meth:`serve_forever` serves in the calling thread
    until :meth:`shutdown`."""

    def __init__(self, settings: "HttpSettings", worker: Worker, token: Optional[str], debug: bool = False,
                 app=None):
        try:
            import httptools  # noqa: F401 - the parser http_conn builds on
            import starlette  # noqa: F401
            import uvicorn
        except ImportError:
            raise DependencyError("serving over HTTP needs uvicorn, httptools and starlette: "
                                  "pip install 'medvolcore[http]'") from None

        from .http_app import Transport
        from .http_conn import Connection

        self.settings = settings
        self.worker = worker
        self.token = token
        self.debug = bool(debug)
        self.allowed = allowed_names(settings.host, settings.allowed_hosts)
        own = isinstance(worker, Worker)  # else the front of several workers (:mod:`.router`): they keep the sessions
        self.sessions = SessionTable(busy=worker.session_busy) if own else None
        self.peak_connections = 0
        self._reaper_stop = threading.Event()
        self._uvicorn = None
        self._stopped = threading.Event()
        self._stopped.set()
        if own:
            worker.hello_extra = {"session_idle_s": settings.session_idle_s}
        host = settings.host.strip("[]") if ":" in settings.host.strip("[]") else settings.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # (asyncio sets TCP_NODELAY)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, settings.port))
            self.socket.listen(LISTEN_BACKLOG)
        except BaseException:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).setLevel(logging.DEBUG if self.debug else logging.ERROR)
        self.app = app(self) if app is not None else Transport(self)
        if settings.monailabel and own:
            from .monailabel import MonaiLabelApp, default_ohif_dir

            ohif = Path(settings.ohif_dir) if settings.ohif_dir else default_ohif_dir()
            self.app.extra = MonaiLabelApp(self.app, worker.pacs_servers[settings.monailabel], ohif)
        self.config = uvicorn.Config(
            self.app, http=type("MedVolConnection", (Connection,), {"owner": self}), ws="none",
            lifespan="off", access_log=False, log_config=None, proxy_headers=False, server_header=False,
            timeout_keep_alive=max(1, int(settings.client_timeout)), timeout_graceful_shutdown=5,
            backlog=LISTEN_BACKLOG, ssl_certfile=settings.tls_cert, ssl_keyfile=settings.tls_key)
        if own:
            threading.Thread(target=self._reap_sessions, name="medvol-http-sessions", daemon=True).start()

    def _reap_sessions(self) -> None:
        """Forget sessions idle for ``session_idle_s`` and cancel their queued requests. A running
        request of such a session is left to finish: its client still waits on its connection
        for the reply (a client that went away was already cancelled)."""
        idle = float(self.settings.session_idle_s)
        while not self._reaper_stop.wait(max(0.2, min(30.0, idle / 4))):
            expired = self.sessions.expire(idle)
            cancelled = sum(self.worker.cancel_session(sid, f"its session was idle for more than {idle:g} s")
                            for sid in expired)
            if cancelled:
                log.info("http: %d session(s) idle for more than %g s forgotten; %d queued request(s) cancelled",
                         len(expired), idle, cancelled)

    def serve_forever(self, poll_interval: float = 0.25) -> None:
        """Serve until :meth:`shutdown` (or the worker's ``shutdown`` op)."""
        import uvicorn

        self._uvicorn = uvicorn.Server(self.config)
        self._stopped.clear()
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def stop_serving(self) -> None:
        """Ask the serving loop to stop (from any thread); returns at once."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    def shutdown(self) -> None:
        """Stop serving and wait until :meth:`serve_forever` has returned."""
        self.stop_serving()
        self._stopped.wait(30)

    def server_close(self) -> None:
        self._reaper_stop.set()
        self.shutdown()
        try:
            self.socket.close()
        except OSError:
            pass

def serve_http(settings: WorkerSettings, http: HttpSettings) -> int:
    """Serve HTTP until the worker stops (``shutdown``, SIGINT, SIGTERM); returns the exit code."""
    token = listening_token(http)
    check_folders(settings)
    tls = _check_tls(http)
    old = install_signals()  # from here on, SIGTERM stops it cleanly, whenever it comes
    worker = server = None
    how = "shutdown"
    try:
        worker = Worker.from_settings(settings, "http", preload=False)  # the preset loads once the port is ours
        try:
            server = HttpServer(http, worker, token, debug=settings.debug)
        except OSError as e:
            raise InputError(f"cannot listen on {http.host}:{http.port}: {e.strerror or e}") from None
        if settings.preset:
            worker.preload(settings.preset, settings.adapter)
        how = serve_until_stopped(server, tls, token, (f"; data folder {worker.data_dir}" if worker.data_dir
                                                       else "; no server paths (volumes come in requests)")
                                  + (f"; output folder {worker.out_dir}" if worker.out_dir
                                     else "; masks come back in the replies"))
    except Stop:
        how = "SIGTERM"
    except KeyboardInterrupt:
        how = "SIGINT"
    finally:
        done = True
        if worker is not None:
            done = stop_worker(worker, how, old, before_close=server.server_close if server is not None else None)
        else:
            restore_signals(old)
    code = EXIT_CODES.get(how, 0)
    if not done:
        sys.stderr.flush()
        os._exit(code)
    return code


def serve_until_stopped(server: HttpServer, tls: bool, token: Optional[str], more: str = "") -> str:
    """Serve in a thread of its own, say the ready line (``more`` appended), and wait until the
    server stops (``shutdown``) or a signal comes; returns how it stopped: ``shutdown``,
    ``SIGTERM`` or ``SIGINT``. Call it with :func:`.lifecycle.install_signals` in force."""
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    serving = threading.Thread(target=server.serve_forever, name="medvol-http", daemon=True)
    try:
        serving.start()
        say(f"ready (protocol {PROTOCOL}) on {'https' if tls else 'http'}://{shown}:{port}"
            + (" (token required)" if token else "") + more)
        while serving.is_alive():
            serving.join(0.25)
    except Stop:
        return "SIGTERM"
    except KeyboardInterrupt:
        return "SIGINT"
    return "shutdown"


def _check_tls(http: HttpSettings) -> bool:
    """Whether the server speaks HTTPS: ``--tls-cert`` and ``--tls-key`` together, readable PEM
    files that make a certificate and its key (checked before the worker starts)."""
    if not (http.tls_cert or http.tls_key):
        return False
    if not (http.tls_cert and http.tls_key):
        raise InputError("--tls-cert and --tls-key go together: give both (PEM files)")
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(http.tls_cert, http.tls_key)
    except OSError as e:
        raise InputError(f"cannot read --tls-cert {http.tls_cert} / --tls-key {http.tls_key}: "
                         f"{e.strerror or e}") from None
    except ssl.SSLError as e:
        raise InputError(f"--tls-cert {http.tls_cert} and --tls-key {http.tls_key} are not a PEM certificate and "
                         f"its key ({e.reason or e})") from None
    return True
