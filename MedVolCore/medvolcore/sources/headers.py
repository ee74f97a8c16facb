"""Which data files a detached header names (the NRRD ``data file`` field, the MetaImage
``ElementDataFile`` field), read from the header's text alone: no image library, nothing heavy.

:func:`declared_data_files` is what :func:`~medvolcore.sources.volume_sources` and the private
copies build on; nothing a header names is looked up here.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

from ..errors import LimitError, VolumeError

# The same bound as ``volume.MAX_DICOM_FILES`` (tested): a CT series rarely has more than 2000
# slices, and a header naming more data files than this is a mistake or a probe.
MAX_SOURCE_FILES = 10000
NIFTI_SUFFIXES = (".nii", ".nii.gz")
ITK_SUFFIXES = (".nrrd", ".nhdr", ".mha", ".mhd")
_HEADER_MAX_BYTES = 4 << 20   # a NRRD/MetaImage header is a few hundred bytes; a LIST of 10,000 names some 300 KB
_HEADER_MAX_LINE = 1 << 16


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
