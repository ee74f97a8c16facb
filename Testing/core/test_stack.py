"""The canonical axial stack (medvolcore.stack): orientation, voxel <-> RAS, masks between the source
grid and the stack, slice sampling and rendering.

The orientation logic is checked against expectations that do not use the code under test:
anatomy of the real TotalSegmentator CT (liver on the image left, lungs at the top of the stack,
spine at the back), the closed-form index mapping of a RAS file, and hand-reoriented copies of the
same CT that must give the same canonical stack.
"""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest

from medvolcore.errors import InputError, VolumeError
from medvolcore.stack import AxialStack, LVLM_SLICE_COUNT, axis_codes, sample_slice_indices
from medvolcore.volume import CTVolume, load_volume
from medvolcore.windowing import window_to_uint8

from core.test_volume import (AORTA, CT_SHAPE, KIDNEY_LEFT, KIDNEY_RIGHT, LIVER, LUNG_LABELS, SPLEEN,  # noqa: F401
                              STACK_SHAPE, URINARY_BLADDER, VERTEBRAE, _centroid, _reorient, ct, nib_ct, nib_seg, seg,
                              seg_stack, stack)


# ---- the real CT on the canonical stack: its anatomy ---------------------------------------------

def test_stack_shape_and_orientation_codes(stack):
    assert stack.shape == STACK_SHAPE
    assert (stack.depth, stack.height, stack.width) == STACK_SHAPE
    assert stack.spacing == pytest.approx((3.0, 3.0, 3.0))
    assert axis_codes(stack) == "RAS"


def test_ras_stack_equals_closed_form_elementwise(stack, nib_ct):
    """For a RAS file: stack[z, y, x] == src[I-1-x, J-1-y, K-1-z]."""
    src, _ = nib_ct
    ni, nj, nk = src.shape
    z, y, x = np.indices(STACK_SHAPE)
    expected = src[ni - 1 - x, nj - 1 - y, nk - 1 - z].astype(np.float32)
    assert np.array_equal(stack.data, expected)
    # spot checks of single voxels, written out
    assert stack.data[0, 0, 0] == src[ni - 1, nj - 1, nk - 1]
    assert stack.data[7, 40, 3] == src[ni - 1 - 3, nj - 1 - 40, nk - 1 - 7]
    assert stack.data[nk - 1, nj - 1, ni - 1] == src[0, 0, 0]


def test_liver_on_image_left_spleen_on_image_right(seg_stack, stack):
    liver_x = _centroid(seg_stack == LIVER)[2]
    spleen_x = _centroid(seg_stack == SPLEEN)[2]
    assert liver_x < stack.width / 2 < spleen_x
    # the right kidney is on the image left too
    assert _centroid(seg_stack == KIDNEY_RIGHT)[2] < stack.width / 2 < _centroid(seg_stack == KIDNEY_LEFT)[2]


def test_slices_run_head_to_feet(seg_stack, stack):
    lungs_z = _centroid(np.isin(seg_stack, LUNG_LABELS))[0]
    liver_z = _centroid(seg_stack == LIVER)[0]
    bladder_z = _centroid(seg_stack == URINARY_BLADDER)[0]
    assert lungs_z < liver_z < bladder_z
    assert lungs_z < stack.depth * 0.25 and bladder_z > stack.depth * 0.6


def test_anterior_is_image_top(seg_stack, stack):
    h = stack.height
    # Vertebral column (labels) in the posterior half
    spine = np.isin(seg_stack, VERTEBRAE)
    assert _centroid(spine)[1] > h / 2
    # Bone by HU alone (> 200) in the midline columns sits in the posterior half
    mid = slice(stack.width // 2 - 10, stack.width // 2 + 10)
    ys = np.nonzero(stack.data[:, :, mid] > 200)[1]
    assert ys.size > 100 and ys.mean() > h / 2
    # On every slice with both, the aorta lies in front of (smaller y than) the vertebrae
    checked = 0
    for z in range(stack.depth):
        a, v = seg_stack[z] == AORTA, np.isin(seg_stack[z], VERTEBRAE)
        if a.sum() > 5 and v.sum() > 5:
            assert np.argwhere(a)[:, 0].mean() < np.argwhere(v)[:, 0].mean(), z
            checked += 1
    assert checked >= 10
    # The liver's anterior edge is in front of the aorta
    assert np.argwhere(seg_stack == LIVER)[:, 1].min() < _centroid(seg_stack == AORTA)[1]


def test_ct_sm_slab_is_top_of_ct_stack(ct_sm_path, stack):
    """example_ct_sm holds example_ct[:, :, 82:112] (with the same affine): its stack is the first 30 slices."""
    sm = AxialStack(load_volume(ct_sm_path))
    assert sm.shape == (30, 101, 122)
    assert np.array_equal(sm.data, stack.data[:30])


# ---- orientation: hand-reoriented copies give the same canonical stack ------------------------

_OPPOSITE = {"R": "L", "L": "R", "A": "P", "P": "A", "S": "I", "I": "S"}


# (expected axis codes, perm, flips) for a RAS source
ORIENTATIONS = [
    ("LPS", (0, 1, 2), (True, True, False)),
    ("PSR", (1, 2, 0), (True, False, False)),
    ("IAL", (2, 1, 0), (True, False, True)),
    ("ASR", (1, 2, 0), (False, False, False)),
    ("SRA", (2, 0, 1), (False, False, False)),
    ("LIP", (0, 2, 1), (True, True, True)),
    ("RAS", (0, 1, 2), (False, False, False)),
]


@pytest.mark.parametrize("codes,perm,flips", ORIENTATIONS, ids=[o[0] for o in ORIENTATIONS])
def test_reoriented_nifti_gives_same_stack(codes, perm, flips, tmp_path, nib_ct, nib_seg, stack, seg_stack):
    src, affine = nib_ct
    data, new_affine = _reorient(src, affine, perm, flips)
    # the fixture itself: the copy has the intended orientation and describes the same anatomy
    assert "".join(nib.aff2axcodes(new_affine)) == codes
    i, j, k = 10, 20, 30
    new_idx = [(src.shape[p] - 1 - (i, j, k)[p]) if f else (i, j, k)[p] for p, f in zip(perm, flips)]
    assert data[tuple(new_idx)] == src[i, j, k]
    assert np.allclose(new_affine @ [*new_idx, 1], affine @ [i, j, k, 1])

    path = tmp_path / f"ct_{codes}.nii.gz"
    nib.save(nib.Nifti1Image(data, new_affine), str(path))
    vol = load_volume(path)
    assert vol.shape == data.shape
    st = AxialStack(vol)
    assert axis_codes(st) == codes
    assert st.shape == STACK_SHAPE
    assert np.array_equal(st.data, stack.data)
    assert np.allclose(st.index_to_ras, stack.index_to_ras, atol=1e-3)
    assert st.spacing == pytest.approx(stack.spacing)
    # a label map on the reoriented grid maps onto the same stack, and back exactly
    seg_data, _ = _reorient(nib_seg[0], nib_seg[1], perm, flips)
    assert np.array_equal(st.to_stack(seg_data), seg_stack)
    assert np.array_equal(st.to_source(seg_stack), seg_data)
    # index maps agree too
    pts = np.array([[0, 0, 0], [111, 100, 121], [5, 19, 17], [60.5, 33.25, 80.75]])
    assert np.allclose(st.stack_to_ras(pts), stack.stack_to_ras(pts), atol=1e-3)


def test_oblique_affine_uses_closest_axes(nib_ct, stack):
    """A 20° rotation does not change which source axis is closest to each world axis."""
    src, affine = nib_ct
    data, new_affine = _reorient(src, affine, (1, 2, 0), (True, False, False))  # PSR
    t = np.deg2rad(20)
    rot = np.eye(4)
    rot[:3, :3] = [[np.cos(t), -np.sin(t), 0], [np.sin(t), np.cos(t), 0], [0, 0, 1]]
    rot2 = np.eye(4)
    rot2[:3, :3] = [[1, 0, 0], [0, np.cos(t), -np.sin(t)], [0, np.sin(t), np.cos(t)]]
    st = AxialStack(CTVolume(data.astype(np.float32), rot2 @ rot @ new_affine))
    assert np.array_equal(st.data, stack.data)
    p = np.array([[3.0, 7.0, 11.0], [100.0, 50.0, 2.0]])
    assert np.allclose(st.ras_to_stack(st.stack_to_ras(p)), p)


def test_stack_spacing_follows_axes():
    """PSR source: i → posterior (0.5 mm), j → superior (0.8 mm), k → right (2.0 mm)."""
    affine = np.array([[0, 0, 2.0, 0], [-0.5, 0, 0, 0], [0, 0.8, 0, 0], [0, 0, 0, 1]])
    arr = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)
    st = AxialStack(CTVolume(arr, affine))
    assert axis_codes(st) == "PSR"
    assert st.spacing == pytest.approx((0.8, 0.5, 2.0))
    assert st.shape == (5, 4, 6)
    # stack[z, y, x]: z from superior (j = J-1-z), y from anterior (i = y: i runs posterior), x from right (k = K-1-x)
    z, y, x = np.indices(st.shape)
    assert np.array_equal(st.data, arr[y, 4 - z, 5 - x])


# ---- voxel <-> RAS --------------------------------------------------------------------------------

def test_stack_to_ras_by_hand(stack, nib_ct):
    _, affine = nib_ct
    ni, nj, nk = CT_SHAPE
    rng = np.random.default_rng(1)
    zyx = np.stack([rng.integers(0, n, 50) for n in STACK_SHAPE], axis=1)
    src = np.stack([ni - 1 - zyx[:, 2], nj - 1 - zyx[:, 1], nk - 1 - zyx[:, 0], np.ones(50)], axis=1)
    expected = (affine @ src.T).T[:, :3]
    assert np.allclose(stack.stack_to_ras(zyx), expected, atol=1e-9)
    assert np.allclose(stack.index_to_ras @ np.c_[zyx, np.ones(50)].T, np.r_[expected.T, np.ones((1, 50))], atol=1e-9)
    assert np.allclose(stack.stack_to_source_index(zyx), src[:, :3])
    # a single point also works (shape (3,))
    assert np.allclose(stack.stack_to_ras(zyx[0]), expected[0])
    # stack axes point to inferior, posterior, patient left
    d = stack.stack_to_ras([[1, 0, 0], [0, 1, 0], [0, 0, 1]]) - stack.stack_to_ras([0, 0, 0])
    assert np.allclose(d, [[0, 0, -3], [0, -3, 0], [-3, 0, 0]])


def test_ras_to_stack_inverts_stack_to_ras(stack):
    rng = np.random.default_rng(2)
    p = rng.uniform(-10, 130, size=(200, 3))
    assert np.allclose(stack.ras_to_stack(stack.stack_to_ras(p)), p, atol=1e-9)
    r = rng.uniform(-200, 200, size=(50, 3))
    assert np.allclose(stack.stack_to_ras(stack.ras_to_stack(r)), r, atol=1e-9)


# ---- masks between the source grid and the stack --------------------------------------------------

def test_mask_to_stack_and_back_is_exact(stack, seg):
    for arr in (seg.array, seg.array == LIVER, (seg.array % 7).astype(np.int16)):
        back = stack.to_source(stack.to_stack(arr))
        assert back.dtype == arr.dtype and back.shape == arr.shape
        assert np.array_equal(back, arr)


def test_to_stack_rejects_wrong_shape(stack):
    with pytest.raises(VolumeError):
        stack.to_stack(np.zeros((3, 4, 5)))
    with pytest.raises(VolumeError):
        stack.to_source(np.zeros(CT_SHAPE))  # source shape, not stack shape


# ---- slice sampling -----------------------------------------------------------------------------------

def test_sample_slice_indices_112():
    idx = sample_slice_indices(112)
    assert len(idx) == LVLM_SLICE_COUNT == 64
    assert idx == sorted(set(idx))
    assert idx[0] == 0 and idx[-1] == 111
    assert idx == [int(v) for v in np.rint(np.linspace(0, 111, 64))]
    assert all(isinstance(v, int) for v in idx)


def test_sample_slice_indices_hand_case():
    # linspace(0, 99, 4) = 0, 33, 66, 99
    assert sample_slice_indices(100, 4) == [0, 33, 66, 99]
    # linspace(0, 9, 4) = 0, 3, 6, 9
    assert sample_slice_indices(10, 4) == [0, 3, 6, 9]
    # linspace(0, 4, 3) = 0, 2, 4
    assert sample_slice_indices(5, 3) == [0, 2, 4]


@pytest.mark.parametrize("depth", [1, 2, 30, 63, 64])
def test_sample_slice_indices_short_stacks_take_all(depth):
    assert sample_slice_indices(depth) == list(range(depth))


def test_sample_slice_indices_65_has_no_duplicates():
    idx = sample_slice_indices(65)
    assert len(idx) == 64 == len(set(idx)) and idx[0] == 0 and idx[-1] == 64


@pytest.mark.parametrize("depth,n", [(0, 64), (-3, 64), (10, 0)])
def test_sample_slice_indices_invalid(depth, n):
    with pytest.raises(InputError):
        sample_slice_indices(depth, n)


def test_stack_sample_indices(stack):
    assert stack.sample_indices() == sample_slice_indices(112)


# ---- rendering -------------------------------------------------------------------------------------------

def test_render_slice_256(stack):
    img = stack.render_slice(50, 256)
    assert img.shape == (256, 256, 3) and img.dtype == np.uint8
    assert np.array_equal(img[..., 0], img[..., 1]) and np.array_equal(img[..., 1], img[..., 2])
    assert img.std() > 10  # a real image, not a constant


def test_render_slice_native_size_is_windowed_slice(stack):
    z = 37
    img = stack.render_slice(z, None)
    expected = window_to_uint8(stack.data[z])
    assert img.shape == (101, 122, 3)
    for c in range(3):
        assert np.array_equal(img[..., c], expected)
    # same for another window, and (W, H) equal to the slice size means no resize
    lung = stack.render_slice(z, None, window="lung")
    assert np.array_equal(lung[..., 0], window_to_uint8(stack.data[z], "lung"))
    assert np.array_equal(stack.render_slice(z, (122, 101)), img)
    assert np.array_equal(stack.windowed(z), expected)


def test_render_slice_width_height(stack):
    img = stack.render_slice(0, (100, 50))
    assert img.shape == (50, 100, 3)


@pytest.mark.parametrize("z", [-1, 112, 3.0, True, "5"])
def test_render_slice_bad_slice(stack, z):
    with pytest.raises(InputError):
        stack.render_slice(z)


def test_render_slice_bad_size(stack):
    with pytest.raises(InputError):
        stack.render_slice(0, 0)
