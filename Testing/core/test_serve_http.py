"""The HTTP worker against the second review's probes (II.4, II.10's HTTP parts) and its server stance.

Most probes talk to an in-process :class:`medvolcore.serve.http.HttpServer` whose worker runs a
stand-in job (no model, no volume read): they are about framing, logs, sessions, replies and
temporary folders, which the HTTP layer decides before any work. The output-folder probes and
the handshake need a real segment job: they share one ``medvol serve --http`` child with the
``tiny`` preset, ``--data-dir`` and ``--out-dir``. Every server listens on loopback only.
``@pytest.mark.probe(item, text)`` ties each test to the finding it replays
(``Testing/benchmarks/abuse.py`` prints them); figures go to ``record_property``.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import statistics
import threading
import time
from pathlib import Path

import pytest

from core.probes import ANCHOR, b64, one_line, run_cli
from core.worker_clients import HttpServer as ServeProcess
from core.worker_clients import StdioClient

from medvolcore import RESEARCH_USE_NOTICE
from medvolcore.errors import CancelledError
from medvolcore.serve.http import HttpServer, HttpSettings
from medvolcore.serve.protocol import RequestError, parse_request
from medvolcore.serve.worker import Worker

SESSION = "X-MedVol-Session"


# ---- an in-process server whose jobs are stand-ins ------------------------------------------------

def read_replies(sock, wait: float) -> tuple:
    """Every final reply (status, JSON body) on ``sock`` until it closes or ``wait`` s pass, interim
    ``100 Continue`` replies skipped; and whether the server closed the connection (a reset after
    the reply, our unread body still queued, counts as closed)."""
    sock.settimeout(wait)
    got, closed = b"", False
    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            got += chunk
    except socket.timeout:
        pass
    except ConnectionResetError:
        closed = True
    out = []
    while got.startswith(b"HTTP/"):
        head, _, rest = got.partition(b"\r\n\r\n")
        status = int(head.split()[1])
        if 100 <= status < 200:
            got = rest
            continue
        n = int([h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")][0])
        out.append((status, json.loads(rest[:n])))
        got = rest[n:]
    return out, closed


class _InProcess:
    """An HTTP worker in this process on 127.0.0.1 (port 0). Its queued jobs do no work: a
    ``segment`` whose query is ``"block"`` waits for :attr:`gate` (honouring cancel), any other
    one answers ``{"echo": id}`` at once."""

    def __init__(self, session_idle_s=None, **worker_kw):
        self.gate = threading.Event()
        self.worker = Worker(transport="http", **worker_kw)
        self.worker._execute = self._execute
        settings = HttpSettings(host="127.0.0.1", port=0, client_timeout=5)
        if session_idle_s is not None:
            settings.session_idle_s = session_idle_s
        self.server = HttpServer(settings, self.worker, None)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def _execute(self, job):
        if job.req.get("query") == "block":
            while not self.gate.wait(0.02):
                if job.cancel.is_set():
                    raise CancelledError(f"request {job.id!r} cancelled")
        return {"echo": job.id}

    def connect(self, source="127.0.0.1") -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30, source_address=(source, 0))

    def raw(self, data: bytes, wait: float = 5.0) -> list:
        """Send ``data`` on a new connection; every (status, JSON body) the server answers until it
        closes the connection (or ``wait`` seconds pass: then the last item is ``"open"``)."""
        s = socket.create_connection(("127.0.0.1", self.port), timeout=wait)
        s.sendall(data)
        try:
            replies, closed = read_replies(s, wait)
        finally:
            s.close()
        return replies + ([] if closed else ["open"])

    def close(self):
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()
        self.worker.close(5)


def rpc(conn, obj, session=None, headers=None, method="POST", path="/rpc"):
    """``(status, reply, session header)`` of one request on a keep-alive connection."""
    h = {"Content-Type": "application/json", **(headers or {})}
    if session:
        h[SESSION] = session
    conn.request(method, path, body=None if obj is None else json.dumps(obj).encode(), headers=h)
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read()), resp.getheader(SESSION)


SMALL_ANCHOR = dict(ANCHOR, slice=4)  # on the 8 slices of ``small_ct``


@pytest.fixture(scope="module")
def data_folder(tmp_path_factory, small_ct):
    """A data folder holding two patients' CTs (8 slices each, so a real job is short)."""
    root = tmp_path_factory.mktemp("http-data")
    (root / "ct.nii.gz").write_bytes(small_ct[0].read_bytes())
    (root / "other.nii.gz").write_bytes(small_ct[0].read_bytes())
    return root


@pytest.fixture(scope="module")
def inproc(data_folder):
    s = _InProcess(data_dir=data_folder)
    yield s
    s.close()


# ---- II.4: outputs go to --out-dir only ------------------------------------------------------------

@pytest.mark.probe("II.4", "HTTP out + overwrite naming another patient's CT in --data-dir, no --out-dir")
def test_http_out_is_forbidden_without_out_dir(inproc, data_folder):
    before = (data_folder / "other.nii.gz").read_bytes()
    conn = inproc.connect()
    for out in ("other.nii.gz", str(data_folder / "other.nii.gz"), "new.nii.gz"):
        st, r, _ = rpc(conn, {"id": "o", "op": "propagate", "volume": "ct.nii.gz", "anchor": SMALL_ANCHOR,
                              "out": out, "overwrite": True})
        assert st == 200 and r["ok"] is False and r["error"]["code"] == "forbidden", (out, r)
        msg = r["error"]["message"]
        assert "reply" in msg and "--out-dir" in msg and str(data_folder) not in msg
    assert (data_folder / "other.nii.gz").read_bytes() == before
    assert not (data_folder / "new.nii.gz").exists()
    st, r, _ = rpc(conn, {"id": "i", "op": "propagate", "volume": "ct.nii.gz", "anchor": SMALL_ANCHOR})
    conn.close()
    assert r["ok"] is True  # reading from the data folder still works


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, data_folder):
    out = tmp_path_factory.mktemp("http-out")
    s = ServeProcess("--device", "cpu", "--preset", "tiny", "--data-dir", str(data_folder), "--out-dir", str(out),
                     "--max-voxels", "5000000", "--max-request-mb", "16")
    yield s, out
    s.stop()


@pytest.mark.probe("II.4", "--out-dir: a mask inside; ../data, absolute, symlinked file and folder refused")
def test_out_dir_holds_the_outputs_and_follows_no_link(tiny_server, data_folder):
    server, out_dir = tiny_server
    before = {p.name: p.read_bytes() for p in data_folder.iterdir()}
    (out_dir / "masks").mkdir()
    (out_dir / "link.nii.gz").symlink_to(data_folder / "other.nii.gz")
    (out_dir / "linkdir").symlink_to(data_folder)
    st, r = server.request("POST", "/rpc", {"id": 1, "op": "propagate", "volume": "ct.nii.gz", "anchor": SMALL_ANCHOR,
                                            "out": "masks/m.nii.gz"})
    assert r["ok"] is True, r
    assert r["result"]["mask_path"] == os.path.join("masks", "m.nii.gz")  # relative to --out-dir
    assert (out_dir / "masks" / "m.nii.gz").is_file() and r["result"]["mask_b64"]
    for out in ("../" + data_folder.name + "/other.nii.gz", str(data_folder / "other.nii.gz"), "link.nii.gz",
                "linkdir/other.nii.gz", "linkdir/new.nii.gz", "/etc/x.nii.gz"):
        st, r = server.request("POST", "/rpc", {"id": 2, "op": "propagate", "anchor": SMALL_ANCHOR, "out": out,
                                                "overwrite": True, "volume_b64": b64(data_folder / "ct.nii.gz")})
        assert r["ok"] is False and r["error"]["code"] == "forbidden", (out, r)
        assert str(data_folder) not in r["error"]["message"] and str(out_dir) not in r["error"]["message"]
    assert {p.name: p.read_bytes() for p in data_folder.iterdir()} == before
    assert (out_dir / "link.nii.gz").is_symlink()


@pytest.mark.probe("II.4", "--out-dir inside, equal to or holding --data-dir: refused at start")
@pytest.mark.parametrize("layout", ["inside", "same", "holds"])
def test_out_dir_overlapping_data_dir_is_refused_at_start(tmp_path, capsys, layout):
    data = tmp_path / "data"
    (data / "masks").mkdir(parents=True)
    data_dir, out_dir = {"inside": (data, data / "masks"), "same": (data, data),
                         "holds": (data / "masks", data)}[layout]
    # --host 0.0.0.0 without a token would stop it right after: it never serves, whatever happens
    code, out, err = run_cli(capsys, "serve", "--http", "--host", "0.0.0.0", "--port", "0",
                             "--data-dir", data_dir, "--out-dir", out_dir)
    one_line(code, err, "--out-dir", "--data-dir", "the data folder")


# ---- II.10: framing ----------------------------------------------------------------------------------

_HEAD = b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
_STATUS = b'{"id":"s","op":"status"}'
_SMUGGLED = b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

FRAMING = {
    "Transfer-Encoding and Content-Length": b"POST /rpc HTTP/1.1\r\n" + _HEAD + b"Transfer-Encoding: chunked\r\n"
                                            + b"Content-Length: 24\r\n\r\n" + _STATUS,
    "Transfer-Encoding alone": b"POST /rpc HTTP/1.1\r\n" + _HEAD + b"Transfer-Encoding: chunked\r\n\r\n18\r\n"
                               + _STATUS + b"\r\n0\r\n\r\n",
    "two equal Content-Length": b"POST /rpc HTTP/1.1\r\n" + _HEAD + b"Content-Length: 24\r\nContent-Length: 24\r\n\r\n"
                                + _STATUS,
    "two different Content-Length": b"POST /rpc HTTP/1.1\r\n" + _HEAD + b"Content-Length: 24\r\n"
                                    + b"Content-Length: 0\r\n\r\n" + _STATUS,
    "Content-Length of superscript digits": b"POST /rpc HTTP/1.1\r\n" + _HEAD + b"Content-Length: \xb2\xb3\r\n\r\n"
                                            + _STATUS,
    "GET with a body": b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: " + str(len(_SMUGGLED)).encode()
                       + b"\r\n\r\n" + _SMUGGLED,
}


@pytest.mark.probe("II.10", "Transfer-Encoding, repeated/conflicting/Unicode Content-Length, body on GET")
def test_ambiguous_framing_is_refused_and_the_connection_closed(inproc):
    for name, data in FRAMING.items():
        replies = inproc.raw(data)
        assert len(replies) == 1 and replies[-1] != "open", (name, replies)  # one reply, then closed
        status, body = replies[0]
        assert 400 <= status < 500 and body["ok"] is False and body["error"]["code"] == "bad_request", (name, replies)
    # well-framed requests on one connection still work
    replies = inproc.raw(b"POST /rpc HTTP/1.1\r\n" + _HEAD + b"Content-Length: 24\r\n\r\n" + _STATUS
                         + b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n", wait=0.3)
    assert [s for s, _ in replies[:2]] == [200, 200] and replies[-1] == "open"


# ---- II.10: the refusal log --------------------------------------------------------------------------

class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.probe("II.10", "refusal log: ?token= query and ANSI escapes in the path")
def test_refusal_log_carries_no_query_and_no_control_characters(inproc):
    rec = _Records()
    logger = logging.getLogger("medvolcore.serve")
    logger.addHandler(rec)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        conn = inproc.connect()
        st, r, _ = rpc(conn, {"id": "x", "op": "status"}, path="/rpc?token=SECRET-TOKEN-123",
                       headers={"Origin": "http://evil.example"})
        conn.close()
        assert st == 403
        inproc.raw(b"GET /\x1b[2J\x1b[31mowned\x07?token=SECRET-TOKEN-456 HTTP/1.1\r\nHost: evil.example\r\n\r\n")
    finally:
        logger.removeHandler(rec)
        logger.setLevel(old_level)
    refused = [line for line in rec.lines if "refused" in line]
    assert len(refused) == 2, rec.lines
    text = "\n".join(rec.lines)
    assert "SECRET-TOKEN" not in text
    assert not any(ch in text for ch in "\x1b\x07"), text
    assert "/rpc?…" in refused[0] and "\\x1b[2J" in refused[1]


# ---- II.10: sessions per client ----------------------------------------------------------------------

@pytest.mark.probe("II.10", "4,100 session-less requests from another client address")
def test_a_client_cannot_evict_another_clients_session(inproc, record_property):
    alice = inproc.connect("127.0.0.1")
    _, r, sid = rpc(alice, {"id": "h", "op": "hello"})
    assert r["result"]["session"] == sid
    mallory = inproc.connect("127.0.0.2")  # loopback too, another address
    t = time.perf_counter()
    for i in range(4100):
        rpc(mallory, {"id": i, "op": "status"})
    record_property("4,100 session-less requests in s", round(time.perf_counter() - t, 2))
    record_property("sessions held", len(inproc.server.sessions))
    alice.close()  # (a new connection: the server drops one idle longer than --client-timeout)
    alice = inproc.connect("127.0.0.1")
    _, r, again = rpc(alice, {"id": "h2", "op": "hello"}, session=sid)
    alice.close()
    mallory.close()
    assert again == sid and r["result"]["session"] == sid
    assert len(inproc.server.sessions) <= 100


@pytest.mark.probe("II.10", "an idle session's queued request is cancelled; its running one finishes")
def test_idle_sessions_are_reaped(record_property):
    s = _InProcess(session_idle_s=0.8)
    a, b = s.connect(), s.connect()
    try:
        _, _, sa = rpc(a, {"id": "h", "op": "hello"})
        _, _, sb = rpc(b, {"id": "h", "op": "hello"})
        got = {}

        def call(name, conn, req, sid):
            got[name] = rpc(conn, req, session=sid)

        ta = threading.Thread(target=call, args=("a", a, {"id": "run", "op": "segment", "volume_b64": "AA==",
                                                          "query": "block"}, sa))
        ta.start()
        deadline = time.monotonic() + 10
        while not s.worker.status()["busy"] and time.monotonic() < deadline:
            time.sleep(0.02)
        tb = threading.Thread(target=call, args=("b", b, {"id": "wait", "op": "segment", "volume_b64": "AA==",
                                                          "query": "q"}, sb))
        t0 = time.perf_counter()
        tb.start()
        tb.join(8)  # the reaper answers it once b's session has been idle 0.8 s
        record_property("queued request of an idle session cancelled after s", round(time.perf_counter() - t0, 2))
        s.gate.set()
        ta.join(10)
        assert "b" in got, "the idle session's queued request was never cancelled"
        assert got["b"][1]["error"]["code"] == "cancelled" and "idle" in got["b"][1]["error"]["message"]
        assert got["a"][1]["ok"] is True and got["a"][1]["result"] == {"echo": "run"}  # the running one finished
        _, r, fresh = rpc(b, {"id": "h", "op": "hello"}, session=sb)
        assert fresh != sb  # forgotten: a new session is issued
    finally:
        for c in (a, b):
            c.close()
        s.close()


# ---- II.10: one write per reply ---------------------------------------------------------------------

def _keep_alive_ms(s, n=15) -> float:
    conn = s.connect()
    rpc(conn, None, method="GET", path="/status")
    times = []
    for _ in range(n):
        t = time.perf_counter()
        rpc(conn, None, method="GET", path="/status")
        times.append(time.perf_counter() - t)
    conn.close()
    return statistics.median(times) * 1000


@pytest.mark.probe("II.10", "keep-alive reply time (headers and body in one write)")
def test_keep_alive_replies_are_not_delayed(inproc, record_property):
    after = _keep_alive_ms(inproc)
    record_property("keep-alive reply ms", round(after, 2))
    assert after < 10, f"{after:.1f} ms a reply on a kept-alive connection"


# ---- II.10: duplicate keys ---------------------------------------------------------------------------

@pytest.mark.probe("II.10", "a request naming a key twice (op, and inside the anchor)")
def test_duplicate_json_keys_are_refused(inproc):
    conn = inproc.connect()
    conn.request("POST", "/rpc", body=b'{"id":"d","op":"hello","op":"status"}',
                 headers={"Content-Type": "application/json"})
    r = json.loads(conn.getresponse().read())
    conn.close()
    assert r["ok"] is False and r["error"]["code"] == "bad_request" and '"op"' in r["error"]["message"]
    with pytest.raises(RequestError, match='"slice" twice') as e:
        parse_request(b'{"op":"propagate","anchor":{"slice":1,"boxes":[],"slice":2}}')
    assert e.value.code == "bad_request"


# ---- II.10: temporary folders of killed workers -------------------------------------------------------

@pytest.mark.probe("II.10", "kill -9 leaves medvol-serve-*: removed at the next start, a live worker's kept")
def test_stale_temp_folder_of_a_killed_worker_is_removed(inproc):
    c = StdioClient("--device", "cpu")
    try:
        killed = Path(c.call({"id": "s", "op": "status"}, timeout=60)["result"]["tmp_dir"])
        c.proc.send_signal(signal.SIGKILL)
        c.proc.wait(30)
    finally:
        c.close()
    assert killed.is_dir()  # SIGKILL: nothing could clean up
    live = inproc.worker.tmp_dir  # a live worker of this process
    stranger = live.parent / "medvol-serve-notes"  # not a worker's folder
    stranger.mkdir()
    w = Worker(transport="http")
    try:
        assert not killed.exists()
        assert live.is_dir() and stranger.is_dir() and w.tmp_dir.is_dir()
    finally:
        w.close(5)
        stranger.rmdir()


# ---- the capability / licence handshake -----------------------------------------------------------------

def test_hello_names_models_licences_and_limits_without_server_paths(tiny_server, data_folder):
    server, out_dir = tiny_server
    st, r = server.request("GET", "/hello")
    h = r["result"]
    assert h["protocol"] == 1 and h["transport"] == "http" and "segment" in h["ops"] and h["session"]
    m = h["models"]
    assert m["preset"] == "tiny" and m["smoke"] is True and m["adapter"] is None
    assert m["grounder"]["licence"] == "none" and m["medsam2"]["licence"] == "none"
    assert h["limits"]["max_voxels"] == 5_000_000 and h["limits"]["max_request_mb"] == 16
    assert h["limits"]["max_boxes"] == 8
    assert h["server_paths"] == {"volume": True, "out": True} and h["session_idle_s"] == 3600
    text = json.dumps(h)
    assert str(data_folder) not in text and str(out_dir) not in text and "/tmp" not in text


def test_hello_of_a_hub_preset_names_repos_and_licences(tmp_path):
    w = Worker(transport="http", default_preset="medvol-r1", default_adapter=str(tmp_path / "runs" / "my-adapter"))
    try:
        h = w.hello("sid", "http")
    finally:
        w.close(5)
    m = h["models"]
    assert m["preset"] == "medvol-r1" and m["loaded"] is False and m["adapter"] == "my-adapter"
    assert m["grounder"]["repo_id"] == "Qwen/Qwen3-VL-4B-Instruct" and m["grounder"]["licence"] == "apache-2.0"
    assert m["medsam2"]["repo_id"] == "wanglab/MedSAM2" and m["medsam2"]["licence"] == "cc-by-sa-4.0"
    # an adapter without medvol-train's record is not called MedVol-R1, and the notice is there
    assert h["model_label"] == m["identity"]["label"] == (
        "Qwen3-VL-4B-Instruct + LoRA adapter my-adapter (not made by medvol-train: not known to be trained for "
        "this task)")
    assert not m["identity"]["trained_for_task"] and h["research_use"] == RESEARCH_USE_NOTICE
    assert str(tmp_path) not in json.dumps(h)


def test_every_hub_model_of_the_manifest_names_its_licence():
    from medvolcore import models

    for p in models.list_presets():
        for part in (p.grounder, p.medsam2):
            assert isinstance(part.get("licence"), str) and part["licence"], (p.name, part)
            if part.get("repo_id"):
                assert part.get("licence_source", "").startswith("https://huggingface.co/" + part["repo_id"])


# ---- issue 26 item 6: the mask as bytes (the volume bodies: test_serve_upload.py) ------------------


def _volume_rpc(port, body, req, headers=None, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/rpc", body=body, headers={"Content-Type": "application/octet-stream",
                                                     "X-MedVol-Request": json.dumps(req), **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp, data


@pytest.mark.probe("26.6", "Accept: application/gzip: the mask as the reply body, the reply in X-MedVol-Reply")
def test_mask_comes_back_as_gzip_bytes_when_asked(tiny_server, data_folder):
    import gzip as _gzip

    import nibabel as nib
    import numpy as np

    server, _ = tiny_server
    ct = (data_folder / "ct.nii.gz").read_bytes()
    req = {"id": "bin", "op": "propagate", "anchor": SMALL_ANCHOR}
    resp, data = _volume_rpc(server.port, ct, req, headers={"Accept": "application/gzip"}, timeout=120)
    assert resp.status == 200 and resp.getheader("Content-Type") == "application/gzip"
    r = json.loads(resp.getheader("X-MedVol-Reply"))
    assert r["ok"] is True and r["id"] == "bin" and "mask_b64" not in r["result"] and "_mask_bytes" not in r["result"]
    assert resp.getheader(SESSION)
    mask = nib.Nifti1Image.from_bytes(_gzip.decompress(data))
    assert mask.shape == nib.Nifti1Image.from_bytes(_gzip.decompress(ct)).shape
    voxels = int(np.count_nonzero(np.asanyarray(mask.dataobj)))
    assert voxels == r["result"]["mask_voxels"] > 0
    # without Accept, the JSON form old clients read: the same mask in base64
    resp, data = _volume_rpc(server.port, ct, req, timeout=120)
    j = json.loads(data)
    assert resp.getheader("Content-Type") == "application/json" and j["ok"] is True
    old = nib.Nifti1Image.from_bytes(_gzip.decompress(__import__("base64").b64decode(j["result"]["mask_b64"])))
    assert np.array_equal(np.asanyarray(old.dataobj), np.asanyarray(mask.dataobj))


def test_a_refused_volume_body_keeps_the_request_id(tiny_server):
    """A volume body refused before the worker reads the request (not NIfTI here) answers with the
    request's own id, taken from its header, so the client can tell which request failed."""
    server, _ = tiny_server
    resp, data = _volume_rpc(server.port, b"this is not a NIfTI file at all" * 20,
                             {"id": "case-7", "op": "propagate", "anchor": SMALL_ANCHOR})
    j = json.loads(data)
    assert resp.status == 400 and j["ok"] is False and j["id"] == "case-7"


@pytest.mark.probe("43.5", "64+ session-less GET /hello from one address (a proxy) while a client holds its session")
def test_session_less_requests_from_one_address_never_push_out_a_used_session(inproc, record_property):
    before = len(inproc.server.sessions)
    alice = inproc.connect()
    _, r, sid = rpc(alice, {"id": "h", "op": "hello"})
    _, r, again = rpc(alice, {"id": "h1", "op": "status"}, session=sid)  # alice uses her session
    assert again == sid
    mallory = inproc.connect()  # the same address: behind one proxy
    for _ in range(200):
        mallory.request("GET", "/hello")
        resp = mallory.getresponse()
        resp.read()
        assert resp.status == 200
    _, r, again = rpc(alice, {"id": "h2", "op": "hello"}, session=sid)
    alice.close()
    mallory.close()
    assert again == sid and r["result"]["session"] == sid
    record_property("sessions held", len(inproc.server.sessions))
    assert len(inproc.server.sessions) <= before + 64 + 1  # 64 new ones at most for the address, and alice's


def test_a_session_with_a_request_in_flight_is_never_pushed_out():
    from medvolcore.serve.http import SessionsFull, SessionTable

    busy = set()
    table = SessionTable(per_client=2, total=100, busy=busy.__contains__)
    a = table.session(None, "c")
    busy.add(a)  # a request of a's runs; a was never sent back (a fresh session)
    b = table.session(None, "c")
    busy.add(b)
    with pytest.raises(SessionsFull):
        table.session(None, "c")  # both fresh ones are busy: no third, and neither is pushed out
    assert table.session(a, "c") == a and table.session(b, "c") == b  # now known: the fresh pool is free
    for _ in range(10):
        table.session(None, "c")
    for k in range(3):  # known sessions: at most 2 per address, and never a busy one
        table.session(table.session(None, "c"), "c")
    assert table.session(a, "c") == a and table.session(b, "c") == b
    busy.clear()
    c = table.session(table.session(None, "c"), "c")
    assert table.session(c, "c") == c and len(table) <= 2 + 2
