"""The worker's volume cache: AxialStacks kept by the content sha256 of the files they were read from.

A cache never serves another volume. The key is the sha256 of what the reader reads
(:mod:`medvolcore.sources`): a file's bytes, or for a detached header or a DICOM folder the names,
sizes and sha256s of the header and every data file it names, or of the folder's files (symbolic
links followed over stdio; a folder with no file is refused before any lookup, so no empty key
exists). The key is computed over the very bytes that are read: over stdio the files are copied
into the worker's private folder while hashed and the reader reads only that copy (uploads and
``--data-dir`` copies are private files already), so a file replaced while it is read can never
give a volume under another volume's key. Before a cached volume is served, its shape and affine are checked against the file's
header (a cheap header read); a volume that does not match is read again. A stack enters the
cache only once its request succeeded, so a volume from a failed or cancelled request is never
held in memory. Over HTTP the entries are scoped to the client that sent the volume (its
session): another client sending the same CT gets its own read and its own encoded slices, so
``volume_cached`` and ``slices_encoded`` (and the time a request takes) never tell a client what
another one sent.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..errors import MedVolError, VolumeError
from .limits import limit
from ..sources import HashMemo, hashed_copy, known_sha256, sources_sha256, store_bytes, volume_sources

__all__ = ["DEFAULT_CACHE_SIZE", "DEFAULT_FEATURE_CACHE_MB", "DEFAULT_MAX_VOXELS", "StackCache", "file_sha256",
           "header_geometry", "scoped", "request_bytes", "check_request_memory", "REQUEST_BYTES_PER_VOXEL"]

log = logging.getLogger("medvolcore.serve")

DEFAULT_CACHE_SIZE = 4
# MedSAM2 image features of recent volumes: about 4.2 MB a slice at 512 px (fp32), so 2 GB holds
# some 480 slices, e.g. four 120-slice CTs (the worker's default volume cache).
DEFAULT_FEATURE_CACHE_MB = 2048
# A 1024×1024 CT of 1000 slices (4 GB as float32; 512×512 CTs of up to 4000 slices). A one-target
# request peaks at about REQUEST_BYTES_PER_VOXEL bytes a voxel (Testing/benchmarks/memory.py,
# docs/benchmarks.md), so the largest volume it allows costs at most about 7.3 GiB.
DEFAULT_MAX_VOXELS = int(limit("voxels").default)
# What a request holds per voxel, measured (docs/benchmarks.md, "Memory per voxel"): the volume as
# float32, then per target its masks (source grid and stack, the label map), then per extra
# consensus sample its mask and share of the agreement map.
VOLUME_BYTES_PER_VOXEL = 4.0
TARGET_BYTES_PER_VOXEL = 3.5
SAMPLE_BYTES_PER_VOXEL = 3.75
REQUEST_BYTES_PER_VOXEL = VOLUME_BYTES_PER_VOXEL + TARGET_BYTES_PER_VOXEL


def request_bytes(voxels: int, targets: int = 1, samples: int = 1) -> float:
    """About how many bytes a segment/propagate request on ``voxels`` voxels holds at its peak,
    with ``targets`` queries and a consensus of ``samples`` answers each."""
    per_target = TARGET_BYTES_PER_VOXEL + SAMPLE_BYTES_PER_VOXEL * (max(1, samples) - 1)
    return voxels * (VOLUME_BYTES_PER_VOXEL + max(1, targets) * per_target)


def check_request_memory(voxels: int, targets: int, samples: int, max_voxels: Optional[int]) -> None:
    """Refuse (:class:`~medvolcore.errors.LimitError`) a request whose peak memory would pass what
    ``max_voxels`` allows a one-target request (:func:`request_bytes`): several targets and a
    consensus multiply the masks held, so they get a smaller volume, never more memory."""
    if max_voxels is None:
        return
    need, budget = request_bytes(voxels, targets, samples), request_bytes(int(max_voxels))
    if need > budget:
        from ..errors import LimitError

        largest = int(max_voxels * budget / request_bytes(int(max_voxels), targets, samples))
        raise LimitError(f"{targets} target(s) with {samples} answer(s) each on a volume of {voxels:,} voxels would "
                         f"hold about {need / 2**30:.1f} GiB, more than the voxel limit (--max-voxels) allows a "
                         f"request ({budget / 2**30:.1f} GiB); with these settings the volume may have at most "
                         f"{largest:,} voxels: send fewer queries, a smaller consensus or a smaller volume")


def file_sha256(path: Path, cancel=None) -> str:
    """The content sha256 of a volume path: of a file's bytes, or of the files the reader reads
    for a detached header or a DICOM folder (:func:`medvolcore.sources.sources_sha256`).

    Only regular files are read (never a device or FIFO, which could block for ever); a folder
    is not walked recursively (a DICOM series is one folder), holds at most
    ``volume.MAX_DICOM_FILES`` entries and at least one file. ``cancel`` is checked between 1 MB
    chunks.
    """
    return sources_sha256(volume_sources(path), cancel)


def header_geometry(path) -> tuple:
    """``(shape, affine)`` of a volume as its header declares them, without reading voxels:
    the shape in file index order ``(I, J, K)`` and the voxel→RAS affine, as
    :func:`medvolcore.volume.load_volume` returns them. A DICOM folder's come from its series'
    file list and the first and last slice headers (the series reader's spacing)."""
    from ..volume import _LPS_TO_RAS, NIFTI_SUFFIXES

    p = Path(path)
    if not p.is_dir() and p.name.lower().endswith(NIFTI_SUFFIXES):
        import nibabel as nib

        img = nib.load(str(p))
        shape = tuple(int(v) for v in img.shape)
        if len(shape) == 4 and shape[3] == 1:
            shape = shape[:3]
        return shape, np.asarray(img.affine, dtype=np.float64)
    import SimpleITK as sitk  # noqa: N813

    def info(f):
        r = sitk.ImageFileReader()
        r.SetFileName(str(f))
        r.ReadImageInformation()
        return r

    if p.is_dir():
        ids = sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(p))
        if len(ids) != 1:
            raise VolumeError(f"{p} is not one DICOM series")
        files = sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(p), ids[0])
        first = info(files[0])
        size = (first.GetSize()[0], first.GetSize()[1], len(files))
        spacing = list(first.GetSpacing())
        if len(files) > 1:
            step = np.subtract(info(files[-1]).GetOrigin(), first.GetOrigin())
            if np.linalg.norm(step) > 0:
                spacing[2] = float(np.linalg.norm(step)) / (len(files) - 1)
    else:
        first = info(p)
        size, spacing = first.GetSize(), first.GetSpacing()
    lps = np.eye(4)
    lps[:3, :3] = np.array(first.GetDirection(), dtype=np.float64).reshape(3, 3) @ np.diag(spacing)
    lps[:3, 3] = first.GetOrigin()
    return tuple(int(v) for v in size), _LPS_TO_RAS @ lps


def scoped(scope: str, digest: str) -> str:
    """The cache key of ``digest`` in ``scope``: the digest itself over stdio (one client), else
    the scope and the digest, so one HTTP client's entries never answer another's request."""
    return f"{scope}\0{digest}" if scope else digest


class StackCache:
    """A small LRU of AxialStacks keyed by the content sha256 of the files they were read from.

    ``get_path`` / ``get_bytes`` return a stack without keeping it; the caller adds it with
    :meth:`put` once its request succeeded, so a volume from a failed or cancelled request (say, a
    decompression bomb) is never held in memory.
    """

    def __init__(self, size: int = DEFAULT_CACHE_SIZE, max_voxels: Optional[int] = DEFAULT_MAX_VOXELS):
        self.size = max(0, int(size))
        self.max_voxels = max_voxels
        self._items: "collections.OrderedDict[str, Any]" = collections.OrderedDict()
        self._memo = HashMemo()  # per file: a file known by (path, device, inode, size, mtime, ctime) is not hashed again
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.mismatches = 0  # cached volumes not served because the file's header disagreed

    def _cached(self, digest: str, path: Path, owned: bool = False):
        """The stack cached under ``digest``, if its shape and affine are those ``path``'s header
        declares and, for a DICOM series, its record is of the same kind (``owned``: read from a
        private copy) and describes exactly the instances of ``path``'s bytes (else None: the
        volume is read again and replaces it)."""
        with self._lock:
            stack = self._items.get(digest)
        if stack is None:
            return None
        record = getattr(stack.volume, "dicom", None)
        if record is not None and (record.private != owned or (owned and not record.describes(path))):
            self.mismatches += 1
            log.warning("cached volume %s… is a DICOM series whose record does not describe the files asked for; "
                        "reading them again", digest[:12])
            return None
        try:
            shape, affine = header_geometry(path)
        except Exception:  # noqa: BLE001 - an unreadable header is reported by the full read below
            shape, affine = None, None
        if shape != stack.volume.shape or not np.allclose(affine, stack.volume.affine, atol=1e-3):
            self.mismatches += 1
            log.warning("cached volume %s… does not match the header of the file it was asked for (shape %s, cached "
                        "%s); reading the file again", digest[:12], shape, stack.volume.shape)
            return None
        with self._lock:
            if digest in self._items:
                self._items.move_to_end(digest)
            self.hits += 1
        return stack

    def max_bytes(self) -> Optional[int]:
        """The most a volume's files may hold together to be copied and read: what ``max_voxels``
        float64 voxels take, plus room for headers (a NIfTI's extensions, DICOM slice headers)."""
        from ..volume import MAX_NIFTI_EXTENSIONS

        if self.max_voxels is None:
            return None
        return int(self.max_voxels) * 8 + MAX_NIFTI_EXTENSIONS + (64 << 20)

    def get_path(self, path, cancel=None, digest: Optional[str] = None, tmp_dir=None, scope: str = "",
                 owned: bool = False) -> tuple:
        """``(stack, sha256, cached)`` for a volume path (not added to the cache: see :meth:`put`).

        ``digest``: the path's content key when the caller already has it, for a private file
        no one else writes (an upload, a private copy, hashed while written); it is read as it is.
        Without it, the files the reader reads are checked
        (:func:`medvolcore.sources.volume_sources`: a missing data file, a FIFO or a folder with
        no file is refused here, before any lookup), then copied into a private folder in
        ``tmp_dir`` while hashed (:func:`medvolcore.sources.hashed_copy`), and only that copy is
        read: the voxels are those of the key, even when the file is replaced while it is read.
        A cached volume is served without a copy when every file is one already hashed, as it
        is now (same path, device, inode, size, mtime and ctime). ``scope``: whose cache entries
        these are (the worker's HTTP client identity, :func:`scoped`; "" over stdio): an entry
        is served only in the scope that put it. ``owned``: ``path`` is a private copy the worker
        made and removes once read (a retrieved series, a ``--data-dir`` folder's copy): a DICOM
        series' record is marked :attr:`~medvolcore.dicomrecord.DicomRecord.private`, so a
        DICOM-SEG can reference it after the copy is gone; a user's folder (``owned`` false)
        keeps its check that the files read are unchanged.
        """
        path = Path(path)
        if digest is not None:
            return self._get_private(path, digest, cancel, scope, owned)
        sources = volume_sources(path)
        known = known_sha256(sources, self._memo)
        if known is not None:
            stack = self._cached(scoped(scope, known), path, owned)
            if stack is not None:
                return stack, known, True
        with hashed_copy(path, tmp_dir if tmp_dir is not None else tempfile.gettempdir(), cancel, self._memo,
                         self.max_bytes()) as copy:
            try:
                stack, digest, cached = self._get_private(copy.path, copy.sha256, cancel, scope, owned)
            except MedVolError as e:  # name the caller's file, not the private copy
                raise type(e)(str(e).replace(str(copy.path), str(path))) from None
        if not cached:
            stack.volume.path = str(path)
        return stack, digest, cached

    def _get_private(self, path: Path, digest: str, cancel, scope: str = "", owned: bool = False) -> tuple:
        from ..stack import AxialStack
        from ..volume import load_volume

        stack = self._cached(scoped(scope, digest), path, owned)
        if stack is not None:
            return stack, digest, True
        self.misses += 1
        volume = load_volume(path, max_voxels=self.max_voxels, cancel=cancel)
        if owned and getattr(volume, "dicom", None) is not None:
            volume.dicom.private = True
        return AxialStack(volume), digest, False

    def get_bytes(self, data: bytes, tmp_dir: Path, cancel=None, scope: str = "") -> tuple:
        """``(stack, sha256, cached)`` for uploaded NIfTI bytes, written to a private file in
        ``tmp_dir`` to be read (or to have its header checked against a cached volume), then
        removed. A full disk raises :class:`~medvolcore.errors.LimitError`."""
        digest = hashlib.sha256(data).hexdigest()
        if len(data) < 348:
            raise VolumeError(f"uploaded volume is {len(data)} bytes: too short to be a NIfTI file")
        tmp = store_bytes(data, tmp_dir, ".nii.gz" if data[:2] == b"\x1f\x8b" else ".nii")
        try:
            return self._get_private(tmp, digest, cancel, scope)
        finally:
            try:
                tmp.unlink()
            except OSError:
                pass

    def put(self, digest: str, stack, scope: str = "") -> None:
        key = scoped(scope, digest)
        with self._lock:
            if self.size == 0:
                return
            self._items[key] = stack
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def describe(self) -> list:
        with self._lock:
            return [{"sha256": k.rsplit("\0", 1)[-1], "shape_zyx": list(v.shape)} for k, v in self._items.items()]

    def __len__(self) -> int:
        return len(self._items)
