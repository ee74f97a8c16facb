"""The worker (``medvol serve``, :mod:`medvolcore.serve`) under hostile or broken input.

Each test replays one probe a hostile client could send and checks the outcome: refused with a
clear error and the worker still serving, nothing read or written outside what the operator
allowed. Servers run on loopback only, with the ``tiny`` preset; every probe is bounded in count
and time. ``@pytest.mark.probe(item, text)`` ties a test to the hardening item it replays; figures
a reviewer wants (memory, connections held, seconds to refuse) are recorded with
``record_property``. ``Testing/benchmarks/abuse.py`` runs every probe, with the heavy ones
(``heavy``: 200 slow clients, a decompression bomb under the default voxel limit), and prints
probe → outcome.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest


from core.probes import (ANCHOR, LONG_ANCHOR, assert_no_patient_text, b64, bomb, ct_with_patient_text, heavy, proc_status, rss_mb)
from core.worker_clients import HttpServer, StdioClient


# ---- a guarded HTTP server: no data folder, small limits ------------------------------------------

@pytest.fixture(scope="module")
def server():
    s = HttpServer("--device", "cpu", "--preset", "tiny", "--client-timeout", "2", "--max-connections", "8",
                   "--max-voxels", "5000000")
    s.request("POST", "/rpc", {"id": "hi", "op": "hello"})  # get a session
    yield s
    s.stop()


def _wait_idle(server, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        st, r = server.request("GET", "/status", session=False, timeout=10)
        if not r["result"]["busy"] and r["result"]["queue_length"] == 0:
            return True
        time.sleep(0.2)
    return False




# 1. no server paths over HTTP without --data-dir ---------------------------------------------------

@pytest.mark.probe("1", "HTTP volume/out/adapter path without --data-dir")
def test_http_refuses_server_paths_without_data_dir(server, tmp_path, ct_sm_path):
    secret = tmp_path / "secret.nii.gz"
    secret.write_bytes(ct_sm_path.read_bytes())
    replies = []
    for vol in (str(secret), str(tmp_path / "does-not-exist.nii.gz")):
        st, r = server.request("POST", "/rpc", {"id": 1, "op": "segment", "volume": vol, "query": "liver"})
        replies.append(r)
        assert st == 200 and r["ok"] is False and r["error"]["code"] == "forbidden", r
    # the refusal says nothing about which server files exist
    assert replies[0]["error"]["message"] == replies[1]["error"]["message"]
    out = tmp_path / "sub" / "written.nii.gz"
    st, r = server.request("POST", "/rpc", {"id": 2, "op": "propagate", "volume_b64": b64(ct_sm_path),
                                            "anchor": ANCHOR, "out": str(out), "overwrite": True})
    assert r["ok"] is False and r["error"]["code"] == "forbidden"
    assert not out.parent.exists()  # no folder created on the way
    st, r = server.request("POST", "/rpc", {"id": 3, "op": "load", "preset": "tiny", "adapter": str(tmp_path)})
    assert r["ok"] is False and r["error"]["code"] == "forbidden"


# 2. cross-site requests ---------------------------------------------------------------------------

@pytest.mark.probe("2", "cross-site POST shutdown (text/plain, form, foreign Origin, foreign Host)")
@pytest.mark.parametrize("headers,status", [
    ({"Content-Type": "text/plain"}, 415),                      # what a web page's simple POST sends
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ({"Origin": "http://evil.example"}, 403),
    ({"Host": "evil.example"}, 403),                            # DNS rebinding
])
def test_http_refuses_cross_site_shutdown(server, headers, status):
    st, r = server.request("POST", "/rpc", {"id": "x", "op": "shutdown"}, headers=headers)
    assert st == status and r["ok"] is False, r
    time.sleep(0.2)
    assert server.alive()
    st, r = server.request("POST", "/rpc", {"id": "h", "op": "hello"})
    assert st == 200 and r["ok"] is True


@pytest.mark.probe("2", "own Origin and localhost Host still accepted")
def test_http_accepts_its_own_origin(server):
    st, r = server.request("POST", "/rpc", {"id": "h", "op": "hello"},
                           headers={"Origin": f"http://127.0.0.1:{server.port}", "Host": f"localhost:{server.port}"})
    assert st == 200 and r["ok"] is True


# 3. no hang on devices, FIFOs; a disconnected client's request is cancelled ----------------------

@pytest.mark.probe("3", "volume /dev/zero, a FIFO, /dev/stdin")
def test_stdio_refuses_device_and_fifo_at_once(tmp_path, ct_sm_path, record_property):
    fifo = tmp_path / "fifo.nii.gz"
    os.mkfifo(fifo)
    c = StdioClient("--device", "cpu")  # no model is loaded: the volume is checked first
    try:
        for i, vol in enumerate(("/dev/zero", str(fifo), "/dev/stdin")):
            t = time.perf_counter()
            r = c.call({"id": i, "op": "propagate", "volume": vol, "anchor": ANCHOR}, timeout=60)
            assert r["ok"] is False and r["error"]["code"] == "bad_volume", r
            assert "regular file" in r["error"]["message"]
            record_property(f"{vol.split('/')[-1]} refused in s", round(time.perf_counter() - t, 3))
            assert time.perf_counter() - t < 10
        r = c.call({"id": "st", "op": "status"})
        assert r["ok"] and r["result"]["busy"] is False
    finally:
        c.close()



@pytest.mark.probe("3", "client disconnects during a 112-slice propagation")
def test_http_client_disconnect_cancels_its_request(server, ct_path, record_property):
    body = json.dumps({"id": "gone", "op": "propagate", "volume_b64": b64(ct_path), "anchor": LONG_ANCHOR}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\nX-MedVol-Session: {server.session}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until it runs
        _, r = server.request("GET", "/status")
        if r["result"]["current"] and r["result"]["current"]["id"] == "gone":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the request never started")
    sock.close()
    t = time.perf_counter()
    assert _wait_idle(server, 30), "the abandoned request kept running"
    record_property("idle after disconnect s", round(time.perf_counter() - t, 2))
    assert time.perf_counter() - t < 20  # well under the full 112-slice propagation
    assert any("client disconnected" in line for line in server.stderr)


# 4. decompression bomb ----------------------------------------------------------------------------

@pytest.mark.probe("4", "1 MB .nii.gz declaring 2048×2048×1000 voxels")
@pytest.mark.probe("II.11", "1 MB .nii.gz declaring 2048×2048×1000 voxels, order-independent (after the preload)")
def test_http_bomb_refused_from_its_header(server, record_property):
    # the module's server preloads the tiny preset: wait for it, so that neither the refusal time
    # nor the memory growth counts the model load when this probe runs alone (or first)
    assert _wait_idle(server, 120), "the server never became idle"
    before = rss_mb(server.proc.pid)
    t = time.perf_counter()
    st, r = server.request("POST", "/rpc", data=bomb(), headers={
        "Content-Type": "application/octet-stream",
        "X-MedVol-Request": json.dumps({"id": "bomb", "op": "propagate", "anchor": ANCHOR})})
    assert r["ok"] is False and r["error"]["code"] == "too_large", r
    assert "4,194,304,000 voxels" in r["error"]["message"] and "--max-voxels" in r["error"]["message"]
    refuse_s = time.perf_counter() - t
    growth = rss_mb(server.proc.pid) - before
    record_property("refused in s", round(refuse_s, 3))
    record_property("RSS growth MB", round(growth, 1))
    assert refuse_s < 5
    assert growth < 100  # nothing was decompressed
    _, s = server.request("GET", "/status")
    assert s["result"]["cached_volumes"] <= 1


@pytest.mark.probe("4", "volume of a failed request is not cached")
def test_failed_request_does_not_cache_its_volume(server, ct_sm_path):
    _, s0 = server.request("GET", "/status")
    bad_anchor = dict(ANCHOR, slice=999)  # fails after the volume was read
    st, r = server.request("POST", "/rpc", {"id": "f", "op": "propagate", "volume_b64": b64(ct_sm_path),
                                            "anchor": bad_anchor})
    assert r["ok"] is False and r["error"]["code"] == "bad_anchor"
    _, s1 = server.request("GET", "/status")
    assert s1["result"]["cached_volumes"] == s0["result"]["cached_volumes"]


# 5. slow clients ----------------------------------------------------------------------------------

@pytest.mark.probe("5", "8 clients that never finish their headers (cap 8, timeout 2 s)")
def test_slow_clients_are_dropped_and_capped(server, record_property):
    slow = []
    for _ in range(8):  # fill every connection slot with clients that never finish their headers
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow.append(s)
    time.sleep(0.3)
    t = time.perf_counter()
    st, r = server.request("GET", "/status", timeout=10)  # one more: refused at once, not queued behind them
    record_property("9th client answered (503) in s", round(time.perf_counter() - t, 3))
    assert st == 503 and r["error"]["code"] == "busy"
    assert time.perf_counter() - t < 2
    for s in slow:  # the server hangs up on them after --client-timeout (2 s)
        s.settimeout(10)
        assert s.recv(100) == b""
        s.close()
    record_property("all 8 dropped after s", round(time.perf_counter() - t, 2))
    assert time.perf_counter() - t < 8
    time.sleep(0.3)
    st, r = server.request("GET", "/status")
    assert st == 200 and r["ok"]


@pytest.mark.probe("5", "headers dripped one byte per 0.3 s")
def test_slow_drip_headers_are_cut_off(server):
    s = socket.create_connection(("127.0.0.1", server.port))
    s.settimeout(10)
    t = time.perf_counter()
    try:
        for ch in b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 100:  # one byte every 0.3 s
            s.sendall(bytes([ch]))
            time.sleep(0.3)
            if time.perf_counter() - t > 6:
                break
        data = s.recv(100)
    except (BrokenPipeError, ConnectionResetError):
        data = b""
    finally:
        s.close()
    assert data == b""
    assert time.perf_counter() - t < 6.5


# 6. sessions: no client sees or cancels another's request ----------------------------------------

@pytest.mark.probe('6', "another client's status and cancel")
def test_sessions_scope_status_and_cancel(server, ct_path):
    other = HttpServer.__new__(HttpServer)  # a second client of the same server
    other.port, other.session, other.proc = server.port, None, server.proc
    _, r = other.request("POST", "/rpc", {"id": "h", "op": "hello"})
    assert r["result"]["session"] == other.session != server.session

    done = {}
    th = threading.Thread(target=lambda: done.update(r=server.request(
        "POST", "/rpc", {"id": "mine", "op": "propagate", "volume_b64": b64(ct_path), "anchor": LONG_ANCHOR})))
    th.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _, s = server.request("GET", "/status")
            if s["result"]["current"] and s["result"]["current"]["eta_s"] is not None:
                break
            time.sleep(0.1)
        assert s["result"]["current"]["id"] == "mine"
        cur = s["result"]["current"]  # the time left in the stage, as the stdio events carry it
        assert cur["stage"] in ("read", "load", "propagate", "write") and 0 <= cur["eta_s"] < 3600
        _, s2 = other.request("GET", "/status")
        assert s2["result"]["busy"] is True and s2["result"]["current"] is None and s2["result"]["queued"] == []
        for key in ("tmp_dir", "pid", "cache"):
            assert key not in s2["result"]
        assert "/" not in json.dumps(s2["result"])  # no server path at all
        _, c = other.request("POST", "/rpc", {"id": "c", "op": "cancel", "target": "mine"})
        assert c["result"] == {"target": "mine", "found": False, "state": "not_found"}
        _, c = server.request("POST", "/rpc", {"id": "c", "op": "cancel", "target": "mine"})
        assert c["result"]["state"] == "running"
    finally:
        th.join(120)
    assert done["r"][1]["error"]["code"] == "cancelled"


# 7. token file, internal paths and internal errors ------------------------------------------------

@pytest.mark.probe("7", "world-readable token file")
def test_world_readable_token_file_warns(tmp_path):
    tf = tmp_path / "token"
    tf.write_text("a-long-enough-token-0123456789\n")
    tf.chmod(0o644)
    s = HttpServer("--device", "cpu", "--token-file", str(tf))
    try:
        time.sleep(0.5)
        assert any("can be read by other users" in line and "chmod 600" in line for line in s.stderr)
    finally:
        s.stop()


@pytest.mark.probe("7", "error for a corrupt upload names no server path")
def test_http_errors_carry_no_server_paths(server):
    corrupt = b"\x1f\x8b" + b"not really gzip" * 40
    st, r = server.request("POST", "/rpc", {"id": "c", "op": "propagate",
                                            "volume_b64": base64.b64encode(corrupt).decode(), "anchor": ANCHOR})
    assert r["ok"] is False and r["error"]["code"] == "bad_volume"
    assert "uploaded volume" in r["error"]["message"]
    assert "/tmp" not in r["error"]["message"] and "medvol-serve-" not in r["error"]["message"]


@pytest.mark.probe("7", "internal error: reference only, detail in log")
def test_internal_error_reply_has_a_reference_not_the_exception(caplog):
    from medvolcore.serve import Worker

    w = Worker(transport="http")
    try:
        def boom(*a, **k):
            raise RuntimeError("secret detail /srv/data/patient-42")

        w._check_queued = boom
        got = []
        w.handle_line(json.dumps({"id": 7, "op": "segment", "volume_b64": "AA==", "query": "x"}), reply=got.append)
        (r,) = got
        assert r["ok"] is False and r["error"]["code"] == "internal" and r["id"] == 7
        assert "secret" not in r["error"]["message"] and "patient" not in r["error"]["message"]
        ref = r["error"]["message"].split("ref ")[1].split(")")[0]
        assert any(ref in rec.getMessage() and "secret detail" in rec.getMessage() for rec in caplog.records)
    finally:
        w.close(5)


# 8. one bad line never stops the worker -----------------------------------------------------------

BAD_LINES = [
    (b'{"id":' + b"1" * 5000 + b',"op":"hello"}', "bad_json"),     # over Python's int-digit limit
    (b'{"id":"\\ud800","op":"hello"}', "bad_request"),             # lone surrogate: cannot be echoed as UTF-8
    (b'{"id":' + b"9" * 30 + b',"op":"hello"}', "bad_request"),    # an id too big to be a 64-bit integer
    (b'{"id":"' + b"x" * 300 + b'","op":"hello"}', "bad_request"),
    (b'{"id":1,"op":"hello","pad":"\\udfff"}', None),               # harmless field: still answered
]


@pytest.mark.probe("8", "stdio: 5000-digit id, lone-surrogate id, huge ids")
def test_stdio_survives_crash_lines():
    c = StdioClient("--device", "cpu")
    try:
        for raw, code in BAD_LINES:
            c.send_raw(raw)
            msg = c.next(30)
            if code:
                assert msg["ok"] is False and msg["error"]["code"] == code and msg["id"] is None, (raw[:40], msg)
        assert c.call({"id": "after", "op": "hello"})["ok"] is True
        assert c.proc.poll() is None
    finally:
        c.close()


@pytest.mark.probe("8", "HTTP: the same lines")
def test_http_survives_crash_lines(server):
    for raw, code in BAD_LINES:
        st, r = server.request("POST", "/rpc", data=raw)
        assert st == 200, (raw[:40], st, r)
        if code:
            assert r["ok"] is False and r["error"]["code"] == code
    assert server.alive()


# 9. malformed anchors, surrogates, too many boxes, NaN voxels -------------------------------------

@pytest.fixture(scope="module")
def stdio(ct_sm_path):
    c = StdioClient("--device", "cpu", "--preset", "tiny")
    yield c
    c.close()


@pytest.mark.probe("9", "anchor world/notes/query of the wrong type, 9 or 500 boxes")
@pytest.mark.parametrize("change,code", [
    ({"world": "abc"}, "bad_anchor"),
    ({"world": {"boxes_ras": 5}}, "bad_anchor"),
    ({"notes": 5}, "bad_anchor"),
    ({"notes": ["ok", 3]}, "bad_anchor"),
    ({"query": ["not", "text"]}, "bad_anchor"),
    ({"boxes": [[10, 10, 20, 20]] * 500}, "bad_anchor"),
    ({"boxes": [[10, 10, 20, 20]] * 9}, "bad_anchor"),
])
def test_malformed_anchor_fields(stdio, ct_sm_path, change, code):
    anchor = {k: v for k, v in ANCHOR.items() if not (k == "boxes" and "world" in change)}
    anchor.update(change)
    t = time.perf_counter()
    r = stdio.call({"id": "a", "op": "propagate", "volume": str(ct_sm_path), "anchor": anchor})
    assert r["ok"] is False and r["error"]["code"] == code, r
    assert time.perf_counter() - t < 30


@pytest.mark.probe("9", "lone surrogate in the query")
def test_lone_surrogate_query_is_bad_input(stdio, ct_sm_path):
    stdio.send_raw(b'{"id":"q","op":"segment","volume":"' + str(ct_sm_path).encode() + b'","query":"liver \\ud800"}')
    r = stdio.reply("q")
    assert r["ok"] is False and r["error"]["code"] == "bad_input"


@pytest.mark.probe("9", "NaN/Inf voxels reported in notes")
def test_nan_voxels_are_reported_in_notes(stdio, tmp_path, ct_sm_path):
    img = nib.load(str(ct_sm_path))
    arr = np.asarray(img.dataobj).astype(np.float32)
    arr[0:3, 0:2, 0] = np.nan
    arr[5, 5, 5] = np.inf
    p = tmp_path / "nan.nii.gz"
    nib.save(nib.Nifti1Image(arr, img.affine), str(p))
    r = stdio.call({"id": "n", "op": "propagate", "volume": str(p), "anchor": ANCHOR})
    assert r["ok"] is True, r
    assert any("7 NaN or infinite voxel(s)" in n for n in r["result"]["notes"])



# 10. no patient text in the masks written ---------------------------------------------------------

@pytest.mark.probe("10", "worker mask of a CT with patient text in its header")
def test_worker_mask_has_no_patient_text(stdio, tmp_path, ct_sm_path):
    ct = ct_with_patient_text(ct_sm_path, tmp_path / "named.nii.gz")
    r = stdio.call({"id": "p", "op": "propagate", "volume": str(ct), "anchor": ANCHOR})
    assert r["ok"] is True, r
    assert_no_patient_text(Path(r["result"]["mask_path"]))



# ---- --data-dir: paths inside one folder only ------------------------------------------------------

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, ct_sm_path):
    root = tmp_path_factory.mktemp("data")
    (root / "ct.nii.gz").write_bytes(ct_sm_path.read_bytes())
    outside = tmp_path_factory.mktemp("outside")
    (outside / "private.nii.gz").write_bytes(ct_sm_path.read_bytes())
    (root / "link.nii.gz").symlink_to(outside / "private.nii.gz")
    (root / "linkdir").symlink_to(outside)
    return root, outside


@pytest.fixture(scope="module")
def sandboxed(data_dir):
    s = HttpServer("--device", "cpu", "--preset", "tiny", "--data-dir", str(data_dir[0]))
    yield s
    s.stop()


@pytest.mark.probe("1", "--data-dir: ../, absolute, symlinked file and folder")
def test_data_dir_allows_paths_inside_only(sandboxed, data_dir):
    root, outside = data_dir
    (root / "masks").mkdir(exist_ok=True)
    st, r = sandboxed.request("POST", "/rpc", {"id": 1, "op": "propagate", "volume": "ct.nii.gz", "anchor": ANCHOR,
                                               "out": "masks/m.nii.gz"})
    # outputs go to --out-dir only (test_serve_http.py), never into the data folder
    assert r["ok"] is False and r["error"]["code"] == "forbidden" and "--out-dir" in r["error"]["message"]
    assert not (root / "masks" / "m.nii.gz").exists()
    st, r = sandboxed.request("POST", "/rpc", {"id": 2, "op": "propagate", "volume": "ct.nii.gz", "anchor": ANCHOR})
    assert r["ok"] is True, r
    assert "mask_path" not in r["result"] and r["result"]["mask_b64"]
    for vol in ("../" + outside.name + "/private.nii.gz", str(outside / "private.nii.gz"), "link.nii.gz",
                "linkdir/private.nii.gz", "/etc/passwd"):
        st, r = sandboxed.request("POST", "/rpc", {"id": 3, "op": "propagate", "volume": vol, "anchor": ANCHOR})
        assert r["ok"] is False and r["error"]["code"] == "forbidden", (vol, r)
    st, r = sandboxed.request("POST", "/rpc", {"id": 4, "op": "propagate", "volume_b64": b64(root / "ct.nii.gz"),
                                               "anchor": ANCHOR, "out": "linkdir/evil.nii.gz"})
    assert r["ok"] is False and r["error"]["code"] == "forbidden"
    assert not (outside / "evil.nii.gz").exists()


@pytest.mark.probe('1', "--data-dir: out = the request's own volume, overwrite")
def test_output_never_replaces_the_input(sandboxed, data_dir):
    root, _ = data_dir
    before = (root / "ct.nii.gz").read_bytes()
    st, r = sandboxed.request("POST", "/rpc", {"id": 5, "op": "propagate", "volume": "ct.nii.gz", "anchor": ANCHOR,
                                               "out": "./ct.nii.gz", "overwrite": True})
    assert r["ok"] is False and r["error"]["code"] == "forbidden"  # no output into the data folder at all
    assert (root / "ct.nii.gz").read_bytes() == before


@pytest.mark.probe("5", "20 simultaneous clients")
def test_twenty_simultaneous_clients_are_all_answered(sandboxed):
    results = []

    def one():
        try:
            st, r = sandboxed.request("GET", "/status", session=False, timeout=30)
            results.append(st)
        except Exception as e:  # noqa: BLE001 - a reset is what this test looks for
            results.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [200] * 20



# ---- heavy probes (Testing/benchmarks/abuse.py) -------------------------------------------------------

@heavy
@pytest.mark.probe("5", "200 clients that never finish their headers (default cap 32, timeout 20 s)")
def test_two_hundred_slow_clients(record_property):
    s = HttpServer("--device", "cpu")
    try:
        base = proc_status(s.proc.pid, "Threads")
        t_attack = time.perf_counter()
        socks = []
        for _ in range(200):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
            c.sendall(b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(c)
        time.sleep(1.0)
        held = proc_status(s.proc.pid, "Threads") - base
        t = time.perf_counter()
        st, r = s.request("GET", "/status", timeout=10)
        busy_s = time.perf_counter() - t
        refused = 0
        for c in socks:
            c.settimeout(30)
            try:
                if c.recv(200).startswith(b"HTTP/1.1 503"):
                    refused += 1
            except OSError:
                pass
        deadline = time.monotonic() + 40
        while proc_status(s.proc.pid, "Threads") > base and time.monotonic() < deadline:
            time.sleep(0.2)
        dropped_s = time.perf_counter() - t_attack
        for c in socks:
            c.close()
        st2, _ = s.request("GET", "/status", timeout=10)
        record_property("threads held", int(held))
        record_property("answered 503 at once", refused)
        record_property("a new client during the attack", f"{st} in {busy_s:.3f} s")
        record_property("all dropped, threads back to baseline after s", round(dropped_s, 1))
        assert held <= 33 and refused >= 200 - 32 and st == 503 and st2 == 200
    finally:
        s.stop()


@heavy
@pytest.mark.probe("4", "0.5 MB .nii.gz declaring 512×512×1000 (under the default limit), cancelled")
def test_bomb_under_the_default_limit_keeps_no_memory(ct_path, record_property):
    s = HttpServer("--device", "cpu", "--preset", "tiny")
    try:
        s.request("POST", "/rpc", {"id": "h", "op": "hello"})
        _wait_idle(s, 120)
        before = rss_mb(s.proc.pid)
        data = bomb((512, 512, 1000), complete=True)
        hdr = {"Content-Type": "application/octet-stream",
               "X-MedVol-Request": json.dumps({"id": "bomb", "op": "propagate",
                                              "anchor": dict(ANCHOR, slice=500)})}
        out = {}
        th = threading.Thread(target=lambda: out.update(r=s.request("POST", "/rpc", data=data, headers=hdr)))
        th.start()
        peak = before
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            peak = max(peak, rss_mb(s.proc.pid))
            _, st = s.request("GET", "/status")
            cur = st["result"]["current"]
            if cur and cur["stage"] == "propagate":
                break
            if not th.is_alive():
                break
            time.sleep(0.2)
        s.request("POST", "/rpc", {"id": "c", "op": "cancel", "target": "bomb"})
        th.join(120)
        _wait_idle(s, 60)
        time.sleep(1.0)
        after = rss_mb(s.proc.pid)
        _, st = s.request("GET", "/status")
        record_property("upload bytes", len(data))
        record_property("RSS before / peak / after cancel MB", f"{before:.0f} / {peak:.0f} / {after:.0f}")
        assert out["r"][1]["error"]["code"] == "cancelled", out
        assert st["result"]["cached_volumes"] == 0
        assert after - before < 300  # the 1 GB volume was not kept
    finally:
        s.stop()
