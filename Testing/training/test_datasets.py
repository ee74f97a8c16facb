"""``medvol-train prepare``/``evaluate`` compare label maps by the same geometry rule as ``medvol
metrics`` and ``medvol batch`` (medvolcore.geometry)."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from training_data import write_jsonl

from medvoltrain.datasets import read_manifest
from medvoltrain.prepare import PrepareSettings, load_samples, prepare


def test_training_cases_use_the_same_rule(tmp_path, ct_sm_path, seg_sm_path):
    """``medvol-train prepare`` (and ``evaluate``, which re-reads cases the same way) take a label map
    on a flipped grid: the stack labels equal those of the label map stored on the CT's own grid."""
    from medvoltrain.datasets import Case as TrainCase, CaseError, load_case

    seg = nib.load(str(seg_sm_path))
    arr = np.asarray(seg.dataobj)
    flipped = seg.affine.copy()
    flipped[:3, 1] *= -1
    flipped[:3, 3] = seg.affine[:3, :3] @ [0, arr.shape[1] - 1, 0] + seg.affine[:3, 3]
    nib.save(nib.Nifti1Image(np.ascontiguousarray(arr[:, ::-1, :]), flipped), str(tmp_path / "seg_flipped.nii.gz"))
    nib.save(nib.Nifti1Image(arr[:, :, :20].copy(), seg.affine), str(tmp_path / "seg_short.nii.gz"))

    def case(labels):
        return TrainCase(id="c", volume=Path(ct_sm_path), labels=labels, targets={}, split="train", dataset=None)

    stack, labels, _w, _i = load_case(case(tmp_path / "seg_flipped.nii.gz"))
    assert np.array_equal(labels.label_stack, stack.to_stack(arr))
    with pytest.raises(CaseError) as ei:
        load_case(case(tmp_path / "seg_short.nii.gz"))
    assert ei.value.reason == "grid_mismatch"


# ---- a row's targets never swap labels (probe 43.2) --------------------------------------------
# ``medvol-train prepare`` never swaps labels between a row's targets (probe 43.2).
#
# Before: ``{"liver": 5, "liver ": 1}`` gave one sample ``("liver", [1])`` (the liver query trained on
# the spleen's label), ``{"liver!": 5, "liver?": 1}`` two samples sharing one mask file, and a target
# named twice in the targets JSON kept the last, all with exit 0. Now each of these refuses the row
# with one line naming both names, and the rest of the manifest goes on.
# 

SPLEEN, LIVER = 1, 5


def _row(cid, targets, ct, seg):
    return {"id": cid, "volume": str(ct), "labels": str(seg), "split": "train", "targets": targets}


def _refused(bad, cid):
    (row,) = [b for b in bad if b["case"] == cid]
    assert row["reason"] == "bad_row"
    assert "\n" not in row["message"]
    return row["message"]


@pytest.mark.probe("43.2", "prepare: targets 'liver' and 'liver ' (one target once normalised), two labels")
def test_names_alike_once_normalised_refuse_the_row(tmp_path):
    m = write_jsonl(tmp_path / "m.jsonl", [_row("a", {"liver": LIVER, "liver ": SPLEEN}, "ct.nii.gz", "seg.nii.gz"),
                                          _row("b", {"Liver_Left": 2, "liver  left": 3}, "ct.nii.gz", "seg.nii.gz"),
                                          _row("ok", {"liver": LIVER, "spleen": SPLEEN}, "ct.nii.gz", "seg.nii.gz")])
    cases, bad = read_manifest(m)
    assert [c.id for c in cases] == ["ok"] and cases[0].targets == {"liver": [LIVER], "spleen": [SPLEEN]}
    msg = _refused(bad, "a")
    assert "'liver'" in msg and "'liver '" in msg
    msg = _refused(bad, "b")
    assert "'Liver_Left'" in msg and "'liver  left'" in msg


@pytest.mark.probe("43.2", "prepare: targets 'liver!' and 'liver?' (one mask file), two labels")
def test_names_sharing_a_mask_file_refuse_the_row(tmp_path):
    m = write_jsonl(tmp_path / "m.jsonl", [_row("a", {"liver!": LIVER, "liver?": SPLEEN}, "ct.nii.gz", "seg.nii.gz")])
    cases, bad = read_manifest(m)
    assert cases == []
    msg = _refused(bad, "a")
    assert "'liver!'" in msg and "'liver?'" in msg and "mask file" in msg


@pytest.mark.probe("43.2", "prepare: CSV targets JSON naming 'liver' twice")
def test_a_key_named_twice_in_the_csv_targets_refuses_the_row(tmp_path):
    m = tmp_path / "m.csv"
    m.write_text('id,volume,labels,split,targets\n'
                 'a,ct.nii.gz,seg.nii.gz,train,"{""liver"": 5, ""liver"": 1}"\n', encoding="utf-8")
    cases, bad = read_manifest(m)
    assert cases == []
    assert "'liver' twice" in _refused(bad, "a")


@pytest.mark.probe("43.2", "prepare: JSONL row whose targets object names 'liver' twice")
def test_a_target_named_twice_in_a_jsonl_row_refuses_the_row(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text('{"id": "a", "volume": "ct.nii.gz", "labels": "seg.nii.gz", "split": "train", '
                 '"targets": {"liver": 5, "liver": 1}}\n'
                 + json.dumps(_row("ok", {"liver": LIVER}, "ct.nii.gz", "seg.nii.gz")) + "\n", encoding="utf-8")
    cases, bad = read_manifest(m)
    assert [c.id for c in cases] == ["ok"]
    (row,) = bad
    assert row["reason"] == "bad_row" and "'liver' twice" in row["message"] and "\n" not in row["message"]


def test_prepare_trains_no_query_on_another_label(tmp_path, ct_sm_path, seg_sm_path):
    """End to end: the refused rows are listed, the good row is prepared, no sample swaps labels."""
    m = write_jsonl(tmp_path / "m.jsonl", [_row("alike", {"liver": LIVER, "liver ": SPLEEN}, ct_sm_path, seg_sm_path),
                                          _row("file", {"liver!": LIVER, "liver?": SPLEEN}, ct_sm_path, seg_sm_path),
                                          _row("ok", {"liver": LIVER}, ct_sm_path, seg_sm_path)])
    summary = prepare(m, tmp_path / "D", PrepareSettings(negative_fraction=0.0), progress=False)
    assert {(s["case"], s["reason"]) for s in summary["skipped"]} == {("alike", "bad_row"), ("file", "bad_row")}
    samples = load_samples(tmp_path / "D")
    assert [(s["id"], s["label_ids"]) for s in samples] == [("ok/liver", [LIVER])]
