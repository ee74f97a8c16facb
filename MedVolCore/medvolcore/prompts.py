"""Correction prompts: boxes and points on any slice, new objects and a slice range.

What ``medvol.anchor/2`` adds to an anchor (``docs/architecture.md``, "Correction prompts"), in
pixel form on the canonical stack:

* a prompt is ``{"slice": z, "object": k, "box": [x0, y0, x1, y1] | None, "points": [[x, y,
  label], ...]}``: ``object`` is 1-based; ``k`` ≤ N (the key slice's boxes) corrects that object,
  N+1, N+2, … add new objects, numbered without gaps, whose first prompt needs a box or a
  positive point; ``label`` 1 = inside, 0 = outside; at most one box per object and slice (the
  key-slice box of objects 1..N counts);
* ``z_range = (z0, z1)``, inclusive: propagation stays inside it; the key slice and every prompt
  lie inside it.

What ``medvol.anchor/4`` adds: a *mask prompt* ``{"slice": z, "object": k, "mask": {"runs": [s0,
n0, s1, n1, ...]}}``, a painted outline of object ``k`` on slice ``z`` that sam2 receives with
``add_new_mask``. ``runs`` are the mask's foreground runs in row-major order on the ``W × H``
slice: pixel ``(x, y)`` is index ``y·W + x``; each run is a start and a length ≥ 1, starts
increasing, with at least one background pixel between two runs (one encoding per mask). A mask
prompt has no box or points, and it is its object's only input on its slice: it replaces the
key-slice box of objects 1..N on the key slice, and no other prompt of that object may share its
slice. A new object may start with a mask.

:func:`plan_objects` turns a key slice, its boxes and the prompts into one
:class:`ObjectPrompts` per object: its start slice and, per prompted slice, the box and points
sam2 receives there. Everything here is plain Python: no numpy array, no model.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Type

from .errors import InputError, MedVolError, shown

__all__ = ["MAX_INDEX", "MAX_MASK_PROMPTS", "MAX_MASK_RUNS", "MAX_OBJECTS", "MAX_POINTS", "MAX_PROMPTS", "ObjectPrompts",
           "check_mask_runs", "check_prompt_fields", "check_z_range", "plan_objects"]

MAX_OBJECTS = 8  # each object is tracked through every slice: bound the work (as anchor boxes)
MAX_PROMPTS = 64
MAX_POINTS = 256  # in all prompts together
MAX_INDEX = 1_000_000  # slices, objects and pixel indices: no stack is this large
MAX_MASK_PROMPTS = 16  # painted slices in one request
MAX_MASK_RUNS = 32_768  # foreground runs in all mask prompts together (a 512² outline has about a thousand)


@dataclass
class ObjectPrompts:
    """One object's prompts: where its propagation starts and what sam2 gets on each prompted slice.

    ``frames`` maps a slice to ``(box or None, [(x, y, label), ...])``, in the order the slices
    were first prompted. ``seeded_by_key`` is true for objects 1..N (the key slice's boxes).
    ``masks`` maps a slice with a mask prompt to its runs (its ``frames`` entry is then
    ``(None, [])``: the mask is the object's only input there).
    """

    number: int
    start: int
    frames: "OrderedDict[int, Tuple[Optional[Tuple[int, int, int, int]], List[Tuple[int, int, int]]]]" = field(
        default_factory=OrderedDict)
    seeded_by_key: bool = True
    masks: "dict" = field(default_factory=dict)

    @property
    def slices(self) -> List[int]:
        return sorted(self.frames)


def _index(v, what: str, error: Type[MedVolError]) -> int:
    """A slice, object or pixel index: a whole number within ±MAX_INDEX (a huge or non-finite
    number is refused as an error of its field, never converted)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise error(f"{what} must be an integer, got {_show(v)}")
    if isinstance(v, numbers.Integral):
        if not -MAX_INDEX <= int(v) <= MAX_INDEX:
            raise error(f"{what} is out of range ({_show(v)}); indices are at most {MAX_INDEX:,}")
        return int(v)
    f = float(v)
    if not math.isfinite(f) or abs(f) > MAX_INDEX:
        raise error(f"{what} is out of range ({_show(v)}); indices are finite and at most {MAX_INDEX:,}")
    if f.is_integer():
        return int(f)
    raise error(f"{what} must be an integer, got {_show(v)}")


def _show(value, limit: int = 30) -> str:
    return shown(value, limit)


def check_z_range(z_range, depth: Optional[int] = None, error: Type[MedVolError] = InputError) -> Optional[Tuple[int, int]]:
    """``z_range`` as ``(z0, z1)`` with ``0 <= z0 <= z1 < depth``, or None when absent."""
    if z_range is None:
        return None
    if isinstance(z_range, (str, bytes, dict)) or not hasattr(z_range, "__len__") or len(z_range) != 2:
        raise error(f"z_range must be two slice indices [z0, z1], got {_show(z_range, 60)}")
    z0, z1 = (_index(v, "z_range", error) for v in z_range)
    if z0 < 0 or z1 < z0:
        raise error(f"z_range [{z0}, {z1}] is not a slice range: need 0 <= z0 <= z1")
    if depth is not None and z1 >= depth:
        raise error(f"z_range [{z0}, {z1}] reaches outside the stack (0..{depth - 1})")
    return z0, z1


def check_prompt_fields(prompt, i: int, error: Type[MedVolError] = InputError) -> dict:
    """A pixel-form prompt's types: ``{"slice", "object", "box", "points"}`` with integers.

    Returns a new dict with ``box`` a list of 4 ints or None and ``points`` a list of ``[x, y,
    label]`` ints; slice bounds and box bounds are checked later, against the slice.
    """
    what = f"prompt {i + 1}"
    if not isinstance(prompt, dict):
        raise error(f"{what} must be an object {{slice, object, box, points}}, got {type(prompt).__name__}")
    for name in ("slice", "object"):
        if prompt.get(name) is None:
            raise error(f"{what} has no '{name}'")
    z = _index(prompt["slice"], f"{what}: slice", error)
    k = _index(prompt["object"], f"{what}: object", error)
    if z < 0:
        raise error(f"{what}: slice {z} is negative")
    if k < 1:
        raise error(f"{what}: object {k} is not an object number (1, 2, …)")
    if prompt.get("mask") is not None:
        if prompt.get("box") is not None or prompt.get("points"):
            raise error(f"{what}: a mask prompt has no box or points (sam2 takes either a mask or clicks on a "
                        "slice); give them as another prompt on another slice")
        return {"slice": z, "object": k, "box": None, "points": [], "mask": {"runs": _runs(prompt["mask"], what, error)}}
    box = prompt.get("box")
    if box is not None:
        if isinstance(box, (str, bytes, dict)) or not hasattr(box, "__len__") or len(box) != 4:
            raise error(f"{what}: box must be [x0, y0, x1, y1] or null, got {_show(box, 60)}")
        box = [_index(v, f"{what}: box coordinate", error) for v in box]
    points = prompt.get("points") or []
    if not isinstance(points, (list, tuple)):
        raise error(f"{what}: points must be a list of [x, y, label], got {type(points).__name__}")
    pts = []
    for j, p in enumerate(points):
        if isinstance(p, (str, bytes, dict)) or not hasattr(p, "__len__") or len(p) != 3:
            raise error(f"{what}: point {j + 1} must be [x, y, label], got {_show(p, 60)}")
        x, y, label = (_index(v, f"{what}: point {j + 1}", error) for v in p)
        if label not in (0, 1):
            raise error(f"{what}: point {j + 1} has label {label}; use 1 (inside) or 0 (outside)")
        pts.append([x, y, label])
    if box is None and not pts:
        raise error(f"{what} has neither a box nor a point")
    return {"slice": z, "object": k, "box": box, "points": pts}


def _runs(mask, what: str, error: Type[MedVolError]) -> List[int]:
    """A mask prompt's ``{"runs": [...]}``: whole numbers, an even count (types only; bounds later)."""
    runs = mask.get("runs") if isinstance(mask, dict) else None
    if not isinstance(runs, (list, tuple)) or (isinstance(mask, dict) and set(mask) - {"runs"}):
        raise error(f"{what}: mask must be {{\"runs\": [start, length, ...]}} (row-major foreground runs), got "
                    f"{_show(mask, 60)}")
    if len(runs) > 2 * MAX_MASK_RUNS:
        raise error(f"{what}: mask has {len(runs) // 2:,} runs; at most {MAX_MASK_RUNS:,} are allowed")
    if len(runs) % 2:
        raise error(f"{what}: mask runs come in pairs [start, length, ...]; got {len(runs)} numbers")
    return [_index(v, f"{what}: mask run", error) for v in runs]


def check_mask_runs(runs: Sequence[int], width: int, height: int, what: str = "mask",
                    error: Type[MedVolError] = InputError) -> Tuple[int, ...]:
    """Runs ``[s0, n0, s1, n1, ...]`` of a non-empty mask on the ``width × height`` slice (see the module's
    docstring), as a tuple; :class:`InputError` (or ``error``) names the first broken rule."""
    if not runs:
        raise error(f"{what} is empty: paint the object on the slice (a mask prompt needs at least one pixel)")
    end, size = -1, width * height
    for i in range(0, len(runs), 2):
        s, n = int(runs[i]), int(runs[i + 1])
        if n < 1 or s < 0:
            raise error(f"{what}: run {i // 2 + 1} [{s}, {n}] needs a start ≥ 0 and a length ≥ 1")
        if s <= end:
            raise error(f"{what}: run {i // 2 + 1} starts at {s}, not after the previous run (which ends at {end - 1}); "
                        "runs are increasing with a gap between them")
        end = s + n
        if end > size:
            raise error(f"{what}: run {i // 2 + 1} ends at pixel {end - 1}, outside the {width}×{height} slice "
                        f"({size} pixels): is the mask for another image size?")
    return tuple(int(v) for v in runs)


def plan_objects(key_slice: int, boxes: Sequence[Sequence[int]], prompts: Sequence[dict], *,
                 width: int, height: int, depth: Optional[int] = None, z_range=None,
                 error: Type[MedVolError] = InputError) -> List[ObjectPrompts]:
    """One :class:`ObjectPrompts` per object, checking every rule of the prompts.

    ``boxes`` (objects 1..N, on ``key_slice``) are taken as valid inclusive pixel boxes. Prompt
    boxes must lie inside the ``width × height`` slice (an anchor clamps them before), points
    too. ``error`` is the exception class raised (``AnchorError`` for files).
    """
    prompts = list(prompts or [])
    if len(prompts) > MAX_PROMPTS:
        raise error(f"{len(prompts)} prompts; at most {MAX_PROMPTS} are allowed (merge some, or propagate in rounds)")
    n_points = sum(len(p.get("points") or []) for p in prompts if isinstance(p, dict) and hasattr(p.get("points"), "__len__"))
    if n_points > MAX_POINTS:
        raise error(f"{n_points} points in the prompts; at most {MAX_POINTS} are allowed")
    masks = [p for p in prompts if isinstance(p, dict) and p.get("mask") is not None]
    if len(masks) > MAX_MASK_PROMPTS:
        raise error(f"{len(masks)} mask prompts; at most {MAX_MASK_PROMPTS} are allowed")
    n_runs = sum(len(m["mask"]["runs"]) // 2 for m in masks
                 if isinstance(m["mask"], dict) and isinstance(m["mask"].get("runs"), (list, tuple)))
    if n_runs > MAX_MASK_RUNS:
        raise error(f"{n_runs:,} runs in the mask prompts; at most {MAX_MASK_RUNS:,} are allowed in all")
    rng = check_z_range(z_range, depth, error)
    n = len(boxes)
    objects = [ObjectPrompts(i + 1, key_slice, OrderedDict([(key_slice, (tuple(int(v) for v in b), []))]))
               for i, b in enumerate(boxes)]
    if rng is not None and not rng[0] <= key_slice <= rng[1]:
        raise error(f"the key slice {key_slice} lies outside z_range [{rng[0]}, {rng[1]}]")
    for i, raw in enumerate(prompts):
        p = check_prompt_fields(raw, i, error)
        what = f"prompt {i + 1}"
        z, k, box, pts = p["slice"], p["object"], p["box"], p["points"]
        if depth is not None and z >= depth:
            raise error(f"{what}: slice {z} is outside the stack (0..{depth - 1})")
        if rng is not None and not rng[0] <= z <= rng[1]:
            raise error(f"{what}: slice {z} lies outside z_range [{rng[0]}, {rng[1]}]")
        runs = None
        if p.get("mask") is not None:
            runs = check_mask_runs(p["mask"]["runs"], width, height, f"{what}: mask", error)
        if box is not None:
            x0, y0, x1, y1 = box
            if not (0 <= x0 <= x1 < width and 0 <= y0 <= y1 < height):
                raise error(f"{what}: box {box} is not an inclusive pixel box on the {width}×{height} slice "
                            f"(need 0 <= x0 <= x1 < {width} and 0 <= y0 <= y1 < {height})")
        for j, (x, y, _label) in enumerate(pts):
            if not (0 <= x < width and 0 <= y < height):
                raise error(f"{what}: point {j + 1} ({x}, {y}) lies outside the {width}×{height} slice")
        if k > len(objects) + 1:
            raise error(f"{what}: object {k} does not exist; the anchor has {len(objects)} objects "
                        f"({n} key-slice boxes), so a new one is number {len(objects) + 1}")
        if k == len(objects) + 1:
            if len(objects) >= MAX_OBJECTS:
                raise error(f"{what}: a new object {k} would make more than {MAX_OBJECTS} objects")
            if runs is None and box is None and not any(label == 1 for _x, _y, label in pts):
                raise error(f"{what}: the first prompt of new object {k} needs a box or an inside (positive) point, "
                            "or a mask")
            objects.append(ObjectPrompts(k, z, OrderedDict(), seeded_by_key=False))
        obj = objects[k - 1]
        key_box_only = obj.seeded_by_key and z == key_slice and not obj.frames[z][1] and z not in obj.masks
        if z in obj.masks or (runs is not None and z in obj.frames and not key_box_only):
            raise error(f"{what}: object {k} has a mask prompt and another prompt on slice {z}; a mask is its "
                        "object's only input on its slice (paint the correction into the mask, or use another slice)")
        if runs is not None:  # the mask replaces the key-slice box of objects 1..N on the key slice
            obj.frames[z] = (None, [])
            obj.masks[z] = runs
            continue
        old_box, old_pts = obj.frames.get(z, (None, []))
        if box is not None and old_box is not None:
            where = "the key slice, where its anchor box is" if obj.seeded_by_key and z == key_slice else f"slice {z}"
            raise error(f"{what}: object {k} already has a box on {where}; one box per object and slice "
                        "(move that box, or add points)")
        obj.frames[z] = (tuple(box) if box is not None else old_box, old_pts + [tuple(q) for q in pts])
    return objects
