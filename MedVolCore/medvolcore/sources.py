"""Which files a volume path makes the reader read, checked and fingerprinted.

A volume is not always one file: a detached header (``.mhd``, ``.nhdr``) names its data files,
and a DICOM series is a folder of slices. The checks before reading, the worker's cache key and
the ``--data-dir`` sandbox all need that list, so it is made here, once, by parsing the header's
text (the NRRD ``data file`` field, the MetaImage ``ElementDataFile`` field; no image library, so
this module imports nothing heavy):

- :func:`volume_sources` (the command line, and the worker over stdio: the caller's own rights):
  the header and every data file it names, or a DICOM folder's files, symbolic links followed.
  A missing data file, a FIFO, device or socket, or a folder with no file is refused with one
  :class:`~medvolcore.errors.VolumeError` before anything is read (a FIFO would block for ever).
  :func:`medvolcore.volume.load_volume` calls it first.
- :func:`sources_sha256`: the content sha256 of those files. One file: the sha256 of its bytes
  (the same key as an upload of that file); several: the sha256 of their names, sizes and
  sha256s. A :class:`HashMemo` keeps the sha256 of files already hashed, by path, device, inode,
  size, mtime and ctime, so an unchanged file is not read again.
- :func:`private_copy` (a client over HTTP naming a file in ``--data-dir``): opens the client's
  path once, component by component from a descriptor of the data folder without following any
  symbolic link, and copies what it names into the worker's private folder while hashing: a
  single file whose voxels are in the file itself (NIfTI, NRRD without ``data file``, MetaImage
  with ``ElementDataFile = LOCAL``), or a DICOM folder of regular files. The reader then reads
  only the copy, so a path swapped after the check cannot redirect it, and a header cannot make
  it open a file outside the folder.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import os
import shutil
import stat
import struct
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

from .errors import CancelledError, ForbiddenError, LimitError, VolumeError

__all__ = ["COPY_SECONDS", "MAX_SOURCE_FILES", "CopyLimits", "HashMemo", "check_header", "check_series_folder", "PrivateCopy", "VolumeSources", "declared_data_files", "hashed_copy",
           "known_sha256", "private_copy", "sources_sha256", "store_bytes", "volume_sources"]

# The same bound as ``volume.MAX_DICOM_FILES`` (tested): a CT series rarely has more than 2000
# slices, and a header naming more data files than this is a mistake or a probe.
MAX_SOURCE_FILES = 10000
NIFTI_SUFFIXES = (".nii", ".nii.gz")
ITK_SUFFIXES = (".nrrd", ".nhdr", ".mha", ".mhd")
_CHUNK = 1 << 20
_HEADER_MAX_BYTES = 4 << 20   # a NRRD/MetaImage header is a few hundred bytes; a LIST of 10,000 names some 300 KB
_HEADER_MAX_LINE = 1 << 16
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_KEY_VERSION = b"medvol.sources/1\0"
# The longest a copy from ``--data-dir`` may take: a 2 GB volume at 20 MB/s (a slow network share).
COPY_SECONDS = 120.0
HEADER_PEEK = 1 << 20  # a gzip member may carry a name, comment and extra field before a NIfTI header


@dataclass(frozen=True)
class VolumeSources:
    """The files a reader reads for ``path``.

    ``kind``: ``nifti``, ``nrrd``, ``metaimage``, ``dicom`` or ``unknown`` (a suffix no reader
    takes; the reader refuses it). ``files``: the header (or single file) first, then the data
    files it names, in the header's order; for a DICOM folder its files sorted by name. ``names``:
    the name each file is fingerprinted under (its entry name in a folder, ``header``/``data N``
    for a detached header).
    """

    path: Path
    kind: str
    files: Tuple[Path, ...]
    names: Tuple[str, ...]

    @property
    def single(self) -> bool:
        """True when the volume is one file holding its own voxels."""
        return self.kind != "dicom" and len(self.files) == 1


# ---- headers: which data files they name ----------------------------------------------------------

def _header_lines(fh, where: str) -> Iterable[str]:
    """The text lines of a header, bounded in length and total size (the voxels of an attached
    file come after the header and are never reached by the parsers below). A header that does
    not end within the bound is refused: stopping early could miss a data file named after it."""
    total = 0
    while True:
        line = fh.readline(_HEADER_MAX_LINE)
        if not line:
            return
        total += len(line)
        if total > _HEADER_MAX_BYTES:
            raise LimitError(f"{where}: no end of its header within {_HEADER_MAX_BYTES >> 20} MB; refused before "
                             "reading it (is it a NRRD or MetaImage file?)")
        yield os.fsdecode(line.rstrip(b"\r\n"))


def _expand(value: str, rest: Iterable[str], where: str) -> List[str]:
    """The file names of a data-file field: ``LIST`` (names on the following lines), a pattern
    ``FORMAT MIN MAX STEP [SUBDIM]`` (``sprintf(FORMAT, i)``, as teem and MetaIO expand it), or one
    name."""
    words = value.split()
    if not words:
        raise VolumeError(f"{where}: its data file field is empty")
    if words[0].upper() == "LIST":
        names = []
        for line in rest:
            if line.strip():
                names.append(line.strip())
                if len(names) > MAX_SOURCE_FILES:
                    raise LimitError(f"{where} names more than {MAX_SOURCE_FILES} data files")
        return names
    if len(words) in (4, 5) and all(_is_int(w) for w in words[1:]):
        lo, hi, step = int(words[1]), int(words[2]), int(words[3])
        if step == 0 or (hi - lo) * step < 0:
            raise VolumeError(f"{where}: its data file pattern {value!r} names no file")
        count = (hi - lo) // step + 1
        if count > MAX_SOURCE_FILES:
            raise LimitError(f"{where} names {count} data files, more than {MAX_SOURCE_FILES}")
        fmt = words[0]
        try:
            return [fmt % i if "%" in fmt else fmt for i in range(lo, hi + (1 if step > 0 else -1), step)]
        except (TypeError, ValueError, OverflowError):
            raise VolumeError(f"{where}: cannot expand its data file pattern {fmt!r}") from None
    return [value.strip()]


def _is_int(word: str) -> bool:
    try:
        int(word)
        return True
    except ValueError:
        return False


def _nrrd_data_files(fh, where: str) -> Optional[List[str]]:
    """NRRD: the names of the ``data file`` (or ``datafile``) field; None when the voxels follow
    the header (attached), or when there is no such field (teem then reads nothing else)."""
    lines = iter(_header_lines(fh, where))
    next(lines, None)  # the magic line, NRRD000N
    for line in lines:
        if line == "":
            return None  # end of the header: the voxels follow
        if line.startswith("#") or ":=" in line:
            continue  # a comment or a key/value pair
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() in ("data file", "datafile"):
            return _expand(value, lines, where)
    return None


def _metaimage_data_files(fh, where: str) -> Optional[List[str]]:
    """MetaImage: the names of ``ElementDataFile`` (the header's last field); None for ``LOCAL``
    (the voxels follow it)."""
    lines = iter(_header_lines(fh, where))
    for line in lines:
        cut = min((i for i in (line.find("="), line.find(":")) if i >= 0), default=-1)
        if cut < 0:
            continue
        if line[:cut].strip().lower() == "elementdatafile":
            value = line[cut + 1:].strip()
            if value.upper() == "LOCAL":
                return None
            return _expand(value, lines, where)
    raise VolumeError(f"{where} is neither a NRRD nor a MetaImage file (no ElementDataFile field); give a CT as "
                      "NIfTI, NRRD, MetaImage or a DICOM folder")


def declared_data_files(path) -> Tuple[str, Optional[List[str]]]:
    """``(kind, names)``: the format of a NRRD/MetaImage file by its content (``nrrd`` when it
    starts with ``NRRD``, else ``metaimage``) and the data files its header names, as written
    (None when its voxels are in the file itself). Only the header is read; nothing it names
    is looked up."""
    p = Path(path)
    with _open_regular(p) as fh:
        if fh.read(4) == b"NRRD":
            fh.seek(0)
            return "nrrd", _nrrd_data_files(fh, str(p))
        fh.seek(0)
        return "metaimage", _metaimage_data_files(fh, str(p))


# ---- the files of a volume path (command line, stdio) ---------------------------------------------

def _open_regular(path: Path):
    """Open a file for reading only if it is a regular file, without ever blocking on a FIFO
    (``O_NONBLOCK``; the type is checked on the open descriptor)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise VolumeError(f"{path} is not a regular file (a device, FIFO or socket); give a CT file or a DICOM "
                              "folder")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _stat_or_none(path: Path) -> Optional[os.stat_result]:
    """``os.stat`` (links followed), None when there is nothing there (or a broken link)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise VolumeError(f"{path} cannot be read: {e.strerror or e}") from None


def _entry_names(folder, shown: str) -> List[str]:
    """The names in ``folder`` (a path or a descriptor), refused with a :class:`LimitError` naming
    ``shown`` past :data:`MAX_SOURCE_FILES` entries, before any is looked at."""
    names = []
    with os.scandir(folder) as it:
        for entry in it:
            names.append(entry.name)
            if len(names) > MAX_SOURCE_FILES:
                raise LimitError(f"{shown} holds more than {MAX_SOURCE_FILES} files; a DICOM series folder should "
                                 "hold one series (give the folder of that series)")
    return names


def _folder_sources(path: Path) -> VolumeSources:
    """A DICOM folder: its files (symbolic links followed), sorted by name. Subfolders are not
    part of the series (the series reader does not look into them); anything else that is not a
    regular file is refused."""
    try:
        names = _entry_names(path, str(path))
    except OSError as e:
        raise VolumeError(f"{path} cannot be read: {e.strerror or e}") from None
    files, kept = [], []
    for name in sorted(names):
        f = path / name
        st = _stat_or_none(f)
        if st is None:
            raise VolumeError(f"{f} is a broken symbolic link (or vanished); a DICOM folder should hold only the files "
                              "of its series")
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            raise VolumeError(f"{f} is not a regular file (a device, FIFO or socket); a DICOM folder should hold only "
                              "the files of its series")
        files.append(f)
        kept.append(name)
    if not files:
        raise VolumeError(f"{path} holds no file, so it is not a DICOM series; give the folder of one series")
    return VolumeSources(path, "dicom", tuple(files), tuple(kept))


def volume_sources(path) -> VolumeSources:
    """The files the reader will read for ``path``, each checked to be there and a regular file.

    Symbolic links are followed (the caller reads with its own rights). A detached header's data
    files are resolved as its reader resolves them: relative to the header's folder. Raises
    :class:`VolumeError` (missing file, FIFO, device, socket, broken link, folder with no file,
    a NRRD/MetaImage suffix on another kind of file) or :class:`LimitError` (too many files),
    before any voxel is read.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise VolumeError(f"{p} does not exist") from None
    except OSError as e:
        raise VolumeError(f"{p} cannot be read: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        return _folder_sources(p)
    if not stat.S_ISREG(st.st_mode):
        raise VolumeError(f"{p} is not a regular file or folder (a device, FIFO or socket); give a CT file or a DICOM "
                          "folder")
    name = p.name.lower()
    if name.endswith(NIFTI_SUFFIXES):  # nibabel reads a .nii/.nii.gz from that one file
        return VolumeSources(p, "nifti", (p,), ("",))
    if not name.endswith(ITK_SUFFIXES):
        return VolumeSources(p, "unknown", (p,), ("",))
    try:
        kind, declared = declared_data_files(p)
    except OSError as e:
        raise VolumeError(f"{p} cannot be read: {e.strerror or e}") from None
    if declared is None:
        return VolumeSources(p, kind, (p,), ("",))
    files = [p]
    for data_name in declared:
        f = Path(data_name) if os.path.isabs(data_name) else p.parent / data_name
        st = _stat_or_none(f)
        if st is None:
            raise VolumeError(f"{p.name} names the data file {f}, which does not exist; refused before reading it")
        if not stat.S_ISREG(st.st_mode):
            raise VolumeError(f"{p.name} names the data file {f}, which is not a regular file (a device, FIFO, socket "
                              "or folder); refused before reading it")
        files.append(f)
    return VolumeSources(p, kind, tuple(files), ("header",) + tuple(f"data {i}" for i in range(1, len(files))))


# ---- fingerprints ---------------------------------------------------------------------------------

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


# ---- private copies (HTTP, --data-dir) ----------------------------------------------------------------

def _no_space(e: OSError, what: str) -> Optional[LimitError]:
    if e.errno in _NO_SPACE:
        return LimitError(f"the server has no space left for {what} ({os.strerror(e.errno)}); try again later or "
                          "send a smaller volume")
    return None


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def store_bytes(data: bytes, dest_dir, suffix: str, what: str = "the uploaded volume") -> Path:
    """Write ``data`` to a new private file in ``dest_dir``; a full disk raises
    :class:`LimitError` ("the server has no space left for …") and leaves no file."""
    path = None
    try:
        fd, path = tempfile.mkstemp(prefix="upload-", suffix=suffix, dir=dest_dir)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
    except OSError as e:
        if path is not None:
            _unlink(path)
        err = _no_space(e, what)
        if err is None:
            raise
        raise err from None
    return Path(path)


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass
class PrivateCopy:
    """A private copy of a client's volume: ``path`` (a file or a folder) for the reader,
    ``sha256`` its content key (as :func:`sources_sha256` computes it), ``folder`` the private
    folder holding it. :meth:`close` removes it (also as a context manager)."""

    path: Path
    sha256: str
    folder: Path

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "PrivateCopy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def client_parts(root, value: str, what: str = "volume") -> List[str]:
    """The components of ``value`` (relative to ``root``, or absolute) inside ``root``, worked out
    from the text alone (``..`` collapsed, nothing looked up). A path that leaves ``root`` raises
    :class:`ForbiddenError`; ``[]`` names ``root`` itself."""
    if "\0" in value:
        raise ForbiddenError(f"'{what}' is not a usable path")
    root = os.fspath(root)
    full = os.path.normpath(os.path.join(root, value))
    rel = os.path.relpath(full, root)
    if rel == os.curdir:
        return []
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise ForbiddenError(f"'{what}' {value!r} is outside the server's data folder")
    return rel.split(os.sep)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _refuse_link(value: str, what: str, name: str, entry: bool = False) -> ForbiddenError:
    where = "holds a symbolic link" if entry else "goes through a symbolic link"
    return ForbiddenError(f"'{what}' {value!r} {where} ({name}), which the server does not follow inside its data "
                          "folder; name the file or folder itself (a DICOM folder of regular files)")


def _open_entry(dir_fd: int, name: str, value: str, what: str, folder: bool) -> int:
    """Open ``name`` in the folder ``dir_fd`` without following a symbolic link: a folder, or a
    regular file (never a FIFO, device or socket: the type is checked before and after the open,
    and the open does not block)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise VolumeError(f"'{what}' {value!r} does not exist in the server's data folder") from None
    except NotADirectoryError:
        raise VolumeError(f"'{what}' {value!r} does not exist in the server's data folder") from None
    except OSError as e:
        raise VolumeError(f"'{what}' {value!r} cannot be read: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode):
        raise _refuse_link(value, what, name)
    if folder and not stat.S_ISDIR(st.st_mode):
        raise VolumeError(f"'{what}' {value!r} does not exist in the server's data folder ({name} is not a folder)")
    if not folder and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise VolumeError(f"'{what}' {value!r} is not a regular file or folder (a device, FIFO or socket); give a CT "
                          "file or a DICOM folder")
    try:
        fd = os.open(name, _DIR_FLAGS if stat.S_ISDIR(st.st_mode) else _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # swapped for a link since the stat
            raise _refuse_link(value, what, name) from None
        raise VolumeError(f"'{what}' {value!r} cannot be read: {e.strerror or e}") from None
    st2 = os.fstat(fd)
    if stat.S_IFMT(st2.st_mode) != stat.S_IFMT(st.st_mode) or not (stat.S_ISREG(st2.st_mode)
                                                                    or stat.S_ISDIR(st2.st_mode)):
        os.close(fd)
        raise VolumeError(f"'{what}' {value!r} changed while it was opened; try again")
    return fd


# ---- what a --data-dir name stands for, before a byte is copied ---------------------------------------

def _nifti_dims(raw: bytes) -> Optional[List[int]]:
    """The dimensions a NIfTI-1 or NIfTI-2 header declares (either byte order), None when ``raw``
    does not start with one."""
    for order in "<>":
        if len(raw) >= 348 and struct.unpack(order + "i", raw[:4])[0] == 348:
            dims = struct.unpack(order + "8h", raw[40:56])
        elif len(raw) >= 540 and struct.unpack(order + "i", raw[:4])[0] == 540:
            dims = struct.unpack(order + "8q", raw[16:80])
        else:
            continue
        if not 1 <= dims[0] <= 7:
            return None
        return [int(v) for v in dims[1:1 + dims[0]]]
    return None


def _text_dims(raw: bytes, kind: str) -> Optional[List[int]]:
    """The sizes a NRRD (``sizes:``) or MetaImage (``DimSize =``) header declares, times its
    channels; None when the header names none."""
    dims, channels = None, 1
    for line in raw.split(b"\n"):
        text = os.fsdecode(line.rstrip(b"\r"))
        if kind == "nrrd" and text == "":
            break  # the voxels follow
        cut = text.find(":") if kind == "nrrd" else text.find("=")
        if cut < 0:
            continue
        key, value = text[:cut].strip().lower(), text[cut + 1:].lstrip("=").strip()
        try:
            if key in ("sizes", "dimsize"):
                dims = [int(v) for v in value.split()]
            elif key == "elementnumberofchannels":
                channels = int(value)
        except ValueError:
            return None
        if kind == "metaimage" and key == "elementdatafile":
            break
    return None if dims is None else dims + [max(1, channels)]


def check_header(fd: int, suffix: str, what: str, limits: "CopyLimits") -> None:
    """Refuse an open file before it is copied: over ``limits.max_bytes``, or whose header
    (NIfTI, gzip-compressed or not: decompressed as far as the header only; NRRD; MetaImage)
    declares more than ``limits.max_voxels`` voxels, or a NIfTI with no header at all. Reads
    at most the file's first megabyte."""
    size = os.fstat(fd).st_size
    limits.check_size(size, what)
    if limits.max_voxels is None:
        return
    raw = os.pread(fd, HEADER_PEEK, 0)
    if suffix in NIFTI_SUFFIXES:
        if raw[:2] == b"\x1f\x8b":
            try:
                raw = zlib.decompressobj(31).decompress(raw, 544)  # the header only, whatever follows
            except zlib.error as e:
                raise VolumeError(f"{what} is not a readable gzip stream ({e}); refused before copying it") from None
        dims = _nifti_dims(raw)
        if dims is None:
            raise VolumeError(f"{what} has no NIfTI-1 or NIfTI-2 header; refused before copying it")
    else:
        dims = _text_dims(raw, "nrrd" if raw[:4] == b"NRRD" else "metaimage")
        if dims is None:
            return  # the reader's own header check decides, on the copy
    n = 1
    for v in dims:
        n *= max(0, v)
    if n > limits.max_voxels:
        raise LimitError(f"{what} declares {'×'.join(map(str, dims))} = {n:,} voxels, over the limit of "
                         f"{int(limits.max_voxels):,} (--max-voxels); refused before copying it")


def _series_entry(dir_fd: int, name: str, value: str, what: str) -> Optional[os.stat_result]:
    """The stat of entry ``name`` of a series folder when it is a regular file; None when it is gone
    or a subfolder (not part of the series); a symbolic link, device, FIFO or socket is refused."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise _refuse_link(value, what, name, entry=True)
    if stat.S_ISDIR(st.st_mode):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise VolumeError(f"'{what}' {value!r} holds {name}, which is not a regular file (a device, FIFO or "
                          "socket); a DICOM folder should hold only the files of its series")
    return st


def check_series_folder(dir_fd: int, names: List[str], value: str, what: str, limits: "CopyLimits") -> None:
    """Refuse a folder before any of it is copied: an entry that is a symbolic link, a device,
    FIFO or socket, a file that is not a DICOM file (no ``DICM`` marker after its 128-byte
    preamble: a folder of NIfTI files, or the data folder itself, is not a series), or files
    holding more than ``limits.max_bytes`` together. Reads 132 bytes of each file."""
    total = 0
    for name in sorted(names):
        st = _series_entry(dir_fd, name, value, what)
        if st is None:
            continue
        total += st.st_size
        limits.check_size(total, f"'{what}' {value!r}")
        fd = _open_entry(dir_fd, name, value, what, folder=False)
        try:
            marker = os.pread(fd, 4, 128) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        finally:
            os.close(fd)
        if marker != b"DICM":
            raise VolumeError(f"'{what}' {value!r} holds {name}, which is not a DICOM file (no DICM marker); a folder "
                              "is read as one DICOM series and should hold only its files; refused before copying it")


@dataclass
class CopyLimits:
    """What a private copy may cost: ``max_bytes`` (all its files together), ``max_voxels`` (what a
    header may declare), ``deadline`` (a :func:`time.monotonic` time the copy must end by).
    None: no bound. :meth:`spend` is called per chunk copied."""

    max_bytes: Optional[int] = None
    max_voxels: Optional[int] = None
    deadline: Optional[float] = None
    seconds: Optional[float] = None
    copied: int = 0

    @classmethod
    def make(cls, max_bytes=None, max_voxels=None, seconds=None) -> "CopyLimits":
        return cls(max_bytes, max_voxels, None if seconds is None else time.monotonic() + seconds, seconds)

    def check_size(self, size: int, what: str) -> None:
        if self.max_bytes is not None and self.copied + size > self.max_bytes:
            raise LimitError(f"{what} holds {self.copied + size:,} bytes, more than the voxel limit (--max-voxels) "
                             f"allows a volume ({self.max_bytes:,} bytes); refused before copying it")

    def spend(self, n: int, what: str) -> None:
        self.copied += n
        if self.max_bytes is not None and self.copied > self.max_bytes:
            raise LimitError(f"{what} grew past what the voxel limit (--max-voxels) allows a volume while it was "
                             "copied; refused")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise LimitError(f"{what} took more than {self.seconds:g} s to copy from the data folder; refused (is "
                             "the data folder on a slow disk?)")


def _copy_fd(src_fd: int, out_fd: int, cancel, what: str, limits: Optional[CopyLimits] = None) -> Tuple[str, int]:
    """Copy an open regular file into ``out_fd``, hashing the bytes copied, within ``limits``
    (bytes and deadline, checked per chunk); a full disk raises :class:`LimitError`."""
    os.set_blocking(src_fd, True)
    h = hashlib.sha256()
    size = 0
    try:
        while True:
            _check_cancel(cancel, what)
            chunk = os.read(src_fd, _CHUNK)
            if not chunk:
                break
            if limits is not None:
                limits.spend(len(chunk), what)
            h.update(chunk)
            size += len(chunk)
            _write_all(out_fd, chunk)
    except OSError as e:
        raise _no_space(e, "a private copy of the volume") or VolumeError(
            f"{what} cannot be copied: {e.strerror or e}") from None
    return h.hexdigest(), size


def _new_file(make, what: str):
    """``make()`` (a new file or folder in the private folder); a full disk raises :class:`LimitError`."""
    try:
        return make()
    except OSError as e:
        raise _no_space(e, "a private copy of the volume") or VolumeError(
            f"{what} cannot be copied: {e.strerror or e}") from None


def _copy_file(fd: int, value: str, what: str, folder: Path, cancel, limits: CopyLimits) -> Tuple[Path, str]:
    name = os.path.basename(os.path.normpath(value)).lower()
    suffix = next((s for s in NIFTI_SUFFIXES[::-1] + ITK_SUFFIXES if name.endswith(s)), None)
    if suffix is None:
        raise VolumeError(f"'{what}' {value!r}: unsupported file type; use NIfTI (.nii, .nii.gz), NRRD (.nrrd), "
                          "MetaImage (.mha) or a DICOM folder")
    label = f"'{what}' {value!r}"
    check_header(fd, suffix, label, limits)  # size, header and voxel count, before a byte is copied
    out_fd, out = _new_file(lambda: tempfile.mkstemp(prefix="volume-", suffix=suffix, dir=folder), label)
    try:
        digest, _ = _copy_fd(fd, out_fd, cancel, label, limits)
    finally:
        os.close(out_fd)
    if suffix in ITK_SUFFIXES:
        try:
            _, declared = declared_data_files(out)
        except (VolumeError, LimitError) as e:
            raise type(e)(str(e).replace(out, label)) from None
        if declared is not None:
            raise ForbiddenError(f"{label} is a detached header: its voxels are in other files "
                                 f"({declared[0]!r}{' …' if len(declared) > 1 else ''}), which the server does not "
                                 "open for HTTP clients; give a file that holds its voxels (NIfTI, NRRD, MetaImage "
                                 ".mha) or a DICOM folder")
    return Path(out), digest


def _copy_folder(dir_fd: int, value: str, what: str, folder: Path, cancel, limits: CopyLimits) -> Tuple[Path, str]:
    """A DICOM folder: every entry must be a regular file (a symbolic link is refused, a subfolder
    is not part of the series and is skipped), a DICOM file (checked with the folder's total size
    before anything is copied); each is copied under its own name."""
    names = _entry_names(dir_fd, f"'{what}' {value!r}")
    check_series_folder(dir_fd, names, value, what, limits)
    # named as the client's folder, so the reader's messages name it too
    base = os.path.basename(os.path.normpath(value))
    series = folder / (base if base not in ("", os.curdir, os.pardir) else "series")
    _new_file(lambda: series.mkdir(), f"'{what}' {value!r}")
    manifest = _Manifest("dicom")
    copied = 0
    for name in sorted(names):
        st = _series_entry(dir_fd, name, value, what)
        if st is None:
            continue  # gone since the listing, or a subfolder (not part of the series)
        fd = _open_entry(dir_fd, name, value, what, folder=False)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise VolumeError(f"'{what}' {value!r} changed while it was opened; try again")
            label = f"'{what}' {value!r}"
            out_fd = _new_file(lambda dst=series / name: os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                                                                 | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), label)
            try:
                digest, size = _copy_fd(fd, out_fd, cancel, label, limits)
            finally:
                os.close(out_fd)
        finally:
            os.close(fd)
        manifest.add(name, size, digest)
        copied += 1
    if not copied:
        raise VolumeError(f"'{what}' {value!r} holds no file, so it is not a DICOM series; give the folder of one "
                          "series")
    return series, manifest.hexdigest()


def private_copy(root, value: str, dest_dir, cancel=None, what: str = "volume", *, max_bytes: Optional[int] = None,
                 max_voxels: Optional[int] = None, seconds: Optional[float] = None) -> PrivateCopy:
    """Copy the volume a client names inside ``root`` into a new folder in ``dest_dir``.

    ``value`` is walked from a descriptor of ``root``, one component at a time, each opened with
    ``O_NOFOLLOW``: a symbolic link anywhere raises :class:`ForbiddenError`, as does a path that
    leaves ``root`` (decided from the text, before anything is looked up). What it names must be
    a regular file holding its voxels (a NRRD/MetaImage header naming data files raises
    :class:`ForbiddenError`, checked on the copy, before any data file is looked up) or a folder
    whose entries are regular files (a DICOM series). Every byte is read once, from the
    descriptors opened by the walk, and hashed while copied; the key is :func:`sources_sha256`'s
    for the same content. A full disk raises :class:`LimitError`.

    What the path stands for is checked before anything is copied (:func:`check_header`,
    :func:`check_series_folder`): a file over ``max_bytes``, a header declaring more than
    ``max_voxels`` voxels, a folder whose files are not DICOM files or hold more than
    ``max_bytes`` together raise :class:`LimitError` or :class:`VolumeError` with nothing
    copied. The copy itself stops (:class:`LimitError`) past ``max_bytes`` or ``seconds``.
    """
    parts = client_parts(root, value, what)
    limits = CopyLimits.make(max_bytes, max_voxels, seconds)
    folder = Path(_new_file(lambda: tempfile.mkdtemp(prefix="source-", dir=dest_dir), f"'{what}' {value!r}"))
    dir_fd = None
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        for name in parts[:-1]:
            fd = _open_entry(dir_fd, name, value, what, folder=True)
            os.close(dir_fd)
            dir_fd = fd
        fd = _open_entry(dir_fd, parts[-1], value, what, folder=False) if parts else os.dup(dir_fd)
        try:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                path, digest = _copy_folder(fd, value, what, folder, cancel, limits)
            else:
                path, digest = _copy_file(fd, value, what, folder, cancel, limits)
        finally:
            os.close(fd)
        return PrivateCopy(path, digest, folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        if dir_fd is not None:
            os.close(dir_fd)


# ---- hashed copies (command line, stdio: the caller's own rights) ---------------------------------------

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
