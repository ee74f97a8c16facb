"""``medvol batch`` over series named by DICOMweb URL, and ``medvol pacs find`` writing such a
manifest (QIDO-RS), against a real Orthanc on loopback (Testing/reference/orthanc.py): a run
interrupted after its first case and resumed retrieves only the cases not finished, and ends
with what an uninterrupted run writes."""

from __future__ import annotations

import csv
import io
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

from medvolcore import pacs
from medvolcore.batch import BatchOptions, run_batch

from reference.orthanc import Orthanc, why_not_available
from core.test_cli import run_cli
from core.test_pipeline import tiny  # noqa: F401  (fixture)

sitk = pytest.importorskip("SimpleITK")
pytest.importorskip("dicomweb_client")
pydicom = pytest.importorskip("pydicom")
nib = pytest.importorskip("nibabel")

UID = "1.2.826.0.1.3680043.2.1125.9147"
needs_orthanc = pytest.mark.skipif(why_not_available() is not None, reason=str(why_not_available()))
# three CT studies of January 2024, one CT study of 2023 and one MR series of January 2024
SERIES = {f"{UID}.{n}": (f"{UID}.{n}0", "CT", f"202401{n:02d}") for n in (1, 2, 3)}
SERIES[f"{UID}.7"] = (f"{UID}.70", "CT", "20230101")
SERIES[f"{UID}.8"] = (f"{UID}.80", "MR", "20240105")
WANTED = sorted(s for s, (_st, mod, date) in SERIES.items() if mod == "CT" and date.startswith("2024"))


@pytest.fixture(scope="module")
def orthanc(tmp_path_factory, small_ct, write_dicom_series):
    why = why_not_available()
    if why:
        pytest.skip(why)
    ct, _ = small_ct
    img = sitk.Cast(sitk.ReadImage(str(ct)), sitk.sitkInt16)
    source = tmp_path_factory.mktemp("pacsbatch") / "series"
    write_dicom_series(sitk, img, source, uid=UID)
    server = Orthanc(tmp_path_factory.mktemp("orthanc"))
    try:
        for series, (study, modality, date) in SERIES.items():  # the same slices, filed as other series
            for f in sorted(source.iterdir()):
                ds = pydicom.dcmread(str(f))
                ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.Modality, ds.StudyDate = study, series, modality, date
                ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = f"{series}.{ds.InstanceNumber}"
                ds.FrameOfReferenceUID = f"{series}.99"
                buf = io.BytesIO()
                ds.save_as(buf, enforce_file_format=True)
                server.rest("POST", "/instances", buf.getvalue())
        yield server
    finally:
        server.stop()


def _url(server, series: str) -> str:
    return f"{server.dicomweb}/studies/{SERIES[series][0]}/series/{series}"


def _leftover_downloads() -> list:
    return sorted(p.name for p in Path(tempfile.gettempdir()).glob("medvol-dicomweb-*"))


@needs_orthanc
def test_pacs_find_writes_a_manifest_of_the_series_matching(capsys, orthanc, tmp_path):
    out = tmp_path / "cases.csv"
    code, stdout, err = run_cli(capsys, "pacs", "find", "--url", orthanc.dicomweb.replace("dicomweb://", "http://"),
                                "--modality", "CT", "--study-date", "20240101-20240131", "--query", "the liver",
                                "--out", out)
    assert code == 0, err
    assert "3 series written" in stdout
    rows = list(csv.DictReader(out.open()))
    assert sorted(r["id"] for r in rows) == WANTED
    assert {r["volume"] for r in rows} == {_url(orthanc, s) for s in WANTED}
    assert {r["query"] for r in rows} == {"the liver"}
    # no date: the 2023 CT too; a limit of 1: one
    code, stdout, _ = run_cli(capsys, "pacs", "find", "--url", orthanc.dicomweb, "--modality", "CT",
                              "--query", "liver", "--out", tmp_path / "all.csv", "--json")
    assert code == 0 and json.loads(stdout)["series"] == 4
    code, stdout, _ = run_cli(capsys, "pacs", "find", "--url", orthanc.dicomweb, "--limit", "1",
                              "--query", "liver", "--out", tmp_path / "one.csv", "--json")
    assert code == 0 and json.loads(stdout)["series"] == 1
    # an existing manifest is not replaced without --overwrite; a bad date is one line
    code, _, err = run_cli(capsys, "pacs", "find", "--url", orthanc.dicomweb, "--query", "liver", "--out", out)
    assert code == 2 and "exists" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "pacs", "find", "--url", orthanc.dicomweb, "--study-date", "2024-01",
                           "--query", "liver", "--out", tmp_path / "x.csv")
    assert code == 2 and "--study-date" in err and not (tmp_path / "x.csv").exists()


def _manifest(server, path: Path) -> Path:
    path.write_text("id,volume,query\n" + "".join(f"c{i},{_url(server, s)},the liver\n" for i, s in enumerate(WANTED)))
    return path


def _mask(out: Path, case: str) -> np.ndarray:
    return np.asarray(nib.load(str(out / case / "mask.nii.gz")).dataobj)


@needs_orthanc
def test_batch_by_url_interrupted_and_resumed_retrieves_only_unfinished_cases(orthanc, tmp_path, tiny,  # noqa: F811
                                                                             monkeypatch):
    manifest = _manifest(orthanc, tmp_path / "cases.csv")
    fetched = []
    real = pacs.retrieve_series

    def counted(url, *a, **k):
        fetched.append(url.series)
        return real(url, *a, **k)

    monkeypatch.setattr(pacs, "retrieve_series", counted)
    before = _leftover_downloads()
    opts = dict(preset="tiny", device="cpu", progress=False)

    def stop_after_first(row):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_batch(manifest, tmp_path / "run", BatchOptions(**opts), pipeline=tiny, on_case=stop_after_first)
    assert fetched == [WANTED[0]]
    done = json.loads((tmp_path / "run" / "c0" / "done.json").read_text())
    assert done["status"] == "done" and done["retrieved"]["instances"] == 8
    assert done["case"]["volume"] == _url(orthanc, WANTED[0]).replace("dicomweb://", "http://")
    assert not (tmp_path / "run" / "c1").exists()

    res = run_batch(manifest, tmp_path / "run", BatchOptions(resume=True, **opts), pipeline=tiny)
    assert fetched == WANTED  # the finished case was not retrieved again
    assert res.info["skipped"] == 1 and res.info["ran"] == 2 and res.exit_code == 0
    assert _leftover_downloads() == before  # each case's download is gone

    full = run_batch(manifest, tmp_path / "full", BatchOptions(**opts), pipeline=tiny)
    assert [r["status"] for r in full.rows] == [r["status"] for r in res.rows] == ["done"] * 3
    for case in ("c0", "c1", "c2"):
        assert np.array_equal(_mask(tmp_path / "run", case), _mask(tmp_path / "full", case))
    assert [r["voxels"] for r in csv.DictReader((tmp_path / "run" / "summary.csv").open())] == \
        [r["voxels"] for r in csv.DictReader((tmp_path / "full" / "summary.csv").open())]


@needs_orthanc
def test_pacs_find_manifest_runs_keeps_downloads_and_stores_each_seg(capsys, orthanc, tmp_path):
    manifest = tmp_path / "cases.csv"
    code, _, err = run_cli(capsys, "pacs", "find", "--url", orthanc.dicomweb, "--modality", "CT",
                           "--study-date", "20240102-", "--query", "the liver", "--out", manifest)
    assert code == 0, err
    keep = tmp_path / "keep"
    code, stdout, err = run_cli(capsys, "batch", "--manifest", manifest, "--out-dir", tmp_path / "out",
                                "--keep-downloads", keep, "--store-seg", "--preset", "tiny", "--device", "cpu",
                                "--no-progress", "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["done"] == 2 and info["failed"] == 0
    assert sorted(p.name for p in keep.iterdir()) == WANTED[1:]
    assert all(len(list((keep / s).iterdir())) == 8 for s in WANTED[1:])
    from dicomweb_client.api import DICOMwebClient

    client = DICOMwebClient(f"{orthanc.url}/dicom-web")
    for row in csv.DictReader(manifest.open()):
        study = SERIES[row["id"]][0]
        done = json.loads((tmp_path / "out" / row["id"] / "done.json").read_text())
        [found] = client.search_for_series(study, search_filters={"Modality": "SEG"})
        assert found["0020000E"]["Value"][0] == done["stored"]["series_instance_uid"]
        [inst] = client.search_for_instances(study, done["stored"]["series_instance_uid"])
        ds = client.retrieve_instance(study, done["stored"]["series_instance_uid"], inst["00080018"]["Value"][0])
        assert ds.ReferencedSeriesSequence[0].SeriesInstanceUID == row["id"]
        assert not list((tmp_path / "out" / row["id"]).glob("*.dcm"))  # the SEG is on the server only
    assert json.loads((tmp_path / "out" / WANTED[1] / "done.json").read_text())["case"]["store_seg"] is True


# ---- the pre-check: no server contacted -----------------------------------------------------------

def test_batch_refuses_urls_on_servers_not_allowed_before_anything(capsys, tmp_path):
    servers = tmp_path / "pacs.json"
    servers.write_text(json.dumps({"servers": {"ours": {"url": "http://127.0.0.1:9/dicom-web"}}}))
    manifest = tmp_path / "cases.csv"
    manifest.write_text("id,volume,query\n"
                        "a,dicomweb://127.0.0.1:9/dicom-web/studies/1.2/series/1.2.3,liver\n"
                        "b,dicomweb://elsewhere.example/dicom-web/studies/1.2/series/1.2.4,liver\n"
                        "c,dicomweb://127.0.0.1:9/dicom-web/studies/1.2/series/x,liver\n")
    code, _, err = run_cli(capsys, "batch", "--manifest", manifest, "--out-dir", tmp_path / "out", "--pacs-config",
                           servers, "--allow-pacs", "ours", "--preset", "tiny", "--device", "cpu", "--no-progress")
    assert code == 2 and "Traceback" not in err
    assert "(b): volume http://elsewhere.example" in err and "not allowed by --allow-pacs" in err
    assert "(c): volume" in err and "not a DICOM UID" in err and "(a)" not in err
    assert not (tmp_path / "out").exists()
    token = tmp_path / "token"
    token.write_text("abc")
    code, stdout, err = run_cli(capsys, "batch", "--manifest", manifest, "--out-dir", tmp_path / "out",
                                "--dicomweb-token-file", token, "--skip-invalid", "--dry-run", "--preset", "tiny",
                                "--json")
    assert code == 0, err
    info = json.loads(stdout)
    invalid = {c["id"]: c["error"] for c in info["invalid_cases"]}
    assert set(invalid) == {"b", "c"} and "sent to one server" in invalid["b"]
    assert info["would_run"] == ["a"] and not (tmp_path / "out").exists()


def test_one_token_goes_to_one_server():
    access = pacs.SeriesAccess(token="Bearer x")
    problems = pacs.check_sources(["dicomweb://127.0.0.1:9/w/studies/1/series/2",
                                   "dicomweb://127.0.0.1:9/w/studies/1/series/3",
                                   "dicomweb://other.example/w/studies/1/series/4"], access)
    assert list(problems) == ["dicomweb://other.example/w/studies/1/series/4"]
    assert "sent to one server" in problems["dicomweb://other.example/w/studies/1/series/4"]
    assert pacs.check_sources(["dicomweb://a/w/studies/1/series/2", "dicomweb://b/w/studies/1/series/3"],
                              pacs.SeriesAccess()) == {}


def test_a_case_on_a_server_that_is_down_fails_alone(capsys, tmp_path):
    from reference.orthanc import free_port

    manifest = tmp_path / "cases.csv"
    manifest.write_text(f"id,volume,query\na,dicomweb://127.0.0.1:{free_port()}/dicom-web/studies/1.2/series/1.3,liver\n")
    before = _leftover_downloads()
    code, stdout, err = run_cli(capsys, "batch", "--manifest", manifest, "--out-dir", tmp_path / "out",
                                "--preset", "tiny", "--device", "cpu", "--no-progress", "--json")
    assert code == 3, err
    [failure] = json.loads(stdout)["failures"]
    assert failure["id"] == "a" and failure["error"].startswith("pacs_error: cannot reach the DICOMweb server")
    assert sorted(p.name for p in (tmp_path / "out" / "a").iterdir()) == ["error.json"]
    assert _leftover_downloads() == before


def test_pacs_find_on_a_server_that_is_down_is_one_line(capsys, tmp_path):
    from reference.orthanc import free_port

    code, _, err = run_cli(capsys, "pacs", "find", "--url", f"dicomweb://127.0.0.1:{free_port()}/dicom-web",
                           "--query", "liver", "--out", tmp_path / "m.csv")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "cannot reach the DICOMweb server" in err
    assert not (tmp_path / "m.csv").exists()
    code, _, err = run_cli(capsys, "pacs", "find", "--url", "ftp://h/x", "--query", "liver", "--out", tmp_path / "m.csv")
    assert code == 2 and "not a DICOMweb service URL" in err


def test_dicomweb_options_without_any_url_are_refused(capsys, tmp_path, small_ct):
    manifest = tmp_path / "cases.csv"
    manifest.write_text(f"id,volume,query\na,{small_ct[0]},liver\n")
    code, _, err = run_cli(capsys, "batch", "--manifest", manifest, "--out-dir", tmp_path / "out", "--store-seg",
                           "--preset", "tiny", "--dry-run")
    assert code == 2 and "names none" in err and len(err.strip().splitlines()) == 1
