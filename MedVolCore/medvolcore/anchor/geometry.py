"""Box geometry on the canonical slice: pixel, normalised (0–1000) and world (RAS mm) boxes, and
prompts placed from their world form (the conventions: :mod:`medvolcore.anchor`)."""

from __future__ import annotations

import logging
import math
from typing import List, Optional, Sequence

import numpy as np

from ..errors import AnchorError, InputError, shown
from ..prompts import MAX_INDEX, check_prompt_fields

# the name the anchor's warnings have always been logged under
log = logging.getLogger("medvolcore.anchor")

NORM = 1000.0
# Tolerance (in pixels) when rounding normalised coordinates outward: absorbs the rounding of
# boxes_norm as written in anchor files (6 decimals) and of integer model outputs.
_EPS = 1e-3
# Bounds on numbers read from anchors: no slice is a million pixels wide and no point of a body
# is a kilometre from the scanner's origin, so larger values (1e308, 10**400) are refused as
# errors of their field before any arithmetic can overflow.
MAX_COORD = MAX_INDEX
MAX_WORLD_MM = 1_000_000.0

Box = List[int]


def _show(value, limit: int = 60) -> str:
    return shown(value, limit)


def _in_range(v, bound: float) -> bool:
    """Whether a number (int, float, numpy scalar; not bool) is finite and within ``±bound``,
    without converting a huge int to float (which overflows)."""
    if isinstance(v, (int, np.integer)):
        return -bound <= int(v) <= bound
    return math.isfinite(v) and -bound <= float(v) <= bound


def _as_numbers(box, what: str = "box") -> list:
    if isinstance(box, (str, bytes)) or not hasattr(box, "__len__") or len(box) != 4:
        raise InputError(f"{what} must have 4 numbers [x0, y0, x1, y1], got {_show(box)}")
    out = []
    for v in box:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise InputError(f"{what} {_show(list(box))} has a non-numeric coordinate {_show(v)}")
        if not _in_range(v, MAX_COORD):
            raise InputError(f"{what} has a coordinate out of range ({_show(v, 30)}): coordinates are finite and at "
                             f"most {MAX_COORD:,} in size")
        out.append(v)
    return out


def check_box(box, width: int, height: int, what: str = "box") -> Box:
    """Validate an inclusive pixel box on a ``width × height`` slice.

    An inverted or empty box is an error; a box reaching outside the slice is clamped to it,
    with a warning; a box entirely outside is an error.
    """
    x0, y0, x1, y1 = _as_numbers(box, what)
    if any(float(v) != int(v) for v in (x0, y0, x1, y1)):
        raise InputError(f"{what} {list(box)!r}: pixel boxes take integer indices")
    x0, y0, x1, y1 = int(x0), int(y0), int(x1), int(y1)
    if x1 < x0 or y1 < y0:
        raise InputError(f"{what} [{x0}, {y0}, {x1}, {y1}] is inverted: need x0 <= x1 and y0 <= y1 (inclusive pixel indices)")
    c = [min(max(x0, 0), width - 1), min(max(y0, 0), height - 1), min(max(x1, 0), width - 1), min(max(y1, 0), height - 1)]
    if x1 < 0 or y1 < 0 or x0 >= width or y0 >= height:
        raise InputError(f"{what} [{x0}, {y0}, {x1}, {y1}] lies entirely outside the {width}×{height} slice")
    if c != [x0, y0, x1, y1]:
        log.warning("%s [%d, %d, %d, %d] reaches outside the %d×%d slice; clamped to %s", what, x0, y0, x1, y1, width, height, c)
    return c


def box_to_norm(box: Sequence[int], width: int, height: int) -> List[float]:
    """Inclusive pixel box → normalised 0–1000 box (continuous)."""
    x0, y0, x1, y1 = box
    return [NORM * x0 / width, NORM * y0 / height, NORM * (x1 + 1) / width, NORM * (y1 + 1) / height]


def norm_to_box(box_norm: Sequence[float], width: int, height: int, what: str = "box") -> Box:
    """Normalised 0–1000 box → inclusive pixel box, rounding outward and clamping to the slice."""
    x0, y0, x1, y1 = (float(v) for v in _as_numbers(box_norm, what))
    if not (x0 < x1 and y0 < y1):
        raise InputError(f"{what} {list(box_norm)!r} is empty or inverted (need x0 < x1 and y0 < y1)")
    px0 = math.floor(x0 * width / NORM + _EPS)
    py0 = math.floor(y0 * height / NORM + _EPS)
    px1 = math.ceil(x1 * width / NORM - _EPS) - 1
    py1 = math.ceil(y1 * height / NORM - _EPS) - 1
    px1, py1 = max(px1, px0), max(py1, py0)
    clamped = [min(max(px0, 0), width - 1), min(max(py0, 0), height - 1), min(max(px1, 0), width - 1), min(max(py1, 0), height - 1)]
    if px1 < 0 or py1 < 0 or px0 >= width or py0 >= height:
        raise InputError(f"{what} {list(box_norm)!r} lies outside the image (0..1000)")
    return clamped


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two continuous boxes ``[x0, y0, x1, y1]`` (e.g. normalised), area ``(x1−x0)·(y1−y0)``."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def box_to_ras(stack, z: int, box: Sequence[int]) -> List[List[float]]:
    """RAS mm centres of a box's first ``(z, y0, x0)`` and last ``(z, y1, x1)`` voxel."""
    x0, y0, x1, y1 = box
    pts = stack.stack_to_ras([[z, y0, x0], [z, y1, x1]])
    return [[float(v) for v in p] for p in pts]


def _ras_points_to_stack(stack, points, what: str, tol: float = 0.5):
    """``(z, rows, cols)`` of RAS points that must all lie on one axial slice (within ``tol`` voxels)."""
    idx = _stack_indices(stack, np.asarray(points, dtype=np.float64).reshape(-1, 3), what)
    zs = idx[:, 0]
    z = int(np.rint(zs.mean()))
    if np.any(np.abs(zs - z) > tol):
        raise AnchorError(f"{what}: its points lie on different axial slices (z = "
                          + ", ".join(f"{v:.2f}" for v in zs) + ")")
    if not 0 <= z < stack.depth:
        raise AnchorError(f"{what}: its slice z = {z} is outside the stack (0..{stack.depth - 1})")
    return z, np.rint(idx[:, 1]).astype(int), np.rint(idx[:, 2]).astype(int)


def _anchor_box(box, width: int, height: int, what: str) -> Box:
    """:func:`check_box` with its errors as :class:`AnchorError` (a box read from an anchor)."""
    try:
        return check_box(box, width, height, what)
    except InputError as e:
        raise AnchorError(str(e)) from None


def _pixel_prompt(raw, i: int, width: int, height: int, what: str) -> dict:
    """A pixel-form prompt with its fields checked and its box clamped to the slice, as anchor boxes are."""
    p = check_prompt_fields(raw, i, AnchorError)
    if p["box"] is not None:
        p["box"] = _anchor_box(p["box"], width, height, f"{what} box")
    return p


def _world_array(value) -> Optional[np.ndarray]:
    """``value`` as float64, or None when it is not numbers (a huge int overflows: None too)."""
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        return None


def _check_world_range(a: np.ndarray, what: str) -> None:
    if not np.all(np.abs(a) <= MAX_WORLD_MM):  # NaN and inf fail too
        raise AnchorError(f"{what}: a coordinate is not finite or lies more than {MAX_WORLD_MM:,.0f} mm from the "
                          "origin; world coordinates are RAS millimetres")


def _ras_array(value, shape_tail: int, what: str, form: str) -> np.ndarray:
    a = _world_array(value)
    if a is None or a.ndim != 2 or a.shape[1] != shape_tail or len(a) == 0:
        raise AnchorError(f"{what}: must be {form}, got {_show(value)}")
    _check_world_range(a, what)
    return a


def _stack_indices(stack, ras: np.ndarray, what: str) -> np.ndarray:
    """Continuous stack indices of RAS points, refused when they lie absurdly far from the volume."""
    idx = stack.ras_to_stack(ras)
    if not np.all(np.abs(idx) <= MAX_COORD):
        raise AnchorError(f"{what}: a point lies far outside the volume (more than {MAX_COORD:,} voxels away)")
    return idx


def ras_to_prompt(stack, world: dict, what: str = "prompt") -> dict:
    """A prompt's pixel form ``{slice, box, points}`` from its ``world`` form (``box_ras``, ``points_ras``)."""
    if not isinstance(world, dict):
        raise AnchorError(f"{what}: 'world' must be an object with 'box_ras' and/or 'points_ras'")
    box_ras, points_ras = world.get("box_ras"), world.get("points_ras") or []
    if box_ras is None and not points_ras:
        raise AnchorError(f"{what}: its 'world' has neither 'box_ras' nor 'points_ras'")
    ras, labels = [], []
    if box_ras is not None:
        corners = _ras_array(box_ras, 3, what + " box_ras", "two RAS points [[r, a, s], [r, a, s]]")
        if len(corners) != 2:
            raise AnchorError(f"{what}: box_ras must be two RAS points [[r, a, s], [r, a, s]]")
        ras += list(corners)
    if points_ras:
        pts = _ras_array(points_ras, 4, what + " points_ras", "a list of [r, a, s, label]")
        ras += list(pts[:, :3])
        labels = [float(v) for v in pts[:, 3]]
    z, rows, cols = _ras_points_to_stack(stack, ras, what)
    box = None
    if box_ras is not None:
        box = _anchor_box([int(min(cols[:2])), int(min(rows[:2])), int(max(cols[:2])), int(max(rows[:2]))],
                          stack.width, stack.height, what + " box")
        rows, cols = rows[2:], cols[2:]
    points = []
    for j, (y, x, label) in enumerate(zip(rows, cols, labels)):
        if label not in (0.0, 1.0):
            raise AnchorError(f"{what}: point {j + 1} has label {label:g}; use 1 (inside) or 0 (outside)")
        points.append([int(x), int(y), int(label)])
    return {"slice": z, "box": box, "points": points}


def ras_to_box(stack, corners, what: str = "box", tol: float = 0.5):
    """``(z, box)`` from the RAS centres of a box's first and last voxel.

    Points are rounded to the nearest voxel; both must lie on the same slice (within
    ``tol`` voxels) and inside the stack's depth.
    """
    c = _world_array(corners)
    if c is None or c.shape != (2, 3):
        raise AnchorError(f"{what}: world box must be two RAS points [[r, a, s], [r, a, s]], got {_show(corners)}")
    _check_world_range(c, what)
    idx = _stack_indices(stack, c, what)
    zs = idx[:, 0]
    z = int(np.rint(zs.mean()))
    if np.any(np.abs(zs - z) > tol):
        raise AnchorError(f"{what}: its corners lie on different axial slices (z = {zs[0]:.2f} and {zs[1]:.2f})")
    if not 0 <= z < stack.depth:
        raise AnchorError(f"{what}: its slice z = {z} is outside the stack (0..{stack.depth - 1})")
    ys, xs = np.rint(idx[:, 1]).astype(int), np.rint(idx[:, 2]).astype(int)
    box = [int(min(xs)), int(min(ys)), int(max(xs)), int(max(ys))]
    return z, check_box(box, stack.width, stack.height, what)


def _slice_centre(stack, z: int) -> List[float]:
    return [float(v) for v in stack.stack_to_ras([z, (stack.height - 1) / 2.0, (stack.width - 1) / 2.0])]
