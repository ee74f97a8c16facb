"""The module's worker client and session against a real ``medvol serve`` (tiny preset, CPU):
progress, results, edited anchors, cancel (polite and by killing the tree), crash and restart,
and the remote (HTTP) transport."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from MedVolR1SlicerLib.client import StdioWorker, WorkerError, worker_command
from MedVolR1SlicerLib.remoteworker import RemoteWorker
from MedVolR1SlicerLib.geometry import RoiBox, VolumeGeometry, anchor_from_rois, rois_from_anchor
from MedVolR1SlicerLib.session import CANCELLING, IDLE, RUNNING, Options, Session
from json_standin import send_json

TIMEOUT = 180
TINY = Options(preset="tiny", device="cpu")


def _command():
    return worker_command(sys.executable, "cpu", threads=1)


@pytest.fixture(scope="module")
def session():
    s = Session(client_factory=lambda options: StdioWorker(_command(), cancel_grace_s=20.0))
    yield s
    s.shutdown()


def _track(s: Session):
    states, events = [], []
    s.state_changed.connect(states.append)
    s.progress.connect(lambda job: events.append((job.op, job.stage, job.fraction)))
    return states, events


@pytest.mark.slow  # a worker process, a segment end to end
def test_segment_reports_progress_and_returns_mask_and_world_anchor(session, ct_sm_path):
    states, events = _track(session)
    etas = []
    session.progress.connect(lambda job: etas.append(job.eta_s) if job.stage == "ground" else None)
    job = session.segment(str(ct_sm_path), "  the organ that   secretes bile ", TINY)
    assert session.state == RUNNING
    session.wait(job, TIMEOUT)
    assert job.state == "done", job.error
    assert states == [RUNNING, IDLE]
    stages = [st for op, st, _ in events if op == "segment"]
    assert {"ground", "propagate"} <= set(stages)
    assert stages.index("ground") < stages.index("propagate")
    prop = [f for op, st, f in events if op == "segment" and st == "propagate"]
    assert prop == sorted(prop) and prop[-1] == pytest.approx(1.0)
    assert any(op == "load" for op, _, _ in events)  # model loading shows on the bar too
    ground = [f for op, st, f in events if op == "segment" and st == "ground"]
    assert len(set(ground)) >= 10 and any(e is not None for e in etas)  # the grounding moves the bar, with time left

    r = job.result
    assert r["smoke"] is True
    assert r["anchor"]["query"] == "the organ that secretes bile"  # sent normalised
    world = r["anchor"]["world"]
    assert len(world["boxes_ras"]) == len(r["anchor"]["boxes"]) >= 1
    mask = nib.load(r["mask_path"])
    ct = nib.load(str(ct_sm_path))
    assert mask.shape == ct.shape
    np.testing.assert_allclose(mask.affine, ct.affine, atol=1e-5)
    assert int(np.count_nonzero(np.asanyarray(mask.dataobj))) == r["mask_voxels"]


def test_edited_boxes_propagate_without_reloading(session, ct_sm_path):
    job = session.wait(session.segment(str(ct_sm_path), "the liver", TINY), TIMEOUT)
    assert job.state == "done", job.error
    starts = session.client.starts
    ct = nib.load(str(ct_sm_path))
    geo = VolumeGeometry(ct.affine, ct.shape)
    rois, k = rois_from_anchor(geo, job.result["anchor"])
    # the user drags the first box 3 mm and widens it by 6 mm along the volume's first axis
    r = rois[0]
    rois[0] = RoiBox(r.center + r.axes[:, 0] * 3.0, r.size + np.array([6.0, 0, 0]), r.axes)
    anchor, notes = anchor_from_rois(geo, rois, k, query="the liver")
    prop = session.wait(session.propagate(str(ct_sm_path), anchor, TINY), TIMEOUT)
    assert prop.state == "done", prop.error
    assert session.client.starts == starts  # same process
    assert prop.result["timings"]["load_s"] == 0  # models stayed loaded
    got = prop.result["anchor"]
    assert got["source"] == "user"
    # the worker placed the world boxes on its stack: same slice, the first box moved
    assert got["slice"] == job.result["anchor"]["slice"]
    assert got["boxes"][0] != job.result["anchor"]["boxes"][0]
    np.testing.assert_allclose(got["world"]["boxes_ras"], anchor["world"]["boxes_ras"], atol=1e-4)


def test_bad_requests_come_back_as_errors_and_the_worker_keeps_serving(session, ct_sm_path, tmp_path):
    with pytest.raises(WorkerError, match="type a query"):
        session.segment(str(ct_sm_path), "   ", TINY)
    job = session.wait(session.segment(str(tmp_path / "missing.nii.gz"), "the liver", TINY), TIMEOUT)
    assert job.state == "failed"
    assert job.error.code in ("bad_volume", "bad_input")
    assert "missing.nii.gz" in job.error.message
    assert session.state == IDLE
    ok = session.wait(session.segment(str(ct_sm_path), "the spleen", TINY), TIMEOUT)
    assert ok.state == "done"


@pytest.mark.slow  # a worker process cancelled mid-request
def test_cancel_stops_a_running_request(session, ct_path):
    states, events = _track(session)
    job = session.segment(str(ct_path), "the liver", TINY)
    while not job.done and job.stage != "propagate":
        session.poll(0.05)
    session.cancel()
    assert session.state == CANCELLING
    session.wait(job, 60)
    assert job.state == "cancelled", (job.state, job.error)
    assert states[-2:] == [CANCELLING, IDLE]
    assert session.client.running  # stopped politely: no kill needed
    assert session.wait(session.segment(str(ct_path), "the spleen", TINY), TIMEOUT).state == "done"


@pytest.mark.slow  # a worker process tree killed
def test_cancel_that_is_not_honoured_kills_the_process_tree(ct_sm_path):
    w = StdioWorker(_command(), cancel_grace_s=1.0)
    try:
        w.call("load", TIMEOUT, preset="tiny", device="cpu")
        first = w.pid
        job = w.submit("segment", volume=str(ct_sm_path), query="the liver", preset="tiny")
        while not job.done and job.stage is None:
            w.poll(0.05)
        os.kill(first, signal.SIGSTOP)  # a worker stuck where it cannot honour a cancel
        t = time.monotonic()
        w.cancel(job)
        w.wait(job, 30)
        assert job.state == "cancelled"
        assert "did not stop within 1 s" in job.error.message
        assert 1.0 <= time.monotonic() - t < 15
        assert not w.running
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)
        # the next request starts a fresh worker
        assert w.call("hello", 60)["protocol"] == 1
        assert w.starts == 2 and w.pid != first
    finally:
        w.stop()


@pytest.mark.slow  # a worker process crashed and started again
def test_crash_is_reported_and_the_worker_restarts(ct_sm_path):
    s = Session(client_factory=lambda options: StdioWorker(_command()))
    crashes = []
    try:
        job = s.segment(str(ct_sm_path), "the liver", TINY)
        s.client.crashed.connect(crashes.append)
        while not job.done and job.stage not in ("ground", "propagate"):
            s.poll(0.05)
        os.kill(s.client.pid, signal.SIGKILL)
        s.wait(job, 30)
        assert job.state == "failed"
        assert job.error.code == "worker_crashed"
        assert "restarted on the next request" in job.error.message
        assert crashes and s.state == IDLE
        ops = []
        s.progress.connect(lambda j: ops.append(j.op))
        again = s.wait(s.segment(str(ct_sm_path), "the liver", TINY), TIMEOUT)
        assert again.state == "done", again.error
        assert s.client.starts == 2
        assert "load" in ops  # the session asked the new process for the models again
    finally:
        s.shutdown()


def test_worker_that_cannot_start_fails_the_request_not_the_session(tmp_path):
    s = Session(client_factory=lambda options: StdioWorker(
        [str(tmp_path / "no-such-python"), "-m", "medvolcore.cli_serve", "--stdio"]))
    with pytest.raises(WorkerError) as e:
        s.segment(str(tmp_path / "ct.nii.gz"), "the liver", TINY)
    assert e.value.code == "worker_start"
    assert s.state == IDLE


@pytest.mark.slow  # a worker process over HTTP, segments end to end
def test_remote_worker_over_http(ct_sm_path, tmp_path):
    token = "t" * 24
    (tmp_path / "token").write_text(token)
    proc = subprocess.Popen([sys.executable, "-m", "medvolcore.cli_serve", "--http", "--port", "0", "--threads", "1",
                             "--token-file", str(tmp_path / "token"), "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            m = re.search(r"127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        assert port, "the HTTP worker did not say where it listens"
        with pytest.raises(WorkerError, match="unauthorized|token"):
            RemoteWorker(f"http://127.0.0.1:{port}", token="wrong-token-xxxxxxxxxxxx").call("hello", 30)
        s = Session()
        opts = Options(preset="tiny", device="cpu", worker="remote", remote_url=f"http://127.0.0.1:{port}/",
                       remote_token=token)
        job = s.wait(s.segment(str(ct_sm_path), "the liver", opts), TIMEOUT)
        assert job.state == "done", job.error
        assert "mask_b64" not in job.result
        mask = nib.load(job.result["mask_path"])  # written locally from the reply
        assert mask.shape == nib.load(str(ct_sm_path)).shape
        assert int(np.count_nonzero(np.asanyarray(mask.dataobj))) == job.result["mask_voxels"]
        masks = Path(job.result["mask_path"]).parent
        s.shutdown()
        assert not masks.exists()  # the client's own folder of returned masks (patient data) is gone
        with pytest.raises(WorkerError, match="http://"):
            RemoteWorker("ftp://example")
        gone = RemoteWorker("http://127.0.0.1:9")  # nothing listens there
        with pytest.raises(WorkerError) as e:
            gone.call("hello", 30)
        assert e.value.code == "connection"
        gone.stop()
        kept = tmp_path / "kept"
        kept.mkdir()
        mine = RemoteWorker("http://127.0.0.1:9", tmp_dir=str(kept))
        mine.stop()
        assert kept.is_dir()  # a folder the caller gave is the caller's
    finally:
        proc.terminate()
        proc.wait(30)


def test_remote_worker_uploads_gzip_and_reads_a_binary_mask(tmp_path, ct_sm_path):
    """Against a stand-in server: a ``.nii`` goes out gzip-compressed with a Content-Length (never
    chunked, which the worker refuses) and ``Accept: application/gzip``; a mask sent as the reply
    body (the envelope in ``X-MedVol-Reply``) lands in ``mask_path`` byte for byte."""
    import gzip
    import hashlib
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    nii = tmp_path / "ct.nii"
    nii.write_bytes(gzip.decompress(ct_sm_path.read_bytes()))
    mask = gzip.compress(b"mask bytes " * 1000)
    seen = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.headers, body))
            req = json.loads(self.headers.get("X-MedVol-Request") or body)
            if req["op"] == "hello":
                out, ctype, extra = json.dumps({"id": req["id"], "ok": True, "result": {}}).encode(), "application/json", {}
            else:
                reply = {"id": req["id"], "ok": True, "result": {"mask_voxels": 7}}
                out, ctype, extra = mask, "application/gzip", {"X-MedVol-Reply": json.dumps(reply)}
            self.send_response(200)
            for k, v in {"Content-Type": ctype, "Content-Length": str(len(out)), "X-MedVol-Session": "s1", **extra}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(out)

    srv = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    w = RemoteWorker(f"http://127.0.0.1:{srv.server_address[1]}")
    try:
        res = w.call("segment", 30, volume=str(nii), query="the liver")
        headers, body = seen[-1]
        assert body[:2] == b"\x1f\x8b" and gzip.decompress(body) == nii.read_bytes()  # the CT, gzip-compressed
        assert len(body) < 0.8 * nii.stat().st_size
        assert "Transfer-Encoding" not in headers and int(headers["Content-Length"]) == len(body)
        assert headers["Accept"].startswith("application/gzip")
        assert json.loads(headers["X-MedVol-Request"])["query"] == "the liver"
        assert headers["X-MedVol-Volume"] == hashlib.sha256(body).hexdigest()  # the affinity key: the bytes sent
        assert Path(res["mask_path"]).read_bytes() == mask and res["mask_voxels"] == 7
        w.call("segment", 30, volume=str(nii), query="again")
        assert seen[-1][1] == body  # the compressed copy is reused while the file is unchanged
        assert len(list(w.tmp_dir.glob("upload-*"))) == 1
        res = w.call("segment", 30, volume=str(ct_sm_path), query="gz")
        assert seen[-1][1] == ct_sm_path.read_bytes()  # a .nii.gz goes as it is
        assert seen[-1][0]["X-MedVol-Volume"] == hashlib.sha256(ct_sm_path.read_bytes()).hexdigest()
        assert "X-MedVol-Volume" not in seen[0][0]  # the hello is about no volume
    finally:
        srv.shutdown()
        w.stop()
    assert not w.tmp_dir.exists()


def test_sending_another_volume_never_removes_the_one_sent_before(tmp_path, ct_sm_path):
    """Only the compressed copy of a ``.nii`` is this client's to remove: a ``.nii.gz`` is sent as
    it is, and sending another volume after it must leave that file alone."""
    first, second = tmp_path / "a.nii.gz", tmp_path / "b.nii.gz"
    first.write_bytes(ct_sm_path.read_bytes())
    second.write_bytes(ct_sm_path.read_bytes() + b"")
    nii = tmp_path / "c.nii"
    nib.save(nib.load(str(ct_sm_path)), str(nii))
    w = RemoteWorker("http://127.0.0.1:9")
    try:
        assert w._gzipped(str(first))[0] == first
        assert w._gzipped(str(second))[0] == second and first.is_file()
        copy = w._gzipped(str(nii))[0]
        assert copy.parent == w.tmp_dir and second.is_file()
        w._gzipped(str(first))
        assert not copy.exists() and first.is_file() and second.is_file() and nii.is_file()
    finally:
        w.stop()


def test_status_polls_and_the_cancel_of_a_job_carry_its_volume_key(ct_sm_path):
    """Behind a load balancer that routes on ``X-MedVol-Volume``, a job's status polls and its
    cancel must reach the worker that runs it: each carries the key of the volume the job sent;
    a request about no volume carries none."""
    import hashlib
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen, cancelled = [], threading.Event()
    key = hashlib.sha256(ct_sm_path.read_bytes()).hexdigest()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):  # noqa: N802
            seen.append(("status", self.headers.get("X-MedVol-Volume")))
            send_json(self, {"id": None, "ok": True, "result": {"current": {"id": "none", "stage": "ground"}}})

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            req = json.loads(self.headers.get("X-MedVol-Request") or body)
            seen.append((req["op"], self.headers.get("X-MedVol-Volume")))
            if req["op"] == "cancel":
                cancelled.set()
            elif req["op"] == "segment":
                cancelled.wait(20)
                send_json(self, {"id": req["id"], "ok": False, "error": {"code": "cancelled", "message": "cancelled"}})
                return
            send_json(self, {"id": req["id"], "ok": True, "result": {}})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    w = RemoteWorker(f"http://127.0.0.1:{srv.server_address[1]}", status_interval_s=0.05)
    try:
        job = w.submit("segment", volume=str(ct_sm_path), query="the liver")
        deadline = time.monotonic() + 20
        while not any(op == "status" for op, _ in seen) and time.monotonic() < deadline:
            time.sleep(0.02)
        w.cancel(job)
        w.wait(job, 20)
        assert cancelled.is_set() and job.state in ("failed", "cancelled")
        ops = {op: k for op, k in seen}
        assert ops["segment"] == key and ops["status"] == key and ops["cancel"] == key
        # the client's own session, then the one for this volume, from the worker that will hold it
        assert [k for op, k in seen if op == "hello"] == [None, key]
    finally:
        srv.shutdown()
        w.stop()


@pytest.mark.slow  # a front and two worker processes over HTTP, a segment and a correction round
def test_remote_worker_through_a_front_of_two_workers(ct_sm_path, tmp_path):
    """``medvol serve --http --devices cpu,cpu``: the Slicer client, unchanged, segments and sends a
    correction round, which reaches the worker holding the volume (no slice encoded again); its
    progress comes from status polls that reach that worker too."""
    proc = subprocess.Popen([sys.executable, "-m", "medvolcore.cli_serve", "--http", "--port", "0", "--threads", "1",
                             "--devices", "cpu,cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None and time.monotonic() < deadline:
            m = re.search(r"ready \(protocol 1\) on http://127\.0\.0\.1:(\d+)", proc.stderr.readline())
            port = int(m.group(1)) if m else None
        assert port, "the front did not say where it listens"
        s = Session()
        opts = Options(preset="tiny", device="cpu", worker="remote", remote_url=f"http://127.0.0.1:{port}")
        events = []
        s.progress.connect(lambda job: events.append((job.op, job.stage)))
        job = s.wait(s.segment(str(ct_sm_path), "the liver", opts), TIMEOUT)
        assert job.state == "done", job.error
        assert job.result["slices_encoded"] > 0
        assert any(op == "segment" and st in ("ground", "propagate") for op, st in events)
        ct = nib.load(str(ct_sm_path))
        geo = VolumeGeometry(ct.affine, ct.shape)
        rois, k = rois_from_anchor(geo, job.result["anchor"])
        r = rois[0]
        rois[0] = RoiBox(r.center + r.axes[:, 0] * 3.0, r.size, r.axes)
        anchor, _ = anchor_from_rois(geo, rois, k, query="the liver")
        prop = s.wait(s.propagate(str(ct_sm_path), anchor, opts), TIMEOUT)
        assert prop.state == "done", prop.error
        assert prop.result["slices_encoded"] == 0  # the worker that holds the volume answered
        s.shutdown()
    finally:
        proc.terminate()
        proc.wait(60)
