"""Safe output: checked before the work, written under a temporary name and renamed.

Every output is checked before any long work starts (:func:`check_output`: the format, the
folder, write permission; :func:`check_distinct`: no two outputs of one command are the same
file and no output is one of its inputs). It is then written under a hidden temporary name in
its own folder and renamed (:func:`atomic_path`), so a killed or failing process never leaves a
half-written output under the final name, and an existing output is only replaced when the
caller asked for it. What was written is checked before the rename (:func:`check_written`: not
empty, a mask's header readable), the temporary carries the writing process's pid so the next
write of the same output removes what a ``kill -9`` left, and its format suffix is lower case
so every writer recognises it. Write failures (permission, full disk, read-only file system) become one
:class:`~medvolcore.errors.OutputError` naming the file and the reason, and the temporary file
is removed.

The outputs of one job change as one set (:func:`output_set`): inside it, each file is written
and checked under its temporary name and kept there; only when every file of the set is written
are they renamed into place, an existing file first moved aside and put back if a later rename
fails. A failure anywhere leaves every previous output as it was and no new file.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import errno
import functools
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence, Tuple, Union

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


def resolve_paths(paths: Iterable[PathLike]) -> list:
    """What :func:`is_inside` compares, for many paths at once: each absolute, ``~`` expanded,
    ``..`` and symbolic links resolved (``os.path.realpath``), ``normcase``-d; each distinct
    folder is resolved once, so n paths in a few folders cost O(n), not n full resolutions."""
    folders: dict = {}
    out = []
    for p in paths:
        a = os.path.abspath(os.path.expanduser(str(p)))
        parent, name = os.path.split(a)
        if not name:  # the root itself
            out.append(os.path.normcase(os.path.realpath(a)))
            continue
        real_parent = folders.get(parent)
        if real_parent is None:
            real_parent = folders[parent] = os.path.realpath(parent)
        full = os.path.join(real_parent, name)
        if os.path.islink(full):
            full = os.path.realpath(full)
        out.append(os.path.normcase(full))
    return out


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


def _input_files(path: PathLike) -> list:
    """Every file an input path stands for: a DICOM folder's files, a detached header's data files
    (:func:`medvolcore.sources.volume_sources`), or the path itself when that cannot be listed (the
    reader refuses it later)."""
    p = Path(os.path.expanduser(str(path)))
    if not (p.is_dir() or p.name.lower().endswith((".nhdr", ".mhd", ".nrrd", ".mha"))):
        return [p]
    from .sources import volume_sources

    try:
        return [p] + [f for f in volume_sources(p).files if f != p]
    except Exception:  # noqa: BLE001 - the read refuses it with its own message
        return [p]


def _file_ids(paths) -> set:
    ids = set()
    for q in paths:
        with contextlib.suppress(OSError):
            st = os.stat(q)
            ids.add((st.st_dev, st.st_ino))
    return ids


def check_distinct(outputs: Iterable[Tuple[str, Optional[PathLike]]],
                   inputs: Iterable[Tuple[str, Optional[PathLike]]] = ()) -> None:
    """Refuse two outputs that are one file, or an output that is one of the inputs or one of the
    files an input stands for (each file of a DICOM series folder, a detached header's data
    files), or a DICOM Segmentation written into a DICOM input folder (it would become a second
    series there).

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
    for in_label, q in ins:
        files = _input_files(q)
        if len(files) < 2 and not Path(os.path.expanduser(str(q))).is_dir():
            continue
        names = {_identity(f): f for f in files}
        ids = _file_ids(files)
        folder = Path(os.path.expanduser(str(q)))
        for label, p in outs:
            hit = names.get(_identity(p))
            if hit is None and os.path.lexists(p):
                with contextlib.suppress(OSError):
                    st = os.stat(p)
                    if (st.st_dev, st.st_ino) in ids:
                        hit = p
            if hit is not None:
                raise InputError(f"{label} {p} is {Path(hit).name}, a file of the input {in_label} {q}; outputs never "
                                 "replace an input: write it elsewhere")
            if folder.is_dir() and str(p).lower().endswith(".dcm") and _identity(Path(os.path.expanduser(str(p))).parent) \
                    == _identity(folder):
                raise InputError(f"{label} {p}: a DICOM Segmentation written into its source folder {q} would become "
                                 "a second series there; write it elsewhere")


@functools.lru_cache(maxsize=1)
def _host_tag() -> str:
    """Six hex digits naming this machine in temporary names, so a process on another machine
    sharing the folder (a cluster's file system) is never taken for a dead one of ours."""
    import hashlib
    import socket

    return hashlib.blake2b(socket.gethostname().encode("utf-8", "replace"), digest_size=3).hexdigest()


# .NAME.<pid>-<host>.<mkstemp's 8 random characters>.part<suffix>; the greedy NAME makes the owner
# field the last one that fits, whatever dots and digits the output's own name holds
_TMP_NAME_RE = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)-(?P<host>[0-9a-f]{6})\.[a-z0-9_]{8}\.part")


def temporary_prefix(final: PathLike) -> str:
    """The start of every temporary name of ``final``: ``.NAME.<pid>-<host>.`` (then mkstemp's
    random part and ``.part`` + the format suffix in lower case)."""
    return f".{Path(final).name}.{os.getpid()}-{_host_tag()}."


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid we can judge: keep the file
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's process
        return True
    return True


# Per folder, the temporaries (name → (pid, host)) found when this process first wrote there:
# one listing per folder and process, so writing n files into one folder stays O(n). A writer
# killed later is cleaned up by the next process that writes there.
_TEMPORARIES: collections.OrderedDict = collections.OrderedDict()
_TEMPORARIES_LOCK = threading.Lock()
_FOLDERS_KEPT = 1024


def _temporaries_in(folder: Path) -> dict:
    key = os.path.abspath(str(folder))
    with _TEMPORARIES_LOCK:
        found = _TEMPORARIES.get(key)
        if found is not None:
            _TEMPORARIES.move_to_end(key)
            return found
    found = {}
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            m = _TMP_NAME_RE.match(entry.name) if ".part" in entry.name else None
            if m is not None:
                found[entry.name] = (int(m.group("pid")), m.group("host"), m.group("name"))
    with _TEMPORARIES_LOCK:
        _TEMPORARIES[key] = found
        while len(_TEMPORARIES) > _FOLDERS_KEPT:
            _TEMPORARIES.popitem(last=False)
    return found


def remove_stale_temporaries(final: PathLike) -> int:
    """Remove the temporaries of ``final`` left by a killed process (``kill -9``, a power cut):
    those named by :func:`atomic_path` with this machine's tag and the pid of a process that is
    no longer alive. Another live process's temporaries, and those of other machines, are kept.
    The folder is listed once per process (see ``_TEMPORARIES``). Returns how many were removed."""
    final = Path(final)
    host = _host_tag()
    found = _temporaries_in(final.parent)
    removed = 0
    for name, (pid, tag, output) in list(found.items()):
        if output != final.name or tag != host or _pid_alive(pid):
            continue
        path = final.parent / name
        with contextlib.suppress(OSError):
            if path.is_symlink() or path.is_file():
                os.unlink(path)
                removed += 1
        with _TEMPORARIES_LOCK:
            found.pop(name, None)
    return removed


def _remove_temporary(tmp_path: Path) -> None:
    """Remove a temporary and any sibling a writer made from its name (``.part.mhd`` + ``.zraw``
    where a writer did not know the suffix): every name starting with it up to ``.part``."""
    with contextlib.suppress(OSError):
        tmp_path.unlink()
    m = _TMP_NAME_RE.match(tmp_path.name)
    if m is None:
        return
    stem = tmp_path.name[: m.end()]
    with contextlib.suppress(OSError):
        for entry in os.scandir(tmp_path.parent):
            if entry.name.startswith(stem) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def check_written(path: PathLike, final: PathLike) -> None:
    """Check a file a writer has just made under a temporary name, before it is renamed to
    ``final``: it exists and is not empty, and a mask or NIfTI (``.nii``, ``.nii.gz``, ``.nrrd``,
    ``.seg.nrrd``, ``.mha``) has a header its reader accepts, a PNG or DICOM file its signature. A writer that silently wrote
    nothing (or elsewhere) is an :class:`OutputError`, never a success."""
    p = Path(path)
    why = None
    try:
        size = os.stat(p).st_size
    except OSError as e:
        raise OutputError(f"cannot write {final}: the writer made no file ({os_reason(e)})") from None
    if size == 0:
        why = "the writer wrote nothing (0 bytes)"
    else:
        suffix = full_suffix(final).lower()
        try:
            if suffix in (".nii", ".nii.gz"):
                import nibabel as nib

                nib.load(str(p)).header  # noqa: B018 - reads the header only (the first bytes of a .gz)
            elif suffix in (".nrrd", ".seg.nrrd", ".mha"):
                import SimpleITK as sitk

                reader = sitk.ImageFileReader()
                reader.SetFileName(str(p))
                reader.ReadImageInformation()
            elif suffix == ".png":
                with open(p, "rb") as f:
                    if f.read(8) != b"\x89PNG\r\n\x1a\n":
                        why = "the file written is not a PNG picture"
            elif suffix == ".dcm":
                with open(p, "rb") as f:
                    if f.read(132)[128:] != b"DICM":
                        why = "the file written is not a DICOM file"
        except Exception as e:  # noqa: BLE001 - whatever the reader raises, the file is not usable
            why = f"the file written cannot be read back ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else 'unreadable'})"
    if why:
        raise OutputError(f"cannot write {final}: {why}; nothing was written under that name")


@contextlib.contextmanager
def atomic_path(path: PathLike, overwrite: bool = False, *,
                verify: Optional[Callable[[Path], None]] = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it into place on success.

    The temporary is ``.NAME.<pid>-<host>.XXXXXXXX.part`` + the format suffix in lower case
    (``m.Nii`` → ``….part.nii``), since writers choose the format from the suffix and do not all
    read upper case. Before the rename the file written is checked (``verify(tmp)``, by default
    :func:`check_written`: not empty, a mask's header readable), so a writer that silently wrote
    nothing is an :class:`OutputError`. Temporaries of ``path`` left by a killed process on this
    machine are removed first (:func:`remove_stale_temporaries`).

    An ``OSError`` while writing (full disk, permission, read-only file system) becomes an
    :class:`OutputError`; the temporary file is removed whatever happens, including on
    KeyboardInterrupt and on SIGTERM (the CLI turns SIGTERM into an exception that unwinds).
    """
    final = check_output(path, overwrite)
    remove_stale_temporaries(final)
    tmp_path: Optional[Path] = None
    try:
        try:
            fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(final), suffix=".part" + full_suffix(final).lower(),
                                       dir=final.parent)
        except OSError as e:
            raise OutputError(f"cannot write {final}: {os_reason(e)}") from None
        tmp_path = Path(tmp)
        os.close(fd)
        try:
            yield tmp_path
        except OSError as e:
            raise OutputError(f"cannot write {final}: {os_reason(e)}") from None
        try:
            (verify or (lambda t: check_written(t, final)))(tmp_path)
        except OSError as e:
            raise OutputError(f"cannot write {final}: {os_reason(e)}") from None
        staging = _STAGING.get()
        if staging is not None:  # one file of a set: renamed with the others (OutputSet.commit)
            staging.add(tmp_path, final, overwrite)
            tmp_path = None
            return
        if final.exists() and not overwrite:  # appeared while we were writing
            raise OutputExistsError(f"{final} already exists; pass --overwrite to replace it")
        try:
            # mkstemp creates 0600 files; give the output the permissions a plain open() would
            os.chmod(tmp_path, 0o666 & ~_umask())
            os.replace(tmp_path, final)
        except OSError as e:
            raise OutputError(f"cannot write {final}: {os_reason(e)}") from None
        tmp_path = None
    finally:
        if tmp_path is not None:
            _remove_temporary(tmp_path)


_STAGING: contextvars.ContextVar = contextvars.ContextVar("medvol_output_set", default=None)


class OutputSet:
    """Files written under temporary names (:func:`atomic_path` inside :func:`output_set`), to be
    renamed into place together (:meth:`commit`) or removed together (:meth:`discard`)."""

    def __init__(self) -> None:
        self.staged: list = []  # (temporary, final, overwrite), in writing order

    def add(self, tmp: Path, final: Path, overwrite: bool) -> None:
        for i, (old_tmp, old_final, _) in enumerate(self.staged):
            if _identity(old_final) == _identity(final):  # written twice: the later one counts
                _remove_temporary(old_tmp)
                del self.staged[i]
                break
        self.staged.append((tmp, final, overwrite))

    def discard(self) -> None:
        for tmp, _, _ in self.staged:
            _remove_temporary(tmp)
        self.staged = []

    def commit(self) -> None:
        """Rename every staged file into place. An existing output is first moved aside under a
        temporary name; if any rename fails (or the process is interrupted), the files already
        placed are removed, the moved-aside ones put back, and the error raised: the folder holds
        the previous set, whole."""
        staged, self.staged = self.staged, []
        placed: list = []  # (final, the previous file's temporary name or None)
        try:
            for _, final, overwrite in staged:
                if os.path.lexists(final) and not overwrite:  # appeared while we were writing
                    raise OutputExistsError(f"{final} already exists; pass --overwrite to replace it")
            for tmp, final, _ in staged:
                try:
                    os.chmod(tmp, 0o666 & ~_umask())
                    aside = None
                    if os.path.lexists(final):
                        fd, name = tempfile.mkstemp(prefix=temporary_prefix(final),
                                                    suffix=".part" + full_suffix(final).lower(), dir=final.parent)
                        os.close(fd)
                        aside = Path(name)
                        try:
                            os.replace(final, aside)
                        except OSError:
                            _remove_temporary(aside)
                            raise
                    placed.append((final, aside))
                    os.replace(tmp, final)
                except OSError as e:
                    raise OutputError(f"cannot write {final}: {os_reason(e)}") from None
        except BaseException:
            for final, aside in reversed(placed):
                with contextlib.suppress(OSError):
                    if aside is not None and os.path.lexists(aside):
                        os.replace(aside, final)
                    elif aside is None:
                        os.unlink(final)
            for tmp, _, _ in staged:
                _remove_temporary(tmp)
            raise
        for _, aside in placed:
            if aside is not None:
                with contextlib.suppress(OSError):
                    os.unlink(aside)


@contextlib.contextmanager
def output_set() -> Iterator[OutputSet]:
    """Inside this block, every file written with :func:`atomic_path` (so every writer of this
    package) stays under its temporary name; when the block ends without an error they are all
    renamed into place (:meth:`OutputSet.commit`), otherwise all removed. A block inside another
    joins the outer set."""
    outer = _STAGING.get()
    if outer is not None:
        yield outer
        return
    files = OutputSet()
    token = _STAGING.set(files)
    try:
        yield files
    except BaseException:
        _STAGING.reset(token)
        files.discard()
        raise
    _STAGING.reset(token)
    files.commit()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: PathLike, text: str, overwrite: bool = False) -> Path:
    """Write ``text`` (UTF-8) atomically; the file is checked to hold exactly the bytes written."""
    data = text.encode("utf-8")

    def verify(tmp: Path) -> None:
        if os.stat(tmp).st_size != len(data):
            raise OutputError(f"cannot write {path}: the file holds {os.stat(tmp).st_size} bytes, "
                              f"{len(data)} were written")

    with atomic_path(path, overwrite, verify=verify) as tmp:
        tmp.write_bytes(data)
    return Path(path)
