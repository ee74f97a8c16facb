"""The module's parameter node: what the panel shows and what a result leaves in the scene
(saved with it). The evidence fields (those :mod:`.evidence` lists: the key slice, boxes,
corrections, range, reasoning, confidence, ...) are those of the selected segment
(``outputSegmentation``/``segmentId``); each segment keeps its own in an evidence node. Slicer's ``parameterNodeWrapper`` keeps each field on the module's singleton
``vtkMRMLScriptedModuleNode``: plain values as parameters, nodes as node references. A spin box
bound to a field takes its range from the field's ``WithinRange`` (Slicer's GUI connector), so
every bounded number says its bounds here.

The worker (local or remote) and the remote address are not here: they are the application's
settings (``MedVolR1SlicerPanel/worker_settings.py``), never a scene's, so opening a scene can
never choose where a CT is sent. Versions before that saved them as the parameters ``worker`` and
``remoteUrl``; :func:`drop_worker_settings` removes them from a scene that carries them."""

from typing import Annotated

from slicer import vtkMRMLMarkupsFiducialNode, vtkMRMLMarkupsROINode, vtkMRMLScalarVolumeNode, vtkMRMLSegmentationNode
from slicer.parameterNodeWrapper import WithinRange, parameterNodeWrapper

from MedVolR1SlicerLib import params
from MedVolR1SlicerLib.consensus import MAX_CONSENSUS


@parameterNodeWrapper
class MedVolR1SlicerParameterNode:
    inputVolume: vtkMRMLScalarVolumeNode
    query: str = ""
    preset: str = params.DEFAULTS["preset"]
    adapter: str = ""
    device: str = params.DEFAULTS["device"]
    window: str = params.DEFAULTS["window"]
    outputSegmentation: vtkMRMLSegmentationNode
    segmentId: str = ""
    # the segmentation whose segment ``segmentId`` the evidence below belongs to (evidence.follow_selection
    # makes it the Output segmentation again whenever that changes)
    evidenceSegmentation: vtkMRMLSegmentationNode
    resultVolume: vtkMRMLScalarVolumeNode  # the volume the shown segment's result and its boxes belong to
    boxes: list[vtkMRMLMarkupsROINode]  # the key-slice boxes: the anchor's objects 1..N
    keySlice: int = -1  # stack z of the anchor (shown to the user)
    keySliceIJK: int = -1  # the same slice along the volume's slice axis (for re-propagation)
    reasoning: str = ""
    anchorJson: str = ""
    boxesEdited: bool = False  # boxes, corrections, points or the range changed since the result
    corrections: list[vtkMRMLMarkupsROINode]  # boxes on other slices or of new objects (prompts)
    points: vtkMRMLMarkupsFiducialNode  # "MedVol points": control points labelled +N / -N
    rangeStart: int = -1  # the slice range's ends along the volume's slice axis (-1: not set)
    rangeEnd: int = -1
    correctionObject: int = 0  # the object Add box here and new points are for (0: a new object)
    negativePoints: bool = False  # new points mark the outside of the object
    consensus: Annotated[int, WithinRange(1, MAX_CONSENSUS)] = 1  # Advanced: answers per Segment (1: off)
    confidence: str = ""  # how sure the model was about the shown segment (MedVolR1SlicerLib.consensus)
    agreementSegmentId: str = ""  # the shown segment's "… agreement ≥ k/G" segment, if any


# the worker settings a scene saved by an older version carries (never read: see the module's doc)
SCENE_WORKER_PARAMETERS = ("worker", "remoteUrl")


def drop_worker_settings(node) -> dict:
    """Remove the worker settings an older version saved in the scene from the module's
    ``vtkMRMLScriptedModuleNode`` ``node``; returns what was there (``{name: value}``, empty when
    nothing), so that the panel can say they were ignored."""
    found = {name: node.GetParameter(name) for name in SCENE_WORKER_PARAMETERS if node.HasParameter(name)}
    if found:
        was = node.StartModify()
        try:
            for name in found:
                node.UnsetParameter(name)
        finally:
            node.EndModify(was)
    return found
