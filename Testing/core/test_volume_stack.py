"""Tests for medvolcore.volume, medvolcore.stack and medvolcore.windowing.

The orientation logic is checked against expectations that do not use the code under test:
anatomy of the real TotalSegmentator CT (liver on the image left, lungs at the top of the stack,
spine at the back), the closed-form index mapping of a RAS file, and hand-reoriented copies of the
same CT that must give the same canonical stack.
"""

from __future__ import annotations

import logging
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.errors import InputError, OutputError, OutputExistsError, VolumeError
from medvolcore.stack import AxialStack, LVLM_SLICE_COUNT, axis_codes, sample_slice_indices
from medvolcore.volume import CTVolume, label_mask, load_label_map, load_volume, save_mask
from medvolcore.windowing import Window, get_window, window_presets, window_to_uint8

# TotalSegmentator v2 label ids (class_map_total_v2.json), as in Testing/conftest.py
SPLEEN, KIDNEY_RIGHT, KIDNEY_LEFT, LIVER, URINARY_BLADDER = 1, 2, 3, 5, 21
LUNG_LABELS = (10, 11, 14)  # lung lobes present in example_seg_fast_force_split
VERTEBRAE = tuple(range(27, 34))  # vertebrae L5 .. T11 (class_map_total_v2.json)
AORTA = 52

CT_SHAPE = (122, 101, 112)
STACK_SHAPE = (112, 101, 122)


# ---- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nib_ct(ct_path):
    img = nib.load(str(ct_path))
    return np.asarray(img.dataobj), np.asarray(img.affine, dtype=np.float64)


@pytest.fixture(scope="module")
def nib_seg(seg_path):
    img = nib.load(str(seg_path))
    return np.asarray(img.dataobj), np.asarray(img.affine, dtype=np.float64)


@pytest.fixture(scope="module")
def ct(ct_path):
    return load_volume(ct_path)


@pytest.fixture(scope="module")
def seg(seg_path):
    return load_label_map(seg_path)


@pytest.fixture(scope="module")
def stack(ct):
    return AxialStack(ct)


@pytest.fixture(scope="module")
def seg_stack(stack, seg):
    return stack.to_stack(seg.array)


def _centroid(mask):
    pts = np.argwhere(mask)
    assert len(pts), "structure absent"
    return pts.mean(axis=0)  # (z, y, x)


# ---- the real CT: loading and anatomy on the canonical stack ---------------------------------

def test_real_ct_loads_as_float32_hu_on_its_own_grid(ct, nib_ct):
    data, affine = nib_ct
    assert ct.shape == CT_SHAPE
    assert ct.array.dtype == np.float32
    assert np.array_equal(ct.array, data.astype(np.float32))
    assert np.array_equal(ct.affine, affine)
    assert ct.spacing == pytest.approx((3.0, 3.0, 3.0))
    assert ct.source_format == "nifti"
    assert ct.array.min() == -1207 and ct.array.max() == 3382


def test_real_label_map_is_integer_on_same_grid(seg, ct, nib_seg):
    data, _ = nib_seg
    assert np.issubdtype(seg.array.dtype, np.integer)
    assert np.array_equal(seg.array, data)
    assert seg.same_grid(ct)


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


def _reorient(data, affine, perm, flips):
    """New array axis a = old axis perm[a], reversed where flips[a]; affine adjusted by hand."""
    new = np.transpose(data, perm)
    new = new[tuple(slice(None, None, -1) if f else slice(None) for f in flips)]
    m = np.zeros((4, 4))
    m[3, 3] = 1.0
    for a, (old, f) in enumerate(zip(perm, flips)):
        m[old, a] = -1.0 if f else 1.0
        m[old, 3] = new.shape[a] - 1 if f else 0.0
    return np.ascontiguousarray(new), affine @ m


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


# ---- masks between grids and on disk ---------------------------------------------------------------

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


def test_save_mask_nifti_same_grid_uint8_unscaled(tmp_path, ct, seg, seg_path):
    ref = nib.load(str(seg_path))
    mask = label_mask(seg, LIVER)
    out = save_mask(mask, ct, tmp_path / "liver.nii.gz")
    assert Path(out) == tmp_path / "liver.nii.gz"
    img = nib.load(str(out))
    assert img.shape == CT_SHAPE
    assert np.array_equal(img.affine, ref.affine)
    assert img.get_data_dtype() == np.uint8
    raw = np.asanyarray(img.dataobj)
    assert raw.dtype == np.uint8
    assert np.array_equal(raw, mask.astype(np.uint8))
    assert np.array_equal(np.asarray(img.dataobj.get_unscaled()), mask.astype(np.uint8))
    slope, inter = img.header.get_slope_inter()
    assert slope in (None, 1.0) and inter in (None, 0.0)
    # and back through the reader
    back = load_label_map(out)
    assert np.array_equal(back.array, mask.astype(np.uint8))


def test_save_mask_whole_label_map_round_trip(tmp_path, seg, seg_path):
    ref = nib.load(str(seg_path))
    out = save_mask(seg.array, seg, tmp_path / "labels.nii")
    img = nib.load(str(out))
    assert np.array_equal(img.affine, ref.affine)
    assert img.get_data_dtype() == np.uint8
    assert np.array_equal(np.asanyarray(img.dataobj), seg.array)


def test_save_mask_on_reoriented_grid_keeps_its_affine(tmp_path, nib_seg):
    data, affine = _reorient(nib_seg[0], nib_seg[1], (1, 2, 0), (True, False, False))
    p = tmp_path / "psr.nii.gz"
    nib.save(nib.Nifti1Image(data, affine), str(p))
    like = load_label_map(p)
    st = AxialStack(like)
    mask_stack = st.to_stack(like.array) == LIVER
    out = save_mask(st.to_source(mask_stack), like, tmp_path / "m.nii.gz")
    img = nib.load(str(out))
    assert np.array_equal(img.affine, nib.load(str(p)).affine)
    assert np.array_equal(np.asanyarray(img.dataobj), (data == LIVER).astype(np.uint8))


def test_save_mask_nrrd_round_trip(tmp_path, seg):
    sitk = pytest.importorskip("SimpleITK")
    out = save_mask(seg.array, seg, tmp_path / "labels.nrrd")
    back = load_label_map(out)
    assert back.source_format == "nrrd"
    assert back.shape == seg.shape
    assert np.array_equal(back.array, seg.array)
    assert np.allclose(back.affine, seg.affine, atol=1e-5)
    # independent check of the LPS header: origin is the RAS origin with R and A negated
    img = sitk.ReadImage(str(out))
    assert np.allclose(img.GetOrigin(), seg.affine[:3, 3] * [-1, -1, 1], atol=1e-5)
    assert np.allclose(img.GetSpacing(), (3, 3, 3))
    assert np.allclose(np.reshape(img.GetDirection(), (3, 3)), np.diag([-1, -1, 1]))
    assert np.array_equal(sitk.GetArrayFromImage(img), seg.array.transpose(2, 1, 0))


def test_save_mask_rejects_wrong_shape_and_suffix(tmp_path, ct):
    with pytest.raises(VolumeError):
        save_mask(np.zeros((2, 2, 2), np.uint8), ct, tmp_path / "x.nii.gz")
    with pytest.raises(OutputError, match="unsupported mask type"):  # refused before anything is written
        save_mask(np.zeros(CT_SHAPE, np.uint8), ct, tmp_path / "x.png")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".nii.gz", ".nii", ".nrrd", ".mha"])
def test_save_mask_refuses_existing_output_and_leaves_no_temp(tmp_path, suffix):
    like = CTVolume(np.zeros((4, 5, 6), np.float32), np.diag([2.0, 2.0, 3.0, 1.0]))
    a = np.zeros((4, 5, 6), np.uint8)
    a[1:3, 2:4, 1:5] = 1
    out = tmp_path / f"mask{suffix}"
    save_mask(a, like, out)
    first = out.read_bytes()
    with pytest.raises(OutputExistsError):
        save_mask(np.ones_like(a), like, out)
    assert out.read_bytes() == first
    save_mask(np.ones_like(a), like, out, overwrite=True)
    assert np.array_equal(load_label_map(out).array, np.ones_like(a))
    assert list(tmp_path.glob(".*part*")) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


@pytest.mark.parametrize("suffix", [".mhd", ".nhdr"])
def test_save_mask_refuses_detached_header_formats(tmp_path, suffix):
    like = CTVolume(np.zeros((4, 5, 6), np.float32), np.diag([2.0, 2.0, 3.0, 1.0]))
    a = np.zeros((4, 5, 6), np.uint8)
    a[1:3, 2:4, 1:5] = 1
    # detached-header formats write two files, which one atomic rename cannot move: refused
    with pytest.raises(OutputError, match="unsupported mask type"):
        save_mask(a, like, tmp_path / f"mask{suffix}")
    assert list(tmp_path.iterdir()) == []


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


# ---- windowing ------------------------------------------------------------------------------------------

def test_window_to_uint8_soft_tissue_known_values():
    hu = np.array([-160, 240, 40, -1000, 3000, -159, 0, 100, 239], dtype=np.float32)
    # round(255 * (clip(hu, -160, 240) + 160) / 400): 40 -> 127.5 -> 128 (round half to even)
    # 0 -> 102.0, 100 -> 165.75 -> 166, -159 -> 0.6375 -> 1, 239 -> 254.3625 -> 254
    expected = [0, 255, 128, 0, 255, 1, 102, 166, 254]
    out = window_to_uint8(hu)
    assert out.dtype == np.uint8
    assert out.tolist() == expected
    assert window_to_uint8(hu, "soft_tissue").tolist() == expected
    assert window_to_uint8(hu, (40, 400)).tolist() == expected
    assert window_to_uint8(hu, "40,400").tolist() == expected


def test_window_to_uint8_rounds_half_to_even():
    # width 255 makes the scale exactly 1: values are HU - low, so the halves are exact
    hu = np.array([0.5, 1.5, 2.5, 3.49, 3.51, 254.5], dtype=np.float32)
    assert window_to_uint8(hu, (127.5, 255)).tolist() == [0, 2, 2, 3, 4, 254]


def test_window_to_uint8_keeps_shape_and_accepts_ints():
    a = np.full((3, 4, 5), 240, dtype=np.int32)
    out = window_to_uint8(a)
    assert out.shape == (3, 4, 5) and out.dtype == np.uint8 and (out == 255).all()


def test_window_presets_and_strings():
    presets = window_presets()
    assert presets["lung"].center == -600 and presets["lung"].width == 1500
    assert get_window(None).center == 40 and get_window(None).width == 400
    lung = get_window("lung")
    assert (lung.low, lung.high) == (-1350, 150)
    # lung: round(255 * (hu + 1350) / 1500); -975 -> 63.75 -> 64
    assert window_to_uint8(np.array([-1350, 150, -975, -2000, 500]), "lung").tolist() == [0, 255, 64, 0, 255]
    assert get_window(" -600 , 1500 ") == Window(-600.0, 1500.0)
    assert get_window("50,350").low == 50 - 175
    w = Window(10, 20, "x")
    assert get_window(w) is w


@pytest.mark.parametrize("spec", ["nope", "40", "40,400,1", "a,b", "40,0", "40,-5", (40,), (1, 2, 3), 7, (40, float("nan"))])
def test_invalid_windows(spec):
    with pytest.raises(InputError):
        get_window(spec)


def test_invalid_window_object():
    with pytest.raises(InputError):
        Window(0, 0)


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


# ---- loading errors ----------------------------------------------------------------------------------------

def _save_nifti(path, data, affine=None):
    nib.save(nib.Nifti1Image(data, np.diag([2.0, 2.0, 2.0, 1.0]) if affine is None else affine), str(path))
    return path


def test_missing_file(tmp_path):
    with pytest.raises(VolumeError, match="does not exist"):
        load_volume(tmp_path / "nope.nii.gz")
    with pytest.raises(VolumeError, match="does not exist"):
        load_label_map(tmp_path / "nope.nii.gz")


def test_2d_nifti_rejected(tmp_path):
    p = _save_nifti(tmp_path / "flat.nii.gz", np.zeros((5, 6), np.int16))
    with pytest.raises(VolumeError, match="3-D"):
        load_volume(p)


def test_4d_nifti_with_three_volumes_rejected(tmp_path):
    p = _save_nifti(tmp_path / "t.nii.gz", np.zeros((4, 5, 6, 3), np.int16))
    with pytest.raises(VolumeError, match="3-D"):
        load_volume(p)


def test_4d_nifti_with_one_volume_accepted(tmp_path):
    data = np.arange(4 * 5 * 6, dtype=np.int16).reshape(4, 5, 6, 1)
    p = _save_nifti(tmp_path / "t1.nii.gz", data)
    vol = load_volume(p)
    assert vol.shape == (4, 5, 6)
    assert np.array_equal(vol.array, data[..., 0])


def test_all_nan_rejected(tmp_path):
    p = _save_nifti(tmp_path / "nan.nii.gz", np.full((3, 4, 5), np.nan, np.float32))
    with pytest.raises(VolumeError, match="NaN"):
        load_volume(p)


def test_partial_nan_filled_with_min(tmp_path, caplog):
    data = np.arange(60, dtype=np.float32).reshape(3, 4, 5) - 100
    data[0, 0, 0] = np.nan
    data[2, 3, 4] = np.inf
    p = _save_nifti(tmp_path / "pnan.nii.gz", data)
    with caplog.at_level(logging.WARNING):
        vol = load_volume(p)
    assert np.isfinite(vol.array).all()
    assert vol.array[0, 0, 0] == -99 and vol.array[2, 3, 4] == -99  # min of the finite voxels
    assert vol.array[1, 1, 1] == data[1, 1, 1]
    assert any("non-finite" in r.getMessage() for r in caplog.records)


def test_text_file_named_nifti(tmp_path):
    p = tmp_path / "x.nii.gz"
    p.write_text("this is not an image\n")
    with pytest.raises(VolumeError):
        load_volume(p)


def test_unsupported_suffix(tmp_path):
    p = tmp_path / "x.png"
    p.write_bytes(b"\x89PNG\r\n")
    with pytest.raises(VolumeError, match="unsupported"):
        load_volume(p)


def test_label_map_with_non_integer_floats(tmp_path):
    data = np.zeros((3, 4, 5), np.float32)
    data[1, 1, 1] = 2.5
    with pytest.raises(VolumeError, match="non-integer"):
        load_label_map(_save_nifti(tmp_path / "f.nii.gz", data))


def test_label_map_with_integral_floats_becomes_int(tmp_path):
    data = np.zeros((3, 4, 5), np.float32)
    data[1, 1, 1] = 5.0
    lab = load_label_map(_save_nifti(tmp_path / "fi.nii.gz", data))
    assert np.issubdtype(lab.array.dtype, np.integer)
    assert lab.array[1, 1, 1] == 5 and lab.array.sum() == 5


def test_label_map_negative_rejected(tmp_path):
    data = np.zeros((3, 4, 5), np.int16)
    data[0, 0, 0] = -1
    with pytest.raises(VolumeError, match="negative"):
        load_label_map(_save_nifti(tmp_path / "neg.nii.gz", data))


def test_label_mask(seg):
    m = label_mask(seg, LIVER)
    assert m.dtype == bool and m.sum() == int((seg.array == LIVER).sum()) == 41692
    both = label_mask(seg, [KIDNEY_RIGHT, KIDNEY_LEFT])
    assert both.sum() == 7134 + 5090
    assert np.array_equal(label_mask(seg), seg.array != 0)


def test_label_mask_absent_label_lists_present(seg):
    with pytest.raises(VolumeError) as e:
        label_mask(seg, 116)
    msg = str(e.value)
    assert "116" in msg and "absent" in msg
    assert "1, 2, 3, 4, 5" in msg


def test_label_mask_empty_map():
    empty = CTVolume(np.zeros((2, 3, 4), np.uint8), np.eye(4))
    with pytest.raises(VolumeError):
        label_mask(empty)
    with pytest.raises(VolumeError, match="none"):
        label_mask(empty, 1)


def test_ctvolume_rejects_bad_shapes():
    with pytest.raises(VolumeError):
        CTVolume(np.zeros((2, 3)), np.eye(4))
    with pytest.raises(VolumeError):
        CTVolume(np.zeros((2, 3, 4)), np.eye(3))


# ---- DICOM, NRRD and MetaImage geometry ------------------------------------------------------------------

def _sitk_image(sitk):
    rng = np.random.default_rng(5)
    arr = rng.integers(-1000, 1500, size=(7, 9, 11)).astype(np.int16)  # SimpleITK order (k, j, i)
    img = sitk.GetImageFromArray(arr)
    img.SetSpacing((0.7, 0.8, 2.5))
    img.SetOrigin((-12.5, 30.0, 100.0))
    # coronal acquisition (LSA): i → +x (LPS: left), j → +z (superior), k → −y (LPS: anterior)
    img.SetDirection((1.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 1.0, 0.0))
    return img, arr


def _expected_ras_affine(img):
    d = np.reshape(img.GetDirection(), (3, 3))
    a = np.eye(4)
    a[:3, :3] = np.diag([-1, -1, 1]) @ d @ np.diag(img.GetSpacing())
    a[:3, 3] = np.diag([-1, -1, 1]) @ np.asarray(img.GetOrigin())
    return a


def test_dicom_series_geometry_matches_nifti(tmp_path, write_dicom_series):
    sitk = pytest.importorskip("SimpleITK")
    img, arr = _sitk_image(sitk)
    write_dicom_series(sitk, img, tmp_path / "series")
    sitk.WriteImage(img, str(tmp_path / "same.nii.gz"))
    dcm = load_volume(tmp_path / "series")
    nii = load_volume(tmp_path / "same.nii.gz")  # read by nibabel
    assert dcm.source_format == "dicom"
    assert dcm.shape == nii.shape == (11, 9, 7)
    assert np.array_equal(dcm.array, arr.transpose(2, 1, 0).astype(np.float32))
    assert np.array_equal(dcm.array, nii.array)
    assert np.allclose(dcm.affine, _expected_ras_affine(img), atol=1e-4)
    assert np.allclose(dcm.affine, nii.affine, atol=1e-4)
    assert dcm.spacing == pytest.approx((0.7, 0.8, 2.5), abs=1e-4)
    # both give the same canonical stack
    assert np.array_equal(AxialStack(dcm).data, AxialStack(nii).data)
    assert axis_codes(AxialStack(dcm)) == "LSA"


@pytest.mark.parametrize("suffix", [".nrrd", ".mha"])
def test_itk_file_geometry_matches_nifti(tmp_path, suffix):
    sitk = pytest.importorskip("SimpleITK")
    img, arr = _sitk_image(sitk)
    sitk.WriteImage(img, str(tmp_path / f"v{suffix}"))
    sitk.WriteImage(img, str(tmp_path / "v.nii.gz"))
    a, b = load_volume(tmp_path / f"v{suffix}"), load_volume(tmp_path / "v.nii.gz")
    assert a.source_format == suffix.lstrip(".")
    assert np.array_equal(a.array, b.array)
    assert np.allclose(a.affine, _expected_ras_affine(img), atol=1e-6)
    assert np.allclose(a.affine, b.affine, atol=1e-4)


def test_empty_folder_is_not_a_dicom_series(tmp_path):
    pytest.importorskip("SimpleITK")
    (tmp_path / "empty").mkdir()
    with pytest.raises(VolumeError):
        load_volume(tmp_path / "empty")


def test_outputs_get_normal_file_permissions(tmp_path):
    import os
    import stat

    from medvolcore.fileio import write_text_atomic

    p = write_text_atomic(tmp_path / "a.anchor.json", "{}")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask
