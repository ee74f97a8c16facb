"""The worker's volume cache: AxialStacks kept by the content sha256 of their file or upload.

A cache never serves another volume: the key is the sha256 of the bytes themselves (a file's, a
DICOM folder's files' names and bytes, or an upload's), and a stack enters the cache only once its
request succeeded, so a volume from a failed or cancelled request is never held in memory.
"""

from __future__ import annotations

import collections
import hashlib
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

from ..errors import CancelledError, LimitError, VolumeError

__all__ = ["DEFAULT_CACHE_SIZE", "DEFAULT_FEATURE_CACHE_MB", "DEFAULT_MAX_VOXELS", "StackCache", "file_sha256"]

DEFAULT_CACHE_SIZE = 4
# MedSAM2 image features of recent volumes: about 4.2 MB a slice at 512 px (fp32), so 2 GB holds
# some 480 slices, e.g. four 120-slice CTs (the worker's default volume cache).
DEFAULT_FEATURE_CACHE_MB = 2048
DEFAULT_MAX_VOXELS = 1024 * 1024 * 2000  # a 1024×1024 CT of 2000 slices (8 GB as float32)


def _hash_file(path: Path, h, cancel=None) -> None:
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"reading {path.name} was cancelled")
            h.update(chunk)


def file_sha256(path: Path, cancel=None) -> str:
    """sha256 of a regular file's bytes, or of a folder's own regular files (name + bytes, sorted).

    Only regular files are read (never a device or FIFO, which could block for ever); a folder
    is not walked recursively (a DICOM series is one folder) and holds at most
    ``volume.MAX_DICOM_FILES`` entries. ``cancel`` is checked between 1 MB chunks.
    """
    from ..volume import MAX_DICOM_FILES

    h = hashlib.sha256()
    st = path.stat()
    if stat.S_ISDIR(st.st_mode):
        names = []
        with os.scandir(path) as it:
            for entry in it:
                names.append(entry.name)
                if len(names) > MAX_DICOM_FILES:
                    raise LimitError(f"{path.name} holds more than {MAX_DICOM_FILES} files; give the folder of one "
                                     "DICOM series")
        for name in sorted(names):
            f = path / name
            if f.is_file() and not f.is_symlink():
                h.update(name.encode("utf-8", "surrogateescape") + b"\0")
                _hash_file(f, h, cancel)
        return h.hexdigest()
    if not stat.S_ISREG(st.st_mode):
        raise VolumeError(f"{path} is not a regular file or folder (a device, FIFO or socket); give a CT file or "
                          "a DICOM folder")
    _hash_file(path, h, cancel)
    return h.hexdigest()


class StackCache:
    """A small LRU of AxialStacks keyed by the content sha256 of the volume file.

    ``get_path`` / ``get_bytes`` return a stack without keeping it; the caller adds it with
    :meth:`put` once its request succeeded, so a volume from a failed or cancelled request (say, a
    decompression bomb) is never held in memory.
    """

    def __init__(self, size: int = DEFAULT_CACHE_SIZE, max_voxels: Optional[int] = DEFAULT_MAX_VOXELS):
        self.size = max(0, int(size))
        self.max_voxels = max_voxels
        self._items: "collections.OrderedDict[str, Any]" = collections.OrderedDict()
        self._stat_hash: dict = {}  # (path, size, mtime_ns) -> sha256, so a known file is not hashed again
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _key_for_path(self, path: Path, cancel=None) -> str:
        try:
            st = path.stat()
        except OSError as e:
            raise VolumeError(f"{path} cannot be read: {e.strerror or e}") from None
        memo = (str(path.resolve()), st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None
        if memo is not None and memo in self._stat_hash:
            return self._stat_hash[memo]
        try:
            digest = file_sha256(path, cancel)
        except OSError as e:
            raise VolumeError(f"{path} cannot be read: {e.strerror or e}") from None
        if memo is not None:
            if len(self._stat_hash) > 256:
                self._stat_hash.clear()
            self._stat_hash[memo] = digest
        return digest

    def _cached(self, digest: str):
        with self._lock:
            if digest in self._items:
                self._items.move_to_end(digest)
                self.hits += 1
                return self._items[digest]
        return None

    def get_path(self, path, cancel=None) -> tuple:
        """``(stack, sha256, cached)`` for a volume path (not added to the cache: see :meth:`put`)."""
        from ..stack import AxialStack
        from ..volume import load_volume

        path = Path(path)
        digest = self._key_for_path(path, cancel)
        stack = self._cached(digest)
        if stack is not None:
            return stack, digest, True
        self.misses += 1
        return AxialStack(load_volume(path, max_voxels=self.max_voxels, cancel=cancel)), digest, False

    def get_bytes(self, data: bytes, tmp_dir: Path, cancel=None) -> tuple:
        """``(stack, sha256, cached)`` for uploaded NIfTI bytes (written to ``tmp_dir`` only to be read)."""
        from ..stack import AxialStack
        from ..volume import load_volume

        digest = hashlib.sha256(data).hexdigest()
        stack = self._cached(digest)
        if stack is not None:
            return stack, digest, True
        if len(data) < 348:
            raise VolumeError(f"uploaded volume is {len(data)} bytes: too short to be a NIfTI file")
        self.misses += 1
        suffix = ".nii.gz" if data[:2] == b"\x1f\x8b" else ".nii"
        fd, tmp = tempfile.mkstemp(prefix="upload-", suffix=suffix, dir=tmp_dir)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            stack = AxialStack(load_volume(tmp, max_voxels=self.max_voxels, cancel=cancel))
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return stack, digest, False

    def put(self, digest: str, stack) -> None:
        with self._lock:
            if self.size == 0:
                return
            self._items[digest] = stack
            self._items.move_to_end(digest)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def describe(self) -> list:
        with self._lock:
            return [{"sha256": k, "shape_zyx": list(v.shape)} for k, v in self._items.items()]

    def __len__(self) -> int:
        return len(self._items)
