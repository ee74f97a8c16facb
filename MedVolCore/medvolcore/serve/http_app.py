"""The routes of ``medvol serve --http`` as a Starlette application: ``POST /rpc``, ``GET /status``,
``GET /hello`` and ``GET /openapi.json`` (generated from these routes' descriptions).

Every request is checked on its headers before any of its body is read (:meth:`Transport.checks`:
framing, ``Host``, ``Origin``, token, session); a body must then arrive at
``BODY_MIN_RATE`` (after ``client_timeout`` seconds of grace), else the client gets 408 and the
connection is closed. A JSON body is bounded by ``--max-request-mb``; a volume body by the voxel
limit from its header, streamed to a private file (:mod:`.upload`). The worker answers in its own
thread; a client whose connection is lost while it waits has its request cancelled.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import re
import threading
import time
import types
import urllib.parse
from typing import Optional

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.schemas import SchemaGenerator

from ..errors import LimitError, MedVolError
from .lifecycle import loggable
from .http_conn import BODY_MIN_RATE, DRAIN_MAX
from .protocol import PROTOCOL, CountedJSON, RequestError, _jsonable, check_json_cost, encode_line, error_reply, internal_reply
from .upload import WHAT as UPLOAD_WHAT
from .sessions import SessionsFull, client_key
from .upload import BodyWriter, body_bound, check_space, read_header, upload_ceiling
from .worker import MASK_BYTES_KEY, log

__all__ = ["Transport", "BODY_MIN_RATE", "decode_request_header"]

SESSION_HEADER = "X-MedVol-Session"
VOLUME_HEADER = "X-MedVol-Volume"  # the affinity key a load balancer routes on (docs/deploy.md)
VOLUME_KEY = re.compile(r"[A-Za-z0-9._:-]{1,128}")
REQUEST_HEADER = "X-MedVol-Request"
CLIENT_HEADER = "X-MedVol-Client"  # the client's address, from the front of --devices to its workers only
MASK_TYPE = "application/gzip"  # ``Accept`` this: the mask comes back as the body, the reply in a header
REPLY_HEADER = "X-MedVol-Reply"
MAX_REPLY_HEADER = 32 << 10  # a longer reply goes back as JSON with ``mask_b64`` (clients cap header lines)
_CONTENT_LENGTH = re.compile(r"[0-9]{1,15}")


class _TooSlow(Exception):
    pass


class _Gone(Exception):
    pass


def decode_request_header(raw: bytes) -> str:
    """The request object carried in ``X-MedVol-Request``: the header's bytes are UTF-8 and
    percent-encoded octets (``%C3%B6``) are decoded, so a client sends any text as ASCII
    (``docs/protocol.md``). Raises ValueError for bytes that are not UTF-8."""
    text = raw.decode("utf-8")
    return urllib.parse.unquote(text, encoding="utf-8", errors="strict")


def _header_id(header: str):
    """The ``id`` of the request object in a volume body's header, when it reads as one, else None."""
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


def _split_host(value: str) -> str:
    """``name[:port]`` or ``[v6]:port`` → the lower-case name without brackets or port."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


class _Headers(dict):
    """A request's headers by lower-case name, read as Starlette's ``Headers`` reads them (any
    case; latin-1; the first of a repeated header), built once from the ASGI scope."""

    def __init__(self, raw):
        super().__init__((k.decode("latin-1"), v.decode("latin-1")) for k, v in reversed(raw))

    def __getitem__(self, key):
        return dict.__getitem__(self, key.lower())

    def get(self, key, default=None):
        return dict.get(self, key.lower(), default)

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key.lower())


class _Request:
    """What the checks and the worker call read of a ``GET /status`` or ``GET /hello`` request
    (no body): the scope, its headers and a state, without Starlette's request object (these
    two routes are what a client polls, many times a second)."""

    __slots__ = ("scope", "receive", "method", "headers", "state")

    def __init__(self, scope, receive):
        self.scope = scope
        self.receive = receive
        self.method = scope["method"]
        self.headers = _Headers(scope["headers"])
        self.state = types.SimpleNamespace()


class _Reply:
    """A JSON reply sent as two ASGI messages (what Starlette's ``Response`` sends, without
    building one)."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list, body: bytes):
        self.status, self.headers, self.body = status, headers, body

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


_NOSNIFF = (b"x-content-type-options", b"nosniff")
_NO_STORE = (b"cache-control", b"no-store")
_JSON = (b"content-type", b"application/json")
_INLINE = frozenset(("/status", "/hello"))  # the polled routes, answered at once in the serving thread


class Transport:
    """The application of one :class:`~medvolcore.serve.http.HttpServer`."""

    def __init__(self, server):
        self.server = server
        self.worker = server.worker
        routes = [Route("/rpc", self.rpc, methods=["POST"]), Route("/status", self.status, methods=["GET"]),
                  Route("/hello", self.hello, methods=["GET"]), Route("/openapi.json", self.openapi, methods=["GET"])]
        self.schemas = SchemaGenerator({"openapi": "3.0.0", "info": {"title": "medvol serve",
                                                                     "version": f"protocol {PROTOCOL}"}})
        self.routes = routes  # the one declaration: dispatched on below, described at /openapi.json
        self._by_path = {route.path: route for route in routes}
        self.extra = None  # more routes mounted beside these (:mod:`.monailabel`): ``handles(path)``, then called

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        # the polled routes without Starlette's request object (any other method or path: below)
        fast = scope["method"] == "GET" and scope["path"].rstrip("/") in _INLINE
        request = _Request(scope, receive) if fast else Request(scope, receive)
        request.state.t0 = time.monotonic()
        request.state.session = None
        refusal = self.checks(request) or self.open_session(request)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        route = self._by_path.get(scope["path"].rstrip("/"))
        try:
            if route is None and self.extra is not None and self.extra.handles(scope["path"]):
                response = await self.extra(request)
            elif route is None:
                response = self.reply(request, 404, error_reply(None, "not_found", "no such path; use POST /rpc, "
                                                                "GET /status or GET /hello"), close=request.method != "GET")
            elif request.method not in route.methods:
                response = self.reply(request, 405, error_reply(None, "bad_request", "use POST /rpc, GET /status or "
                                                                "GET /hello"), close=True)
            else:
                response = await route.endpoint(request)
        except _Gone:
            return
        await response(scope, receive, send)

    # -- replies --
    def reply(self, request: Request, status: int, obj: dict, close: bool = False) -> _Reply:
        body = encode_line(obj)
        headers = [_NOSNIFF, _NO_STORE]
        if request.state.session:
            headers.append((b"x-medvol-session", request.state.session.encode("latin-1")))
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="medvol"'))
        if close:
            headers.append((b"connection", b"close"))
        headers += ((b"content-length", b"%d" % len(body)), _JSON)
        return _Reply(status, headers, body)

    def refuse(self, request: Request, status: int, code: str, message: str, rid=None) -> _Reply:
        log.warning("http %s %s %s refused: %s", self._client(request), loggable(request.method, 20),
                    self._log_path(request), loggable(message, 300))
        return self.reply(request, status, error_reply(rid, code, message), close=True)

    @staticmethod
    def _client(request: Request) -> str:
        client = request.scope.get("client")
        return client[0] if client else "-"

    @staticmethod
    def _log_path(request: Request) -> str:
        path = request.scope.get("raw_path", b"").decode("latin-1")
        return loggable(path, 100) + ("?…" if request.scope.get("query_string") else "")

    def _access(self, request: Request, op, rid, outcome) -> None:
        log.info("http %s %s id=%s -> %s (%.2f s)", self._client(request), op,
                 "null" if rid is None else json.dumps(rid)[:40], outcome,
                 time.monotonic() - request.state.t0)

    # -- checks on the headers alone, before any body is read --
    def checks(self, request: Request) -> Optional[Response]:
        """A refusal of what the request's headers say (framing, volume key, ``Host``, ``Origin``,
        token), or None."""
        h = request.headers
        if "transfer-encoding" in h:
            return self.refuse(request, 400, "bad_request", "Transfer-Encoding is not supported; send the body "
                                                            "with one Content-Length header")
        length = h.get("content-length")
        if length is not None and not _CONTENT_LENGTH.fullmatch(length.strip(" \t")):
            return self.refuse(request, 400, "bad_request", "Content-Length must be a number of at most 15 ASCII "
                                                            "digits")
        if length is not None and request.method != "POST" and int(length) != 0:
            return self.refuse(request, 400, "bad_request", f"a {request.method} request has no body; POST requests "
                                                            "go to /rpc")
        key = h.get(VOLUME_HEADER)
        if key is not None and not VOLUME_KEY.fullmatch(key):
            return self.refuse(request, 400, "bad_request", f"{VOLUME_HEADER} must be 1 to 128 letters, digits or "
                                                            "'.', '_', ':', '-' (the sha256 of the volume sent)")
        server = self.server
        allowed = server.allowed
        host = h.get("host")
        if allowed is not None and host is not None and _split_host(host) not in allowed:
            return self.refuse(request, 403, "forbidden", f"Host {host[:100]!r} is not this server's name; start "
                                                          "it with --allowed-host NAME to accept it")
        origin = h.get("origin")
        if origin is not None:
            names = allowed if allowed is not None else {_split_host(host or "")}
            port = server.server_address[1]
            own = {f"{scheme}://{n if ':' not in n else '[' + n + ']'}:{port}" for n in names
                   for scheme in ("http", "https")}
            if origin.strip().lower() not in own:
                return self.refuse(request, 403, "forbidden", f"cross-origin requests are refused (Origin "
                                                              f"{origin[:100]!r})")
        if server.token is not None:
            scheme, _, value = h.get("authorization", "").partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode("latin-1"),
                                                                         server.token.encode("utf-8"))):
                return self.refuse(request, 401, "unauthorized", "missing or wrong token: send 'Authorization: "
                                                                 "Bearer TOKEN'")
        return None

    def open_session(self, request: Request) -> Optional[Response]:
        """The request's session (the one it names, when this server issued it, else a new one),
        in ``request.state.session``; a refusal when its client may hold no more."""
        sid = (request.headers.get(SESSION_HEADER) or "").strip()[:64]
        client = self._client(request)
        if self.server.settings.behind_front:  # the front's own header (its token was checked above)
            client = (request.headers.get(CLIENT_HEADER) or client)[:64]
        try:
            request.state.session = self.server.sessions.session(sid, client_key(client))
        except SessionsFull as e:
            return self.refuse(request, 429, "busy", str(e))
        return None

    # -- routes --
    async def status(self, request: Request) -> Response:
        """
        summary: The worker's state as this client's session sees it (protocol op "status").
        responses:
          200: {description: "a protocol reply (JSON)"}
        """
        return await self._call(request, {"id": None, "op": "status"}, inline=True)

    async def hello(self, request: Request) -> Response:
        """
        summary: The protocol version, models, licences and limits (protocol op "hello").
        responses:
          200: {description: "a protocol reply (JSON)"}
        """
        return await self._call(request, {"id": None, "op": "hello"}, inline=True)

    async def openapi(self, request: Request) -> Response:
        """
        summary: This description of the routes, generated from them.
        responses:
          200: {description: "OpenAPI 3 (JSON)"}
        """
        schema = self.schemas.get_schema(self.routes)
        return Response(json.dumps(schema, indent=1), 200, {"Cache-Control": "no-store"},
                        media_type="application/json")

    async def rpc(self, request: Request) -> Response:
        """
        summary: One protocol request (docs/protocol.md).
        description: >
          A JSON body (application/json) is one request object. A volume body
          (application/octet-stream, NIfTI .nii or .nii.gz) carries the request object in the
          X-MedVol-Request header, UTF-8 with non-ASCII text percent-encoded. With
          "Accept: application/gzip" a mask comes back as the body and the reply in X-MedVol-Reply.
        responses:
          200: {description: "a protocol reply (JSON), or the mask (application/gzip)"}
          400: {description: "a refused request (JSON error)"}
          408: {description: "the body arrived slower than 256 kB/s"}
          413: {description: "a body over the limits"}
        """
        ctype = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
        if ctype not in ("application/json", "application/octet-stream"):
            return self.refuse(request, 415, "bad_request", f"Content-Type must be application/json (a request) or "
                                                            f"application/octet-stream (a volume), got "
                                                            f"{ctype or 'none'!r}")
        length = request.headers.get("content-length")
        if length is None:
            return self.reply(request, 411, error_reply(None, "bad_request", "a Content-Length header is required"),
                              close=True)
        n = int(length.strip(" \t"))
        try:
            if ctype == "application/octet-stream":
                return await self._post_volume(request, n)
            return await self._post_json(request, n)
        except _TooSlow:
            return self.refuse(request, 408, "bad_request", f"the body arrived slower than "
                                                            f"{BODY_MIN_RATE >> 10} kB/s")

    # -- bodies --
    async def _chunks(self, request: Request, n: int):
        """The body's chunks as they arrive; raises _TooSlow when byte ``k`` has not arrived
        ``client_timeout + k / BODY_MIN_RATE`` seconds after the headers, _Gone when the client left."""
        loop = asyncio.get_running_loop()
        start, grace, got = loop.time(), self.server.settings.client_timeout, 0
        if n == 0:
            return
        while True:
            left = start + grace + got / BODY_MIN_RATE - loop.time()
            if left <= 0:
                raise _TooSlow()
            try:
                msg = await asyncio.wait_for(request.receive(), left)
            except asyncio.TimeoutError:
                raise _TooSlow() from None
            if msg["type"] == "http.disconnect":
                raise _Gone()
            chunk = msg.get("body", b"")
            got += len(chunk)
            if chunk:
                yield chunk
            if not msg.get("more_body", False):
                if got < n:
                    raise _Gone()
                return

    async def _post_json(self, request: Request, n: int) -> Response:
        limit = self.worker.max_request_bytes
        chunks = self._chunks(request, n)
        if n > limit:
            if n <= DRAIN_MAX:  # read and dropped after the reply, so that its client sees it (http_conn)
                request.state.drain = n
            return self.reply(request, 413, error_reply(None, "too_large", f"request body of {n} bytes is over "
                                                                           f"--max-request-mb {limit / (1 << 20):g} MB"),
                              close=True)
        data, keys, values = bytearray(), 0, 0
        async for chunk in chunks:
            try:  # the parse's cost, bounded as the body arrives (a few ms a MB), before it is parsed
                keys, values = check_json_cost(chunk, keys, values)
            except RequestError as e:
                if n - len(data) - len(chunk) <= DRAIN_MAX:
                    request.state.drain = n - len(data) - len(chunk)
                return self.refuse(request, 413, e.code, str(e))
            data += chunk
        return await self._call(request, CountedJSON(data))

    async def _refuse_body(self, request, chunks, status, code, message, unread, rid=None) -> Response:
        """Refuse a volume body of which ``unread`` bytes were not read: the reply goes first, then
        up to ``refused_body_drain`` bytes of the rest are read and dropped (:meth:`.http_conn.Connection.close_or_drain`)
        and the connection is closed; a bigger rest is never read."""
        if 0 < unread <= DRAIN_MAX:
            request.state.drain = unread
        return self.refuse(request, status, code, message, rid)

    async def _post_volume(self, request: Request, n: int) -> Response:
        worker = self.worker
        chunks = self._chunks(request, n)
        raw = request.headers.raw
        header = next((v for k, v in raw if k == b"x-medvol-request"), None)
        if header is None:
            return await self._refuse_body(request, chunks, 400, "bad_request", "a volume body needs the request "
                                           "object in the X-MedVol-Request header", n)
        try:
            header = decode_request_header(header)
        except ValueError:
            return await self._refuse_body(request, chunks, 400, "bad_request", "the X-MedVol-Request header is not "
                                           "UTF-8; send non-ASCII text percent-encoded (%C3%B6)", n)
        rid = _header_id(header)
        ceiling = upload_ceiling(worker.max_voxels)
        if ceiling is not None and n > ceiling:
            return await self._refuse_body(request, chunks, 413, "too_large", f"a volume body of {n:,} bytes is more "
                                           f"than --max-voxels {worker.max_voxels:,} allows ({ceiling:,} bytes)", n, rid)
        prefix, info, writer = b"", None, None
        try:
            async for chunk in chunks:
                if writer is not None:
                    writer.write(chunk)
                    continue
                prefix += chunk
                info = read_header(prefix, len(prefix) >= n, worker.max_voxels)
                if info is None:
                    continue
                if n > body_bound(info):
                    raise LimitError(f"the {UPLOAD_WHAT} is {n:,} bytes, more than the {info.raw_bytes:,} bytes its "
                                     f"header declares need")
                check_space(worker.tmp_dir, n)
                writer = BodyWriter(prefix, info, worker.tmp_dir)
        except MedVolError as e:
            if writer is not None:
                writer.discard()
            return await self._refuse_body(request, chunks, 413 if e.code == "too_large" else 400, e.code, str(e),
                                           n - len(prefix), rid)
        except BaseException:
            if writer is not None:
                writer.discard()
            raise
        if writer is None:  # n == 0, or a body too short for a header
            try:
                read_header(prefix, True, worker.max_voxels)
            except MedVolError as e:
                return self.refuse(request, 413 if e.code == "too_large" else 400, e.code, str(e), rid)
            return self.refuse(request, 400, "bad_volume", f"the {UPLOAD_WHAT} is empty", rid)
        return await self._call(request, header, upload=writer.finish())

    # -- the worker --
    def _wants_mask_bytes(self, request: Request) -> bool:
        accept = request.headers.get("accept") or ""
        return any(part.split(";")[0].strip().lower() == MASK_TYPE for part in accept.split(","))

    async def _call(self, request: Request, raw, upload=None, inline: bool = False) -> Response:
        """Hand ``raw`` to the worker and wait for its final reply, or for the client to go
        (then the request is cancelled). ``inline``: ``status`` and ``hello``, answered at once
        without a thread, their request already a dict; anything a client wrote is parsed and
        checked in a worker thread."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        here = threading.get_ident()
        worker = self.worker

        def reply(obj):
            if "event" in obj:
                return
            if upload is not None:  # the worker is done with it: its one final reply
                upload.remove()
            if threading.get_ident() == here:  # answered at once, in this thread
                done.done() or done.set_result(obj)
            else:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(obj))

        def handle():
            return (worker.handle if inline else worker.handle_line)(
                raw, reply=reply, body=upload, transport="http", session=request.state.session,
                mask_bytes=self._wants_mask_bytes(request))

        try:
            job = handle() if inline else await loop.run_in_executor(None, handle)
        except Exception:  # noqa: BLE001 - a bad request never kills the server or goes unanswered
            if upload is not None:
                upload.remove()
            return self.reply(request, 500, internal_reply(None, f"HTTP {request.method} {self._log_path(request)}"),
                              close=True)
        if not await self._done_or_gone(request, done):
            if job is not None:
                worker.abandon(job)  # its reply, when it comes, removes the upload
                self._access(request, job.op, job.id, "client disconnected: cancelled")
            raise _Gone()
        r = done.result()
        self._access(request, job.op if job is not None else "-", r.get("id"),
                     "ok" if r.get("ok") else r.get("error", {}).get("code"))
        self.server.sessions.touch(request.state.session)
        if worker.stopped.is_set():
            loop.call_soon(self.server.stop_serving)
        mask = (r.get("result") or {}).pop(MASK_BYTES_KEY, None) if r.get("ok") else None
        if mask is not None:
            return self._mask_reply(request, r, mask)
        return self.reply(request, 200, r)

    async def _done_or_gone(self, request: Request, fut) -> bool:
        """Wait until ``fut`` is done or the client has gone; whether ``fut`` is done."""
        if not fut.done():
            gone = asyncio.ensure_future(self._disconnected(request))
            try:
                await asyncio.wait({fut, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not gone.done():
                    gone.cancel()
        return fut.done()

    @staticmethod
    async def _disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def _mask_reply(self, request: Request, r: dict, mask: bytes) -> Response:
        """The mask (``.nii.gz``) as the body, the reply envelope (without the mask) in the
        ``X-MedVol-Reply`` header, ASCII JSON; a reply too long for one header line goes as JSON
        with ``mask_b64``, as to an old client."""
        head = json.dumps(_jsonable(r), ensure_ascii=True, separators=(",", ":"), allow_nan=False)
        if len(head) > MAX_REPLY_HEADER:
            r["result"]["mask_b64"] = base64.b64encode(mask).decode("ascii")
            return self.reply(request, 200, r)
        headers = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store", REPLY_HEADER: head}
        if request.state.session:
            headers[SESSION_HEADER] = request.state.session
        return Response(mask, 200, headers, media_type=MASK_TYPE)
