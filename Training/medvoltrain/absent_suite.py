"""Challenge-layout cases made from a CT and its label map, and the absent-target suite made from
the TotalSegmentator files shipped in ``Testing/data/totalsegmentator``.

:func:`write_case` turns a NIfTI CT and label map into ``imgs/<case>.npz`` and ``gts/<case>.npz``
(axes superior, posterior, left — a SimpleITK array of an LPS image, the challenge's; spacing in that
order). :func:`write_absent_suite` writes two cases whose prompts include structures that are not
in the volume:

* ``ts_slab`` — the upper-abdomen slab (``example_ct_sm``): liver, spleen and gallbladder are in it;
  the urinary bladder and the left femur are in the same patient's full CT but **outside this
  field of view**;
* ``ts_left_kidney_removed`` — the same slab with the left kidney **removed**: its voxels set to
  fat (−100 HU) and its label cleared, so a query for it has no target; the right kidney and liver
  stay.

Prompts are the TotalSegmentator class names in words; class ids are TotalSegmentator's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from . import challenge

FAT_HU = -100.0
SLAB_PROMPTS = {5: "liver", 1: "spleen", 4: "gallbladder", 21: "urinary bladder", 75: "left femur"}
REMOVED_PROMPTS = {3: "left kidney", 2: "right kidney", 5: "liver"}
REMOVED_LABEL = 3  # TotalSegmentator's left kidney


def _lps_order(path) -> tuple:
    """``(array on axes superior, posterior, left; spacing in that order)`` of a NIfTI file."""
    import nibabel as nib
    import nibabel.orientations as nio

    img = nib.load(str(path))
    ornt = nio.ornt_transform(nio.io_orientation(img.affine), nio.axcodes2ornt(("L", "P", "S")))
    data = nio.apply_orientation(np.asarray(img.dataobj), ornt)
    zooms = np.asarray(img.header.get_zooms()[:3], float)
    spacing = [0.0, 0.0, 0.0]  # of the L, P, S axes: input axis i becomes output axis ornt[i, 0]
    for i in range(3):
        spacing[int(ornt[i, 0])] = float(zooms[i])
    return np.ascontiguousarray(np.transpose(data, (2, 1, 0))), tuple(spacing[::-1])


def write_case(out_dir, name: str, ct_path, labels_path, prompts: Dict[int, str], *,
               remove: Optional[int] = None) -> Path:
    """Write ``imgs/<name>.npz`` and ``gts/<name>.npz``; the gts keep only the prompted classes.
    ``remove``: a class whose voxels become fat in the image and background in the labels."""
    out_dir = Path(out_dir)
    imgs, spacing = _lps_order(ct_path)
    labels, _ = _lps_order(labels_path)
    if labels.shape != imgs.shape:
        raise ValueError(f"{labels_path} and {ct_path} are not on one grid")
    imgs = imgs.astype(np.int16)
    if remove is not None:
        imgs[labels == remove] = int(FAT_HU)
        labels = np.where(labels == remove, 0, labels)
    gts = np.where(np.isin(labels, list(prompts)), labels, 0).astype(np.uint8)
    challenge.write_image(out_dir / "imgs" / f"{name}.npz", imgs, spacing, prompts)
    (out_dir / "gts").mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out_dir / "gts" / f"{name}.npz", gts=gts)
    return out_dir


def write_absent_suite(real_dir, out_dir) -> Path:
    """The two cases of the module docstring, from ``real_dir/totalsegmentator``."""
    ts = Path(real_dir) / "totalsegmentator"
    ct, seg = ts / "example_ct_sm.nii.gz", ts / "example_seg.nii.gz"
    write_case(out_dir, "ts_slab", ct, seg, SLAB_PROMPTS)
    write_case(out_dir, "ts_left_kidney_removed", ct, seg, REMOVED_PROMPTS, remove=REMOVED_LABEL)
    (Path(out_dir) / "suite.json").write_text(json.dumps({
        "outside_field_of_view": {"ts_slab": [21, 75]}, "removed": {"ts_left_kidney_removed": [REMOVED_LABEL]}},
        indent=1) + "\n")
    return Path(out_dir)
