"""The module's parameter node: what the panel shows and what a result leaves in the scene
(saved with it). Slicer's ``parameterNodeWrapper`` keeps each field on the module's singleton
``vtkMRMLScriptedModuleNode``: plain values as parameters, nodes as node references. A spin box
bound to a field takes its range from the field's ``WithinRange`` (Slicer's GUI connector), so
every bounded number says its bounds here."""

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
    worker: str = params.DEFAULTS["worker"]
    remoteUrl: str = params.DEFAULTS["remote_url"]
    outputSegmentation: vtkMRMLSegmentationNode
    segmentId: str = ""
    resultVolume: vtkMRMLScalarVolumeNode  # the volume the last result, its boxes and Undo belong to
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
    confidence: str = ""  # how sure the model was about the last result (MedVolR1SlicerLib.consensus)
    agreementSegmentId: str = ""  # the last result's "… agreement ≥ k/G" segment, if any
