"""Generated series, not only named ones (:mod:`core.dicomgen`): small CT series varying what real
series vary (character set, Type 2 attributes, blanked UIDs, instances of another patient, study or
frame of reference, tilt/gap/duplicate positions, rescale per slice, transfer syntax). For each, the
one segment job asked for a DICOM-SEG, a NIfTI, a QC picture and statistics either writes every
output — the SEG passes dciodvfy with no error and reads back equal to the NIfTI mask — or drops
only the SEG with a note saying why (a series no SEG can reference), or refuses in one line before
any model loads; it never fails otherwise."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings

from medvolcore.errors import MedVolError
from medvolcore.jobs import SegmentOutputs, SegmentRequest, run_segment_job

from core.dicomgen import SYNTAXES, expected, series_spec, write_series
from core.test_jobs import calls, propagator  # noqa: F401  (fixtures)

hd = pytest.importorskip("highdicom")
sitk = pytest.importorskip("SimpleITK")

BOX = [8, 8, 24, 24]


def _plain(**changes) -> dict:
    spec = {"charset": 0, "type2": {}, "blank": [], "disagree": None, "positions": "even", "rescale": "same",
            "syntax": SYNTAXES[0]}
    spec.update(changes)
    return spec


def dciodvfy_errors(path) -> list:
    """dciodvfy's ``Error`` lines for ``path`` ([] when dicom3tools is not installed: said by a skip elsewhere)."""
    tool = shutil.which("dciodvfy")
    if tool is None:
        return []
    report = subprocess.run([tool, str(path)], capture_output=True, text=True, errors="replace")
    return [ln for ln in (report.stdout + report.stderr).splitlines() if ln.startswith("Error")]


def seg_equals_mask(seg_path, series, nifti) -> None:
    """The SEG's frames against the NIfTI mask resampled onto the source series by SimpleITK."""
    import pydicom

    reader = sitk.ImageSeriesReader()
    files = reader.GetGDCMSeriesFileNames(str(series))
    reader.SetFileNames(files)
    ref = reader.Execute()
    mask = sitk.Resample(sitk.ReadImage(str(nifti)), ref, sitk.Transform(), sitk.sitkNearestNeighbor)
    want = sitk.GetArrayFromImage(mask) > 0
    uids = [str(pydicom.dcmread(f, stop_before_pixels=True).file_meta.MediaStorageSOPInstanceUID) for f in files]
    got = hd.seg.segread(str(seg_path)).get_pixels_by_source_instance(source_sop_instance_uids=uids,
                                                                     segment_numbers=[1])[..., 0] > 0
    assert got.shape == want.shape and np.array_equal(got, want)


def check_one_series(tmp_path_factory, calls, spec: dict):  # noqa: F811
    root = tmp_path_factory.mktemp("gen")
    series = root / "series"
    write_series(spec, series)
    outs = root / "out"
    outs.mkdir()
    seg, nifti = outs / "m.dcm", outs / "m.nii.gz"
    outputs = SegmentOutputs([seg, nifti], qc=outs / "m.png", stats=outs / "m.json")
    calls.made.clear()
    want = expected(spec)
    try:
        res = run_segment_job(calls, series, SegmentRequest(key_slice=2, boxes=[BOX], span=1), outputs)
    except MedVolError as e:
        message = str(e)
        assert want["refused"], f"refused a series it should read: {message}"
        assert "\n" not in message and calls.made == [] and not any(outs.iterdir())
        if want["refused"] in ("gap", "duplicate"):
            assert "DICOM series" in message
        else:
            assert want["refused"] in message, message
        return
    assert not want["refused"], f"read a series it should refuse ({want['refused']})"
    assert nifti.is_file() and (outs / "m.png").is_file() and (outs / "m.json").is_file()
    if want["seg"]:
        assert not seg.exists() and res["outs"] == [str(nifti)]
        assert any(str(seg) in n and "was not written" in n for n in res["notes"]), res["notes"]
        return
    assert res["outs"] == [str(seg), str(nifti)], res["notes"]
    assert dciodvfy_errors(seg) == []
    seg_equals_mask(seg, series, nifti)
    import pydicom

    written = pydicom.dcmread(str(seg))
    assert written.SpecificCharacterSet == "ISO_IR 192"
    source = pydicom.dcmread(str(next(series.iterdir())), stop_before_pixels=True)
    assert str(written.get("PatientName", "")) == str(source.get("PatientName", ""))  # decoded, never '??'


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@example(spec=_plain(charset=1))  # SpecificCharacterSet present but empty (GE): the default repertoire
@example(spec=_plain(charset=4, syntax=SYNTAXES[3]))  # ISO 2022 with code extensions, first value empty; RLE
@example(spec=_plain(disagree="PatientID"))  # two patients under one series UID
@example(spec=_plain(charset=6, type2={"PatientID": "missing", "StudyID": "empty"}, rescale="per_slice",
                     syntax=SYNTAXES[2]))  # 'ISO_IR 6' (not a DICOM term), Type 2 gaps, big endian
@given(spec=series_spec())
def test_a_generated_series_is_written_whole_or_refused_in_one_line(tmp_path_factory, calls, spec):  # noqa: F811
    check_one_series(tmp_path_factory, calls, spec)
