"""Undo and Redo of results, as deep as the session, one history per segmentation.

A :class:`Step` is what one click changed in one segmentation: for each segment it touched (the
result's segments, an agreement segment added or dropped) the segment and its evidence before
and after (:class:`SegmentState`: the mask as packed bits on the result volume's grid, the name,
colour and terminology to add it again, the evidence as a snapshot of :mod:`.evidence`). Undo
puts every segment of the step back as it was before, Redo as it was after; each first counts
the voxels edited since (Segment Editor, another module, a script) and refuses, unless told to
discard them (:class:`EditedSinceResult`). A step acts only on its own segmentation and volume:
the panel asks for the history of the segmentation it shows, so Undo never reaches another
patient's result, an imported scene's included. MRML only, no Qt."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import zlib

import slicer

from . import evidence, painted
from .nodes import in_scene

BeforeChange = Optional[Callable[[object], None]]  # called with a segmentation node before it changes


class EditedSinceResult(ValueError):
    """Undo (or Redo) would throw away edits made to the segment after the result."""

    def __init__(self, voxels: int, segmentName: str, action: str = "Undo"):
        self.voxels = voxels
        super().__init__(f"“{segmentName}” was edited after the result ({voxels} voxels changed); "
                         f"{action} would throw those edits away")


@dataclass
class SegmentState:
    """One segment as it was: ``bits`` (its mask, packed and deflated: a session's steps stay
    small; None: there was no such segment)."""

    bits: object = None
    shape: Tuple[int, ...] = ()
    name: str = ""
    color: Tuple[float, float, float] = (0.5, 0.5, 0.5)
    terminology: str = ""
    evidence: Optional[dict] = None
    resultSlices: str = ""  # the segment's result digests (painted.TAG): what a painted slice is compared with

    @property
    def present(self) -> bool:
        return self.bits is not None


def _mask(segNode, segmentId: str, volume):
    return slicer.util.arrayFromSegmentBinaryLabelmap(segNode, segmentId, volume) > 0


def _pack(mask) -> bytes:
    import numpy as np

    return zlib.compress(np.packbits(mask).tobytes(), 1)


def _unpack(bits: bytes):
    import numpy as np

    return np.frombuffer(zlib.decompress(bits), np.uint8)


def capture(p, segNode, segmentId: str, volume, withEvidence: bool = True) -> SegmentState:
    """The segment ``segmentId`` of ``segNode`` now (its evidence as ``p`` shows it, when selected)."""
    import numpy as np

    segment = segNode.GetSegmentation().GetSegment(segmentId) if segmentId else None
    snap = evidence.snapshot(p, segNode, segmentId) if withEvidence and segmentId else None
    if segment is None:
        return SegmentState(evidence=snap)
    mask = _mask(segNode, segmentId, volume)
    getTerminology = getattr(segment, "GetTerminology", None)
    return SegmentState(_pack(mask), mask.shape, segment.GetName(), tuple(segment.GetColor()),
                        getTerminology() if getTerminology is not None else "", snap,
                        painted.result_digests(segNode, segmentId))


def _differs(segNode, segmentId: str, volume, expected: SegmentState) -> int:
    """How many voxels of the segment differ from ``expected`` (a missing segment holds none)."""
    import numpy as np

    segment = segNode.GetSegmentation().GetSegment(segmentId)
    if segment is None:
        return int(np.unpackbits(_unpack(expected.bits)).sum()) if expected.present else 0
    now = _mask(segNode, segmentId, volume)
    if not expected.present:
        return int(now.sum())
    if now.shape != tuple(expected.shape):
        return int(now.size)
    return int(np.unpackbits(np.bitwise_xor(np.packbits(now), _unpack(expected.bits))).sum())


def _put(p, segNode, segmentId: str, volume, state: SegmentState) -> None:
    """Make the segment (and its evidence) what ``state`` says."""
    import numpy as np

    segmentation = segNode.GetSegmentation()
    segment = segmentation.GetSegment(segmentId)
    if not state.present:
        if segment is not None:
            segmentation.RemoveSegment(segmentId)
    else:
        if segment is None:
            segmentation.AddEmptySegment(segmentId, state.name, list(state.color))
            segment = segmentation.GetSegment(segmentId)
            if state.terminology and hasattr(segment, "SetTerminology"):
                segment.SetTerminology(state.terminology)
        mask = np.unpackbits(_unpack(state.bits))[:int(np.prod(state.shape))].reshape(state.shape).astype(np.uint8)
        slicer.util.updateSegmentBinaryLabelmapFromArray(mask, segNode, segmentId, volume)
        segment = segmentation.GetSegment(segmentId)
        if state.resultSlices:
            segment.SetTag(painted.TAG, state.resultSlices)
        else:
            segment.RemoveTag(painted.TAG)
    evidence.restore(p, segNode, segmentId, state.evidence if state.present else None)


@dataclass
class Change:
    segmentId: str
    before: SegmentState
    after: SegmentState


@dataclass
class Step:
    """What one result changed in ``segmentation`` (on ``volume``'s grid); ``shown``: the segment
    the panel shows after Redo (the result's first)."""

    segmentation: object
    volume: object
    changes: List[Change] = field(default_factory=list)
    shown: str = ""
    label: str = ""

    def available(self) -> bool:
        return in_scene(self.segmentation) and in_scene(self.volume)

    def edited_voxels(self, undo: bool = True) -> Tuple[int, str]:
        """``(voxels, segment name)``: what Undo (``undo``) or Redo would throw away."""
        total, name = 0, ""
        for change in self.changes:
            expected = change.after if undo else change.before
            n = _differs(self.segmentation, change.segmentId, self.volume, expected)
            if n and not name:
                segment = self.segmentation.GetSegmentation().GetSegment(change.segmentId)
                name = segment.GetName() if segment is not None else (change.after.name or change.before.name)
            total += n
        return total, name

    def apply(self, p, undo: bool, discardEdits: bool = False, beforeChange: BeforeChange = None) -> None:
        """Put the step's segments back as they were before it (``undo``) or after it (Redo).
        Raises :class:`EditedSinceResult` before changing anything when a segment was edited since."""
        voxels, name = self.edited_voxels(undo)
        if voxels and not discardEdits:
            raise EditedSinceResult(voxels, name, "Undo" if undo else "Redo")
        if beforeChange is not None:
            beforeChange(self.segmentation)
        evidence.store(p)
        for change in self.changes:
            _put(p, self.segmentation, change.segmentId, self.volume, change.before if undo else change.after)
        # show the segment the step is about when it is there, else no evidence (none is stale)
        shown = [c.segmentId for c in self.changes if (c.before if undo else c.after).evidence is not None]
        target = self.shown if self.shown in shown else (shown[0] if shown else "")
        if target:
            evidence.select_segment(p, self.segmentation, target)
        else:
            if evidence._same(p.evidenceSegmentation, self.segmentation):
                evidence.forget_shown(p)


class History:
    """The Undo and Redo stacks of each segmentation."""

    def __init__(self):
        self._stacks = []  # [(segmentation node, undo steps, redo steps)]

    def clear(self) -> None:
        self._stacks = []

    def _entry(self, segNode, create: bool = False):
        self._stacks = [e for e in self._stacks if in_scene(e[0])]
        for entry in self._stacks:
            if entry[0] is segNode:
                return entry
        if create and segNode is not None:
            entry = (segNode, [], [])
            self._stacks.append(entry)
            return entry
        return None

    def push(self, step: Step) -> None:
        entry = self._entry(step.segmentation, create=True)
        entry[1].append(step)
        entry[2].clear()  # a new result: what was undone before it can no longer be redone

    def top(self, segNode, undo: bool = True) -> Optional[Step]:
        entry = self._entry(segNode)
        if entry is None:
            return None
        stack = entry[1] if undo else entry[2]
        while stack and not stack[-1].available():
            stack.pop()
        return stack[-1] if stack else None

    def depth(self, segNode, undo: bool = True) -> int:
        entry = self._entry(segNode)
        return 0 if entry is None else len(entry[1] if undo else entry[2])

    def move(self, segNode, undo: bool) -> None:
        """The top step was undone (``undo``) or redone: it goes to the other stack."""
        entry = self._entry(segNode)
        source, dest = (entry[1], entry[2]) if undo else (entry[2], entry[1])
        dest.append(source.pop())
