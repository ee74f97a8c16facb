"""The DICOM conformance corpus (``Testing/data/dicom/``): each case is read or refused in one
line as ``cases.py`` says; each case read gets a mask written as ``.dcm``, ``.seg.nrrd`` and
``.nii.gz``, and its DICOM-SEG is checked independently of the writer: dciodvfy (dicom3tools)
reports no error, dcmtk's dcmdump parses it, highdicom and pydicom read it back, every frame lies
on the position of the source instance it references, and its frames equal the NIfTI mask
resampled onto the source series by SimpleITK."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from medvolcore.errors import VolumeError

pydicom = pytest.importorskip("pydicom")
hd = pytest.importorskip("highdicom")
sitk = pytest.importorskip("SimpleITK")

DATA = Path(__file__).resolve().parents[1] / "data" / "dicom"
sys.path.insert(0, str(DATA))
from cases import CASES, HERE, build  # noqa: E402

READ = sorted(n for n, c in CASES.items() if c[3] in ("read", "no-seg"))
REFUSED = sorted(n for n, c in CASES.items() if c[3] not in ("read", "no-seg"))


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian: apt-get install {'dicom3tools' if name == 'dciodvfy' else 'dcmtk'};"
                    " `python3 MedVolCore/bootstrap.py` installs it where it can)")
    return path


@pytest.mark.parametrize("name", REFUSED)
def test_a_refused_case_is_one_line(tmp_path, name):
    from medvolcore.volume import load_volume

    with pytest.raises(VolumeError) as e:
        load_volume(build(name, tmp_path / name))
    assert str(e.value).startswith(CASES[name][3]) or CASES[name][3] in str(e.value)
    assert "\n" not in str(e.value)


def _box(ct, values=(1,)):
    labels = np.zeros(ct.shape, np.uint8)
    i, j, k = ct.shape
    for n, v in enumerate(values):
        labels[i // 4 + n * i // 4: i // 2 + n * i // 4, j // 4: 3 * j // 4, 1: k - 1] = v
    return labels


@pytest.mark.parametrize("name", READ)
def test_a_case_read_writes_a_seg_that_others_accept(tmp_path, name):
    from medvolcore.dicomseg import save_dicom_seg
    from medvolcore.errors import InputError
    from medvolcore.volume import load_volume, save_mask

    series = build(name, tmp_path / name)
    ct = load_volume(series)
    labels = _box(ct)
    segments = [{"name": "the liver", "value": 1}]
    save_mask(labels, ct, tmp_path / "m.nii.gz")
    save_mask(labels, ct, tmp_path / "m.seg.nrrd", segments=segments)
    out = tmp_path / "m.dcm"
    if CASES[name][3] == "no-seg":
        with pytest.raises(InputError, match="write .seg.nrrd or .nii.gz instead"):
            save_dicom_seg(labels, ct.affine, ct, out, segments, algorithm="MedVol test", version="0")
        assert not out.exists()
        return
    save_dicom_seg(labels, ct.affine, ct, out, segments, algorithm="MedVol test", version="0")

    seg = hd.seg.segread(str(out))
    sources = {str(ds.SOPInstanceUID or ds.file_meta.MediaStorageSOPInstanceUID): ds
               for ds in (pydicom.dcmread(str(f)) for f in sorted(series.iterdir())) if "PixelData" in ds}
    # every frame on the position of the source instance it references
    for frame in seg.PerFrameFunctionalGroupsSequence:
        uid = frame.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID
        pos = frame.PlanePositionSequence[0].ImagePositionPatient
        assert np.allclose([float(v) for v in pos], [float(v) for v in sources[uid].ImagePositionPatient], atol=1e-3)
    # the SEG and the NIfTI mask agree by geometry (SimpleITK's resampling onto the GDCM-read series)
    reader = sitk.ImageSeriesReader()
    files = reader.GetGDCMSeriesFileNames(str(series))
    reader.SetFileNames(files)
    ref = reader.Execute()
    mask = sitk.Resample(sitk.ReadImage(str(tmp_path / "m.nii.gz")), ref, sitk.Transform(), sitk.sitkNearestNeighbor)
    expected = sitk.GetArrayFromImage(mask)
    uids = [str(pydicom.dcmread(f).SOPInstanceUID or pydicom.dcmread(f).file_meta.MediaStorageSOPInstanceUID)
            for f in files]
    got = seg.get_pixels_by_source_instance(source_sop_instance_uids=uids, segment_numbers=[1])[..., 0]
    assert expected.sum() > 0 and np.array_equal(got > 0, expected > 0)
    seg_nrrd = sitk.GetArrayFromImage(sitk.ReadImage(str(tmp_path / "m.seg.nrrd")))
    assert int((seg_nrrd > 0).sum()) == int(expected.sum())

    assert subprocess.run([_tool("dcmdump"), str(out)], capture_output=True).returncode == 0
    report = subprocess.run([_tool("dciodvfy"), str(out)], capture_output=True, text=True, errors="replace")
    errors = [ln for ln in (report.stdout + report.stderr).splitlines() if ln.startswith("Error")]
    assert errors == []


@pytest.mark.parametrize("name, source", [("ct-empty-charset", None), ("ct-iso2022-japanese", "chrH31.dcm"),
                                          ("ct-iso2022-korean", "chrI2.dcm"), ("ct-gb18030", "chrX2.dcm")])
def test_a_source_character_set_keeps_the_patient_name(tmp_path, name, source):
    """Real character sets (an empty one, ISO 2022 with code extensions, GB18030): the SEG is UTF-8,
    names the patient as the source does, and dciodvfy finds no error."""
    from medvolcore.dicomseg import save_dicom_seg
    from medvolcore.volume import load_volume

    series = build(name, tmp_path / name)
    written = pydicom.dcmread(str(next(series.iterdir())))
    assert written.SpecificCharacterSet == (pydicom.dcmread(str(HERE / source)).SpecificCharacterSet if source else "")
    ct = load_volume(series)
    out = save_dicom_seg(_box(ct), ct.affine, ct, tmp_path / "m.dcm", [{"name": "the liver", "value": 1}],
                         algorithm="MedVol test", version="0")
    seg = pydicom.dcmread(str(out))
    assert seg.SpecificCharacterSet == "ISO_IR 192" and str(seg.PatientName) == str(written.PatientName)
    if source:
        assert str(seg.PatientName) == str(pydicom.dcmread(str(HERE / source)).PatientName)
    report = subprocess.run([_tool("dciodvfy"), str(out)], capture_output=True, text=True, errors="replace")
    assert [ln for ln in (report.stdout + report.stderr).splitlines() if ln.startswith("Error")] == []


def test_an_enhanced_multiframe_instance_is_placed_by_its_frames(tmp_path):
    """The slices as one Legacy Converted Enhanced CT instance, frames stored in reverse order:
    each frame lands where its single-frame slice does."""
    from medvolcore.volume import load_volume

    enhanced = load_volume(build("ct-enhanced-multiframe", tmp_path / "e"))
    _, n, edit, _ = CASES["ct-enhanced-multiframe"]
    series = tmp_path / "s"
    build("ct-enhanced-multiframe", tmp_path / "tmp")  # the same slices, one file each, for reference
    import highdicom  # noqa: F401

    src = pydicom.dcmread(str(tmp_path / "tmp" / "ENHANCED.dcm"))
    assert int(src.NumberOfFrames) == n
    series.mkdir()
    for k, frame in enumerate(src.PerFrameFunctionalGroupsSequence):
        ds = pydicom.dcmread(str(DATA / "CT_small.dcm"))
        ds.SOPInstanceUID = f"{src.SOPInstanceUID}.{k + 1}"
        ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
        ds.ImagePositionPatient = frame.PlanePositionSequence[0].ImagePositionPatient
        ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
        ds.PixelData = src.pixel_array[k].astype(np.int16).tobytes()
        ds.RescaleIntercept, ds.RescaleSlope = -1024, 1
        ds.save_as(str(series / f"IM{k}.dcm"))
    single = load_volume(series)
    assert enhanced.shape == single.shape and enhanced.dicom.frames is not None
    values = set()
    for k in range(n):
        kb = int(round(np.linalg.solve(single.affine, enhanced.affine @ [0, 0, k, 1])[2]))
        assert np.array_equal(enhanced.array[:, :, k], single.array[:, :, kb])
        values.add(float(enhanced.array[0, 0, k]))
    assert len(values) == n  # the frames differ, so the order is tested
    assert "enhanced multi-frame" in enhanced.dicom.seg_refusal()


def test_several_targets_make_a_smaller_labelmap_seg(tmp_path):
    """Several targets: one LABELMAP frame set (RLE), read back by highdicom, smaller than BINARY."""
    from medvolcore.dicomseg import save_dicom_seg
    from medvolcore.volume import load_volume

    ct = load_volume(build("ct-explicit-le", tmp_path / "s"))
    labels = _box(ct, values=(1, 2, 3))
    segments = [{"name": q, "value": v} for v, q in enumerate(["liver", "spleen", "left kidney"], start=1)]
    out = save_dicom_seg(labels, ct.affine, ct, tmp_path / "organs.dcm", segments, algorithm="MedVol test",
                         version="0", seg_type="labelmap")  # opt-in (--seg-type labelmap)
    seg = hd.seg.segread(str(out))
    assert seg.SegmentationType == "LABELMAP" and seg.file_meta.TransferSyntaxUID == "1.2.840.10008.1.2.5"
    uids = [i.sop_instance_uid for i in ct.dicom.instances]
    got = seg.get_pixels_by_source_instance(source_sop_instance_uids=uids, segment_numbers=[1, 2, 3])
    assert [int(got[..., n].sum()) for n in range(3)] == [int((labels == v).sum()) for v in (1, 2, 3)]
    binary = 3 * labels.size // 8  # what three BINARY frame sets hold, before any header
    assert out.stat().st_size < binary
    assert subprocess.run([_tool("dcmdump"), str(out)], capture_output=True).returncode == 0


# ---- end to end: medvol segment with the tiny preset ------------------------------------------------

def _segment(capsys, series, *outs):
    from medvolcore.cli import main

    argv = ["segment", "--volume", str(series), "--query", "the liver", "--preset", "tiny", "--device", "cpu",
            "--json", "--no-progress", "--empty-mask-on-absent"]
    for o in outs:
        argv += ["--out", str(o)]
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_blank_uids_end_to_end_write_every_output(capsys, tmp_path):
    """The anonymised series whose data sets blank their SOP UIDs (the file meta keeps them): the
    .dcm is written with the other outputs, not lost to an internal error after the model ran."""
    import json

    series = build("ct-blank-sop-uids", tmp_path / "s")
    outs = [tmp_path / "m.dcm", tmp_path / "m.seg.nrrd", tmp_path / "m.nii.gz"]
    code, out, err = _segment(capsys, series, *outs)
    assert code == 0, err
    assert all(o.exists() for o in outs) and json.loads(out)["outs"] == [str(o) for o in outs]
    seg = pydicom.dcmread(str(outs[0]))
    assert {r.ReferencedSOPInstanceUID for r in seg.ReferencedSeriesSequence[0].ReferencedInstanceSequence} == \
        {pydicom.dcmread(str(f)).file_meta.MediaStorageSOPInstanceUID for f in series.iterdir()}
    report = subprocess.run([_tool("dciodvfy"), str(outs[0])], capture_output=True, text=True, errors="replace")
    assert [ln for ln in (report.stdout + report.stderr).splitlines() if ln.startswith("Error")] == []


def test_no_study_uid_end_to_end_drops_only_the_dcm(capsys, tmp_path, monkeypatch):
    import json

    series = build("ct-no-study-uid", tmp_path / "s")
    code, out, err = _segment(capsys, series, tmp_path / "m.dcm", tmp_path / "m.nii.gz")
    assert code == 0, err
    res = json.loads(out)
    assert not (tmp_path / "m.dcm").exists() and (tmp_path / "m.nii.gz").exists()
    assert any("m.dcm was not written: the source series has no StudyInstanceUID" in n for n in res["notes"])

    import medvolcore.pipeline as pipeline

    def no_model(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(pipeline.Pipeline, "__init__", no_model)
    code, out, err = _segment(capsys, series, tmp_path / "only.dcm")
    assert code != 0 and len(err.strip().splitlines()) == 1 and "has no StudyInstanceUID" in err
    assert not (tmp_path / "only.dcm").exists()
