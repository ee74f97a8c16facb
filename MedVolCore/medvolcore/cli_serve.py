"""``medvol serve``: the persistent worker over stdio or HTTP (protocol 1, see :mod:`medvolcore.worker`).

    medvol serve --stdio [--preset P] [--device cpu|cuda|auto] [--max-request-mb N]
    medvol serve --http [--host 127.0.0.1] [--port N] [--token-file F] [...]

Over stdio, stdout carries only protocol lines (anything else a library prints is sent to
stderr); the ready line and logs go to stderr. Over HTTP, binding to an address other than a
loopback one needs ``--token-file``; ``--port 0`` picks a free port, shown in the ready line
``medvol serve: ready (protocol 1) on http://HOST:PORT``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import List, Optional

from .errors import InputError
from .worker import DEFAULT_CACHE_SIZE, DEFAULT_MAX_REQUEST_MB, PROTOCOL, Worker, dumps_line, error_reply

PROG = "medvol serve"
log = logging.getLogger("medvolcore")
STOP_GRACE_S = 15.0


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
        data = (dumps_line(obj) + "\n").encode("utf-8")
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
                    transport="stdio", max_request_bytes=limit, threads=args.threads)
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
    return token


def make_http_server(args, worker: Worker, token: Optional[str]):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    limit = int(args.max_request_mb * (1 << 20))
    debug = bool(getattr(args, "debug", False))

    class Handler(BaseHTTPRequestHandler):
        server_version = "medvol-serve/1"
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):  # noqa: D401
            if debug:
                _say("http: " + (fmt % a))

        def _send(self, status: int, obj: dict, close: bool = False) -> None:
            body = (dumps_line(obj) + "\n").encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
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

        def _authorised(self) -> bool:
            if token is None:
                return True
            got = self.headers.get("Authorization", "")
            scheme, _, value = got.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode()):
                return True
            self._send(401, error_reply(None, "unauthorized", "missing or wrong token: send 'Authorization: Bearer TOKEN'"),
                       close=True)
            return False

        def _call(self, raw, body=None) -> None:
            done = threading.Event()
            box = {}

            def reply(obj):
                if "event" in obj:
                    return
                box["reply"] = obj
                done.set()

            worker.handle_line(raw, reply=reply, body=body, transport="http")
            done.wait()
            self._send(200, box["reply"])
            if worker.stopped.is_set():
                threading.Thread(target=self.server.shutdown, daemon=True).start()

        def do_GET(self):  # noqa: N802
            if not self._authorised():
                return
            path = self.path.split("?", 1)[0].rstrip("/")
            if path in ("/status", "/hello"):
                self._call(json.dumps({"id": None, "op": path[1:]}))
            else:
                self._send(404, error_reply(None, "not_found", f"no {self.path}; use POST /rpc, GET /status or GET /hello"))

        def do_POST(self):  # noqa: N802
            if not self._authorised():
                return
            if self.path.split("?", 1)[0].rstrip("/") != "/rpc":
                self._send(404, error_reply(None, "not_found", f"no {self.path}; POST requests go to /rpc"), close=True)
                return
            length = self.headers.get("Content-Length")
            if length is None or not length.strip().isdigit():
                self._send(411, error_reply(None, "bad_request", "a Content-Length header is required"), close=True)
                return
            n = int(length)
            if n > limit:
                # read (and drop) a moderately oversized body so the client sees the reply, not a reset
                left = n if n <= 4 * limit + (16 << 20) else 0
                while left > 0:
                    chunk = self.rfile.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    left -= len(chunk)
                self._send(413, error_reply(None, "too_large", f"request body of {n} bytes is over --max-request-mb "
                                                                f"{args.max_request_mb:g} MB"), close=True)
                return
            data = self.rfile.read(n)
            ctype = (self.headers.get("Content-Type") or "application/json").split(";")[0].strip().lower()
            if ctype in ("application/json", "text/plain", "text/json", ""):
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

    host = args.host
    if ":" in host.strip("[]"):
        import socket

        Server.address_family = socket.AF_INET6
        host = host.strip("[]")
    return Server((host, args.port), Handler)


def serve_http(args) -> int:
    token = _read_token(args.token_file) if args.token_file else None
    if token is None and not _is_loopback(args.host):
        raise InputError(f"refusing to listen on {args.host} without a token: binding to a non-loopback address "
                         "needs --token-file FILE (every request must then send 'Authorization: Bearer TOKEN')")
    limit = int(args.max_request_mb * (1 << 20))
    worker = Worker(None, default_preset=args.preset, device=args.device, cache_size=args.cache_size,
                    transport="http", max_request_bytes=limit, threads=args.threads)
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
        _say(f"ready (protocol {PROTOCOL}) on http://{shown}:{port}" + (" (token required)" if token else ""))
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
    if not args.http and (args.token_file or args.port is not None or args.host is not None):
        raise InputError("--host, --port and --token-file apply to --http only")
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
