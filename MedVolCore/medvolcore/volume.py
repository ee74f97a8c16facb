"""CT volumes and label maps on their source grid.

A :class:`CTVolume` is the array exactly as stored (index order ``i, j, k`` of the file),
its 4×4 voxel→RAS affine in millimetres and its voxel spacing. Reorientation happens only in
:class:`medvolcore.stack.AxialStack`, which is lossless, so anything computed on the stack maps
back to this grid exactly.

NIfTI (``.nii``, ``.nii.gz``) is read with nibabel. NRRD (``.nrrd``, ``.nhdr``), MetaImage
(``.mha``, ``.mhd``) and DICOM series folders need SimpleITK (``pip install
'medvolcore[itk]'``); their LPS geometry is converted to RAS.

Reading is bounded: only regular files and folders are opened (never a device, FIFO or
socket, which could block for ever); every dimension and component a header declares (2-D, 4-D
and vector images alike) is checked against ``max_voxels``, and anything but a 3-D scalar image
refused, before any voxel is decompressed; NIfTI header extensions are never read, and a header
placing the voxels more than ``MAX_NIFTI_EXTENSIONS`` bytes in is refused; a DICOM folder is
refused above ``MAX_DICOM_FILES`` files, when it holds several series, or when its slice
positions are not evenly spaced (a missing or duplicated slice would otherwise be read with an
averaged spacing: silently wrong geometry), and GDCM reads it in a child process whose memory is
capped (:mod:`medvolcore.dicom`); a ``cancel`` event is honoured between slabs (and kills that
child).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Union

import numpy as np

from .errors import CancelledError, DependencyError, LimitError, OutputExistsError, VolumeError
from .fileio import MASK_SUFFIXES, atomic_path, check_output

log = logging.getLogger(__name__)

NIFTI_SUFFIXES = (".nii", ".nii.gz")
ITK_SUFFIXES = (".nrrd", ".nhdr", ".mha", ".mhd")
_LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
MAX_DICOM_FILES = 10000  # a CT series rarely has more than 2000 slices; a bigger folder is a mistake (or a probe)
_SLAB_BYTES = 32 << 20   # NIfTI voxels are read this much at a time, checking for a cancel between slabs
# NIfTI header extensions (free text, DICOM headers, AFNI XML) are a few kB; masks carry none
MAX_NIFTI_EXTENSIONS = 8 << 20
# NIfTI header fields that are free text, where scanners and converters put patient names or ids.
_FREE_TEXT_FIELDS = ("descrip", "aux_file", "intent_name", "db_name")


@dataclass
class CTVolume:
    """A 3-D image on its source grid.

    ``array``: shape ``(I, J, K)`` in file index order; float32 HU for a CT, an integer type
    for a label map. ``affine``: maps homogeneous ``(i, j, k, 1)`` to RAS millimetres (voxel
    centres). ``spacing``: voxel size in mm along ``i, j, k``. ``header``: the nibabel header
    when read from NIfTI (reused when writing masks on the same grid).
    """

    array: np.ndarray
    affine: np.ndarray
    spacing: tuple = field(default=None)
    header: Any = None
    path: Optional[str] = None
    source_format: str = "array"
    notes: list = field(default_factory=list)  # remarks a reader of the result should see (e.g. voxels replaced)
    # a DICOM series: the instances read, their positions and digests (medvolcore.dicomrecord.DicomRecord);
    # a DICOM Segmentation of this volume references exactly these, never a second read of the folder
    dicom: Any = None

    def __post_init__(self):
        self.affine = np.asarray(self.affine, dtype=np.float64)
        if self.affine.shape != (4, 4):
            raise VolumeError(f"affine must be 4×4, got {self.affine.shape}")
        if self.array.ndim != 3:
            raise VolumeError(f"{self.name}: expected a 3-D image, got {self.array.ndim}-D with shape {self.array.shape}")
        if self.spacing is None:
            self.spacing = tuple(float(s) for s in np.linalg.norm(self.affine[:3, :3], axis=0))

    @property
    def shape(self) -> tuple:
        return tuple(self.array.shape)

    @property
    def name(self) -> str:
        return os.path.basename(self.path) if self.path else "volume"

    def same_grid(self, other: "CTVolume", atol: float = 1e-3) -> bool:
        return self.shape == other.shape and np.allclose(self.affine, other.affine, atol=atol)


def _is_nifti(path: Path) -> bool:
    return path.name.lower().endswith(NIFTI_SUFFIXES)


def _require_sitk(what: str):
    try:
        import SimpleITK as sitk  # noqa: N813
    except ImportError:
        raise DependencyError(
            f"reading {what} needs SimpleITK, which is not installed: run "
            "`pip install 'medvolcore[itk]'` (or `pip install SimpleITK`), or convert the file to NIfTI"
        ) from None
    return sitk


def _check_cancel(cancel, path) -> None:
    if cancel is not None and cancel.is_set():
        raise CancelledError(f"reading {Path(path).name} was cancelled")


def _check_voxels(path, shape, max_voxels, components: int = 1) -> None:
    """Refuse a header declaring more than ``max_voxels`` values: every dimension (2-D, 4-D alike)
    times the components per voxel."""
    dims = [int(v) for v in shape] + ([int(components)] if components != 1 else [])
    n = int(np.prod(dims, dtype=object))
    if max_voxels is not None and n > max_voxels:
        what = f" ({int(components)} components per voxel)" if components != 1 else ""
        raise LimitError(f"{Path(path).name} declares {'×'.join(str(v) for v in dims)} = {n:,} voxels{what}, over the "
                         f"limit of {int(max_voxels):,} (--max-voxels); refused before reading it")


def _check_3d_scalar(path, shape, components: int = 1) -> None:
    """Refuse anything but one number per voxel on a 3-D grid, from the header."""
    if len(shape) != 3 or components != 1:
        what = f"a {len(shape)}-D image of {'×'.join(str(int(v)) for v in shape)} voxels"
        if components != 1:
            what += f" with {int(components)} components per voxel (a colour or vector image)"
        raise VolumeError(f"{path}: not a 3-D scalar CT: the header declares {what}")


def _nifti_header(path: Path):
    """The NIfTI-1 or -2 header of ``path`` without its extensions (nibabel would read every byte
    before ``vox_offset`` into memory: a bomb in a few kB of ``.nii.gz``), and the image class."""
    import nibabel as nib
    from nibabel.openers import ImageOpener

    with ImageOpener(str(path)) as f:
        raw = f.read(nib.Nifti2Header.sizeof_hdr)
    for klass in (nib.Nifti1Image, nib.Nifti2Image):
        hclass = klass.header_class
        if hclass.may_contain_header(raw):
            return klass, hclass(raw[:hclass.sizeof_hdr], check=True)
    raise VolumeError(f"cannot read {path} as NIfTI: no NIfTI-1 or NIfTI-2 header")


def _read_nifti(path: Path, max_voxels=None, cancel=None, dtype=None):
    """Header first (without extensions; every dimension and component checked against
    ``max_voxels``, the header region against ``MAX_NIFTI_EXTENSIONS``, anything but a 3-D scalar
    image refused, all before any voxel is decompressed), then the voxels in slabs along the
    third axis, checking ``cancel`` between slabs. The header returned has no extensions."""
    try:
        klass, header = _nifti_header(path)
        full = tuple(int(v) for v in header.get_data_shape())
        stored = header.get_data_dtype()
        offset = int(header.get_data_offset())
    except VolumeError:
        raise
    except Exception as exc:  # nibabel raises many types for corrupt files
        raise VolumeError(f"cannot read {path} as NIfTI: {exc}") from None
    components = len(stored.names) if stored.names else 1  # RGB(A) voxels
    _check_voxels(path, full, max_voxels, components)
    extensions = offset - header.single_vox_offset
    if extensions > MAX_NIFTI_EXTENSIONS:
        raise LimitError(f"{path.name}: its header places the voxels {offset:,} bytes into the file, after "
                         f"{extensions / (1 << 20):,.1f} MB of header extensions (at most {MAX_NIFTI_EXTENSIONS >> 20} MB); "
                         "refused before reading it")
    shape = full
    while len(shape) > 3 and shape[-1] == 1:  # (I, J, K, 1): one volume of a series
        shape = shape[:-1]
    _check_3d_scalar(path, shape, components)
    if not (np.issubdtype(stored, np.integer) or np.issubdtype(stored, np.floating) or stored == bool):
        raise VolumeError(f"{path}: voxels are {stored}, not numbers")
    rest = (0,) * (len(full) - 3)
    proxy = None
    try:
        proxy = klass.ImageArrayProxy(str(path), header.copy(), mmap=True, keep_file_open=True)
        if min(shape) < 1:
            data = np.asanyarray(proxy).reshape(shape)
        else:
            step = max(1, _SLAB_BYTES // max(1, shape[0] * shape[1] * stored.itemsize))
            data = None
            for k in range(0, shape[2], step):
                _check_cancel(cancel, path)
                slab = np.asanyarray(proxy[(slice(None), slice(None), slice(k, k + step)) + rest])
                if data is None:
                    data = np.empty(shape, dtype=dtype or slab.dtype)
                data[:, :, k:k + step] = slab
    except (CancelledError, MemoryError):
        raise
    except Exception as exc:
        raise VolumeError(f"cannot read {path} as NIfTI: {exc}") from None
    finally:
        _close_nifti(proxy)
    return data, np.asarray(header.get_best_affine(), dtype=np.float64), header


def _close_nifti(proxy) -> None:
    """Close the file nibabel keeps open for ``keep_file_open=True`` (not needed once read)."""
    opener = getattr(proxy, "_opener", None)
    if opener is not None:
        try:
            opener.close_if_mine()
        except Exception:  # noqa: BLE001 - best effort
            pass


def _dicom_files(path: Path) -> None:
    """Refuse a folder with more than MAX_DICOM_FILES entries before anything reads it."""
    n = 0
    with os.scandir(path) as it:
        for _ in it:
            n += 1
            if n > MAX_DICOM_FILES:
                raise LimitError(f"{path} holds more than {MAX_DICOM_FILES} files; a DICOM series folder should hold "
                                 "one series (give the folder of that series)")


def _read_itk(path: Path, max_voxels=None, cancel=None):
    """A DICOM series folder (through :mod:`medvolcore.dicom`, in a child process of bounded memory)
    or an NRRD/MetaImage file: every dimension and component the header declares is checked
    against ``max_voxels``, and anything but a 3-D scalar image refused, before a voxel is read."""
    sitk = _require_sitk("DICOM" if path.is_dir() else path.suffix.upper().lstrip(".") + " files")
    if path.is_dir():
        try:
            import pydicom  # noqa: F401 - every slice's header is checked with it (medvolcore.dicomrecord)
        except ImportError:
            raise DependencyError("reading a DICOM folder needs pydicom, which is not installed: run "
                                  "`pip install 'medvolcore[itk]'` (or `pip install pydicom`)") from None
        from .dicom import read_series

        _dicom_files(path)
        series = read_series(path, lambda size, components: _check_voxels(path, size, max_voxels, components), cancel)
        array, spacing, origin, direction = series.array, series.spacing, series.origin, series.direction
        if series.record is not None and series.record.tilt is not None:  # gantry tilt: onto an orthogonal grid
            from .dicomrecord import orthogonal_grid

            array, spacing, origin, direction = orthogonal_grid(array, series.record, spacing, origin, direction)
        data = array.transpose(2, 1, 0)  # (k, j, i) -> (i, j, k)
        # for a DICOM folder the "header" is the record of the instances read (dicomrecord.DicomRecord)
        return data, _lps_to_ras(spacing, origin, direction), series.record
    try:
        reader = sitk.ImageFileReader()
        # the reader of the suffix, whatever its case (ITK matches ".mha" only in lower case) and
        # never another one ITK would pick from the content
        reader.SetImageIO(_ITK_IO[path.suffix.lower()])
        reader.SetFileName(str(path))
        reader.ReadImageInformation()
        size, components = reader.GetSize(), reader.GetNumberOfComponents()
        _check_voxels(path, size, max_voxels, components)
        _check_3d_scalar(path, size, components)
        _check_cancel(cancel, path)
        image = reader.Execute()
    except (VolumeError, LimitError, CancelledError):
        raise
    except Exception as exc:
        raise VolumeError(f"cannot read {path}: {str(exc).strip().splitlines()[-1]}") from None
    _check_3d_scalar(path, image.GetSize(), image.GetNumberOfComponentsPerPixel())
    data = sitk.GetArrayFromImage(image).transpose(2, 1, 0)  # (k, j, i) -> (i, j, k)
    return data, _lps_to_ras(image.GetSpacing(), image.GetOrigin(), image.GetDirection()), None


_ITK_IO = {".nrrd": "NrrdImageIO", ".nhdr": "NrrdImageIO", ".mha": "MetaImageIO", ".mhd": "MetaImageIO"}


def _lps_to_ras(spacing, origin, direction) -> np.ndarray:
    lps = np.eye(4)
    lps[:3, :3] = np.array(direction, dtype=np.float64).reshape(3, 3) @ np.diag(spacing)
    lps[:3, 3] = origin
    return _LPS_TO_RAS @ lps


def _read_any(path, max_voxels=None, cancel=None, dtype=None) -> tuple:
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise VolumeError(f"{p} does not exist") from None
    except OSError as e:
        raise VolumeError(f"{p} cannot be read: {e.strerror or e}") from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise VolumeError(f"{p} is not a regular file or folder (a device, FIFO or socket); give a CT file or a DICOM folder")
    if stat.S_ISDIR(st.st_mode):
        data, affine, header = _read_itk(p, max_voxels, cancel)
        fmt = "dicom"
    elif _is_nifti(p):
        data, affine, header = _read_nifti(p, max_voxels, cancel, dtype)
        fmt = "nifti"
    elif p.name.lower().endswith(ITK_SUFFIXES):
        data, affine, header = _read_itk(p, max_voxels, cancel)
        fmt = p.suffix.lower().lstrip(".")
    else:
        raise VolumeError(
            f"{p}: unsupported file type; use NIfTI (.nii, .nii.gz), NRRD (.nrrd), MetaImage (.mha) or a DICOM folder"
        )
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise VolumeError(f"{p}: expected a 3-D image, got {data.ndim}-D with shape {tuple(data.shape)}")
    if min(data.shape) < 1:
        raise VolumeError(f"{p}: image is empty (shape {tuple(data.shape)})")
    if not (np.issubdtype(data.dtype, np.integer) or np.issubdtype(data.dtype, np.floating) or data.dtype == bool):
        raise VolumeError(f"{p}: voxels are {data.dtype}, not numbers")
    if not np.all(np.isfinite(affine)) or abs(np.linalg.det(affine[:3, :3])) < 1e-12:
        raise VolumeError(f"{p}: the voxel-to-world matrix is singular or not finite")
    return data, affine, header, fmt


def read_grid(path) -> Optional[tuple]:
    """``(shape, affine)`` of a volume or label map from its header alone (no voxel read), its files
    checked first as by :func:`load_volume`; None for a DICOM folder, whose geometry only a scan of
    every slice gives (it is checked when the case is read). :class:`VolumeError` when the header
    cannot be read or does not describe a 3-D scalar image."""
    from .sources import volume_sources

    p = Path(path)
    src = volume_sources(p)
    if src.kind == "dicom":
        return None
    if _is_nifti(p):
        try:
            _klass, header = _nifti_header(p)
            shape = tuple(int(v) for v in header.get_data_shape())
            affine = np.asarray(header.get_best_affine(), dtype=np.float64)
        except VolumeError:
            raise
        except Exception as exc:  # nibabel raises many types for corrupt files
            raise VolumeError(f"cannot read {p} as NIfTI: {exc}") from None
        while len(shape) > 3 and shape[-1] == 1:
            shape = shape[:-1]
        _check_3d_scalar(p, shape)
    elif p.name.lower().endswith(ITK_SUFFIXES):
        sitk = _require_sitk(p.suffix.upper().lstrip(".") + " files")
        try:
            reader = sitk.ImageFileReader()
            reader.SetImageIO(_ITK_IO[p.suffix.lower()])
            reader.SetFileName(str(p))
            reader.ReadImageInformation()
        except Exception as exc:  # noqa: BLE001 - SimpleITK raises RuntimeError subclasses
            raise VolumeError(f"cannot read {p}: {str(exc).strip().splitlines()[-1]}") from None
        shape = tuple(int(v) for v in reader.GetSize())
        _check_3d_scalar(p, shape, reader.GetNumberOfComponents())
        affine = _lps_to_ras(reader.GetSpacing(), reader.GetOrigin(), reader.GetDirection())
    else:
        raise VolumeError(f"{p}: unsupported file type; use NIfTI (.nii, .nii.gz), NRRD (.nrrd), MetaImage (.mha) "
                          "or a DICOM folder")
    if min(shape) < 1:
        raise VolumeError(f"{p}: image is empty (shape {shape})")
    if not np.all(np.isfinite(affine)) or abs(np.linalg.det(affine[:3, :3])) < 1e-12:
        raise VolumeError(f"{p}: the voxel-to-world matrix is singular or not finite")
    return shape, affine


AIR_HU = -500.0  # CT shows air (about -1000 HU) around and inside a body: a CT has voxels below this
LABEL_LIKE_VALUES = 256  # at most this many distinct whole values, none negative: a label map, not a CT


def ct_plausibility(array: np.ndarray, name: str = "the volume") -> List[str]:
    """Warnings for a volume whose intensities do not look like CT in Hounsfield units (empty when
    they do): no voxel below :data:`AIR_HU` (no air: MR, a label map, CT without its rescale), or
    only a few distinct whole values, none negative (a label map). A volume that is all air (no
    voxel above :data:`AIR_HU`) is refused (:class:`~medvolcore.errors.VolumeError`): there is
    nothing to segment. One pass over the voxels for the range, a strided sample of at most about
    two million for the distinct values."""
    a = np.asarray(array)
    finite = a[np.isfinite(a)] if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all() else a
    if finite.size == 0 or float(finite.max()) <= AIR_HU:
        top = "no finite voxel" if finite.size == 0 else f"its highest value is {float(finite.max()):g} HU"
        raise VolumeError(f"{name} is all air ({top}; nothing above {AIR_HU:g} HU): there is nothing to segment; "
                          "is it the right file?")
    lo, hi = float(finite.min()), float(finite.max())
    reasons = []
    if lo > AIR_HU:
        reasons.append(f"no voxel below {AIR_HU:g} HU (values {lo:g} to {hi:g}: no air"
                       + (", the range of MR or of CT stored without its rescale" if lo >= 0 else "") + ")")
    step = max(1, int(np.ceil((a.size / 2_000_000) ** (1 / 3))))
    sample = a[::step, ::step, ::step] if a.ndim == 3 else a
    sample = sample[np.isfinite(sample)] if np.issubdtype(sample.dtype, np.floating) else sample
    if lo >= 0 and np.array_equal(sample, np.round(sample)):
        n = len(np.unique(sample))
        if n <= LABEL_LIKE_VALUES:
            reasons.append(f"only {n} distinct whole values (a label map?)")
    if not reasons:
        return []
    return [f"{name} does not look like CT in Hounsfield units: {'; '.join(reasons)}. The models expect CT; "
            "the result is unreliable"]


def load_volume(path, *, max_voxels: Optional[int] = None, cancel=None) -> CTVolume:
    """Read a CT (values in HU) as float32 on its source grid.

    ``max_voxels``: refuse (:class:`LimitError`) a volume declaring more voxels, before reading
    them. ``cancel``: a ``threading.Event``; reading stops with :class:`CancelledError` when set.
    Non-finite voxels are set to the lowest finite value, and ``notes`` says so. Every file the
    reader would open (a detached header's data files, a DICOM folder's files) is checked first
    (:func:`medvolcore.sources.volume_sources`): a missing one, a FIFO, device or socket is
    refused before anything is read.
    """
    from .sources import volume_sources

    volume_sources(path)
    data, affine, header, fmt = _read_any(path, max_voxels, cancel, dtype=np.float32)
    record, header = (header, None) if fmt == "dicom" else (None, header)
    hu = np.asarray(data, dtype=np.float32)
    del data
    notes = list(record.notes) if record is not None else []
    # one slab of the last axis at a time: a whole-volume boolean mask would cost a byte per voxel
    step = max(1, (_SLAB_BYTES // 4) // max(1, hu.shape[0] * hu.shape[1]))
    slabs = [(slice(None), slice(None), slice(k, k + step)) for k in range(0, hu.shape[2], step)]
    bad = sum(int(hu[s].size - np.count_nonzero(np.isfinite(hu[s]))) for s in slabs)
    if bad == hu.size:
        raise VolumeError(f"{Path(path).name}: every voxel is NaN or infinite")
    if bad:
        fill = min(float(hu[s][np.isfinite(hu[s])].min(initial=np.inf)) for s in slabs)
        notes.append(f"the volume had {bad} NaN or infinite voxel(s); they were set to {fill:.0f} HU, the lowest value")
        log.warning("%s: %d non-finite voxels set to %.0f HU", path, bad, fill)
        for s in slabs:
            np.copyto(hu[s], np.float32(fill), where=~np.isfinite(hu[s]))
    return CTVolume(hu, affine, header=header, path=str(path), source_format=fmt, notes=notes, dicom=record)


def load_label_map(path, *, max_voxels: Optional[int] = None, cancel=None) -> CTVolume:
    """Read a label map (integer ids, 0 = background) on its source grid (its files checked
    first, as by :func:`load_volume`)."""
    from .sources import volume_sources

    volume_sources(path)
    data, affine, header, fmt = _read_any(path, max_voxels, cancel)
    header = None if fmt == "dicom" else header
    if data.dtype.kind == "f":
        if not np.all(np.isfinite(data)):
            raise VolumeError(f"{path}: label map contains NaN or infinite values")
        if not np.array_equal(data, np.round(data)):
            raise VolumeError(f"{path}: label map has non-integer values; is it an image rather than labels?")
        data = data.astype(np.int32)
    elif data.dtype == bool:
        data = data.astype(np.uint8)
    else:
        data = np.asarray(data)
    if data.min() < 0:
        raise VolumeError(f"{path}: label map has negative values")
    return CTVolume(data, affine, header=header, path=str(path), source_format=fmt)


def label_mask(labels: CTVolume, label: Optional[Union[int, list]] = None) -> np.ndarray:
    """Boolean mask of ``label`` (an id or a list of ids), or of every non-zero voxel when None."""
    arr = labels.array
    if label is None:
        m = arr != 0
        if not m.any():
            raise VolumeError(f"{labels.name}: the label map is empty (no non-zero voxel)")
        return m
    ids = [int(v) for v in (label if isinstance(label, (list, tuple)) else [label])]
    m = np.isin(arr, ids)
    if not m.any():
        present = np.unique(arr)
        present = present[present != 0]
        shown = ", ".join(str(int(v)) for v in present[:20]) + (" …" if present.size > 20 else "")
        raise VolumeError(f"label {ids[0] if len(ids) == 1 else ids} is absent from {labels.name} (labels present: {shown or 'none'})")
    return m


def save_mask(mask: np.ndarray, like: CTVolume, path, overwrite: bool = False, segments=None) -> Path:
    """Write a binary or label mask on ``like``'s grid (same shape, affine; NIfTI header reused).

    The output format follows the suffix: NIfTI by default, NRRD/MetaImage through SimpleITK.
    Written atomically.
    """
    mask = np.asarray(mask)
    if mask.shape != like.shape:
        raise VolumeError(f"mask shape {mask.shape} does not match the volume grid {like.shape}")
    out = Path(path)
    check_output(out, overwrite, suffixes=MASK_SUFFIXES, what="mask")
    data = mask.astype(np.uint8) if mask.max(initial=0) <= 255 else mask.astype(np.uint16)
    name = out.name.lower()
    if name.endswith(NIFTI_SUFFIXES):
        import nibabel as nib

        header = like.header.copy() if like.header is not None and hasattr(like.header, "set_data_dtype") else None
        img = nib.Nifti1Image(data, like.affine, header=header)
        _clear_free_text(img.header)
        img.set_data_dtype(data.dtype)
        img.header.set_slope_inter(1.0, 0.0)
        img.header["cal_min"], img.header["cal_max"] = 0, float(data.max(initial=0))
        img.header.set_intent("label")
        with atomic_path(out, overwrite) as tmp:
            nib.save(img, str(tmp))
    elif name.endswith((".nrrd", ".mha")):  # single-file formats only: a rename must move everything
        sitk = _require_sitk("writing " + out.suffix)
        image = sitk.GetImageFromArray(data.transpose(2, 1, 0))
        lps = np.linalg.inv(_LPS_TO_RAS) @ like.affine
        spacing = np.linalg.norm(lps[:3, :3], axis=0)
        image.SetSpacing(tuple(float(s) for s in spacing))
        image.SetDirection(tuple(float(v) for v in (lps[:3, :3] / spacing).ravel()))
        image.SetOrigin(tuple(float(v) for v in lps[:3, 3]))
        if name.endswith(".seg.nrrd"):
            for key, value in segmentation_metadata(data, segments).items():
                image.SetMetaData(key, value)
        with atomic_path(out, overwrite) as tmp:
            sitk.WriteImage(image, str(tmp), True)
    return out


def segmentation_metadata(labels: np.ndarray, segments=None) -> dict:
    """The header keys that make a label-map NRRD a Slicer segmentation (``.seg.nrrd``), as Slicer's
    ``vtkMRMLSegmentationStorageNode`` reads them: one segment per entry of ``segments`` (each a
    dict with ``name``, ``value`` — its label value — and optionally ``term``, a
    :class:`medvolcore.terminology.Term`, for its colour and terminology entry). Without
    ``segments``: one per label value present, named "Segment_<value>". Extents are in the file's
    voxel indices (``labels`` in x, y, z order)."""
    from .terminology import generic

    if segments is None:
        segments = [{"name": f"Segment_{v}", "value": int(v)} for v in np.unique(labels) if v]
    meta = {"Segmentation_MasterRepresentation": "Binary labelmap",
            "Segmentation_ContainedRepresentationNames": "Binary labelmap|",
            "Segmentation_ReferenceImageExtentOffset": "0 0 0"}
    for i, seg in enumerate(segments):
        value = int(seg["value"])
        term = seg.get("term") or generic(i + 1)
        idx = np.nonzero(labels == value)
        extent = " ".join(f"{int(a.min())} {int(a.max())}" for a in idx) if idx[0].size else "0 -1 0 -1 0 -1"
        name = " ".join(str(seg["name"]).split())  # one header line: no line breaks
        key = f"Segment{i}_"
        meta.update({key + "ID": f"Segment_{i + 1}", key + "Name": name, key + "NameAutoGenerated": "0",
                     key + "Color": " ".join(f"{c / 255:.6g}" for c in term.color), key + "ColorAutoGenerated": "0",
                     key + "LabelValue": str(value), key + "Layer": "0", key + "Extent": extent,
                     key + "Tags": f"TerminologyEntry:{term.slicer_terminology()}|"})
    return meta


def _clear_free_text(header) -> None:
    """Blank the header's free-text fields and drop its extensions (they may carry patient
    names or ids copied from the source scan); the geometry fields are kept."""
    for name in _FREE_TEXT_FIELDS:
        if name in header:
            header[name] = b""
    if hasattr(header, "extensions"):
        del header.extensions[:]


__all__ = ["CTVolume", "load_volume", "load_label_map", "read_grid", "label_mask", "save_mask", "segmentation_metadata",
           "OutputExistsError"]
