"""Safe output: checked before the work, written under a temporary name and renamed.

Every output is checked before any long work starts (:func:`check_output`: the format, the
folder, write permission; :func:`check_distinct`: no two outputs of one command are the same
file and no output is one of its inputs). It is then written under a hidden temporary name in
its own folder and renamed (:func:`atomic_path`), so a killed or failing process never leaves a
half-written output under the final name, and an existing output is only replaced when the
caller asked for it. Write failures (permission, full disk, read-only file system) become one
:class:`~medvolcore.errors.OutputError` naming the file and the reason, and the temporary file
is removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Tuple, Union

from .errors import InputError, OutputError, OutputExistsError

PathLike = Union[str, "os.PathLike[str]"]

# Suffixes that carry the file format (nibabel and SimpleITK choose the writer from them).
_MULTI_SUFFIXES = (".nii.gz", ".anchor.json", ".seg.nrrd")
# What each writer accepts (checked before any work, so a bad name fails in a second, not after minutes).
MASK_SUFFIXES = (".nii.gz", ".nii", ".nrrd", ".mha")
PNG_SUFFIXES = (".png",)


def full_suffix(path: PathLike) -> str:
    name = Path(path).name.lower()
    for s in _MULTI_SUFFIXES:
        if name.endswith(s):
            return Path(path).name[-len(s):]
    return Path(path).suffix


def os_reason(exc: OSError) -> str:
    """A short, lower-case reason for an OS error (``permission denied``, ``no space left on device``)."""
    if exc.errno is not None and exc.errno in errno.errorcode:
        return os.strerror(exc.errno).lower()
    return (exc.strerror or str(exc) or type(exc).__name__).lower()


def _nearest_existing(folder: Path) -> Path:
    folder = Path(os.path.abspath(folder))
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    return folder


def check_output(path: PathLike, overwrite: bool = False, *, suffixes: Optional[Sequence[str]] = None,
                 what: str = "output", create_folder: bool = True) -> Path:
    """Check that ``path`` can be written, before any work; create its folder (unless
    ``create_folder`` is False: then a missing folder is refused).

    Refuses (in this order): a name whose suffix is not one of ``suffixes`` (case-insensitive),
    a folder, an existing file unless ``overwrite``, an existing path that is not a regular
    file (a device or FIFO would be replaced by the rename), a parent that is a file, and a
    folder where this process cannot create files (checked by creating and removing a hidden
    probe file, so a read-only file system or a quota is caught as well as permissions).
    """
    p = Path(os.path.expanduser(str(path)))
    if suffixes and not p.name.lower().endswith(tuple(s.lower() for s in suffixes)):
        raise OutputError(f"cannot write {p}: unsupported {what} type; use {', '.join(suffixes)}")
    if p.is_dir():
        raise OutputError(f"cannot write {p}: it is a folder, not a file path")
    if os.path.lexists(p):
        if not overwrite:
            raise OutputExistsError(f"{p} already exists; pass --overwrite to replace it")
        if not p.is_file():
            raise OutputError(f"cannot write {p}: it exists and is not a regular file")
    folder = _nearest_existing(p.parent)
    if not folder.is_dir():
        raise OutputError(f"cannot write {p}: {folder} is a file, not a folder")
    if not create_folder and not p.parent.is_dir():
        raise OutputError(f"cannot write {p}: the folder {p.parent} does not exist")
    if create_folder and not p.parent.is_dir():
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot write {p}: cannot create the folder {p.parent}: {os_reason(e)}") from None
        folder = p.parent
    _probe_write(folder, f"cannot write {p}")
    return p


def _probe_write(folder: Path, failure: str) -> None:
    """Create and remove a hidden file in ``folder``; an OSError becomes ``failure: reason``."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".medvol-write-test-", dir=folder)
    except OSError as e:
        raise OutputError(f"{failure}: {os_reason(e)} (in {folder})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def check_folder(path: PathLike, what: str = "output folder") -> Path:
    """Check, before any work, that ``path`` is (or can be created as) a folder this process
    can write in; create it."""
    p = Path(os.path.expanduser(str(path)))
    if os.path.lexists(p) and not p.is_dir():
        raise OutputError(f"cannot use {what} {p}: it is a file, not a folder")
    folder = _nearest_existing(p)
    if not folder.is_dir():
        raise OutputError(f"cannot use {what} {p}: {folder} is a file, not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {what} {p}: {os_reason(e)}") from None
    _probe_write(p, f"cannot write in {what} {p}")
    return p


def is_inside(path: PathLike, folder: PathLike) -> bool:
    """Whether ``path`` resolves to ``folder`` or something inside it (symbolic links followed)."""
    a, b = _identity(path), _identity(folder)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def _identity(path: PathLike) -> str:
    return os.path.normcase(os.path.realpath(os.path.abspath(os.path.expanduser(str(path)))))


def _same_file(a: PathLike, b: PathLike) -> bool:
    if _identity(a) == _identity(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links, bind mounts
    except OSError:
        return False


def check_distinct(outputs: Iterable[Tuple[str, Optional[PathLike]]],
                   inputs: Iterable[Tuple[str, Optional[PathLike]]] = ()) -> None:
    """Refuse two outputs that are one file, or an output that is one of the inputs.

    ``outputs`` / ``inputs``: ``(label, path)`` pairs (the label is the option name shown in
    the message, e.g. ``--anchor-out``); ``None`` paths are skipped. Paths are compared after
    resolving symbolic links and ``..``, and by inode when both exist (hard links).
    """
    outs = [(label, p) for label, p in outputs if p is not None]
    ins = [(label, p) for label, p in inputs if p is not None]
    for i, (label, p) in enumerate(outs):
        for other_label, q in outs[:i]:
            if _same_file(p, q):
                raise InputError(f"{other_label} and {label} are the same file ({q}); give each output its own path")
        for in_label, q in ins:
            if _same_file(p, q):
                raise InputError(f"{label} {p} is the input {in_label}; write the output elsewhere")


@contextlib.contextmanager
def atomic_path(path: PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same suffix); rename it into place on success.

    An ``OSError`` while writing (full disk, permission, read-only file system) becomes an
    :class:`OutputError`; the temporary file is removed whatever happens, including on
    KeyboardInterrupt and on SIGTERM (the CLI turns SIGTERM into an exception that unwinds).
    """
    final = check_output(path, overwrite)
    tmp_path: Optional[Path] = None
    try:
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".part" + full_suffix(final), dir=final.parent)
        except OSError as e:
            raise OutputError(f"cannot write {final}: {os_reason(e)}") from None
        tmp_path = Path(tmp)
        os.close(fd)
        try:
            yield tmp_path
        except OSError as e:
            raise OutputError(f"cannot write {final}: {os_reason(e)}") from None
        if final.exists() and not overwrite:  # appeared while we were writing
            raise OutputExistsError(f"{final} already exists; pass --overwrite to replace it")
        try:
            # mkstemp creates 0600 files; give the output the permissions a plain open() would
            os.chmod(tmp_path, 0o666 & ~_umask())
            os.replace(tmp_path, final)
        except OSError as e:
            raise OutputError(f"cannot write {final}: {os_reason(e)}") from None
    finally:
        if tmp_path is not None:
            with contextlib.suppress(OSError):
                tmp_path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: PathLike, text: str, overwrite: bool = False) -> Path:
    with atomic_path(path, overwrite) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
