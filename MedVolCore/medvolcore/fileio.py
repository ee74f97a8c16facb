"""Atomic output: every file is written under a temporary name in its folder and renamed.

A killed process therefore never leaves a half-written output under the final name, and an
existing output is only replaced when the caller asked for it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator, Union

from .errors import InputError, OutputExistsError

PathLike = Union[str, "os.PathLike[str]"]

# Suffixes that carry the file format (nibabel and SimpleITK choose the writer from them).
_MULTI_SUFFIXES = (".nii.gz", ".anchor.json", ".seg.nrrd")


def full_suffix(path: PathLike) -> str:
    name = Path(path).name.lower()
    for s in _MULTI_SUFFIXES:
        if name.endswith(s):
            return Path(path).name[-len(s):]
    return Path(path).suffix


def check_output(path: PathLike, overwrite: bool = False) -> Path:
    """Refuse an existing output unless ``overwrite``; make sure the folder exists."""
    p = Path(path)
    if p.exists() and not overwrite:
        raise OutputExistsError(f"{p} already exists; pass --overwrite to replace it")
    if p.is_dir():
        raise InputError(f"{p} is a folder, not a file path")
    if not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    return p


@contextlib.contextmanager
def atomic_path(path: PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same suffix); rename it into place on success."""
    final = check_output(path, overwrite)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".part" + full_suffix(final), dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if final.exists() and not overwrite:  # appeared while we were writing
            raise OutputExistsError(f"{final} already exists; pass --overwrite to replace it")
        # mkstemp creates 0600 files; give the output the permissions a plain open() would
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: PathLike, text: str, overwrite: bool = False) -> Path:
    with atomic_path(path, overwrite) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
