"""A series is one patient's, study's, series' and frame of reference's (refused in one line naming
the attribute and two files, before any model loads); a DICOM-SEG that cannot be written never loses
the other outputs; the command line says so in its printed notes, and writes a BINARY SEG by default
(``--seg-type labelmap`` to opt in)."""

from __future__ import annotations

import json

import pytest

from medvolcore.cli import main
from medvolcore.errors import VolumeError
from medvolcore.jobs import SegmentOutputs, SegmentRequest, run_segment_job

from core.dicomgen import SYNTAXES, write_series
from core.test_dicom_generated import BOX, dciodvfy_errors
from core.test_jobs import calls, propagator  # noqa: F401  (fixtures)

hd = pytest.importorskip("highdicom")


def _spec(**changes) -> dict:
    spec = {"charset": 0, "type2": {}, "blank": [], "disagree": None, "positions": "even", "rescale": "same",
            "syntax": SYNTAXES[0]}
    spec.update(changes)
    return spec


@pytest.mark.parametrize("attribute", ["PatientID", "PatientName", "StudyInstanceUID", "FrameOfReferenceUID"])
def test_a_series_of_two_patients_studies_or_frames_is_refused(tmp_path, attribute):
    from medvolcore.volume import load_volume

    files = write_series(_spec(disagree=attribute), tmp_path / "s")
    with pytest.raises(VolumeError) as e:
        load_volume(tmp_path / "s")
    message = str(e.value)
    assert attribute in message and "\n" not in message
    assert files[-1].name in message and any(f.name in message for f in files[:-1])  # two files named
    assert "PAT-B" not in message and "Other^Patient" not in message  # who the patients are is not said


def test_a_name_missing_on_some_slices_is_not_a_second_patient(tmp_path):
    from medvolcore.volume import load_volume

    write_series(_spec(disagree="PatientName", type2={"PatientName": "missing"}), tmp_path / "s")
    assert load_volume(tmp_path / "s").dicom is not None


def test_a_failed_seg_keeps_the_other_outputs(tmp_path, calls, monkeypatch):  # noqa: F811
    import medvolcore.dicomseg as dicomseg

    def broken(*a, **k):
        raise ValueError("disk said no")

    write_series(_spec(), tmp_path / "s")
    monkeypatch.setattr(dicomseg, "save_dicom_seg", broken)
    out = tmp_path / "o"
    res = run_segment_job(calls, tmp_path / "s", SegmentRequest(key_slice=2, boxes=[BOX], span=0),
                          SegmentOutputs([out / "m.dcm", out / "m.nii.gz"], qc=out / "m.png", stats=out / "m.json"))
    assert sorted(p.name for p in out.iterdir()) == ["m.json", "m.nii.gz", "m.png"]
    assert res["outs"] == [str(out / "m.nii.gz")]
    assert any("m.dcm was not written: disk said no" in n for n in res["notes"])


def _propagate(capsys, series, *outs, extra=()):
    argv = ["propagate", "--volume", series, "--slice", 2, "--box", *BOX, "--random-weights", 0, "--image-size", 64,
            "--window", 0, "--no-progress"] + [a for o in outs for a in ("--out", o)] + list(extra)
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_an_empty_character_set_is_the_default_repertoire(tmp_path, capsys):
    """GE's present-but-empty SpecificCharacterSet: every output is written, the SEG in UTF-8."""
    import pydicom

    write_series(_spec(charset=1), tmp_path / "s")
    dcm, nii = tmp_path / "m.dcm", tmp_path / "m.nii.gz"
    code, out, err = _propagate(capsys, tmp_path / "s", dcm, nii)
    assert code == 0, err
    assert dcm.is_file() and nii.is_file() and "internal error" not in err
    ds = pydicom.dcmread(str(dcm))
    assert ds.SpecificCharacterSet == "ISO_IR 192" and ds.SegmentationType == "BINARY"
    assert str(ds.PatientName) == "Doe^John" and dciodvfy_errors(dcm) == []


def test_a_seg_that_cannot_reference_its_series_is_said_in_the_printed_notes(tmp_path, capsys):
    write_series(_spec(blank=["StudyInstanceUID"]), tmp_path / "s")
    dcm, nii = tmp_path / "m.dcm", tmp_path / "m.nii.gz"
    code, out, err = _propagate(capsys, tmp_path / "s", dcm, nii)
    assert code == 0, err
    assert nii.is_file() and not dcm.exists()
    assert f"{dcm} was not written" in out + err  # printed, not only in --json


def test_seg_type_labelmap_is_an_opt_in(tmp_path, capsys):
    import pydicom

    write_series(_spec(), tmp_path / "s")
    code, out, err = _propagate(capsys, tmp_path / "s", tmp_path / "m.dcm", extra=["--seg-type", "labelmap", "--json"])
    assert code == 0, err
    assert pydicom.dcmread(str(tmp_path / "m.dcm")).SegmentationType == "LABELMAP"
    assert json.loads(out)["outs"] == [str(tmp_path / "m.dcm")]
    with pytest.raises(SystemExit) as e:
        _propagate(capsys, tmp_path / "s", tmp_path / "n.dcm", extra=["--seg-type", "bitmap"])
    assert e.value.code == 2 and "--seg-type" in capsys.readouterr().err


def test_bidirectional_controls_are_removed_from_seg_text(tmp_path):
    """A right-to-left override would show 'liver' as another label in a viewer: removed, as a control
    character is."""
    import pydicom

    from medvolcore.dicomseg import save_dicom_seg
    from medvolcore.volume import load_volume

    write_series(_spec(), tmp_path / "s")
    ct = load_volume(tmp_path / "s")
    import numpy as np

    labels = np.zeros(ct.shape, np.uint8)
    labels[8:20, 8:20, 1:4] = 1
    query = "the \u202eright\u202c kidney\u2066 \x07cyst"
    out = save_dicom_seg(labels, ct.affine, ct, tmp_path / "m.dcm", [{"name": query, "value": 1}],
                         algorithm="MedVol \u202etest", version="0")
    ds = pydicom.dcmread(str(out))
    seg = ds.SegmentSequence[0]
    assert seg.SegmentLabel == seg.SegmentDescription == "the right kidney cyst"
    assert seg.SegmentAlgorithmName == "MedVol test"


def test_seg_type_at_every_door():
    """The worker's wire key and a batch run's option carry the SEG type; anything else is refused by name."""
    from medvolcore.batch import BatchOptions
    from medvolcore.request import FieldError

    assert SegmentRequest.from_wire({"op": "segment", "query": "liver", "seg_type": "labelmap"}).seg_type == "labelmap"
    assert SegmentRequest.from_wire({"op": "segment", "query": "liver"}).seg_type == "binary"
    with pytest.raises(FieldError, match="'seg_type' must be binary or labelmap"):
        SegmentRequest.from_wire({"op": "propagate", "anchor": {}, "seg_type": "LABELMAP"})
    settings = BatchOptions(seg_type="labelmap").request_settings()
    assert SegmentRequest.from_manifest({"query": "liver"}, **settings).seg_type == "labelmap"
