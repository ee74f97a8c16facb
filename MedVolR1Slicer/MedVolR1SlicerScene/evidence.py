"""Each segment's own evidence: the anchor, its boxes, the correction boxes and points, the slice
range, the reasoning and the confidence of the result that made the segment.

The evidence of a segment is kept in an *evidence node*: a ``vtkMRMLScriptedModuleNode`` (hidden
from editors, saved with the scene) with the attribute :data:`EVIDENCE_ATTR`, a node reference
``segmentation``, the parameter ``segmentId``, one parameter per plain field of :data:`FIELDS` and
node references for the markups (:data:`NODE_FIELDS`, :data:`LIST_FIELDS`); MRML renumbers the
references when a scene is imported, and segment IDs are kept in ``.seg.nrrd``, so the evidence
finds its segment again after a ``.mrb`` is saved and reopened. The module's parameter node shows
the evidence of one segment, the selected one (``outputSegmentation``/``segmentId``): the
parameter node holds that segment's evidence (it is what the panel edits) and
:func:`select_segment` writes it back to its evidence node before it loads another's. Another
kind of evidence (a painted slice used as a prompt, say) is one more entry in these tables.

The parameter node says whose evidence it holds (``evidenceSegmentation``/``segmentId``), so the
selection has one answer: whatever changed the Output segmentation (the user, Qt's selector
when a node is removed or created, a script, a scene closed or imported) or removed the segment,
:func:`follow_selection` makes the evidence shown that of the selected segment again, or shows
none, and says why. An evidence node is made only for a segment that exists.

A *snapshot* (:func:`snapshot`) is a segment's evidence as plain data, what Undo and Redo put
back with :func:`restore`. MRML only, no Qt."""

from __future__ import annotations

from typing import Optional

import slicer

from MedVolR1SlicerLib.geometry import RoiBox

from .markups import OBJECT_ATTR, SLICE_ATTR, get_roi, node_object, node_slice, set_roi
from .nodes import in_scene, live
from .views import place_in_study

EVIDENCE_ATTR = "MedVolR1.evidence"
SEGMENTATION_ROLE = "segmentation"

# the parameter node's plain evidence fields and their "no evidence" values
FIELDS = {"anchorJson": "", "reasoning": "", "confidence": "", "keySlice": -1, "keySliceIJK": -1,
          "rangeStart": -1, "rangeEnd": -1, "boxesEdited": False, "agreementSegmentId": "", "correctionObject": 0}
NODE_FIELDS = {"resultVolume": "volume", "points": "points"}  # one node each: field -> reference role
LIST_FIELDS = {"boxes": "box", "corrections": "correction"}  # lists of ROI nodes: field -> reference role


def _text(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _value(text: str, default):
    if isinstance(default, bool):
        return text == "true"
    if isinstance(default, int):
        try:
            return int(text)
        except (TypeError, ValueError):
            return default
    return text or ""


def _same(a, b) -> bool:
    return a is not None and b is not None and a.GetID() == b.GetID()


def evidence_nodes(segNode=None) -> list:
    """The evidence nodes in the scene (of ``segNode`` only, when given)."""
    found = []
    for node in slicer.util.getNodesByClass("vtkMRMLScriptedModuleNode"):
        if node.GetAttribute(EVIDENCE_ATTR) is None:
            continue
        if segNode is None or _same(node.GetNodeReference(SEGMENTATION_ROLE), segNode):
            found.append(node)
    return found


def find(segNode, segmentId: str):
    """The evidence node of segment ``segmentId`` of ``segNode``, or None."""
    if segNode is None or not segmentId:
        return None
    for node in evidence_nodes(segNode):
        if node.GetParameter("segmentId") == segmentId:
            return node
    return None


def shows(p, segNode, segmentId: str) -> bool:
    """Whether ``p`` holds the evidence of segment ``segmentId`` of ``segNode``."""
    return _same(p.evidenceSegmentation, segNode) and p.segmentId == segmentId


def segment_of(segNode, segmentId: str):
    """The segment ``segmentId`` of ``segNode`` (None when either is gone)."""
    if not in_scene(segNode) or not segmentId:
        return None
    return segNode.GetSegmentation().GetSegment(segmentId)


def has_evidence(p, segNode, segmentId: str) -> bool:
    """Whether the segment has a result's evidence (shown in ``p`` or kept in its evidence node)."""
    if shows(p, segNode, segmentId) and segmentId:
        return bool(p.anchorJson)
    node = find(segNode, segmentId)
    return node is not None and bool(node.GetParameter("anchorJson"))


def _markups(node) -> list:
    """The markups nodes an evidence node refers to."""
    found = [node.GetNthNodeReference(role, i) for role in LIST_FIELDS.values()
             for i in range(node.GetNumberOfNodeReferences(role))]
    found.append(node.GetNodeReference(NODE_FIELDS["points"]))
    return [n for n in found if n is not None]


def shown_markups(p) -> list:
    return live(list(p.boxes) + list(p.corrections) + [p.points])


def store(p) -> None:
    """Write the evidence ``p`` shows into the evidence node of its segment (made when missing,
    and only for a segment that exists); nothing when ``p`` shows no segment's evidence."""
    segNode, segmentId = p.evidenceSegmentation, p.segmentId
    if not in_scene(segNode) or not segmentId or not p.anchorJson:
        return
    node = find(segNode, segmentId)
    if node is None:
        if segment_of(segNode, segmentId) is None:  # never an evidence node for a segment that is not there
            return
        node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLScriptedModuleNode", "MedVol evidence")
        node.SetHideFromEditors(True)
        node.SetAttribute(EVIDENCE_ATTR, "1")
        node.SetNodeReferenceID(SEGMENTATION_ROLE, segNode.GetID())
        node.SetParameter("segmentId", segmentId)
    segment = segNode.GetSegmentation().GetSegment(segmentId)
    was = node.StartModify()
    try:
        if segment is not None:
            node.SetName(f"MedVol evidence: {segment.GetName()}")
        for name in FIELDS:
            node.SetParameter(name, _text(getattr(p, name)))
        for name, role in NODE_FIELDS.items():
            value = getattr(p, name)
            node.SetNodeReferenceID(role, value.GetID() if in_scene(value) else None)
        for name, role in LIST_FIELDS.items():
            node.RemoveNodeReferenceIDs(role)
            for n in live(getattr(p, name)):
                node.AddNodeReferenceID(role, n.GetID())
    finally:
        node.EndModify(was)


def load(p, node) -> None:
    """Show the evidence of evidence node ``node`` in ``p`` (None: no evidence)."""
    for name, default in FIELDS.items():
        value = default if node is None else _value(node.GetParameter(name), default)
        if getattr(p, name) != value:
            setattr(p, name, value)
    for name, role in NODE_FIELDS.items():
        setattr(p, name, None if node is None else node.GetNodeReference(role))
    for name, role in LIST_FIELDS.items():
        nodes = [] if node is None else [node.GetNthNodeReference(role, i)
                                         for i in range(node.GetNumberOfNodeReferences(role))]
        setattr(p, name, [n for n in nodes if n is not None])


def _show(nodes, visible: bool) -> None:
    for n in nodes:
        display = n.GetDisplayNode()
        if display is not None and bool(display.GetVisibility()) != visible:
            display.SetVisibility(visible)


def select_segment(p, segNode, segmentId: str) -> None:
    """Show the evidence of segment ``segmentId`` of ``segNode`` in ``p`` (none when it has none,
    or when there is no such segment): the evidence ``p`` showed goes back to its evidence node
    first, the markups of the other segments of ``segNode`` are hidden and the selected
    segment's are shown. ``segNode`` becomes the Output segmentation (None: no segment shown)."""
    if segment_of(segNode, segmentId) is None:
        segmentId = ""
    if not (shows(p, segNode, segmentId) and _same(p.outputSegmentation, segNode)):
        store(p)
        previous = shown_markups(p)
        node = find(segNode, segmentId)
        p.segmentId = segmentId or ""
        load(p, node)
        p.evidenceSegmentation = segNode
        if segNode is not None and not _same(p.outputSegmentation, segNode):
            p.outputSegmentation = segNode
        _show([n for n in previous if n not in shown_markups(p)], False)
    if segNode is not None:
        for other in evidence_nodes(segNode):
            if other.GetParameter("segmentId") != segmentId:
                _show(_markups(other), False)
    _show(shown_markups(p), True)


def forget_shown(p) -> None:
    """``p`` shows no segment's evidence (the nodes stay in the scene, with their evidence node)."""
    store(p)
    p.segmentId = ""
    load(p, None)
    p.evidenceSegmentation = p.outputSegmentation


def _segment_name(segNode, segmentId: str) -> str:
    segment = segment_of(segNode, segmentId)
    return segment.GetName() if segment is not None else segmentId


def follow_selection(p) -> str:
    """Make the evidence ``p`` shows that of its selection again, after anything changed the
    Output segmentation or removed the segment shown; returns the line that says what is shown
    now and why ('' when nothing changed). On another segmentation the segment of the same ID
    is shown only when that segmentation has its own evidence for it (a clone has none), else
    its first segment with evidence, else none."""
    seg, segmentId = p.outputSegmentation, p.segmentId
    if seg is None:
        if p.evidenceSegmentation is None and not segmentId and not p.anchorJson:
            return ""
        select_segment(p, None, "")
        return "No output segmentation is selected: no evidence is shown, and Re-propagate is off."
    if _same(p.evidenceSegmentation, seg):
        if segment_of(seg, segmentId) is not None or not (segmentId or p.anchorJson):
            return ""
        select_segment(p, seg, "")  # the segment shown was removed
        return (f"The segment whose evidence was shown is no longer in {seg.GetName()}: no evidence is shown, and "
                "Re-propagate is off until a segment with a result's evidence is selected.")
    chosen = segmentId if find(seg, segmentId) is not None and segment_of(seg, segmentId) is not None else ""
    if not chosen:
        kept = [n.GetParameter("segmentId") for n in evidence_nodes(seg) if n.GetParameter("anchorJson")]
        chosen = next((sid for sid in kept if segment_of(seg, sid) is not None), "")
    select_segment(p, seg, chosen)
    if p.anchorJson:
        return f"Output segmentation {seg.GetName()}: showing the evidence of “{_segment_name(seg, chosen)}”."
    return (f"Output segmentation {seg.GetName()} has no result's evidence: Re-propagate is off until you click "
            "Segment or select a segment a result made.")


def prune() -> None:
    """Remove the evidence nodes (and their markups) of segmentations that are gone."""
    for node in slicer.util.getNodesByClass("vtkMRMLScriptedModuleNode"):
        if node.GetAttribute(EVIDENCE_ATTR) is not None and not in_scene(node.GetNodeReference(SEGMENTATION_ROLE)):
            for n in _markups(node):
                if n.GetScene() is not None:
                    slicer.mrmlScene.RemoveNode(n)
            slicer.mrmlScene.RemoveNode(node)


# ---- snapshots (Undo, Redo) -------------------------------------------------------------------

def _roi_record(n) -> dict:
    roi = get_roi(n)
    return {"name": n.GetName(), "center": [float(v) for v in roi.center], "size": [float(v) for v in roi.size],
            "axes": roi.axes, "object": node_object(n), "slice": node_slice(n)}


def snapshot(p, segNode, segmentId: str) -> Optional[dict]:
    """The segment's evidence as plain data (None when it has none): what :func:`restore` puts back."""
    if shows(p, segNode, segmentId):
        store(p)
    node = find(segNode, segmentId)
    if node is None or not node.GetParameter("anchorJson"):
        return None
    rois = {role: [_roi_record(node.GetNthNodeReference(role, i))
                   for i in range(node.GetNumberOfNodeReferences(role)) if node.GetNthNodeReference(role, i)]
            for role in LIST_FIELDS.values()}
    points = node.GetNodeReference(NODE_FIELDS["points"])
    pts = None
    if points is not None:
        pts = {"name": points.GetName(), "format": points.GetControlPointLabelFormat(), "points": []}
        for i in range(points.GetNumberOfControlPoints()):
            if points.GetNthControlPointPositionStatus(i) != points.PositionDefined:
                continue
            ras = [0.0, 0.0, 0.0]
            points.GetNthControlPointPositionWorld(i, ras)
            pts["points"].append((points.GetNthControlPointLabel(i), ras))
    return {"fields": {name: node.GetParameter(name) for name in FIELDS},
            "volume": node.GetNodeReference(NODE_FIELDS["resultVolume"]), "rois": rois, "points": pts}


def remove(segNode, segmentId: str) -> None:
    """Remove the segment's evidence node and the markups it refers to."""
    node = find(segNode, segmentId)
    if node is None:
        return
    for n in _markups(node):
        if n.GetScene() is not None:
            slicer.mrmlScene.RemoveNode(n)
    slicer.mrmlScene.RemoveNode(node)


def _new_roi(record: dict, volume, correction: bool):
    n = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLMarkupsROINode", record["name"])
    set_roi(n, RoiBox(record["center"], record["size"], record["axes"]), correction=correction)
    n.SetAttribute(OBJECT_ATTR, str(record["object"]))
    n.SetAttribute(SLICE_ATTR, str(record["slice"]))
    if in_scene(volume):
        place_in_study(n, volume)
    return n


def restore(p, segNode, segmentId: str, snap: Optional[dict]) -> None:
    """Put the segment's evidence back as ``snap`` (None: no evidence): its current evidence node
    and markups are removed, new ones made from ``snap``. ``p`` shows it when the segment is the
    selected one."""
    selected = shows(p, segNode, segmentId)
    if selected:
        load(p, None)  # nothing of p refers to the nodes removed next
    remove(segNode, segmentId)
    if snap is not None:
        volume = snap["volume"]
        node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLScriptedModuleNode", "MedVol evidence")
        node.SetHideFromEditors(True)
        node.SetAttribute(EVIDENCE_ATTR, "1")
        node.SetNodeReferenceID(SEGMENTATION_ROLE, segNode.GetID())
        node.SetParameter("segmentId", segmentId)
        for name, text in snap["fields"].items():
            node.SetParameter(name, text)
        if in_scene(volume):
            node.SetNodeReferenceID(NODE_FIELDS["resultVolume"], volume.GetID())
        for role, records in snap["rois"].items():
            for record in records:
                node.AddNodeReferenceID(role, _new_roi(record, volume, role == "correction").GetID())
        if snap["points"] is not None:
            points = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLMarkupsFiducialNode", snap["points"]["name"])
            if points.GetDisplayNode() is None:
                points.CreateDefaultDisplayNodes()
            display = points.GetDisplayNode()
            if display is not None:
                display.SetSelectedColor(0.2, 1.0, 0.4)
            for label, ras in snap["points"]["points"]:
                points.AddControlPoint(ras[0], ras[1], ras[2], label)
            points.SetControlPointLabelFormat(snap["points"]["format"])
            if in_scene(volume):
                place_in_study(points, volume)
            node.SetNodeReferenceID(NODE_FIELDS["points"], points.GetID())
        if selected:
            load(p, node)
        else:
            _show(_markups(node), False)
