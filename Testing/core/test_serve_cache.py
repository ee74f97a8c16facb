"""The worker's volume cache (medvolcore.serve.cache): stacks kept by the sha256 of what the reader
reads, never served for another content, checked against the file's header, least recently used out.
Small NIfTI files written here; the worker's own use of the cache is test_sources.py's."""

from __future__ import annotations

import hashlib

import nibabel as nib
import numpy as np
import pytest

from medvolcore.errors import VolumeError
from medvolcore.serve.cache import StackCache, file_sha256, header_geometry
from medvolcore.volume import load_volume

SPACING = np.diag([0.8, 0.9, 2.5, 1.0])


def _nii(path, fill, shape=(6, 5, 4), affine=SPACING):
    nib.save(nib.Nifti1Image(np.full(shape, fill, np.int16), affine), str(path))
    return path


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_file_is_keyed_by_the_sha256_of_its_bytes(tmp_path):
    a = _nii(tmp_path / "a.nii.gz", 1)
    assert file_sha256(a) == _sha(a)
    assert file_sha256(_nii(tmp_path / "b.nii.gz", 2)) != file_sha256(a)


def test_a_cached_volume_is_served_for_its_own_content_only(tmp_path):
    cache = StackCache(size=4)
    a = _nii(tmp_path / "a.nii.gz", 1)
    stack, digest, cached = cache.get_path(a)
    assert cached is False and digest == _sha(a)
    cache.put(digest, stack)
    # another volume of the same shape and grid: its own content, read from its file
    other, other_digest, cached = cache.get_path(_nii(tmp_path / "b.nii.gz", 2))
    assert cached is False and other is not stack and other_digest != digest
    assert float(other.volume.array.max()) == 2.0
    # the same bytes under another name: the cached stack
    copy = tmp_path / "copy.nii.gz"
    copy.write_bytes(a.read_bytes())
    again, _, cached = cache.get_path(copy)
    assert cached is True and again is stack
    # the first file rewritten with other voxels: a new key, never the cached stack
    _nii(a, 7)
    fresh, fresh_digest, cached = cache.get_path(a)
    assert cached is False and fresh_digest == _sha(a) != digest and float(fresh.volume.array.max()) == 7.0
    assert (cache.hits, cache.misses) == (1, 3)


@pytest.mark.parametrize("change", ["shape", "affine"])
def test_a_cached_volume_that_disagrees_with_the_files_header_is_read_again(tmp_path, change):
    cache = StackCache()
    a = _nii(tmp_path / "a.nii.gz", 1)
    wrong, _, _ = cache.get_path(a)
    b = _nii(tmp_path / "b.nii.gz", 3, shape=(6, 5, 5) if change == "shape" else (6, 5, 4),
             affine=SPACING if change == "shape" else np.diag([0.8, 0.9, 3.0, 1.0]))
    cache.put(_sha(b), wrong)  # b's key holding a's volume (a collision, a poisoned entry)
    stack, digest, cached = cache.get_path(b)
    assert cached is False and stack is not wrong and cache.mismatches == 1 and cache.hits == 0
    assert stack.volume.shape == load_volume(b).shape and np.allclose(stack.volume.affine, load_volume(b).affine)
    assert float(stack.volume.array.max()) == 3.0


def test_the_least_recently_used_volume_leaves_first(tmp_path):
    cache = StackCache(size=2)
    paths = [_nii(tmp_path / f"{i}.nii.gz", i) for i in range(3)]
    keys = []
    for p in paths[:2]:
        stack, digest, _ = cache.get_path(p)
        cache.put(digest, stack)
        keys.append(digest)
    assert cache.get_path(paths[0])[2] is True  # used again: the most recent now
    stack, digest, _ = cache.get_path(paths[2])
    cache.put(digest, stack)
    assert len(cache) == 2 and [d["sha256"] for d in cache.describe()] == [keys[0], digest]
    assert cache.get_path(paths[1])[2] is False  # the one left out is read again
    assert cache.describe()[0]["shape_zyx"] == [4, 5, 6]  # the stack's (z, y, x)
    none = StackCache(size=0)
    none.put(digest, stack)
    assert len(none) == 0


def test_uploaded_bytes_are_keyed_by_their_sha256_and_leave_no_file(tmp_path):
    data = _nii(tmp_path / "a.nii", 5).read_bytes()  # uncompressed: over the 348 bytes of a NIfTI-1 header
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cache = StackCache()
    stack, digest, cached = cache.get_bytes(data, tmp)
    assert digest == hashlib.sha256(data).hexdigest() and cached is False and float(stack.volume.array.max()) == 5.0
    assert list(tmp.iterdir()) == []  # the private file is gone once read
    cache.put(digest, stack)
    assert cache.get_bytes(data, tmp)[2] is True and list(tmp.iterdir()) == []
    with pytest.raises(VolumeError, match="too short to be a NIfTI file"):
        cache.get_bytes(data[:347], tmp)


def test_the_header_geometry_is_what_load_volume_reads(tmp_path, ct_sm_path, write_dicom_series):
    vol = load_volume(ct_sm_path)
    shape, affine = header_geometry(ct_sm_path)
    assert shape == vol.shape and np.allclose(affine, vol.affine)
    single = tmp_path / "one.nii"  # a trailing 4th dimension of 1, as load_volume drops it
    nib.save(nib.Nifti1Image(np.zeros((6, 5, 4, 1), np.int16), SPACING), str(single))
    assert header_geometry(single)[0] == load_volume(single).shape == (6, 5, 4)
    sitk = pytest.importorskip("SimpleITK")
    series = tmp_path / "series"
    write_dicom_series(sitk, sitk.Cast(sitk.ReadImage(str(ct_sm_path)), sitk.sitkInt16), series)
    dicom = load_volume(series)
    shape, affine = header_geometry(series)  # from the file list and the first and last slices' headers
    assert shape == dicom.shape and np.allclose(affine, dicom.affine, atol=1e-4)
