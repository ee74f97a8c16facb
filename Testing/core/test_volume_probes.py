"""Reading volumes and writing masks (:mod:`medvolcore.volume`) under hostile or broken input (probes,
``@pytest.mark.probe``): cancel while reading, a header declaring a bomb, patient text in header
fields, 2-D/4-D/vector headers over ``--max-voxels`` and NIfTI header extensions (second review,
II.10), masks named with an upper-case suffix (II.5). A DICOM folder's probes are test_dicom.py's.

The memory figures come from a fresh Python process (:func:`core.probes.peak_mb`); where a test also
measures the unguarded library call (SimpleITK's ``ReadImage``, ``nibabel.load``), it does so after
the guarded read in the same process, so the two peaks are comparable."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.errors import CancelledError, LimitError, VolumeError
from medvolcore.volume import MAX_NIFTI_EXTENSIONS, load_label_map, load_volume, save_mask

from core.probes import assert_no_patient_text, bomb, ct_with_patient_text, gzip_of, peak_mb


@pytest.mark.probe("3", "cancel while reading a volume")
def test_reading_honours_cancel(ct_path):
    ev = threading.Event()
    ev.set()
    with pytest.raises(CancelledError):
        load_volume(ct_path, cancel=ev)


@pytest.mark.probe("10", "save_mask clears descrip/aux_file/intent_name/db_name")
def test_save_mask_clears_free_text_but_keeps_geometry(tmp_path, ct_sm_path):
    ct = load_volume(ct_with_patient_text(ct_sm_path, tmp_path / "named.nii.gz"))
    out = save_mask(np.zeros(ct.shape, np.uint8), ct, tmp_path / "m.nii.gz")
    assert_no_patient_text(out)
    assert np.allclose(nib.load(str(out)).affine, ct.affine)


# ---- unit-level limits --------------------------------------------------------------------------------

@pytest.mark.probe("4", "load_volume of the bomb with the default limit")
def test_voxel_limit_checked_in_the_header(tmp_path):
    p = tmp_path / "bomb.nii.gz"
    p.write_bytes(bomb())
    t = time.perf_counter()
    with pytest.raises(LimitError, match="over the limit"):
        load_volume(p, max_voxels=1024 * 1024 * 2000)
    assert time.perf_counter() - t < 1


# ---- II.10a: the voxel limit counts every dimension and component, from the header ---------------------

def _nhdr(folder: Path, name: str, sizes, kinds=None) -> Path:
    """A detached NRRD header whose data file is empty: only a header check can answer."""
    (folder / "empty.raw").touch()
    p = folder / name
    lines = ["NRRD0004", "type: short", f"dimension: {len(sizes)}", "sizes: " + " ".join(map(str, sizes)),
             "encoding: raw", "endian: little", "data file: empty.raw"]
    if kinds:
        lines.insert(4, "kinds: " + " ".join(kinds))
    p.write_text("\n".join(lines) + "\n")
    return p


def _mhd(folder: Path, name: str, sizes, channels=1) -> Path:
    """A MetaImage header whose data file exists but is empty: the header alone must be refused."""
    p = folder / name
    (folder / "empty.raw").touch()
    p.write_text(f"ObjectType = Image\nNDims = {len(sizes)}\nDimSize = {' '.join(map(str, sizes))}\n"
                 f"ElementNumberOfChannels = {channels}\nElementType = MET_SHORT\nElementDataFile = empty.raw\n")
    return p


def _nifti_header_only(folder: Path, name: str, shape) -> Path:
    """A .nii whose header declares ``shape`` int16 voxels, with none of them in the file."""
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(np.int16)
    hdr["vox_offset"] = 352
    p = folder / name
    p.write_bytes(hdr.binaryblock + b"\0" * 4)
    return p


HEADERS = {  # name: (writer, declared shape with components), every one over a limit of 2,000 voxels
    "nrrd 2-D": (lambda d: _nhdr(d, "a.nhdr", (50, 50)), "50×50 = 2,500"),
    "nrrd 4-D": (lambda d: _nhdr(d, "b.nhdr", (10, 10, 10, 3)), "10×10×10×3 = 3,000"),
    "nrrd vector": (lambda d: _nhdr(d, "c.nhdr", (3, 10, 10, 10), ["vector", "domain", "domain", "domain"]),
                    "10×10×10×3 = 3,000"),
    "mhd 4-D": (lambda d: _mhd(d, "d.mhd", (10, 10, 10, 3)), "10×10×10×3 = 3,000"),
    "mhd vector": (lambda d: _mhd(d, "e.mhd", (10, 10, 10), channels=3), "10×10×10×3 = 3,000"),
    "nifti 2-D": (lambda d: _nifti_header_only(d, "f.nii", (50, 50)), "50×50 = 2,500"),
    "nifti 4-D": (lambda d: _nifti_header_only(d, "g.nii", (10, 10, 10, 3)), "10×10×10×3 = 3,000"),
    "nifti vector": (lambda d: _nifti_header_only(d, "h.nii", (10, 10, 10, 1, 3)), "10×10×10×1×3 = 3,000"),
}


@pytest.mark.probe("II.10", "2-D/4-D/vector NRRD, MetaImage and NIfTI headers over --max-voxels")
@pytest.mark.parametrize("kind", sorted(HEADERS))
def test_voxel_limit_counts_every_dimension_and_component(tmp_path, kind):
    pytest.importorskip("SimpleITK")
    write, declared = HEADERS[kind]
    with pytest.raises(LimitError, match=f"declares {declared} voxels.*over the limit of 2,000"):
        load_volume(write(tmp_path), max_voxels=2000)


@pytest.mark.probe("II.10", "2-D/4-D/vector headers within --max-voxels")
@pytest.mark.parametrize("kind", sorted(HEADERS))
def test_not_a_3d_scalar_ct_is_refused_from_the_header(tmp_path, kind):
    pytest.importorskip("SimpleITK")
    write, _ = HEADERS[kind]
    with pytest.raises(VolumeError, match="not a 3-D scalar CT: the header declares a"):
        load_volume(write(tmp_path), max_voxels=10_000)


@pytest.mark.probe("II.10", "4-D NRRD of 256×256×128×4 zeros (67 MB) over --max-voxels")
def test_4d_nrrd_over_the_limit_is_not_read(tmp_path, record_property):
    pytest.importorskip("SimpleITK")
    sizes = (256, 256, 128, 4)
    head = ("NRRD0004\ntype: short\ndimension: 4\nsizes: " + " ".join(map(str, sizes))
            + "\nencoding: gzip\nendian: little\n\n").encode()
    p = tmp_path / "bomb4d.nrrd"
    p.write_bytes(head + gzip_of(2 * int(np.prod(sizes))))
    import SimpleITK as sitk
    warm = tmp_path / "warm.nrrd"
    sitk.WriteImage(sitk.Image(4, 4, 4, sitk.sitkInt16), str(warm), True)
    fig = peak_mb(f"""
        out["error"] = error(lambda: load_volume({str(p)!r}, max_voxels=256 * 256 * 128))
        mark("guarded")
        SimpleITK.ReadImage({str(p)!r})
        mark("unguarded")
    """, "SimpleITK", warm=warm)
    record_property("file_kb", round(p.stat().st_size / 1024))
    record_property("load_volume_rss_growth_mb", round(fig["guarded"] - fig["start"]))
    record_property("sitk_readimage_rss_growth_mb", round(fig["unguarded"] - fig["start"]))
    assert fig["error"].startswith("LimitError: bomb4d.nrrd declares 256×256×128×4"), fig["error"]
    assert fig["guarded"] - fig["start"] < 10, fig
    assert fig["unguarded"] - fig["guarded"] > 50, fig  # what the reader used to read before refusing


def test_nifti_with_a_trailing_singleton_is_still_read(tmp_path):
    data = np.arange(24, dtype=np.int16).reshape(2, 3, 4, 1, 1)
    p = tmp_path / "five.nii.gz"
    nib.save(nib.Nifti1Image(data, np.eye(4)), str(p))
    v = load_label_map(p)
    assert v.shape == (2, 3, 4) and np.array_equal(v.array, data[..., 0, 0])


# ---- II.10b: NIfTI header extensions ---------------------------------------------------------------------

def _nifti_with_extension(path: Path, esize: int, vox_offset: int) -> np.ndarray:
    """A 4×4×4 int16 .nii.gz with one extension whose header claims ``esize`` bytes, the voxels
    (1 … 64) at ``vox_offset`` and zeros up to the end of what the extension claims."""
    data = np.arange(1, 65, dtype=np.int16).reshape(4, 4, 4)
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(data.shape)
    hdr.set_data_dtype(np.int16)
    hdr["vox_offset"] = vox_offset
    head = hdr.binaryblock + b"\1\0\0\0" + np.array([esize, 40], "<i4").tobytes()
    tail = max(0, len(head) + esize - 8 - vox_offset - data.nbytes)
    path.write_bytes(gzip_of(head, vox_offset - len(head), data.tobytes(order="F"), tail))
    return data


@pytest.mark.probe("II.10", "NIfTI whose vox_offset leaves 64 MB of header extensions")
def test_nifti_extension_region_over_the_cap_is_refused(tmp_path):
    p = tmp_path / "ext.nii.gz"
    _nifti_with_extension(p, 64 << 20, 352 + (64 << 20))
    with pytest.raises(LimitError, match=r"67,109,216 bytes into the file, after 64\.0 MB of header extensions "
                                         rf"\(at most {MAX_NIFTI_EXTENSIONS >> 20} MB\)"):
        load_volume(p)


@pytest.mark.probe("II.10", "NIfTI extension claiming 128 MB (a 130 kB .nii.gz)")
def test_nifti_extensions_are_never_read(tmp_path, record_property):
    p = tmp_path / "esize.nii.gz"
    data = _nifti_with_extension(p, 128 << 20, 368)  # vox_offset small, the extension's claimed size huge
    warm = tmp_path / "warm.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.int16), np.eye(4)), str(warm))
    fig = peak_mb(f"""
        v = load_volume({str(p)!r})
        out["values"] = v.array.ravel(order="F").tolist()
        mark("guarded")
        nibabel.load({str(p)!r})
        mark("unguarded")
    """, "nibabel", warm=warm)
    record_property("file_kb", round(p.stat().st_size / 1024))
    record_property("load_volume_rss_growth_mb", round(fig["guarded"] - fig["start"]))
    record_property("nibabel_load_rss_growth_mb", round(fig["unguarded"] - fig["start"]))
    assert fig["values"] == data.ravel(order="F").tolist()
    assert fig["guarded"] - fig["start"] < 10, fig
    assert fig["unguarded"] - fig["guarded"] > 100, fig  # what nibabel (and so the reader, before) held


# ---- II.5: masks named with an upper-case suffix ---------------------------------------------------------

def _tiny_volume():
    from medvolcore.volume import CTVolume

    return CTVolume(np.zeros((6, 5, 4), dtype=np.float32), np.diag([1.5, 1.5, 2.0, 1.0]))


def _mask():
    m = np.zeros((6, 5, 4), dtype=np.uint8)
    m[1:4, 2:4, 1:3] = 1
    return m


@pytest.mark.probe("II.5", "mask named .Nii, .Mha, .MHA, .NII.GZ, .Nrrd")
@pytest.mark.parametrize("name", ["m.Nii", "m.Mha", "m.MHA", "m.NII.GZ", "m.Nrrd"])
def test_upper_case_mask_suffixes_hold_the_mask(tmp_path, name):
    """The writers choose the format from the suffix and do not read upper case: the temporary's
    suffix is lower case, so the file under the user's name holds the mask (it used to be 0 bytes,
    the data left in a hidden .part file), and MedVol reads it back under that name (ITK matches
    ``.mha`` in lower case only: the reader is chosen from the suffix in any case)."""
    from medvolcore.volume import load_label_map, save_mask

    like = _tiny_volume()
    save_mask(_mask(), like, tmp_path / name)
    assert os.listdir(tmp_path) == [name]  # nothing hidden left beside it
    back = load_label_map(tmp_path / name)
    assert np.array_equal(np.asarray(back.array), _mask()) and np.allclose(back.affine, like.affine)
