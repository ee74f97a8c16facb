"""The canonical axial stack: a lossless view of a volume as ``stack[z, y, x]``.

``z`` runs superior → inferior (head to feet), ``y`` anterior → posterior (image top is
anterior), ``x`` patient right → left (image left is the patient's right, the radiological view
of Slicer's Red slice). The view is obtained from the source array by an axis permutation and
flips chosen from the affine (closest axes, as ``nibabel.orientations.io_orientation``); there is
no resampling, so stack indices, masks and boxes map back to the source grid exactly.

All index triples on the stack are in ``(z, y, x)`` order; RAS points are millimetres.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import numpy as np

from .errors import InputError, VolumeError
from .volume import CTVolume
from .windowing import WindowLike, window_to_uint8

# World (RAS) axis and the direction, in RAS sign, that each stack axis points to:
# z → inferior (−S), y → posterior (−A), x → patient left (−R).
_STACK_WORLD_AXES = (2, 1, 0)
_STACK_WORLD_SIGNS = (-1, -1, -1)

LVLM_SLICE_COUNT = 64


def sample_slice_indices(depth: int, n: int = LVLM_SLICE_COUNT) -> list:
    """``round(linspace(0, depth-1, n))`` without duplicates; every slice when ``depth < n``."""
    if depth < 1:
        raise InputError(f"a stack needs at least one slice, got depth {depth}")
    if n < 1:
        raise InputError(f"the number of sampled slices must be ≥ 1, got {n}")
    if depth <= n:
        return list(range(depth))
    idx = np.rint(np.linspace(0, depth - 1, n)).astype(int)
    return [int(v) for v in dict.fromkeys(idx.tolist())]


class AxialStack:
    """Canonical axial view of a :class:`CTVolume` (or any array on its grid)."""

    def __init__(self, volume: CTVolume):
        import nibabel.orientations as nio

        self.volume = volume
        ornt = nio.io_orientation(volume.affine)  # per source axis: (world axis, ±1)
        perm, flips = [], []
        for world_axis, wanted_sign in zip(_STACK_WORLD_AXES, _STACK_WORLD_SIGNS):
            src = int(np.flatnonzero(ornt[:, 0] == world_axis)[0])
            perm.append(src)
            flips.append(int(ornt[src, 1]) != wanted_sign)
        self.perm: Tuple[int, int, int] = tuple(perm)  # source axis of stack axes z, y, x
        self.flips: Tuple[bool, bool, bool] = tuple(flips)
        self._inverse_perm = tuple(int(a) for a in np.argsort(perm))
        self.data = self.to_stack(volume.array)  # a view, no copy

        # stack index (z, y, x, 1) -> source index (i, j, k, 1)
        m = np.zeros((4, 4))
        m[3, 3] = 1.0
        for stack_axis, (src, flip) in enumerate(zip(self.perm, self.flips)):
            n = volume.shape[src]
            m[src, stack_axis] = -1.0 if flip else 1.0
            m[src, 3] = (n - 1) if flip else 0.0
        self.stack_to_source_matrix = m
        self.index_to_ras = volume.affine @ m  # (z, y, x, 1) -> RAS mm

    @classmethod
    def from_volume(cls, volume: CTVolume) -> "AxialStack":
        return cls(volume)

    # ---- shape and spacing -------------------------------------------------------------
    @property
    def shape(self) -> Tuple[int, int, int]:
        return tuple(self.data.shape)

    @property
    def depth(self) -> int:
        return self.data.shape[0]

    @property
    def height(self) -> int:
        return self.data.shape[1]

    @property
    def width(self) -> int:
        return self.data.shape[2]

    @property
    def spacing(self) -> Tuple[float, float, float]:
        """Voxel size in mm along ``z, y, x``."""
        return tuple(float(self.volume.spacing[a]) for a in self.perm)

    # ---- arrays between grids ---------------------------------------------------------
    def to_stack(self, source_array: np.ndarray) -> np.ndarray:
        """View an array on the source grid (same shape as the volume) as a stack array."""
        a = np.asarray(source_array)
        if a.shape[:3] != self.volume.shape:
            raise VolumeError(f"array shape {a.shape[:3]} does not match the volume grid {self.volume.shape}")
        a = np.transpose(a, self.perm + tuple(range(3, a.ndim)))
        return a[tuple(slice(None, None, -1) if f else slice(None) for f in self.flips)]

    def to_source(self, stack_array: np.ndarray) -> np.ndarray:
        """Map an array on the stack (e.g. a mask) back to the source grid, exactly."""
        a = np.asarray(stack_array)
        if a.shape[:3] != self.shape:
            raise VolumeError(f"array shape {a.shape[:3]} does not match the stack {self.shape}")
        a = a[tuple(slice(None, None, -1) if f else slice(None) for f in self.flips)]
        return np.ascontiguousarray(np.transpose(a, self._inverse_perm + tuple(range(3, a.ndim))))

    def stack_to_source_index(self, zyx) -> np.ndarray:
        """Stack indices ``(..., 3)`` in ``(z, y, x)`` → source indices ``(i, j, k)``."""
        p = np.asarray(zyx, dtype=np.float64)
        return p @ self.stack_to_source_matrix[:3, :3].T + self.stack_to_source_matrix[:3, 3]

    # ---- world coordinates --------------------------------------------------------------
    def stack_to_ras(self, zyx) -> np.ndarray:
        """Voxel-centre RAS millimetres of stack indices ``(..., 3)`` in ``(z, y, x)`` order."""
        p = np.asarray(zyx, dtype=np.float64)
        return p @ self.index_to_ras[:3, :3].T + self.index_to_ras[:3, 3]

    def ras_to_stack(self, ras) -> np.ndarray:
        """Continuous stack indices ``(z, y, x)`` of RAS points ``(..., 3)`` (round to get a voxel)."""
        inv = np.linalg.inv(self.index_to_ras)
        p = np.asarray(ras, dtype=np.float64)
        return p @ inv[:3, :3].T + inv[:3, 3]

    def check_slice(self, z) -> int:
        if isinstance(z, bool) or not isinstance(z, (int, np.integer)):
            raise InputError(f"slice must be an integer, got {z!r}")
        if not 0 <= int(z) < self.depth:
            raise InputError(f"slice {z} is outside the stack (0..{self.depth - 1})")
        return int(z)

    # ---- images -------------------------------------------------------------------------
    def sample_indices(self, n: int = LVLM_SLICE_COUNT) -> list:
        return sample_slice_indices(self.depth, n)

    def windowed(self, z: int, window: WindowLike = None) -> np.ndarray:
        """Slice ``z`` as uint8 (H, W) after windowing (default soft tissue 40/400 HU)."""
        return window_to_uint8(self.data[self.check_slice(z)], window)

    def render_slice(self, z: int, size: Union[int, Sequence[int], None] = 256, window: WindowLike = None) -> np.ndarray:
        """Slice ``z`` as an RGB uint8 image ``(h, w, 3)``, resized (PIL bicubic) to ``size``.

        ``size`` is an int (square), ``(width, height)``, or None for the slice's own size.
        """
        from PIL import Image

        gray = Image.fromarray(self.windowed(z, window), mode="L")
        if size is not None:
            w, h = (size, size) if isinstance(size, (int, np.integer)) else (int(size[0]), int(size[1]))
            if w < 1 or h < 1:
                raise InputError(f"render size must be positive, got {size!r}")
            if (w, h) != gray.size:
                gray = gray.resize((w, h), Image.BICUBIC)
        return np.asarray(gray.convert("RGB"))

    def __repr__(self) -> str:
        return f"AxialStack(shape={self.shape}, spacing={tuple(round(s, 3) for s in self.spacing)}, source={self.volume.name})"


def axis_codes(stack: AxialStack) -> str:
    """Orientation of the source array axes, e.g. ``'RAS'`` (for messages and reports)."""
    import nibabel as nib

    return "".join(nib.aff2axcodes(stack.volume.affine))


__all__ = ["AxialStack", "sample_slice_indices", "LVLM_SLICE_COUNT", "axis_codes", "Optional"]
