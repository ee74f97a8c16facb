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

The package's modules, one concern each: :mod:`~medvolcore.sources.headers` (which data files a
header names), :mod:`~medvolcore.sources.files` (the files of a volume path),
:mod:`~medvolcore.sources.fingerprints` (content keys), :mod:`~medvolcore.sources.private`
(``--data-dir`` copies, uploads) and :mod:`~medvolcore.sources.hashed` (copies with the caller's
own rights).
"""

# every name importable from ``medvolcore.sources`` before it was a package still is (the suffixes,
# HEADER_PEEK, client_parts and _no_space are used by other modules but not in ``__all__``)
from .files import VolumeSources, volume_sources
from .fingerprints import HashMemo, known_sha256, sources_sha256
from .hashed import hashed_copy
from .headers import ITK_SUFFIXES, MAX_SOURCE_FILES, NIFTI_SUFFIXES, declared_data_files  # noqa: F401
from .private import (COPY_SECONDS, HEADER_PEEK, CopyLimits, PrivateCopy, _no_space, check_header,  # noqa: F401
                      check_series_folder, client_parts, private_copy, store_bytes)

__all__ = ["COPY_SECONDS", "MAX_SOURCE_FILES", "CopyLimits", "HashMemo", "check_header", "check_series_folder", "PrivateCopy", "VolumeSources", "declared_data_files", "hashed_copy",
           "known_sha256", "private_copy", "sources_sha256", "store_bytes", "volume_sources"]
