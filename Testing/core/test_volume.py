"""CT volumes (medvolcore.volume): the real CT and its label map read on their own grid, masks
written back onto it, loading errors, NRRD and MetaImage geometry.

The real CT's fixtures here are shared with test_stack.py (the canonical stack and its anatomy).
"""

from __future__ import annotations

import logging
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.errors import OutputError, OutputExistsError, VolumeError
from medvolcore.stack import AxialStack
from medvolcore.volume import CTVolume, label_mask, load_label_map, load_volume, save_mask

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


# ---- the real CT: loading ----------------------------------------------------------------------

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


# ---- masks on disk ----------------------------------------------------------------------------------

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


# ---- NRRD and MetaImage geometry (a DICOM series': test_dicom.py) -------------------------------------

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
