"""The absent-target suite's cases (``medvoltrain.absent_suite``) made from the shipped TotalSegmentator
files: a removed organ and structures outside the field of view, in the challenge layout."""

from __future__ import annotations

import nibabel as nib
import numpy as np
from ts_labels import KIDNEY_LEFT, URINARY_BLADDER

from medvoltrain import challenge
from medvoltrain.absent_suite import _lps_order, write_absent_suite


def test_the_suite_is_made_from_the_shipped_label_maps(tmp_path, real_dir):
    """A removed organ: the left kidney's voxels are fat and its label gone; a structure outside the
    field of view: the bladder is in the full CT's label map, not in the slab's."""
    suite = write_absent_suite(real_dir, tmp_path / "DATA")
    ts = real_dir / "totalsegmentator"
    removed = challenge.read_image(suite / "imgs" / "ts_left_kidney_removed.npz")
    slab = challenge.read_image(suite / "imgs" / "ts_slab.npz")
    gts_removed = np.load(suite / "gts" / "ts_left_kidney_removed.npz")["gts"]
    gts_slab = np.load(suite / "gts" / "ts_slab.npz")["gts"]
    assert KIDNEY_LEFT in removed.prompts and not (gts_removed == KIDNEY_LEFT).any()
    kidney = _lps_order(ts / "example_seg.nii.gz")[0] == KIDNEY_LEFT
    assert kidney.sum() > 1000 and (removed.imgs[kidney] == -100).all() and (slab.imgs[kidney] != -100).any()
    assert URINARY_BLADDER in slab.prompts and not (gts_slab == URINARY_BLADDER).any()
    full = np.asarray(nib.load(str(ts / "example_seg_fast_force_split.nii.gz")).dataobj)
    assert (full == URINARY_BLADDER).sum() > 100
    # axis 0 is the axial slice index: the slab's 30 slices
    assert slab.imgs.shape == (30, 101, 122) and slab.spacing == (3.0, 3.0, 3.0)


def test_a_converted_case_shows_the_model_the_same_stack_as_its_nifti(tmp_path, real_dir):
    """The challenge array (axes superior, posterior, left) read back through ``volume_of`` gives the
    canonical axial stack of the original NIfTI, voxel for voxel: the model sees the same slices."""
    from medvolcore.stack import AxialStack
    from medvolcore.volume import load_volume

    suite = write_absent_suite(real_dir, tmp_path / "DATA")
    image = challenge.read_image(suite / "imgs" / "ts_slab.npz")
    ours = AxialStack(challenge.volume_of(image))
    theirs = AxialStack(load_volume(real_dir / "totalsegmentator" / "example_ct_sm.nii.gz"))
    assert ours.shape == theirs.shape and ours.spacing == theirs.spacing
    assert np.array_equal(ours.data, theirs.data)
