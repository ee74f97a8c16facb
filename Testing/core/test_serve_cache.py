"""The worker's volume cache (medvolcore.serve.cache): stacks kept by the sha256 of what the reader
reads, never served for another content, checked against the file's header, least recently used out.
Small NIfTI files written here; the worker's own use of the cache is test_sources.py's."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.errors import VolumeError
from medvolcore.serve import Worker
from medvolcore.serve.cache import StackCache, file_sha256, header_geometry
from medvolcore.serve.worker import _Job
from medvolcore.volume import load_volume

sitk = pytest.importorskip("SimpleITK")

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


# ---- the key is the sha256 of the bytes read (probe 43.1) --------------------------------------
# The worker's volume cache key is the sha256 of the very bytes that become the volume (probe 43.1).
#
# Over stdio the client's file is the caller's own: Slicer re-exports ``{nodeID}.nii`` with
# ``os.replace``, so a file can be replaced between the moment it is hashed and the moment it is
# read. The old worker hashed the path, then opened it again to read it: a reply could carry CT X's
# ``volume_sha256`` with CT Y's voxels, and the cache then held Y's stack under X's key, served to
# every later request for X. Now the files are copied into the worker's private folder while hashed
# and only the copy is read.
#
# Each case makes two volumes X and Y of the same shape (so the header check before serving a cached
# stack cannot tell them apart), in every layout whose key is a content sha256: a single NIfTI, a
# detached MetaImage header (relative and absolute data file names), a NRRD header naming its data
# file through ``..``, and a DICOM folder. ``install`` puts one of them in place, file by file with
# ``os.replace`` as an exporter does.
# 

ANCHOR = {"schema": "medvol.anchor/1", "slice": 1, "boxes": [[2, 2, 8, 8]], "source": "user"}
SHAPE = (16, 16, 4)


def _voxels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-1000, 1000, size=SHAPE).astype(np.int16)


def _raw(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.ascontiguousarray(_voxels(seed).transpose(2, 1, 0)).tobytes())


def _make(tree: Path, layout: str, seed: int, live: Path, write_dicom_series) -> str:
    """Write volume ``seed`` in ``layout`` under ``tree``; the volume's path relative to the tree."""
    tree.mkdir(parents=True)
    if layout == "nifti":
        nib.save(nib.Nifti1Image(_voxels(seed), np.diag([0.7, 0.8, 2.5, 1.0])), str(tree / "ct.nii"))
        return "ct.nii"
    head = ("ObjectType = Image\nNDims = 3\nBinaryData = True\nBinaryDataByteOrderMSB = False\n"
            "ElementSpacing = 0.7 0.8 2.5\nDimSize = 16 16 4\nElementType = MET_SHORT\nElementDataFile = %s\n")
    if layout == "mhd":
        _raw(tree / "ct.raw", seed)
        (tree / "ct.mhd").write_text(head % "ct.raw")
        return "ct.mhd"
    if layout == "mhd-absolute":
        _raw(tree / "data" / "ct.raw", seed)
        (tree / "ct.mhd").write_text(head % (live / "data" / "ct.raw"))
        return "ct.mhd"
    if layout == "nhdr-up":
        _raw(tree / "data" / "ct.raw", seed)
        (tree / "hdr").mkdir()
        (tree / "hdr" / "ct.nhdr").write_text("NRRD0004\ntype: short\ndimension: 3\nsizes: 16 16 4\n"
                                              "spacings: 0.7 0.8 2.5\nencoding: raw\nendian: little\n"
                                              "data file: ../data/ct.raw\n")
        return "hdr/ct.nhdr"
    assert layout == "dicom"
    img = sitk.GetImageFromArray(_voxels(seed).transpose(2, 1, 0))
    img.SetSpacing((0.7, 0.8, 2.5))
    write_dicom_series(sitk, img, tree / "series", uid="1.2.826.0.1.3680043.2.1125.4331")
    return "series"


def install(tree: Path, live: Path) -> None:
    """Put every file of ``tree`` in place under ``live``, each with ``os.replace`` (a new inode)."""
    for f in sorted(p for p in tree.rglob("*") if p.is_file()):
        dst = live / f.relative_to(tree)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        shutil.copyfile(f, tmp)
        os.replace(tmp, dst)


def stack_for(w: Worker, volume: Path) -> tuple:
    """``(stack, sha256, cached)`` as a stdio request gets it; the stack is then kept, as after a
    successful request."""
    job = _Job({"id": "t", "op": "propagate", "anchor": ANCHOR, "volume": str(volume)}, lambda r: None, "stdio")
    stack, digest, cached = w._stack_for(job, lambda *a, **k: None)
    if not cached:
        w.cache.put(digest, stack, w._scope(job))
    return stack, digest, cached


@pytest.fixture
def worker():
    w = Worker(transport="stdio")

    def refuse(*a, **k):
        raise AssertionError("the pipeline was reached")

    w._ensure_pipeline = refuse
    yield w
    w.close(5)


def _setup(tmp_path, layout, write_dicom_series):
    live = tmp_path / "live"
    rel = _make(tmp_path / "x", layout, 1, live, write_dicom_series)
    _make(tmp_path / "y", layout, 2, live, write_dicom_series)
    from medvolcore.serve.cache import file_sha256
    from medvolcore.volume import load_volume

    expected = {}
    for name in ("y", "x"):  # what each key must give: X is left in place
        install(tmp_path / name, live)
        expected[name] = (file_sha256(live / rel), load_volume(live / rel).array)
    assert expected["x"][0] != expected["y"][0] and not np.array_equal(expected["x"][1], expected["y"][1])
    return live, live / rel, expected


def _check(stack, digest, expected) -> str:
    """Which volume the reply is, after checking that its voxels are those of its sha256."""
    by_key = {d: (name, arr) for name, (d, arr) in expected.items()}
    assert digest in by_key, "a key that is neither volume's"
    name, arr = by_key[digest]
    assert np.array_equal(stack.volume.array, arr), f"the reply says {name} (sha256) but carries the other's voxels"
    return name


@pytest.mark.probe("43.1", "stdio: the volume file replaced (os.replace) between its hash and its read")
@pytest.mark.parametrize("layout", ["nifti", "mhd", "mhd-absolute", "nhdr-up", "dicom"])
def test_file_replaced_between_hash_and_read(worker, tmp_path, layout, write_dicom_series, monkeypatch):
    import medvolcore.volume as volume

    live, path, expected = _setup(tmp_path, layout, write_dicom_series)
    real = volume.load_volume
    swaps = []

    def swap_then_read(p, *a, **k):  # the exporter wins the race: the swap lands right here
        if not swaps:
            install(tmp_path / "y", live)
            swaps.append(p)
        return real(p, *a, **k)

    monkeypatch.setattr(volume, "load_volume", swap_then_read)
    stack, digest, cached = stack_for(worker, path)
    assert swaps and cached is False
    _check(stack, digest, expected)  # before: X's sha256 with Y's voxels
    monkeypatch.setattr(volume, "load_volume", real)
    # a fresh copy of X: never Y's stack from the cache
    install(tmp_path / "x", live)
    stack, digest, cached = stack_for(worker, path)
    assert _check(stack, digest, expected) == "x"
    assert np.array_equal(stack.volume.array, expected["x"][1])
    # and Y, put back, is Y
    install(tmp_path / "y", live)
    stack, digest, _ = stack_for(worker, path)
    assert _check(stack, digest, expected) == "y"
    assert [p.name for p in worker.tmp_dir.iterdir() if p.name.startswith("source-")] == []  # copies removed


@pytest.mark.probe("43.1", "stdio: 40 requests while another thread swaps the file between two CTs")
def test_requests_while_the_file_is_swapped_in_a_loop(worker, tmp_path, write_dicom_series):
    live, path, expected = _setup(tmp_path, "nifti", write_dicom_series)
    stop = threading.Event()

    def swapper():
        deadline = time.monotonic() + 30
        n = 0
        while not stop.is_set() and time.monotonic() < deadline and n < 100000:
            install(tmp_path / ("y" if n % 2 == 0 else "x"), live)
            n += 1

    t = threading.Thread(target=swapper, daemon=True)
    t.start()
    seen = []
    try:
        for _ in range(40):
            stack, digest, _ = stack_for(worker, path)
            seen.append(_check(stack, digest, expected))
    finally:
        stop.set()
        t.join(10)
    install(tmp_path / "x", live)
    stack, digest, _ = stack_for(worker, path)
    assert _check(stack, digest, expected) == "x"
