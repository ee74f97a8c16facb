"""One HTTP connection of ``medvol serve --http``: uvicorn's HTTP/1.1 protocol (httptools) with
the transport's connection rules added (``docs/architecture.md``, "Worker trust boundary").

- at most ``max_connections`` connections at once: one more is answered 503 (JSON) at once and
  closed, before anything of it is read;
- a client has ``client_timeout`` seconds to send a request's line and headers (and as long
  between requests on a kept-alive connection), else it is disconnected;
- a request repeating a protocol header (:data:`SINGLE_HEADERS`), or one the parser cannot frame
  (two ``Content-Length``, digits that are not ASCII, ``Transfer-Encoding`` beside
  ``Content-Length``, a malformed line), is answered 400 as a JSON error and the connection
  closed;
- a request target (path and query) over ``request_line`` bytes gets 414, a header line over ``header_line``, more
  than ``header_count`` headers, or a request line and headers over ``header_bytes`` in all get
  431 (:mod:`.limits`; nginx's ``large_client_header_buffers 4 64k``), as a JSON error, and the
  connection is closed: counted on the bytes as they arrive, before the parser keeps them, so
  a client without a token never makes the server hold more than ``header_bytes`` of it;
- a refused request whose body is still coming has its rest read and dropped after the reply
  when that rest is at most ``refused_body_drain`` bytes, at the minimum body rate and within
  ``DRAIN_MAX_S`` seconds, so that its client sees the reply; then the connection is closed (a
  larger rest is not read at all): a refused body never keeps its slot longer;
- a client that half-closes its side after its request (``shutdown(SHUT_WR)``) still gets its
  reply: the end of its stream only stops reading. While the reply is pending, the server then
  sends ``100 Continue`` once a second (an interim reply every HTTP/1.1 client skips); a client
  that is really gone answers it with a reset, its connection is lost and its request cancelled.
"""

from __future__ import annotations

import socket

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .limits import limit
from .lifecycle import loggable
from .protocol import encode_line, error_reply
from .worker import log

__all__ = ["Connection", "SINGLE_HEADERS", "BODY_MIN_RATE"]

# headers the protocol reads one value of: a request carrying one of them twice is refused
SINGLE_HEADERS = frozenset((b"content-length", b"transfer-encoding", b"host", b"origin", b"content-type", b"accept",
                            b"authorization", b"x-medvol-request", b"x-medvol-session",
                            b"x-medvol-volume", b"x-medvol-client"))
BODY_MIN_RATE = int(limit("body_rate").default)  # bytes/s a client must at least sustain while sending a body
MAX_REQUEST_LINE = int(limit("request_line").default)
MAX_HEADER_LINE = int(limit("header_line").default)
MAX_HEADER_BYTES = int(limit("header_bytes").default)
MAX_HEADERS = int(limit("header_count").default)
DRAIN_MAX = int(limit("refused_body_drain").default)
DRAIN_GRACE_S = 0.5  # a refused body's rest must then arrive at BODY_MIN_RATE …
DRAIN_MAX_S = 5.0  # … and within this, whatever its size
_PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"
PROBE_INTERVAL_S = 1.0


def _header_name(name: bytes) -> str:
    return "-".join(w.capitalize() for w in name.decode("latin-1").split("-")).replace("Medvol", "MedVol")


def _raw_reply(status: int, reason: str, obj: dict, extra: str = "") -> bytes:
    body = encode_line(obj)
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"X-Content-Type-Options: nosniff\r\nCache-Control: no-store\r\n{extra}Connection: close\r\n\r\n"
            ).encode("ascii") + body


class _Transport:
    """The socket's transport as uvicorn sees it. A reply's writes (its head, its body) leave in
    one send once it is complete (two small sends on a kept-alive connection cost a round trip
    each); closing it after a refusal whose request body is still coming first reads
    and drops that rest (:meth:`Connection.close_or_drain`)."""

    def __init__(self, transport, connection):
        self._transport = transport
        self._connection = connection
        self._pending = []

    def write(self, data) -> None:
        cycle = self._connection.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self._pending.append(bytes(data))  # a reply being written: it leaves when complete
            return
        self.flush()
        self._transport.write(data)

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
            self._pending = []
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._connection.close_or_drain()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class Connection(HttpToolsProtocol):
    """uvicorn's httptools protocol with the connection rules above; ``owner`` is the
    :class:`~medvolcore.serve.http.HttpServer` (set on a subclass made per server)."""

    owner = None

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._timer = None
        self._probe_timer = None
        self._refused = False
        self._eof = False
        self._why = None
        self._raw = None
        self._status = None
        self._drain_left = None
        self._seen = set()
        self.url = b""
        self._head = 0  # bytes of the current request's line and headers received so far (None: all in)
        self._headers = 0

    # -- the connection cap and the deadline for a request's line and headers --
    def connection_made(self, transport) -> None:
        owner = self.owner
        if len(self.connections) >= owner.settings.max_connections:
            self._refused = True
            self.transport = transport
            reply = error_reply(None, "busy", f"the server already serves {owner.settings.max_connections} "
                                              "connections; try again later")
            transport.write(_raw_reply(503, "Service Unavailable", reply, "Retry-After: 5\r\n"))
            transport.close()
            return
        self._raw = transport
        super().connection_made(_Transport(transport, self))
        if hasattr(transport, "max_size"):  # asyncio reads 256 kB at a time: a volume body comes faster in 1 MB
            transport.max_size = 1 << 20
        sock = transport.get_extra_info("socket")
        try:  # a reply's head and body: without it a second write would wait for a delayed ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):
            pass
        owner.peak_connections = max(owner.peak_connections, len(self.connections))
        self._arm()

    # -- parsing: each protocol header once --
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._seen = set()
        self._headers = 0
        if self._head is None:  # a next request on this connection
            self._head = 0

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > MAX_REQUEST_LINE:
            self._why = f"the request target is too long (over {MAX_REQUEST_LINE >> 10} kB)"
            self._status = 414
            raise ValueError(self._why)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        if len(name) + len(value) > MAX_HEADER_LINE or self._headers > MAX_HEADERS:
            self._why = (f"a header line is too long (over {MAX_HEADER_LINE >> 10} kB)" if self._headers <= MAX_HEADERS
                         else f"too many headers (over {MAX_HEADERS})")
            self._status = 431
            raise ValueError(self._why)
        lower = name.lower()
        if lower in SINGLE_HEADERS:
            if lower in self._seen:
                self._why = f"a request may carry one {_header_name(lower)} header, not several"
                raise ValueError(self._why)  # the parser stops; send_400_response answers
            self._seen.add(lower)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head = None
        self._disarm()
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._drain_left is not None:
            self._drain_left -= len(data)
            if self._drain_left <= 0:
                self._raw.close()
            return
        if self._refused or self._raw.is_closing():
            return
        self._unset_keepalive_if_required()
        rest = b""
        if self._head is not None:  # the request line and headers: bounded before the parser keeps them
            room = MAX_HEADER_BYTES - self._head
            if len(data) > room:
                data, rest = data[:room], data[room:]
            self._head += len(data)
        try:
            if data:
                self.parser.feed_data(data)
            if rest and self._head is not None:  # still in the headers, and over the bound
                self._why = f"the request line and headers are too large (over {MAX_HEADER_BYTES >> 10} kB)"
                self._status = 431
                self.send_400_response(self._why)
                return
            if rest:
                self.parser.feed_data(rest)
        except httptools.HttpParserUpgrade:
            self._why = "protocol upgrades are not supported"
            self.send_400_response(self._why)
        except httptools.HttpParserError as e:
            # the parser's reason, without the bytes it may quote (a query, a token)
            self._why = self._why or (str(e).split(":", 1)[0].strip() or "malformed request")
            if not self.url:  # refused in its request line: the log names what it held
                parts = data.split(b"\n", 1)[0].split(b" ")
                self.url = parts[1] if len(parts) > 1 else b""
            self.send_400_response(self._why)

    # -- a refused body: the reply first, then up to ``drain`` bytes of the rest read and dropped --
    def close_or_drain(self) -> None:
        """Close; but after a reply that refused a request whose body is still coming, first
        read and drop up to the ``drain`` bytes the application allowed (at the minimum body
        rate), so that a client still sending its body sees the reply, not a reset."""
        cycle = self.cycle
        budget = 0
        if cycle is not None and cycle.response_complete and self._drain_left is None:
            # what the application did not read, less what arrived but it left in the buffer
            budget = min(int((cycle.scope.get("state") or {}).get("drain") or 0), DRAIN_MAX) - len(cycle.body)
        if budget <= 0 or not cycle.more_body or self._raw.is_closing():
            self._raw.close()
            return
        self._drain_left = budget
        self._disarm()
        self._timer = self.loop.call_later(min(DRAIN_MAX_S, DRAIN_GRACE_S + budget / BODY_MIN_RATE), self._raw.close)
        self._raw.resume_reading()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._probe_timer is not None:
            self._probe_timer.cancel()
        if self._refused:
            return
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._timer = self.loop.call_later(self.owner.settings.client_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _too_slow(self) -> None:
        self._timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def on_response_complete(self) -> None:
        self.transport.flush()
        super().on_response_complete()
        if self._drain_left is not None:  # its own deadline runs
            self._unset_keepalive_if_required()
        elif self._eof:
            self.transport.close()
        elif not self.transport.is_closing():
            self._arm()

    # -- refusals of the framing, as JSON --
    def send_400_response(self, msg: str) -> None:
        why = self._why or msg
        try:
            method = loggable(self.parser.get_method().decode("latin-1"), 20)
        except Exception:  # noqa: BLE001 - no method parsed yet
            method = "-"
        target = bytes(self.url or b"").decode("latin-1")
        path = (loggable(target.split("?", 1)[0], 100) + ("?…" if "?" in target else "")) if target else "-"
        client = self.client[0] if self.client else "-"
        log.warning("http %s %s %s refused: %s", client, method, path, loggable(why, 300))
        status = self._status or (431 if "too large" in why or "too long" in why else 400)
        reply = error_reply(None, "too_large" if status != 400 else "bad_request", why[:300])
        reason = {400: "Bad Request", 414: "URI Too Long", 431: "Request Header Fields Too Large"}[status]
        self.transport.write(_raw_reply(status, reason, reply))
        self.transport.close()

    # -- a half-closed client still gets its reply --
    def eof_received(self) -> bool:
        cycle = self.cycle
        if cycle is None or cycle.response_complete or cycle.more_body:
            return False  # idle, or gone in the middle of its request: close
        self._eof = True
        self._probe()
        return True  # keep writing: the reply is still to come

    def _probe(self) -> None:
        self._probe_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or cycle.response_started or cycle.disconnected:
            return
        self.transport.write(_PROBE)
        self._probe_timer = self.loop.call_later(PROBE_INTERVAL_S, self._probe)
