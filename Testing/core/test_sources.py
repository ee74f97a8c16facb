"""Which files a volume path makes the reader read (:mod:`medvolcore.sources`), and what the worker
does with that: its volume cache key, the checks before reading, the ``--data-dir`` sandbox.

Probes of the second review (``II.1`` wrong series from the cache, ``II.2`` escapes through
detached headers and symbolic links, ``II.3`` check-then-use race, and a full temp folder) run on
in-process workers: ``Worker._stack_for`` is the step that turns a request's volume into a stack
(no model is loaded: the pipeline getter is replaced by one that fails loudly), and ``handle``
gives the reply a client would see. Volumes are tiny and synthetic (NIfTI, MetaImage, NRRD, DICOM
series of 16×16 slices written by SimpleITK).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import locale
import os
import queue
import tempfile
import threading
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.errors import ForbiddenError, LimitError, VolumeError
from medvolcore.serve import Worker
from medvolcore.serve.worker import _Job

from core.probes import one_line, run_cli

sitk = pytest.importorskip("SimpleITK")

ANCHOR = {"schema": "medvol.anchor/1", "slice": 1, "boxes": [[2, 2, 8, 8]], "source": "user"}


# ---- material --------------------------------------------------------------------------------------

def _image(depth: int, seed: int, spacing=(0.7, 0.8, 2.5)):
    arr = np.random.default_rng(seed).integers(-1000, 1000, size=(depth, 16, 16)).astype(np.int16)
    img = sitk.GetImageFromArray(arr)
    img.SetSpacing(spacing)
    img.SetOrigin((10.0, -20.0, 30.0))
    return img


def _nifti(path: Path, depth: int, seed: int) -> Path:
    arr = np.random.default_rng(seed).integers(-1000, 1000, size=(16, 16, depth)).astype(np.int16)
    nib.save(nib.Nifti1Image(arr, np.diag([0.7, 0.8, 2.5, 1.0])), str(path))
    return path


def _mhd(path: Path, data_file: str, depth: int = 3) -> Path:
    """A detached MetaImage header for 16×16×depth int16 voxels in ``data_file``."""
    path.write_text("ObjectType = Image\nNDims = 3\nBinaryData = True\nBinaryDataByteOrderMSB = False\n"
                    "ElementSpacing = 0.7 0.8 2.5\nDimSize = 16 16 %d\nElementType = MET_SHORT\n"
                    "ElementDataFile = %s\n" % (depth, data_file))
    return path


def _left_in(worker) -> list:
    """What the worker's temporary folder holds besides its own lock file: no private copy."""
    from medvolcore.serve.lifecycle import TMP_LOCK_NAME

    return [p.name for p in worker.tmp_dir.iterdir() if p.name != TMP_LOCK_NAME]


@pytest.fixture(scope="module")
def material(tmp_path_factory, write_dicom_series):
    """``root`` (a data folder) and ``outside`` (a folder next to it), holding:
    DICOM series s3 (3 slices) and s5 (5 slices) outside; inside, folders of symbolic links to
    each (``links3``, ``links5``), a regular copy of s3 (``series3``), an empty folder, single-file
    volumes (``ct.nii.gz``, ``ok.mha`` with LOCAL data, ``ok.nrrd`` attached) and detached headers
    pointing out of the folder (``escape.mhd``, ``passwd.mhd``, ``fifo.mhd``, ``escape.nhdr``)."""
    base = tmp_path_factory.mktemp("sources")
    root, outside = base / "data", base / "outside"
    root.mkdir()
    outside.mkdir()
    saved = locale.setlocale(locale.LC_ALL, None)
    try:
        write_dicom_series(sitk, _image(3, 1), outside / "s3", uid="1.2.826.0.1.3680043.2.1125.31")
        write_dicom_series(sitk, _image(5, 2), outside / "s5", uid="1.2.826.0.1.3680043.2.1125.51")
    finally:  # GDCM's writer sets the process locale to "C" (ASCII text for later subprocess tests)
        locale.setlocale(locale.LC_ALL, saved)
    for n in (3, 5):
        links = root / f"links{n}"
        links.mkdir()
        for f in sorted((outside / f"s{n}").iterdir()):
            (links / f.name).symlink_to(f)
    (root / "series3").mkdir()
    for f in (outside / "s3").iterdir():
        (root / "series3" / f.name).write_bytes(f.read_bytes())
    (root / "empty").mkdir()
    _nifti(root / "ct.nii.gz", 4, 3)
    sitk.WriteImage(_image(6, 4), str(root / "ok.mha"))
    sitk.WriteImage(_image(7, 5), str(root / "ok.nrrd"))
    (outside / "secret.raw").write_bytes(np.zeros((3, 16, 16), np.int16).tobytes())
    os.mkfifo(outside / "fifo.raw")
    _mhd(root / "escape.mhd", "../outside/secret.raw")
    _mhd(root / "passwd.mhd", "/etc/passwd")
    _mhd(root / "fifo.mhd", str(outside / "fifo.raw"))
    (root / "escape.nhdr").write_text("NRRD0004\ntype: short\ndimension: 3\nsizes: 16 16 3\nencoding: raw\n"
                                      f"endian: little\ndata file: {outside / 'secret.raw'}\n")
    _nifti(outside / "private.nii.gz", 9, 6)
    yield root, outside
    _unblock(outside / "fifo.raw")


def _unblock(fifo: Path) -> None:
    """Release a reader blocked on ``fifo`` (the old code's hang), so no thread is left behind."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:  # nobody reads it: nothing to release
        pass


def _no_models(w: Worker) -> Worker:
    def refuse(*a, **k):
        raise AssertionError("the pipeline was reached: the volume was accepted")

    w._ensure_pipeline = refuse
    return w


@pytest.fixture(scope="module")
def stdio_worker():
    w = _no_models(Worker(transport="stdio"))
    yield w
    w.close(5)


@pytest.fixture(scope="module")
def http_worker(material):
    w = _no_models(Worker(transport="http", data_dir=material[0]))
    yield w
    w.close(5)


def stack_for(w: Worker, volume=None, transport=None, keep=True, timeout=20.0, **fields):
    """``(stack, sha256, cached)`` for a request's volume, as ``_run_volume_job`` gets it (the
    stack is kept in the cache, as after a successful request, unless ``keep`` is false). Runs
    in a thread so a read that blocks fails the test instead of hanging it."""
    req = {"id": "t", "op": "propagate", "anchor": ANCHOR, **fields}
    if volume is not None:
        req["volume"] = str(volume)
    job = _Job(req, lambda r: None, transport or w.transport)
    out = queue.Queue()

    def run():
        try:
            out.put(("ok", w._stack_for(job, lambda *a, **k: None)))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.put(("error", e))

    threading.Thread(target=run, daemon=True).start()
    try:
        kind, value = out.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"reading {volume} did not end within {timeout} s (blocked)") from None
    if kind == "error":
        raise value
    stack, digest, cached = value
    if keep and not cached:
        w.cache.put(digest, stack, w._scope(job))
    return value


def _scope_of(w: Worker) -> str:
    """The cache scope of :func:`stack_for`'s requests (no session) on ``w``."""
    return w._scope(_Job({"id": "t"}, lambda r: None, w.transport))


def reply_to(w: Worker, req: dict, timeout=20.0) -> dict:
    """The reply a client gets for ``req`` (through ``handle``, as the transports call it)."""
    got = queue.Queue()
    w.handle(dict({"id": "r", "op": "propagate", "anchor": ANCHOR}, **req), reply=got.put)
    while True:
        msg = got.get(timeout=timeout)
        if "event" not in msg:  # progress events (stdio) come before the reply
            return msg


# ---- II.1: the cache key is what the reader reads ----------------------------------------------------

@pytest.mark.probe("II.1", "stdio: DICOM folders of symbolic links (3 and 5 slices) one after the other")
def test_folders_of_symlinks_get_their_own_series(stdio_worker, material, record_property):
    root, outside = material
    s5, _, _ = stack_for(stdio_worker, root / "links5")
    assert s5.volume.shape == (16, 16, 5)
    s3, key3, cached = stack_for(stdio_worker, root / "links3")
    record_property("slices returned for the 3-slice folder", s3.volume.shape[2])
    assert cached is False and s3.volume.shape == (16, 16, 3)  # before: the 5-slice series, volume_cached true
    # the key is the content: the same slices as regular files are the same volume
    again, key, cached = stack_for(stdio_worker, outside / "s3")
    assert cached is True and key == key3 and again is s3


@pytest.mark.probe("II.1", "empty folder (stdio and HTTP --data-dir) with a volume cached under sha256('')")
def test_empty_folder_is_refused_before_any_cache_lookup(stdio_worker, http_worker, material):
    root, outside = material
    planted, _, _ = stack_for(stdio_worker, outside / "s5", keep=False)
    empty_key = hashlib.sha256(b"").hexdigest()  # what an empty folder hashed to
    for w, volume in ((stdio_worker, root / "empty"), (http_worker, "empty")):
        w.cache.put(empty_key, planted, _scope_of(w))
        with pytest.raises(VolumeError, match="holds no file"):
            stack_for(w, volume)
        r = reply_to(w, {"volume": str(volume)})
        assert r["ok"] is False and r["error"]["code"] == "bad_volume", r


@pytest.mark.probe("II.1", "a cached volume whose shape/affine disagree with the file's header")
def test_cached_volume_that_disagrees_with_its_header_is_not_served(stdio_worker, http_worker, material, tmp_path):
    root, outside = material
    ct = _nifti(tmp_path / "a.nii.gz", 4, 11)
    wrong, _, _ = stack_for(stdio_worker, outside / "s5", keep=False)
    before = getattr(stdio_worker.cache, "mismatches", 0)
    # the file's own key now holds another volume (a collision, a poisoned entry): never served
    key = hashlib.sha256(ct.read_bytes()).hexdigest()
    stdio_worker.cache.put(key, wrong)
    made_from_wrong = stdio_worker.features.store((key, 40.0, 400.0, 0))  # slices encoded from that volume
    stack, _, cached = stack_for(stdio_worker, ct)
    assert cached is False and stack.volume.shape == (16, 16, 4)
    assert stdio_worker.cache.mismatches == before + 1
    assert made_from_wrong.closed and stdio_worker.features.store((key, 40.0, 400.0, 0)) is not made_from_wrong
    stack, _, cached = stack_for(stdio_worker, ct)  # the fresh read replaced it
    assert cached is True and stack.volume.shape == (16, 16, 4)
    # an upload is checked the same way
    data = (root / "ct.nii.gz").read_bytes()
    http_worker.cache.put(hashlib.sha256(data).hexdigest(), wrong, _scope_of(http_worker))
    stack, _, cached = stack_for(http_worker, volume_b64=base64.b64encode(data).decode())
    assert cached is False and stack.volume.shape == (16, 16, 4)


@pytest.mark.probe("II.1", "detached header whose data file changed; a file rewritten with its mtime put back")
def test_key_covers_data_files_and_rewritten_files(stdio_worker, tmp_path):
    raw = tmp_path / "v.raw"
    raw.write_bytes(np.full((3, 16, 16), 7, np.int16).tobytes())
    hdr = _mhd(tmp_path / "v.mhd", "v.raw")
    stack_for(stdio_worker, hdr)
    raw.write_bytes(np.full((3, 16, 16), 9, np.int16).tobytes())
    second, _, cached = stack_for(stdio_worker, hdr)
    assert cached is False and float(second.volume.array.max()) == 9.0  # before: the header's key, stale voxels
    # same size, mtime restored: the memo knows it by inode and ctime too, so it is hashed again
    ct = _nifti(tmp_path / "b.nii", 4, 12)
    old, _, _ = stack_for(stdio_worker, ct)
    st = ct.stat()
    img = nib.load(str(ct))
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj) + 1, img.affine, img.header), str(tmp_path / "c.nii"))
    os.replace(tmp_path / "c.nii", ct)
    os.utime(ct, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ct.stat().st_size == st.st_size and ct.stat().st_mtime_ns == st.st_mtime_ns
    new, _, cached = stack_for(stdio_worker, ct)
    assert cached is False and np.array_equal(new.volume.array, old.volume.array + 1)


# ---- II.2: --data-dir escapes through headers and links; FIFOs named by a header ------------------------

@pytest.mark.probe("II.2", "HTTP --data-dir: .mhd/.nhdr pointing outside, at /etc/passwd, at a FIFO; folder of links out")
def test_http_refuses_detached_headers_and_links_without_opening_them(http_worker, material, record_property):
    for volume in ("escape.mhd", "passwd.mhd", "fifo.mhd", "escape.nhdr", "links3"):
        t = time.perf_counter()
        with pytest.raises(ForbiddenError):
            stack_for(http_worker, volume, timeout=10)
        record_property(f"{volume} refused in s", round(time.perf_counter() - t, 3))
    r = reply_to(http_worker, {"volume": "fifo.mhd"})
    assert r["ok"] is False and r["error"]["code"] == "forbidden", r
    outside = material[1]
    assert "detached header" in r["error"]["message"] and str(outside) not in r["error"]["message"]
    assert _left_in(http_worker) == []  # the private copies are gone


def test_http_reads_single_file_volumes_and_dicom_folders(http_worker):
    shapes = {v: stack_for(http_worker, v)[0].volume.shape for v in ("ct.nii.gz", "ok.mha", "ok.nrrd", "series3")}
    assert shapes == {"ct.nii.gz": (16, 16, 4), "ok.mha": (16, 16, 6), "ok.nrrd": (16, 16, 7), "series3": (16, 16, 3)}
    # the key of a copy is the key of the same content named over stdio (one cache, one feature store)
    assert stack_for(http_worker, "ct.nii.gz")[2] is True
    assert _left_in(http_worker) == []


@pytest.mark.probe("II.2", "stdio/CLI: .mhd whose data file is a FIFO, or missing")
def test_stdio_and_cli_refuse_a_fifo_or_missing_data_file_at_once(stdio_worker, material, tmp_path, capsys,
                                                                   record_property):
    from medvolcore.volume import load_volume

    root, outside = material
    missing = _mhd(tmp_path / "missing.mhd", "nowhere.raw")
    fifo = root / "fifo.mhd"
    t = time.perf_counter()
    with pytest.raises(VolumeError, match="not a regular file"):
        stack_for(stdio_worker, fifo, timeout=10)
    record_property("worker: FIFO data file refused in s", round(time.perf_counter() - t, 3))
    done = queue.Queue()
    threading.Thread(target=lambda: done.put(_outcome(load_volume, fifo)), daemon=True).start()
    try:
        outcome = done.get(timeout=10)
    except queue.Empty:
        outcome = "blocked"
    finally:
        _unblock(outside / "fifo.raw")
    assert isinstance(outcome, VolumeError) and "FIFO" in str(outcome), outcome
    with pytest.raises(VolumeError, match="does not exist"):
        stack_for(stdio_worker, missing)
    code, _, err = run_cli(capsys, "info", fifo)
    one_line(code, err, "fifo.raw", "not a regular file")
    code, _, err = run_cli(capsys, "info", missing)
    one_line(code, err, "nowhere.raw", "does not exist")


def _outcome(fn, *a):
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - handed to the test
        return e


# ---- II.3: the path is opened once -----------------------------------------------------------------------

@pytest.mark.probe("II.3", "HTTP --data-dir: file swapped for a link to outside between check and read")
def test_a_file_swapped_for_a_link_after_the_check_is_not_followed(material, monkeypatch):
    root, outside = material
    _nifti(root / "swap.nii.gz", 4, 21)
    w = _no_models(Worker(transport="http", data_dir=root))
    try:
        read = w.cache.get_path

        def swap_then_read(path, *a, **k):  # the attacker wins the race: the swap lands right here
            tmp = root / "swap.tmp"
            tmp.symlink_to(outside / "private.nii.gz")
            os.replace(tmp, root / "swap.nii.gz")
            return read(path, *a, **k)

        monkeypatch.setattr(w.cache, "get_path", swap_then_read)
        stack, _, _ = stack_for(w, "swap.nii.gz")
        assert stack.volume.shape == (16, 16, 4)  # before: the outside volume, 9 slices
        monkeypatch.setattr(w.cache, "get_path", read)
        with pytest.raises(ForbiddenError):  # the link itself is refused
            stack_for(w, "swap.nii.gz")
    finally:
        w.close(5)


# ---- a full temp folder ---------------------------------------------------------------------------------

@pytest.mark.probe("II.10", "full TMPDIR: writing the upload or the private copy (ENOSPC)")
def test_full_temp_folder_gives_a_clear_error(http_worker, material, monkeypatch):
    real = tempfile.mkstemp

    def full_disk(*a, **k):  # a real name, but every write gets ENOSPC from the kernel (/dev/full)
        fd, name = real(*a, **k)
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), name

    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(OSError) as e:
            os.write(fd, b"x")
        assert e.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    monkeypatch.setattr(tempfile, "mkstemp", full_disk)
    data = base64.b64encode((material[0] / "ct.nii.gz").read_bytes()).decode()
    for req in ({"volume_b64": data}, {"volume": "ct.nii.gz"}):
        r = reply_to(http_worker, req)
        assert r["ok"] is False and r["error"]["code"] == "too_large", r
        assert "no space left" in r["error"]["message"], r
    with pytest.raises(LimitError):
        stack_for(http_worker, "ok.mha")
    assert _left_in(http_worker) == []


# ---- the parser itself ----------------------------------------------------------------------------------

def test_sources_list_what_the_readers_read(tmp_path):
    from medvolcore.sources import MAX_SOURCE_FILES, volume_sources
    from medvolcore.volume import MAX_DICOM_FILES, load_volume

    assert MAX_SOURCE_FILES == MAX_DICOM_FILES
    img = _image(4, 9)
    (tmp_path / "d").mkdir()
    sitk.WriteImage(img, str(tmp_path / "d" / "v.nhdr"))  # header + raw data file
    sitk.WriteImage(img, str(tmp_path / "v.mha"))
    raw = sitk.GetArrayFromImage(img).tobytes()
    for k in range(4):
        (tmp_path / f"s{k:02d}.raw").write_bytes(raw[k * 512:(k + 1) * 512])
    _mhd(tmp_path / "pattern.mhd", "s%02d.raw 0 3 1", depth=4)
    _mhd(tmp_path / "list.mhd", "LIST 2D\n" + "".join(f"s{k:02d}.raw\n" for k in range(4)), depth=4)
    got = {name: [f.name for f in volume_sources(tmp_path / name).files]
           for name in ("d/v.nhdr", "v.mha", "pattern.mhd", "list.mhd")}
    assert got == {"d/v.nhdr": ["v.nhdr", "v.raw"], "v.mha": ["v.mha"],
                   "pattern.mhd": ["pattern.mhd", "s00.raw", "s01.raw", "s02.raw", "s03.raw"],
                   "list.mhd": ["list.mhd", "s00.raw", "s01.raw", "s02.raw", "s03.raw"]}
    for name in ("pattern.mhd", "list.mhd"):  # and the reader reads exactly those voxels
        assert np.array_equal(load_volume(tmp_path / name).array, load_volume(tmp_path / "v.mha").array)


# ---- 43.3: with --data-dir, what a name stands for is checked before a byte is copied ------------------

def _sparse_nifti(path: Path, shape, size: int) -> Path:
    """A NIfTI file declaring ``shape`` (int8 voxels), made ``size`` bytes long as a sparse file
    (no disk blocks behind it)."""
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(np.int8)
    with open(path, "wb") as fh:
        fh.write(hdr.binaryblock + b"\0" * 4)
        fh.truncate(size)
    return path


@pytest.fixture
def copies(monkeypatch):
    """The bytes the worker copied from the data folder (every copy goes through ``_copy_fd``, in the
    module that calls it)."""
    import medvolcore.sources.private as sources

    seen = []
    real = sources._copy_fd

    def counting(src_fd, *a, **k):
        digest, size = real(src_fd, *a, **k)
        seen.append(size)
        return digest, size

    monkeypatch.setattr(sources, "_copy_fd", counting)
    return seen


@pytest.mark.probe("43.3", "HTTP --data-dir: sparse 4 GB NIfTIs under --max-voxels 100000 (header over it; size over it)")
@pytest.mark.parametrize("shape", [(1024, 1024, 4096), (16, 16, 4)], ids=["declares-4G-voxels", "declares-1k-voxels"])
def test_a_sparse_huge_file_is_refused_before_it_is_copied(tmp_path, shape, copies, record_property):
    data = tmp_path / "data"
    data.mkdir()
    f = _sparse_nifti(data / "big.nii", shape, 4 << 30)
    assert f.stat().st_size == 4 << 30 and f.stat().st_blocks * 512 < (16 << 20)  # sparse: nothing on disk
    w = _no_models(Worker(transport="http", data_dir=data, max_voxels=100000))
    try:
        t = time.perf_counter()
        with pytest.raises(LimitError, match="refused before copying it"):
            stack_for(w, "big.nii", timeout=30)
        seconds = time.perf_counter() - t
        record_property("refused in s", round(seconds, 3))
        assert seconds < 5 and copies == [] and _left_in(w) == []
        r = reply_to(w, {"volume": "big.nii"})
        assert r["ok"] is False and r["error"]["code"] == "too_large", r
        assert str(data) not in r["error"]["message"]
    finally:
        w.close(5)


@pytest.mark.probe("43.3", "HTTP --data-dir: a gzip NIfTI of zeros declaring 512×512×600 under --max-voxels 100000")
def test_a_compressed_bomb_in_the_data_folder_is_refused_from_its_header(tmp_path, copies):
    data = tmp_path / "data"
    data.mkdir()
    hdr = nib.Nifti1Header()
    hdr.set_data_shape((512, 512, 600))
    hdr.set_data_dtype(np.int16)
    import gzip

    with gzip.open(data / "zeros.nii.gz", "wb") as fh:
        fh.write(hdr.binaryblock + b"\0" * 4)
        for _ in range(600):
            fh.write(bytes(512 * 512 * 2))
    w = _no_models(Worker(transport="http", data_dir=data, max_voxels=100000))
    try:
        with pytest.raises(LimitError, match="512×512×600 = 157,286,400 voxels"):
            stack_for(w, "zeros.nii.gz")
        assert copies == [] and _left_in(w) == []
    finally:
        w.close(5)


@pytest.mark.probe("43.3", "HTTP --data-dir: \"volume\": \".\" (the data folder itself) and a folder of NIfTI files")
def test_the_data_folder_itself_is_refused_without_copying_it(http_worker, material, copies, tmp_path):
    for value in (".", "./", ""):
        t = time.perf_counter()
        with pytest.raises(VolumeError, match="not a DICOM file"):
            stack_for(http_worker, value)
        assert time.perf_counter() - t < 5
    assert copies == [] and _left_in(http_worker) == []
    r = reply_to(http_worker, {"volume": "."})
    assert r["ok"] is False and r["error"]["code"] == "bad_volume", r
    assert str(material[0]) not in r["error"]["message"]
    # a DICOM series is still copied, file by file
    assert stack_for(http_worker, "series3", keep=False)[0].volume.shape == (16, 16, 3)
    assert len(copies) == 3


def test_a_folder_over_the_byte_cap_is_refused_before_copying(material, copies, tmp_path):
    from medvolcore.sources import private_copy

    root = material[0]
    with pytest.raises(LimitError, match="refused before copying it"):
        private_copy(root, "series3", tmp_path, max_bytes=1000)
    assert copies == [] and list(tmp_path.iterdir()) == []


def test_a_copy_past_its_deadline_stops(material, tmp_path):
    from medvolcore.sources import private_copy

    for value in ("series3", "ct.nii.gz"):
        with pytest.raises(LimitError, match="took more than 0 s to copy"):
            private_copy(material[0], value, tmp_path, seconds=0.0)
    assert list(tmp_path.iterdir()) == []
    with private_copy(material[0], "ct.nii.gz", tmp_path, seconds=60, max_voxels=16 * 16 * 4,
                      max_bytes=1 << 20) as copy:
        assert copy.path.is_file()
