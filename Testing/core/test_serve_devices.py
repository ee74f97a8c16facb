"""``medvol serve --http --devices``: one address in front of one worker per device.

Against a real front with two CPU workers running the ``tiny`` preset: a volume keeps its worker
(a correction round encodes no slice, with or without the client's ``X-MedVol-Volume``), a killed
worker's volume is answered by the other with the same mask (and is started again), a worker
killed in the middle of a request has that request answered by the other, the front's own checks
hold before any worker is asked, and stopping the front stops its workers.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time

import nibabel as nib
import numpy as np
import pytest

from core.test_serve_http import SMALL_ANCHOR
from core.worker_clients import SERVE, HttpServer

psutil = pytest.importorskip("psutil")


SESSION = {}  # the session of this module's client: a worker's cache is its client's own


def _post_volume(port, body: bytes, req: dict, headers=None, timeout=180):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/octet-stream", "X-MedVol-Request": json.dumps(req), **(headers or {})}
    if SESSION.get(port):
        h["X-MedVol-Session"] = SESSION[port]
    conn.request("POST", "/rpc", body=body, headers=h)
    resp = conn.getresponse()
    data = json.loads(resp.read())
    if resp.getheader("X-MedVol-Session"):
        SESSION[port] = resp.getheader("X-MedVol-Session")
    conn.close()
    return resp.status, data


def _mask(reply) -> np.ndarray:
    img = nib.Nifti1Image.from_bytes(gzip.decompress(base64.b64decode(reply["result"]["mask_b64"])))
    return np.asanyarray(img.dataobj)


def _workers(front) -> list:
    st, r = front.request("GET", "/status", session=False)
    assert st == 200 and r["ok"], r
    return r["result"]["workers"]


def _children(front) -> list:
    """The worker processes, in the order of ``workers`` (the order they were started in)."""
    kids = psutil.Process(front.proc.pid).children()
    return sorted(kids, key=lambda p: p.create_time())


def _wait(cond, timeout=120, step=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return False


@pytest.fixture(scope="module")
def front():
    s = HttpServer("--devices", "cpu,cpu", "--preset", "tiny", "--max-voxels", "5000000", "--threads", "1")
    yield s
    s.stop()


def _propagate(front, ct: bytes, rid: str, anchor=None, key: bool = True):
    headers = {"X-MedVol-Volume": hashlib.sha256(ct).hexdigest()} if key else {}
    st, r = _post_volume(front.port, ct, {"id": rid, "op": "propagate", "anchor": anchor or SMALL_ANCHOR},
                         headers=headers)
    assert st == 200 and r["ok"] is True, r
    return r


@pytest.mark.slow
def test_a_volume_keeps_its_worker_and_another_answers_when_it_is_gone(front, small_ct):
    ct = small_ct[0].read_bytes()
    assert [w["device"] for w in _workers(front)] == ["cpu", "cpu"]
    st, hello = front.request("GET", "/hello", session=False)
    assert hello["result"]["devices"] == ["cpu", "cpu"]

    first = _propagate(front, ct, "p1")
    assert first["result"]["slices_encoded"] == 8
    moved = dict(SMALL_ANCHOR, boxes=[[35, 35, 95, 85]])
    again = _propagate(front, ct, "p2", moved)  # a correction round: the worker holding the volume
    assert again["result"]["slices_encoded"] == 0
    third = _propagate(front, ct, "p3", key=False)  # without the header: the front hashes the body itself
    assert third["result"]["slices_encoded"] == 0
    assert np.array_equal(_mask(third), _mask(first))

    time.sleep(1.1)  # the front asks its workers for their queues at most once a second
    workers = _workers(front)
    holder = next(i for i, w in enumerate(workers) if w["cached_volumes"])
    assert [w["cached_volumes"] for w in workers].count(0) == 1  # the volume went to one worker only
    _children(front)[holder].kill()
    after = _propagate(front, ct, "p4")  # the other worker reads and encodes it again, and answers alike
    assert after["result"]["slices_encoded"] == 8
    assert np.array_equal(_mask(after), _mask(first))
    assert _wait(lambda: (lambda w: w["restarts"] == 1 and w["up"] and w.get("answering", True))(
        _workers(front)[holder]))
    assert _workers(front)[holder]["last_exit"] == -signal.SIGKILL
    log = "".join(front.stderr)
    assert "exited with code -9; starting it again in 1 s" in log
    assert log.count("ready (protocol 1)") == 1  # the workers' own ready lines are the front's business


@pytest.mark.slow
def test_a_request_whose_worker_dies_while_running_it_is_answered_by_another(front, small_ct):
    img = nib.load(str(small_ct[0]))
    arr = np.asanyarray(img.dataobj)
    long = np.concatenate([arr] * 40, axis=2)  # 320 slices, every one propagated: seconds of work
    other = gzip.compress(nib.Nifti1Image(long, img.affine).to_bytes(), 1)
    import threading

    result = {}
    t = threading.Thread(target=lambda: result.update(r=_post_volume(
        front.port, other, {"id": "dies", "op": "propagate", "anchor": SMALL_ANCHOR, "stop_after_empty": 0})))
    t.start()
    busy = None

    def running():  # exactly one worker busy: the one running it (both loaded their preset long ago;
        # the front asks the workers for their queues at most once a second)
        nonlocal busy
        flags = [bool(w.get("busy")) for w in _workers(front)]
        busy = flags.index(True) if flags.count(True) == 1 else None
        return busy is not None

    if not _wait(running, timeout=60, step=0.1) or not t.is_alive():
        pytest.skip("the request finished before it could be interrupted")
    before = [w["restarts"] for w in _workers(front)]
    _children(front)[busy].kill()
    t.join(180)
    st, r = result["r"]
    assert st == 200 and r["ok"] is True and r["id"] == "dies", r
    assert r["result"]["mask_voxels"] >= 0
    assert _wait(lambda: _workers(front)[busy]["restarts"] == before[busy] + 1)
    assert "failed a request it had received" in "".join(front.stderr)


def test_the_front_refuses_before_any_worker_is_asked(front):
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
    conn.request("POST", "/rpc", body=b'{"id": 1, "op": "status"}',
                 headers={"Content-Type": "application/json", "Origin": "http://evil.example"})
    resp = conn.getresponse()
    r = json.loads(resp.read())
    assert resp.status == 403 and r["error"]["code"] == "forbidden"
    conn.close()
    sock = __import__("socket").create_connection(("127.0.0.1", front.port), timeout=10)
    sock.sendall(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-MedVol-Volume: a\r\nX-MedVol-Volume: b\r\n\r\n")
    head = sock.recv(65536)
    sock.close()
    assert head.startswith(b"HTTP/1.1 400") and b"not several" in head
    st, r = _post_volume(front.port, b"not a NIfTI file" * 40, {"id": "bad", "op": "propagate"})
    assert st == 400 and r["error"]["code"] == "bad_volume" and r["id"] == "bad"
    st, r = front.request("POST", "/rpc", {"id": "b", "op": "propagate", "volume": "/etc/passwd",
                                           "anchor": SMALL_ANCHOR}, session=False)
    assert r["ok"] is False and r["error"]["code"] == "forbidden"  # the workers' own trust boundary
    assert "/etc/passwd" not in "".join(front.stderr)


def test_devices_options_are_checked_before_anything_starts(tmp_path):
    for args, words in ((["--stdio", "--devices", "cpu,cpu"], "--http only"),
                        (["--http", "--devices", "cpu,gpu1"], "'gpu1' is not a device"),
                        (["--http", "--devices", "cpu,,cpu"], "comma-separated"),
                        (["--http", "--device", "cpu", "--devices", "cpu,cpu"], "not both")):
        p = subprocess.run(SERVE + args, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert p.returncode == 2 and len(lines) == 1 and words in lines[0], (args, p.stderr)


def test_stopping_the_front_stops_its_workers():
    s = HttpServer("--devices", "cpu,cpu", "--threads", "1")
    kids = psutil.Process(s.proc.pid).children()
    assert len(kids) == 2
    tmp = [p for p in os.listdir(__import__("tempfile").gettempdir()) if p.startswith(f"medvol-serve-{s.proc.pid}-")]
    assert len(tmp) == 1
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(60)
    gone, alive = psutil.wait_procs(kids, timeout=30)
    assert not alive and s.proc.returncode == 143  # as a shell reports SIGTERM
    assert not os.path.exists(os.path.join(__import__("tempfile").gettempdir(), tmp[0]))
    assert "stopped (SIGTERM)" in "".join(s.stderr)


def test_a_killed_front_takes_its_workers_with_it():
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent's death signal is Linux's")
    s = HttpServer("--devices", "cpu,cpu", "--threads", "1")
    kids = psutil.Process(s.proc.pid).children()
    s.proc.kill()
    s.proc.wait(30)
    gone, alive = psutil.wait_procs(kids, timeout=30)
    assert not alive


def test_shutdown_stops_the_workers_then_the_front():
    s = HttpServer("--devices", "cpu,cpu", "--threads", "1")
    kids = psutil.Process(s.proc.pid).children()
    st, r = s.request("POST", "/rpc", {"id": "bye", "op": "shutdown"}, session=False)
    assert st == 200 and r == {"id": "bye", "ok": True, "result": {"stopping": True}}
    s.proc.wait(60)
    gone, alive = psutil.wait_procs(kids, timeout=30)
    assert not alive and s.proc.returncode == 0


def test_the_front_asks_for_its_token_and_its_workers_answer_only_the_front(tmp_path):
    token = "front-token-" + "x" * 20
    (tmp_path / "token").write_text(token)
    (tmp_path / "token").chmod(0o600)
    s = HttpServer("--devices", "cpu,cpu", "--threads", "1", "--token-file", str(tmp_path / "token"))
    try:
        st, r = s.request("GET", "/hello", session=False)
        assert st == 401 and r["error"]["code"] == "unauthorized"
        st, r = s.request("GET", "/hello", token=token, session=False)
        assert st == 200 and r["result"]["devices"] == ["cpu", "cpu"]
        listening = [c for kid in psutil.Process(s.proc.pid).children()
                     for c in getattr(kid, "net_connections", kid.connections)(kind="tcp")
                     if c.status == psutil.CONN_LISTEN]
        ports = [c.laddr.port for c in listening]
        assert len(ports) == 2 and s.port not in ports
        assert all(c.laddr.ip == "127.0.0.1" for c in listening)  # loopback only
        for port in ports:  # and the client's token is not theirs
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/hello", headers={"Authorization": f"Bearer {token}"})
            resp = conn.getresponse()
            assert resp.status == 401
            conn.close()
    finally:
        s.stop()


@pytest.mark.slow
def test_a_client_that_goes_away_has_its_request_cancelled_on_the_worker(front, small_ct):
    """The front closes its connection to the worker when its client leaves; the worker then
    cancels the request (it does not keep a device busy for nobody)."""
    import socket

    img = nib.load(str(small_ct[0]))
    long = np.concatenate([np.asanyarray(img.dataobj)] * 40, axis=2)
    body = gzip.compress(nib.Nifti1Image(long, img.affine).to_bytes(), 1)
    req = json.dumps({"id": "leaves", "op": "propagate", "anchor": SMALL_ANCHOR, "stop_after_empty": 0})
    sock = socket.create_connection(("127.0.0.1", front.port), timeout=30)
    sock.sendall(f"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                 f"X-MedVol-Request: {req}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    assert _wait(lambda: any(w.get("busy") for w in _workers(front)), timeout=60, step=0.1)
    sock.close()
    assert _wait(lambda: 'id="leaves" -> client disconnected: cancelled' in "".join(front.stderr), timeout=30)
    assert _wait(lambda: not any(w.get("busy") for w in _workers(front)), timeout=30)


def test_the_front_reads_a_request_as_the_worker_does(front):
    """A key named twice is refused by the worker; the front does not take the last ``op`` for
    the one that counts (a ``shutdown`` hidden behind a ``status`` stops nothing)."""
    st, r = front.request("POST", "/rpc", data=b'{"id": "d", "op": "status", "op": "shutdown"}', session=False)
    assert st == 200 and r["ok"] is False and r["error"]["code"] == "bad_request" and "twice" in r["error"]["message"]
    assert front.alive() and all(w["up"] for w in _workers(front))


@pytest.mark.slow
def test_a_data_folder_volume_keeps_its_worker_without_any_header(small_ct, tmp_path):
    """A JSON request naming a ``--data-dir`` file is routed by that name: its correction round
    reaches the worker that read it, though the client sends no volume key."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "ct.nii.gz").write_bytes(small_ct[0].read_bytes())
    s = HttpServer("--devices", "cpu,cpu", "--preset", "tiny", "--threads", "1", "--data-dir", str(data))
    try:
        encoded = []
        for anchor in (SMALL_ANCHOR, dict(SMALL_ANCHOR, boxes=[[35, 35, 95, 85]])):
            st, r = s.request("POST", "/rpc", {"id": "d", "op": "propagate", "volume": "ct.nii.gz", "anchor": anchor})
            assert st == 200 and r["ok"], r
            encoded.append(r["result"]["slices_encoded"])
        assert encoded == [8, 0]
        for i in range(4):  # without a session too (no session to follow): the name decides, not turns
            st, r = s.request("POST", "/rpc", {"id": f"n{i}", "op": "propagate", "volume": "ct.nii.gz",
                                               "anchor": SMALL_ANCHOR}, session=False)
            assert st == 200 and r["ok"], r
        time.sleep(0.5)
        answered = {line.rsplit(" from ", 1)[1].split(")")[0] for line in s.stderr
                    if 'propagate id="n' in line and " from " in line}
        assert len(answered) == 1, answered
    finally:
        s.stop()


def test_the_front_serves_https_itself(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    proc = subprocess.Popen(SERVE + ["--http", "--host", "127.0.0.1", "--port", "0", "--devices", "cpu,cpu",
                                     "--threads", "1", "--tls-cert", str(cert), "--tls-key", str(key)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for _ in range(200):
            line = proc.stderr.readline()
            if "ready (protocol 1) on https://127.0.0.1:" in line:
                port = int(line.split("https://127.0.0.1:")[1].split(";")[0].split()[0])
                break
        assert port, "no https ready line"
        import ssl

        ctx = ssl.create_default_context(cafile=str(cert))
        ctx.check_hostname = False
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
        conn.request("GET", "/hello")
        resp = conn.getresponse()
        r = json.loads(resp.read())
        conn.close()
        assert resp.status == 200 and r["result"]["devices"] == ["cpu", "cpu"]
    finally:
        proc.terminate()
        proc.wait(60)


def _hello(port, source, sid=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    conn.request("GET", "/hello", headers={"X-MedVol-Session": sid} if sid else {})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.getheader("X-MedVol-Session")


@pytest.mark.probe("55.4", "behind --devices, one client's 140 sessions push out no other client's")
def test_front_keeps_sessions_per_client(front):
    """The workers count sessions under the client the front names (X-MedVol-Client), not under
    the front's own address: a client opening and using many sessions forgets only its own."""
    bob = _hello(front.port, "127.0.0.2")
    assert _hello(front.port, "127.0.0.2", bob) == bob  # sent back: a known session
    for _ in range(140):  # about 70 known sessions on each worker, more than 64 a client keeps
        sid = _hello(front.port, "127.0.0.1")
        assert _hello(front.port, "127.0.0.1", sid) == sid
    assert _hello(front.port, "127.0.0.2", bob) == bob

