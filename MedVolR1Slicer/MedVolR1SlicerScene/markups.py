"""The evidence and its corrections as markups: the key-slice boxes (ROI nodes, the anchor's
objects 1..N), correction boxes on any slice, the inside/outside points of one "MedVol points"
list, and the slice range; and the anchor rebuilt from them for Re-propagate.

Each function takes the parameter node ``p`` (the module's parameter-node wrapper) and plain
values. A correction box is a ROI node whose object and slice are the attributes
:data:`OBJECT_ATTR` and :data:`SLICE_ATTR` (saved with the scene); a point's object and sign are
its control-point label, ``+N`` or ``-N`` (saved in the markups file); the range is two slice
indices along the volume's slice axis. MRML only, no Qt."""

from __future__ import annotations

import json
from typing import Callable, List, Optional, Sequence, Tuple

import slicer

from MedVolR1SlicerLib.corrections import (MAX_OBJECTS, CorrectionBox, CorrectionPoint, build_anchor,
                                           parse_point_label, point_label, prompts_from_anchor, range_text)
from MedVolR1SlicerLib.geometry import GeometryError, RoiBox, VolumeGeometry, rois_from_anchor

from .nodes import geometry, in_scene, int_attribute, live, result_problem
from .views import interaction_node, place_in_study, red_view_centre, slice_here

OBJECT_ATTR = "MedVolR1.object"
SLICE_ATTR = "MedVolR1.slice"

Here = Callable[[], Sequence[float]]  # where "here" is: the RAS centre of the Red slice view


# ---- ROI nodes ---------------------------------------------------------------------------------

def set_roi(node, roi: RoiBox, correction: bool = False) -> None:
    """Put ROI ``node`` flat on ``roi`` (its axes, centre and size); key-slice boxes are yellow,
    correction boxes cyan."""
    node.SetAndObserveObjectToNodeMatrix(slicer.util.vtkMatrixFromArray(roi.object_to_node()))
    node.SetCenter(*[float(v) for v in roi.center])
    node.SetSize(*[float(v) for v in roi.size])
    display = node.GetDisplayNode()
    if display is not None:
        display.SetSelectedColor(*((0.2, 0.8, 1.0) if correction else (1.0, 0.8, 0.0)))
        display.SetFillOpacity(0.1)


def get_roi(node) -> RoiBox:
    """ROI ``node`` as a :class:`RoiBox` (centre, size and axes in RAS)."""
    matrix = slicer.util.arrayFromVTKMatrix(node.GetObjectToNodeMatrix())
    center = [0.0, 0.0, 0.0]
    node.GetCenter(center)
    box = RoiBox.from_object_to_node(matrix, node.GetSize())
    return RoiBox(center, box.size, box.axes)


def node_object(node, default: int = 0) -> int:
    """The object number a box is for (its ``MedVolR1.object`` attribute)."""
    return int_attribute(node, OBJECT_ATTR, default)


def node_slice(node, default: int = -1) -> int:
    """The slice a correction box was made on, along the volume's slice axis (``MedVolR1.slice``)."""
    return int_attribute(node, SLICE_ATTR, default)


def _new_roi(name: str, roi: RoiBox, obj: int, k: int, volumeNode, correction: bool):
    node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLMarkupsROINode", name)
    set_roi(node, roi, correction=correction)
    node.SetAttribute(OBJECT_ATTR, str(obj))
    node.SetAttribute(SLICE_ATTR, str(k))
    if volumeNode is not None:
        place_in_study(node, volumeNode)
    return node


def place_rois(p, rois: List[RoiBox], k: int, volumeNode=None) -> list:
    """Replace the key-slice boxes of ``p`` by one ROI node per box of ``rois`` on slice ``k``."""
    for old in p.boxes:
        if old is not None and old.GetScene() is not None:
            slicer.mrmlScene.RemoveNode(old)
    nodes = [_new_roi(f"MedVol box {i + 1}", roi, i + 1, k, volumeNode, correction=False)
             for i, roi in enumerate(rois)]
    p.boxes = nodes
    p.keySliceIJK = k
    return nodes


def place_boxes(p, volumeNode, anchor: dict) -> list:
    """One ROI node per anchor box, flat on the key slice, from ``world``; and the anchor's
    corrections (``medvol.anchor/2``: prompts, slice range), if any."""
    geo = geometry(volumeNode)
    rois, k = rois_from_anchor(geo, anchor)
    prompts, zRange = prompts_from_anchor(geo, anchor)
    p.resultVolume = volumeNode
    nodes = place_rois(p, rois, k, volumeNode)
    place_corrections(p, geo, prompts, zRange, volumeNode)
    return nodes


def anchor_from_boxes(p) -> Tuple[dict, List[str]]:
    """The anchor rebuilt from the ROI nodes, the correction boxes, the points and the slice
    range (``source: "user"``, world coordinates), and the notes on what was clamped.

    Without corrections and range it is exactly the ``medvol.anchor/1`` anchor of the boxes;
    with them, ``medvol.anchor/2`` with ``prompts`` and ``world.z_range_ras``
    (:func:`MedVolR1SlicerLib.corrections.build_anchor`). Everything the worker would refuse
    (too many objects or prompts, two boxes of an object on one slice, a correction outside
    the range, ...) raises ValueError with a message before anything is sent. Clamped boxes
    and snapped points are put back where they will be used, so what the user sees is what runs."""
    problem = result_problem(p)
    if problem:
        raise ValueError(problem)
    geo = geometry(p.resultVolume)
    keyNodes = live(p.boxes)
    if not keyNodes:
        raise ValueError("there is no box left; add one on the key slice (Add box here) or click Segment")
    corrNodes = live(p.corrections)
    pointIndices, points = point_entries(p)
    built = build_anchor(
        geo, [get_roi(n) for n in keyNodes], [node_object(n, i + 1) for i, n in enumerate(keyNodes)],
        p.keySliceIJK,
        [CorrectionBox(node_object(n), node_slice(n), get_roi(n)) for n in corrNodes],
        points, slice_range(p), query=json.loads(p.anchorJson).get("query") or p.query, reasoning=p.reasoning)
    for node, corners in zip(keyNodes, built.anchor["world"]["boxes_ras"]):
        set_roi(node, geo.roi_from_world_box(corners)[0])
    for node, corners in zip(corrNodes, built.boxes_ras):
        set_roi(node, geo.roi_from_world_box(corners)[0], correction=True)
    pointsNode = live([p.points])
    for i, centre in zip(pointIndices, built.points_ras):
        pointsNode[0].SetNthControlPointPositionWorld(i, *centre)
    return built.anchor, built.notes


# ---- objects -----------------------------------------------------------------------------------

def point_entries(p) -> Tuple[List[int], List[CorrectionPoint]]:
    """``(indices, points)``: the placed control points of "MedVol points" (those whose position
    is defined) as :class:`CorrectionPoint`, in RAS. A label that is not +N/-N raises
    GeometryError."""
    node = p.points if in_scene(p.points) else None
    indices, points = [], []
    if node is None:
        return indices, points
    for i in range(node.GetNumberOfControlPoints()):
        if node.GetNthControlPointPositionStatus(i) != node.PositionDefined:
            continue  # the point being placed (preview), or one whose position was cleared
        obj, positive = parse_point_label(node.GetNthControlPointLabel(i))
        ras = [0.0, 0.0, 0.0]
        node.GetNthControlPointPositionWorld(i, ras)
        indices.append(i)
        points.append(CorrectionPoint(obj, positive, ras))
    return indices, points


def object_numbers(p) -> List[int]:
    """The object numbers in use: the key-slice boxes', the correction boxes' and the points'."""
    numbers = {node_object(n, i + 1) for i, n in enumerate(live(p.boxes))}
    numbers |= {node_object(n) for n in live(p.corrections)}
    try:
        numbers |= {pt.object for pt in point_entries(p)[1]}
    except GeometryError:  # a renamed point: Re-propagate says so
        pass
    return sorted(n for n in numbers if n > 0)


def next_object_number(p) -> int:
    return max(object_numbers(p), default=0) + 1


def object_choices(p) -> List[Tuple[str, int]]:
    """What the Object selector offers: ``(text, number)`` for each object, the one being
    started (chosen, nothing placed yet) marked "(new)", and "New object" (0)."""
    numbers = object_numbers(p)
    choices = [(str(n), n) for n in numbers]
    if p.correctionObject > 0 and p.correctionObject not in numbers:
        choices.append((f"{p.correctionObject} (new)", p.correctionObject))
    return choices + [("New object", 0)]


def choose_object(p, number: int) -> int:
    """Choose the object Add box here and new points are for; 0 starts a new object (numbered
    now, so that every box and point added next belongs to that same object)."""
    number = int(number)
    if number <= 0:
        number = next_object_number(p)
        if len(object_numbers(p)) >= MAX_OBJECTS:
            raise GeometryError(f"there are {MAX_OBJECTS} objects already, the most that can be propagated at "
                                "once; delete the boxes and points of one first")
    p.correctionObject = number
    update_point_label_format(p)
    return number


def object_for(p, objectNumber: Optional[int]) -> int:
    """The object a new box or point is for: ``objectNumber``, else the chosen one, else a new one."""
    number = p.correctionObject if objectNumber is None else int(objectNumber)
    if number <= 0 or (number not in object_numbers(p) and len(object_numbers(p)) >= MAX_OBJECTS):
        number = choose_object(p, 0)
    return number


# ---- boxes -------------------------------------------------------------------------------------

def add_box_here(p, objectNumber: Optional[int] = None, ras=None, sliceIndex: Optional[int] = None,
                 here: Here = red_view_centre):
    """A new box flat on the slice through ``ras`` (default: ``here()``, the centre of the Red
    view), or on slice ``sliceIndex``, a quarter of the image wide, centred there (kept on the
    image), for object ``objectNumber`` (default: the chosen one, ``p.correctionObject``; a new
    one when none is chosen).

    On the key slice it is a key-slice box (the anchor's ``boxes``), allowed only for an object
    that has none there; on any other slice it is a correction box (a prompt), at most one per
    object and slice. Raises GeometryError with a message."""
    problem = result_problem(p)
    if problem:
        raise GeometryError(problem)
    geo = geometry(p.resultVolume)
    if sliceIndex is None:
        k, centre = slice_here(p.resultVolume.GetName(), geo, here() if ras is None else ras)
    else:
        k, centre = int(sliceIndex), ras
    obj = object_for(p, objectNumber)
    keyNodes, corrNodes = live(p.boxes), live(p.corrections)
    lo, hi = geo.box_around(k, centre)
    roi = geo.roi_from_voxels(lo, hi)
    if k == p.keySliceIJK:
        if obj in [node_object(n, i + 1) for i, n in enumerate(keyNodes)]:
            raise GeometryError(f"object {obj} already has its box on the key slice; move or resize that box, "
                                "or place points")
        node = _new_roi(f"MedVol box {obj}", roi, obj, k, p.resultVolume, correction=False)
        p.boxes = keyNodes + [node]
    else:
        if any(node_object(n) == obj and node_slice(n) == k for n in corrNodes):
            raise GeometryError(f"object {obj} already has a box on {geo.slice_text(k)}; move or resize it")
        node = _new_roi(f"MedVol box {obj}, slice {geo.stack_z(k) + 1}", roi, obj, k, p.resultVolume,
                        correction=True)
        p.corrections = corrNodes + [node]
    p.correctionObject = obj
    p.boxesEdited = True
    update_point_label_format(p)
    return node


def add_box(p):
    """A new box (a new object) in the middle of the key slice, a quarter of the image wide."""
    problem = result_problem(p)
    if problem:
        raise GeometryError(problem)
    return add_box_here(p, objectNumber=next_object_number(p), sliceIndex=p.keySliceIJK)


# ---- points ------------------------------------------------------------------------------------

def points_node(p, create: bool = True):
    """The "MedVol points" markups node of the result (made on first use, filed under the
    volume's study), or None."""
    node = p.points if in_scene(p.points) else None
    if node is None and create:
        problem = result_problem(p)
        if problem:
            raise GeometryError(problem)
        node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLMarkupsFiducialNode", "MedVol points")
        if node.GetDisplayNode() is None:
            node.CreateDefaultDisplayNodes()
        display = node.GetDisplayNode()
        if display is not None:
            display.SetSelectedColor(0.2, 1.0, 0.4)
        place_in_study(node, p.resultVolume)
        p.points = node
        update_point_label_format(p)
    return node


def update_point_label_format(p) -> str:
    """Points placed from now on are labelled for the chosen object and sign (``+1``, ``-2``…):
    the points node's control-point label format (saved with it)."""
    obj = p.correctionObject if p.correctionObject > 0 else next_object_number(p)
    label = point_label(obj, not p.negativePoints)
    node = p.points if in_scene(p.points) else None
    if node is not None and node.GetControlPointLabelFormat() != label:
        node.SetControlPointLabelFormat(label)
    return label


def set_negative_points(p, negative: bool) -> None:
    """New points mark the outside (negative) or the inside (positive) of the object."""
    if bool(p.negativePoints) != bool(negative):
        p.negativePoints = bool(negative)
    update_point_label_format(p)


def add_point(p, ras, positive: Optional[bool] = None, objectNumber: Optional[int] = None) -> int:
    """Add a point at ``ras``: inside (``positive``, default: the panel's sign) or outside object
    ``objectNumber`` (default: the chosen one). Returns its control-point index."""
    node = points_node(p)
    obj = object_for(p, objectNumber)
    sign = (not p.negativePoints) if positive is None else bool(positive)
    index = node.AddControlPoint(float(ras[0]), float(ras[1]), float(ras[2]), point_label(obj, sign))
    p.correctionObject = obj
    p.boxesEdited = True
    update_point_label_format(p)
    return index


def start_placing_points(p) -> bool:
    """Click to place points in the slice views (place mode stays on until stopped), labelled
    for the chosen object and sign; a new object is numbered now."""
    node = points_node(p)
    if p.correctionObject <= 0:
        choose_object(p, 0)
    update_point_label_format(p)
    logic = slicer.modules.markups.logic()
    logic.SetActiveList(node)
    return bool(logic.StartPlaceMode(True))


def stop_placing_points() -> None:
    interaction = interaction_node()
    if interaction is not None and interaction.GetCurrentInteractionMode() == interaction.Place:
        interaction.SwitchToViewTransformMode()


def placing_points(p) -> bool:
    """Whether the views are placing points into "MedVol points"."""
    interaction = interaction_node()
    selection = slicer.mrmlScene.GetSingletonNode("Singleton", "vtkMRMLSelectionNode")
    node = p.points if in_scene(p.points) else None
    return bool(interaction is not None and selection is not None and node is not None
                and interaction.GetCurrentInteractionMode() == interaction.Place
                and selection.GetActivePlaceNodeID() == node.GetID())


def point_count(p) -> int:
    node = p.points if in_scene(p.points) else None
    return node.GetNumberOfControlPoints() if node is not None else 0


# ---- the slice range ---------------------------------------------------------------------------

def set_range_end(p, which: str, ras=None, here: Here = red_view_centre) -> int:
    """Set the ``"start"`` or ``"end"`` slice of the range to the slice through ``ras`` (default:
    ``here()``, the Red view's); the order does not matter. Returns the slice index."""
    if which not in ("start", "end"):
        raise ValueError(f"which must be 'start' or 'end', got {which!r}")
    problem = result_problem(p)
    if problem:
        raise GeometryError(problem)
    geo = geometry(p.resultVolume)
    k, _ = slice_here(p.resultVolume.GetName(), geo, here() if ras is None else ras)
    if which == "start":
        p.rangeStart = k
    else:
        p.rangeEnd = k
    p.boxesEdited = True
    return k


def clear_range(p) -> None:
    if p.rangeStart >= 0 or p.rangeEnd >= 0:
        p.rangeStart = p.rangeEnd = -1
        p.boxesEdited = True


def slice_range(p) -> Optional[Tuple[int, int]]:
    """``(k0, k1)`` (sorted, along the slice axis), None when no range is set; one end only
    raises ValueError."""
    if p.rangeStart < 0 and p.rangeEnd < 0:
        return None
    if p.rangeStart < 0 or p.rangeEnd < 0:
        missing = "start" if p.rangeStart < 0 else "end"
        raise ValueError(f"the slice range has no {missing} slice: set it (Set {missing}) or clear the range")
    return tuple(sorted((p.rangeStart, p.rangeEnd)))


def range_label(p) -> str:
    """The slice range as the panel shows it: "slices 40–90 (S -20.0 to 105.0 mm)", "–"."""
    if (p.rangeStart < 0 and p.rangeEnd < 0) or p.resultVolume is None:
        return "whole volume"
    try:
        geo = geometry(p.resultVolume)
    except GeometryError:
        return "–"
    if p.rangeStart < 0 or p.rangeEnd < 0:
        k = max(p.rangeStart, p.rangeEnd)
        return f"{'end' if p.rangeStart < 0 else 'start'}: {geo.slice_text(k)}; set the other end"
    return range_text(geo, p.rangeStart, p.rangeEnd)


# ---- all corrections ---------------------------------------------------------------------------

def has_corrections(p) -> bool:
    return bool(live(p.corrections) or point_count(p) or p.rangeStart >= 0 or p.rangeEnd >= 0)


def clear_corrections(p) -> bool:
    """Remove the correction boxes, the points and the slice range. Returns whether there was
    anything to remove."""
    had = has_corrections(p) or in_scene(p.points)
    remove_corrections(p)
    if had:
        p.boxesEdited = True
    return had


def remove_corrections(p) -> None:
    if placing_points(p):
        stop_placing_points()
    for old in list(p.corrections) + [p.points]:
        if old is not None and old.GetScene() is not None:
            slicer.mrmlScene.RemoveNode(old)
    p.corrections = []
    p.points = None
    p.rangeStart = p.rangeEnd = -1


def place_corrections(p, geo: VolumeGeometry, prompts, zRange, volumeNode) -> None:
    """Replace the correction nodes by the prompts the worker ran (its anchor's ``prompts``,
    read by ``prompts_from_anchor``) and the range by its ``z_range``."""
    remove_corrections(p)
    nodes = []
    pointsNode = None
    for prompt in prompts:
        if prompt.box_ras is not None:
            roi, k = geo.roi_from_world_box(prompt.box_ras)
            name = (f"MedVol box {prompt.object}" if k == p.keySliceIJK
                    else f"MedVol box {prompt.object}, slice {geo.stack_z(k) + 1}")
            nodes.append(_new_roi(name, roi, prompt.object, k, volumeNode, correction=True))
        for ras, positive in prompt.points:
            if pointsNode is None:
                pointsNode = points_node(p)
            pointsNode.AddControlPoint(ras[0], ras[1], ras[2], point_label(prompt.object, positive))
    p.corrections = nodes
    if zRange is not None:
        p.rangeStart, p.rangeEnd = zRange
    p.correctionObject = 1 if live(p.boxes) else 0
    update_point_label_format(p)
