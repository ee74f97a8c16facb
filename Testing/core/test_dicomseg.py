"""DICOM Segmentation output (``.dcm``, highdicom): references its source series, shares its study
and frame of reference, codes each segment, and its frames are the mask by geometry (checked
against SimpleITK's own resampling, not against the writer's arithmetic)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from medvolcore.errors import InputError
from medvolcore.jobs import SegmentOutputs, SegmentRequest, check_outputs, run_segment_job

from core.test_jobs import BOX, calls, propagator  # noqa: F401  (fixtures)

hd = pytest.importorskip("highdicom")
sitk = pytest.importorskip("SimpleITK")


@pytest.fixture
def series(tmp_path, small_ct, write_dicom_series):
    ct, _ = small_ct
    img = sitk.Cast(sitk.ReadImage(str(ct)), sitk.sitkInt16)
    folder = tmp_path / "series"
    write_dicom_series(sitk, img, folder)
    return folder


def test_dicom_seg_of_a_dicom_series(tmp_path, series, calls):  # noqa: F811
    anchor = tmp_path / "a.anchor.json"
    first = run_segment_job(calls, series, SegmentRequest(key_slice=3, boxes=[BOX]),
                            SegmentOutputs(tmp_path / "m.nii.gz", anchor=anchor))
    a = json.loads(anchor.read_text())
    a["query"] = "the right kidney"
    anchor.write_text(json.dumps(a))
    res = run_segment_job(calls, series, SegmentRequest(anchor=str(anchor)), SegmentOutputs(tmp_path / "m.dcm"))
    assert res["out"] == str(tmp_path / "m.dcm") and res["mask_voxels"] == first["mask_voxels"] > 0

    seg = hd.seg.segread(str(tmp_path / "m.dcm"))
    import pydicom

    sources = [pydicom.dcmread(str(f)) for f in sorted(series.iterdir())]
    assert seg.StudyInstanceUID == sources[0].StudyInstanceUID
    assert seg.FrameOfReferenceUID == sources[0].FrameOfReferenceUID
    referenced = {r.ReferencedSOPInstanceUID for s in seg.ReferencedSeriesSequence for r in s.ReferencedInstanceSequence}
    assert referenced == {s.SOPInstanceUID for s in sources}
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == sources[0].SeriesInstanceUID
    d = seg.SegmentSequence[0]
    assert d.SegmentLabel == "the right kidney" and d.SegmentDescription == "the right kidney"
    assert d.SegmentedPropertyTypeCodeSequence[0].CodeValue == "64033007"  # Kidney
    assert d.SegmentedPropertyTypeCodeSequence[0].SegmentedPropertyTypeModifierCodeSequence[0].CodeMeaning == "Right"
    assert d.SegmentAlgorithmType == "AUTOMATIC" and d.SegmentAlgorithmName.startswith("MedVol")

    # the frames against the NIfTI mask resampled onto the source series by SimpleITK
    reader = sitk.ImageSeriesReader()
    files = reader.GetGDCMSeriesFileNames(str(series))
    reader.SetFileNames(files)
    ref = reader.Execute()
    mask = sitk.Resample(sitk.ReadImage(str(tmp_path / "m.nii.gz")), ref, sitk.Transform(), sitk.sitkNearestNeighbor)
    expected = sitk.GetArrayFromImage(mask)  # (k, j, i) in the series' order
    uids = [pydicom.dcmread(f, stop_before_pixels=True).SOPInstanceUID for f in files]
    got = seg.get_pixels_by_source_instance(source_sop_instance_uids=uids, segment_numbers=[1])[..., 0]
    assert got.shape == expected.shape and np.array_equal(got > 0, expected > 0)


def test_a_dicom_seg_needs_a_dicom_series(tmp_path, small_ct):
    ct, _ = small_ct
    with pytest.raises(InputError, match="must be a DICOM series folder"):
        check_outputs(SegmentOutputs(tmp_path / "m.dcm"), [("--volume", ct)])
    assert not (tmp_path / "m.dcm").exists()


def test_a_source_slice_without_geometry_is_one_error():
    from pydicom.dataset import Dataset

    from medvolcore.dicomseg import frames_from_mask
    from medvolcore.errors import VolumeError

    ds = Dataset()
    ds.Rows, ds.Columns, ds.ImagePositionPatient = 2, 2, [0, 0, 0]  # no orientation, no spacing
    with pytest.raises(VolumeError, match="lacks a usable position, orientation or pixel spacing"):
        frames_from_mask(np.zeros((2, 2, 1), np.uint8), np.eye(4), [ds])


def test_several_targets_are_one_segment_each(tmp_path, series):
    import pydicom

    from medvolcore.dicomseg import save_dicom_seg
    from medvolcore.terminology import match
    from medvolcore.volume import load_volume

    ct = load_volume(series)
    labels = np.zeros(ct.shape, np.uint8)
    labels[20:60, 30:70, 1:4] = 1
    labels[70:90, 10:40, 3:7] = 2
    queries = ["the liver", "the spleen", "the kidney that contains the cyst"]  # the third found nothing
    segments = [{"name": q, "value": k, "term": match(q, k)} for k, q in enumerate(queries, start=1)]
    out = save_dicom_seg(labels, ct.affine, ct, tmp_path / "organs.dcm", segments, algorithm="MedVol test",
                         version="0")
    seg = hd.seg.segread(str(out))
    assert seg.SegmentationType == "BINARY"  # by default: one frame set per segment, which every reader takes
    from core.test_dicom_generated import dciodvfy_errors

    assert dciodvfy_errors(out) == []
    named = list(seg.SegmentSequence)
    assert [d.SegmentLabel for d in named] == queries
    assert [d.SegmentedPropertyTypeCodeSequence[0].CodeMeaning for d in named][:2] == ["Liver", "Spleen"]
    uids = [pydicom.dcmread(str(f), stop_before_pixels=True).SOPInstanceUID for f in sorted(series.iterdir())]
    got = seg.get_pixels_by_source_instance(source_sop_instance_uids=uids, segment_numbers=[1, 2, 3])
    assert [int(got[..., k].sum()) for k in range(3)] == [int((labels == v).sum()) for v in (1, 2, 3)]
