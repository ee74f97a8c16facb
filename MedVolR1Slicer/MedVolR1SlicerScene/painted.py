"""A painted slice as a prompt: the slices of a result's segment the clinician repainted.

When a result is put into the scene, :func:`remember_result` keeps a short digest of each of the
segment's slices (along the volume's slice axis) in the segment's tag ``MedVolR1.resultSlices``,
which is saved with the segmentation. When Re-propagate builds its request,
:func:`add_mask_prompts` finds the slices whose voxels differ from that result (painted or erased
in the Segment Editor), takes each one's mask on the volume's grid, turns it into MedVolCore's
canonical slice (the stack's ``z``, rows ``y`` A→P, columns ``x`` R→L) and adds it to the anchor
as a mask prompt (``medvol.anchor/4``: ``{"slice", "object", "mask": {"runs"}, "world":
{"slice_center_ras"}}``) for the object chosen in the panel (or the only one). A painted slice
that cannot be a prompt — erased empty, outside the slice range, one of too many, for an object
that does not exist, or sharing its slice with a box or point of the same object — raises
ValueError with the message the panel shows; nothing is sent. MRML and numpy only, no Qt."""

from __future__ import annotations

import hashlib
import json
from typing import List, Optional, Tuple

import numpy as np
import slicer
import vtk

from MedVolR1SlicerLib.corrections import MAX_OBJECTS

from .markups import object_numbers
from .nodes import geometry, in_scene

TAG = "MedVolR1.resultSlices"
SCHEMA_V4 = "medvol.anchor/4"
MAX_PAINTED_SLICES = 16  # the engine's limit on mask prompts in one anchor


def _labelmap(segNode, segmentId: str, volumeNode) -> np.ndarray:
    """The segment's voxels on the volume's grid (KJI, as ``slicer.util.arrayFromVolume``)."""
    arr = slicer.util.arrayFromSegmentBinaryLabelmap(segNode, segmentId, volumeNode)
    want = tuple(reversed(volumeNode.GetImageData().GetDimensions()))
    if arr is None or tuple(arr.shape) != want:
        raise ValueError(f"the segment's voxels are not on the grid of {volumeNode.GetName()} "
                         f"({None if arr is None else tuple(arr.shape)} instead of {want}); "
                         "a painted slice must lie on the volume's own voxels")
    return arr


def _by_slice(arr: np.ndarray, geo) -> np.ndarray:
    """``arr`` (KJI) with the volume's slice axis first."""
    return np.moveaxis(arr, 2 - geo.slice_axis, 0)


def slice_digests(arr: np.ndarray, geo) -> List[str]:
    """One short digest per slice along the slice axis of a KJI mask."""
    return [hashlib.blake2b(np.packbits(s != 0).tobytes() + bytes(str(s.shape), "ascii"), digest_size=6).hexdigest()
            for s in _by_slice(arr, geo)]


def _segment(p, segNode=None, segmentId: Optional[str] = None):
    segNode = p.outputSegmentation if segNode is None else segNode
    segmentId = p.segmentId if segmentId is None else segmentId
    if not in_scene(segNode) or not segmentId:
        return None, "", None
    return segNode, segmentId, segNode.GetSegmentation().GetSegment(segmentId)


def remember_result(p, segNode=None, segmentId: Optional[str] = None, volumeNode=None) -> bool:
    """Keep the digests of the result's segment (default: ``p``'s) in its tag. False when there is none."""
    segNode, segmentId, segment = _segment(p, segNode, segmentId)
    volumeNode = p.resultVolume if volumeNode is None else volumeNode
    if segment is None or volumeNode is None:
        return False
    digests = slice_digests(_labelmap(segNode, segmentId, volumeNode), geometry(volumeNode))
    segment.SetTag(TAG, ",".join(digests))
    return True


def result_digests(segNode, segmentId: str) -> str:
    """The result digests kept in the segment's tag ("" when none): what Undo and Redo keep with a mask."""
    segment = segNode.GetSegmentation().GetSegment(segmentId) if in_scene(segNode) and segmentId else None
    tagged = vtk.reference("")
    return tagged.get() if segment is not None and segment.GetTag(TAG, tagged) else ""


def painted_slices(p, segNode=None, segmentId: Optional[str] = None, volumeNode=None) -> List[int]:
    """The slices (indices along the volume's slice axis) whose voxels differ from the last result
    of the segment; empty when nothing changed or no result of it is known."""
    segNode, segmentId, segment = _segment(p, segNode, segmentId)
    volumeNode = p.resultVolume if volumeNode is None else volumeNode
    if segment is None or volumeNode is None:
        return []
    tagged = vtk.reference("")
    if not segment.GetTag(TAG, tagged) or not tagged.get():
        return []
    then = tagged.get().split(",")
    now = slice_digests(_labelmap(segNode, segmentId, volumeNode), geometry(volumeNode))
    if len(then) != len(now):
        raise ValueError("the segment's volume changed since the result; Segment again")
    return [k for k, (a, b) in enumerate(zip(then, now)) if a != b]


_LAST: dict = {}  # the last answer of segment_painted and what it was for (ids and a modification time)


def segment_painted(p) -> bool:
    """Whether a slice of ``p``'s result segment was painted since the result (what enables
    Re-propagate without a moved box); computed again only after the segmentation changed."""
    segNode, segmentId, segment = _segment(p)
    volumeNode = p.resultVolume
    if segment is None or volumeNode is None:
        return False
    labelmap = segment.GetRepresentation(slicer.vtkSegmentationConverter.GetBinaryLabelmapRepresentationName())
    key = (segNode.GetID(), segmentId, segNode.GetMTime(), labelmap.GetMTime() if labelmap is not None else 0,
           volumeNode.GetID())
    if _LAST.get("key") != key:
        try:
            value = bool(painted_slices(p))
        except ValueError:  # Re-propagate says why
            value = True
        _LAST.clear()
        _LAST.update(key=key, value=value)
    return _LAST["value"]


def canonical_slice(arr: np.ndarray, geo, k: int) -> Tuple[int, np.ndarray]:
    """``(z, mask)``: slice ``k`` (along the slice axis) of a KJI mask as MedVolCore's canonical slice
    ``z``, a boolean ``(H, W)`` array (rows ``y`` A→P, columns ``x`` R→L)."""
    stack = np.transpose(np.transpose(arr, (2, 1, 0)), geo.stack_axes)  # IJK, then the stack's z, y, x
    for axis, ijk_axis in enumerate(geo.stack_axes):
        if geo.against_stack[ijk_axis]:
            stack = np.flip(stack, axis=axis)
    z = geo.stack_z(k)
    return z, np.array(stack[z] != 0)


def mask_runs(mask: np.ndarray) -> List[int]:
    """Row-major foreground runs ``[start, length, ...]`` of a 2-D mask (the anchor's form)."""
    flat = np.concatenate(([False], np.asarray(mask, dtype=bool).ravel(), [False]))
    edges = np.flatnonzero(flat[1:] != flat[:-1])
    return np.stack([edges[0::2], edges[1::2] - edges[0::2]], axis=1).ravel().astype(int).tolist()


def _object(p, segmentName: str) -> int:
    numbers = object_numbers(p)
    obj = int(p.correctionObject)
    if obj <= 0:
        if len(numbers) == 1:
            return numbers[0]
        raise ValueError(f"“{segmentName}” has {len(numbers)} objects: choose the one your painting corrects "
                         "(Object) and click Re-propagate again")
    if obj not in numbers and (obj != max(numbers, default=0) + 1 or len(numbers) >= MAX_OBJECTS):
        raise ValueError(f"object {obj} does not exist (the objects are {', '.join(map(str, numbers))}); "
                         "choose one of them, or New object")
    return obj


def _prompted_slices(anchor: dict, geo, obj: int) -> set:
    """The slices (along the slice axis) where the anchor's prompts of object ``obj`` lie."""
    out = set()
    for pr in anchor.get("prompts") or []:
        if pr.get("object") != obj:
            continue
        w = pr.get("world") or {}
        ras = ([w["box_ras"][0]] if w.get("box_ras") else []) + [pt[:3] for pt in w.get("points_ras") or []]
        out |= {geo.slice_of(r) for r in ras}
    return out


def earlier_mask_prompts(p) -> List[dict]:
    """The mask prompts the last result ran with (its anchor, ``p.anchorJson``): painted slices of
    earlier rounds, sent again until the segment is segmented anew."""
    try:
        last = json.loads(p.anchorJson or "{}")
    except ValueError:
        return []
    prompts = last.get("prompts") if isinstance(last, dict) else None
    return [dict(pr) for pr in prompts or [] if isinstance(pr, dict) and pr.get("mask") is not None]


def add_mask_prompts(p, anchor: dict, segNode=None, segmentId: Optional[str] = None) -> dict:
    """``anchor`` (what Re-propagate sends) with a mask prompt for each slice of the segment (default:
    ``p``'s) painted since the result, and the earlier rounds' painted slices not painted again
    (:func:`earlier_mask_prompts`); unchanged when there are none. ValueError (the panel's message)
    for a painted slice that cannot be a prompt; then nothing is sent."""
    volumeNode = p.resultVolume
    painted = painted_slices(p, segNode, segmentId, volumeNode)
    geo = geometry(volumeNode) if volumeNode is not None else None
    earlier = [pr for pr in earlier_mask_prompts(p) if geo is not None and isinstance(pr.get("slice"), int)
               and geo.slice_of_stack_z(pr["slice"]) not in painted]
    if not painted and not earlier:
        return anchor
    for pr in earlier:
        k = geo.slice_of_stack_z(pr["slice"])
        if k in _prompted_slices(anchor, geo, pr.get("object")):
            raise ValueError(f"object {pr.get('object')} has a box or point on {geo.slice_text(k)}, which was "
                             "painted in an earlier round; a painted slice is the object's only prompt there: "
                             "delete that box or point, or paint that slice again")
    out = dict(anchor, schema=SCHEMA_V4)
    out["prompts"] = list(anchor.get("prompts") or []) + earlier
    if not painted:
        return out
    segNode, segmentId, segment = _segment(p, segNode, segmentId)
    name = segment.GetName()
    if len(painted) + len(earlier) > MAX_PAINTED_SLICES:
        raise ValueError(f"“{name}” was edited on {len(painted)} slices since the result; a painted slice is a "
                         f"prompt of its own (at most {MAX_PAINTED_SLICES} in all): keep the outline you fixed and "
                         "undo the other edits in the Segment Editor")
    obj = _object(p, name)
    lo, hi = p.rangeStart, p.rangeEnd
    prompted = _prompted_slices(anchor, geo, obj)
    arr = _labelmap(segNode, segmentId, volumeNode)
    prompts = []
    for k in painted:
        where = geo.slice_text(k)
        if lo >= 0 and hi >= 0 and not min(lo, hi) <= k <= max(lo, hi):
            raise ValueError(f"“{name}” was painted on {where}, outside the slice range; widen the range or "
                             "clear it")
        z, mask = canonical_slice(arr, geo, k)
        if not mask.any():
            raise ValueError(f"“{name}” is empty on {where} since your edit: a painted slice is the object's "
                             "outline there; paint it, or undo the erase in the Segment Editor")
        if k in prompted:
            raise ValueError(f"object {obj} has a box or point on {where}, where “{name}” was painted; a painted "
                             "slice is the object's only prompt there: delete that box or point")
        prompts.append({"slice": z, "object": obj, "box": None, "points": [], "mask": {"runs": mask_runs(mask)},
                        "world": {"slice_center_ras": geo.slice_center_ras(k)}})
    out["prompts"] += prompts
    return out
