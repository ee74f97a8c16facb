"""The worker and the command line under hostile or broken input (issue 13).

Each test replays one probe a hostile client (or an unlucky user) could send and checks the
outcome: refused with a clear error and the worker still serving, nothing read or written
outside what the operator allowed, nothing half-written left behind. Servers run on loopback
only, with the ``tiny`` preset; every probe is bounded in count and time.

``@pytest.mark.probe(item, text)`` ties a test to the issue's numbered item; figures a reviewer
wants (memory, connections held, seconds to refuse) are recorded with ``record_property``.
``Testing/benchmarks/abuse.py`` runs this file, with the heavy probes (``heavy_probe``: 200 slow
clients, a decompression bomb under the default voxel limit), and prints probe → outcome.
"""

from __future__ import annotations

import base64
import errno
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.cli import main as cli_main
from medvolcore.errors import AnchorError, CancelledError, LimitError, OutputError, VolumeError
from medvolcore.volume import load_volume, save_mask

from worker_clients import HttpServer, StdioClient

ANCHOR = {"schema": "medvol.anchor/1", "slice": 12, "boxes": [[30, 30, 90, 80]], "source": "user"}
LONG_ANCHOR = {"schema": "medvol.anchor/1", "slice": 56, "boxes": [[30, 30, 90, 80]], "source": "user"}


def _b64(path: Path) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode()


def _bomb(shape=(2048, 2048, 1000), complete: bool = False) -> bytes:
    """A small .nii.gz whose header declares ``shape`` int16 voxels of value 0.

    ``complete``: the gzip stream holds every declared voxel (zeros compress about 1000:1, so
    512×512×1000 is about 0.5 MB), else only the first MB (enough for a header check).
    """
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(np.int16)
    hdr["vox_offset"] = 352
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip container
    parts = [z.compress(hdr.binaryblock + b"\0" * 4)]
    left = 2 * int(np.prod(shape)) if complete else 1 << 20
    zeros = b"\0" * (16 << 20)
    while left > 0:
        parts.append(z.compress(zeros[:min(left, len(zeros))]))
        left -= len(zeros)
    parts.append(z.flush())
    return b"".join(parts)


def _proc_status(pid: int, key: str) -> float:
    """A field of /proc/PID/status: memory fields in MB (VmRSS, VmHWM), counts as they are (Threads)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                v = float(line.split()[1])
                return v / 1024 if key.startswith("Vm") else v
    return float("nan")


def _rss_mb(pid: int) -> float:
    return _proc_status(pid, "VmRSS")


heavy = pytest.mark.skipif(os.environ.get("MEDVOL_HEAVY_PROBES") != "1",
                           reason="heavy probe: run Testing/benchmarks/abuse.py (or set MEDVOL_HEAVY_PROBES=1)")


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
    st, r = server.request("POST", "/rpc", {"id": 2, "op": "propagate", "volume_b64": _b64(ct_sm_path),
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


@pytest.mark.probe("3", "folder of 10,001 files as a volume")
def test_folder_with_too_many_files_is_refused_before_reading(tmp_path):
    from medvolcore.volume import MAX_DICOM_FILES

    big = tmp_path / "big"
    big.mkdir()
    for i in range(MAX_DICOM_FILES + 1):
        (big / f"{i}.dcm").touch()
    t = time.perf_counter()
    with pytest.raises(LimitError, match="more than"):
        load_volume(big)
    from medvolcore.worker import file_sha256

    with pytest.raises(LimitError):
        file_sha256(big)
    assert time.perf_counter() - t < 10


@pytest.mark.probe("3", "cancel while reading a volume")
def test_reading_honours_cancel(ct_path):
    ev = threading.Event()
    ev.set()
    with pytest.raises(CancelledError):
        load_volume(ct_path, cancel=ev)


@pytest.mark.probe("3", "client disconnects during a 112-slice propagation")
def test_http_client_disconnect_cancels_its_request(server, ct_path, record_property):
    body = json.dumps({"id": "gone", "op": "propagate", "volume_b64": _b64(ct_path), "anchor": LONG_ANCHOR}).encode()
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
def test_http_bomb_refused_from_its_header(server, record_property):
    before = _rss_mb(server.proc.pid)
    t = time.perf_counter()
    st, r = server.request("POST", "/rpc", data=_bomb(), headers={
        "Content-Type": "application/octet-stream",
        "X-MedVol-Request": json.dumps({"id": "bomb", "op": "propagate", "anchor": ANCHOR})})
    assert r["ok"] is False and r["error"]["code"] == "too_large", r
    assert "4,194,304,000 voxels" in r["error"]["message"] and "--max-voxels" in r["error"]["message"]
    refuse_s = time.perf_counter() - t
    growth = _rss_mb(server.proc.pid) - before
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
    st, r = server.request("POST", "/rpc", {"id": "f", "op": "propagate", "volume_b64": _b64(ct_sm_path),
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
        "POST", "/rpc", {"id": "mine", "op": "propagate", "volume_b64": _b64(ct_path), "anchor": LONG_ANCHOR})))
    th.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _, s = server.request("GET", "/status")
            if s["result"]["current"]:
                break
            time.sleep(0.1)
        assert s["result"]["current"]["id"] == "mine"
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
    from medvolcore.worker import Worker

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

def _ct_with_patient_text(src: Path, dst: Path) -> Path:
    img = nib.load(str(src))
    hdr = img.header.copy()
    hdr["descrip"] = b"DOE^JOHN 1970-01-01"
    hdr["aux_file"] = b"MRN 123456"
    hdr["intent_name"] = b"John"
    hdr["db_name"] = b"Hospital X"
    hdr.extensions.append(nib.nifti1.Nifti1Extension(2, b"DICOM header with PatientName DOE^JOHN"))
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj), img.affine, header=hdr), str(dst))
    return dst


def _assert_no_patient_text(mask_path: Path) -> None:
    h = nib.load(str(mask_path)).header
    for name in ("descrip", "aux_file", "intent_name", "db_name"):
        assert bytes(h[name].item()).strip(b"\0") == b"", name
    assert len(h.extensions) == 0
    raw = gzip.decompress(Path(mask_path).read_bytes()) if str(mask_path).endswith(".gz") else Path(mask_path).read_bytes()
    assert b"DOE" not in raw and b"123456" not in raw


@pytest.mark.probe("10", "worker mask of a CT with patient text in its header")
def test_worker_mask_has_no_patient_text(stdio, tmp_path, ct_sm_path):
    ct = _ct_with_patient_text(ct_sm_path, tmp_path / "named.nii.gz")
    r = stdio.call({"id": "p", "op": "propagate", "volume": str(ct), "anchor": ANCHOR})
    assert r["ok"] is True, r
    _assert_no_patient_text(Path(r["result"]["mask_path"]))


@pytest.mark.probe("10", "save_mask clears descrip/aux_file/intent_name/db_name")
def test_save_mask_clears_free_text_but_keeps_geometry(tmp_path, ct_sm_path):
    ct = load_volume(_ct_with_patient_text(ct_sm_path, tmp_path / "named.nii.gz"))
    out = save_mask(np.zeros(ct.shape, np.uint8), ct, tmp_path / "m.nii.gz")
    _assert_no_patient_text(out)
    assert np.allclose(nib.load(str(out)).affine, ct.affine)


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
    st, r = sandboxed.request("POST", "/rpc", {"id": 1, "op": "propagate", "volume": "ct.nii.gz", "anchor": ANCHOR,
                                               "out": "masks/m.nii.gz"})
    assert r["ok"] is False and r["error"]["code"] == "bad_output"  # no folder is created for a client
    (root / "masks").mkdir(exist_ok=True)
    st, r = sandboxed.request("POST", "/rpc", {"id": 2, "op": "propagate", "volume": "ct.nii.gz", "anchor": ANCHOR,
                                               "out": "masks/m.nii.gz"})
    assert r["ok"] is True, r
    assert r["result"]["mask_path"] == os.path.join("masks", "m.nii.gz")  # relative, as the client named it
    assert (root / "masks" / "m.nii.gz").is_file() and r["result"]["mask_b64"]
    for vol in ("../" + outside.name + "/private.nii.gz", str(outside / "private.nii.gz"), "link.nii.gz",
                "linkdir/private.nii.gz", "/etc/passwd"):
        st, r = sandboxed.request("POST", "/rpc", {"id": 3, "op": "propagate", "volume": vol, "anchor": ANCHOR})
        assert r["ok"] is False and r["error"]["code"] == "forbidden", (vol, r)
    st, r = sandboxed.request("POST", "/rpc", {"id": 4, "op": "propagate", "volume_b64": _b64(root / "ct.nii.gz"),
                                               "anchor": ANCHOR, "out": "linkdir/evil.nii.gz"})
    assert r["ok"] is False and r["error"]["code"] == "forbidden"
    assert not (outside / "evil.nii.gz").exists()


@pytest.mark.probe('1', "--data-dir: out = the request's own volume, overwrite")
def test_output_never_replaces_the_input(sandboxed, data_dir):
    root, _ = data_dir
    before = (root / "ct.nii.gz").read_bytes()
    st, r = sandboxed.request("POST", "/rpc", {"id": 5, "op": "propagate", "volume": "ct.nii.gz", "anchor": ANCHOR,
                                               "out": "./ct.nii.gz", "overwrite": True})
    assert r["ok"] is False and r["error"]["code"] == "bad_input" and "input" in r["error"]["message"]
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


# ---- command line: outputs --------------------------------------------------------------------------

def _run(capsys, *argv):
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(code, err, *needles):
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if ": warning:" not in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a command gets as far as loading models (the checks must come first)."""
    from medvolcore import pipeline

    def refuse(*a, **k):
        raise AssertionError("models were loaded before the outputs were checked")

    monkeypatch.setattr(pipeline.Pipeline, "__init__", refuse)


@pytest.mark.probe("11", "segment --out m --anchor-out m / --qc m")
@pytest.mark.parametrize("other", ["--anchor-out", "--qc"])
def test_segment_refuses_two_outputs_in_one_file(capsys, tmp_path, ct_sm_path, no_model_load, other):
    m = tmp_path / "m.nii.gz"
    code, _, err = _run(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", m, other, m, "--overwrite")
    _one_line(code, err, "same file")
    assert not m.exists()


@pytest.mark.probe("11", "segment --out = --volume (same path, symlink, ..)")
def test_segment_refuses_output_equal_to_input(capsys, tmp_path, ct_sm_path, no_model_load):
    ct = tmp_path / "ct.nii.gz"
    ct.write_bytes(ct_sm_path.read_bytes())
    link = tmp_path / "alias.nii.gz"
    link.symlink_to(ct)
    for out in (ct, link, tmp_path / "x" / ".." / "ct.nii.gz"):
        (tmp_path / "x").mkdir(exist_ok=True)
        code, _, err = _run(capsys, "segment", "--volume", ct, "--query", "liver", "--preset", "tiny",
                            "--out", out, "--overwrite")
        _one_line(code, err, "is the input --volume")
    assert ct.read_bytes() == ct_sm_path.read_bytes()


@pytest.mark.probe("11", "propagate --anchor-out = --anchor")
def test_propagate_refuses_anchor_out_over_anchor(capsys, tmp_path, ct_sm_path):
    a = tmp_path / "a.anchor.json"
    a.write_text(json.dumps(ANCHOR))
    code, _, err = _run(capsys, "propagate", "--volume", ct_sm_path, "--anchor", a, "--random-weights", "0",
                        "--out", tmp_path / "m.nii.gz", "--anchor-out", a, "--overwrite")
    _one_line(code, err, "is the input --anchor")
    assert json.loads(a.read_text()) == ANCHOR


@pytest.mark.probe("12", "parent is a file; .txt mask; .jpg QC")
def test_output_problems_found_before_the_work(capsys, tmp_path, ct_sm_path, no_model_load):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = _run(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", afile / "m.nii.gz")
    _one_line(code, err, "cannot write", "is a file, not a folder")
    code, _, err = _run(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", tmp_path / "new" / "deeper" / "m.txt")
    _one_line(code, err, "unsupported mask type")
    assert not (tmp_path / "new").exists()  # refused before any folder was made
    code, _, err = _run(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", tmp_path / "m.nii.gz", "--qc", tmp_path / "qc.jpg")
    _one_line(code, err, "unsupported QC picture type")


@pytest.mark.probe("12", "permission denied (simulated EACCES)")
def test_permission_denied_is_one_clear_line(capsys, tmp_path, ct_sm_path, monkeypatch, no_model_load):
    import tempfile as tempfile_mod

    from medvolcore import fileio

    real = tempfile_mod.mkstemp

    def denied(*a, dir=None, **k):
        if dir is not None and Path(dir) == tmp_path / "ro":
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(*a, dir=dir, **k)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(fileio.tempfile, "mkstemp", denied)
    code, _, err = _run(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", tmp_path / "ro" / "m.nii.gz")
    _one_line(code, err, f"cannot write {tmp_path / 'ro' / 'm.nii.gz'}: permission denied")


@pytest.fixture
def read_only_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:  # root ignores modes
        pytest.skip("cannot make a folder read-only for root here (no chattr +i)")
    yield d
    subprocess.run(["chattr", "-i", str(d)], capture_output=True)


@pytest.mark.probe("12", "read-only folder (chattr +i / chmod 555)")
def test_real_read_only_folder(capsys, read_only_dir, ct_sm_path, no_model_load):
    code, _, err = _run(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", read_only_dir / "m.nii.gz")
    _one_line(code, err, "cannot write", "m.nii.gz")
    assert os.listdir(read_only_dir) == []


@pytest.mark.probe("12", "disk full while writing (simulated ENOSPC)")
def test_disk_full_leaves_no_partial_file(capsys, tmp_path, small_ct, monkeypatch):
    import nibabel

    def full(img, path):
        Path(path).write_bytes(b"\x1f\x8b partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nibabel, "save", full)
    code, _, err = _run(capsys, "propagate", "--volume", small_ct[0], "--slice", "3", "--box", "30", "30", "90", "80",
                        "--random-weights", "0", "--image-size", "64", "--out", tmp_path / "m.nii.gz", "--no-progress")
    _one_line(code, err, f"cannot write {tmp_path / 'm.nii.gz'}: no space left on device")
    assert os.listdir(tmp_path) == []


@pytest.mark.probe("12", "SIGTERM during the atomic rename")
def test_sigterm_during_the_write_removes_the_temporary(tmp_path, seg_sm_path):
    """SIGTERM at the moment an output is renamed into place: no hidden .part file may stay behind."""
    script = f"""
import os, sys, time
from pathlib import Path
from medvolcore import fileio
def slow_replace(src, dst):
    Path({str(tmp_path / 'writing')!r}).write_text("x")
    time.sleep(60)
fileio.os.replace = slow_replace
from medvolcore.cli import main
sys.exit(main(sys.argv[1:]))
"""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", script, "anchor", "--mask", str(seg_sm_path), "--label", "5",
                             "--out", str(out / "liver.anchor.json")], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "writing").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert (tmp_path / "writing").exists(), proc.stderr.read() if proc.poll() is not None else "no write"
    assert any(p.name.startswith(".liver.anchor.json.") for p in out.iterdir())  # the temporary exists now
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 143
    assert "terminated" in proc.stderr.read()
    assert os.listdir(out) == []


# ---- heavy probes (Testing/benchmarks/abuse.py) -------------------------------------------------------

@heavy
@pytest.mark.probe("5", "200 clients that never finish their headers (default cap 32, timeout 20 s)")
def test_two_hundred_slow_clients(record_property):
    s = HttpServer("--device", "cpu")
    try:
        base = _proc_status(s.proc.pid, "Threads")
        t_attack = time.perf_counter()
        socks = []
        for _ in range(200):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
            c.sendall(b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(c)
        time.sleep(1.0)
        held = _proc_status(s.proc.pid, "Threads") - base
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
        while _proc_status(s.proc.pid, "Threads") > base and time.monotonic() < deadline:
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
        before = _rss_mb(s.proc.pid)
        data = _bomb((512, 512, 1000), complete=True)
        hdr = {"Content-Type": "application/octet-stream",
               "X-MedVol-Request": json.dumps({"id": "bomb", "op": "propagate",
                                              "anchor": dict(ANCHOR, slice=500)})}
        out = {}
        th = threading.Thread(target=lambda: out.update(r=s.request("POST", "/rpc", data=data, headers=hdr)))
        th.start()
        peak = before
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            peak = max(peak, _rss_mb(s.proc.pid))
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
        after = _rss_mb(s.proc.pid)
        _, st = s.request("GET", "/status")
        record_property("upload bytes", len(data))
        record_property("RSS before / peak / after cancel MB", f"{before:.0f} / {peak:.0f} / {after:.0f}")
        assert out["r"][1]["error"]["code"] == "cancelled", out
        assert st["result"]["cached_volumes"] == 0
        assert after - before < 300  # the 1 GB volume was not kept
    finally:
        s.stop()


# ---- DICOM series that are not one evenly spaced stack ---------------------------------------------

@pytest.fixture
def dicom_series(tmp_path, ct_sm_path, write_dicom_series):
    sitk = pytest.importorskip("SimpleITK")
    img = sitk.ReadImage(str(ct_sm_path))
    folder = tmp_path / "series"
    write_dicom_series(sitk, sitk.Cast(img, sitk.sitkInt16), folder)
    return sitk, img, folder


def _by_position(folder):
    import SimpleITK as sitk

    r = sitk.ImageFileReader()
    pos = []
    for f in sorted(folder.iterdir()):
        r.SetFileName(str(f))
        r.ReadImageInformation()
        pos.append((float(r.GetMetaData("0020|0032").split("\\")[2]), f))
    return [f for _, f in sorted(pos)]


@pytest.mark.probe("13", "complete DICOM series: 3.000 mm")
def test_dicom_series_reads_with_its_real_spacing(dicom_series):
    _, img, folder = dicom_series
    v = load_volume(folder)
    assert v.shape == (122, 101, 30)
    assert v.spacing == pytest.approx((3.0, 3.0, 3.0), abs=1e-3)


@pytest.mark.probe("13", "DICOM series with one slice missing")
def test_dicom_gap_is_refused_and_named(dicom_series):
    _, _, folder = dicom_series
    files = _by_position(folder)
    files[14].unlink()
    with pytest.raises(VolumeError, match=r"not evenly spaced.*6\.00 mm.*3\.00 mm apart; about 1 slice missing"):
        load_volume(folder)
    from medvolcore.pipeline import as_stack

    with pytest.raises(VolumeError):
        as_stack(folder)


@pytest.mark.probe("13", "DICOM series with a duplicated position")
def test_dicom_duplicate_position_is_refused(dicom_series, write_dicom_series):
    sitk, img, folder = dicom_series
    files = _by_position(folder)
    r = sitk.ImageFileReader()
    r.SetFileName(str(files[3]))
    r.LoadPrivateTagsOn()
    one = r.Execute()
    r.SetFileName(str(files[4]))
    r.ReadImageInformation()
    one.SetMetaData("0020|0032", r.GetMetaData("0020|0032"))   # slice 3 now claims slice 4's position
    one.SetMetaData("0008|0018", "1.2.826.0.1.3680043.2.1125.7731.9.9")
    w = sitk.ImageFileWriter()
    w.KeepOriginalImageUIDOn()
    w.SetFileName(str(files[3]))
    w.Execute(one)
    with pytest.raises(VolumeError, match="same position"):
        load_volume(folder)


@pytest.mark.probe("13", "two DICOM series in one folder")
def test_dicom_two_series_in_one_folder_is_refused(tmp_path, dicom_series, write_dicom_series):
    sitk, img, folder = dicom_series
    write_dicom_series(sitk, sitk.Cast(img, sitk.sitkInt16)[:, :, :5], tmp_path / "other", uid="1.2.826.0.1.3680043.2.1125.99")
    for f in (tmp_path / "other").iterdir():
        f.rename(folder / ("b_" + f.name))
    with pytest.raises(VolumeError, match="2 DICOM series"):
        load_volume(folder)


@pytest.mark.probe("13", "medvol info on a gapped series")
def test_cli_dicom_gap_is_one_line(capsys, dicom_series):
    _, _, folder = dicom_series
    _by_position(folder)[20].unlink()
    code, _, err = _run(capsys, "info", folder)
    _one_line(code, err, "not evenly spaced", "slice missing")


# ---- unit-level limits --------------------------------------------------------------------------------

@pytest.mark.probe("4", "load_volume of the bomb with the default limit")
def test_voxel_limit_checked_in_the_header(tmp_path):
    p = tmp_path / "bomb.nii.gz"
    p.write_bytes(_bomb())
    t = time.perf_counter()
    with pytest.raises(LimitError, match="over the limit"):
        load_volume(p, max_voxels=1024 * 1024 * 2000)
    assert time.perf_counter() - t < 1


@pytest.mark.probe("9", "EvidenceAnchor with 9 boxes")
def test_anchor_box_cap():
    from medvolcore.anchor import MAX_BOXES, EvidenceAnchor

    EvidenceAnchor(0, [[0, 0, 1, 1]] * MAX_BOXES, [10, 10])
    with pytest.raises(AnchorError, match="at most 8"):
        EvidenceAnchor(0, [[0, 0, 1, 1]] * (MAX_BOXES + 1), [10, 10])


@pytest.mark.probe("12", "output path that is a folder")
def test_output_error_type_for_folder_collisions(tmp_path):
    from medvolcore.fileio import check_output

    (tmp_path / "d.nii.gz").mkdir()
    with pytest.raises(OutputError, match="is a folder"):
        check_output(tmp_path / "d.nii.gz")
