"""Tests for medvolcore.anchor: targets from a mask, box geometry, world boxes and the anchor file,
its schemas /2 (correction prompts and a slice range) and /3 (absent anchors).

The expected anchors on the real label map were computed independently of medvolcore (see the
comment above ``EXPECTED``), so an implementation with a wrong orientation, tie rule or
component rule fails here. The world forms of prompts are checked by hand against the affine (a
prompt point's RAS is the affine applied to its source voxel), on the real CT and on an oblique,
permuted grid, so a wrong axis order or flip fails here; every rule of schema /2 has a case that
must be refused with one clear message.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import nibabel as nib
import numpy as np
import pytest

from medvolcore.anchor import (
    SCHEMA,
    SCHEMA_V2,
    EvidenceAnchor,
    anchor_from_mask,
    box_iou,
    box_to_norm,
    box_to_ras,
    boxes_from_slice_mask,
    check_box,
    norm_to_box,
    rank_slices,
    ras_to_box,
    slice_areas,
)
from medvolcore.errors import AnchorError, InputError, OutputExistsError, VolumeError
from medvolcore.prompts import MAX_OBJECTS, MAX_PROMPTS
from medvolcore.stack import AxialStack, sample_slice_indices
from medvolcore.volume import CTVolume, load_label_map, load_volume

# TotalSegmentator v2 label ids (class_map_total_v2.json), as in Testing/conftest.py
SPLEEN, KIDNEY_RIGHT, KIDNEY_LEFT, LIVER = 1, 2, 3, 5

# Expected anchors (top_k=1) on the canonical stack of example_ct.nii.gz, computed with a
# throwaway script that does not import medvolcore: plain numpy/scipy on the source RAS array
# of example_seg_fast_force_split.nii.gz (122×101×112): areas = isin(seg, labels).sum over (i, j)
# for each k; key slice = largest area, ties to the smallest z where z = K-1-k; boxes =
# scipy.ndimage.label(seg[:, :, k], 8-connectivity) bounding boxes, components < 10 px or < 5 % of
# the largest dropped, converted to stack pixels x = I-1-i, y = J-1-j, sorted by (x0, y0).
#   liver   : k=106 → z=5,  area 2108 (next: z=4 2102, z=3 2082, z=6 2071, z=2 2055), one component
#   kidneys : k=92  → z=19, area 484, components 223 px (right kidney) and 261 px (left kidney)
#   spleen  : k=107 → z=4,  area 496
# Cross-check by label on that source slice: liver i 42..104, j 27..81; kidney_right i 70..89,
# j 29..45; kidney_left i 26..43, j 28..45; spleen i 11..41, j 23..50.
EXPECTED = {
    "liver": ([LIVER], 5, [[17, 19, 79, 73]]),
    "kidneys": ([KIDNEY_RIGHT, KIDNEY_LEFT], 19, [[32, 55, 51, 71], [78, 55, 95, 72]]),
    "spleen": ([SPLEEN], 4, [[80, 50, 110, 77]]),
}
LIVER_TOP3 = {3, 4, 5}
W, H, D = 122, 101, 112


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(ct_path):
    return AxialStack(load_volume(ct_path))


@pytest.fixture(scope="module")
def seg_stack(stack, seg_path):
    return stack.to_stack(load_label_map(seg_path).array)


@pytest.fixture(scope="module")
def nib_seg(seg_path):
    img = nib.load(str(seg_path))
    return np.asarray(img.dataobj), np.asarray(img.affine, dtype=np.float64)


@pytest.fixture(scope="module")
def liver_anchor(stack, seg_stack):
    return anchor_from_mask(seg_stack == LIVER, stack=stack, query="the organ that secretes bile")


# ---- anchors from the real label map ------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_anchor_from_real_mask_matches_independent_values(name, seg_stack, stack):
    labels, z, boxes = EXPECTED[name]
    a = anchor_from_mask(np.isin(seg_stack, labels), stack=stack)
    assert a.slice == z
    assert a.boxes == boxes
    assert a.image_size == [W, H]
    assert a.source == "mask"
    assert a.world is not None and len(a.world["boxes_ras"]) == len(boxes)


def test_kidney_boxes_right_kidney_first(seg_stack):
    a = anchor_from_mask(np.isin(seg_stack, [KIDNEY_RIGHT, KIDNEY_LEFT]))
    right, left = a.boxes
    key = seg_stack[a.slice]
    # the first box (image left) holds the right kidney, the second the left kidney
    assert (key[right[1]:right[3] + 1, right[0]:right[2] + 1] == KIDNEY_RIGHT).sum() > 150
    assert (key[left[1]:left[3] + 1, left[0]:left[2] + 1] == KIDNEY_LEFT).sum() > 150


def test_anchor_without_stack_has_no_world(seg_stack):
    a = anchor_from_mask(seg_stack == LIVER)
    assert a.world is None and a.slice == 5


def test_top_k_sampling(seg_stack):
    mask = seg_stack == LIVER
    seen = set()
    for seed in range(40):
        a = anchor_from_mask(mask, top_k=3, rng=seed)
        assert a.slice in LIVER_TOP3
        assert a.boxes == boxes_from_slice_mask(mask[a.slice])
        # reproducible: same seed as an int or as a fresh Generator
        assert anchor_from_mask(mask, top_k=3, rng=seed).slice == a.slice
        assert anchor_from_mask(mask, top_k=3, rng=np.random.default_rng(seed)).slice == a.slice
        seen.add(a.slice)
    assert len(seen) >= 2  # different seeds give different slices
    # default rng is seeded: deterministic
    assert anchor_from_mask(mask, top_k=3).slice == anchor_from_mask(mask, top_k=3).slice
    # top_k=1 ignores the rng
    assert {anchor_from_mask(mask, top_k=1, rng=s).slice for s in range(10)} == {5}


def test_candidates_restrict_key_slice(seg_stack):
    mask = seg_stack == LIVER
    cand = sample_slice_indices(D)
    a = anchor_from_mask(mask, candidates=cand)
    assert a.slice in cand and a.slice == 5
    # multiples of 3: liver areas z=3 2082 > z=6 2071 > … (independent script above)
    every3 = list(range(0, D, 3))
    assert anchor_from_mask(mask, candidates=every3).slice == 3
    assert {anchor_from_mask(mask, top_k=2, candidates=every3, rng=s).slice for s in range(30)} == {3, 6}
    # candidates outside the organ → error, not a silent pick
    with pytest.raises(VolumeError, match="empty"):
        anchor_from_mask(mask, candidates=[100, 110])


def test_rank_slices_ties_to_smaller_z():
    m = np.zeros((6, 8, 8), bool)
    m[4, :3, :3] = True  # area 9
    m[1, 5:, 5:] = True  # area 9
    m[2, :2, :2] = True  # area 4
    assert slice_areas(m).tolist() == [0, 9, 4, 0, 9, 0]
    assert rank_slices(m) == [1, 4, 2]
    assert rank_slices(m, candidates=[4, 2, 2, 99]) == [4, 2]
    assert anchor_from_mask(m).slice == 1


def test_anchor_from_mask_errors():
    with pytest.raises(VolumeError):
        anchor_from_mask(np.zeros((3, 4, 4), bool))
    m = np.zeros((3, 4, 4), bool)
    m[1, 1, 1] = True
    for k in (0, -1, True, 1.5):
        with pytest.raises(InputError):
            anchor_from_mask(m, top_k=k)
    with pytest.raises(InputError):
        slice_areas(np.zeros((4, 4)))


# ---- the component rule (synthetic slices) ---------------------------------------------------------

def test_component_of_9_pixels_dropped():
    m = np.zeros((40, 40), bool)
    m[0:10, 0:10] = True  # 100 px
    m[30:33, 30:33] = True  # 9 px → dropped
    m[20:22, 10:15] = True  # 10 px → kept (≥ 10 and ≥ 5 % of 100)
    assert boxes_from_slice_mask(m) == [[0, 0, 9, 9], [10, 20, 14, 21]]


def test_component_under_5_percent_dropped():
    m = np.zeros((60, 60), bool)
    m[0:20, 0:20] = True  # 400 px; 5 % = 20
    m[40:42, 40:50] = True  # 20 px → kept (not under 5 %)
    m[50:51, 0:19] = True  # 19 px → dropped
    assert boxes_from_slice_mask(m) == [[0, 0, 19, 19], [40, 40, 49, 41]]


def test_at_most_8_largest_components():
    m = np.zeros((30, 120), bool)
    # 10 vertical bars, bar b has 11 + b pixels, 2 px apart; the two smallest (b = 0, 1) go
    for b in range(10):
        x = 3 * b
        m[0:11 + b, x] = True
    boxes = boxes_from_slice_mask(m)
    assert len(boxes) == 8
    assert boxes == [[3 * b, 0, 3 * b, 10 + b] for b in range(2, 10)]


def test_boxes_ordered_by_x0_then_y0():
    m = np.zeros((50, 50), bool)
    m[30:40, 20:30] = True  # x0 20, y0 30
    m[0:10, 20:25] = True  # x0 20, y0 0
    m[15:25, 2:12] = True  # x0 2
    m[5:15, 40:48] = True  # x0 40
    assert boxes_from_slice_mask(m) == [[2, 15, 11, 24], [20, 0, 24, 9], [20, 30, 29, 39], [40, 5, 47, 14]]


def test_eight_connectivity_joins_diagonals():
    m = np.zeros((20, 20), bool)
    m[2:6, 2:6] = True  # 16 px
    m[6:10, 6:10] = True  # touches the first only at a corner (diagonal)
    assert boxes_from_slice_mask(m) == [[2, 2, 9, 9]]
    # a single diagonal line of 12 px is one component
    d = np.eye(12, dtype=bool)
    assert boxes_from_slice_mask(d) == [[0, 0, 11, 11]]


def test_single_small_component_fallback():
    m = np.zeros((10, 10), bool)
    m[3:5, 6:8] = True  # 4 px, under 10: still yields its box
    assert boxes_from_slice_mask(m) == [[6, 3, 7, 4]]
    m[8, 0] = True  # 1 px: the larger small one wins
    assert boxes_from_slice_mask(m) == [[6, 3, 7, 4]]
    assert boxes_from_slice_mask(np.zeros((5, 5), bool)) == []


def test_labels_count_as_foreground():
    m = np.zeros((20, 20), np.uint8)
    m[0:5, 0:5] = 3
    m[10:15, 10:15] = 7
    assert boxes_from_slice_mask(m) == [[0, 0, 4, 4], [10, 10, 14, 14]]


def test_anchor_from_synthetic_mask_end_to_end():
    m = np.zeros((5, 30, 40), bool)
    m[2, 5:15, 20:35] = True  # 150 px
    m[2, 20:25, 1:6] = True  # 25 px
    m[3, 0:10, 0:10] = True  # 100 px
    a = anchor_from_mask(m)
    assert (a.slice, a.boxes, a.image_size) == (2, [[1, 20, 5, 24], [20, 5, 34, 14]], [40, 30])


# ---- world boxes land inside the organ ---------------------------------------------------------------

def _world_to_source(corners, affine):
    inv = np.linalg.inv(affine)
    c = np.c_[np.asarray(corners, dtype=np.float64), np.ones(len(corners))]
    ijk = (inv @ c.T).T[:, :3]
    assert np.allclose(ijk, np.rint(ijk), atol=1e-6), "world corners are not voxel centres"
    return np.rint(ijk).astype(int)


@pytest.mark.parametrize("name,organ_labels", [("liver", [[LIVER]]), ("kidneys", [[KIDNEY_RIGHT], [KIDNEY_LEFT]])])
def test_world_boxes_land_inside_the_organ(name, organ_labels, seg_stack, stack, nib_seg):
    seg, affine = nib_seg
    labels, z, _ = EXPECTED[name]
    a = anchor_from_mask(np.isin(seg_stack, labels), stack=stack)
    k = seg.shape[2] - 1 - a.slice
    assert len(a.world["boxes_ras"]) == len(organ_labels)
    for corners, organ in zip(a.world["boxes_ras"], organ_labels):
        ijk = _world_to_source(corners, affine)
        assert (ijk[:, 2] == k).all()  # both corners on the key slice
        i0, i1 = sorted(ijk[:, 0])
        j0, j1 = sorted(ijk[:, 1])
        region = seg[i0:i1 + 1, j0:j1 + 1, k]
        assert np.isin(region, organ).mean() > 0.3
        # the box is exactly the organ's extent on that slice (each structure is one component here)
        ii, jj = np.nonzero(np.isin(seg[:, :, k], organ))
        assert (i0, i1, j0, j1) == (ii.min(), ii.max(), jj.min(), jj.max())
    # slice centre: the source slice's centre voxel, by hand
    ci, cj = (seg.shape[0] - 1) / 2, (seg.shape[1] - 1) / 2
    assert np.allclose(a.world["slice_center_ras"], (affine @ [ci, cj, k, 1])[:3])


def test_liver_world_box_centre_voxel_is_liver(liver_anchor, nib_seg):
    seg, affine = nib_seg
    ijk = _world_to_source(liver_anchor.world["boxes_ras"][0], affine)
    centre = np.rint(ijk.mean(axis=0)).astype(int)
    assert seg[tuple(centre)] == LIVER


# ---- pixel ↔ normalised ↔ world -------------------------------------------------------------------------

def test_box_to_norm_hand_example():
    assert box_to_norm([17, 19, 79, 73], 122, 101) == pytest.approx(
        [1000 * 17 / 122, 1000 * 19 / 101, 1000 * 80 / 122, 1000 * 74 / 101])
    assert box_to_norm([0, 0, 121, 100], 122, 101) == pytest.approx([0, 0, 1000, 1000])
    assert norm_to_box([1000 * 17 / 122, 1000 * 19 / 101, 1000 * 80 / 122, 1000 * 74 / 101], 122, 101) == [17, 19, 79, 73]


@pytest.mark.parametrize("w,h", [(122, 101), (101, 122), (512, 512), (7, 3), (1, 1), (1000, 999)])
def test_box_norm_round_trip(w, h):
    rng = np.random.default_rng(w * 1000 + h)
    for _ in range(300):
        x0, x1 = sorted(rng.integers(0, w, 2).tolist())
        y0, y1 = sorted(rng.integers(0, h, 2).tolist())
        box = [x0, y0, x1, y1]
        n = box_to_norm(box, w, h)
        assert 0 <= n[0] < n[2] <= 1000 and 0 <= n[1] < n[3] <= 1000
        assert norm_to_box(n, w, h) == box


def test_norm_to_box_rounds_outward():
    # W = H = 122: 10 → 1.22 px, 20 → 2.44 px; floor(1.22) = 1, ceil(2.44) - 1 = 2
    assert norm_to_box([10, 10, 20, 20], 122, 122) == [1, 1, 2, 2]
    # exact pixel edges are not widened: 1000·2/100 … 1000·5/100 → pixels 2..4
    assert norm_to_box([20, 20, 50, 50], 100, 100) == [2, 2, 4, 4]
    # a sliver inside one pixel is that pixel
    assert norm_to_box([101, 0, 102, 1], 100, 100) == [10, 0, 10, 0]
    # typical grounder answer on the real slice size (integers 0..1000)
    assert norm_to_box([139, 188, 656, 733], 122, 101) == [16, 18, 80, 74]


def test_norm_to_box_clamps_and_rejects():
    assert norm_to_box([-50, -10, 1100, 1200], 122, 101) == [0, 0, 121, 100]
    assert norm_to_box([900, 900, 1500, 1500], 10, 10) == [9, 9, 9, 9]
    for bad in ([20, 10, 10, 20], [10, 20, 20, 10], [10, 10, 10, 20], [10, 10, 20, 10]):
        with pytest.raises(InputError):
            norm_to_box(bad, 122, 101)
    with pytest.raises(InputError):
        norm_to_box([1001, 1001, 1100, 1100], 122, 101)  # entirely outside
    with pytest.raises(InputError):
        norm_to_box([-100, -100, -1, -1], 122, 101)
    for bad in ([1, 2, 3], "1234", [1, 2, "3", 4], [1, 2, float("nan"), 4], [True, 0, 5, 5]):
        with pytest.raises(InputError):
            norm_to_box(bad, 122, 101)


def test_box_iou_hand_values():
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == pytest.approx(1.0)
    assert box_iou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(25 / 175)
    assert box_iou([0, 0, 10, 10], [2, 2, 4, 4]) == pytest.approx(4 / 100)
    assert box_iou([0, 0, 10, 10], [10, 0, 20, 10]) == 0.0  # touching
    assert box_iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0
    assert box_iou([0, 0, 10, 20], [0, 10, 10, 30]) == pytest.approx(100 / 300)
    assert box_iou([0, 0, 0, 0], [0, 0, 0, 0]) == 0.0


def test_check_box():
    assert check_box([1, 2, 3, 4], 10, 10) == [1, 2, 3, 4]
    assert check_box([1.0, 2.0, 3.0, 4.0], 10, 10) == [1, 2, 3, 4]
    assert check_box([5, 5, 5, 5], 10, 10) == [5, 5, 5, 5]  # one pixel is a valid box
    for bad in ([1.5, 2, 3, 4], [3, 2, 1, 4], [1, 4, 3, 2], [1, 2, 3], None, "abcd", [1, 2, 3, None]):
        with pytest.raises(InputError):
            check_box(bad, 10, 10)
    with pytest.raises(InputError, match="outside"):
        check_box([10, 0, 12, 5], 10, 10)


def test_check_box_clamps_with_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="medvolcore.anchor"):
        assert check_box([-3, 2, 14, 9], 10, 8) == [0, 2, 9, 7]
    assert any("clamped" in r.getMessage() for r in caplog.records)


def test_box_to_ras_by_hand(stack, nib_seg):
    _, affine = nib_seg
    corners = box_to_ras(stack, 5, [17, 19, 79, 73])
    # first voxel (z=5, y=19, x=17) is source (I-1-17, J-1-19, K-1-5)
    assert np.allclose(corners[0], (affine @ [W - 1 - 17, H - 1 - 19, D - 1 - 5, 1])[:3])
    assert np.allclose(corners[1], (affine @ [W - 1 - 79, H - 1 - 73, D - 1 - 5, 1])[:3])


def _oblique_stack():
    t = np.deg2rad(12)
    rot = np.array([[np.cos(t), 0, np.sin(t), 0], [0, 1, 0, 0], [-np.sin(t), 0, np.cos(t), 0], [0, 0, 0, 1.0]])
    base = np.array([[0, 0, -0.9, 40], [0.7, 0, 0, -20], [0, -2.5, 0, 60], [0, 0, 0, 1.0]])  # A I L axes
    return AxialStack(CTVolume(np.zeros((37, 23, 51), np.float32), rot @ base))


@pytest.mark.parametrize("which", ["real", "oblique"])
def test_box_ras_round_trip(which, stack):
    st = stack if which == "real" else _oblique_stack()
    rng = np.random.default_rng(3)
    for _ in range(200):
        z = int(rng.integers(0, st.depth))
        x0, x1 = sorted(rng.integers(0, st.width, 2).tolist())
        y0, y1 = sorted(rng.integers(0, st.height, 2).tolist())
        corners = box_to_ras(st, z, [x0, y0, x1, y1])
        assert ras_to_box(st, corners) == (z, [x0, y0, x1, y1])
    # small noise (< half a voxel) is absorbed
    corners = np.asarray(box_to_ras(st, 3, [1, 2, 5, 6])) + 0.2
    assert ras_to_box(st, corners) == (3, [1, 2, 5, 6])


def test_ras_to_box_errors(stack):
    a = stack.stack_to_ras([5, 10, 10])
    b = stack.stack_to_ras([9, 20, 20])
    with pytest.raises(AnchorError, match="different axial slices"):
        ras_to_box(stack, [a, b])
    with pytest.raises(AnchorError, match="outside"):
        ras_to_box(stack, [stack.stack_to_ras([200, 1, 1]), stack.stack_to_ras([200, 5, 5])])
    with pytest.raises(AnchorError):
        ras_to_box(stack, [a])
    with pytest.raises(AnchorError):
        ras_to_box(stack, [[0, 0, float("nan")], a])


def test_from_world_reproduces_boxes(stack, seg_stack):
    a = anchor_from_mask(np.isin(seg_stack, [KIDNEY_RIGHT, KIDNEY_LEFT]), stack=stack)
    b = EvidenceAnchor.from_world(a.world, stack)
    assert (b.slice, b.boxes, b.image_size) == (a.slice, a.boxes, a.image_size)
    assert b.world == a.world
    with pytest.raises(AnchorError):
        EvidenceAnchor.from_world({"boxes_ras": []}, stack)
    mixed = {"boxes_ras": [box_to_ras(stack, 3, [1, 1, 4, 4]), box_to_ras(stack, 7, [1, 1, 4, 4])]}
    with pytest.raises(AnchorError, match="different slices"):
        EvidenceAnchor.from_world(mixed, stack)


def test_anchor_boxes_norm_and_from_norm():
    a = EvidenceAnchor(5, [[17, 19, 79, 73]], [122, 101])
    assert a.boxes_norm[0] == pytest.approx([1000 * 17 / 122, 1000 * 19 / 101, 1000 * 80 / 122, 1000 * 74 / 101])
    b = EvidenceAnchor.from_norm(5, a.boxes_norm, [122, 101], source="grounder")
    assert b.boxes == a.boxes and b.source == "grounder"


def test_anchor_object_validation():
    with pytest.raises(AnchorError):
        EvidenceAnchor(-1, [[1, 1, 2, 2]], [10, 10])
    with pytest.raises(AnchorError):
        EvidenceAnchor(1, [], [10, 10])
    with pytest.raises(AnchorError):
        EvidenceAnchor(1, [[1, 1, 2, 2]], [10, 10], source="oracle")
    with pytest.raises(AnchorError):
        EvidenceAnchor(1, [[1, 1, 2, 2]], [0, 10])
    with pytest.raises(AnchorError, match="inverted"):
        EvidenceAnchor(1, [[3, 1, 2, 2]], [10, 10])


def test_with_world_checks_stack(stack):
    with pytest.raises(AnchorError, match="another volume"):
        EvidenceAnchor(5, [[1, 1, 2, 2]], [256, 256]).with_world(stack)
    with pytest.raises(AnchorError, match="outside"):
        EvidenceAnchor(112, [[1, 1, 2, 2]], [W, H]).with_world(stack)


# ---- the anchor file --------------------------------------------------------------------------------------

def test_save_load_round_trip(tmp_path, liver_anchor, stack):
    a = dataclasses.replace(liver_anchor, reasoning="bile → liver", notes=["made by a test"])
    p = a.save(tmp_path / "liver.anchor.json")
    d = json.loads(p.read_text(encoding="utf-8"))
    assert d["schema"] == SCHEMA == "medvol.anchor/1"
    assert d["slice"] == 5 and d["boxes"] == [[17, 19, 79, 73]] and d["image_size"] == [W, H]
    assert d["boxes_norm"][0] == pytest.approx([1000 * 17 / 122, 1000 * 19 / 101, 1000 * 80 / 122, 1000 * 74 / 101], abs=1e-3)
    assert set(d["world"]) == {"slice_center_ras", "boxes_ras"}
    for loaded in (EvidenceAnchor.load(p), EvidenceAnchor.load(p, stack)):
        assert loaded.slice == a.slice and loaded.boxes == a.boxes and loaded.image_size == a.image_size
        assert loaded.query == "the organ that secretes bile" and loaded.reasoning == "bile → liver"
        assert loaded.source == "mask" and loaded.notes == ["made by a test"]
        assert np.allclose(loaded.world["boxes_ras"], a.world["boxes_ras"])
        assert np.allclose(loaded.world["slice_center_ras"], a.world["slice_center_ras"])
        assert loaded.to_dict() == a.to_dict()
    assert list(tmp_path.glob(".*part*")) == []


def test_save_refuses_overwrite(tmp_path):
    a = EvidenceAnchor(2, [[1, 1, 3, 3]], [10, 10], source="user")
    p = a.save(tmp_path / "a.anchor.json")
    b = EvidenceAnchor(4, [[2, 2, 5, 5]], [10, 10], source="user")
    with pytest.raises(OutputExistsError):
        b.save(p)
    assert EvidenceAnchor.load(p).slice == 2
    b.save(p, overwrite=True)
    assert EvidenceAnchor.load(p).slice == 4
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.anchor.json"]


def _liver_dict(liver_anchor):
    return json.loads(liver_anchor.to_json())


def test_wrong_schema(liver_anchor):
    d = _liver_dict(liver_anchor)
    d["schema"] = "medvol.anchor/3"
    with pytest.raises(AnchorError, match="medvol.anchor/3"):
        EvidenceAnchor.from_dict(d)
    del d["schema"]
    with pytest.raises(AnchorError, match="schema"):
        EvidenceAnchor.from_dict(d)


def test_world_only_file(tmp_path, liver_anchor, stack):
    d = _liver_dict(liver_anchor)
    for key in ("boxes", "boxes_norm", "slice", "image_size"):
        del d[key]
    p = tmp_path / "w.anchor.json"
    p.write_text(json.dumps(d))
    a = EvidenceAnchor.load(p, stack)
    assert a.slice == 5 and a.boxes == [[17, 19, 79, 73]] and a.image_size == [W, H]
    with pytest.raises(AnchorError, match="volume"):
        EvidenceAnchor.load(p)  # no stack: cannot place world boxes


def test_world_edited_by_user_wins_when_boxes_absent(liver_anchor, stack):
    # Slicer writes back a moved box as world corners only
    d = _liver_dict(liver_anchor)
    d.pop("boxes"), d.pop("boxes_norm")
    d["world"]["boxes_ras"] = [box_to_ras(stack, 5, [20, 22, 70, 60])]
    a = EvidenceAnchor.from_dict(d, stack)
    assert (a.slice, a.boxes) == (5, [[20, 22, 70, 60]])


@pytest.mark.parametrize("change", ["box", "slice"])
def test_boxes_and_world_disagree(liver_anchor, stack, change):
    d = _liver_dict(liver_anchor)
    if change == "box":
        d["boxes"][0][0] += 3
    else:
        d["slice"] = 6
    with pytest.raises(AnchorError, match="disagree"):
        EvidenceAnchor.from_dict(d, stack)


def test_image_size_mismatch_with_stack(liver_anchor, stack):
    d = _liver_dict(liver_anchor)
    d["image_size"] = [256, 256]
    del d["world"]
    with pytest.raises(AnchorError, match="256"):
        EvidenceAnchor.from_dict(d, stack)


def test_box_outside_slice_clamped_with_warning(liver_anchor, caplog):
    d = _liver_dict(liver_anchor)
    d["boxes"] = [[100, 10, 130, 50]]
    del d["world"], d["boxes_norm"]
    with caplog.at_level(logging.WARNING, logger="medvolcore.anchor"):
        a = EvidenceAnchor.from_dict(d)
    assert a.boxes == [[100, 10, 121, 50]]
    assert any("clamped" in r.getMessage() for r in caplog.records)


def test_inverted_box_in_file(liver_anchor):
    d = _liver_dict(liver_anchor)
    d["boxes"] = [[79, 19, 17, 73]]
    with pytest.raises(AnchorError, match="inverted"):
        EvidenceAnchor.from_dict(d)


@pytest.mark.parametrize("text", ["{not json", "", "\xff\xfe"])
def test_invalid_json(tmp_path, text):
    p = tmp_path / "bad.anchor.json"
    p.write_bytes(text.encode("latin-1"))
    with pytest.raises(AnchorError):
        EvidenceAnchor.load(p)


def test_other_malformed_files(tmp_path):
    p = tmp_path / "list.anchor.json"
    p.write_text("[1, 2]")
    with pytest.raises(AnchorError, match="object"):
        EvidenceAnchor.load(p)
    with pytest.raises(AnchorError, match="does not exist"):
        EvidenceAnchor.load(tmp_path / "missing.anchor.json")
    with pytest.raises(AnchorError, match="neither"):
        EvidenceAnchor.from_dict({"schema": SCHEMA, "slice": 1, "image_size": [10, 10]})
    with pytest.raises(AnchorError, match="slice"):
        EvidenceAnchor.from_dict({"schema": SCHEMA, "boxes": [[1, 1, 2, 2]], "image_size": [10, 10]})
    with pytest.raises(AnchorError, match="image_size"):
        EvidenceAnchor.from_dict({"schema": SCHEMA, "slice": 1, "boxes": [[1, 1, 2, 2]]})


def test_boxes_norm_only_file_uses_outward_rounding():
    d = {"schema": SCHEMA, "slice": 3, "boxes_norm": [[10, 10, 20, 20]], "image_size": [122, 122]}
    assert EvidenceAnchor.from_dict(d).boxes == [[1, 1, 2, 2]]


def test_boxes_norm_written_by_to_dict_read_back(liver_anchor):
    d = _liver_dict(liver_anchor)
    del d["boxes"], d["world"]
    assert EvidenceAnchor.from_dict(d).boxes == liver_anchor.boxes


@pytest.mark.probe("9", "EvidenceAnchor with 9 boxes")
def test_anchor_box_cap():
    from medvolcore.anchor import MAX_BOXES, EvidenceAnchor

    EvidenceAnchor(0, [[0, 0, 1, 1]] * MAX_BOXES, [10, 10])
    with pytest.raises(AnchorError, match="at most 8"):
        EvidenceAnchor(0, [[0, 0, 1, 1]] * (MAX_BOXES + 1), [10, 10])


# ---- hostile numbers, huge files, repeated keys (second review, II.10) ---------------------------

def _small_stack():
    """A 10×16×20 stack with 2 mm voxels and an offset origin: enough to place world points."""
    aff = np.diag([2.0, 2.0, 2.0, 1.0])
    aff[:3, 3] = [-10.0, -16.0, -20.0]
    return AxialStack(CTVolume(np.zeros((10, 16, 20), dtype=np.float32), aff))


def _v2_anchor_dict(stack):
    a = EvidenceAnchor(5, [[2, 3, 6, 8]], [stack.width, stack.height], source="user",
                       prompts=[{"slice": 6, "object": 1, "box": [1, 1, 4, 4], "points": [[3, 3, 1]]}], z_range=[2, 8])
    return a.with_world(stack).to_dict()


def _put(d, path, value):
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value


HUGE = [1e308, -1e308, float("inf"), float("nan"), 10**400, -(10**400), 10**30]
# (what is kept of the anchor, where the number goes)
HOSTILE_PLACES = [
    ("pixel", ("boxes", 0, 2)), ("pixel", ("image_size", 0)), ("norm", ("boxes_norm", 0, 1)),
    ("world", ("world", "boxes_ras", 0, 1, 0)), ("pixel", ("prompts", 0, "box", 0)),
    ("pixel", ("prompts", 0, "points", 0, 1)), ("world", ("prompts", 0, "world", "points_ras", 0, 2)),
    ("world", ("prompts", 0, "world", "box_ras", 1, 1)), ("world", ("world", "z_range_ras", 0, 2)),
]


@pytest.mark.probe("II.10", "1e308, inf, nan, 10**400 in anchor boxes, world points, prompts, image_size")
@pytest.mark.parametrize("form,place", HOSTILE_PLACES, ids=["/".join(map(str, p)) for _f, p in HOSTILE_PLACES])
def test_huge_numbers_in_an_anchor_are_field_errors(form, place):
    """Each value is one AnchorError of its field, never an OverflowError, ValueError or a box silently
    clamped from a coordinate that overflowed (world 1e308 used to become x0 = -2**63 → 0)."""
    stack = _small_stack()
    base = _v2_anchor_dict(stack)
    if form == "pixel":
        del base["world"]
        for p in base["prompts"]:
            p.pop("world")
    elif form == "norm":
        del base["world"], base["boxes"]
        for p in base["prompts"]:
            p.pop("world")
    else:
        del base["boxes"], base["boxes_norm"]
        for p in base["prompts"]:
            del p["slice"], p["box"], p["points"]
    for value in HUGE:
        d = json.loads(json.dumps(base))
        _put(d, place, value)
        with pytest.raises(AnchorError) as ei:
            EvidenceAnchor.from_dict(d, stack)
        assert len(str(ei.value)) < 400, str(ei.value)[:100]  # a 400-digit number is not echoed whole


@pytest.mark.probe("II.10", "a 2 MB anchor file is refused from its size, before it is read")
def test_anchor_file_size_is_capped_before_reading(tmp_path, monkeypatch, record_property):
    from medvolcore import anchor as anchor_mod
    from medvolcore.errors import LimitError

    big = tmp_path / "big.anchor.json"
    with open(big, "wb") as f:  # 2 MB: a sparse file, nothing to read
        f.truncate(2 << 20)
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: reads.append(a[0]) or real_open(*a, **k))
    with pytest.raises(LimitError, match="at most 1 MB"):
        EvidenceAnchor.load(big)
    assert str(big) not in map(str, reads)  # refused from stat, never opened
    monkeypatch.undo()

    # the largest anchor the limits allow is far under the cap
    stack = _small_stack()
    prompts = [{"slice": z, "object": k, "box": [0, 0, 5, 5], "points": [[1, 1, 1]] * 4}
               for z in (0, 1, 2, 3, 4, 6, 7, 8) for k in range(1, 9)]  # 64 prompts, 256 points, 8 objects
    biggest = EvidenceAnchor(5, [[2, 3, 6, 8]] * 8, [stack.width, stack.height], source="user", prompts=prompts,
                             query="q" * 2000, reasoning="r" * 16000, z_range=[0, 9])
    size = len(biggest.with_world(stack).to_json().encode())
    record_property("largest_anchor_bytes", size)
    assert size < anchor_mod.MAX_ANCHOR_FILE_BYTES // 8


@pytest.mark.probe("II.10", "anchor file naming a key twice")
def test_anchor_file_with_a_repeated_key_is_refused(tmp_path):
    p = tmp_path / "dup.anchor.json"
    p.write_text('{"schema": "medvol.anchor/1", "slice": 4, "boxes": [[2, 3, 6, 8]], "image_size": [20, 16], '
                 '"boxes": [[1, 1, 2, 2]]}')
    with pytest.raises(AnchorError, match="'boxes' appears more than once"):
        EvidenceAnchor.load(p)
    p.write_text('{"schema": "medvol.anchor/1", "slice": 4, "boxes": [[2, 3, NaN, 8]], "image_size": [20, 16]}')
    with pytest.raises(AnchorError, match="NaN"):
        EvidenceAnchor.load(p)
    p.write_text('{"schema": "medvol.anchor/1", "slice": 4, "boxes": [[2, 3, ' + "9" * 5000 + ', 8]], "image_size": [20, 16]}')
    with pytest.raises(AnchorError, match="not usable JSON"):
        EvidenceAnchor.load(p)


@pytest.mark.probe("II.10", "worker: anchor box 10**400, world point 1e308, window [10**400, 400] / [1e308, 1e308]")
def test_the_worker_answers_huge_numbers_with_a_field_error(tmp_path):
    """One error reply of the field's kind (bad_anchor, bad_input), never ``internal``; no model loads."""
    import queue

    from medvolcore.serve import Worker

    ct = tmp_path / "ct.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((20, 16, 10), dtype=np.int16), np.diag([2.0, 2.0, 2.0, 1.0])), str(ct))
    ok_anchor = {"schema": "medvol.anchor/1", "slice": 4, "boxes": [[2, 3, 6, 8]], "source": "user"}
    world = {"schema": "medvol.anchor/1", "source": "user", "world": {"boxes_ras": [[[1e308, 2.0, 2.0], [4.0, 6.0, 2.0]]]}}
    probes = [({"anchor": dict(ok_anchor, boxes=[[2, 3, 10**400, 8]])}, "bad_anchor"),
              ({"anchor": world}, "bad_anchor"),
              ({"anchor": ok_anchor, "window": [10**400, 400]}, "bad_input"),
              ({"anchor": ok_anchor, "window": [1e308, 1e308]}, "bad_input")]
    replies: queue.Queue = queue.Queue()
    w = Worker(transport="stdio", device="cpu")
    try:
        for i, (fields, _code) in enumerate(probes):
            w.handle_line(json.dumps({"id": i, "op": "propagate", "volume": str(ct), **fields}), reply=replies.put)
        got = {}
        while len(got) < len(probes):
            r = replies.get(timeout=60)
            if "event" not in r:  # progress events come on the same channel
                got[r["id"]] = r
        for i, (_fields, code) in enumerate(probes):
            assert got[i]["ok"] is False and got[i]["error"]["code"] == code, got[i]
        assert w.pipeline is None  # refused before any model was asked for
    finally:
        w.close(10)


# ---- schema /2: correction prompts and a slice range, read, written and checked ------------------

def _anchor(**kw):
    base = dict(slice=50, boxes=[[30, 30, 60, 60], [70, 30, 90, 50]], image_size=[W, H], source="user")
    base.update(kw)
    return EvidenceAnchor(**base)


PROMPTS = [
    {"slice": 62, "object": 1, "box": [28, 32, 58, 66], "points": []},
    {"slice": 62, "object": 1, "box": None, "points": [[40, 40, 0], [45, 50, 1]]},
    {"slice": 50, "object": 2, "box": None, "points": [[80, 40, 0]]},      # points only on the key slice
    {"slice": 30, "object": 3, "box": None, "points": [[60, 70, 1]]},      # a new object from a positive point
    {"slice": 35, "object": 3, "box": [50, 60, 70, 80], "points": []},
]


def test_without_corrections_the_file_is_v1_exactly(stack):
    a = _anchor().with_world(stack)
    d = a.to_dict()
    assert d["schema"] == SCHEMA == "medvol.anchor/1"
    assert "prompts" not in d and "z_range" not in d and "z_range_ras" not in d["world"]


def test_with_corrections_the_file_is_v2_and_reads_back(stack):
    a = _anchor(prompts=PROMPTS, z_range=[20, 80]).with_world(stack)
    d = json.loads(a.to_json())
    assert d["schema"] == SCHEMA_V2 and d["z_range"] == [20, 80]
    assert [p["object"] for p in d["prompts"]] == [1, 1, 2, 3, 3]
    assert a.num_objects == 3
    back = EvidenceAnchor.from_dict(d, stack)
    assert back.pixel_prompts() == a.pixel_prompts() and back.z_range == [20, 80]
    # only the z_range given in pixels, no volume: still read
    d_px = {k: v for k, v in d.items() if k != "world"}
    d_px["prompts"] = [{k: v for k, v in p.items() if k != "world"} for p in d["prompts"]]
    assert EvidenceAnchor.from_dict(d_px).pixel_prompts() == a.pixel_prompts()


@pytest.mark.parametrize("which", ["real", "oblique"])
def test_prompt_world_form_by_hand_and_world_only_round_trip(which, stack):
    st = stack if which == "real" else _oblique_stack()
    k, z = 10, 14
    prompts = [{"slice": z, "object": 1, "box": [3, 4, 12, 15], "points": [[5, 6, 0], [8, 9, 1]]}]
    a = EvidenceAnchor(k, [[2, 2, 10, 12]], [st.width, st.height], source="user", prompts=prompts, z_range=[k - 3, z + 2])
    a.with_world(st)
    w = a.prompts[0]["world"]
    src = np.linalg.inv(st.volume.affine)
    for (x, y, label), ras in zip(prompts[0]["points"], w["points_ras"]):
        assert ras[3] == label
        ijk = (src @ np.r_[ras[:3], 1.0])[:3]
        # the source voxel of stack (z, y, x), found without the stack's own mapping
        assert np.allclose(st.ras_to_stack(np.asarray([ras[:3]]))[0], [z, y, x], atol=1e-6)
        assert np.allclose(ijk, np.rint(ijk), atol=1e-6)
    # first/last voxel of the box, as boxes_ras
    assert np.allclose(st.ras_to_stack(np.asarray(w["box_ras"])), [[z, 4, 3], [z, 15, 12]], atol=1e-6)
    assert np.allclose(st.ras_to_stack(np.asarray(a.world["z_range_ras"]))[:, 0], [k - 3, z + 2], atol=1e-6)
    # what Slicer writes: world forms only, prompts without a slice
    world_only = {"schema": SCHEMA_V2, "source": "user", "world": a.world,
                  "prompts": [{"object": 1, "world": w}]}
    back = EvidenceAnchor.from_dict(world_only, st)
    assert back.slice == k and back.z_range == [k - 3, z + 2]
    assert back.pixel_prompts() == a.pixel_prompts()


def test_world_and_pixel_forms_that_disagree_are_refused(stack):
    d = _anchor(prompts=PROMPTS[:1]).with_world(stack).to_dict()
    d["prompts"][0]["box"] = [29, 32, 58, 66]
    with pytest.raises(AnchorError, match="prompt 1.*disagree"):
        EvidenceAnchor.from_dict(d, stack)
    d = _anchor(z_range=[20, 80]).with_world(stack).to_dict()
    d["z_range"] = [21, 80]
    with pytest.raises(AnchorError, match="z_range.*disagree"):
        EvidenceAnchor.from_dict(d, stack)


def test_world_points_on_two_slices_are_refused(stack):
    d = _anchor(prompts=PROMPTS[1:2]).with_world(stack).to_dict()
    w = d["prompts"][0]["world"]
    w["points_ras"][1][2] += 3 * abs(stack.stack_to_ras([1, 0, 0])[2] - stack.stack_to_ras([0, 0, 0])[2])
    with pytest.raises(AnchorError, match="different axial slices"):
        EvidenceAnchor.from_dict({"schema": SCHEMA_V2, "world": d["world"], "prompts": [{"object": 1, "world": w}]}, stack)


# ---- schema /2: every rule, one clear error ---------------------------------------------------------

BAD = [
    ({"prompts": [{"slice": 60, "object": 1, "box": None, "points": [[W, 10, 1]]}]}, "point 1 .* outside the 122×101 slice"),
    ({"prompts": [{"slice": 60, "object": 1, "box": [200, 200, 220, 220], "points": []}]}, "entirely outside"),
    ({"prompts": [{"slice": 90, "object": 1, "box": [1, 1, 5, 5], "points": []}], "z_range": [20, 80]},
     "slice 90 lies outside z_range"),
    ({"z_range": [60, 80]}, "key slice 50 lies outside z_range"),
    ({"z_range": [80, 60]}, "not a slice range"),
    ({"prompts": [{"slice": 60, "object": 3, "box": None, "points": [[5, 5, 0]]}]}, "new object 3 needs a box or an inside"),
    ({"prompts": [{"slice": 60, "object": 4, "box": [1, 1, 5, 5], "points": []}]}, "object 4 does not exist.*number 3"),
    ({"prompts": [{"slice": 50, "object": 1, "box": [1, 1, 5, 5], "points": []}]}, "already has a box on the key slice"),
    ({"prompts": [{"slice": 60, "object": 1, "box": [1, 1, 5, 5], "points": []},
                  {"slice": 60, "object": 1, "box": [2, 2, 6, 6], "points": []}]}, "already has a box on slice 60"),
    ({"prompts": [{"slice": 60, "object": 1, "box": None, "points": []}]}, "neither a box nor a point"),
    ({"prompts": [{"slice": 60, "object": 1, "box": None, "points": [[5, 5, 2]]}]}, "label 2"),
    ({"prompts": [{"slice": 60, "object": 0, "box": [1, 1, 5, 5], "points": []}]}, "not an object number"),
    ({"prompts": [{"slice": 60.5, "object": 1, "box": [1, 1, 5, 5], "points": []}]}, "slice must be an integer"),
    ({"prompts": [{"object": 1, "box": [1, 1, 5, 5], "points": []}]}, "neither 'slice'"),
    ({"prompts": [{"slice": 60 + i, "object": 3 + i, "box": [1, 1, 5, 5], "points": []} for i in range(MAX_OBJECTS - 1)]},
     f"more than {MAX_OBJECTS} objects"),
    ({"prompts": [{"slice": i, "object": 1, "box": None, "points": [[5, 5, 1]]} for i in range(MAX_PROMPTS + 1)]},
     f"at most {MAX_PROMPTS} are allowed"),
    ({"prompts": {"slice": 1}}, "'prompts' must be a list"),
]


@pytest.mark.parametrize("change, match", BAD, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_corrections_are_one_clear_error(stack, change, match):
    with pytest.raises(AnchorError, match=match) as e:
        d = _anchor().to_dict()
        d.update(change, schema=SCHEMA_V2)
        EvidenceAnchor.from_dict(d, stack)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


def test_a_prompt_beyond_the_stack_needs_the_volume_to_be_caught(stack):
    d = _anchor(prompts=[{"slice": D + 5, "object": 1, "box": [1, 1, 5, 5], "points": []}]).to_dict()
    assert EvidenceAnchor.from_dict(d).prompts  # no volume: the depth is unknown
    with pytest.raises(AnchorError, match=f"slice {D + 5} is outside the stack"):
        EvidenceAnchor.from_dict(d, stack)


def test_v1_files_keep_working_and_may_not_carry_corrections(stack):
    d = _anchor().with_world(stack).to_dict()
    assert EvidenceAnchor.from_dict(d, stack).boxes == _anchor().boxes
    d["prompts"] = PROMPTS[:1]
    with pytest.raises(AnchorError, match="need schema 'medvol.anchor/2'"):
        EvidenceAnchor.from_dict(d, stack)


def test_a_huge_prompt_list_is_refused_before_it_is_read(stack):
    """A remote client's anchor of 100 000 prompts is refused by its length, before any prompt is read:
    the first prompt is malformed, and reading it would have raised its own error instead."""
    d = _anchor().with_world(stack).to_dict()
    bad_first = [{"object": 1, "world": "not an object"}]
    d.update(schema=SCHEMA_V2, prompts=bad_first + [{"object": 1, "world": {"points_ras": [[0.0, 0.0, 0.0, 1]]}}] * 99_999)
    with pytest.raises(AnchorError, match="100000 prompts; at most 64"):
        EvidenceAnchor.from_dict(d, stack)
    d["prompts"] = bad_first + [{"object": 1, "world": {"points_ras": [[0.0, 0.0, 0.0, 1]] * 10_000}}]
    with pytest.raises(AnchorError, match="too many points"):
        EvidenceAnchor.from_dict(d, stack)
    d["prompts"] = bad_first
    with pytest.raises(AnchorError, match="'world' must be an object"):
        EvidenceAnchor.from_dict(d, stack)


# ---- schema /3: absent anchors ----------------------------------------------------------------------

def _absent_dict(**over):
    d = {"schema": "medvol.anchor/3", "absent": True, "slice": None, "boxes": [], "boxes_norm": [],
         "image_size": [W, H], "query": "the kidney cyst", "reasoning": "none seen", "source": "grounder"}
    d.update(over)
    return d


def test_absent_anchor_round_trips_through_a_file(tmp_path, stack):
    a = EvidenceAnchor.absent_for([W, H], query="the kidney cyst", reasoning="none seen", source="grounder",
                                  notes=["not found in this CT: the kidney cyst"])
    p = a.save(tmp_path / "a.anchor.json")
    d = json.loads(p.read_text())
    assert d == _absent_dict(notes=["not found in this CT: the kidney cyst"])
    b = EvidenceAnchor.load(p, stack)
    assert b.absent and b.slice is None and b.boxes == [] and b.query == "the kidney cyst"
    assert EvidenceAnchor.from_dict(_absent_dict(slice=None, boxes=None, boxes_norm=None)).absent
    assert not EvidenceAnchor.from_dict({"schema": SCHEMA, "absent": False, "slice": 3, "boxes": [[1, 1, 5, 5]],
                                         "image_size": [W, H]}).absent  # "absent": false is an ordinary anchor


@pytest.mark.parametrize("over, message", [
    (dict(schema=SCHEMA_V2), "'absent' needs schema 'medvol.anchor/3'"),
    (dict(absent="yes"), "'absent' must be true"),
    (dict(absent=False), "'absent' must be true in a 'medvol.anchor/3' anchor"),
    (dict(slice=4), "an absent anchor has no 'slice'"),
    (dict(boxes=[[1, 1, 5, 5]]), "an absent anchor has no 'boxes'"),
    (dict(z_range=[1, 4]), "no 'slice' or 'z_range'"),
    (dict(image_size=[W + 1, H]), "was it made for another volume"),
])
def test_contradictory_absent_anchors_are_refused(stack, over, message):
    with pytest.raises(AnchorError, match=message):
        EvidenceAnchor.from_dict(_absent_dict(**over), stack)


def test_an_absent_anchor_plans_nothing_and_old_schemas_say_so():
    a = EvidenceAnchor.absent_for([W, H])
    with pytest.raises(AnchorError, match="nothing to propagate"):
        a.plan()
    with pytest.raises(AnchorError, match="has no slice"):
        EvidenceAnchor(None, [[1, 1, 5, 5]], [W, H])
    with pytest.raises(AnchorError, match="has no slice, boxes"):
        EvidenceAnchor(None, [[1, 1, 5, 5]], [W, H], absent=True)


# ---- schema /4: a painted slice as a mask prompt --------------------------------------------------

def _painted_disc(cx=40, cy=45, r=9):
    yy, xx = np.mgrid[:H, :W]
    return (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r


def test_a_mask_prompt_makes_a_v4_file_that_reads_back(tmp_path, stack):
    from medvolcore.anchor import SCHEMA_V4
    from medvolcore.maskprompt import mask_prompt, runs_to_mask

    m = _painted_disc()
    a = _anchor(prompts=PROMPTS[:1] + [mask_prompt(70, 1, m), mask_prompt(20, 3, m)], z_range=[10, 90]).with_world(stack)
    path = a.save(tmp_path / "a.anchor.json")
    d = json.loads(path.read_text())
    assert d["schema"] == SCHEMA_V4 == "medvol.anchor/4"
    written = d["prompts"][1]
    assert written["mask"]["runs"][:2] == [int(np.flatnonzero(m.ravel())[0]), int(m[np.nonzero(m)[0][0]].sum())]
    assert np.allclose(stack.ras_to_stack(np.asarray([written["world"]["slice_center_ras"]]))[0],
                       [70, (H - 1) / 2, (W - 1) / 2])
    back = EvidenceAnchor.load(path, stack)
    assert back.schema == SCHEMA_V4 and back.pixel_prompts() == a.pixel_prompts()
    assert np.array_equal(runs_to_mask(back.prompts[1]["mask"]["runs"], W, H), m)
    objs = back.plan(D)
    assert objs[0].masks.keys() == {70} and objs[0].frames[70] == (None, []) and objs[2].start == 20
    # pixel form only (no volume): read too; world only needs the volume to place the slice
    px = dict(d, prompts=[{k: v for k, v in p.items() if k != "world"} for p in d["prompts"]])
    px.pop("world")
    assert EvidenceAnchor.from_dict(px).pixel_prompts() == a.pixel_prompts()
    world_only = dict(d, prompts=[{k: v for k, v in p.items() if k != "slice"} for p in d["prompts"][1:]])
    assert EvidenceAnchor.from_dict(world_only, stack).pixel_prompts() == a.pixel_prompts()[1:]


def test_older_schemas_read_and_write_exactly_as_before(tmp_path, stack):
    """A /1 and a /2 file (no mask) read back identically and are written again byte for byte with
    their own schema; a /2 file may not carry a mask prompt."""
    for a, schema in ((_anchor(), SCHEMA), (_anchor(prompts=PROMPTS, z_range=[20, 80]), SCHEMA_V2)):
        text = a.with_world(stack).to_json()
        path = tmp_path / f"{schema[-1]}.anchor.json"
        path.write_text(text)
        back = EvidenceAnchor.load(path, stack)
        assert back.schema == schema and back.to_json() == text
    d = json.loads(text)
    d["prompts"].append({"slice": 70, "object": 1, "mask": {"runs": [10, 5]}})
    with pytest.raises(AnchorError, match="mask prompts need schema 'medvol.anchor/4'"):
        EvidenceAnchor.from_dict(d, stack)


@pytest.mark.parametrize("prompt, match", [
    ({"slice": 70, "object": 1, "mask": {"runs": []}}, "mask is empty"),
    ({"slice": 70, "object": 1, "mask": {"runs": [W * H - 2, 5]}}, f"outside the {W}×{H} slice"),
    ({"slice": D + 3, "object": 1, "mask": {"runs": [0, 5]}}, f"slice {D + 3} is outside the stack"),
    ({"slice": 70, "object": 5, "mask": {"runs": [0, 5]}}, "object 5 does not exist"),
    ({"slice": 70, "object": 1, "mask": {"runs": [5, 3, 7, 2]}}, "not after the previous run"),
    ({"slice": 70, "object": 1, "mask": {"runs": [5, 0]}}, "length ≥ 1"),
    ({"slice": 70, "object": 1, "mask": [1, 2]}, "mask must be"),
    ({"slice": 70, "object": 1, "mask": {"runs": [0, 5]}, "box": [1, 1, 4, 4]}, "no box or points"),
    ({"slice": 62, "object": 1, "mask": {"runs": [0, 5]}}, "only input on its slice"),
], ids=["empty", "other-grid", "off-the-stack", "unknown-object", "overlap", "zero-length", "not-runs", "with-box",
        "shares-a-slice"])
def test_bad_mask_prompts_are_one_clear_error(stack, prompt, match):
    d = _anchor(prompts=PROMPTS[:1]).with_world(stack).to_dict()
    d.update(schema="medvol.anchor/4", prompts=d["prompts"] + [prompt])
    with pytest.raises(AnchorError, match=match):
        EvidenceAnchor.from_dict(d, stack)


def test_a_mask_on_the_key_slice_replaces_that_objects_box(stack):
    from medvolcore.maskprompt import mask_prompt

    a = _anchor(prompts=[mask_prompt(50, 2, _painted_disc(80, 40, 6))])
    objs = a.plan(D)
    assert objs[1].frames[50] == (None, []) and 50 in objs[1].masks
    assert objs[0].frames[50] == ((30, 30, 60, 60), []) and not objs[0].masks  # object 1 keeps its box
