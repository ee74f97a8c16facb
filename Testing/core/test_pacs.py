"""A DICOMweb server as source and destination (medvolcore.pacs, ``medvol segment --volume
dicomweb://… --out dicomweb://…``), against a real Orthanc on loopback (Testing/reference/orthanc.py),
and against small servers that misbehave on purpose (a refused connection, HTTP errors, a body
cut short): each a single error line, nothing stored."""

from __future__ import annotations

import io
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from medvolcore import pacs
from medvolcore.errors import InputError, LimitError

from reference.orthanc import Orthanc, free_port, why_not_available
from core.test_cli import run_cli

sitk = pytest.importorskip("SimpleITK")
pytest.importorskip("dicomweb_client")
hd = pytest.importorskip("highdicom")

UID = "1.2.826.0.1.3680043.2.1125.9146"
STUDY, SERIES = f"{UID}.1", f"{UID}.2"
needs_orthanc = pytest.mark.skipif(why_not_available() is not None, reason=str(why_not_available()))


# ---- URLs and tokens (no server) ---------------------------------------------------------

def test_series_and_study_urls():
    u = pacs.parse_url("dicomweb://pacs.example:8042/dicom-web/studies/1.2.3/series/1.2.3.4")
    assert (u.base, u.study, u.series) == ("http://pacs.example:8042/dicom-web", "1.2.3", "1.2.3.4")
    u = pacs.parse_url("https://h/a/b/studies/1.2/series/3", "--volume")
    assert (u.base, u.series) == ("https://h/a/b", "3")
    u = pacs.parse_url("dicomweb://h/studies/1.2", "--out", series=False)
    assert (u.base, u.study, u.series) == ("http://h", "1.2", None)
    assert pacs.is_dicomweb("dicomweb://h/x") and not pacs.is_dicomweb("studies/1.2") and not pacs.is_dicomweb("ct.nii")


@pytest.mark.parametrize("url, match", [
    ("dicomweb://h/dicom-web/studies/1.2", "ending in …/studies/STUDY/series/SERIES"),
    ("dicomweb://h/studies/1.2/series/..", "not a DICOM UID"),
    ("dicomweb://h/studies/1.2/series/1.3%2F..", "not a DICOM UID"),
    ("dicomweb://u:pw@h/studies/1.2/series/3", "no credentials in the URL"),
    ("dicomweb://h:99999/studies/1.2/series/3", "port"),
    ("ftp://h/studies/1.2/series/3", "not a DICOMweb URL"),
    ("dicomweb://h/studies/1.2/series/3?x=1", "no query"),
])
def test_bad_urls_are_refused(url, match):
    with pytest.raises(InputError, match=re.escape(match)):
        pacs.parse_url(url)


def test_token_files(tmp_path):
    f = tmp_path / "token"
    f.write_text("abc.def\n")
    assert pacs.read_token(f) == "Bearer abc.def"
    f.write_text("Basic dXNlcjpwdw==")
    assert pacs.read_token(f) == "Basic dXNlcjpwdw=="
    f.write_text("two\nlines")
    with pytest.raises(InputError, match="one line"):
        pacs.read_token(f)


def test_a_token_is_never_sent_in_plain_http_off_loopback(tmp_path):
    url = pacs.parse_url("dicomweb://pacs.example/dicom-web/studies/1.2/series/3")
    with pytest.raises(InputError, match="over HTTPS only"):
        pacs.retrieve_series(url, tmp_path / "s", token="Bearer x")
    assert not any((tmp_path / "s").iterdir())


# ---- a real Orthanc ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def source_series(tmp_path_factory, small_ct, write_dicom_series):
    ct, _ = small_ct
    img = sitk.Cast(sitk.ReadImage(str(ct)), sitk.sitkInt16)
    folder = tmp_path_factory.mktemp("pacs") / "series"
    write_dicom_series(sitk, img, folder, uid=UID)
    return folder


@pytest.fixture(scope="module")
def orthanc(tmp_path_factory, source_series):
    why = why_not_available()
    if why:
        pytest.skip(why)
    server = Orthanc(tmp_path_factory.mktemp("orthanc"))
    try:
        assert server.upload(source_series) == 8
        yield server
    finally:
        server.stop()


def _series_url(server) -> str:
    return f"{server.dicomweb}/studies/{STUDY}/series/{SERIES}"


def _client(server):
    from dicomweb_client.api import DICOMwebClient

    return DICOMwebClient(f"{server.url}/dicom-web")


def _segs(server) -> list:
    return _client(server).search_for_series(STUDY, search_filters={"Modality": "SEG"})


def _leftover_downloads() -> list:
    import tempfile

    return sorted(p.name for p in Path(tempfile.gettempdir()).glob("medvol-dicomweb-*"))


@needs_orthanc
def test_retrieve_segment_store_round_trip(capsys, orthanc, source_series, tmp_path):
    import pydicom

    before = _leftover_downloads()
    code, stdout, err = run_cli(capsys, "segment", "--volume", _series_url(orthanc), "--query", "the liver",
                                "--out", f"{orthanc.dicomweb}/studies/{STUDY}", "--out", tmp_path / "m.nii.gz",
                                "--preset", "tiny", "--device", "cpu", "--json", "--no-progress")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["retrieved"]["instances"] == 8 and res["retrieved"]["bytes"] > 0.9 * sum(f.stat().st_size for f in source_series.iterdir())
    assert _leftover_downloads() == before  # the downloads and the local SEG are gone

    found = _segs(orthanc)
    assert len(found) == 1
    seg_series = found[0]["0020000E"]["Value"][0]
    assert seg_series == res["stored"]["series_instance_uid"]
    client = _client(orthanc)
    [inst] = client.search_for_instances(STUDY, seg_series)
    ds = client.retrieve_instance(STUDY, seg_series, inst["00080018"]["Value"][0])
    seg = hd.seg.Segmentation.from_dataset(ds)
    sources = [pydicom.dcmread(str(f)) for f in source_series.iterdir()]
    assert seg.StudyInstanceUID == STUDY and seg.FrameOfReferenceUID == sources[0].FrameOfReferenceUID
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == SERIES
    referenced = {r.ReferencedSOPInstanceUID for s in seg.ReferencedSeriesSequence for r in s.ReferencedInstanceSequence}
    assert referenced == {s.SOPInstanceUID for s in sources}
    # the frames stored are the mask written locally, slice by slice
    import nibabel as nib
    import numpy as np

    mask = np.asarray(nib.load(str(tmp_path / "m.nii.gz")).dataobj) > 0
    uids = [s.SOPInstanceUID for s in sorted(sources, key=lambda s: float(s.ImagePositionPatient[2]))]
    got = seg.get_pixels_by_source_instance(source_sop_instance_uids=uids, segment_numbers=[1])[..., 0]
    assert int(got.sum()) == int(mask.sum()) == res["mask_voxels"] > 0
    assert seg.SegmentSequence[0].SegmentLabel == "the liver"
    orthanc.rest("DELETE", f"/series/{_orthanc_id(orthanc, seg_series)}")
    assert _segs(orthanc) == []


def _orthanc_id(server, series_uid) -> str:
    [oid] = server.rest("POST", "/tools/lookup", series_uid.encode())
    return oid["ID"]


@needs_orthanc
def test_keep_downloads_resumes_a_retrieval(orthanc, tmp_path):
    url = pacs.parse_url(_series_url(orthanc))
    first = pacs.retrieve_series(url, tmp_path / "s")
    assert (first["instances"], first["fetched"]) == (8, 8)
    victim = sorted((tmp_path / "s").iterdir())[3]
    victim.unlink()
    again = pacs.retrieve_series(url, tmp_path / "s")
    assert (again["instances"], again["fetched"]) == (8, 1) and victim.is_file()
    assert sorted(p.name for p in (tmp_path / "s").iterdir() if p.name.startswith("."))  == []
    assert oct(os.stat(tmp_path / "s").st_mode & 0o777) == "0o700"


@needs_orthanc
def test_an_instance_over_the_limit_is_refused(orthanc, tmp_path):
    url = pacs.parse_url(_series_url(orthanc))
    with pytest.raises(LimitError, match="over the limit of 0.01 MB"):
        pacs.retrieve_series(url, tmp_path / "s", limits=pacs.Limits(max_instance_bytes=int(0.01 * 2**20)))
    assert list((tmp_path / "s").iterdir()) == []
    with pytest.raises(LimitError, match="over 3 instances"):
        pacs.retrieve_series(url, tmp_path / "t", limits=pacs.Limits(max_instances=3))


@needs_orthanc
def test_a_seg_is_stored_only_into_its_own_study(capsys, orthanc, tmp_path):
    code, _, err = run_cli(capsys, "segment", "--volume", _series_url(orthanc), "--query", "liver",
                           "--out", f"{orthanc.dicomweb}/studies/1.2.3", "--preset", "tiny", "--device", "cpu",
                           "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "stored into its source's study" in err
    assert _segs(orthanc) == []


@needs_orthanc
def test_orthanc_refusing_credentials_is_one_line(capsys, tmp_path, source_series):
    server = Orthanc(tmp_path / "o", user=("medvol", "s3cret"))
    try:
        server.upload(source_series)
        url = f"{server.dicomweb}/studies/{STUDY}/series/{SERIES}"
        code, _, err = run_cli(capsys, "segment", "--volume", url, "--query", "liver", "--out", tmp_path / "m.nii.gz",
                               "--preset", "tiny", "--device", "cpu", "--no-progress")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "refused the credentials" in err and "HTTP 401" in err
        token = tmp_path / "token"
        token.write_text("Basic " + __import__("base64").b64encode(b"medvol:s3cret").decode())
        got = pacs.retrieve_series(pacs.parse_url(url), tmp_path / "s", token=pacs.read_token(token))
        assert got["instances"] == 8
    finally:
        server.stop()
    assert not (tmp_path / "m.nii.gz").exists()


# ---- servers that misbehave --------------------------------------------------------------

class _Bad(BaseHTTPRequestHandler):
    mode = "500"

    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        if self.mode == "slow":
            time.sleep(5)
        if self.mode in ("401", "404", "500"):
            self.send_response(int(self.mode))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if "/instances" in self.path and "/instances/" not in self.path:  # QIDO: one instance
            uid = __import__("pydicom").dcmread(io.BytesIO(self.instance)).SOPInstanceUID if self.mode == "cut" \
                else f"{SERIES}.1"
            body = json.dumps([{"00080018": {"vr": "UI", "Value": [uid]}}]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/dicom+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.mode == "cut":  # a whole HTTP body whose one part is a DICOM file cut inside its pixel data
            part = self.instance[: len(self.instance) // 2]
            body = b"--b0\r\nContent-Type: application/dicom\r\n\r\n" + part + b"\r\n--b0--\r\n"
            self.send_response(200)
            self.send_header("Content-Type", 'multipart/related; type="application/dicom"; boundary=b0')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        # WADO: a multipart body that declares 100000 bytes and stops after 300
        self.send_response(200)
        self.send_header("Content-Type", 'multipart/related; type="application/dicom"; boundary=b0')
        self.send_header("Content-Length", "100000")
        self.end_headers()
        self.wfile.write(b"--b0\r\nContent-Type: application/dicom\r\n\r\n" + b"\0" * 128 + b"DICM" + b"\1" * 120)
        self.wfile.flush()


@pytest.fixture
def bad_server(source_series):
    servers = []
    instance = sorted(source_series.iterdir())[0].read_bytes()

    def start(mode):
        handler = type("H", (_Bad,), {"mode": mode, "instance": instance})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"dicomweb://127.0.0.1:{srv.server_address[1]}/dicom-web/studies/{STUDY}/series/{SERIES}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("mode, says", [
    ("down", "cannot reach the DICOMweb server"),
    ("401", "refused the credentials"),
    ("404", "has no such resource"),
    ("500", "failed on its side"),
    ("truncated", "truncated answer"),
    ("slow", "did not answer in time"),
    ("cut", "truncated"),
])
def test_a_bad_server_is_one_line_and_nothing_is_kept(capsys, tmp_path, bad_server, mode, says):
    url = (f"dicomweb://127.0.0.1:{free_port()}/dicom-web/studies/{STUDY}/series/{SERIES}" if mode == "down"
           else bad_server(mode))
    before = _leftover_downloads()
    code, stdout, err = run_cli(capsys, "segment", "--volume", url, "--query", "liver", "--out", tmp_path / "m.dcm",
                                "--preset", "tiny", "--device", "cpu", "--no-progress", "--dicomweb-timeout", "1" if mode == "slow" else "20")
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert says in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == [] and _leftover_downloads() == before


# ---- the worker: series only on servers the operator allowed ------------------------------

def _call(worker, req, transport=None):
    done, got = threading.Event(), []
    worker.handle(req, reply=lambda r: (got.append(r), done.set()) if "event" not in r else None, transport=transport)
    assert done.wait(300)
    return got[0]


def _servers_file(tmp_path, url) -> Path:
    f = tmp_path / "pacs.json"
    f.write_text(json.dumps({"servers": {"orthanc": {"url": url, "max_instances": 100}}}))
    return f


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_the_worker_fetches_no_url_the_operator_did_not_allow(tmp_path, transport):
    import socket

    from medvolcore.serve import Worker

    listener = socket.socket()  # a host the client names: it must never be contacted
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    allowed = pacs.load_servers(_servers_file(tmp_path, f"http://127.0.0.1:{free_port()}/dicom-web"), ["orthanc"])
    w = Worker(transport=transport, device="cpu", pacs_servers=allowed)
    none = Worker(transport=transport, device="cpu")
    try:
        for worker, url in ((w, f"dicomweb://127.0.0.1:{port}/dicom-web/studies/{STUDY}/series/{SERIES}"),
                            (w, f"http://127.0.0.1:{port}/other/studies/{STUDY}/series/{SERIES}"),
                            (none, f"dicomweb://127.0.0.1:{port}/dicom-web/studies/{STUDY}/series/{SERIES}")):
            r = _call(worker, {"op": "segment", "id": 1, "volume": url, "query": "liver", "preset": "tiny"}, transport)
            assert r["ok"] is False and r["error"]["code"] == "forbidden", r
            assert "--allow-pacs" in r["error"]["message"]
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
        w.close(5)
        none.close(5)


@needs_orthanc
def test_the_worker_segments_a_series_on_an_allowed_orthanc(orthanc, tmp_path):
    import nibabel as nib

    from medvolcore.serve import Worker

    servers = pacs.load_servers(_servers_file(tmp_path, f"{orthanc.url}/dicom-web/"), ["orthanc"])
    w = Worker(transport="stdio", device="cpu", pacs_servers=servers)
    try:
        r = _call(w, {"op": "segment", "id": 1, "volume": _series_url(orthanc), "query": "the liver",
                      "preset": "tiny", "out": str(tmp_path / "m.nii.gz")})
        assert r["ok"] is True, r
        assert r["result"]["retrieved"]["instances"] == 8 and r["result"]["retrieved"]["pacs"] == "orthanc"
        assert nib.load(str(tmp_path / "m.nii.gz")).shape[2] == 8
        assert not list(Path(w.tmp_dir).glob("dicomweb-*"))  # the retrieved series is gone
    finally:
        w.close(5)


def test_serve_needs_both_allow_pacs_and_its_config(capsys, tmp_path):
    code, _, err = run_cli(capsys, "serve", "--stdio", "--allow-pacs", "orthanc")
    assert code == 2 and "--pacs-config" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "serve", "--stdio", "--allow-pacs", "elsewhere",
                           "--pacs-config", _servers_file(tmp_path, "http://127.0.0.1:1/dicom-web"))
    assert code == 2 and "--allow-pacs elsewhere: no server of that name" in err


@needs_orthanc
def test_keep_downloads_keeps_the_series_for_the_next_run(capsys, orthanc, tmp_path):
    keep = tmp_path / "downloads"
    args = ["segment", "--volume", _series_url(orthanc), "--query", "liver", "--out", tmp_path / "m.nii.gz",
            "--preset", "tiny", "--device", "cpu", "--json", "--no-progress", "--keep-downloads", keep]
    code, stdout, err = run_cli(capsys, *args)
    assert code == 0, err
    res = json.loads(stdout)
    assert res["downloads"] == str(keep / SERIES) and len(list((keep / SERIES).glob("*.dcm"))) == 8
    assert res["retrieved"]["fetched"] == 8
    code, stdout, err = run_cli(capsys, *args, "--overwrite")
    assert code == 0, err
    assert json.loads(stdout)["retrieved"]["fetched"] == 0  # nothing fetched again
