"""A worker's result put into the scene, and taken back (Undo).

:func:`apply_result` checks everything that can fail on a bad result (the anchor's boxes, the
mask file and its grid) before the scene is touched, then writes the segment, the agreement
segment of a consensus, the boxes and corrections that ran, the parameter node's fields, and
shows the key slice; it returns the notes for the user and the :class:`UndoRecord` that takes it
back. A request's destination (:class:`Target`) is fixed when the request starts. MRML only,
no Qt."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import slicer

from MedVolR1SlicerLib.consensus import agreement_level, confidence_note, confidence_text
from MedVolR1SlicerLib.corrections import prompts_from_anchor
from MedVolR1SlicerLib.geometry import rois_from_anchor
from MedVolR1SlicerLib.presets import result_model_text
from MedVolR1SlicerLib.segments import (absent_message, agreement_segment_name, segment_name, segment_style,
                                        unique_name)

from .markups import place_corrections, place_rois
from .nodes import geometry, in_scene
from .storage import read_mask
from .views import place_in_study, show_key_slice

BeforeChange = Optional[Callable[[object], None]]  # called with a segmentation node before it changes


@dataclass
class Target:
    """Where a request's result goes, fixed when the request starts."""

    volume: object  # the volume that was exported (the result lies on its grid)
    segmentation: object  # None: a new segmentation
    replaceSegmentId: str  # '' : add a segment
    query: str
    generation: int  # the logic's scene count: a closed scene's result is dropped
    notes: List[str] = field(default_factory=list)


class EditedSinceResult(ValueError):
    """Undo would throw away edits made to the segment after the result."""

    def __init__(self, voxels: int, segmentName: str):
        self.voxels = voxels
        super().__init__(f"“{segmentName}” was edited after the result ({voxels} voxels changed); "
                         "Undo would throw those edits away")


def _packed(segNode, segmentId, volumeNode):
    import numpy as np

    return np.packbits(slicer.util.arrayFromSegmentBinaryLabelmap(segNode, segmentId, volumeNode) > 0)


@dataclass
class UndoRecord:
    """What Undo takes back: the segment, the mask it held before (None: it was added) and the
    mask the result wrote (bits packed), to tell whether someone edited it since."""

    segmentation: object
    segmentId: str
    previous: object
    volume: object
    written: object
    agreementId: str = ""  # the agreement segment the result added (Undo removes it too)

    def available(self) -> bool:
        """The segment is still there to take back."""
        return in_scene(self.segmentation) and \
            self.segmentation.GetSegmentation().GetSegment(self.segmentId) is not None

    def edited_voxels(self) -> int:
        """How many voxels of the segment were changed since the result (Segment Editor, another
        module, a script): what Undo would throw away. 0 when it is no longer there."""
        import numpy as np

        if not self.available():
            return 0
        now = _packed(self.segmentation, self.segmentId, self.volume)
        if now.shape != self.written.shape:
            return int(self.written.size * 8)
        return int(np.unpackbits(np.bitwise_xor(now, self.written)).sum())

    def undo(self, discardEdits: bool = False, beforeChange: BeforeChange = None) -> None:
        """Remove the segment the result added, or restore the mask it replaced, and remove its
        agreement segment. Raises :class:`EditedSinceResult` when the segment was edited after
        the result, unless ``discardEdits``."""
        edited = self.edited_voxels()
        if edited and not discardEdits:
            raise EditedSinceResult(edited, self.segmentation.GetSegmentation().GetSegment(self.segmentId).GetName())
        if beforeChange is not None:
            beforeChange(self.segmentation)
        segmentation = self.segmentation.GetSegmentation()
        if self.previous is None:
            segmentation.RemoveSegment(self.segmentId)
        else:
            slicer.util.updateSegmentBinaryLabelmapFromArray(self.previous, self.segmentation, self.segmentId,
                                                             self.volume)
        if self.agreementId and segmentation.GetSegment(self.agreementId) is not None:
            segmentation.RemoveSegment(self.agreementId)


def _remove_agreement_file(result: dict) -> None:
    if result.get("agreement_path"):
        with contextlib.suppress(OSError):
            os.remove(result["agreement_path"])  # ours, in the module's temporary folder


def absent_notes(result: dict, query: str, notes: List[str]) -> List[str]:
    """What the panel says for a "not present" answer: the answer, the model's reasoning, how
    sure it was, and the worker's notes (nothing is added to the scene)."""
    anchor = result["anchor"]
    notes = [n for n in notes if not n.startswith("not found in this CT:")]
    why = anchor.get("reasoning") or ""
    sure = confidence_note(result)
    return [absent_message(anchor.get("query") or query)] + \
        ([f"the model's reasoning: {why}"] if why else []) + ([sure] if sure else []) + notes


def _names(segmentation) -> List[str]:
    return [segmentation.GetNthSegment(i).GetName() for i in range(segmentation.GetNumberOfSegments())]


def _output_segmentation(target: Target, volumeNode, beforeChange: BeforeChange):
    segNode = target.segmentation
    if segNode is None:
        segNode = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", f"{volumeNode.GetName()} MedVol")
        segNode.CreateDefaultDisplayNodes()
        segNode.SetReferenceImageGeometryParameterFromVolumeNode(volumeNode)
        place_in_study(segNode, volumeNode)
    elif beforeChange is not None:
        beforeChange(segNode)
    return segNode


def _write_segment(segNode, target: Target, volumeNode, mask, query: str, terminology) -> Tuple[str, object]:
    """Write ``mask`` into the target's segment (replaced) or a new one named after the query,
    with the result's coded colour and terminology. Returns ``(segmentId, previous mask or None)``."""
    segmentation = segNode.GetSegmentation()
    replaceId = target.replaceSegmentId
    if replaceId and segmentation.GetSegment(replaceId):
        segmentId = replaceId
        previous = slicer.util.arrayFromSegmentBinaryLabelmap(segNode, segmentId, volumeNode).copy()
    else:
        name = unique_name(segment_name(query), _names(segmentation))
        segmentId = segmentation.AddEmptySegment("", name)
        previous = None
        style = segment_style(terminology)  # the worker's coded name and colour
        if style is not None:
            segment = segmentation.GetSegment(segmentId)
            segment.SetColor(*style[0])
            segment.SetTerminology(style[1])
    slicer.util.updateSegmentBinaryLabelmapFromArray(mask, segNode, segmentId, volumeNode)
    return segmentId, previous


def replace_agreement(p, segNode, volumeNode, agreement, query: str, samples: int, keep: str) -> str:
    """Drop the last result's agreement segment (it described that result's answers) and add
    this one's, ``"<query> agreement ≥ k/G"``, from ``agreement`` (a 0/1 array of the voxels at
    least k samples include; None: no consensus). Returns the new segment's id or ''."""
    segmentation = segNode.GetSegmentation()
    old = p.agreementSegmentId
    if old and old != keep and segmentation.GetSegment(old) is not None:
        segmentation.RemoveSegment(old)
    p.agreementSegmentId = ""
    if agreement is None:
        return ""
    name = unique_name(agreement_segment_name(query, agreement_level(samples), samples), _names(segmentation))
    segmentId = segmentation.AddEmptySegment("", name)
    segmentation.GetSegment(segmentId).SetColor(1.0, 0.75, 0.2)
    slicer.util.updateSegmentBinaryLabelmapFromArray(agreement, segNode, segmentId, volumeNode)
    p.agreementSegmentId = segmentId
    return segmentId


def apply_result(p, volumeNode, result: dict, target: Target,
                 beforeChange: BeforeChange = None) -> Tuple[List[str], Optional[UndoRecord]]:
    """Put the mask in a segment named after the query, the boxes on the key slice, the
    corrections that ran (the anchor's prompts and slice range, if any; the old correction
    nodes are removed), the reasoning in the parameter node ``p``, and show the key slice.
    Returns the notes for the user and what Undo takes back (None for a "not present" answer,
    which adds nothing and leaves the last result as it was)."""
    anchor = result["anchor"]
    query = anchor.get("query") or target.query
    notes = list(result.get("notes") or [])
    model = result_model_text(result)  # what made it, as the worker says: zero-shot, MedVol-R1, smoke
    if model:
        notes.insert(0, model)
    if result.get("absent") or anchor.get("absent"):
        _remove_agreement_file(result)
        return absent_notes(result, target.query, notes), None

    # everything that can fail on a bad result, before the scene is touched
    geo = geometry(volumeNode)
    rois, k = rois_from_anchor(geo, anchor)
    prompts, zRange = prompts_from_anchor(geo, anchor)  # the corrections that ran (medvol.anchor/2)
    mask = read_mask(result["mask_path"], volumeNode)
    agreement, samples = None, int(result.get("consensus") or 1)
    if result.get("agreement_path"):
        agreement = read_mask(result["agreement_path"], volumeNode, atLeast=agreement_level(samples))
        _remove_agreement_file(result)
    elif samples > 1:
        notes.append("no agreement map came back (a remote worker writes it only into its output folder)")

    segNode = _output_segmentation(target, volumeNode, beforeChange)
    segmentId, previous = _write_segment(segNode, target, volumeNode, mask, query, result.get("terminology"))
    agreementId = replace_agreement(p, segNode, volumeNode, agreement, query, samples, keep=segmentId)
    undo = UndoRecord(segNode, segmentId, previous, volumeNode, _packed(segNode, segmentId, volumeNode), agreementId)
    p.confidence = confidence_text(result)
    p.outputSegmentation = segNode
    p.segmentId = segmentId
    p.resultVolume = volumeNode
    p.reasoning = anchor.get("reasoning") or ""
    p.keySlice = int(anchor["slice"])
    p.anchorJson = json.dumps(anchor)
    place_rois(p, rois, k, volumeNode)
    place_corrections(p, geo, prompts, zRange, volumeNode)
    p.boxesEdited = False
    show_key_slice(volumeNode, anchor)
    return notes, undo
