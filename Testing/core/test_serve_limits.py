"""Every limit of the serving path (:mod:`medvolcore.serve.limits`) at its bound and one past it,
and the one declaration they come from: ``docs/security.md``'s table is generated from it, and
every test a limit names exists.

An in-process HTTP worker on 127.0.0.1 whose jobs are stand-ins (``test_serve_http._InProcess``)
takes the requests; raw sockets send what an HTTP client library would not.
"""

from __future__ import annotations

import ast
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from core.test_serve_http import _InProcess, read_replies, rpc
from medvolcore.serve import limits as L
from medvolcore.serve.http import HttpServer, HttpSettings
from medvolcore.serve.protocol import RequestError, check_json_cost, parse_request
from medvolcore.serve.sessions import SessionTable
from medvolcore.serve.worker import Worker

REPO = Path(__file__).resolve().parents[2]
MB = 1 << 20


@pytest.fixture(scope="module")
def srv():
    s = _InProcess(max_request_bytes=1 * MB)
    yield s
    s.close()


def _head(path: str = "/hello", headers=(), host: str = "127.0.0.1") -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", "Connection: close", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _status(srv, data: bytes, wait: float = 10.0):
    replies = srv.raw(data, wait)
    assert replies and replies[0] != "open", replies
    return replies[0][0], replies[0][1]


# ---- the declaration ---------------------------------------------------------------------------

def test_security_md_holds_the_generated_table():
    text = (REPO / "docs" / "security.md").read_text(encoding="utf-8")
    assert L.TABLE_BEGIN in text and L.TABLE_END in text
    assert L.with_table(text) == text, ("docs/security.md's limits table differs from medvolcore.serve.limits: run "
                                        "`python -m medvolcore.serve.limits --write docs/security.md`")


def test_every_limit_names_tests_that_exist():
    for lim in L.LIMITS:
        assert lim.tests, lim.name
        for ref in lim.tests:
            path, _, name = ref.partition("::")
            tree = ast.parse((REPO / "Testing" / path).read_text(encoding="utf-8"))
            names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            assert name in names, f"{lim.name}: {ref} does not exist"


def test_the_serving_code_takes_its_values_from_the_declaration():
    from medvolcore.serve import http, http_conn, protocol, sessions
    from medvolcore.serve.cache import DEFAULT_MAX_VOXELS
    from medvolcore.serve.upload import upload_ceiling

    assert http_conn.MAX_HEADER_BYTES == L.limit("header_bytes").default == 4 * 64 * 1024  # nginx's 4 × 64k
    assert http.DEFAULT_MAX_CONNECTIONS == L.limit("connections").default
    assert sessions.MAX_SESSIONS_PER_CLIENT == L.limit("sessions_per_client").default
    assert protocol.DEFAULT_MAX_REQUEST_MB << 20 == L.limit("json_body").default
    assert upload_ceiling(DEFAULT_MAX_VOXELS) == L.limit("volume_body").default
    from medvolcore.pacs import Limits

    assert Limits().max_instance_bytes == L.limit("pacs_instance").default


# ---- the request line and headers: 414/431 before the token ------------------------------------

def test_request_line_at_and_past_the_bound(srv):
    n = L.limit("request_line").default
    path = "/hello?" + "a" * (n - len("/hello?"))
    assert _status(srv, _head(path))[0] == 200
    st, r = _status(srv, _head(path + "a"))
    assert st == 414 and r["error"]["code"] == "too_large"


def test_one_header_line_at_and_past_the_bound(srv):
    n = L.limit("header_line").default
    assert _status(srv, _head(headers=["X-Pad: " + "v" * (n - len("X-Pad"))]))[0] == 200
    st, r = _status(srv, _head(headers=["X-Pad: " + "v" * (n - len("X-Pad") + 1)]))
    assert st == 431 and r["error"]["code"] == "too_large"


def test_header_count_at_and_past_the_bound(srv):
    n = L.limit("header_count").default
    assert _status(srv, _head(headers=[f"X-P{i}: 1" for i in range(n - 2)]))[0] == 200  # + Host, Connection
    st, r = _status(srv, _head(headers=[f"X-P{i}: 1" for i in range(n - 1)]))
    assert st == 431 and r["error"]["code"] == "too_large"


def _head_of_size(total: int) -> bytes:
    """A GET /hello whose request line and headers are exactly ``total`` bytes."""
    base = len(_head(headers=["X-A: "]))
    parts, left = [], total - base
    while left > 60_000 + 10:
        parts.append("X-B: " + "b" * 60_000)
        left -= 60_000 + len("X-B: ") + 2
    parts.insert(0, "X-A: " + "a" * left)
    data = _head(headers=parts)
    assert len(data) == total
    return data


def test_header_bytes_at_and_past_the_bound(srv):
    n = L.limit("header_bytes").default
    assert _status(srv, _head_of_size(n))[0] == 200
    st, r = _status(srv, _head_of_size(n + 1))
    assert st == 431 and r["error"]["code"] == "too_large"


@pytest.mark.probe("55.1", "a never-ending header value (8 MB) without a token")
def test_a_never_ending_header_costs_no_memory(record_property):
    """431 before the token is read, and the server holds at most the bound of what was sent."""
    import resource  # noqa: F401 - Linux: VmHWM below
    from core.probes import proc_status

    worker = Worker(transport="http")
    token_file = Path(__import__("tempfile").mkdtemp()) / "token"
    token_file.write_text("t" * 32)
    server = HttpServer(HttpSettings(host="127.0.0.1", port=0, client_timeout=5, token_file=str(token_file)),
                        worker, "t" * 32)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        import os
        before = proc_status(os.getpid(), "VmRSS")
        s = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10)
        s.sendall(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: ")
        sent = 0
        try:
            chunk = b"x" * 65536
            while sent < 8 * MB:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the server answered and closed
            pass
        replies, closed = read_replies(s, 10)
        s.close()
        grown = proc_status(os.getpid(), "VmRSS") - before
        record_property("bytes sent", sent)
        record_property("memory grown (MB)", round(grown, 1))
        assert closed and replies and replies[0][0] == 431, replies  # not 401: the token was never read
        assert grown < 16  # the 8 MB sent are never kept (at most the 256 kB bound)
    finally:
        server.shutdown()
        server.server_close()
        worker.close(5)


def test_headers_within_and_past_the_client_timeout():
    worker = Worker(transport="http")
    server = HttpServer(HttpSettings(host="127.0.0.1", port=0, client_timeout=1.0), worker, None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /hello HTTP/1.1\r\n")
        time.sleep(0.5)
        s.sendall(b"Host: 127.0.0.1\r\n\r\n")
        replies, _ = read_replies(s, 1.0)
        s.close()
        assert replies and replies[0][0] == 200
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /hello HTTP/1.1\r\n")
        t = time.monotonic()
        replies, closed = read_replies(s, 5)
        s.close()
        assert closed and not replies and time.monotonic() - t < 3
    finally:
        server.shutdown()
        server.server_close()
        worker.close(5)


# ---- JSON: size, keys, values, depth -----------------------------------------------------------

def _post(srv, body: bytes):
    head = (f"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return _status(srv, head + body, wait=20)


def test_json_body_at_and_past_the_bound(srv):
    n = srv.worker.max_request_bytes
    st, r = _post(srv, b" " * (n - 2) + b"{}")
    assert st == 200 and r.get("error", {}).get("code") != "too_large", r
    st, r = _post(srv, b" " * (n - 1) + b"{}")
    assert st == 413 and r["error"]["code"] == "too_large"


def _keys_body(keys: int) -> bytes:
    # {"id":1,"op":"hello","x":{"k0":0,...}}: 2 braces and 3 colons, then one colon a key
    inner = ",".join(f'"k{i}":0' for i in range(keys - 5))
    return ('{"id":1,"op":"hello","x":{' + inner + "}}").encode()


def _values_body(values: int) -> bytes:
    # {"id":1,"op":"hello","x":[0,...]}: 1 brace, 3 colons, 2 commas, 1 bracket, then a comma a value
    return ('{"id":1,"op":"hello","x":[' + ",".join("0" * (values - 6)) + "]}").encode()


@pytest.mark.probe("55.10", "JSON of more keys than the bound: refused as it arrives, before it is parsed")
def test_json_keys_at_and_past_the_bound(srv):
    n = L.limit("json_keys").default
    assert check_json_cost(_keys_body(n))[0] == n
    st, r = _post(srv, _keys_body(n))
    assert st == 200 and r.get("error", {}).get("code") != "too_large", r
    st, r = _post(srv, _keys_body(n + 1))
    assert st == 413 and r["error"]["code"] == "too_large" and "keys" in r["error"]["message"]
    with pytest.raises(RequestError, match="keys"):  # stdio and the front read it the same way
        parse_request(_keys_body(n + 1))


def test_json_values_at_and_past_the_bound(srv):
    n = L.limit("json_values").default
    assert check_json_cost(_values_body(n))[1] == n
    st, r = _post(srv, _values_body(n))
    assert st == 200 and r.get("error", {}).get("code") != "too_large", r
    st, r = _post(srv, _values_body(n + 1))
    assert st == 413 and r["error"]["code"] == "too_large" and "values" in r["error"]["message"]


def test_json_depth_at_and_past_the_bound(srv):
    n = L.limit("json_depth").default

    def body(depth):  # the request object is the first level
        return ('{"id":1,"op":"hello","x":' + "[" * (depth - 1) + "]" * (depth - 1) + "}").encode()

    st, r = _post(srv, body(n))
    assert st == 200 and "levels" not in r.get("error", {}).get("message", ""), r
    st, r = _post(srv, body(n + 1))
    assert st == 200 and r["error"]["code"] == "bad_request" and f"{n} levels" in r["error"]["message"]


# ---- volume bodies, refused bodies, connections, sessions, paths, disk ---------------------------

def test_volume_body_at_and_past_the_ceiling():
    from medvolcore.serve.upload import upload_ceiling

    s = _InProcess(max_voxels=1000)
    try:
        ceiling = upload_ceiling(1000)
        head = ("POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                "X-MedVol-Request: {\"id\":1,\"op\":\"propagate\"}\r\nContent-Length: %d\r\n\r\n")
        st, r = _status(s, (head % (ceiling + 1)).encode(), wait=5)
        assert st == 413 and r["error"]["code"] == "too_large" and "allows" in r["error"]["message"]
        assert s.raw((head % ceiling).encode(), wait=1.5) == ["open"]  # accepted: it waits for the body
    finally:
        s.close()


@pytest.mark.probe("55.2", "a refused body sent slowly does not keep its connection slot")
def test_a_refused_body_does_not_keep_its_slot(record_property):
    """At the default --client-timeout (20 s): a JSON body over the limit, dripped, is read on for
    a few seconds at most; one past the drain cap is not read on at all."""
    worker = Worker(transport="http", max_request_bytes=64 << 10)
    server = HttpServer(HttpSettings(host="127.0.0.1", port=0), worker, None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cap = L.limit("refused_body_drain").default
    try:
        from medvolcore.serve.http_conn import DRAIN_MAX_S

        for n, most in ((cap, DRAIN_MAX_S + 1.5), (cap + 1, 1.5)):
            s = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30)
            s.sendall((f"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {n}\r\n\r\n").encode())
            t = time.monotonic()
            closed, got = False, b""
            s.settimeout(0.05)
            while time.monotonic() - t < 30:
                try:
                    s.sendall(b" " * 1024)  # 20 kB/s: far below the minimum rate
                except OSError:
                    closed = True
                    break
                try:
                    chunk = s.recv(65536)
                    if chunk == b"" and got:
                        closed = True
                        break
                    got += chunk
                except socket.timeout:
                    pass
                except OSError:
                    closed = True
                    break
            held = time.monotonic() - t
            s.close()
            record_property(f"held s ({n} bytes refused)", round(held, 2))
            assert got.startswith(b"HTTP/1.1 413") and closed, got[:80]
            assert held < most, (n, held)
    finally:
        server.shutdown()
        server.server_close()
        worker.close(5)


def test_connections_at_and_past_the_bound():
    worker = Worker(transport="http")
    server = HttpServer(HttpSettings(host="127.0.0.1", port=0, max_connections=3, client_timeout=5), worker, None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    socks = []
    try:
        for _ in range(2):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.3)
        third = socket.create_connection(("127.0.0.1", port), timeout=5)
        third.sendall(b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # kept alive: still the third
        replies, _ = read_replies(third, 1)
        assert replies[0][0] == 200
        fourth = socket.create_connection(("127.0.0.1", port), timeout=5)
        replies, closed = read_replies(fourth, 2)
        assert closed and replies[0][0] == 503 and replies[0][1]["error"]["code"] == "busy"
        third.close()
        fourth.close()
    finally:
        for s in socks:
            s.close()
        server.shutdown()
        server.server_close()
        worker.close(5)


def test_sessions_per_client_at_and_past_the_bound():
    n = L.limit("sessions_per_client").default
    table = SessionTable(busy=lambda sid: True)  # every session has a request in flight
    for _ in range(n):
        table.session(None, "10.0.0.1")
    from medvolcore.serve.sessions import SessionsFull

    with pytest.raises(SessionsFull):
        table.session(None, "10.0.0.1")
    table.session(None, "10.0.0.2")  # another client is not affected


def test_session_table_total_at_and_past_the_bound():
    table = SessionTable(per_client=4, total=8)
    first = [table.session(None, f"10.0.0.{i}") for i in range(8)]
    assert len(table) == 8
    table.session(None, "10.0.0.99")
    assert len(table) == 8 and table.session(first[0], "10.0.0.0") != first[0]  # the oldest went


@pytest.mark.probe("55.8", "a 10,000-character --data-dir path, and a 256-byte name")
def test_path_chars_at_and_past_the_bound(tmp_path):
    (tmp_path / "d").mkdir()
    s = _InProcess(data_dir=tmp_path / "d")
    try:
        conn = s.connect()
        n = L.limit("path_chars").default
        for chars in (n, n + 1, 10_000):
            _, r, _ = rpc(conn, {"id": 1, "op": "segment", "volume": "a/" * (chars // 2) + "b" * (chars % 2),
                                 "query": "liver"})
            if chars > n:
                assert r["error"]["code"] == "bad_volume" and "characters" in r["error"]["message"], (chars, r)
            else:  # checked and queued (this server's jobs are stand-ins)
                assert r["ok"] is True, r
        _, r, _ = rpc(conn, {"id": 2, "op": "segment", "volume": "b" * 256, "query": "liver"})  # one name too long
        assert r["error"]["code"] == "bad_volume", r
        conn.close()
    finally:
        s.close()


def test_an_upload_leaving_too_little_disk_is_refused(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from medvolcore.errors import LimitError
    from medvolcore.serve import upload

    margin = L.limit("tmp_free").default
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, margin + 1000))
    upload.check_space(tmp_path, 1000)
    with pytest.raises(LimitError):
        upload.check_space(tmp_path, 1001)


@pytest.mark.probe("55.9", "SIGTERM to medvol serve --http")
def test_sigterm_exits_143_after_a_clean_stop():
    import signal

    from core.worker_clients import HttpServer as ServeProcess

    s = ServeProcess("--device", "cpu")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 143
    time.sleep(0.2)
    assert "stopped (SIGTERM)" in "".join(s.stderr)


def test_a_client_cannot_pass_for_another_with_the_fronts_header(srv):
    """X-MedVol-Client is the front's: a worker not started by a front ignores it, so a client
    naming another's address in it pushes out only its own sessions."""
    n = L.limit("sessions_per_client").default
    bob = srv.connect("127.0.0.2")
    _, _, sid = rpc(bob, {"id": "b", "op": "hello"})
    assert rpc(bob, {"id": "b", "op": "hello"}, session=sid)[2] == sid  # known
    bob.close()
    mallory = srv.connect("127.0.0.1")
    for i in range(n + 2):
        _, _, own = rpc(mallory, {"id": i, "op": "hello"}, headers={"X-MedVol-Client": "127.0.0.2"})
        rpc(mallory, {"id": i, "op": "hello"}, session=own, headers={"X-MedVol-Client": "127.0.0.2"})
    mallory.close()
    bob = srv.connect("127.0.0.2")
    assert rpc(bob, {"id": "b", "op": "hello"}, session=sid)[2] == sid
    bob.close()
