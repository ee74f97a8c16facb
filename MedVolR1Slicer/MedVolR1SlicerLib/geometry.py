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
slice (a correction box: to the slice it was made on) and to the volume, with a message for each
clamp. A point is the voxel nearest to it, on the slice nearest to it; its world form is that
voxel's centre. Correction prompts and the slice range (schema ``medvol.anchor/2``) are built
from these in :mod:`.corrections`.
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
        # IJK axis of the stack's z, y and x (closest to S, A and R)
        self.stack_axes = tuple(next(a for a, (ras, _) in enumerate(axes) if ras == r) for r in (2, 1, 0))

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

    def stack_z(self, k: int) -> int:
        """The canonical stack's ``z`` (0 = most superior) of slice ``k`` along the slice axis."""
        return self.depth - 1 - int(k) if self.against_stack[self.slice_axis] else int(k)

    def slice_of_stack_z(self, z: int) -> int:
        """The slice index along the slice axis of the stack's slice ``z`` (inverse of :meth:`stack_z`)."""
        return self.stack_z(z)  # a flip is its own inverse

    def stack_to_ijk(self, zyx) -> np.ndarray:
        """Stack indices ``(..., 3)`` in ``(z, y, x)`` order → IJK indices (as MedVolCore's
        ``AxialStack.stack_to_source_index``)."""
        p = np.asarray(zyx, dtype=np.float64)
        out = np.zeros(p.shape[:-1] + (3,), dtype=np.float64)
        for stack_axis, ijk_axis in enumerate(self.stack_axes):
            v = p[..., stack_axis]
            out[..., ijk_axis] = (self.shape[ijk_axis] - 1) - v if self.against_stack[ijk_axis] else v
        return out

    def slice_text(self, k: int) -> str:
        """A slice as the panel names it: its number among the axial slices (stack ``z`` + 1, as
        the key slice's label counts) and its S position in mm, e.g. ``slice 41 (S -12.5 mm)``."""
        return f"slice {self.stack_z(k) + 1} (S {self.slice_center_ras(k)[2]:.1f} mm)"

    def point_voxel(self, ras, label: str = "a point") -> Tuple[int, List[float]]:
        """``(k, centre)``: the slice of the voxel nearest to a RAS point and that voxel's RAS
        centre (a point is snapped to its voxel's centre, as boxes are to voxel edges). A point
        outside the volume raises :class:`GeometryError`."""
        p = np.asarray(ras, dtype=np.float64).reshape(-1)[:3]
        if p.shape != (3,) or not np.all(np.isfinite(p)):
            raise GeometryError(f"{label} has no finite position")
        ijk = np.rint(self.to_ijk(p)).astype(int)
        if not all(0 <= ijk[a] < self.shape[a] for a in range(3)):
            raise GeometryError(f"{label} lies outside the volume; move it onto the image or delete it")
        return int(ijk[self.slice_axis]), [float(v) for v in self.to_ras(ijk)]

    def box_around(self, k: int, centre_ras=None) -> Tuple[List[int], List[int]]:
        """An inclusive IJK voxel box on slice ``k``, a quarter of the image wide and high
        (``3n//8 .. 5n//8`` along each in-plane axis, as Add box always made it), centred on
        ``centre_ras`` projected onto the slice when given, and kept inside the image."""
        if not 0 <= k < self.depth:
            raise GeometryError(f"slice index {k} is outside the volume (0..{self.depth - 1})")
        lo, hi = [0, 0, 0], [0, 0, 0]
        lo[self.slice_axis] = hi[self.slice_axis] = int(k)
        centre = None
        if centre_ras is not None:
            centre = np.rint(self.to_ijk(np.asarray(centre_ras, dtype=np.float64).reshape(-1)[:3]))
        for a in self.inplane_axes:
            n = self.shape[a]
            first, last = 3 * n // 8, 5 * n // 8
            if centre is not None:
                width = last - first + 1
                first = int(centre[a]) - (width - 1) // 2
                last = first + width - 1
                shift = max(0, -first) - max(0, last - (n - 1))  # slide it back onto the image
                first, last = max(0, first + shift), min(n - 1, last + shift)
            lo[a], hi[a] = first, last
        return lo, hi

    def range_ras(self, k0: int, k1: int) -> List[List[float]]:
        """The world form of a slice range (``z_range_ras``): a point on each end slice, the
        centre of its middle voxel (a voxel centre, so that no reader has to round a half), the
        stack's smaller ``z`` first (so it reads as ``[z0, z1]``)."""
        out = []
        for k in sorted((int(k0), int(k1)), key=self.stack_z):
            ijk = np.array([(n - 1) // 2 for n in self.shape], dtype=np.float64)
            ijk[self.slice_axis] = k
            out.append([float(v) for v in self.to_ras(ijk)])
        return out

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
    def box_from_roi(self, roi: RoiBox, key_slice: int, label: str = "box",
                     where: str = "the key slice") -> Tuple[List[List[float]], List[str]]:
        """RAS centres of the first and last voxel the ROI covers on ``key_slice``, and messages.

        A ROI moved off the key slice (``where`` names it in the message: a correction box's own
        slice is not the key slice) is put back on it; one reaching outside the volume is cut
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
            notes.append(f"{label} was moved off {where}; it is kept on {where}")

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
