"""RAS ↔ IJK and anchor ↔ ROI geometry of the Slicer module, checked against MedVolCore's stack
on the real CT and on the same voxels stored LPS, with permuted axes and obliquely."""

from __future__ import annotations

import nibabel as nib
import nibabel.orientations as nio
import numpy as np
import pytest
from MedVolR1SlicerLib.geometry import (
    GeometryError,
    RoiBox,
    VolumeGeometry,
    anchor_from_rois,
    closest_axes,
    rois_from_anchor,
)

KIDNEY_RIGHT, KIDNEY_LEFT, LIVER = 2, 3, 5  # TotalSegmentator v2 ids (class_map_total_v2.json)
from medvolcore.anchor import EvidenceAnchor, anchor_from_mask
from medvolcore.stack import AxialStack
from medvolcore.volume import CTVolume


def _rot(axis: int, deg: float) -> np.ndarray:
    t = np.deg2rad(deg)
    c, s = np.cos(t), np.sin(t)
    r = np.eye(3)
    i, j = [a for a in range(3) if a != axis]
    r[i, i], r[i, j], r[j, i], r[j, j] = c, -s, s, c
    return r


def _variants(array: np.ndarray, affine: np.ndarray) -> dict:
    """The same voxels stored in other ways: LPS-flipped, axes permuted, oblique."""
    out = {"ras": (array, affine)}
    # LPS-stored: i and j reversed (as DICOM-derived files often are); the affine follows.
    flip = np.diag([-1.0, -1.0, 1.0, 1.0])
    flip[0, 3], flip[1, 3] = array.shape[0] - 1, array.shape[1] - 1
    out["lps"] = (array[::-1, ::-1, :], affine @ flip)
    # slice axis first: array (k, i, j)
    perm = np.zeros((4, 4))
    perm[3, 3] = 1
    perm[2, 0] = perm[0, 1] = perm[1, 2] = 1  # new index (k, i, j) -> old (i, j, k)
    out["permuted"] = (np.transpose(array, (2, 0, 1)), affine @ perm)
    # oblique: rotated 20° about A and 10° about S (directions only; voxels unchanged)
    obl = affine.copy()
    obl[:3, :3] = _rot(1, 20) @ _rot(2, 10) @ affine[:3, :3]
    out["oblique"] = (array, obl)
    return out


def _liver(real, name="ras"):
    """The liver's anchor on a variant of the real CT, its one ROI and the key slice index."""
    labels, affine = real
    arr, aff = _variants(labels, affine)[name]
    stack = AxialStack(CTVolume(arr, aff))
    geo = VolumeGeometry(aff, arr.shape)
    anchor = anchor_from_mask(stack.data == LIVER, stack=stack)
    (roi,), k = rois_from_anchor(geo, anchor.to_dict())
    return stack, geo, anchor, roi, k


@pytest.fixture(scope="module")
def real(ct_sm_path, seg_sm_path):
    ct = nib.load(str(ct_sm_path))
    seg = nib.load(str(seg_sm_path))
    return np.asarray(seg.dataobj).astype(np.uint8), ct.affine


@pytest.mark.parametrize("name", ["ras", "lps", "permuted", "oblique"])
def test_closest_axes_and_slice_axis_match_medvolcore(real, name):
    labels, affine = real
    arr, aff = _variants(labels, affine)[name]
    ornt = nio.io_orientation(aff)
    assert closest_axes(aff) == [(int(a), int(s)) for a, s in ornt]
    geo = VolumeGeometry(aff, arr.shape)
    stack = AxialStack(CTVolume(arr, aff))
    assert geo.slice_axis == stack.perm[0]
    assert geo.depth == stack.depth
    # RAS <-> IJK round trip and agreement with the volume's affine
    ijk = np.array([[0, 0, 0], [3.5, 7.25, 11], [arr.shape[0] - 1, arr.shape[1] - 1, arr.shape[2] - 1]])
    ras = geo.to_ras(ijk)
    np.testing.assert_allclose(ras, nib.affines.apply_affine(aff, ijk), atol=1e-9)
    np.testing.assert_allclose(geo.to_ijk(ras), ijk, atol=1e-9)


@pytest.mark.parametrize("name", ["ras", "lps", "permuted", "oblique"])
@pytest.mark.parametrize("label_ids,n_boxes", [((LIVER,), 1), ((KIDNEY_RIGHT, KIDNEY_LEFT), 2)])
def test_anchor_to_roi_to_anchor_round_trip(real, name, label_ids, n_boxes):
    labels, affine = real
    arr, aff = _variants(labels, affine)[name]
    stack = AxialStack(CTVolume(arr, aff))
    mask = np.isin(stack.data, label_ids)
    anchor = anchor_from_mask(mask, stack=stack, query="q")
    assert len(anchor.boxes) == n_boxes
    geo = VolumeGeometry(aff, arr.shape)

    rois, k = rois_from_anchor(geo, anchor.to_dict())
    assert len(rois) == n_boxes
    # the key slice along the volume's slice axis is the stack slice, in source indices
    assert k == int(round(stack.stack_to_source_index([anchor.slice, 0, 0])[stack.perm[0]]))
    for roi, box in zip(rois, anchor.boxes):
        assert np.linalg.det(roi.axes) == pytest.approx(1.0)  # a proper rotation, also for LPS
        # faces on voxel edges: corners span exactly the box ±½ voxel, one voxel thick
        zyx = stack.ras_to_stack(roi.corners())
        x0, y0, x1, y1 = box
        np.testing.assert_allclose(zyx.min(axis=0), [anchor.slice - 0.5, y0 - 0.5, x0 - 0.5], atol=1e-6)
        np.testing.assert_allclose(zyx.max(axis=0), [anchor.slice + 0.5, y1 + 0.5, x1 + 0.5], atol=1e-6)

    back, notes = anchor_from_rois(geo, rois, k, query="q")
    assert notes == []
    assert back["source"] == "user" and "boxes" not in back  # world only, as Slicer writes it
    again = EvidenceAnchor.from_dict(back, stack)
    assert again.slice == anchor.slice
    assert again.boxes == anchor.boxes
    np.testing.assert_allclose(back["world"]["slice_center_ras"], anchor.world["slice_center_ras"], atol=1e-6)


@pytest.mark.parametrize("name", ["ras", "lps", "oblique"])
def test_moved_box_lands_where_it_was_dragged(real, name):
    stack, geo, anchor, roi, k = _liver(real, name)
    # drag 4 voxels towards the image's right edge (stack +x) and 2 down (stack +y), in mm
    step = stack.stack_to_ras([0, 2, 4]) - stack.stack_to_ras([0, 0, 0])
    moved = RoiBox(roi.center + step, roi.size, roi.axes)
    back, notes = anchor_from_rois(geo, [moved], k)
    got = EvidenceAnchor.from_dict(back, stack)
    x0, y0, x1, y1 = anchor.boxes[0]
    want = [min(x0 + 4, stack.width - 1), y0 + 2, min(x1 + 4, stack.width - 1), y1 + 2]
    assert got.boxes == [want]
    assert got.slice == anchor.slice


def test_resized_box_takes_voxels_whose_centres_it_covers(real):
    stack, geo, anchor, roi, k = _liver(real)
    # grow by 1.4 voxels in total along every in-plane axis: each side moves 0.7 voxel, which
    # passes the neighbouring voxel centre (0.5 away) on both sides
    grow = np.array([1.4 * geo.spacing[a] if a != geo.slice_axis else 0.0 for a in range(3)])
    bigger = RoiBox(roi.center, roi.size + grow, roi.axes)
    got = EvidenceAnchor.from_dict(anchor_from_rois(geo, [bigger], k)[0], stack)
    x0, y0, x1, y1 = anchor.boxes[0]
    assert got.boxes == [[x0 - 1, y0 - 1, x1 + 1, y1 + 1]]
    # shrinking by 0.8 voxel (0.4 a side) does not yet lose a voxel column
    smaller = RoiBox(roi.center, roi.size - grow * (0.8 / 1.4), roi.axes)
    assert EvidenceAnchor.from_dict(anchor_from_rois(geo, [smaller], k)[0], stack).boxes == anchor.boxes


def test_box_off_the_key_slice_is_put_back_with_a_message(real):
    stack, geo, anchor, roi, k = _liver(real)
    up = np.zeros(3)
    up[geo.slice_axis] = 3
    off = RoiBox(geo.to_ras(geo.to_ijk(roi.center) + up), roi.size, roi.axes)
    back, notes = anchor_from_rois(geo, [off], k)
    assert any("off the key slice" in n for n in notes)
    got = EvidenceAnchor.from_dict(back, stack)
    assert (got.slice, got.boxes) == (anchor.slice, anchor.boxes)


def test_box_outside_the_volume_is_cut_or_refused(real):
    stack, geo, anchor, roi, k = _liver(real)
    x0, y0, x1, y1 = anchor.boxes[0]
    # push the box so that it hangs 5 voxels over the image's left edge (stack x < 0)
    shift = stack.stack_to_ras([0, 0, -(x0 + 5)]) - stack.stack_to_ras([0, 0, 0])
    over = RoiBox(roi.center + shift, roi.size, roi.axes)
    back, notes = anchor_from_rois(geo, [over], k)
    assert any("outside the volume" in n for n in notes)
    got = EvidenceAnchor.from_dict(back, stack)
    assert got.boxes == [[0, y0, x1 - x0 - 5, y1]]
    # entirely off the image: refused, with a message naming the box
    away = stack.stack_to_ras([0, 0, stack.width + 50]) - stack.stack_to_ras([0, 0, 0])
    with pytest.raises(GeometryError, match="box 1 lies outside the volume"):
        anchor_from_rois(geo, [RoiBox(roi.center + away, roi.size, roi.axes)], k)
    with pytest.raises(GeometryError, match="no box left"):
        anchor_from_rois(geo, [], k)


def test_rotated_box_uses_its_bounding_box(real):
    stack, geo, anchor, roi, k = _liver(real)
    turned = RoiBox(roi.center, roi.size, _rot(2, 30) @ roi.axes)
    back, notes = anchor_from_rois(geo, [turned], k)
    assert any("rotated" in n for n in notes)
    got = EvidenceAnchor.from_dict(back, stack)
    x0, y0, x1, y1 = anchor.boxes[0]
    gx0, gy0, gx1, gy1 = got.boxes[0]
    assert gx0 < x0 and gx1 > x1  # the rotated box's footprint is wider than the original


def test_roi_matrix_round_trip_and_errors():
    roi = RoiBox([10, -20, 30], [4, 6, 3], _rot(2, 15))
    m = roi.object_to_node()
    assert m.shape == (4, 4)
    again = RoiBox.from_object_to_node(m, roi.size)
    np.testing.assert_allclose(again.corners(), roi.corners(), atol=1e-9)
    with pytest.raises(GeometryError):
        RoiBox([np.nan, 0, 0], [1, 1, 1])
    with pytest.raises(GeometryError):
        VolumeGeometry(np.diag([1.0, 0.0, 1.0, 1.0]), (4, 4, 4))
    geo = VolumeGeometry(np.eye(4), (10, 10, 10))
    with pytest.raises(GeometryError, match="different slices"):
        rois_from_anchor(geo, {"world": {"boxes_ras": [[[0, 0, 0], [3, 3, 2]]]}})
    with pytest.raises(GeometryError, match="no world boxes"):
        rois_from_anchor(geo, {"slice": 3, "boxes": [[0, 0, 1, 1]]})


@pytest.mark.parametrize("name", ["ras", "lps", "permuted", "oblique"])
def test_world_corners_are_written_in_the_anchor_files_order(real, name):
    """``boxes_ras`` holds the centres of the stack's (x0, y0) and (x1, y1) voxels, in that order."""
    labels, affine = real
    arr, aff = _variants(labels, affine)[name]
    stack = AxialStack(CTVolume(arr, aff))
    anchor = anchor_from_mask(np.isin(stack.data, (KIDNEY_RIGHT, KIDNEY_LEFT)), stack=stack)
    geo = VolumeGeometry(aff, arr.shape)
    rois, k = rois_from_anchor(geo, anchor.to_dict())
    back, _ = anchor_from_rois(geo, rois, k)
    np.testing.assert_allclose(back["world"]["boxes_ras"], anchor.world["boxes_ras"], atol=1e-6)
