"""A worker's result put into the scene.

:func:`apply_result` checks everything that can fail on a bad result (the anchor's boxes, the
mask file and its grid, for every target of several queries) before the scene is touched, then
writes one segment per target found, each with its own evidence (:mod:`.evidence`: the boxes
and corrections that ran, the reasoning, the confidence, the agreement segment of a consensus),
selects the first and shows its key slice; it returns the notes for the user ("not present" for
each target not found) and the :class:`.history.Step` that Undo takes back. A request's
destination (:class:`Target`) is fixed when the request starts. MRML only, no Qt."""

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

from . import evidence
from .history import BeforeChange, Change, SegmentState, Step, capture
from .markups import place_corrections, place_rois
from .nodes import geometry
from .storage import read_labels, read_mask
from .views import place_in_study, show_key_slice


@dataclass
class Target:
    """Where a request's result goes, fixed when the request starts."""

    volume: object  # the volume that was exported (the result lies on its grid)
    segmentation: object  # None: a new segmentation
    replaceSegmentId: str  # '' : add a segment
    query: str
    generation: int  # the logic's scene count: a closed scene's result is dropped
    notes: List[str] = field(default_factory=list)
    queries: Optional[List[str]] = None  # several queries in one request (one segment each)
    keepSegment: str = ""  # Re-propagate: the name of the segment replaced, which must still be there


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


@dataclass
class _Found:
    """One target found, checked before the scene is touched."""

    query: str
    anchor: dict
    rois: list
    k: int
    prompts: list
    zRange: object
    mask: object
    terminology: object
    confidence: str
    agreement: object = None
    samples: int = 1


def _check(geo, anchor: dict, query: str, mask, result: dict) -> _Found:
    rois, k = rois_from_anchor(geo, anchor)
    prompts, zRange = prompts_from_anchor(geo, anchor)  # the corrections that ran (medvol.anchor/2)
    return _Found(anchor.get("query") or query, anchor, rois, k, prompts, zRange, mask, result.get("terminology"),
                  confidence_text(result))


def _new_segment(segNode, query: str, terminology) -> str:
    """An empty segment named after the query, with the result's coded colour and terminology."""
    segmentation = segNode.GetSegmentation()
    segmentId = segmentation.AddEmptySegment("", unique_name(segment_name(query), _names(segmentation)))
    style = segment_style(terminology)  # the worker's coded name and colour
    if style is not None:
        segment = segmentation.GetSegment(segmentId)
        segment.SetColor(*style[0])
        segment.SetTerminology(style[1])
    return segmentId


def _replace_agreement(p, segNode, volumeNode, found: _Found, keep: str) -> List[Change]:
    """Drop the segment's last agreement segment (it described that result's answers) and add this
    result's, ``"<query> agreement ≥ k/G"`` (``found.agreement``: a 0/1 array of the voxels at least
    k samples include; None: no consensus). Returns the changes, for Undo."""
    segmentation = segNode.GetSegmentation()
    changes = []
    old = p.agreementSegmentId
    if old and old != keep and segmentation.GetSegment(old) is not None:
        before = capture(p, segNode, old, volumeNode, withEvidence=False)
        segmentation.RemoveSegment(old)
        changes.append(Change(old, before, SegmentState()))
    p.agreementSegmentId = ""
    if found.agreement is None:
        return changes
    name = unique_name(agreement_segment_name(found.query, agreement_level(found.samples), found.samples),
                       _names(segmentation))
    segmentId = segmentation.AddEmptySegment("", name)
    segmentation.GetSegment(segmentId).SetColor(1.0, 0.75, 0.2)
    slicer.util.updateSegmentBinaryLabelmapFromArray(found.agreement, segNode, segmentId, volumeNode)
    p.agreementSegmentId = segmentId
    return changes + [Change(segmentId, SegmentState(), capture(p, segNode, segmentId, volumeNode, False))]


def _write(p, segNode, volumeNode, geo, found: _Found, replaceId: str) -> List[Change]:
    """One target into its segment (``replaceId``, else a new one) with its evidence; the evidence
    of the segment shown before goes back to its own evidence node, untouched."""
    segmentation = segNode.GetSegmentation()
    if replaceId and segmentation.GetSegment(replaceId) is not None:
        segmentId, before = replaceId, capture(p, segNode, replaceId, volumeNode)
    else:
        segmentId, before = _new_segment(segNode, found.query, found.terminology), SegmentState()
    evidence.select_segment(p, segNode, segmentId)  # p now shows this segment's own evidence
    slicer.util.updateSegmentBinaryLabelmapFromArray(found.mask, segNode, segmentId, volumeNode)
    changes = _replace_agreement(p, segNode, volumeNode, found, keep=segmentId)
    p.confidence = found.confidence
    p.resultVolume = volumeNode
    p.reasoning = found.anchor.get("reasoning") or ""
    p.keySlice = int(found.anchor["slice"])
    p.anchorJson = json.dumps(found.anchor)
    place_rois(p, found.rois, found.k, volumeNode)  # this segment's old boxes only
    place_corrections(p, geo, found.prompts, found.zRange, volumeNode)
    p.boxesEdited = False
    evidence.store(p)
    return [Change(segmentId, before, capture(p, segNode, segmentId, volumeNode))] + changes


def _several(result: dict, target: Target, geo, volumeNode, notes: List[str]) -> List[_Found]:
    """The targets of a ``queries`` reply that were found, checked; a "not present" note for each
    of the others (in the order asked)."""
    entries = result.get("targets") or []
    found, absent = [], []
    labels = read_labels(result["mask_path"], volumeNode) if result.get("mask_path") else None
    for i, entry in enumerate(entries):
        query = entry.get("query") or (target.queries[i] if i < len(target.queries or []) else "")
        anchor = entry.get("anchor") or {}
        if entry.get("absent") or anchor.get("absent") or labels is None:
            absent.append(absent_message(query) + (f" The model's reasoning: {anchor['reasoning']}"
                                                   if anchor.get("reasoning") else ""))
            continue
        mask = (labels == int(entry.get("label") or i + 1)).astype("uint8")
        found.append(_check(geo, anchor, query, mask, entry))
    notes[:0] = absent
    return found


def apply_result(p, volumeNode, result: dict, target: Target,
                 beforeChange: BeforeChange = None) -> Tuple[List[str], Optional[Step]]:
    """Put each target found into its own segment named after its query, with its evidence: the
    boxes on the key slice, the corrections that ran (the anchor's prompts and slice range, if
    any), the reasoning and the confidence; select the first and show its key slice. The
    evidence of the other segments (a correction not sent yet included) is kept. Returns the
    notes for the user and the Undo step (None when nothing was found: a "not present" answer
    adds nothing and leaves the last result as it was)."""
    notes = list(result.get("notes") or [])
    model = result_model_text(result)  # what made it, as the worker says: zero-shot, MedVol-R1, smoke
    if model:
        notes.insert(0, model)
    several = result.get("targets") is not None
    if not several and (result.get("absent") or result["anchor"].get("absent")):
        _remove_agreement_file(result)
        return absent_notes(result, target.query, notes), None

    # everything that can fail on a bad result, before the scene is touched
    geo = geometry(volumeNode)
    if several:
        found = _several(result, target, geo, volumeNode, notes)
        if not found:
            return notes, None
    else:
        found = [_check(geo, result["anchor"], target.query, read_mask(result["mask_path"], volumeNode), result)]
        samples = int(result.get("consensus") or 1)
        found[0].samples = samples
        if result.get("agreement_path"):
            found[0].agreement = read_mask(result["agreement_path"], volumeNode, atLeast=agreement_level(samples))
            _remove_agreement_file(result)
        elif samples > 1:
            notes.append("no agreement map came back (a remote worker writes it only into its output folder)")

    segNode = _output_segmentation(target, volumeNode, beforeChange)
    step = Step(segNode, volumeNode, label=", ".join(f.query for f in found))
    for i, f in enumerate(found):
        step.changes += _write(p, segNode, volumeNode, geo, f, target.replaceSegmentId if i == 0 else "")
    step.shown = step.changes[0].segmentId
    evidence.select_segment(p, segNode, step.shown)
    show_key_slice(volumeNode, found[0].anchor)
    return notes, step
