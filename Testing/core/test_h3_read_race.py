"""The worker's volume cache key is the sha256 of the very bytes that become the volume (probe 43.1).

Over stdio the client's file is the caller's own: Slicer re-exports ``{nodeID}.nii`` with
``os.replace``, so a file can be replaced between the moment it is hashed and the moment it is
read. The old worker hashed the path, then opened it again to read it: a reply could carry CT X's
``volume_sha256`` with CT Y's voxels, and the cache then held Y's stack under X's key, served to
every later request for X. Now the files are copied into the worker's private folder while hashed
and only the copy is read.

Each case makes two volumes X and Y of the same shape (so the header check before serving a cached
stack cannot tell them apart), in every layout whose key is a content sha256: a single NIfTI, a
detached MetaImage header (relative and absolute data file names), a NRRD header naming its data
file through ``..``, and a DICOM folder. ``install`` puts one of them in place, file by file with
``os.replace`` as an exporter does.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.serve import Worker
from medvolcore.serve.worker import _Job

sitk = pytest.importorskip("SimpleITK")

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
        w.cache.put(digest, stack)
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
