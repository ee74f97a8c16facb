"""Metrics by geometry (medvolcore.geometry) and ``medvol batch``'s check before any model loads.

The real TotalSegmentator label map stored as a DICOM series on a flipped grid (as DICOM's LPS rows
and columns store it) scores a geometrically perfect mask Dice 1.0; compared index by index it
would not. No model is loaded here.
"""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.cli import main
from medvolcore.errors import VolumeError
from medvolcore.geometry import gt_on_grid, match_grids
from medvolcore.metrics import dice
from medvolcore.volume import CTVolume, load_label_map

from conftest import LIVER


def _labels() -> np.ndarray:
    a = np.zeros((12, 10, 6), dtype=np.uint8)
    a[2:7, 1:6, 1:4] = 5
    a[8:11, 6:9, 3:6] = 2
    return a


AFFINE = np.array([[0.8, 0, 0, -40.0], [0, 0.8, 0, 12.0], [0, 0, 2.5, -100.0], [0, 0, 0, 1]])


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---- item 5: one rule, tested on the real label map and on synthetic grids ------------------------

def test_real_label_map_as_flipped_dicom_scores_one(capsys, tmp_path, seg_sm_path, write_dicom_series):
    """The real label map written as a DICOM series reoriented to LPS (rows and columns flipped
    against the NIfTI): the liver mask taken from the NIfTI is geometrically perfect."""
    sitk = pytest.importorskip("SimpleITK")
    img = sitk.ReadImage(str(seg_sm_path))
    write_dicom_series(sitk, sitk.DICOMOrient(img, "LPS"), tmp_path / "seg_dicom")
    nifti = load_label_map(seg_sm_path)
    dicom = load_label_map(tmp_path / "seg_dicom")
    assert dicom.shape == nifti.shape and not np.allclose(dicom.affine, nifti.affine)  # same shape, another grid
    liver = nifti.array == LIVER
    nib.save(nib.Nifti1Image(liver.astype(np.uint8), nifti.affine), str(tmp_path / "pred.nii.gz"))
    naive = dice(liver, dicom.array == LIVER)  # index by index, what `medvol metrics` used to report
    assert naive < 0.9
    code, out, err = _cli(capsys, "metrics", "--pred", tmp_path / "pred.nii.gz", "--gt", tmp_path / "seg_dicom",
                          "--label", LIVER, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["dice"] == 1.0 and res["iou"] == 1.0 and res["gt_voxels"] == int(liver.sum())
    assert "flipped axes 0,1" in res["gt_resampled"] and "exact" in res["gt_resampled"]


def test_permuted_and_flipped_axes_are_exact(capsys, tmp_path):
    a = _labels()
    stored = np.transpose(a, (2, 0, 1))[:, ::-1, :]  # stored[k, I-1-i, j] = a[i, j, k]
    index = np.zeros((4, 4))  # stored index (p, q, r) -> a's index (i, j, k) = (I-1-q, r, p)
    index[0, 1], index[0, 3], index[1, 2], index[2, 0], index[3, 3] = -1, a.shape[0] - 1, 1, 1, 1
    nib.save(nib.Nifti1Image(a, AFFINE), str(tmp_path / "pred.nii.gz"))
    nib.save(nib.Nifti1Image(np.ascontiguousarray(stored), AFFINE @ index), str(tmp_path / "gt.nii.gz"))
    code, out, err = _cli(capsys, "metrics", "--pred", tmp_path / "pred.nii.gz", "--gt", tmp_path / "gt.nii.gz", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["per_label"]["5"]["dice"] == 1.0 and res["per_label"]["2"]["dice"] == 1.0
    assert "axes permuted" in res["gt_resampled"]
    on = gt_on_grid(CTVolume(a, AFFINE), CTVolume(np.ascontiguousarray(stored), AFFINE @ index))
    assert on.kind == "reoriented" and np.array_equal(on.array, a)


def test_same_grid_is_untouched_and_a_small_shift_is_resampled():
    a = _labels()
    assert gt_on_grid(CTVolume(a, AFFINE), CTVolume(a.copy(), AFFINE)).note is None
    shifted = AFFINE.copy()
    shifted[:3, 3] += AFFINE[:3, :3] @ [0.3, 0, -0.2]  # within half a voxel: nearest neighbour keeps every voxel
    on = gt_on_grid(CTVolume(a, AFFINE), CTVolume(a.copy(), shifted))
    assert on.kind == "resampled" and "nearest neighbour" in on.note and np.array_equal(on.array, a)
    shifted[:3, 3] = AFFINE[:3, 3] + AFFINE[:3, :3] @ [1.0, 0, 0]  # one voxel over: resampled, one slab lost
    with pytest.raises(VolumeError, match="do not cover the same space"):
        gt_on_grid(CTVolume(a, AFFINE), CTVolume(a.copy(), shifted))


@pytest.mark.parametrize("what", ["extent", "spacing"])
def test_another_extent_or_spacing_is_one_error(capsys, tmp_path, what):
    a = _labels()
    nib.save(nib.Nifti1Image(a, AFFINE), str(tmp_path / "pred.nii.gz"))
    if what == "extent":
        gt = nib.Nifti1Image(a[:, :, :4].copy(), AFFINE)
    else:
        gt = nib.Nifti1Image(a, AFFINE @ np.diag([2.0, 2.0, 1.0, 1.0]))
    nib.save(gt, str(tmp_path / "gt.nii.gz"))
    code, out, err = _cli(capsys, "metrics", "--pred", tmp_path / "pred.nii.gz", "--gt", tmp_path / "gt.nii.gz")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "do not cover the same space" in lines[0] and out == ""


# ---- item 7: the batch manifest checked before any model loads --------------------------------------

class _RecordingPipeline:
    """Stands in for a Pipeline: records whether anything tried to load a model."""

    preset, smoke, identity = "tiny", True, None

    def __init__(self):
        self.calls = []

    def load(self):
        self.calls.append("load")
        raise AssertionError("a model was loaded")


def _tiny(path: Path, array=None, affine=None) -> Path:
    nib.save(nib.Nifti1Image(_labels() if array is None else array, AFFINE if affine is None else affine), str(path))
    return path


def test_missing_file_in_row_500_stops_before_any_model(capsys, tmp_path):
    from medvolcore.batch import BatchOptions, ManifestError, run_batch

    _tiny(tmp_path / "ct.nii.gz")
    _tiny(tmp_path / "seg.nii.gz")
    _tiny(tmp_path / "seg_other.nii.gz", _labels()[:, :, :3].copy())
    lines = ["id,volume,query,gt,label"] + [f"c{i},ct.nii.gz,liver,seg.nii.gz,5" for i in range(1, 500)]
    lines.append("c500,no_such_ct.nii.gz,liver,,")
    lines[10] = "c10,ct.nii.gz,liver,seg_other.nii.gz,5"  # a ground truth of another extent
    manifest = tmp_path / "cases.csv"
    manifest.write_text("\n".join(lines) + "\n")
    pipe = _RecordingPipeline()
    with pytest.raises(ManifestError) as ei:
        run_batch(manifest, tmp_path / "out", BatchOptions(progress=False), pipeline=pipe)
    assert pipe.calls == [] and not (tmp_path / "out").exists()
    assert [d.split(":")[0] for d in ei.value.details] == ["line 11 (c10)", "line 501 (c500)"]
    code, out, err = _cli(capsys, "batch", "--manifest", manifest, "--out-dir", tmp_path / "out", "--preset", "tiny")
    got = err.strip().splitlines()
    assert code == 2 and len(got) == 3 and "Traceback" not in err
    assert "does not cover" not in got[0] and "do not cover the same space" in got[0] and "does not exist" in got[1]
    assert "2 problem(s)" in got[2] and "--skip-invalid" in got[2]
    # --dry-run with --skip-invalid: says what would run, loads and writes nothing
    res = run_batch(manifest, tmp_path / "out", BatchOptions(progress=False, dry_run=True, skip_invalid=True),
                    pipeline=pipe)
    assert pipe.calls == [] and not (tmp_path / "out").exists() and res.exit_code == 0
    assert len(res.info["would_run"]) == 498 and [c["id"] for c in res.info["invalid_cases"]] == ["c10", "c500"]


def test_batch_check_accepts_a_flipped_ground_truth_grid(tmp_path):
    from medvolcore.batch import Case, check_case_files

    a = _labels()
    flipped = AFFINE.copy()
    flipped[:3, 0] *= -1
    flipped[:3, 3] = AFFINE[:3, :3] @ [a.shape[0] - 1, 0, 0] + AFFINE[:3, 3]
    ct, gt = _tiny(tmp_path / "ct.nii.gz"), _tiny(tmp_path / "gt.nii.gz", np.ascontiguousarray(a[::-1]), flipped)
    case = Case(id="a", volume=ct, query="liver", gt=gt)
    check_case_files([case])
    assert case.problem is None
    m = match_grids(a.shape, AFFINE, a.shape, flipped)
    assert m.kind == "reoriented" and "flipped axes 0" in m.note

