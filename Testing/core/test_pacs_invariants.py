"""DICOMweb as docs/pacs.md promises, against a real Orthanc on loopback and small servers that
misbehave on purpose: a series of two patients under one series UID is refused before any model
loads; a server answering with a redirect is refused (the worker or the command line is never sent
elsewhere); a token goes to the one server it names; a search's answer is bounded by bytes as it
streams, before it is parsed; an instance of another study is refused; a DICOM-SEG of two queries
is stored as BINARY by default, passes dciodvfy and reads back."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from medvolcore import pacs
from medvolcore.errors import LimitError

from core.dicomgen import ROOT, SYNTAXES, write_series
from core.test_cli import run_cli
from core.test_dicom_generated import dciodvfy_errors
from core.test_pacs import STUDY, SERIES, _series_url, _segs, needs_orthanc, orthanc, source_series  # noqa: F401
from reference.orthanc import Orthanc

hd = pytest.importorskip("highdicom")
pytest.importorskip("dicomweb_client")


def _spec(**changes) -> dict:
    spec = {"charset": 0, "type2": {}, "blank": [], "disagree": None, "positions": "even", "rescale": "same",
            "syntax": SYNTAXES[0]}
    spec.update(changes)
    return spec


@needs_orthanc
def test_two_patients_under_one_series_uid_are_refused(capsys, tmp_path):
    write_series(_spec(disagree="PatientID"), tmp_path / "s")
    server = Orthanc(tmp_path / "o")
    try:
        assert server.upload(tmp_path / "s") == 5
        url = f"{server.dicomweb}/studies/{ROOT}.1/series/{ROOT}.2"
        code, out, err = run_cli(capsys, "segment", "--volume", url, "--query", "the liver", "--out",
                                 tmp_path / "m.nii.gz", "--preset", "tiny", "--device", "cpu", "--no-progress")
    finally:
        server.stop()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "not one patient's: PatientID differs between" in err
    assert not (tmp_path / "m.nii.gz").exists()


class _Redirect(BaseHTTPRequestHandler):
    target = ""
    seen: list = []

    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        self.seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(302)
        self.send_header("Location", self.target + self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()


def _serve(handler):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@needs_orthanc
def test_a_redirecting_server_is_refused(capsys, orthanc, tmp_path):  # noqa: F811
    """The redirect points at a real Orthanc holding the series: followed, the run would succeed."""
    handler = type("R", (_Redirect,), {"target": orthanc.url, "seen": []})
    srv = _serve(handler)
    try:
        url = f"dicomweb://127.0.0.1:{srv.server_address[1]}/dicom-web/studies/{STUDY}/series/{SERIES}"
        code, out, err = run_cli(capsys, "segment", "--volume", url, "--query", "liver", "--out", tmp_path / "m.nii.gz",
                                 "--preset", "tiny", "--device", "cpu", "--no-progress")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "answered with a redirect to 127.0.0.1:" in err and "follows no redirect" in err
        assert len(handler.seen) == 1 and not (tmp_path / "m.nii.gz").exists()
        with pytest.raises(pacs.PacsError, match="redirect"):
            pacs.find_series(f"http://127.0.0.1:{srv.server_address[1]}/dicom-web", limit=5)
    finally:
        srv.shutdown()
        srv.server_close()


@needs_orthanc
def test_a_token_is_not_sent_to_a_second_server(capsys, orthanc, tmp_path):  # noqa: F811
    other = Orthanc(tmp_path / "o2")
    token = tmp_path / "token"
    token.write_text("s3cret-token")
    try:
        code, out, err = run_cli(capsys, "segment", "--volume", _series_url(orthanc), "--query", "liver",
                                 "--out", f"{other.dicomweb}/studies/{STUDY}", "--dicomweb-token-file", token,
                                 "--preset", "tiny", "--device", "cpu", "--no-progress")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "--dicomweb-token-file is sent to one server" in err and "s3cret" not in err
        assert other.instances() == []
    finally:
        other.stop()


@needs_orthanc
def test_a_seg_of_two_queries_is_stored_as_binary_and_read_back(capsys, orthanc, tmp_path):  # noqa: F811
    code, out, err = run_cli(capsys, "segment", "--volume", _series_url(orthanc), "--query", "the liver", "--query",
                             "the spleen", "--out", f"{orthanc.dicomweb}/studies/{STUDY}", "--out",
                             tmp_path / "m.nii.gz", "--preset", "tiny", "--device", "cpu", "--json", "--no-progress")
    assert code == 0, err
    res = json.loads(out)
    assert res["outs"] == [str(tmp_path / "m.nii.gz")]  # the local copy of the SEG, deleted at the end, is not said
    from dicomweb_client.api import DICOMwebClient

    client = DICOMwebClient(f"{orthanc.url}/dicom-web")
    seg_series = res["stored"]["series_instance_uid"]
    [inst] = client.search_for_instances(STUDY, seg_series)
    ds = client.retrieve_instance(STUDY, seg_series, inst["00080018"]["Value"][0])
    ds.save_as(str(tmp_path / "stored.dcm"), enforce_file_format=True)
    assert dciodvfy_errors(tmp_path / "stored.dcm") == []
    seg = hd.seg.Segmentation.from_dataset(ds)
    assert seg.SegmentationType == "BINARY"
    assert [d.SegmentLabel for d in seg.SegmentSequence] == ["the liver", "the spleen"]
    import nibabel as nib
    import numpy as np

    labels = np.asarray(nib.load(str(tmp_path / "m.nii.gz")).dataobj)
    uids = [i["00080018"]["Value"][0] for i in client.search_for_instances(STUDY, SERIES)]
    got = seg.get_pixels_by_source_instance(source_sop_instance_uids=uids, segment_numbers=[1, 2])
    assert [int(got[..., k].sum()) for k in range(2)] == [int((labels == v).sum()) for v in (1, 2)]
    oid = orthanc.rest("POST", "/tools/lookup", seg_series.encode())[0]["ID"]
    orthanc.rest("DELETE", f"/series/{oid}")
    assert _segs(orthanc) == []


class _Liar(BaseHTTPRequestHandler):
    """QIDO: a search answer far larger than asked for (chunked: no length to refuse it by), or
    one instance; WADO: that instance, which belongs to another study than the URL's."""

    mode = "big"
    instance = b""

    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        if self.mode == "big":
            self.send_response(200)
            self.send_header("Content-Type", "application/dicom+json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            item = json.dumps({"0020000D": {"vr": "UI", "Value": ["1.2.3"]},
                               "0020000E": {"vr": "UI", "Value": ["1.2.3.4"]}, "00081030": {"vr": "LO",
                                                                                            "Value": ["x" * 60]}})
            chunk = ("[" + ",".join([item] * 20000) + "]").encode()
            try:
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            return
        import pydicom

        if "/instances" in self.path and "/instances/" not in self.path:
            uid = pydicom.dcmread(io.BytesIO(self.instance)).SOPInstanceUID
            body = json.dumps([{"00080018": {"vr": "UI", "Value": [uid]}}]).encode()
            ctype = "application/dicom+json"
        else:
            body = b"--b0\r\nContent-Type: application/dicom\r\n\r\n" + self.instance + b"\r\n--b0--\r\n"
            ctype = 'multipart/related; type="application/dicom"; boundary=b0'
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_search_answer_is_bounded_before_it_is_parsed(capsys, tmp_path):
    srv = _serve(type("L", (_Liar,), {"mode": "big"}))
    try:
        base = f"dicomweb://127.0.0.1:{srv.server_address[1]}/dicom-web"
        with pytest.raises(LimitError, match="cut off before it was parsed"):
            pacs.find_series(base, limit=5)
        code, out, err = run_cli(capsys, "pacs", "find", "--url", base, "--limit", "5", "--query", "liver",
                                 "--out", tmp_path / "m.csv")
        assert code == 2 and len(err.strip().splitlines()) == 1 and "before it was parsed" in err, err
        assert not (tmp_path / "m.csv").exists()
    finally:
        srv.shutdown()
        srv.server_close()


def test_an_instance_of_another_study_is_refused(tmp_path):
    files = write_series(_spec(), tmp_path / "s")
    srv = _serve(type("L", (_Liar,), {"mode": "other", "instance": files[0].read_bytes()}))
    try:
        url = pacs.parse_url(f"dicomweb://127.0.0.1:{srv.server_address[1]}/dicom-web/studies/1.2.999/series/"
                             f"{ROOT}.2")
        with pytest.raises(pacs.PacsError, match="an instance of another study"):
            pacs.retrieve_series(url, tmp_path / "got")
        assert list((tmp_path / "got").iterdir()) == []
    finally:
        srv.shutdown()
        srv.server_close()
