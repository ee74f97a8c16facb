"""Corrections of a result, as the panel sends them: boxes on any slice, positive and negative
points, and a slice range (the ``prompts`` and ``z_range`` of schema ``medvol.anchor/2``).

Plain Python on :class:`~.geometry.VolumeGeometry`, no Slicer. The panel writes the world form
only (RAS millimetres, as it writes the key-slice boxes): each prompt is
``{"object": k, "world": {"box_ras": [[r, a, s], [r, a, s]] | null, "points_ras": [[r, a, s, label], ...]}}``
with the box given by the RAS centres of its first and last voxel and each point by its voxel's
centre; the slice range is ``world.z_range_ras``, the centres of its two end slices. The worker
places them on its own stack. An anchor with neither prompts nor a range stays
``medvol.anchor/1``, exactly as :func:`~.geometry.anchor_from_rois` writes it.

Object numbers. The panel numbers objects as the user sees them (stored on the nodes); the
anchor's objects 1..N are the key-slice boxes in their order, then every other object numbered
N+1, N+2, ... in increasing panel number (no gaps). A point's sign and object are its
control-point label, ``+N`` (inside object N) or ``-N`` (outside it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .geometry import GeometryError, RoiBox, VolumeGeometry, anchor_from_rois

SCHEMA_V2 = "medvol.anchor/2"
MAX_OBJECTS = 8  # as the worker: every object is tracked through every slice
MAX_PROMPTS = 64

_POINT_LABEL = re.compile(r"^\s*([+\-\u2212])\s*(\d+)\s*$")


def point_label(obj: int, positive: bool) -> str:
    """The control-point label of a point: ``+2`` (inside object 2) or ``-2`` (outside it)."""
    return f"{'+' if positive else '-'}{int(obj)}"


def parse_point_label(text) -> Tuple[int, bool]:
    """``(object, positive)`` from a label such as ``+1`` or ``-2`` (a typographic minus too)."""
    m = _POINT_LABEL.match(str(text or ""))
    if not m or int(m.group(2)) < 1:
        raise GeometryError(f"a point is labelled {str(text)!r}: a MedVol point's label is +N (inside object N) "
                            "or -N (outside it); rename or delete it")
    return int(m.group(2)), m.group(1) == "+"


@dataclass
class CorrectionBox:
    """A box the user added off the key slice (or for a new object): its panel object number,
    the slice it was made on (index along the volume's slice axis) and the ROI as it is now."""

    object: int
    slice: int
    roi: RoiBox


@dataclass
class CorrectionPoint:
    """A point: its panel object number, its sign and its RAS position as it is now."""

    object: int
    positive: bool
    ras: Sequence[float]


@dataclass
class BuiltAnchor:
    """What :func:`build_anchor` returns: the anchor, the notes on what was clamped, and where
    each correction box and point was put (so the nodes can be put there too: what the user
    sees is what runs)."""

    anchor: dict
    notes: List[str]
    boxes_ras: List[List[List[float]]]  # per CorrectionBox given: its world box on its slice
    points_ras: List[List[float]]  # per CorrectionPoint given: its voxel's centre
    objects: Dict[int, int] = field(default_factory=dict)  # panel object number -> anchor object number


@dataclass
class Prompt:
    """One prompt read back from an anchor: object (anchor numbering), slice index along the
    volume's slice axis, the world box or None, and the points as ``(ras, positive)``."""

    object: int
    slice: int
    box_ras: Optional[List[List[float]]]
    points: List[Tuple[List[float], bool]]


def build_anchor(geometry: VolumeGeometry, key_rois: Sequence[RoiBox], key_objects: Sequence[int], key_slice: int,
                 boxes: Sequence[CorrectionBox] = (), points: Sequence[CorrectionPoint] = (),
                 z_range: Optional[Tuple[int, int]] = None, query: str = "", reasoning: str = "") -> BuiltAnchor:
    """The anchor for Re-propagate: the key-slice boxes as :func:`anchor_from_rois` writes them,
    plus (schema ``medvol.anchor/2``) one prompt per object and slice and the slice range.

    ``key_objects`` are the panel's object numbers of ``key_rois`` (the anchor's objects 1..N);
    ``z_range`` is ``(k0, k1)``, slice indices along the volume's slice axis, in either order.
    Raises :class:`GeometryError` with a message for the user on anything the worker would
    refuse: more than :data:`MAX_OBJECTS` objects or :data:`MAX_PROMPTS` prompts, two boxes of
    one object on one slice, a new object with only negative points, a point outside the volume,
    the key slice or a prompt outside the range.
    """
    anchor, notes = anchor_from_rois(geometry, key_rois, key_slice, query=query, reasoning=reasoning)
    n_key = len(key_rois)
    if len(key_objects) != n_key:
        raise ValueError("one object number per key-slice box is needed")
    objects: Dict[int, int] = {}
    for i, obj in enumerate(key_objects):
        objects.setdefault(int(obj), i + 1)

    placed_boxes: List[List[List[float]]] = []
    for b in boxes:
        if not 0 <= b.slice < geometry.depth:
            raise GeometryError(f"the box of object {b.object} was made on a slice outside this volume (index "
                                f"{b.slice}); delete it")
        where = geometry.slice_text(b.slice)
        corners, n = geometry.box_from_roi(b.roi, b.slice, f"the box of object {b.object} on {where}", where="its slice")
        placed_boxes.append(corners)
        notes.extend(n)
    placed_points: List[Tuple[int, List[float]]] = []
    for pt in points:
        placed_points.append(geometry.point_voxel(pt.ras, f"point {point_label(pt.object, pt.positive)}"))

    new = sorted(({b.object for b in boxes} | {p.object for p in points}) - set(objects))
    for i, obj in enumerate(new):
        objects[obj] = n_key + 1 + i
    total = n_key + len(new)
    if total > MAX_OBJECTS:
        raise GeometryError(f"{total} objects: at most {MAX_OBJECTS} can be propagated at once; delete the boxes "
                            "and points of an object")
    panel_number = {v: k for k, v in objects.items()}

    # one prompt per (object, slice): that slice's box (at most one) and all its points
    groups: Dict[Tuple[int, int], dict] = {}
    for order, (b, corners) in enumerate(zip(boxes, placed_boxes)):
        obj = objects[b.object]
        if obj <= n_key and b.slice == key_slice:
            raise GeometryError(f"object {b.object} already has its box on the key slice, "
                                f"{geometry.slice_text(key_slice)}: move or resize that box instead (points may be "
                                "added there)")
        g = groups.setdefault((obj, b.slice), {"box": None, "points": [], "order": order})
        if g["box"] is not None:
            raise GeometryError(f"object {b.object} has two boxes on {geometry.slice_text(b.slice)}; delete one")
        g["box"] = corners
    for order, (pt, (k, centre)) in enumerate(zip(points, placed_points)):
        g = groups.setdefault((objects[pt.object], k), {"box": None, "points": [], "order": len(boxes) + order})
        g["points"].append(centre + [1 if pt.positive else 0])

    if z_range is not None:
        lo, hi = sorted(int(k) for k in z_range)
        if lo < 0 or hi >= geometry.depth:
            raise GeometryError(f"the slice range lies outside this volume (0..{geometry.depth - 1}); set it again "
                                "or clear it")
        span = range_text(geometry, lo, hi)
        if not lo <= key_slice <= hi:
            raise GeometryError(f"the key slice, {geometry.slice_text(key_slice)}, lies outside the slice range "
                                f"({span}); the range must contain it: set the range again or clear it")
        for (obj, k) in sorted(groups):
            if not lo <= k <= hi:
                raise GeometryError(f"a correction of object {panel_number[obj]} on {geometry.slice_text(k)} lies "
                                    f"outside the slice range ({span}); delete it or widen the range")

    prompts = []
    for obj in sorted({o for o, _ in groups}):
        mine = [(k, g) for (o, k), g in groups.items() if o == obj]
        # a new object starts where its first prompt is: one with a box, else one with a positive point
        mine.sort(key=lambda kg: (kg[1]["box"] is None, not any(p[3] for p in kg[1]["points"]), kg[1]["order"]))
        first = mine[0][1]
        if obj > n_key and first["box"] is None and not any(p[3] for p in first["points"]):
            raise GeometryError(f"object {panel_number[obj]} has only negative (-) points: add a box (Add box here) "
                                "or a positive (+) point for it")
        for _, g in mine:
            prompts.append({"object": obj, "world": {"box_ras": g["box"], "points_ras": g["points"]}})
    if len(prompts) > MAX_PROMPTS:
        raise GeometryError(f"{len(prompts)} corrections (one per object and slice): at most {MAX_PROMPTS} can be "
                            "sent; delete some")

    if prompts or z_range is not None:
        anchor["schema"] = SCHEMA_V2
        if prompts:
            anchor["prompts"] = prompts
        if z_range is not None:
            anchor["world"]["z_range_ras"] = geometry.range_ras(lo, hi)
    return BuiltAnchor(anchor, notes, placed_boxes, [c for _, c in placed_points], objects)


def range_text(geometry: VolumeGeometry, k0: int, k1: int) -> str:
    """A slice range as the panel shows it: ``slices 40–90 (S -20.0 to 105.0 mm)``, numbered as
    the key slice's label counts (the stack's ``z`` + 1)."""
    z0, z1 = sorted((geometry.stack_z(k0) + 1, geometry.stack_z(k1) + 1))
    s0, s1 = sorted((geometry.slice_center_ras(k0)[2], geometry.slice_center_ras(k1)[2]))
    return f"slices {z0}\u2013{z1} (S {s0:.1f} to {s1:.1f} mm)"


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise GeometryError(f"{what} must be an integer, got {value!r}")
    return int(value)


def prompts_from_anchor(geometry: VolumeGeometry, anchor: dict) -> Tuple[List[Prompt], Optional[Tuple[int, int]]]:
    """The prompts and the slice range of an anchor the worker sent back (what ran), placed on
    ``geometry``: from each prompt's ``world`` form, or from its pixel form (``slice``, ``box``,
    ``points`` on the canonical stack) when it has none. ``z_range`` likewise from
    ``world.z_range_ras`` or ``z_range``. A ``/1`` anchor gives ``([], None)``; mask prompts
    (``/4``, painted slices) are skipped: they have no node."""
    anchor = anchor or {}
    out: List[Prompt] = []
    for i, prompt in enumerate(anchor.get("prompts") or []):
        what = f"the anchor's prompt {i + 1}"
        if not isinstance(prompt, dict):
            raise GeometryError(f"{what} is not an object")
        if prompt.get("mask") is not None:  # a painted slice: the segment itself shows it, no node
            continue
        obj = _int(prompt.get("object"), f"{what}'s object")
        if obj < 1:
            raise GeometryError(f"{what}'s object must be 1 or more, got {obj}")
        world = prompt.get("world")
        box_ras, points, ks = None, [], []
        if isinstance(world, dict):
            if world.get("box_ras") is not None:
                k, _, _ = geometry.voxel_box(world["box_ras"])
                box_ras = [[float(v) for v in c] for c in world["box_ras"]]
                ks.append(k)
            for p in world.get("points_ras") or []:
                if not isinstance(p, (list, tuple)) or len(p) != 4 or p[3] not in (0, 1):
                    raise GeometryError(f"{what} has a point {p!r}; a world point is [r, a, s, 0 or 1]")
                ras = [float(v) for v in p[:3]]
                ks.append(geometry.slice_of(ras))
                points.append((ras, p[3] == 1))
        else:
            z = _int(prompt.get("slice"), f"{what}'s slice")
            if prompt.get("box") is not None:
                x0, y0, x1, y1 = (_int(v, f"{what}'s box") for v in prompt["box"])
                ijk = geometry.stack_to_ijk([[z, y0, x0], [z, y1, x1]])
                box_ras = [[float(v) for v in geometry.to_ras(c)] for c in ijk]
                ks.append(geometry.slice_of_stack_z(z))
            for p in prompt.get("points") or []:
                if not isinstance(p, (list, tuple)) or len(p) != 3 or p[2] not in (0, 1):
                    raise GeometryError(f"{what} has a point {p!r}; a point is [x, y, 0 or 1]")
                ras = [float(v) for v in geometry.to_ras(geometry.stack_to_ijk([z, _int(p[1], what), _int(p[0], what)]))]
                points.append((ras, p[2] == 1))
            ks.append(geometry.slice_of_stack_z(z))
        if box_ras is None and not points:
            raise GeometryError(f"{what} has neither a box nor a point")
        if len(set(ks)) != 1:
            raise GeometryError(f"{what}'s box and points lie on different slices")
        if not 0 <= ks[0] < geometry.depth:
            raise GeometryError(f"{what} lies outside this volume")
        out.append(Prompt(obj, ks[0], box_ras, points))

    z_range = None
    world = anchor.get("world") or {}
    if world.get("z_range_ras") is not None:
        ends = world["z_range_ras"]
        if not isinstance(ends, (list, tuple)) or len(ends) != 2:
            raise GeometryError("the anchor's world.z_range_ras must be two RAS points")
        z_range = tuple(sorted(geometry.slice_of(e) for e in ends))
    elif anchor.get("z_range") is not None:
        z0, z1 = (_int(z, "the anchor's z_range") for z in anchor["z_range"])
        z_range = tuple(sorted((geometry.slice_of_stack_z(z0), geometry.slice_of_stack_z(z1))))
    if z_range is not None and not (0 <= z_range[0] and z_range[1] < geometry.depth):
        raise GeometryError("the anchor's slice range lies outside this volume")
    return out, z_range
