"""Hashed copies (the command line, and the worker over stdio: the caller's own rights): the files
the reader reads for a path, copied into a private folder while every byte is hashed, so the
reader reads only bytes whose key is known.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Tuple

from ..errors import LimitError, VolumeError
from .files import volume_sources
from .fingerprints import _CHUNK, HashMemo, _Manifest, _check_cancel, _file_sha256
from .headers import _is_int, _open_regular, declared_data_files
from .private import PrivateCopy, _new_file, _no_space, _write_all


# Where a detached header's absolute data file names go in its copy (the header's copy names them
# relative to itself, under this folder).
_ABSOLUTE_DIR = ".medvol-abs"


def _copy_path(src: Path, dst: Path, cancel, budget: list, memo: Optional[HashMemo]) -> Tuple[str, int]:
    """Copy the regular file ``src`` to the new file ``dst`` (never a FIFO: checked on the open
    descriptor), hashing the bytes copied. ``budget``: ``[bytes left]``, a :class:`LimitError`
    past it. The sha256 is remembered in ``memo`` only when the file did not change during the copy."""
    try:
        fh = _open_regular(src)
    except OSError as e:
        raise VolumeError(f"{src} cannot be read: {e.strerror or e}") from None
    with fh:
        before = os.fstat(fh.fileno())
        if before.st_size > budget[0]:
            raise LimitError(f"{src} is {before.st_size:,} bytes, more than the voxel limit (--max-voxels) allows a "
                             "volume; refused before reading it")
        out_fd = _new_file(lambda: os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                           0o600), str(src))
        try:
            h = hashlib.sha256()
            size = 0
            try:
                for chunk in iter(lambda: fh.read(_CHUNK), b""):
                    _check_cancel(cancel, src.name)
                    size += len(chunk)
                    if size > budget[0]:
                        raise LimitError(f"{src} grew past what the voxel limit (--max-voxels) allows a volume while "
                                         "it was read")
                    h.update(chunk)
                    _write_all(out_fd, chunk)
            except OSError as e:
                raise _no_space(e, "a private copy of the volume") or VolumeError(
                    f"{src} cannot be read: {e.strerror or e}") from None
        finally:
            os.close(out_fd)
        after = os.fstat(fh.fileno())
    budget[0] -= size
    digest = h.hexdigest()
    key = (str(src), before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns, before.st_ctime_ns)
    if memo is not None and size == before.st_size and (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (
            before.st_size, before.st_mtime_ns, before.st_ctime_ns):
        memo.put(key, digest)
    return digest, size


def _relative_header(data: bytes, kind: str) -> bytes:
    """A detached header's text with every absolute data file name made relative (under
    :data:`_ABSOLUTE_DIR`), as its copy lays the data files out."""
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        text = os.fsdecode(line.rstrip(b"\r"))
        if kind == "nrrd":
            if i == 0 or text.startswith("#") or ":=" in text or ":" not in text:
                continue
            key, value = text.split(":", 1)
            if key.strip().lower() not in ("data file", "datafile"):
                continue
        else:
            cut = min((j for j in (text.find("="), text.find(":")) if j >= 0), default=-1)
            if cut < 0 or text[:cut].strip().lower() != "elementdatafile":
                continue
            key, value = text[:cut], text[cut + 1:]
        words = value.split()
        if words and words[0].upper() == "LIST":
            for j in range(i + 1, len(lines)):
                name = os.fsdecode(lines[j].rstrip(b"\r")).strip()
                if os.path.isabs(name):
                    lines[j] = os.fsencode(_ABSOLUTE_DIR + name)
        elif words and os.path.isabs(words[0]):
            rest = value.strip()
            if len(words) in (4, 5) and all(_is_int(w) for w in words[1:]):
                rest = " ".join([_ABSOLUTE_DIR + words[0]] + words[1:])
            else:
                rest = _ABSOLUTE_DIR + rest
            lines[i] = os.fsencode(f"{key}{':' if kind == 'nrrd' else ' ='} {rest}")
        break
    return b"\n".join(lines)


def hashed_copy(path, dest_dir, cancel=None, memo: Optional[HashMemo] = None,
                max_bytes: Optional[int] = None) -> PrivateCopy:
    """Copy the files the reader reads for ``path`` (:func:`volume_sources`: links followed, a
    detached header's data files, a DICOM folder's files) into a new folder in ``dest_dir``,
    hashing every byte as it is copied; the key is :func:`sources_sha256`'s for that content.

    The reader then reads only the copy, so the voxels always are those of the key: a file
    replaced or rewritten while it is read (an export writing ``{node}.nii`` with ``os.replace``)
    cannot give a volume under another volume's key. A detached header's copy finds its data
    files where it names them (relative names as written, ``..`` included; absolute names
    rewritten to a folder of the copy). ``max_bytes``: the most the files may hold together
    (:class:`LimitError` before reading past it). A full disk raises :class:`LimitError`.
    """
    src = volume_sources(path)
    budget = [max_bytes if max_bytes is not None else float("inf")]
    folder = Path(_new_file(lambda: tempfile.mkdtemp(prefix="source-", dir=dest_dir), str(path)))
    try:
        if src.kind == "dicom":
            base = src.path.name if src.path.name not in ("", os.curdir, os.pardir) else "series"
            series = folder / base
            _new_file(lambda: series.mkdir(), str(path))
            manifest = _Manifest("dicom")
            for name, f in zip(src.names, src.files):
                digest, size = _copy_path(f, series / name, cancel, budget, memo)
                manifest.add(name, size, digest)
            return PrivateCopy(series, manifest.hexdigest(), folder)
        if src.single:
            dst = folder / src.path.name
            return PrivateCopy(dst, _copy_path(src.files[0], dst, cancel, budget, memo)[0], folder)
        # the header is copied first and its data files taken from the copy (the names hashed)
        first = folder / ("header" + "".join(src.path.suffixes[-1:]))
        header_digest, header_size = _copy_path(src.files[0], first, cancel, budget, memo)
        kind, declared = declared_data_files(first)
        if declared is None:  # rewritten since it was looked at: now a file holding its voxels
            header = folder / src.path.name
            os.replace(first, header)
            return PrivateCopy(header, header_digest, folder)
        ups = max((_leading_ups(n) for n in declared if not os.path.isabs(n)), default=0)
        home = folder.joinpath("h", *[f"up{i}" for i in range(ups)])
        _new_file(lambda: home.mkdir(parents=True), str(path))
        header = home / src.path.name
        os.replace(first, header)
        manifest = _Manifest(kind)
        manifest.add("header", header_size, header_digest)
        placed = {header: (header_digest, header_size)}
        for i, rel in enumerate(declared, 1):
            f = Path(rel) if os.path.isabs(rel) else src.path.parent / rel
            dst = Path(os.path.normpath(home / (_ABSOLUTE_DIR + rel if os.path.isabs(rel) else rel)))
            if dst in placed:  # the same file named twice (a pattern repeating a name): copied once
                digest, size = placed[dst]
                if _file_sha256(f, cancel)[0] != digest:
                    raise VolumeError(f"{src.path.name} names {f} in two ways that lead to different files; refused")
            else:
                _new_file(lambda d=dst: d.parent.mkdir(parents=True, exist_ok=True), str(path))
                digest, size = _copy_path(f, dst, cancel, budget, memo)
                placed[dst] = (digest, size)
            manifest.add(f"data {i}", size, digest)
        if any(os.path.isabs(n) for n in declared):
            header.write_bytes(_relative_header(header.read_bytes(), kind))
        return PrivateCopy(header, manifest.hexdigest(), folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _leading_ups(name: str) -> int:
    n = 0
    for part in os.path.normpath(name).split(os.sep):
        if part != os.pardir:
            break
        n += 1
    return n
