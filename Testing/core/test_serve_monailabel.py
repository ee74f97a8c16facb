"""MONAI Label's REST contract on ``medvol serve --http --monailabel NAME`` (medvolcore.serve.monailabel),
spoken by MONAI Label's own Python client (``monailabel.client``, from the wheel installed without its
dependencies), against a real Orthanc holding the sample series: ``info()``, ``infer()`` returning a
label on the series' grid, refusals as MONAI Label's clients show them, the viewer's DICOMweb proxy
and its static files."""

from __future__ import annotations

import gzip
import json
import shutil
import urllib.error
import urllib.request
import warnings

import nibabel as nib
import numpy as np
import pytest

from medvolcore import RESEARCH_USE_NOTICE
from medvolcore.volume import load_volume

from core.test_cli import run_cli
from core.test_pacs import SERIES, STUDY, orthanc, source_series  # noqa: F401 - the Orthanc fixtures
from core.worker_clients import HttpServer

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # the client imports cgi
    client_module = pytest.importorskip("monailabel.client.client")
MONAILabelClient, MONAILabelClientException = client_module.MONAILabelClient, client_module.MONAILabelClientException


def _servers(tmp_path, url, **limits):
    f = tmp_path / "servers.json"
    f.write_text(json.dumps({"servers": {"orthanc": dict(url=url, **limits)}}))
    return str(f)


@pytest.fixture(scope="module")
def worker(orthanc, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("ml")
    s = HttpServer("--preset", "tiny", "--device", "cpu", "--threads", "1", "--pacs-config",
                   _servers(d, f"{orthanc.url}/dicom-web"), "--allow-pacs", "orthanc", "--monailabel", "orthanc")
    yield s
    s.stop()


def _get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def _post(url, fields: dict, files: dict = None):
    boundary = "b0undary"
    body = b""
    for k, v in fields.items():
        body += f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
    for k, v in (files or {}).items():
        body += (f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="x.bin"\r\n\r\n'.encode()
                 + v + b"\r\n")
    body += f"--{boundary}--\r\n".encode()
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def test_info_names_the_model_its_labels_config_and_the_notice(worker):
    info = MONAILabelClient(worker.url).info()
    assert list(info["models"]) == ["tiny"]  # named after the loaded preset
    model = info["models"]["tiny"]
    assert model["type"] == "segmentation" and model["dimension"] == 3  # the plugin's Auto-Segmentation tab
    assert model["labels"]["target"] == 1 and model["labels"]["liver"] > 1
    assert sorted(model["labels"].values()) == list(range(1, len(model["labels"]) + 1))
    assert set(model["config"]) == {"query", "consensus"}
    assert RESEARCH_USE_NOTICE in model["description"] and info["description"] == RESEARCH_USE_NOTICE
    identity = info["medvol"]["identity"]  # the preset's honest name: an untrained smoke model here
    assert identity["label"] in info["name"] and identity["label"] in model["description"]
    assert info["datastore"]["read_only"] is True


@pytest.mark.slow
def test_infer_answers_a_label_on_the_series_grid(worker, source_series, tmp_path):  # noqa: F811
    client = MONAILabelClient(worker.url, tmpdir=str(tmp_path))
    label_file, params = client.infer("tiny", SERIES, {"query": "liver"})
    series = load_volume(source_series)
    label = nib.load(label_file)
    assert label.shape == series.shape and np.allclose(label.affine, series.affine, atol=1e-4)
    value = client.info()["models"]["tiny"]["labels"]["liver"]
    assert set(np.unique(np.asarray(label.dataobj))) <= {0, value}
    assert params["query"] == "liver" and params["label"] == "liver" and params["label_value"] == value
    assert params["research_use"] == RESEARCH_USE_NOTICE and "anchor" in params and "reasoning" in params
    assert params["absent"] == (params["anchor"] or {}).get("absent", params["absent"])
    assert (np.asarray(label.dataobj) > 0).sum() == params["mask_voxels"]


@pytest.mark.slow
def test_the_viewer_gets_a_raw_nrrd_in_the_series_index_order(worker, source_series):  # noqa: F811
    """What the OHIF plugin asks (output=image, .nrrd): voxels in the series' own index order."""
    import SimpleITK as sitk

    status, body, headers = _post(f"{worker.url}/infer/tiny?image={SERIES}&output=image",
                                  {"params": json.dumps({"query": "the organ that secretes bile",
                                                         "result_extension": ".nrrd", "result_dtype": "uint8",
                                                         "result_compress": False, "restore_label_idx": False})})
    assert status == 200, body
    head, _, _ = body.partition(b"\n\n")
    assert b"NRRD" in head[:8]
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".nrrd") as t:
        t.write(body)
        t.flush()
        img = sitk.ReadImage(t.name)
    reader = sitk.ImageSeriesReader()  # the series as GDCM sorts it: what MONAI Label and OHIF index
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(source_series)))
    ref = reader.Execute()
    assert img.GetSize() == ref.GetSize() and np.allclose(img.GetOrigin(), ref.GetOrigin(), atol=1e-3)
    assert np.allclose(img.GetDirection(), ref.GetDirection(), atol=1e-6)  # the same index order, voxel by voxel
    assert np.allclose(img.GetSpacing(), ref.GetSpacing(), atol=1e-4)
    assert set(np.unique(sitk.GetArrayFromImage(img))) <= {0, 1}  # a query naming no structure: 'target'
    result = json.loads(urllib.request.unquote(headers["X-MedVol-Result"]))
    assert result["research_use"] == RESEARCH_USE_NOTICE and result["label"] == "target"


@pytest.mark.slow
def test_output_dicom_seg_answers_a_valid_seg_equal_to_the_label(worker, source_series, tmp_path):  # noqa: F811
    """output=dicom_seg: the label file is a DICOM-SEG of the retrieved series (read from the worker's
    private copy, removed before the SEG is written), valid for dciodvfy, its frames equal to the label
    the same query gives as NIfTI (the second call served from the volume cache)."""
    from core.test_dicom_generated import dciodvfy_errors, seg_equals_mask

    params = {"params": json.dumps({"query": "the organ that secretes bile"})}
    status, body, headers = _post(f"{worker.url}/infer/tiny?image={SERIES}&output=dicom_seg", params)
    assert status == 200, body
    assert headers["Content-Type"] == "application/dicom" and body[128:132] == b"DICM"
    (tmp_path / "label.dcm").write_bytes(body)
    status, nii, _ = _post(f"{worker.url}/infer/tiny?image={SERIES}&output=image", params)
    assert status == 200
    (tmp_path / "label.nii.gz").write_bytes(nii)
    seg_equals_mask(tmp_path / "label.dcm", source_series, tmp_path / "label.nii.gz")
    import pydicom

    seg, ct = pydicom.dcmread(str(tmp_path / "label.dcm")), pydicom.dcmread(str(next(source_series.iterdir())))
    assert (seg.StudyInstanceUID, seg.PatientID) == (ct.StudyInstanceUID, ct.PatientID)
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == ct.SeriesInstanceUID
    if shutil.which("dciodvfy") is None:
        pytest.skip("dciodvfy (Debian's dicom3tools) is not installed: the SEG was not validated")
    assert dciodvfy_errors(tmp_path / "label.dcm") == []


@pytest.mark.parametrize("image, params, status, says", [
    ("dicomweb://127.0.0.1:9/dicom-web/studies/1.2/series/1.3", {"query": "liver"}, 403,
     "does not read from"),
    ("1.2.3.999", {"query": "liver"}, 404, "is not on the DICOMweb server orthanc"),
    (SERIES, {"query": "liver\x07 and more"}, 400, "control"),
    (SERIES, {}, 422, "no query"),
    (SERIES, {"query": "liver", "foreground": [[1, 2, 3]]}, 422, "not supported"),
    (SERIES, {"query": "liver", "label": "spleen"}, 422, "not both"),
    ("1.2.3/../4", {"query": "liver"}, 400, "Series Instance UID"),
])
def test_refusals_come_back_as_monailabel_clients_show_them(worker, image, params, status, says):
    with pytest.raises(MONAILabelClientException) as e:
        MONAILabelClient(worker.url).infer("tiny", image, params)
    assert f"Status: {status};" in e.value.msg and says in json.loads(e.value.msg.split("Response: ", 1)[1])["detail"]


def test_other_routes_answer_a_clear_refusal(worker):
    status, body, _ = _post(f"{worker.url}/infer/deepedit?image={SERIES}", {"params": "{}"})
    assert status == 404 and "GET /info/" in json.loads(body)["detail"]
    status, body, _ = _post(f"{worker.url}/infer/tiny?image={SERIES}", {"params": "{}"}, {"label": b"\0" * 10})
    assert status == 422 and "file part" in json.loads(body)["detail"]
    status, body, _ = _get(f"{worker.url}/train/")
    assert status == 404 and "not supported" in json.loads(body)["detail"]
    status, body, _ = _post(f"{worker.url}/datastore/label?image={SERIES}", {"params": "{}"})
    assert status == 405 and "read-only" in json.loads(body)["detail"]
    status, body, _ = _get(f"{worker.url}/datastore/")
    assert status == 200 and json.loads(body)["total"] == 0


def test_the_dicomweb_proxy_reaches_only_the_allowed_server_read_only(worker, orthanc):  # noqa: F811
    status, body, _ = _get(f"{worker.url}/proxy/dicom/qido/studies?StudyInstanceUID={STUDY}",
                           {"Accept": "application/dicom+json"})
    assert status == 200 and json.loads(body)[0]["0020000D"]["Value"] == [STUDY]
    status, body, _ = _get(f"{worker.url}/proxy/dicom/wado/studies/{STUDY}/series/{SERIES}/metadata")
    assert status == 200 and f"127.0.0.1:{orthanc.port}".encode() not in body  # its URLs are the proxy's
    for path in ("qido/system", "qido/studies/../../system", "qido/studies/%2e%2e/tools", "other/studies",
                 "wado/instances"):
        status, _, _ = _get(f"{worker.url}/proxy/dicom/{path}")
        assert status == 404, path
    status, _, _ = _post(f"{worker.url}/proxy/dicom/qido/studies", {"a": "b"})
    assert status == 405


def test_the_proxy_query_at_and_past_its_bound(worker):
    from medvolcore.serve.limits import limit

    bound = int(limit("viewer_proxy_query").default)
    head = f"StudyInstanceUID={STUDY}&x="
    at = head + "a" * (bound - len(head))
    status, body, _ = _get(f"{worker.url}/proxy/dicom/qido/studies?{at}", {"Accept": "application/dicom+json"})
    assert status == 200 and json.loads(body)[0]["0020000D"]["Value"] == [STUDY]
    status, body, _ = _get(f"{worker.url}/proxy/dicom/qido/studies?{at}a", {"Accept": "application/dicom+json"})
    assert status == 414 and "too long" in json.loads(body)["detail"]


def test_the_viewer_is_served_with_its_dicomweb_through_the_worker(worker):
    status, body, headers = _get(f"{worker.url}/ohif/")
    assert status == 200 and b"/ohif/medvol-panel.js" in body and headers["Content-Type"].startswith("text/html")
    status, body, _ = _get(f"{worker.url}/ohif/app-config.js")
    assert b"/proxy/dicom/qido" in body and b"dicomUploadEnabled\": false" in body
    status, body, _ = _get(f"{worker.url}/ohif/viewer?StudyInstanceUIDs={STUDY}")
    assert status == 200 and b"medvol-panel.js" in body  # a route of the single-page app
    for path in ("/ohif/../../../etc/passwd", "/ohif/%2e%2e/%2e%2e/etc/passwd", "/ohif/nothing.js"):
        status, body, _ = _get(worker.url + path)
        assert status == 404 and b"root:" not in body, path
    status, body, _ = _get(f"{worker.url}/ohif/medvol-panel.js")
    assert status == 200 and b"X-MedVol-Result" in body


def test_a_series_over_the_servers_limit_and_a_missing_token(orthanc, tmp_path):  # noqa: F811
    token = "t0ken-of-sixteen-chars"
    (tmp_path / "token").write_text(token)
    (tmp_path / "token").chmod(0o600)
    s = HttpServer("--device", "cpu", "--threads", "1", "--token-file", str(tmp_path / "token"), "--pacs-config",
                   _servers(tmp_path, f"{orthanc.url}/dicom-web", max_instances=4), "--allow-pacs", "orthanc",
                   "--monailabel", "orthanc")
    try:
        client = MONAILabelClient(s.url)
        with pytest.raises(MONAILabelClientException, match="Status: 401"):
            client.info()
        client.update_auth({"token_type": "Bearer", "access_token": token})
        name = next(iter(client.info()["models"]))
        with pytest.raises(MONAILabelClientException) as e:
            client.infer(name, SERIES, {"query": "liver"})
        assert "Status: 413;" in e.value.msg and "over 4 instances" in e.value.msg
    finally:
        s.stop()


def test_serve_checks_the_monailabel_options(capsys, tmp_path):
    servers = _servers(tmp_path, "http://127.0.0.1:1/dicom-web")
    code, _, err = run_cli(capsys, "serve", "--http", "--port", "0", "--pacs-config", servers, "--allow-pacs",
                           "orthanc", "--monailabel", "other")
    assert code == 2 and "--monailabel other: name a server of --allow-pacs" in err
    code, _, err = run_cli(capsys, "serve", "--stdio", "--monailabel", "orthanc")
    assert code == 2 and "apply to --http only" in err
    code, _, err = run_cli(capsys, "serve", "--http", "--port", "0", "--pacs-config", servers, "--allow-pacs",
                           "orthanc", "--monailabel", "orthanc", "--ohif-dir", str(tmp_path))
    assert code == 2 and "no index.html" in err
