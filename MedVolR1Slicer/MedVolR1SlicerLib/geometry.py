"""Volume geometry for the Slicer module: RAS ↔ IJK, and evidence-anchor boxes ↔ ROI boxes.

Plain numpy, no Slicer: every function here is tested with pytest on real affines.

Frames
------
* **IJK**: Slicer's voxel index ``(i, j, k)`` of a volume node (the NIfTI file the module
  exports has the same grid, with ``affine == IJKToRAS``). A voxel ``v`` covers
  ``[v − ½, v + ½)`` along each axis; integers are voxel centres.
* **RAS**: patient millimetres, as Slicer's world frame (no parent transforms: the module
  hardens none and refuses transformed volumes, see :func:`check_untransformed`).
* **Stack**: MedVolCore's canonical axial stack ``(z, y, x)``. It is a permutation and flips of
  IJK chosen by "closest axes", so the *slice axis* (the IJK axis of stack ``z``) is the IJK
  axis closest to superior–inferior. The anchor file's ``world`` block is what crosses the
  boundary: ``slice_center_ras`` and, per box, the RAS centres of its first and last voxel.

An anchor box becomes a ``vtkMRMLMarkupsROINode`` whose faces lie on voxel *edges*: in-plane it
spans ``[x0 − ½, x1 + ½]`` voxels, and it is one voxel thick around the key slice. Its axes are
the volume's IJK directions, so it is right for any orientation (oblique or LPS-stored files
included). Reading a ROI back takes the voxels whose centres it covers, clamped to the key
slice and to the volume, with a message for each clamp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import numpy as np

SCHEMA = "medvol.anchor/1"
_ALIGNED_COS = 0.999  # a ROI axis within ~2.5° of a volume axis counts as aligned


class GeometryError(ValueError):
    """The boxes or the volume cannot be placed (e.g. every box lies outside the volume)."""


def closest_axes(ijk_to_ras) -> List[Tuple[int, int]]:
    """Per IJK axis: ``(RAS axis, ±1)`` of the closest world axis.

    The same rule as ``nibabel.orientations.io_orientation`` (and so as MedVolCore's stack):
    the direction matrix is replaced by its closest rotation, then each IJK axis in turn takes
    the world axis with the largest absolute cosine that is still free.
    """
    m = np.asarray(ijk_to_ras, dtype=np.float64)[:3, :3]
    zooms = np.sqrt((m ** 2).sum(axis=0))
    if np.any(zooms <= 0) or not np.all(np.isfinite(m)):
        raise GeometryError("the volume's IJK→RAS matrix is degenerate (a zero or non-finite axis)")
    u, _, vt = np.linalg.svd(m / zooms)
    r = u @ vt
    out: List[Tuple[int, int]] = []
    for ijk_axis in range(3):
        col = r[:, ijk_axis]
        ras_axis = int(np.argmax(np.abs(col)))
        out.append((ras_axis, 1 if col[ras_axis] > 0 else -1))
        r[ras_axis, :] = 0.0
    return out


def check_untransformed(has_parent_transform: bool, what: str = "volume") -> None:
    if has_parent_transform:
        raise GeometryError(
            f"the {what} is under a transform; harden it first (Data module → right-click → Harden transform) "
            "so that its voxels and the boxes share one RAS frame"
        )


@dataclass
class RoiBox:
    """An oriented box: ``center`` (RAS mm), ``size`` (mm along each axis), ``axes`` (3×3, unit
    column vectors, right-handed). Maps onto ``vtkMRMLMarkupsROINode``'s ObjectToNode matrix
    (rotation = ``axes``, translation = ``center``) and ``Size``."""

    center: np.ndarray
    size: np.ndarray
    axes: np.ndarray = field(default_factory=lambda: np.eye(3))

    def __post_init__(self):
        self.center = np.asarray(self.center, dtype=np.float64).reshape(3)
        self.size = np.asarray(self.size, dtype=np.float64).reshape(3)
        self.axes = np.asarray(self.axes, dtype=np.float64).reshape(3, 3)
        if not (np.all(np.isfinite(self.center)) and np.all(np.isfinite(self.size)) and np.all(np.isfinite(self.axes))):
            raise GeometryError("a box has a non-finite centre, size or orientation")

    def object_to_node(self) -> np.ndarray:
        m = np.eye(4)
        m[:3, :3] = self.axes
        m[:3, 3] = self.center
        return m

    @classmethod
    def from_object_to_node(cls, matrix, size) -> "RoiBox":
        m = np.asarray(matrix, dtype=np.float64).reshape(4, 4)
        axes = m[:3, :3] / np.linalg.norm(m[:3, :3], axis=0)
        return cls(m[:3, 3], size, axes)

    def corners(self) -> np.ndarray:
        """The 8 corners in RAS, shape ``(8, 3)``."""
        signs = np.array([[sx, sy, sz] for sx in (-1, 1) for sy in (-1, 1) for sz in (-1, 1)], dtype=np.float64)
        return self.center + (signs * (self.size / 2.0)) @ self.axes.T


class VolumeGeometry:
    """The grid of one volume node: ``ijk_to_ras`` (4×4) and ``shape`` in IJK order."""

    def __init__(self, ijk_to_ras, shape: Sequence[int]):
        self.ijk_to_ras = np.asarray(ijk_to_ras, dtype=np.float64).reshape(4, 4)
        self.shape = tuple(int(n) for n in shape)
        if len(self.shape) != 3 or min(self.shape) < 1:
            raise GeometryError(f"a volume needs three positive dimensions, got {tuple(shape)}")
        if abs(np.linalg.det(self.ijk_to_ras[:3, :3])) < 1e-12:
            raise GeometryError("the volume's IJK→RAS matrix is singular")
        self.ras_to_ijk_matrix = np.linalg.inv(self.ijk_to_ras)
        axes = closest_axes(self.ijk_to_ras)
        self.slice_axis = next(a for a, (ras, _) in enumerate(axes) if ras == 2)
        self.inplane_axes = tuple(a for a in range(3) if a != self.slice_axis)
        self.spacing = np.sqrt((self.ijk_to_ras[:3, :3] ** 2).sum(axis=0))
        # The stack's x and y point to patient left (−R) and posterior (−A): an in-plane IJK axis
        # whose closest world direction is +R or +A runs against the stack.
        self.against_stack = tuple(sign > 0 for _, sign in axes)

    # ---- points ----------------------------------------------------------------------------
    def to_ras(self, ijk) -> np.ndarray:
        p = np.asarray(ijk, dtype=np.float64)
        return p @ self.ijk_to_ras[:3, :3].T + self.ijk_to_ras[:3, 3]

    def to_ijk(self, ras) -> np.ndarray:
        p = np.asarray(ras, dtype=np.float64)
        return p @ self.ras_to_ijk_matrix[:3, :3].T + self.ras_to_ijk_matrix[:3, 3]

    @property
    def depth(self) -> int:
        return self.shape[self.slice_axis]

    def slice_of(self, ras) -> int:
        """Index along the slice axis of the voxel nearest to a RAS point (not clamped)."""
        return int(np.rint(self.to_ijk(ras)[self.slice_axis]))

    def slice_center_ras(self, k: int) -> List[float]:
        """RAS centre of slice ``k`` (the in-plane middle), as the anchor's ``slice_center_ras``."""
        ijk = np.array([(n - 1) / 2.0 for n in self.shape])
        ijk[self.slice_axis] = k
        return [float(v) for v in self.to_ras(ijk)]

    def _axes_frame(self) -> np.ndarray:
        """Unit IJK directions as columns, made right-handed by flipping the slice axis if needed."""
        m = self.ijk_to_ras[:3, :3] / self.spacing
        if np.linalg.det(m) < 0:
            m = m.copy()
            m[:, self.slice_axis] *= -1.0  # the box is symmetric about its centre: same box
        return m

    # ---- anchor world box → ROI ------------------------------------------------------------
    def voxel_box(self, corners_ras) -> Tuple[int, np.ndarray, np.ndarray]:
        """``(k, lo, hi)``: the slice and inclusive IJK voxel range of a world box."""
        c = np.asarray(corners_ras, dtype=np.float64)
        if c.shape != (2, 3) or not np.all(np.isfinite(c)):
            raise GeometryError(f"a world box must be two RAS points [[r, a, s], [r, a, s]], got {corners_ras!r}")
        ijk = np.rint(self.to_ijk(c)).astype(int)
        ks = ijk[:, self.slice_axis]
        if ks[0] != ks[1]:
            raise GeometryError(f"a box's corners lie on different slices ({ks[0]} and {ks[1]})")
        return int(ks[0]), ijk.min(axis=0), ijk.max(axis=0)

    def roi_from_voxels(self, lo, hi) -> RoiBox:
        """The ROI whose faces lie on the outer voxel edges of the inclusive range ``lo..hi``."""
        lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
        centre_ijk = (lo + hi) / 2.0
        size = (hi - lo + 1.0) * self.spacing
        return RoiBox(self.to_ras(centre_ijk), size, self._axes_frame())

    def roi_from_world_box(self, corners_ras) -> Tuple[RoiBox, int]:
        k, lo, hi = self.voxel_box(corners_ras)
        return self.roi_from_voxels(lo, hi), k

    # ---- ROI → anchor world box ------------------------------------------------------------
    def box_from_roi(self, roi: RoiBox, key_slice: int, label: str = "box") -> Tuple[List[List[float]], List[str]]:
        """RAS centres of the first and last voxel the ROI covers on ``key_slice``, and messages.

        A ROI moved off the key slice is put back on it; one reaching outside the volume is cut
        to it; a rotated one is replaced by its in-plane bounding box. Each says so. A ROI that
        covers no voxel of the slice raises :class:`GeometryError`.
        """
        notes: List[str] = []
        ijk = self.to_ijk(roi.corners())
        lo_f, hi_f = ijk.min(axis=0), ijk.max(axis=0)
        # Voxels whose centres lie inside the ROI, to the nearest voxel edge.
        first = np.rint(lo_f + 0.5).astype(int)
        last = np.rint(hi_f - 0.5).astype(int)
        last = np.maximum(last, first)

        frame = self._axes_frame()
        cos = np.abs(frame.T @ roi.axes)
        if not np.all(cos.max(axis=0) >= _ALIGNED_COS):
            notes.append(f"{label} was rotated; its bounding box on the slice is used")

        k = int(np.rint(self.to_ijk(roi.center)[self.slice_axis]))
        if k != key_slice:
            notes.append(f"{label} was moved off the key slice; it is kept on the key slice")

        lo, hi = first.copy(), last.copy()
        for a in self.inplane_axes:
            n = self.shape[a]
            if hi[a] < 0 or lo[a] > n - 1:
                raise GeometryError(f"{label} lies outside the volume; move it back onto the image or delete it")
            lo[a], hi[a] = max(lo[a], 0), min(hi[a], n - 1)
        if not (np.array_equal(lo[list(self.inplane_axes)], first[list(self.inplane_axes)])
                and np.array_equal(hi[list(self.inplane_axes)], last[list(self.inplane_axes)])):
            notes.append(f"{label} reached outside the volume; it was cut to the image")
        lo[self.slice_axis] = hi[self.slice_axis] = key_slice
        # first corner = the stack's (x0, y0) voxel, as the anchor file orders them
        first_v = np.where(self.against_stack, hi, lo)
        last_v = np.where(self.against_stack, lo, hi)
        return [[float(v) for v in self.to_ras(first_v)], [float(v) for v in self.to_ras(last_v)]], notes


# ---- whole anchors ---------------------------------------------------------------------------

def rois_from_anchor(geometry: VolumeGeometry, anchor: dict) -> Tuple[List[RoiBox], int]:
    """ROIs for every box of an anchor (schema ``medvol.anchor/1``, from its ``world`` block),
    and the key slice index along the volume's slice axis."""
    world = (anchor or {}).get("world") or {}
    boxes = world.get("boxes_ras") or []
    if not boxes:
        raise GeometryError("the anchor has no world boxes; the worker always sends them, is it an old file?")
    rois, ks = [], []
    for corners in boxes:
        roi, k = geometry.roi_from_world_box(corners)
        rois.append(roi)
        ks.append(k)
    if len(set(ks)) != 1:
        raise GeometryError(f"the anchor's boxes lie on different slices ({sorted(set(ks))})")
    k = ks[0]
    if not 0 <= k < geometry.depth:
        raise GeometryError(f"the anchor's slice lies outside this volume (index {k}, {geometry.depth} slices)")
    return rois, k


def anchor_from_rois(geometry: VolumeGeometry, rois: Sequence[RoiBox], key_slice: int, query: str = "",
                     reasoning: str = "") -> Tuple[dict, List[str]]:
    """A world-only anchor (``source: "user"``) from edited ROIs, and what had to be clamped.

    The worker places it on its stack (``EvidenceAnchor.from_world``), so the volume's
    orientation never has to be known here beyond its IJK→RAS matrix.
    """
    if not 0 <= key_slice < geometry.depth:
        raise GeometryError(f"key slice {key_slice} is outside the volume (0..{geometry.depth - 1})")
    if not rois:
        raise GeometryError("there is no box left; add a box (ROI) on the key slice or segment again")
    boxes, notes = [], []
    for i, roi in enumerate(rois):
        corners, n = geometry.box_from_roi(roi, key_slice, f"box {i + 1}")
        boxes.append(corners)
        notes.extend(n)
    anchor = {
        "schema": SCHEMA,
        "world": {"slice_center_ras": geometry.slice_center_ras(key_slice), "boxes_ras": boxes},
        "query": query,
        "reasoning": reasoning,
        "source": "user",
    }
    return anchor, notes
