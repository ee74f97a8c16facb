"""CT volumes and label maps on their source grid.

A :class:`CTVolume` is the array exactly as stored (index order ``i, j, k`` of the file),
its 4×4 voxel→RAS affine in millimetres and its voxel spacing. Reorientation happens only in
:class:`medvolcore.stack.AxialStack`, which is lossless, so anything computed on the stack maps
back to this grid exactly.

NIfTI (``.nii``, ``.nii.gz``) is read with nibabel. NRRD (``.nrrd``, ``.nhdr``), MetaImage
(``.mha``, ``.mhd``) and DICOM series folders need SimpleITK (``pip install
'medvolcore[itk]'``); their LPS geometry is converted to RAS.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from .errors import DependencyError, OutputExistsError, VolumeError
from .fileio import atomic_path, check_output

log = logging.getLogger(__name__)

NIFTI_SUFFIXES = (".nii", ".nii.gz")
ITK_SUFFIXES = (".nrrd", ".nhdr", ".mha", ".mhd")
_LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])


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


def _read_nifti(path: Path):
    import nibabel as nib

    try:
        img = nib.load(str(path))
        data = np.asanyarray(img.dataobj)
    except Exception as exc:  # nibabel raises many types for corrupt files
        raise VolumeError(f"cannot read {path} as NIfTI: {exc}") from None
    return data, np.asarray(img.affine, dtype=np.float64), img.header


def _read_itk(path: Path):
    sitk = _require_sitk("DICOM" if path.is_dir() else path.suffix.upper().lstrip(".") + " files")
    try:
        if path.is_dir():
            reader = sitk.ImageSeriesReader()
            series = reader.GetGDCMSeriesIDs(str(path))
            if not series:
                raise VolumeError(f"{path} is a folder without a DICOM series")
            if len(series) > 1:
                log.warning("%s holds %d DICOM series; reading the first (%s)", path, len(series), series[0])
            reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(path), series[0]))
            image = reader.Execute()
        else:
            image = sitk.ReadImage(str(path))
    except VolumeError:
        raise
    except Exception as exc:
        raise VolumeError(f"cannot read {path}: {str(exc).strip().splitlines()[-1]}") from None
    if image.GetNumberOfComponentsPerPixel() != 1:
        raise VolumeError(f"{path}: expected a scalar image, got {image.GetNumberOfComponentsPerPixel()} components per voxel")
    if image.GetDimension() != 3:
        raise VolumeError(f"{path}: expected a 3-D image, got {image.GetDimension()}-D")
    data = sitk.GetArrayFromImage(image).transpose(2, 1, 0)  # (k, j, i) -> (i, j, k)
    direction = np.array(image.GetDirection(), dtype=np.float64).reshape(3, 3)
    lps = np.eye(4)
    lps[:3, :3] = direction @ np.diag(image.GetSpacing())
    lps[:3, 3] = image.GetOrigin()
    return data, _LPS_TO_RAS @ lps, None


def _read_any(path) -> tuple:
    p = Path(path)
    if not p.exists():
        raise VolumeError(f"{p} does not exist")
    if p.is_dir():
        data, affine, header = _read_itk(p)
        fmt = "dicom"
    elif _is_nifti(p):
        data, affine, header = _read_nifti(p)
        fmt = "nifti"
    elif p.name.lower().endswith(ITK_SUFFIXES):
        data, affine, header = _read_itk(p)
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


def load_volume(path) -> CTVolume:
    """Read a CT (values in HU) as float32 on its source grid."""
    data, affine, header, fmt = _read_any(path)
    hu = np.asarray(data, dtype=np.float32)
    if hu.dtype.kind == "f":
        finite = np.isfinite(hu)
        if not finite.any():
            raise VolumeError(f"{path}: every voxel is NaN or infinite")
        if not finite.all():
            fill = float(hu[finite].min())
            log.warning("%s: %d non-finite voxels set to %.0f HU", path, int((~finite).sum()), fill)
            hu = np.where(finite, hu, np.float32(fill))
    return CTVolume(hu, affine, header=header, path=str(path), source_format=fmt)


def load_label_map(path) -> CTVolume:
    """Read a label map (integer ids, 0 = background) on its source grid."""
    data, affine, header, fmt = _read_any(path)
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


def save_mask(mask: np.ndarray, like: CTVolume, path, overwrite: bool = False) -> Path:
    """Write a binary or label mask on ``like``'s grid (same shape, affine; NIfTI header reused).

    The output format follows the suffix: NIfTI by default, NRRD/MetaImage through SimpleITK.
    Written atomically.
    """
    mask = np.asarray(mask)
    if mask.shape != like.shape:
        raise VolumeError(f"mask shape {mask.shape} does not match the volume grid {like.shape}")
    out = Path(path)
    check_output(out, overwrite)
    data = mask.astype(np.uint8) if mask.max(initial=0) <= 255 else mask.astype(np.uint16)
    name = out.name.lower()
    if name.endswith(NIFTI_SUFFIXES):
        import nibabel as nib

        header = like.header.copy() if like.header is not None and hasattr(like.header, "set_data_dtype") else None
        img = nib.Nifti1Image(data, like.affine, header=header)
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
        with atomic_path(out, overwrite) as tmp:
            sitk.WriteImage(image, str(tmp), True)
    else:
        raise VolumeError(f"{out}: unsupported output type; use .nii.gz, .nii, .nrrd or .mha")
    return out


__all__ = ["CTVolume", "load_volume", "load_label_map", "label_mask", "save_mask", "OutputExistsError"]
