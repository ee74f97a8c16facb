"""The HTTP transport's connection rules (``medvol serve --http`` on uvicorn): a body sent slower
than the minimum rate is cut, a half-closed client still gets its reply, ``X-MedVol-Request`` is
UTF-8 with percent-encoding, a repeated protocol header is refused, the OpenAPI description and
TLS. The in-process server of :mod:`core.test_serve_http` (client timeout 5 s) answers them."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse

import nibabel as nib
import numpy as np
import pytest

from core.test_serve_http import _InProcess, rpc
from core.test_serve_http import read_replies as _replies

from medvolcore.serve.http import HttpServer, HttpSettings
from medvolcore.serve.worker import Worker


@pytest.fixture(scope="module")
def server():
    s = _InProcess()
    yield s
    s.close()


def _nifti_header(shape, dtype=np.int16) -> bytes:
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(dtype)
    hdr["vox_offset"] = 352
    return hdr.binaryblock + b"\0" * 4


@pytest.mark.probe("45.1", "a 512 MB volume body dripped one byte every 0.5 s (client timeout 5 s)")
def test_a_slow_drip_body_is_cut(server, record_property):
    head = _nifti_header((1024, 1024, 256))  # 512 MB of voxels: the old deadline was 5 s + 2,048 s
    n = len(head) + 1024 * 1024 * 256 * 2
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    t = time.perf_counter()
    s.sendall(b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
              b'X-MedVol-Request: {"id": "drip", "op": "segment", "query": "q"}\r\n'
              + f"Content-Length: {n}\r\n\r\n".encode() + head)
    cut = None
    try:
        while time.perf_counter() - t < 15:
            s.sendall(b"\0")
            time.sleep(0.5)
    except (BrokenPipeError, ConnectionResetError):
        cut = time.perf_counter() - t
    replies, closed = _replies(s, 1)
    s.close()
    cut = cut or time.perf_counter() - t
    record_property("slow body cut after s", round(cut, 2))
    assert closed or cut < 15, "a body sent at 2 bytes/s held its connection for 15 s"
    assert cut < 10
    if replies:
        assert replies[0][0] == 408 and replies[0][1]["error"]["code"] == "bad_request"
    st, r, _ = rpc(server.connect(), {"id": "after", "op": "status"})
    assert st == 200 and r["ok"]


@pytest.mark.probe("45.1", "a client half-closes its side after a request that runs 1 s")
def test_a_half_closed_client_gets_its_reply():
    s = _InProcess()
    try:
        body = json.dumps({"id": "half", "op": "segment", "volume_b64": "AA==", "query": "block"}).encode()
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 10
        while not s.worker.status()["busy"] and time.monotonic() < deadline:
            time.sleep(0.02)
        sock.shutdown(socket.SHUT_WR)  # nothing more to send; still reading
        threading.Timer(1.5, s.gate.set).start()
        replies, closed = _replies(sock, 10)
        sock.close()
        assert replies and replies[0][0] == 200, replies
        assert replies[0][1]["ok"] is True and replies[0][1]["result"] == {"echo": "half"}
        assert closed
    finally:
        s.close()


def _volume_request(port: int, header: bytes, body: bytes) -> tuple:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                 b"Connection: close\r\nX-MedVol-Request: " + header + b"\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    replies, _ = _replies(sock, 30)
    sock.close()
    return replies[0]


@pytest.mark.probe("45.1", "X-MedVol-Request naming \"Größe\" as UTF-8, percent-encoded and raw")
def test_the_request_header_is_utf8_percent_encoded(server, small_ct):
    ct = small_ct[0].read_bytes()
    req = '{"id": "Größe 50%", "op": "segment", "query": "Größe"}'
    encoded = urllib.parse.quote(req, safe=" {}:,\"").encode("ascii")
    assert b"%C3%B6" in encoded and b"%25" in encoded
    for header in (encoded, req.replace("%", "%25").encode("utf-8")):
        st, r = _volume_request(server.port, header, ct)
        assert st == 200 and r["ok"] is True, r
        assert r["id"] == "Größe 50%" and r["result"] == {"echo": "Größe 50%"}
    st, r = _volume_request(server.port, b'{"id": "x\xff", "op": "segment", "query": "q"}', ct)
    assert st == 400 and r["error"]["code"] == "bad_request" and "UTF-8" in r["error"]["message"]


REPEATED = {
    "X-MedVol-Request": ("application/octet-stream", b'X-MedVol-Request: {"id": 1, "op": "hello"}\r\n' * 2),
    "Origin": ("application/json", b"Origin: http://127.0.0.1:{port}\r\n" * 2),
    "Host": ("application/json", b"Host: 127.0.0.1\r\n"),
    "Content-Type": ("application/json", b"Content-Type: application/json\r\n"),
    "Accept": ("application/json", b"Accept: application/json\r\n" * 2),
    "X-MedVol-Session": ("application/json", b"X-MedVol-Session: {sid}\r\n" * 2),
    "Authorization": ("application/json", b"Authorization: Bearer 0123456789abcdef\r\n" * 2),
    "X-MedVol-Volume": ("application/json", b"X-MedVol-Volume: " + b"ab" * 32 + b"\r\n" + b"X-MedVol-Volume: cd\r\n"),
    "Content-Length (equal)": ("application/json", b"Content-Length: 24\r\n"),
}


def test_the_volume_key_is_checked_not_trusted(server):
    """``X-MedVol-Volume`` only routes (a load balancer hashes it): a well-formed key is served
    whatever it says, a malformed one (what a proxy might split or log differently) gets 400."""
    for key, ok in (("ab" * 32, True), ("path:case_01.nii.gz", True), ("a b", False), ("x" * 129, False),
                    ("caf\u00e9", False), ("", False)):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.putrequest("GET", "/status", skip_accept_encoding=True)
        conn.putheader("X-MedVol-Volume", key.encode("utf-8"))
        conn.endheaders()
        r = conn.getresponse()
        reply = json.loads(r.read())
        conn.close()
        assert (r.status == 200 and reply["ok"]) is ok, (key, r.status, reply)
        if not ok:
            assert r.status == 400 and "X-MedVol-Volume" in reply["error"]["message"]


@pytest.mark.probe("45.1", "each protocol header sent twice")
@pytest.mark.parametrize("name", list(REPEATED))
def test_a_repeated_protocol_header_is_refused(server, name):
    _, _, sid = rpc(server.connect(), {"id": "h", "op": "hello"})
    ctype, extra = REPEATED[name]
    extra = extra.replace(b"{port}", str(server.port).encode()).replace(b"{sid}", sid.encode())
    body = b'{"id":"s","op":"status"}'
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: " + ctype.encode() + b"\r\n" + extra
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    replies, closed = _replies(sock, 5)
    sock.close()
    assert len(replies) == 1 and closed, (name, replies)
    st, r = replies[0]
    assert st == 400 and r["ok"] is False and r["error"]["code"] == "bad_request", (name, r)
    if name != "Content-Length (equal)":  # (the parser itself refuses a second Content-Length)
        assert "not several" in r["error"]["message"] and name in r["error"]["message"]


def test_openapi_description_is_generated_from_the_routes(server):
    conn = server.connect()
    conn.request("GET", "/openapi.json")
    resp = conn.getresponse()
    doc = json.loads(resp.read())
    conn.close()
    assert resp.status == 200 and doc["openapi"].startswith("3.")
    assert set(doc["paths"]) == {"/rpc", "/status", "/hello", "/openapi.json"}
    assert set(doc["paths"]["/rpc"]) == {"post"} and set(doc["paths"]["/status"]) == {"get"}
    assert "X-MedVol-Request" in doc["paths"]["/rpc"]["post"]["description"]


def test_every_json_reply_carries_the_same_headers(server):
    """``GET /status`` and ``GET /hello`` (answered without Starlette's request object), a 404, a
    ``POST /rpc`` and a refusal: each JSON reply is nosniff, no-store, its exact length, and names
    the session it was answered in (none for a refusal before a session exists)."""
    conn = server.connect()
    got = {}
    for method, path, body, headers in (("GET", "/status", None, {}), ("GET", "/hello/", None, {}),
                                        ("GET", "/nope", None, {}),
                                        ("POST", "/rpc", b'{"id": 1, "op": "status"}',
                                         {"Content-Type": "application/json"}),
                                        ("GET", "/status", None, {"Origin": "http://evil.example"})):
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        got[(method, path, "Origin" in headers)] = (resp.status, resp.getheaders(), data)
    conn.close()
    for key, (status, head, data) in got.items():
        h = {k.lower(): v for k, v in head}
        assert h["x-content-type-options"] == "nosniff" and h["cache-control"] == "no-store", key
        assert h["content-type"] == "application/json" and int(h["content-length"]) == len(data), key
        assert data.endswith(b"\n") and json.loads(data)["ok"] is (status == 200), key
        assert ("x-medvol-session" in h) is (status != 403), key
    assert [s for s, _, _ in got.values()] == [200, 200, 404, 200, 403]


def test_the_polled_routes_read_headers_as_starlette_does():
    from starlette.datastructures import Headers

    from medvolcore.serve.http_app import _Headers

    raw = [(b"host", b"127.0.0.1:1"), (b"x-medvol-session", b"s\xe9"), (b"x-other", b"1"), (b"x-other", b"2")]
    mine, theirs = _Headers(raw), Headers(raw=raw)
    for name in ("Host", "X-MedVol-Session", "x-medvol-session", "X-Other", "Authorization"):
        assert mine.get(name) == theirs.get(name) and (name in mine) == (name in theirs), name
        assert mine.get(name, "") == theirs.get(name, ""), name
    assert mine["X-Other"] == "1" and mine["x-medvol-session"] == "s\xe9"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_directly(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    worker = Worker(transport="http")
    server = HttpServer(HttpSettings(host="127.0.0.1", port=0, tls_cert=str(cert), tls_key=str(key)), worker, None)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        ctx.check_hostname = False
        conn = http.client.HTTPSConnection("127.0.0.1", server.server_address[1], context=ctx, timeout=30)
        conn.request("GET", "/status")
        resp = conn.getresponse()
        r = json.loads(resp.read())
        conn.close()
        assert resp.status == 200 and r["ok"] is True
        plain = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            plain.request("GET", "/status")
            plain.getresponse().read()
        plain.close()
    finally:
        server.server_close()
        worker.close(5)


def test_serving_over_http_without_its_extra_is_one_line(monkeypatch):
    """uvicorn, httptools and Starlette are the `http` extra (Slicer's Python does not get them): without
    them `medvol serve --http` is one error naming the extra, before anything is bound or loaded."""
    import sys

    from medvolcore.errors import DependencyError
    from medvolcore.serve.http import HttpServer

    for name in ("uvicorn", "starlette", "httptools"):
        with monkeypatch.context() as m:
            m.setitem(sys.modules, name, None)  # an import of it fails, as when it is not installed
            with pytest.raises(DependencyError, match=r"pip install 'medvolcore\[http\]'"):
                HttpServer(None, None, None)
