"""``medvol-train prepare``/``evaluate`` compare label maps by the same geometry rule as ``medvol
metrics`` and ``medvol batch`` (medvolcore.geometry)."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest


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
