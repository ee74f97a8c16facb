"""DICOM from the wild: one read and one provenance per series, geometry from every slice's
header, declared sizes checked against the bytes, blank UIDs supplied from the file meta, SEG
text in UTF-8, and outputs that never replace a file of the input.

The series are made with pydicom from pydicom's own CT test file (``CT_small.dcm``, 128×128) so
each case is a few files of a few kB; ``Testing/data/dicom/`` holds the conformance corpus.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from medvolcore.errors import InputError, VolumeError

pydicom = pytest.importorskip("pydicom")
hd = pytest.importorskip("highdicom")
pytest.importorskip("SimpleITK")

UID = "1.2.826.0.1.3680043.8.498.77"


def make_series(folder, n: int = 5, step: float = 2.5, edit=None, name: str = "Doe^Jane", study: str = UID + ".1"):
    """``n`` axial slices of CT_small.dcm, ``step`` mm apart; ``edit(ds, k)`` changes slice k."""
    from pydicom.data import get_testdata_file

    src = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        ds = copy.deepcopy(src)  # a shallow copy shares the data elements changed below
        ds.SOPInstanceUID = f"{study}.{k + 1}"
        ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study, study + ".2", study + ".3"
        ds.PatientName, ds.SeriesDescription = name, "abdomen 2.5 mm"
        ds.ImagePositionPatient = [-158.0, -179.0, -75.0 + step * k]
        ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
        ds.InstanceNumber = k + 1
        ds.SliceThickness = step
        if edit is not None:
            edit(ds, k)
        ds.save_as(str(folder / f"IM{k:04d}.dcm"))
    return folder


def _seg(tmp_path, ct, out="seg.dcm", queries=("the liver",)):
    from medvolcore.dicomseg import save_dicom_seg

    labels = np.zeros(ct.shape, np.uint8)
    for v in range(1, len(queries) + 1):
        labels[10 * v:10 * v + 20, 30:70, 1:4] = v
    segments = [{"name": q, "value": v} for v, q in enumerate(queries, start=1)]
    return save_dicom_seg(labels, ct.affine, ct, tmp_path / out, segments, algorithm="MedVol test", version="0")


# ---- one read, one provenance -----------------------------------------------------------------

def test_the_record_holds_each_instance_read(tmp_path):
    from medvolcore.volume import load_volume

    series = make_series(tmp_path / "s")
    ct = load_volume(series)
    rec = ct.dicom
    assert [i.sop_instance_uid for i in rec.instances] == [f"{UID}.1.{k}" for k in range(1, 6)]
    assert [i.position[2] for i in rec.instances] == [-75.0 + 2.5 * k for k in range(5)]
    import hashlib

    assert rec.instances[0].sha256 == hashlib.sha256((series / "IM0000.dcm").read_bytes()).hexdigest()


def test_the_seg_never_reads_the_folder_again(tmp_path, monkeypatch):
    from medvolcore.volume import load_volume

    ct = load_volume(make_series(tmp_path / "s"))

    def no_read(*a, **k):
        raise AssertionError("the folder was read again")

    monkeypatch.setattr(pydicom, "dcmread", no_read)
    out = _seg(tmp_path, ct)
    monkeypatch.undo()
    seg = pydicom.dcmread(str(out))
    assert {r.ReferencedSOPInstanceUID for r in seg.ReferencedSeriesSequence[0].ReferencedInstanceSequence} == \
        {f"{UID}.1.{k}" for k in range(1, 6)}
    assert str(seg.PatientName) == "Doe^Jane"


def test_a_folder_replaced_under_the_run_is_refused(tmp_path):
    """Another patient's files, same geometry, put in the folder after it was read: no SEG naming
    patient B over patient A's mask."""
    from medvolcore.volume import load_volume

    series = make_series(tmp_path / "s")
    ct = load_volume(series)
    for f in series.iterdir():
        f.unlink()
    make_series(series, name="Roe^Richard", study=UID + ".9")
    with pytest.raises(VolumeError, match="changed since it was read"):
        _seg(tmp_path, ct)
    assert not (tmp_path / "seg.dcm").exists()


# ---- geometry from the slices' headers -----------------------------------------------------------

def test_a_gantry_tilted_series_is_resampled_onto_an_orthogonal_grid(tmp_path):
    """8 slices whose positions drift 1.5 mm in-plane per 2.5 mm (31°): the spacing is 2.5 mm, not
    the 2.9155 mm between positions, and a bright pixel of each source slice lands at its own
    world position (not 10.5 mm off at slice 7)."""
    from medvolcore.volume import load_volume

    def tilt(ds, k):
        ds.ImagePositionPatient = [0.0, 1.5 * k, 2.5 * k]
        arr = np.full((ds.Rows, ds.Columns), 0, np.int16)
        arr[40, 50] = 2000  # row 40, column 50
        ds.PixelData = arr.tobytes()

    series = make_series(tmp_path / "s", n=8, edit=tilt)
    ct = load_volume(series)
    assert ct.dicom.tilt["degrees"] == pytest.approx(30.96, abs=0.01)
    assert any("gantry tilt of 31.0°" in n and "resampled onto an orthogonal grid" in n for n in ct.notes)
    assert np.allclose(ct.spacing, (0.661468, 0.661468, 2.5), atol=1e-4)
    px = 0.661468
    for k in range(8):
        # where the source pixel is (LPS → RAS), against the brightest voxel of slice k on the new grid
        lps = np.array([0.0, 1.5 * k, 2.5 * k]) + 50 * px * np.array([1, 0, 0]) + 40 * px * np.array([0, 1, 0])
        i, j = np.unravel_index(np.argmax(ct.array[:, :, k]), ct.array.shape[:2])
        world = ct.affine @ [i, j, k, 1]
        assert np.allclose(world[:3], lps * [-1, -1, 1], atol=px), (k, world[:3], lps)
    assert "gantry-tilted" in ct.dicom.seg_refusal()


def test_a_slice_with_another_pixel_spacing_is_refused(tmp_path):
    from medvolcore.volume import load_volume

    def spacing(ds, k):
        if k == 3:
            ds.PixelSpacing = [0.7, 0.7]

    with pytest.raises(VolumeError, match="mixes pixel spacings"):
        load_volume(make_series(tmp_path / "s", edit=spacing))


def test_a_fractional_per_slice_rescale_is_applied_exactly(tmp_path):
    from medvolcore.volume import load_volume

    def rescale(ds, k):
        ds.RescaleIntercept = -1024.25 if k == 2 else -1024

    series = make_series(tmp_path / "s", edit=rescale)
    ct = load_volume(series)
    stored = pydicom.dcmread(str(series / "IM0002.dcm")).pixel_array.astype(np.float64)
    # (i, j, k) = (column, row, slice): slice 2 is its stored values − 1024.25, not truncated
    assert np.array_equal(ct.array[:, :, 2].T, (stored - 1024.25).astype(np.float32))
    assert np.array_equal(ct.array[:, :, 1].T, pydicom.dcmread(str(series / "IM0001.dcm")).pixel_array - 1024.0)


def test_a_declared_size_beyond_the_pixel_data_is_refused(tmp_path):
    from medvolcore.volume import load_volume

    def huge(ds, k):
        ds.Rows = ds.Columns = 8192

    with pytest.raises(VolumeError, match="declares 8192×8192 pixels.*but holds 0.033 MB"):
        load_volume(make_series(tmp_path / "s", n=3, edit=huge))


# ---- blank UIDs, character sets, control characters ------------------------------------------------

def test_blank_sop_uids_come_from_the_file_meta(tmp_path):
    from medvolcore.volume import load_volume

    def blank(ds, k):
        ds.SOPInstanceUID = ""
        ds.SOPClassUID = ""

    ct = load_volume(make_series(tmp_path / "s", edit=blank))
    seg = pydicom.dcmread(str(_seg(tmp_path, ct)))
    ref = seg.ReferencedSeriesSequence[0].ReferencedInstanceSequence
    assert sorted(r.ReferencedSOPInstanceUID for r in ref) == [f"{UID}.1.{k}" for k in range(1, 6)]
    assert {r.ReferencedSOPClassUID for r in ref} == {"1.2.840.10008.5.1.4.1.1.2"}


def test_a_series_without_study_uid_drops_only_the_dcm_before_the_model(tmp_path, monkeypatch):
    from medvolcore.jobs import SegmentOutputs, SegmentRequest, run_segment_job

    def blank(ds, k):
        ds.StudyInstanceUID = ""

    series = make_series(tmp_path / "s", edit=blank)

    def no_model():
        raise AssertionError("the model loaded")

    with pytest.raises(InputError, match="has no StudyInstanceUID.*write .seg.nrrd or .nii.gz instead"):
        run_segment_job(no_model, series, SegmentRequest(query="the liver"), SegmentOutputs(tmp_path / "m.dcm"))

    from medvolcore.dicomseg import referenceable_outputs
    from medvolcore.volume import load_volume

    outputs, notes = referenceable_outputs(SegmentOutputs([tmp_path / "m.dcm", tmp_path / "m.nii.gz"]),
                                           load_volume(series))
    assert outputs.masks == [tmp_path / "m.nii.gz"]
    assert notes and "m.dcm was not written" in notes[0] and "StudyInstanceUID" in notes[0]


def test_seg_text_is_utf8_and_names_the_ai(tmp_path):
    from medvolcore.volume import load_volume

    ct = load_volume(make_series(tmp_path / "s", name="Müller^Jürgen"))
    seg = pydicom.dcmread(str(_seg(tmp_path, ct, queries=("die linke Niere, größte Läsion",))))
    assert seg.SpecificCharacterSet == "ISO_IR 192"
    assert seg.SegmentSequence[0].SegmentLabel == "die linke Niere, größte Läsion"
    assert str(seg.PatientName) == "Müller^Jürgen"
    assert seg.SegmentSequence[0].SegmentAlgorithmType == "AUTOMATIC"
    assert str(seg.ContentCreatorName) == "MedVol^AI" and "not confirmed" in seg.ContentDescription
    assert seg.SeriesDescription == "AI seg (unconfirmed) of abdomen 2.5 mm"


@pytest.mark.parametrize("query", ["liver\x00.nii.gz", "liver\x1b[31m", "liver\x7f"])
def test_control_characters_in_a_query_are_refused(query):
    from medvolcore.grounder import validate_query

    with pytest.raises(InputError, match="control character U\\+00"):
        validate_query(query)


# ---- outputs never replace an input ------------------------------------------------------------

def test_an_output_onto_a_slice_of_the_series_is_refused(tmp_path):
    from medvolcore.jobs import SegmentOutputs, check_outputs

    series = make_series(tmp_path / "s", n=3)
    (tmp_path / "link.dcm").hardlink_to(series / "IM0001.dcm")
    for outputs in (SegmentOutputs(series / "IM0001.dcm", overwrite=True),
                    SegmentOutputs(tmp_path / "m.nii.gz", anchor=tmp_path / "link.dcm", overwrite=True),
                    SegmentOutputs(tmp_path / "m.nii.gz", qc=series / "IM0002.dcm", overwrite=True)):
        with pytest.raises(InputError, match="a file of the input --volume"):
            check_outputs(outputs, [("--volume", series)])
    with pytest.raises(InputError, match="written into its source folder"):
        check_outputs(SegmentOutputs(series / "seg.dcm"), [("--volume", series)])
    assert sorted(p.name for p in series.iterdir()) == ["IM0000.dcm", "IM0001.dcm", "IM0002.dcm"]


def test_an_output_onto_a_header_data_file_is_refused(tmp_path):
    from medvolcore.fileio import check_distinct

    (tmp_path / "ct.raw").write_bytes(bytes(8))
    (tmp_path / "ct.nhdr").write_text("NRRD0004\ntype: short\ndimension: 3\nsizes: 2 2 1\nencoding: raw\n"
                                      "endian: little\ndata file: ct.raw\n\n")
    with pytest.raises(InputError, match="--anchor-out .*ct.raw is ct.raw, a file of the input --volume"):
        check_distinct([("--out", tmp_path / "m.nii.gz"), ("--anchor-out", tmp_path / "ct.raw")],
                       [("--volume", tmp_path / "ct.nhdr")])


def test_a_control_character_in_a_target_name_is_refused():
    from medvolcore.errors import FieldError
    from medvolcore.request import SegmentRequest

    with pytest.raises(FieldError, match="without control characters"):
        SegmentRequest(query="the left kidney", target_name="kidney\x00_left").check()
