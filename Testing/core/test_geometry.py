"""Metrics by geometry (medvolcore.geometry): a mask compared with a ground truth by where it lies.

The real TotalSegmentator label map stored as a DICOM series on a flipped grid (as DICOM's LPS rows
and columns store it) scores a geometrically perfect mask Dice 1.0; compared index by index it
would not. No model is loaded here.
"""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from medvolcore.cli import main
from medvolcore.errors import VolumeError
from medvolcore.geometry import gt_on_grid
from medvolcore.metrics import dice
from medvolcore.volume import CTVolume, load_label_map

from ts_labels import LIVER


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
