"""A volume uploaded as an HTTP request body, streamed to a private file (``docs/security.md``).

The voxel limit (``--max-voxels``) is the guard for uploads, not the request-size limit: the body's
NIfTI header is read from its first bytes (a gzip body, ``.nii.gz``, is decompressed only as far as
the header, so a decompression bomb costs nothing) and a volume declaring more voxels than the
limit, or header extensions over :data:`~medvolcore.volume.MAX_NIFTI_EXTENSIONS`, is refused
before the rest of the body is read. The header also bounds the body's size: the voxels it
declares, plus the header, plus 1 % and 1 MB for gzip's framing (:func:`body_bound`), so a client
cannot send more than its volume needs. The body is then copied to a private file in the worker's
temporary folder in 1 MB chunks while hashed, never held in memory; the worker reads that file
and the transport removes it once the request has its reply.

:func:`upload_ceiling` is the bound checked on ``Content-Length`` before anything is read:
``max_voxels × 8`` bytes (the widest voxel the reader takes, float64 or int64) plus the largest
header region.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..errors import LimitError, VolumeError
from .limits import limit

__all__ = ["Upload", "HeaderInfo", "BodyWriter", "store_body", "check_space", "upload_ceiling", "body_bound", "read_header", "HEADER_PREFIX_MAX",
           "CHUNK", "WHAT"]

WHAT = "uploaded volume"
CHUNK = 1 << 20
# a gzip member may carry a name, comment and extra field before its data: look this far for the header
HEADER_PREFIX_MAX = 1 << 20
_SLACK = 1 << 20
_FREE_MARGIN = int(limit("tmp_free").default)  # left free on the temporary folder's disk after an upload


def upload_ceiling(max_voxels: Optional[int]) -> Optional[int]:
    """The largest volume body accepted for ``max_voxels`` (None: no ceiling)."""
    from ..volume import MAX_NIFTI_EXTENSIONS

    if max_voxels is None:
        return None
    return int(max_voxels) * 8 + MAX_NIFTI_EXTENSIONS + 544 + _SLACK


@dataclass
class HeaderInfo:
    """What a body's NIfTI header declares: ``shape`` (every dimension), ``voxel_bytes`` (bytes
    per voxel, all components), ``offset`` (where the voxels start), ``gzip``."""

    shape: tuple
    voxel_bytes: int
    offset: int
    gzip: bool

    @property
    def raw_bytes(self) -> int:
        """The size of the uncompressed NIfTI file the header describes."""
        return self.offset + int(np.prod(self.shape, dtype=object)) * self.voxel_bytes


def body_bound(info: HeaderInfo) -> int:
    """The most bytes a body with this header may have: its uncompressed size, plus for gzip 1 %
    (deflate's stored blocks add about 0.01 %) and 1 MB for the gzip member's own header."""
    raw = info.raw_bytes
    return raw + (raw // 100 if info.gzip else 0) + _SLACK


def read_header(prefix: bytes, complete: bool, max_voxels: Optional[int]) -> Optional[HeaderInfo]:
    """The NIfTI-1/-2 header at the start of ``prefix`` (the first bytes of a body; ``complete``:
    the whole body). None when more bytes are needed. Raises :class:`VolumeError` for a body that
    is not NIfTI, :class:`LimitError` for one over ``max_voxels`` or with too large a header region
    (the same checks and wording as :func:`medvolcore.volume.load_volume`)."""
    import nibabel as nib

    from ..volume import MAX_NIFTI_EXTENSIONS, _check_voxels

    is_gzip = prefix[:2] == b"\x1f\x8b"
    want = nib.Nifti2Header.sizeof_hdr
    if is_gzip:
        try:
            raw = zlib.decompressobj(31).decompress(prefix, want)  # the header only, whatever follows
        except zlib.error as e:
            raise VolumeError(f"the {WHAT} is not a readable gzip stream ({e})") from None
    else:
        raw = prefix[:want]
    if len(raw) < want and not complete and len(prefix) < HEADER_PREFIX_MAX:
        return None
    for klass in (nib.Nifti1Image, nib.Nifti2Image):
        hclass = klass.header_class
        if len(raw) >= hclass.sizeof_hdr and hclass.may_contain_header(raw):
            try:
                header = hclass(raw[:hclass.sizeof_hdr], check=True)
                shape = tuple(int(v) for v in header.get_data_shape())
                stored = header.get_data_dtype()
                offset = int(header.get_data_offset())
            except Exception as exc:  # noqa: BLE001 - nibabel raises many types for a corrupt header
                raise VolumeError(f"cannot read the {WHAT} as NIfTI: {exc}") from None
            components = len(stored.names) if stored.names else 1
            _check_voxels(WHAT, shape, max_voxels, components)
            extensions = offset - header.single_vox_offset
            if extensions > MAX_NIFTI_EXTENSIONS:
                raise LimitError(f"the {WHAT}'s header places the voxels {offset:,} bytes into the file, after "
                                 f"{extensions / (1 << 20):,.1f} MB of header extensions (at most "
                                 f"{MAX_NIFTI_EXTENSIONS >> 20} MB); refused before reading it")
            return HeaderInfo(shape, int(stored.itemsize), max(offset, hclass.sizeof_hdr), is_gzip)
    if len(prefix) >= HEADER_PREFIX_MAX and len(raw) < want:
        raise VolumeError(f"no NIfTI header in the first {HEADER_PREFIX_MAX >> 20} MB of the {WHAT}")
    raise VolumeError(f"the {WHAT} is not NIfTI (.nii or .nii.gz): no NIfTI-1 or NIfTI-2 header")


@dataclass
class Upload:
    """A body stored in a private file: ``path`` (suffix ``.nii`` or ``.nii.gz`` as its bytes say),
    ``sha256`` of its bytes (the volume cache's key), ``size`` in bytes, ``info`` its header."""

    path: Path
    sha256: str
    size: int
    info: HeaderInfo

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


def check_space(folder, n: int) -> None:
    """Refuse (:class:`LimitError`) a body of ``n`` bytes that would leave the temporary folder's
    disk with less than 64 MB free."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if n + _FREE_MARGIN > free:
        raise LimitError(f"the server has no space left for the {WHAT} ({n:,} bytes, {free:,} free); try again "
                         "later or send a smaller volume")


class BodyWriter:
    """A body being written to a new private file in ``folder`` while hashed: :meth:`write` each
    chunk as it arrives, then :meth:`finish` (the :class:`Upload`) or :meth:`discard` (the file is
    removed). A full disk raises :class:`LimitError` and leaves no file."""

    def __init__(self, prefix: bytes, info: HeaderInfo, folder):
        self.info = info
        self.size = 0
        self._digest = hashlib.sha256()
        fd, self._name = tempfile.mkstemp(prefix="upload-", suffix=".nii.gz" if info.gzip else ".nii", dir=folder)
        self._file = os.fdopen(fd, "wb")
        self.write(prefix)

    def write(self, chunk: bytes) -> None:
        try:
            self._file.write(chunk)
        except OSError as e:
            self._failed(e)
        self._digest.update(chunk)
        self.size += len(chunk)

    def finish(self) -> Upload:
        try:
            self._file.close()
        except OSError as e:
            self._failed(e)
        return Upload(Path(self._name), self._digest.hexdigest(), self.size, self.info)

    def _failed(self, e: OSError) -> None:
        """The body could not be written: nothing is kept, and a full disk is one clear error."""
        from ..sources import _no_space

        self.discard()
        err = _no_space(e, f"the {WHAT}")
        if err is None:
            raise e
        raise err from None

    def discard(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        try:
            os.unlink(self._name)
        except OSError:
            pass


def store_body(prefix: bytes, read: Callable[[int], bytes], n: int, info: HeaderInfo, folder) -> Optional[Upload]:
    """Write a body of ``n`` bytes, whose first bytes are ``prefix`` and whose rest ``read(k)``
    returns in chunks, to a new private file in ``folder``, hashing it (:class:`BodyWriter`). None
    when the client stopped sending before ``n`` bytes (the file is removed)."""
    writer = BodyWriter(prefix, info, folder)
    try:
        left = n - len(prefix)
        while left > 0:
            chunk = read(min(CHUNK, left))
            if not chunk:
                writer.discard()
                return None
            writer.write(chunk)
            left -= len(chunk)
    except BaseException:
        writer.discard()
        raise
    return writer.finish()
