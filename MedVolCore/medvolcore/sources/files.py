"""The files a volume path makes the reader read (the command line, and the worker over stdio: the
caller's own rights): the header and every data file it names, or a DICOM folder's files, each
checked to be there and a regular file before anything is read.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from ..errors import LimitError, VolumeError
from .headers import ITK_SUFFIXES, MAX_SOURCE_FILES, NIFTI_SUFFIXES, declared_data_files


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
