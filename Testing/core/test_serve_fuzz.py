"""The HTTP front door under random input: request lines, headers, bodies and JSON drawn by
Hypothesis (a bounded number of examples) never give ``internal``, a 500, a logged traceback, or a
server that stops answering ``GET /hello``.

An in-process worker on 127.0.0.1 whose jobs are stand-ins (``test_serve_http._InProcess``) takes
every example on a new connection, raw, as a hostile client would send it.
"""

from __future__ import annotations

import json
import logging
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.test_serve_http import _InProcess, read_replies
from medvolcore.serve.protocol import OPS

pytestmark = pytest.mark.probe("55.3", "random request lines, headers, bodies and JSON at the front door")


@pytest.fixture(scope="module")
def srv():
    s = _InProcess(max_request_bytes=256 << 10)
    yield s
    s.close()


_TOKEN = st.text(st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters=":"), min_size=1,
                 max_size=20)
_VALUE = st.text(st.characters(min_codepoint=0, max_codepoint=255, blacklist_characters="\r\n"), max_size=80)
_NAMES = st.sampled_from(["Content-Type", "Content-Length", "X-MedVol-Request", "X-MedVol-Session", "X-MedVol-Volume",
                          "Accept", "Origin", "Authorization", "Transfer-Encoding", "Expect", "Host", "Upgrade",
                          "X-MedVol-Client"])
_CTYPES = st.sampled_from(["application/json", "application/octet-stream", "text/plain", "application/json; x=1"])
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=12)
_REQUEST = st.fixed_dictionaries({"op": st.sampled_from([o for o in OPS if o != "shutdown"]) | st.text(max_size=8)},
                                 optional={"id": _JSON, "volume": _JSON, "query": _JSON, "anchor": _JSON,
                                           "volume_b64": st.text(max_size=40), "target": _JSON, "preset": _JSON})


@st.composite
def requests(draw) -> bytes:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "HEAD", "OPTIONS", "DELETE"]) | _TOKEN)
    path = draw(st.sampled_from(["/rpc", "/hello", "/status", "/openapi.json", "/", "/rpc/"]) |
                st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.1 x"]))
    kind = draw(st.sampled_from(["request", "json", "bytes", "none"]))
    if kind == "request":
        body = json.dumps(draw(_REQUEST)).encode()
    elif kind == "json":
        body = json.dumps(draw(_JSON)).encode()
    elif kind == "bytes":
        body = draw(st.binary(max_size=600))
    else:
        body = b""
    body = body.replace(b"shutdown", b"shut")
    headers = [("Host", "127.0.0.1"), ("Content-Type", draw(_CTYPES))]
    headers += draw(st.lists(st.tuples(_NAMES | _TOKEN, _VALUE), max_size=5))
    length = draw(st.sampled_from([len(body), len(body), len(body), None, max(0, len(body) - 1), "x1", "-1"]))
    if length is not None:
        headers.append(("Content-Length", str(length)))
    headers.append(("Connection", "close"))
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("latin-1", "replace") + body


def _send(port: int, data: bytes, wait: float = 0.5) -> bytes:
    """Everything the server sends back on a new connection until it closes (or ``wait`` s)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=wait)
    got = b""
    try:
        s.sendall(data)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except (socket.timeout, ConnectionResetError, BrokenPipeError):
        pass
    finally:
        s.close()
    return got


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=requests())
def test_random_requests_never_give_internal_and_hello_still_answers(srv, data):
    errors = _Errors()
    log = logging.getLogger("medvolcore")
    log.addHandler(errors)
    try:
        got = _send(srv.port, data)
    finally:
        log.removeHandler(errors)
    statuses = [int(line.split()[1]) for line in got.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")
                and len(line.split()) > 1 and line.split()[1].isdigit()]
    assert 500 not in statuses and b'"internal"' not in got, (data[:300], got[:300])
    assert not [r for r in errors.records if "internal error" in r or "Traceback" in r], errors.records
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    s.sendall(b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    hello, _ = read_replies(s, 5)
    s.close()
    assert hello and hello[0][0] == 200 and hello[0][1]["ok"] is True
