"""Which nodes: a volume that can be segmented, its geometry, the result's volume and
segmentation, and whether a node is still in the scene. MRML only, no Qt."""

from __future__ import annotations

from typing import List

import slicer
import vtk

from MedVolR1SlicerLib.geometry import VolumeGeometry, check_untransformed
from MedVolR1SlicerLib.segments import segment_name


def geometry(volumeNode) -> VolumeGeometry:
    """``volumeNode``'s IJK grid and IJK→RAS; a volume under a transform raises GeometryError."""
    check_untransformed(volumeNode.GetParentTransformNode() is not None)
    m = vtk.vtkMatrix4x4()
    volumeNode.GetIJKToRASMatrix(m)
    return VolumeGeometry(slicer.util.arrayFromVTKMatrix(m), volumeNode.GetImageData().GetDimensions())


def volume_problem(volumeNode) -> str:
    """Why ``volumeNode`` cannot be segmented ('' when it can): a label map, a vector or
    tensor volume, or a volume without voxels. The worker reads one scalar per voxel."""
    if volumeNode is None:
        return "choose a CT volume first"
    name = volumeNode.GetName()
    if volumeNode.IsA("vtkMRMLLabelMapVolumeNode"):
        return f"{name} is a label map, not a CT; choose the CT volume"
    if volumeNode.IsA("vtkMRMLVectorVolumeNode") or volumeNode.IsA("vtkMRMLTensorVolumeNode"):
        return f"{name} has several values per voxel (a colour, vector or tensor volume), not a CT"
    image = volumeNode.GetImageData()
    if image is None or min(image.GetDimensions()) < 1:
        return f"{name} has no voxels"
    if image.GetNumberOfScalarComponents() != 1:
        return f"{name} has {image.GetNumberOfScalarComponents()} values per voxel, not one; choose a CT"
    return ""


def first_usable_volume():
    """The first volume in the scene that can be segmented (not a label map or a vector
    volume), or None: what the panel selects when nothing is selected yet."""
    for node in slicer.util.getNodesByClass("vtkMRMLScalarVolumeNode"):
        if not volume_problem(node):
            return node
    return None


def in_scene(node) -> bool:
    """``node`` is in ``slicer.mrmlScene`` now (not removed, not of a closed scene)."""
    return node is not None and node.GetScene() is slicer.mrmlScene and slicer.mrmlScene.IsNodePresent(node)


def live(nodes) -> List:
    """The nodes of ``nodes`` still in the scene (a deleted one may linger as None or as a node
    already removed)."""
    return [n for n in nodes if in_scene(n)]


def reference_volume(segmentationNode):
    """The volume whose grid ``segmentationNode`` was made on (None if not known)."""
    return segmentationNode.GetNodeReference(segmentationNode.GetReferenceImageGeometryReferenceRole())


def result_problem(p) -> str:
    """Why the boxes in parameter node ``p`` cannot be edited or re-propagated ('' when they
    can): no result yet, or the input volume is not the one they were drawn on."""
    if not p.anchorJson or p.keySliceIJK < 0:
        return "segment first: there is no key slice to put the boxes on"
    if p.resultVolume is None:
        return "the volume of the last result is no longer in the scene; click Segment"
    if p.inputVolume is not p.resultVolume:
        other = p.inputVolume.GetName() if p.inputVolume is not None else "no volume"
        return (f"the boxes were drawn on {p.resultVolume.GetName()}, but the input volume is now {other}; "
                f"select {p.resultVolume.GetName()} again to edit or re-propagate them, or click Segment")
    return ""


def existing_segment_id(p) -> str:
    """ID of the segment a new result for ``p.query`` would collide with ('' if none; several
    queries, one per line, each add a segment)."""
    if p.outputSegmentation is None or len([q for q in p.query.splitlines() if q.strip()]) > 1:
        return ""
    return p.outputSegmentation.GetSegmentation().GetSegmentIdBySegmentName(segment_name(p.query)) or ""


def int_attribute(node, name: str, default: int) -> int:
    """``node``'s attribute ``name`` as an int, ``default`` when it is missing or not a number."""
    try:
        return int(node.GetAttribute(name))
    except (TypeError, ValueError):
        return default
