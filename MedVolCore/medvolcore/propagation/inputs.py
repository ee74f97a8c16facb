"""The inputs of a propagation, checked before anything runs: the HU stack, the key slice, the
boxes, the slice window and the early stop ``K``. Each wrong input is one :class:`InputError`
saying what is wrong and what is allowed.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import numpy as np

from ..errors import InputError

# Early stop: each direction ends once every object's mask has been empty on this many
# consecutive slices (0 = never: the MedVol-R1 paper's whole-volume propagation). Why 2: see
# docs/benchmarks.md, "Early stop" (no interior gap in any reference label at 3 mm; a mask
# that vanishes on one slice and comes back is still followed; each extra slice costs ~2
# slices of work per target).
DEFAULT_STOP_AFTER_EMPTY = 2
MAX_STOP_AFTER_EMPTY = 10000


def _check_stack(stack_hu) -> np.ndarray:
    a = np.asarray(stack_hu)
    if a.ndim != 3 or min(a.shape) < 1:
        raise InputError(f"the stack must be a 3-D (D, H, W) array with every side ≥ 1, got shape {a.shape}")
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == bool) or np.issubdtype(a.dtype, np.complexfloating):
        raise InputError(f"the stack must hold real numbers (HU), got dtype {a.dtype}")
    if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
        raise InputError("the stack holds NaN or infinite values; replace them (e.g. with -1024 HU) first")
    return a


def _as_index(v, what: str) -> int:
    if isinstance(v, (bool, np.bool_)):
        raise InputError(f"{what} must be an integer pixel index, got {v!r}")
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real) and math.isfinite(float(v)) and float(v).is_integer():
        return int(v)
    raise InputError(f"{what} must be an integer pixel index, got {v!r}")


def _check_key_slice(key_slice, depth: int) -> int:
    try:
        k = _as_index(key_slice, "key_slice")
    except InputError:
        raise InputError(f"key_slice must be an integer slice index in 0..{depth - 1}, got {key_slice!r}") from None
    if not 0 <= k < depth:
        raise InputError(f"key slice {k} is outside the stack: it has {depth} slices (0..{depth - 1})")
    return k


def _check_boxes(boxes, width: int, height: int) -> list:
    if boxes is None:
        raise InputError("at least one box [x0, y0, x1, y1] is needed on the key slice")
    try:
        items = list(boxes)
    except TypeError:
        raise InputError(f"boxes must be a list of [x0, y0, x1, y1] pixel boxes, got {boxes!r}") from None
    if not items:
        raise InputError("at least one box [x0, y0, x1, y1] is needed on the key slice")
    if len(items) == 4 and all(isinstance(v, numbers.Real) for v in items):
        raise InputError(f"boxes must be a list of boxes; wrap a single box in a list: [{list(items)}]")
    out = []
    for i, b in enumerate(items):
        try:
            vals = list(np.asarray(b).ravel().tolist()) if not isinstance(b, (list, tuple)) else list(b)
        except Exception:
            vals = None
        if vals is None or len(vals) != 4:
            raise InputError(f"box {i} must be [x0, y0, x1, y1], got {b!r}")
        x0, y0, x1, y1 = (_as_index(v, f"box {i} coordinate") for v in vals)
        if not (0 <= x0 <= x1 < width and 0 <= y0 <= y1 < height):
            raise InputError(
                f"box {i} [{x0}, {y0}, {x1}, {y1}] is not an inclusive pixel box on a {width}×{height} slice: "
                f"need 0 ≤ x0 ≤ x1 < {width} and 0 ≤ y0 ≤ y1 < {height}"
            )
        out.append((x0, y0, x1, y1))
    return out


def check_stop_after_empty(value, what: str = "stop_after_empty") -> int:
    """``value`` as an integer K ≥ 0 (0: never stop early); :class:`InputError` otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise InputError(f"{what} must be an integer number of slices ≥ 0 (0 = never stop early), got {value!r}")
    if int(value) > MAX_STOP_AFTER_EMPTY:
        raise InputError(f"{what} {int(value)} is too large: use 0 (never stop) or at most {MAX_STOP_AFTER_EMPTY}")
    return int(value)


def _check_window_span(window) -> Optional[int]:
    if window is None:
        return None
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, numbers.Integral) or int(window) < 0:
        raise InputError(f"window must be None (whole stack) or an integer number of slices ≥ 0, got {window!r}")
    return int(window)
