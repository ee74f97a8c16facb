"""The scene around a result: where it is filed (subject hierarchy), what the views show (the
key slice, the 3D surface, the Red view's slice), and the Segment Editor's parameter node. MRML
only, no Qt."""

from __future__ import annotations

import json
from typing import List, Tuple

import slicer

from MedVolR1SlicerLib.geometry import GeometryError, VolumeGeometry

from .nodes import geometry


def place_in_study(node, volumeNode) -> None:
    """Put ``node`` in the subject hierarchy beside ``volumeNode`` (under its study), so the
    result is listed with the patient and study it was made from."""
    sh = slicer.vtkMRMLSubjectHierarchyNode.GetSubjectHierarchyNode(slicer.mrmlScene)
    if sh is None:
        return
    volumeItem = sh.GetItemByDataNode(volumeNode)
    if not volumeItem:
        return
    parent = sh.GetItemParent(volumeItem)
    if not parent or parent == sh.GetSceneItemID():
        return
    item = sh.GetItemByDataNode(node)  # Slicer's application makes one for each new node
    if item:
        sh.SetItemParent(item, parent)
    else:
        sh.CreateItem(parent, node)


def set_show_3d(p, show: bool) -> bool:
    """Show the result's segmentation as a surface in the 3D view (or stop). Returns whether a
    surface is shown."""
    seg = p.outputSegmentation
    if seg is None:
        return False
    if show:
        seg.CreateClosedSurfaceRepresentation()
    else:
        seg.RemoveClosedSurfaceRepresentation()
    return bool(show)


def shows_surface(p) -> bool:
    """Whether the result's segmentation (``p.outputSegmentation``) has a closed-surface
    representation, i.e. shows as a surface in the 3D view (made here, in the Segment Editor or
    in the Segmentations module)."""
    seg = p.outputSegmentation if p is not None else None
    if seg is None or seg.GetScene() is None:
        return False
    name = slicer.vtkSegmentationConverter.GetSegmentationClosedSurfaceRepresentationName()
    return bool(seg.GetSegmentation().ContainsRepresentation(name))


def segment_editor_node(p):
    """A Segment Editor parameter node set to the result: its segmentation, the CT as the
    source volume and the new segment selected (what "Edit in Segment Editor" opens)."""
    if p.outputSegmentation is None or not p.segmentId:
        raise ValueError("segment first: there is no result to edit")
    node = slicer.mrmlScene.GetSingletonNode("SegmentEditor", "vtkMRMLSegmentEditorNode")
    if node is None:
        node = slicer.vtkMRMLSegmentEditorNode()
        node.SetSingletonTag("SegmentEditor")
        node = slicer.mrmlScene.AddNode(node)
    node.SetAndObserveSegmentationNode(p.outputSegmentation)
    volume = p.resultVolume or p.inputVolume
    if hasattr(node, "SetAndObserveSourceVolumeNode"):
        node.SetAndObserveSourceVolumeNode(volume)
    else:  # Slicer before 5.2 named it the master volume
        node.SetAndObserveMasterVolumeNode(volume)
    node.SetSelectedSegmentID(p.segmentId)
    return node


def key_slice_text(p) -> str:
    """The key slice as Slicer's axial slice view shows its position (S in mm), and as the
    model saw it, counted from the bottom: "S 112.5 mm (slice 17 of 30)"."""
    if not p.anchorJson or p.keySlice < 0:
        return "–"
    s = float(json.loads(p.anchorJson)["world"]["slice_center_ras"][2])
    of = ""
    if p.resultVolume is not None:
        try:
            geo = geometry(p.resultVolume)
            of = f" of {geo.shape[geo.slice_axis]}"
        except GeometryError:  # put under a transform since: the count is left out, not the panel
            pass
    return f"S {s:.1f} mm (slice {p.keySlice + 1}{of})"


def show_key_slice(volumeNode, anchor: dict) -> None:
    """``volumeNode`` in the slice views, centred on the anchor's key slice."""
    slicer.util.setSliceViewerLayers(background=volumeNode)
    r, a, s = anchor["world"]["slice_center_ras"]
    slicer.modules.markups.logic().JumpSlicesToLocation(r, a, s, True)


def jump_to_key_slice(p) -> bool:
    """Show the key slice of the last result in the slice views."""
    if not p.anchorJson or p.resultVolume is None:
        return False
    show_key_slice(p.resultVolume, json.loads(p.anchorJson))
    return True


def red_slice_node():
    """The Red (axial) slice view's node, or None."""
    for node in slicer.util.getNodesByClass("vtkMRMLSliceNode"):
        if node.GetLayoutName() == "Red":
            return node
    return None


def red_slice_centre(node) -> List[float]:
    """RAS of the centre of what slice node ``node`` (the Red view's: :func:`red_slice_node`)
    shows; GeometryError when there is none."""
    import numpy as np

    if node is None:
        raise GeometryError("there is no Red (axial) slice view to take the slice from")
    dims = node.GetDimensions()
    xy = np.array([dims[0] / 2.0, dims[1] / 2.0, 0.0, 1.0])
    return [float(v) for v in (slicer.util.arrayFromVTKMatrix(node.GetXYToRAS()) @ xy)[:3]]


def slice_here(volumeName: str, geo: VolumeGeometry, ras) -> Tuple[int, List[float]]:
    """The slice (index along the slice axis) through ``ras`` and that point; GeometryError when
    the point lies on no slice of the volume (named ``volumeName`` in the message)."""
    ras = [float(v) for v in ras]
    k = geo.slice_of(ras)
    if not 0 <= k < geo.depth:
        raise GeometryError(f"the Red slice view shows no slice of {volumeName}; scroll it onto the volume first")
    return k, ras


def red_view_centre() -> List[float]:
    """RAS of the centre of what the Red slice view shows."""
    return red_slice_centre(red_slice_node())


def interaction_node():
    """The scene's interaction node (place mode or view mode), or None."""
    return slicer.mrmlScene.GetSingletonNode("Singleton", "vtkMRMLInteractionNode")
