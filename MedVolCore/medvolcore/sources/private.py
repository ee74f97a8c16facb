"""Private copies for a client over HTTP naming a file in ``--data-dir``: the path is walked from a
descriptor of the data folder without following any symbolic link, what it stands for is checked
before a byte is copied, and it is copied into the worker's private folder while hashed; also
:func:`store_bytes` (an upload's bytes) and the full-disk error every copy shares.
"""

from __future__ import annotations

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
from typing import List, Optional, Tuple

from ..errors import ForbiddenError, LimitError, VolumeError
from .files import _entry_names
from .fingerprints import _CHUNK, _Manifest, _check_cancel
from .headers import ITK_SUFFIXES, NIFTI_SUFFIXES, declared_data_files

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# The longest a copy from ``--data-dir`` may take: a 2 GB volume at 20 MB/s (a slow network share).
COPY_SECONDS = 120.0
HEADER_PEEK = 1 << 20  # a gzip member may carry a name, comment and extra field before a NIfTI header


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
