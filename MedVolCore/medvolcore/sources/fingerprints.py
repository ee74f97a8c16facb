"""The content sha256 of a volume's files (the worker's cache key): of the bytes for a single file,
else of the names, sizes and sha256s of all its files; :class:`HashMemo` remembers files already
hashed, so an unchanged file is not read again.
"""

from __future__ import annotations

import collections
import hashlib
import os
from pathlib import Path
from typing import Optional, Tuple

from ..errors import CancelledError, VolumeError
from .files import VolumeSources
from .headers import _open_regular

_CHUNK = 1 << 20
_KEY_VERSION = b"medvol.sources/1\0"


class HashMemo:
    """sha256 of files already hashed, by ``(path, device, inode, size, mtime_ns, ctime_ns)``
    (ctime cannot be set back by a program, so a rewritten file is hashed again). Least recently
    used entries go first."""

    def __init__(self, size: int = 20000):
        self.size = size
        self._items: "collections.OrderedDict[tuple, str]" = collections.OrderedDict()

    def get(self, key: tuple) -> Optional[str]:
        digest = self._items.get(key)
        if digest is not None:
            self._items.move_to_end(key)
        return digest

    def put(self, key: tuple, digest: str) -> None:
        self._items[key] = digest
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)


def _check_cancel(cancel, name) -> None:
    if cancel is not None and cancel.is_set():
        raise CancelledError(f"reading {name} was cancelled")


def _file_sha256(path: Path, cancel=None, memo: Optional[HashMemo] = None) -> Tuple[str, int]:
    try:
        fh = _open_regular(path)
    except OSError as e:
        raise VolumeError(f"{path} cannot be read: {e.strerror or e}") from None
    with fh:
        st = os.fstat(fh.fileno())
        key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        digest = memo.get(key) if memo is not None else None
        if digest is None:
            h = hashlib.sha256()
            try:
                for chunk in iter(lambda: fh.read(_CHUNK), b""):
                    _check_cancel(cancel, path.name)
                    h.update(chunk)
            except OSError as e:
                raise VolumeError(f"{path} cannot be read: {e.strerror or e}") from None
            digest = h.hexdigest()
            if memo is not None:
                memo.put(key, digest)
    return digest, st.st_size


class _Manifest:
    """The key of a volume of several files: sha256 over its kind and, per file, its name, size
    and sha256 (names hold no NUL, so the records cannot be confused)."""

    def __init__(self, kind: str):
        self.h = hashlib.sha256(_KEY_VERSION + kind.encode("ascii") + b"\0")

    def add(self, name: str, size: int, digest: str) -> None:
        self.h.update(name.encode("utf-8", "surrogateescape") + b"\0" + str(size).encode("ascii") + b"\0"
                      + digest.encode("ascii") + b"\n")

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def sources_sha256(sources: VolumeSources, cancel=None, memo: Optional[HashMemo] = None) -> str:
    """The content sha256 of a volume's files: of the bytes for a single file, else of the
    names, sizes and sha256s of all its files (header and data files, or a folder's files)."""
    if sources.single:
        return _file_sha256(sources.files[0], cancel, memo)[0]
    manifest = _Manifest(sources.kind)
    for name, f in zip(sources.names, sources.files):
        manifest.add(name, *reversed(_file_sha256(f, cancel, memo)))
    return manifest.hexdigest()


def known_sha256(sources: VolumeSources, memo: HashMemo) -> Optional[str]:
    """The content key of ``sources`` when ``memo`` knows every file as it is now (by path, device,
    inode, size, mtime and ctime: a file replaced or rewritten is not known), without reading any;
    else None. Only for a cache lookup: a volume read is always read from a hashed copy
    (:func:`hashed_copy`)."""
    digests = []
    for f in sources.files:
        try:
            st = os.stat(f)
        except OSError:
            return None
        digest = memo.get((str(f), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        if digest is None:
            return None
        digests.append((st.st_size, digest))
    if sources.single:
        return digests[0][1]
    manifest = _Manifest(sources.kind)
    for name, (size, digest) in zip(sources.names, digests):
        manifest.add(name, size, digest)
    return manifest.hexdigest()
