"""Evidence anchors: one key axial slice and 2-D boxes on it (docs/architecture.md, "Evidence anchor file").

Geometry, on the canonical slice of width ``W`` and height ``H``:

* a pixel ``(x, y)`` covers ``[x, x+1) × [y, y+1)``;
* a pixel box is the inclusive index range ``[x0, y0, x1, y1]``;
* its normalised form (0–1000, Qwen3-VL's convention) is
  ``[1000·x0/W, 1000·y0/H, 1000·(x1+1)/W, 1000·(y1+1)/H]``; converting back rounds outward
  and clamps to the slice;
* its world form is the RAS millimetre centres of its first and last voxel,
  ``(z, y0, x0)`` and ``(z, y1, x1)`` on the stack.

The anchor file (``*.anchor.json``) has schema ``medvol.anchor/1``, or ``medvol.anchor/2`` when it
carries correction prompts or a slice range (:mod:`medvolcore.prompts`), or ``medvol.anchor/3`` when
it is an *absent* anchor (``"absent": true``: the grounder answered that the target is not in this
volume; ``slice`` is null and there are no boxes), or ``medvol.anchor/4`` when a prompt is a painted
mask (``/2`` with mask prompts, :mod:`medvolcore.prompts`). Readers take all four; writers write the
lowest that holds the anchor.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

import numpy as np

from .errors import AnchorError, InputError, LimitError, VolumeError, shown
from .fileio import write_text_atomic
from .prompts import MAX_INDEX, MAX_POINTS, MAX_PROMPTS, check_prompt_fields, check_z_range, plan_objects
from .strictjson import DuplicateKeyError, unique_keys

log = logging.getLogger(__name__)

SCHEMA = "medvol.anchor/1"
SCHEMA_V2 = "medvol.anchor/2"
SCHEMA_V3 = "medvol.anchor/3"
SCHEMA_V4 = "medvol.anchor/4"
SCHEMAS = (SCHEMA, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4)
SOURCES = ("grounder", "mask", "user")
NORM = 1000.0
MAX_BOXES = 8
MIN_COMPONENT_PIXELS = 10
MIN_COMPONENT_FRACTION = 0.05
# Tolerance (in pixels) when rounding normalised coordinates outward: absorbs the rounding of
# boxes_norm as written in anchor files (6 decimals) and of integer model outputs.
_EPS = 1e-3
# Bounds on numbers read from anchors: no slice is a million pixels wide and no point of a body
# is a kilometre from the scanner's origin, so larger values (1e308, 10**400) are refused as
# errors of their field before any arithmetic can overflow.
MAX_COORD = MAX_INDEX
MAX_WORLD_MM = 1_000_000.0
# An anchor file is read only when it is at most this size (checked with stat before reading).
# The largest anchor the limits allow (8 boxes, 64 prompts with boxes, 256 points, each in pixel
# and world form, a 2000-character query, 16 kB of reasoning) is about 48 kB; mask prompts add at most
# 32,768 runs (two numbers each, under 500 kB): 1 MB holds both.
MAX_ANCHOR_FILE_BYTES = 1 << 20

Box = List[int]


# ---- box geometry ---------------------------------------------------------------------

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


def dumps(obj) -> str:
    """JSON with two-space indentation but numeric lists (boxes, points) kept on one line."""
    text = json.dumps(obj, indent=2)
    return re.sub(r"\[[-0-9.,\se+]*\]", lambda m: re.sub(r"\s+", " ", m.group(0)).replace("[ ", "[").replace(" ]", "]"), text) + "\n"


# ---- the anchor ---------------------------------------------------------------------------

def _is_text(value) -> bool:
    """A str that is valid Unicode (a lone surrogate from a JSON ``\\ud800`` escape is not)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _image_size(size) -> List[int]:
    """``[W, H]``: two whole numbers of pixels, 1 to :data:`MAX_COORD`."""
    if (isinstance(size, (str, bytes, dict)) or not hasattr(size, "__len__") or len(size) != 2
            or not all(not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating))
                       and _in_range(v, MAX_COORD) and float(v).is_integer() and v >= 1 for v in size)):
        raise AnchorError(f"image_size must be [W, H] in whole pixels (1 to {MAX_COORD:,}), got {_show(size)}")
    return [int(v) for v in size]


def _check_fields(d: dict, origin: str) -> None:
    """Types of an anchor object's fields, so a malformed one is an AnchorError, not a crash."""
    for name in ("query", "reasoning", "source"):
        v = d.get(name)
        if v is not None and not _is_text(v):
            raise AnchorError(f"{origin}: '{name}' " + ("is not valid Unicode text (a lone surrogate)" if isinstance(v, str)
                                                         else f"must be text, got {type(v).__name__}"))
    notes = d.get("notes")
    if notes is not None and not (isinstance(notes, list) and all(_is_text(n) for n in notes)):
        raise AnchorError(f"{origin}: 'notes' must be a list of texts")
    for name in ("boxes", "boxes_norm", "image_size"):
        v = d.get(name)
        if v is not None and not isinstance(v, list):
            raise AnchorError(f"{origin}: '{name}' must be a list, got {type(v).__name__}")
    for name in ("boxes", "boxes_norm"):
        v = d.get(name)
        if v is not None and len(v) > MAX_BOXES:
            raise AnchorError(f"{origin}: {len(v)} boxes; at most {MAX_BOXES} are allowed")
    world = d.get("world")
    if world is not None:
        if not isinstance(world, dict):
            raise AnchorError(f"{origin}: 'world' must be an object with 'boxes_ras', got {type(world).__name__}")
        boxes_ras = world.get("boxes_ras")
        if boxes_ras is not None and not isinstance(boxes_ras, list):
            raise AnchorError(f"{origin}: 'world.boxes_ras' must be a list of [[r, a, s], [r, a, s]] pairs")
        if boxes_ras is not None and len(boxes_ras) > MAX_BOXES:
            raise AnchorError(f"{origin}: {len(boxes_ras)} world boxes; at most {MAX_BOXES} are allowed")


@dataclass
class EvidenceAnchor:
    """A key slice (0-based ``z`` of the canonical stack), inclusive pixel boxes on it, and corrections.

    ``image_size`` is the slice's ``(W, H)`` in pixels. ``world`` (RAS) is filled by
    :meth:`with_world` when the stack is known. ``notes`` carries remarks a reader should see
    (e.g. that the model was an untrained smoke model, or that a box was reordered).
    ``propagation`` records how the anchor was last propagated (written by the pipeline:
    ``PropagationResult.stop_summary()``, i.e. early stop's K and where each direction
    stopped); it is written to the file but never read back, since it describes a past run,
    not an input.

    ``prompts`` (pixel form, see :mod:`medvolcore.prompts`) correct objects 1..N on any slice or add
    new objects; ``z_range`` limits propagation to ``[z0, z1]``. With either, the file's schema is
    ``medvol.anchor/2``; :meth:`with_world` fills each prompt's ``world`` form.

    ``absent`` (schema ``medvol.anchor/3``): the grounder answered that the target is not in this
    volume. Such an anchor has ``slice`` None, no boxes, prompts or range, and nothing to
    propagate; it keeps the query, the reasoning, the notes and the slice size (so it is still
    checked against the volume it was made for). Use :meth:`absent_for` to make one.

    What the grounder says about its own answer (written when set, never read back: like
    ``propagation`` they describe how this anchor was made, and an edited anchor is no longer
    that answer): ``signal``, the answer's token signal (``answer_mean_logprob``,
    ``answer_mean_prob``, ``answer_scored_tokens``: :meth:`QwenVLGrounder._answer_signal`);
    ``confidence``, the agreement of a consensus's samples in [0, 1], and ``samples``, each
    sampled answer in compact form (:mod:`medvolcore.consensus`). Readers of every schema accept
    these keys and ignore them.
    """

    slice: Optional[int]
    boxes: List[Box]
    image_size: Sequence[int]
    query: str = ""
    reasoning: str = ""
    source: str = "mask"
    world: Optional[dict] = None
    notes: List[str] = field(default_factory=list)
    propagation: Optional[dict] = None
    prompts: List[dict] = field(default_factory=list)
    z_range: Optional[List[int]] = None
    absent: bool = False
    signal: Optional[dict] = None
    confidence: Optional[float] = None
    samples: Optional[List[dict]] = None

    def __post_init__(self):
        if not isinstance(self.absent, bool):
            raise AnchorError(f"anchor 'absent' must be true or false, got {_show(self.absent)}")
        if self.absent:
            if self.slice is not None or self.boxes or self.prompts or self.z_range is not None:
                raise AnchorError("an absent anchor (the target is not in this volume) has no slice, boxes, prompts "
                                  "or slice range")
            self.boxes, self.prompts = [], []
            self.image_size = _image_size(self.image_size)
            if self.source not in SOURCES:
                raise AnchorError(f"anchor source must be one of {', '.join(SOURCES)}, got {self.source!r}")
            return
        if self.slice is None:
            raise AnchorError("the anchor has no slice (only an absent anchor has none)")
        if isinstance(self.slice, bool) or not isinstance(self.slice, (int, np.integer)) or self.slice < 0:
            raise AnchorError(f"anchor slice must be a non-negative integer, got {self.slice!r}")
        self.slice = int(self.slice)
        self.image_size = _image_size(self.image_size)
        if self.source not in SOURCES:
            raise AnchorError(f"anchor source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if not self.boxes:
            raise AnchorError("an anchor needs at least one box")
        if len(self.boxes) > MAX_BOXES:  # each box is tracked through every slice: bound the work
            raise AnchorError(f"the anchor has {len(self.boxes)} boxes; at most {MAX_BOXES} are allowed (one per "
                              "structure; merge or drop some)")
        w, h = self.image_size
        try:
            self.boxes = [check_box(b, w, h, f"box {i + 1}") for i, b in enumerate(self.boxes)]
        except InputError as e:
            raise AnchorError(str(e)) from None
        self.prompts = self._checked_prompts(self.prompts)
        rng = check_z_range(self.z_range, None, AnchorError)
        self.z_range = None if rng is None else list(rng)
        self.plan()

    def _checked_prompts(self, prompts) -> List[dict]:
        """Prompts with their types checked and boxes clamped to the slice (as anchor boxes are)."""
        if prompts is None:
            return []
        if not isinstance(prompts, (list, tuple)):
            raise AnchorError(f"'prompts' must be a list, got {type(prompts).__name__}")
        out = []
        for i, raw in enumerate(prompts):
            p = _pixel_prompt(raw, i, self.width, self.height, f"prompt {i + 1}")
            if isinstance(raw, dict) and isinstance(raw.get("world"), dict):
                p["world"] = raw["world"]
            out.append(p)
        return out

    def plan(self, depth: Optional[int] = None):
        """The objects to propagate (:func:`medvolcore.prompts.plan_objects`); checks every prompt rule.
        An absent anchor has none to propagate: :class:`AnchorError`."""
        if self.absent:
            raise AnchorError("this anchor says the target is not in this volume: there is nothing to propagate "
                              "(draw a box on the slice where it is to correct it)")
        return plan_objects(self.slice, self.boxes, self.pixel_prompts(), width=self.width, height=self.height,
                            depth=depth, z_range=self.z_range, error=AnchorError)

    def pixel_prompts(self) -> List[dict]:
        """The prompts without their ``world`` form (what the propagator takes)."""
        return [{k: p[k] for k in ("slice", "object", "box", "points", "mask") if k in p} for p in self.prompts]

    @property
    def schema(self) -> str:
        if self.absent:
            return SCHEMA_V3
        if any(p.get("mask") is not None for p in self.prompts):
            return SCHEMA_V4
        return SCHEMA_V2 if (self.prompts or self.z_range is not None) else SCHEMA

    @property
    def num_objects(self) -> int:
        return max([len(self.boxes)] + [p["object"] for p in self.prompts])

    @property
    def width(self) -> int:
        return self.image_size[0]

    @property
    def height(self) -> int:
        return self.image_size[1]

    @property
    def boxes_norm(self) -> List[List[float]]:
        return [box_to_norm(b, self.width, self.height) for b in self.boxes]

    # -- constructors --
    @classmethod
    def absent_for(cls, image_size: Sequence[int], **kw) -> "EvidenceAnchor":
        """An absent anchor for slices of ``image_size`` (``[W, H]``)."""
        return cls(None, [], image_size, absent=True, **kw)

    @classmethod
    def from_norm(cls, slice_index: int, boxes_norm: Iterable[Sequence[float]], image_size: Sequence[int], **kw) -> "EvidenceAnchor":
        w, h = _image_size(image_size)
        boxes = [norm_to_box(b, w, h, f"box {i + 1}") for i, b in enumerate(boxes_norm)]
        return cls(slice_index, boxes, [w, h], **kw)

    @classmethod
    def from_world(cls, world: dict, stack, **kw) -> "EvidenceAnchor":
        boxes_ras = (world or {}).get("boxes_ras")
        if not boxes_ras:
            raise AnchorError("anchor 'world' has no boxes_ras")
        zs, boxes = [], []
        for i, corners in enumerate(boxes_ras):
            z, b = ras_to_box(stack, corners, f"world box {i + 1}")
            zs.append(z)
            boxes.append(b)
        if len(set(zs)) != 1:
            raise AnchorError(f"world boxes lie on different slices ({sorted(set(zs))}); an anchor has one key slice")
        return cls(zs[0], boxes, [stack.width, stack.height], **kw).with_world(stack)

    def with_world(self, stack) -> "EvidenceAnchor":
        """Check the anchor against ``stack`` and fill ``world`` (RAS mm)."""
        if [stack.width, stack.height] != self.image_size:
            raise AnchorError(
                f"the anchor is for a {self.width}×{self.height} slice but the volume's axial slices are "
                f"{stack.width}×{stack.height}; was it made for another volume?"
            )
        if self.absent:
            self.world = None
            return self
        if not 0 <= self.slice < stack.depth:
            raise AnchorError(f"anchor slice {self.slice} is outside the stack (0..{stack.depth - 1})")
        self.plan(stack.depth)
        self.world = {
            "slice_center_ras": _slice_centre(stack, self.slice),
            "boxes_ras": [box_to_ras(stack, self.slice, b) for b in self.boxes],
        }
        if self.z_range is not None:
            self.world["z_range_ras"] = [_slice_centre(stack, z) for z in self.z_range]
        for p in self.prompts:
            if p.get("mask") is not None:  # the mask is on its slice's pixels: the world form locates the slice
                p["world"] = {"slice_center_ras": _slice_centre(stack, p["slice"])}
                continue
            pts = stack.stack_to_ras([[p["slice"], y, x] for x, y, _label in p["points"]]) if p["points"] else []
            p["world"] = {"box_ras": None if p["box"] is None else box_to_ras(stack, p["slice"], p["box"]),
                          "points_ras": [[float(v) for v in r] + [int(q[2])] for r, q in zip(pts, p["points"])]}
        return self

    # -- file format --
    def to_dict(self) -> dict:
        if self.absent:
            d = {"schema": self.schema, "absent": True, "slice": None, "boxes": [], "boxes_norm": [],
                 "image_size": list(self.image_size), "query": self.query, "reasoning": self.reasoning,
                 "source": self.source}
            if self.notes:
                d["notes"] = list(self.notes)
            return self._with_grounder_facts(d)
        d = {
            "schema": self.schema,
            "slice": self.slice,
            "boxes": [list(b) for b in self.boxes],
            "boxes_norm": [[round(v, 6) for v in b] for b in self.boxes_norm],
            "image_size": list(self.image_size),
        }
        if self.world is not None:
            d["world"] = self.world
        if self.prompts:
            d["prompts"] = [dict(p) for p in self.prompts]
        if self.z_range is not None:
            d["z_range"] = list(self.z_range)
        d.update(query=self.query, reasoning=self.reasoning, source=self.source)
        if self.notes:
            d["notes"] = list(self.notes)
        self._with_grounder_facts(d)
        if self.propagation is not None:
            d["propagation"] = self.propagation
        return d

    def _with_grounder_facts(self, d: dict) -> dict:
        """``d`` with the answer signal, the confidence and the samples, each only when set."""
        if self.signal:
            d.update(self.signal)
        if self.confidence is not None:
            d["confidence"] = round(float(self.confidence), 4)
        if self.samples is not None:
            d["samples"] = [dict(s) for s in self.samples]
        return d

    def to_json(self) -> str:
        return dumps(self.to_dict())

    def save(self, path, overwrite: bool = False) -> Path:
        return write_text_atomic(path, self.to_json(), overwrite)

    @classmethod
    def from_dict(cls, d: dict, stack=None, origin: str = "anchor") -> "EvidenceAnchor":
        """Read an anchor object. ``boxes``, ``boxes_norm`` or ``world`` may carry the boxes.

        With a ``stack``, ``world`` is used when ``boxes`` is absent, and both are checked
        against each other when both are present (an error names the disagreement).
        """
        if not isinstance(d, dict):
            raise AnchorError(f"{origin}: expected a JSON object, got {type(d).__name__}")
        if d.get("schema") not in SCHEMAS:
            raise AnchorError(f"{origin}: schema is {_show(d.get('schema'))}, expected one of {', '.join(SCHEMAS)}")
        _check_fields(d, origin)
        kw = dict(query=str(d.get("query") or ""), reasoning=str(d.get("reasoning") or ""),
                  source=d.get("source") or "user", notes=list(d.get("notes") or []))
        if d.get("absent", False) is not False or d.get("schema") == SCHEMA_V3:  # "absent": false is an ordinary anchor
            return cls._absent_from_dict(d, stack, origin, kw)
        world = d.get("world")
        kw.update(_read_corrections(d, stack, origin))
        has_boxes = d.get("boxes") is not None or d.get("boxes_norm") is not None
        if not has_boxes and world is None:
            raise AnchorError(f"{origin}: has neither 'boxes' nor 'world'")
        if not has_boxes:
            if stack is None:
                raise AnchorError(f"{origin}: has only 'world' boxes; the volume is needed to place them")
            return cls.from_world(world, stack, **kw)
        image_size = d.get("image_size")
        if image_size is None and stack is not None:
            image_size = [stack.width, stack.height]
        if image_size is None:
            raise AnchorError(f"{origin}: has no 'image_size'")
        if "slice" not in d:
            raise AnchorError(f"{origin}: has no 'slice'")
        try:
            if d.get("boxes") is not None:
                anchor = cls(d["slice"], d["boxes"], image_size, **kw)
            else:
                anchor = cls.from_norm(d["slice"], d["boxes_norm"], image_size, **kw)
        except (InputError, TypeError) as e:
            raise AnchorError(f"{origin}: {e}") from None
        except AnchorError as e:
            raise AnchorError(f"{origin}: {e}") from None
        if stack is not None:
            try:
                anchor.with_world(stack)
            except AnchorError as e:
                raise AnchorError(f"{origin}: {e}") from None
            if world is not None and world.get("boxes_ras"):
                other = cls.from_world(world, stack, **kw)
                if other.slice != anchor.slice or other.boxes != anchor.boxes:
                    raise AnchorError(
                        f"{origin}: 'boxes' (slice {anchor.slice}, {anchor.boxes}) and 'world' (slice {other.slice}, "
                        f"{other.boxes}) disagree; remove the stale one"
                    )
        elif world is not None:
            anchor.world = world
        return anchor

    @classmethod
    def _absent_from_dict(cls, d: dict, stack, origin: str, kw: dict) -> "EvidenceAnchor":
        if d.get("absent") is not True:
            raise AnchorError(f"{origin}: 'absent' must be true in a {SCHEMA_V3!r} anchor, got {_show(d.get('absent'))}"
                              if d.get("schema") == SCHEMA_V3 else
                              f"{origin}: 'absent' needs schema {SCHEMA_V3!r}, not {_show(d.get('schema'))}")
        if d.get("schema") != SCHEMA_V3:
            raise AnchorError(f"{origin}: 'absent' needs schema {SCHEMA_V3!r}, not {_show(d.get('schema'))}")
        for name in ("boxes", "boxes_norm", "prompts"):
            if d.get(name):
                raise AnchorError(f"{origin}: an absent anchor has no {name!r}; remove them or 'absent'")
        if d.get("slice") is not None or d.get("z_range") is not None:
            raise AnchorError(f"{origin}: an absent anchor has no 'slice' or 'z_range'; remove them or 'absent'")
        image_size = d.get("image_size")
        if image_size is None and stack is not None:
            image_size = [stack.width, stack.height]
        if image_size is None:
            raise AnchorError(f"{origin}: has no 'image_size'")
        try:
            anchor = cls.absent_for(image_size, **kw)
            return anchor.with_world(stack) if stack is not None else anchor
        except AnchorError as e:
            raise AnchorError(f"{origin}: {e}") from None

    @classmethod
    def load(cls, path, stack=None) -> "EvidenceAnchor":
        """Read an anchor file: at most :data:`MAX_ANCHOR_FILE_BYTES` (checked before reading),
        strict JSON (no key twice in an object, no NaN or Infinity), then :meth:`from_dict`."""
        p = Path(path)
        if not p.is_file():
            raise AnchorError(f"{p} does not exist" if not p.exists() else f"{p} is not a file")
        try:
            size = p.stat().st_size
            if size > MAX_ANCHOR_FILE_BYTES:
                raise LimitError(f"{p} is {size / 2**20:.1f} MB; an anchor file is at most "
                                 f"{MAX_ANCHOR_FILE_BYTES // 2**20} MB (is it an anchor?)")
            with open(p, "rb") as f:
                raw = f.read(MAX_ANCHOR_FILE_BYTES + 1)  # a file growing after the stat is still bounded
        except OSError as e:
            raise AnchorError(f"cannot read {p}: {e.strerror or e}") from None
        if len(raw) > MAX_ANCHOR_FILE_BYTES:
            raise LimitError(f"{p} is over {MAX_ANCHOR_FILE_BYTES // 2**20} MB; an anchor file is at most that")
        try:
            d = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys, parse_constant=_no_constant)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AnchorError(f"{p} is not valid JSON: {e}") from None
        except DuplicateKeyError as e:
            raise AnchorError(f"{p}: the key {_show(e.key)} appears more than once in one object; give each field "
                              "once") from None
        except _JSONProblem as e:
            raise AnchorError(f"{p}: {e}") from None
        except (ValueError, RecursionError) as e:  # an integer over Python's digit limit; nesting too deep
            raise AnchorError(f"{p} is not usable JSON: {_show(str(e), 120)}") from None
        return cls.from_dict(d, stack, origin=str(p))


class _JSONProblem(ValueError):
    pass


def _no_constant(name: str):
    raise _JSONProblem(f"holds {name}, which is not a finite number")


def _check_counts(prompts: list, origin: str) -> None:
    """The prompt and point limits, checked before any prompt is read (a huge list costs nothing)."""
    if len(prompts) > MAX_PROMPTS:
        raise AnchorError(f"{origin}: {len(prompts)} prompts; at most {MAX_PROMPTS} are allowed")
    n_points = 0
    for pr in prompts:
        if isinstance(pr, dict):
            for pts in (pr.get("points"), (pr.get("world") or {}).get("points_ras") if isinstance(pr.get("world"), dict) else None):
                n_points += len(pts) if isinstance(pts, list) else 0
    if n_points > 2 * MAX_POINTS:  # pixel and world forms together
        raise AnchorError(f"{origin}: too many points in the prompts; at most {MAX_POINTS} are allowed")


def _slice_centre(stack, z: int) -> List[float]:
    return [float(v) for v in stack.stack_to_ras([z, (stack.height - 1) / 2.0, (stack.width - 1) / 2.0])]


def _read_corrections(d: dict, stack, origin: str) -> dict:
    """``prompts`` and ``z_range`` of an anchor object, each from its pixel form, its world form or both
    (which must then agree); the world form needs the volume."""
    world = d.get("world") if isinstance(d.get("world"), dict) else {}
    prompts, z_range = d.get("prompts"), d.get("z_range")
    z_range_ras = world.get("z_range_ras")
    if d.get("schema") not in (SCHEMA_V2, SCHEMA_V4):
        if prompts or z_range is not None or z_range_ras is not None:
            raise AnchorError(f"{origin}: prompts and z_range need schema {SCHEMA_V2!r}, not {d.get('schema')!r}")
        return {}
    if d.get("schema") == SCHEMA_V2 and isinstance(prompts, list) and any(
            isinstance(p, dict) and p.get("mask") is not None for p in prompts):
        raise AnchorError(f"{origin}: mask prompts need schema {SCHEMA_V4!r}, not {SCHEMA_V2!r}")
    out = {}
    if z_range_ras is not None:
        if stack is None:
            if z_range is None:
                raise AnchorError(f"{origin}: has only a world z_range (z_range_ras); the volume is needed to place it")
        else:
            ras = _ras_array(z_range_ras, 3, f"{origin}: world z_range_ras", "two RAS points [[r, a, s], [r, a, s]]")
            if len(ras) != 2:
                raise AnchorError(f"{origin}: world z_range_ras must be two RAS points, one on each end slice")
            ends = sorted(_ras_points_to_stack(stack, [r], f"{origin}: z_range_ras end {i + 1}")[0] for i, r in enumerate(ras))
            if z_range is not None and list(check_z_range(z_range, None, AnchorError)) != ends:
                raise AnchorError(f"{origin}: 'z_range' {list(z_range)} and world z_range_ras (slices {ends}) disagree; "
                                  "remove the stale one")
            z_range = ends
    if z_range is not None:
        out["z_range"] = z_range
    if prompts is None:
        return out
    if not isinstance(prompts, list):
        raise AnchorError(f"{origin}: 'prompts' must be a list, got {type(prompts).__name__}")
    _check_counts(prompts, origin)
    read = []
    for i, p in enumerate(prompts):
        what = f"{origin}: prompt {i + 1}"
        if not isinstance(p, dict):
            raise AnchorError(f"{what} must be an object, got {type(p).__name__}")
        has_pixels = p.get("slice") is not None
        pw = p.get("world")
        if p.get("mask") is not None:
            read.append(_read_mask_prompt(p, i, stack, what))
            continue
        if not has_pixels and pw is None:
            raise AnchorError(f"{what} has neither 'slice' (with 'box'/'points') nor 'world'")
        if pw is not None and stack is not None:
            placed = ras_to_prompt(stack, pw, what)
            if has_pixels:
                mine = _pixel_prompt(p, i, stack.width, stack.height, what)
                if [mine["slice"], mine["box"], mine["points"]] != [placed["slice"], placed["box"], placed["points"]]:
                    raise AnchorError(f"{what}: its pixel form (slice {mine['slice']}, box {mine['box']}, points "
                                      f"{mine['points']}) and its world form (slice {placed['slice']}, box "
                                      f"{placed['box']}, points {placed['points']}) disagree; remove the stale one")
            read.append(dict(placed, object=p.get("object")))
        elif not has_pixels:
            raise AnchorError(f"{what} has only a world form; the volume is needed to place it")
        else:
            read.append({k: p.get(k) for k in ("slice", "object", "box", "points")})
    out["prompts"] = read
    return out


def _read_mask_prompt(p: dict, i: int, stack, what: str) -> dict:
    """A mask prompt of a ``/4`` anchor: its pixel slice and runs; a ``world.slice_center_ras`` must
    lie on that slice (with the volume), or gives it when the slice is absent."""
    pw = p.get("world")
    centre = pw.get("slice_center_ras") if isinstance(pw, dict) else None
    if pw is not None and centre is None:
        raise AnchorError(f"{what}: a mask prompt's 'world' is {{'slice_center_ras': [r, a, s]}}, got {_show(pw)}")
    out = {k: p.get(k) for k in ("slice", "object", "box", "points", "mask")}
    if centre is not None and stack is not None:
        z = _ras_points_to_stack(stack, _ras_array([centre], 3, what + " slice_center_ras", "[r, a, s]"), what)[0]
        if out["slice"] is not None and check_prompt_fields(out, i, AnchorError)["slice"] != z:
            raise AnchorError(f"{what}: its slice {out['slice']} and its world slice_center_ras (slice {z}) disagree; "
                              "remove the stale one")
        out["slice"] = z
    elif out["slice"] is None:
        raise AnchorError(f"{what} has no 'slice'" + (" (its world form needs the volume to place it)" if centre else ""))
    return out


# ---- targets from a mask -----------------------------------------------------------------

def slice_areas(mask: np.ndarray) -> np.ndarray:
    """Foreground pixel count per axial slice of a ``(D, H, W)`` stack mask."""
    m = np.asarray(mask)
    if m.ndim != 3:
        raise InputError(f"expected a (D, H, W) mask, got shape {m.shape}")
    return (m != 0).reshape(m.shape[0], -1).sum(axis=1)


def boxes_from_slice_mask(mask2d: np.ndarray) -> List[Box]:
    """Boxes of the 2-D 8-connected components of one slice's mask, per docs/architecture.md ("Targets from a mask").

    Components under 10 pixels or under 5 % of the largest are dropped (the largest is kept
    even when it is under 10 pixels, so a non-empty slice always yields a box); at most the 8
    largest are kept; boxes are ordered by ``x0`` then ``y0``.
    """
    from scipy import ndimage

    lab, n = ndimage.label(np.asarray(mask2d) != 0, structure=np.ones((3, 3), dtype=bool))
    if n == 0:
        return []
    sizes = np.bincount(lab.ravel())[1:]
    largest = int(sizes.max())
    keep = [i for i in range(n) if sizes[i] >= MIN_COMPONENT_PIXELS and sizes[i] >= MIN_COMPONENT_FRACTION * largest]
    if not keep:
        keep = [int(np.argmax(sizes))]
    keep = sorted(keep, key=lambda i: (-sizes[i], i))[:MAX_BOXES]
    objects = ndimage.find_objects(lab)
    boxes = []
    for i in keep:
        sy, sx = objects[i]
        boxes.append([sx.start, sy.start, sx.stop - 1, sy.stop - 1])
    return sorted(boxes, key=lambda b: (b[0], b[1]))


def rank_slices(mask: np.ndarray, candidates: Optional[Iterable[int]] = None) -> List[int]:
    """Non-empty slices by decreasing foreground area (ties: smaller ``z`` first)."""
    areas = slice_areas(mask)
    zs = range(len(areas)) if candidates is None else sorted(set(int(z) for z in candidates))
    zs = [z for z in zs if 0 <= z < len(areas) and areas[z] > 0]
    return sorted(zs, key=lambda z: (-int(areas[z]), z))


def anchor_from_mask(
    mask: np.ndarray,
    top_k: int = 1,
    rng: Union[np.random.Generator, int, None] = None,
    candidates: Optional[Iterable[int]] = None,
    stack=None,
    **kw,
) -> EvidenceAnchor:
    """The target anchor of a ``(D, H, W)`` mask on the canonical stack (Top-K visibility sampling).

    Slices are ranked by foreground area; the key slice is drawn uniformly from the top
    ``top_k`` (``top_k=1`` is deterministic: the largest, ties to the smaller ``z``).
    ``candidates`` restricts the key slice to given indices (e.g. the 64 shown slices).
    ``rng`` is a numpy Generator or a seed (default seed 0). With ``stack`` the anchor gets
    its ``world`` boxes.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise InputError(f"top_k must be an integer ≥ 1, got {top_k!r}")
    ranked = rank_slices(mask, candidates)
    if not ranked:
        raise VolumeError("the target mask is empty" + (" on the candidate slices" if candidates is not None else ""))
    pool = ranked[: int(top_k)]
    if len(pool) == 1:
        z = pool[0]
    else:
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(0 if rng is None else int(rng))
        z = pool[int(gen.integers(len(pool)))]
    m = np.asarray(mask)
    anchor = EvidenceAnchor(z, boxes_from_slice_mask(m[z]), [m.shape[2], m.shape[1]], source=kw.pop("source", "mask"), **kw)
    return anchor.with_world(stack) if stack is not None else anchor


__all__ = [
    "SCHEMA", "SCHEMA_V2", "SCHEMA_V3", "SCHEMA_V4", "SCHEMAS", "EvidenceAnchor", "anchor_from_mask", "boxes_from_slice_mask", "rank_slices", "slice_areas",
    "check_box", "box_to_norm", "norm_to_box", "box_iou", "box_to_ras", "ras_to_box", "ras_to_prompt",
]
