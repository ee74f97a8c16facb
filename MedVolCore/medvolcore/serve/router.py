"""``medvol serve --http --devices cuda:0,cuda:1``: one address, one worker per device.

The front (this module) is the HTTP transport of :mod:`.http_app` with every rule of a single
worker's (token, ``Host``/``Origin``, framing, each protocol header once, the minimum body rate,
the voxel limit read from a volume body's header, the body streamed to a private file), and no
models: instead of answering, it hands each request to one of its workers (:mod:`.devices`), over
loopback, with their private token, and gives back their reply as it came.

Which worker: the one that holds the request's volume. The key is ``X-MedVol-Volume`` when the
client sends it (``docs/protocol.md``), else the sha256 of the volume body (computed while it is
stored), else the ``volume`` a JSON request names (a ``--data-dir`` path, a DICOMweb URL); a
request about no volume goes to the worker that issued its session (learnt from the replies), else
to the next worker in turn. Keys are spread by rendezvous hashing, so a volume keeps its worker
while that worker is up, and a correction round encodes no slice again.

When the chosen worker is gone (its process exited, or its connection fails), the request goes to
the next worker for its key, which reads and encodes the volume again and answers; a request whose
worker died while running it is sent once more to another, and a second failure is answered
``worker_lost``. The body is kept in the front's private file until the reply, so it can be sent
again. ``shutdown`` stops every worker, then the front. ``GET /status`` adds ``workers`` (each
worker's device, whether it is up, its restarts, its queue) and ``hello`` adds ``devices``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import secrets
import sys
import threading
import time
import urllib.parse
from typing import Optional

from ..errors import DependencyError, InputError, MedVolError
from .devices import Member, Pool
from .http import (DEFAULT_MAX_CONNECTIONS, HttpServer, HttpSettings, _check_tls, check_folders, listening_token,
                   serve_until_stopped)
from .http_app import CLIENT_HEADER, REPLY_HEADER, SESSION_HEADER, VOLUME_HEADER, VOLUME_KEY, Transport, _Gone
from .lifecycle import EXIT_CODES, Stop, install_signals, make_tmp_dir, release_tmp_dir, say
from .protocol import encode_line, error_reply, parse_request, valid_id
from .worker import WorkerSettings, log

__all__ = ["Front", "serve_devices", "worker_arguments"]

_PASSED_UP = ("accept", SESSION_HEADER.lower())  # request headers a worker reads (besides those set here)
_PASSED_DOWN = ("content-type", REPLY_HEADER.lower(), SESSION_HEADER.lower(), "retry-after", "connection")
_SESSIONS_KEPT = 1 << 16
LIVE_S = 1.0  # how old the workers' queues in ``status`` may be
_RETRIES_AFTER_SENT = 1  # a request whose worker died while running it is sent once more


class _Limits:
    """What :class:`.http_app.Transport` reads of a worker before the body reaches it."""

    def __init__(self, settings: WorkerSettings, tmp_dir):
        self.max_request_bytes = int(settings.max_request_mb * (1 << 20))
        self.max_voxels = settings.max_voxels
        self.tmp_dir = tmp_dir
        self.stopped = threading.Event()


class Front(Transport):
    """The application of the front: :class:`.http_app.Transport`'s routes and checks, with
    :meth:`_call` handing the request to a worker instead of answering it."""

    def __init__(self, server):
        super().__init__(server)
        self.pool: Pool = server.pool
        self.sessions = collections.OrderedDict()  # session id -> the worker that issued it
        self._httpx = None
        self._token = server.internal_token
        self._live, self._live_at, self._live_lock = {}, float("-inf"), asyncio.Lock()

    def open_session(self, request):
        return None  # the workers issue and keep the sessions

    def _http(self):
        if self._httpx is None:
            import httpx

            self._httpx = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=None, write=120.0, pool=30.0),
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                                             trust_env=False)
        return self._httpx

    # -- which worker --
    def _key(self, request, sent: "_Sent", upload) -> Optional[str]:
        key = request.headers.get(VOLUME_HEADER)
        if key:
            return key
        if upload is not None:
            return upload.sha256
        return f"volume:{sent.volume}" if sent.volume else None

    def _choose(self, request, key, tried) -> Optional[Member]:
        if key is None:
            sid = (request.headers.get(SESSION_HEADER) or "").strip()
            member = self.sessions.get(sid) if sid else None
            if member is not None and member.up and member not in tried:
                return member
        return self.pool.pick(key, exclude=tried)

    def _learn_session(self, headers, member: Member) -> None:
        sid = headers.get(SESSION_HEADER)
        if sid and VOLUME_KEY.fullmatch(sid[:128]):
            self.sessions[sid] = member
            self.sessions.move_to_end(sid)
            while len(self.sessions) > _SESSIONS_KEPT:
                self.sessions.popitem(last=False)

    # -- one request --
    async def _call(self, request, raw, upload=None, inline: bool = False):
        import httpx

        # the request read off the event loop: its parse (bounded by serve.limits) never stalls other clients
        sent = _Sent(raw) if isinstance(raw, dict) else await asyncio.get_running_loop().run_in_executor(None, _Sent, raw)
        try:
            if sent.op == "shutdown":
                return await self._shutdown(request, sent)
            key = self._key(request, sent, upload)
            tried, sent_fails = [], 0
            while True:
                member = self._choose(request, key, tried)
                if member is None:
                    return self._no_worker(request, sent)
                tried.append(member)
                started = {"body": False}
                try:
                    reply = await self._exchange(request, member, sent, upload, key, started)
                except (httpx.TransportError, OSError) as e:
                    self.pool.mark_gone(member)
                    after_sent = started["body"] or not isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))
                    log.warning("http: the worker for %s (%s) failed a request%s: %s", member.device, member.name,
                                " it had received" if after_sent else "", type(e).__name__)
                    if after_sent:
                        sent_fails += 1
                        if sent_fails > _RETRIES_AFTER_SENT:
                            return self._lost(request, sent)
                    continue
                break
        finally:
            if upload is not None:
                upload.remove()
        status, headers, body = reply
        self._learn_session(headers, member)
        if sent.op == "status" and status == 200:
            body = await self._with_workers(body)
        elif sent.op == "hello":
            body = _add_result(body, devices=[m.device for m in self.pool.members])
        self._access(request, sent.op or "-", sent.rid, f"{status} from {member.device} ({member.name})")
        from starlette.responses import Response

        out = {k: v for k, v in headers.items() if k.lower() in _PASSED_DOWN}
        out.update({"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"})
        return Response(body, status, out)

    async def _exchange(self, request, member: Member, sent: "_Sent", upload, key, started) -> tuple:
        """Send the request to ``member`` and wait for its reply (status, headers, body), or for
        the client to go (then the worker's connection is closed, which cancels the request)."""
        headers = {"Host": f"127.0.0.1:{member.port}", "Authorization": f"Bearer {self._token}",
                   CLIENT_HEADER: self._client(request)}  # whose sessions: a client's header of this name never passes
        for name in _PASSED_UP:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        if key is not None and VOLUME_KEY.fullmatch(key[:128]):
            headers[VOLUME_HEADER] = key[:128]
        if upload is not None:
            headers["Content-Type"] = "application/octet-stream"
            headers["X-MedVol-Request"] = urllib.parse.quote(sent.text, safe=" !\"#$&'()*+,-./:;<=>?@[]^_`{|}~")
            headers["Content-Length"] = str(upload.size)
            content = _file_chunks(upload.path, started)
        else:
            headers["Content-Type"] = "application/json"
            content = sent.body if sent.body is not None else sent.text.encode("utf-8")
            started["body"] = True
        url = f"http://127.0.0.1:{member.port}/rpc"

        async def exchange():
            r = await self._http().post(url, content=content, headers=headers)
            return r.status_code, r.headers, r.content

        job = asyncio.ensure_future(exchange())
        if not await self._done_or_gone(request, job):
            job.cancel()  # closes the worker's connection: the worker cancels the request
            self._access(request, sent.op or "-", sent.rid, "client disconnected: cancelled")
            raise _Gone()
        return job.result()

    def _no_worker(self, request, sent: "_Sent") -> object:
        self._access(request, sent.op or "-", sent.rid, "no worker up")
        return self.reply(request, 503, error_reply(sent.rid, "busy", "no worker is up at the moment (they are "
                                                    "starting or restarting); try again in a few seconds"))

    def _lost(self, request, sent: "_Sent") -> object:
        return self.reply(request, 503, error_reply(sent.rid, "worker_lost", "the worker serving this request "
                                                    "stopped while running it, twice; the request may be what stops "
                                                    "them (see the server's log)"))

    async def _shutdown(self, request, sent: "_Sent"):
        loop = asyncio.get_running_loop()
        say("shutdown requested: stopping the workers")
        await loop.run_in_executor(None, self.pool.stop)
        self.worker.stopped.set()
        loop.call_soon(self.server.stop_serving)
        return self.reply(request, 200, {"id": sent.rid, "ok": True, "result": {"stopping": True}})

    async def _with_workers(self, body: bytes) -> bytes:
        """``status``'s reply with ``workers``: each worker's device, whether it is up, its restarts
        and last exit code, and its queue as it answered (2 s at most) within the last second
        (asked at most once a second, whoever polls)."""
        async with self._live_lock:
            if time.monotonic() - self._live_at > LIVE_S:
                live = {}
                await asyncio.gather(*(self._ask(m, live) for m in self.pool.members if m.up and m.port))
                self._live, self._live_at = live, time.monotonic()
        summary = self.pool.summary()
        for entry, member in zip(summary, self.pool.members):
            if member.up:
                entry.update(self._live.get(member.index, {"answering": False}))
        return _add_result(body, workers=summary)

    async def _ask(self, member: Member, live: dict) -> None:
        """``member``'s own ``status`` (its queue), asked in a session the front keeps for it."""
        monitor = self.server.monitor_sessions
        try:
            r = await self._http().post(f"http://127.0.0.1:{member.port}/rpc", timeout=2.0,
                                        content=b'{"id": null, "op": "status"}',
                                        headers={"Host": f"127.0.0.1:{member.port}", "Content-Type": "application/json",
                                                 "Authorization": f"Bearer {self._token}",
                                                 SESSION_HEADER: monitor.get(member.index, "")})
            if r.headers.get(SESSION_HEADER):
                monitor[member.index] = r.headers[SESSION_HEADER]
            st = r.json().get("result") or {}
            live[member.index] = {k: st.get(k) for k in ("busy", "queue_length", "requests_done", "cached_volumes",
                                                         "uptime_s")}
        except Exception:  # noqa: BLE001 - a worker that does not answer is shown as such
            live[member.index] = {"answering": False}


async def _file_chunks(path, started):
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return
            started["body"] = True
            yield chunk


class _Sent:
    """The request as the front reads it: its JSON ``body`` as the client sent it (what the worker
    gets) or, beside a volume, its ``text`` (the X-MedVol-Request header), and its ``op``, ``id``
    and named ``volume`` when the protocol's own parser reads it (each key once: a request the
    worker will refuse is never read otherwise here). Made off the event loop: the parse of a
    large body takes a while."""

    __slots__ = ("text", "body", "op", "rid", "volume")

    def __init__(self, raw):
        if isinstance(raw, dict):  # GET /status or /hello: the request as the routes made it
            self.text = json.dumps(raw)
            self.body = self.text.encode("utf-8")
        elif isinstance(raw, (bytes, bytearray)):
            self.text, self.body = None, bytes(raw) if not isinstance(raw, bytes) else raw
        else:
            self.text = str(raw)
            self.body = None
        try:
            req = raw if isinstance(raw, dict) else parse_request(raw)
        except MedVolError:
            req = {}
        op, rid, volume = req.get("op"), req.get("id"), req.get("volume")
        self.op = op if isinstance(op, str) else None
        self.rid = rid if valid_id(rid) else None
        self.volume = volume if isinstance(volume, str) and volume else None


def _add_result(body: bytes, **fields) -> bytes:
    """A JSON reply with ``fields`` added to its ``result`` (an error or a mask is left as it is)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body
    if isinstance(obj, dict) and obj.get("ok") and isinstance(obj.get("result"), dict):
        obj["result"].update(fields)
        return encode_line(obj)
    return body


def worker_arguments(args) -> list:
    """The options of ``medvol serve`` that each worker behind ``--devices`` gets as they were
    given (the front keeps the address, the token, the hosts and TLS for itself)."""
    out = []
    for flag, value in (("--preset", args.preset), ("--adapter", args.adapter), ("--data-dir", args.data_dir),
                        ("--out-dir", args.out_dir), ("--pacs-config", args.pacs_config),
                        ("--cache-size", args.cache_size), ("--feature-cache-mb", args.feature_cache_mb),
                        ("--max-voxels", args.max_voxels), ("--max-request-mb", args.max_request_mb),
                        ("--client-timeout", args.client_timeout), ("--session-idle-s", args.session_idle_s)):
        if value is not None:
            out += [flag, str(value)]
    for name in args.allow_pacs or ():
        out += ["--allow-pacs", name]
    # every connection of the front may go to one worker, and the front asks each for its status
    out += ["--max-connections", str((args.max_connections or DEFAULT_MAX_CONNECTIONS) + 8)]
    if getattr(args, "debug", False):
        out.append("--debug")
    return out


def serve_devices(settings: WorkerSettings, http: HttpSettings, devices, worker_args) -> int:
    """Serve HTTP on ``http``'s address with one worker per device until ``shutdown``, SIGINT or
    SIGTERM; returns the exit code."""
    try:
        import httpx  # noqa: F401 - the client that hands requests to the workers
    except ImportError:
        raise DependencyError("serving several devices needs httpx: pip install 'medvolcore[http]'") from None
    token = listening_token(http)
    check_folders(settings)
    tls = _check_tls(http)
    tmp_dir, lock_fd = make_tmp_dir()
    internal = secrets.token_urlsafe(32)
    token_file = tmp_dir / "workers.token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(internal + "\n")
    pool = Pool(devices, worker_args, str(token_file), threads=settings.threads)
    limits = _Limits(settings, tmp_dir)
    server = None
    old = install_signals()
    how = "shutdown"
    try:
        try:
            server = HttpServer(http, limits, token, debug=settings.debug, app=_front_with(pool, internal))
        except OSError as e:
            raise InputError(f"cannot listen on {http.host}:{http.port}: {e.strerror or e}") from None
        pool.start()
        how = serve_until_stopped(server, tls, token, f"; {len(devices)} workers: {', '.join(devices)}")
    except Stop:  # while the workers start
        how = "SIGTERM"
    except KeyboardInterrupt:
        how = "SIGINT"
    finally:
        pool.stop()
        if server is not None:
            server.server_close()
        release_tmp_dir(tmp_dir, lock_fd)
        import signal

        for sig, handler in old.items():
            signal.signal(sig, handler)
    say(f"stopped ({how})")
    sys.stderr.flush()
    return EXIT_CODES.get(how, 0)


def _front_with(pool: Pool, internal: str):
    def make(server):
        server.pool = pool
        server.internal_token = internal
        server.monitor_sessions = {}
        return Front(server)

    return make
