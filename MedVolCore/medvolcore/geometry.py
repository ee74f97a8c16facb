"""One rule for comparing a mask with a ground-truth label map: by geometry, never by index alone.

A label map may be stored on another grid than the prediction's and still describe the same
voxels: a DICOM-derived file with its rows flipped, a NIfTI written with its axes in another order.
Compared index by index, a geometrically perfect mask then scores a meaningless Dice. So
``medvol metrics``, ``medvol batch`` and ``medvol-train prepare``/``evaluate`` all call
:func:`gt_on_grid` (or, from headers only, :func:`match_grids`), which puts the ground truth on
the prediction's grid or refuses with one :class:`~medvolcore.errors.VolumeError`:

- **same grid** (shape equal, voxel centres within :data:`EXACT_TOL_VOXELS` of a voxel): used as it is;
- **same lattice, other axis order or direction** (voxel centres coincide within
  :data:`EXACT_TOL_VOXELS` after an axis permutation and flips, found by nibabel's
  :func:`~nibabel.orientations.io_orientation`): the array is permuted and flipped
  (:func:`~nibabel.orientations.apply_orientation`) — exact, no voxel is interpolated;
- **same space, slightly shifted or tilted lattice** (after that reordering the voxel counts
  match and every corner of the two grids' extents, voxel edges included, lies within
  :data:`RESAMPLE_TOL_VOXELS` of a voxel of the other's): resampled with SimpleITK, nearest neighbour;
- anything else (another extent, another voxel size, another number of voxels along an axis): refused.

Tolerances are in voxels of the prediction's grid along each of its axes. Coordinates are RAS
millimetres of voxel centres (the :class:`~medvolcore.volume.CTVolume` affine convention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .errors import VolumeError

EXACT_TOL_VOXELS = 0.01   # voxel centres this close (in voxels) are the same voxel: float32 headers, DICOM decimal strings
RESAMPLE_TOL_VOXELS = 0.5  # extents whose corners agree within half a voxel cover the same space


@dataclass(frozen=True)
class GridMatch:
    """How a ground-truth grid relates to a prediction grid (see the module's rule).

    ``kind``: ``same``, ``reoriented`` (exact axis permutation/flips) or ``resampled`` (nearest
    neighbour). ``ornt``: nibabel's orientation transform of the ground-truth array onto the
    prediction's axes. ``offset_mm``: the largest distance between corresponding grid corners
    after reordering. ``note``: what was done, for a result (None when ``same``).
    """

    kind: str
    ornt: np.ndarray
    offset_mm: float
    note: Optional[str]


def _describe(shape, affine) -> str:
    spacing = np.linalg.norm(np.asarray(affine)[:3, :3], axis=0)
    return f"{'×'.join(str(int(v)) for v in shape)} voxels of {'×'.join(f'{s:.3g}' for s in spacing)} mm"


def _corners(shape, edges: bool) -> np.ndarray:
    """The 8 corners of a grid in voxel coordinates, homogeneous (4, 8): voxel centres, or voxel edges."""
    lo, hi = (-0.5, np.asarray(shape, float) - 0.5) if edges else (0.0, np.asarray(shape, float) - 1.0)
    pts = [[(hi[a] if (n >> a) & 1 else lo) for a in range(3)] + [1.0] for n in range(8)]
    return np.asarray(pts).T


def _reorient_note(ornt: np.ndarray) -> Optional[str]:
    order = [int(v) for v in ornt[:, 0]]
    flips = [int(order[a]) for a in range(3) if ornt[a, 1] < 0]  # in the prediction's axes
    parts = []
    if order != [0, 1, 2]:
        parts.append(f"axes permuted (ground-truth axes 0,1,2 → prediction axes {','.join(map(str, order))})")
    if flips:
        parts.append(f"flipped axes {','.join(map(str, sorted(flips)))}")
    return " and ".join(parts) + " (exact: voxel for voxel, by geometry)" if parts else None


def match_grids(pred_shape: Sequence[int], pred_affine, gt_shape: Sequence[int], gt_affine,
                pred_name: str = "the prediction", gt_name: str = "the ground truth") -> GridMatch:
    """Decide, from shapes and affines only (no voxel read), how the ground truth's grid maps onto
    the prediction's; :class:`VolumeError` (one line naming both grids) when they do not cover the
    same space. Used by :func:`gt_on_grid` and by ``medvol batch``'s check of a manifest's headers."""
    from nibabel.orientations import inv_ornt_aff, io_orientation

    pa, ga = np.asarray(pred_affine, float), np.asarray(gt_affine, float)
    pred_shape, gt_shape = tuple(int(v) for v in pred_shape), tuple(int(v) for v in gt_shape)
    if pred_shape == gt_shape and np.array_equal(pa, ga):  # the common case, cheaply (a manifest of 10,000 rows)
        return GridMatch("same", np.array([[0, 1], [1, 1], [2, 1]], float), 0.0, None)
    to_pred = np.linalg.inv(pa) @ ga  # ground-truth voxel → prediction voxel
    ornt = io_orientation(to_pred)
    if np.isnan(ornt).any():  # an axis with no clear counterpart (oblique by ~45°)
        ornt = np.array([[0, 1], [1, 1], [2, 1]], float)
    shape = tuple(gt_shape[int(np.flatnonzero(ornt[:, 0] == a)[0])] if a in ornt[:, 0] else -1 for a in range(3))
    reoriented = to_pred @ inv_ornt_aff(ornt, gt_shape)  # reoriented gt voxel → prediction voxel
    spacing = np.linalg.norm(pa[:3, :3], axis=0)

    def refuse(why: str):
        raise VolumeError(f"{gt_name} ({_describe(gt_shape, ga)}) and {pred_name} ({_describe(pred_shape, pa)}) do not "
                          f"cover the same space: {why}; medvol compares them only on one grid (the same voxels up to "
                          "axis order and flips, or within half a voxel), so resample one onto the other first")

    if shape != pred_shape:
        refuse("their numbers of voxels differ along corresponding axes")
    centres = _corners(pred_shape, edges=False)
    err_centres = np.abs((reoriented @ centres - centres)[:3]).max()
    edges = _corners(pred_shape, edges=True)
    err_edges = np.abs((reoriented @ edges - edges)[:3])
    offset_mm = float(np.linalg.norm(((reoriented @ edges - edges)[:3]) * spacing[:, None], axis=0).max())
    if err_centres <= EXACT_TOL_VOXELS:
        note = _reorient_note(ornt)
        return GridMatch("same" if note is None else "reoriented", ornt, offset_mm, note)
    if err_edges.max() <= RESAMPLE_TOL_VOXELS:
        how = _reorient_note(ornt)
        note = (f"resampled onto the prediction's grid (nearest neighbour): voxel positions differ by up to "
                f"{offset_mm:.2f} mm" + (f"; {how.split(' (exact')[0]}" if how else ""))
        return GridMatch("resampled", ornt, offset_mm, note)
    refuse(f"corresponding corners of their extents are up to {offset_mm:.1f} mm apart")


@dataclass(frozen=True)
class OnGrid:
    """A ground-truth label array on the prediction's grid and how it got there (``note`` None: as stored)."""

    array: np.ndarray
    kind: str
    note: Optional[str]


def gt_on_grid(pred, gt) -> OnGrid:
    """The ground-truth label map ``gt`` (a :class:`~medvolcore.volume.CTVolume`) on the grid of
    ``pred`` (a CTVolume, or anything with ``shape`` and ``affine``), label values kept, by the
    module's rule; :class:`VolumeError` when they do not cover the same space."""
    from nibabel.orientations import apply_orientation

    m = match_grids(pred.shape, pred.affine, gt.shape, gt.affine, _name(pred, "the prediction"),
                    _name(gt, "the ground truth"))
    if m.kind == "same":
        return OnGrid(np.asarray(gt.array), "same", None)
    arr = np.ascontiguousarray(apply_orientation(np.asarray(gt.array), m.ornt))
    if m.kind == "reoriented":
        return OnGrid(arr, "reoriented", m.note)
    return OnGrid(_resample_nearest(arr, gt.affine, m.ornt, gt.shape, pred), "resampled", m.note)


def _name(v, default: str) -> str:
    path = getattr(v, "path", None)
    return f"{default} {path}" if path else default


def _sitk_image(array: np.ndarray, affine: np.ndarray):
    """A SimpleITK image of ``array`` (i, j, k) with the RAS voxel→world ``affine`` (LPS for ITK)."""
    import SimpleITK as sitk  # noqa: N813

    lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ np.asarray(affine, float)
    spacing = np.linalg.norm(lps[:3, :3], axis=0)
    image = sitk.GetImageFromArray(np.ascontiguousarray(array.transpose(2, 1, 0)))
    image.SetSpacing(tuple(float(s) for s in spacing))
    image.SetDirection(tuple(float(v) for v in (lps[:3, :3] / spacing).ravel()))
    image.SetOrigin(tuple(float(v) for v in lps[:3, 3]))
    return image


def _resample_nearest(arr: np.ndarray, gt_affine, ornt, gt_shape, pred) -> np.ndarray:
    """``arr`` (the ground truth already reordered onto the prediction's axes) resampled onto
    ``pred``'s grid with SimpleITK's nearest-neighbour interpolator (labels are never blended)."""
    from nibabel.orientations import inv_ornt_aff

    from .volume import _require_sitk

    sitk = _require_sitk("resampling a ground truth onto another grid")
    moving = _sitk_image(arr, np.asarray(gt_affine, float) @ inv_ornt_aff(ornt, gt_shape))
    reference = _sitk_image(np.zeros(pred.shape, dtype=np.uint8), pred.affine)
    out = sitk.Resample(moving, reference, sitk.Transform(), sitk.sitkNearestNeighbor, 0, moving.GetPixelID())
    return sitk.GetArrayFromImage(out).transpose(2, 1, 0).astype(arr.dtype, copy=False)


__all__ = ["EXACT_TOL_VOXELS", "RESAMPLE_TOL_VOXELS", "GridMatch", "OnGrid", "gt_on_grid", "match_grids"]
