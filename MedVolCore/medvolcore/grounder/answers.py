"""The grounder's answers → evidence anchors, and the results that carry them (no model, no torch).

:func:`anchor_from_text` turns one answer text into an :class:`~medvolcore.anchor.EvidenceAnchor`
(source ``"grounder"``, with its world coordinates) or says why it cannot: it parses with
:func:`~medvolcore.answer.parse_answer`; an answer that names a slice that was not shown, or has
no usable box, is :class:`_Unusable`. Boxes with swapped corners are reordered and boxes of zero
width or height dropped, each with a note (:func:`clean_boxes`). ``<answer>[]</answer>`` is the
absent anchor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..anchor import MAX_BOXES, EvidenceAnchor
from ..answer import parse_answer
from ..errors import InputError

__all__ = ["GroundingResult", "GroundingSample", "SampledGrounding", "MAX_SAMPLES", "check_samples", "clean_boxes",
           "check_answer", "anchor_from_text"]


class _Unusable(Exception):
    """An answer that parsed but cannot become an anchor (reason in the message)."""


def _fmt(box) -> str:
    return "[" + ", ".join(f"{v:g}" for v in box) + "]"


def clean_boxes(boxes_norm) -> Tuple[List[List[float]], List[str]]:
    """Reorder swapped corners, drop zero-width/height boxes, keep at most 8; with notes."""
    kept, notes = [], []
    for i, box in enumerate(boxes_norm, start=1):
        x0, y0, x1, y1 = (float(v) for v in box)
        fixed = [min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)]
        if fixed != [x0, y0, x1, y1]:
            notes.append(f"box {i} {_fmt(box)} had swapped corners; reordered to {_fmt(fixed)}")
        if fixed[0] == fixed[2] or fixed[1] == fixed[3]:
            notes.append(f"box {i} {_fmt(box)} has zero width or height; dropped")
            continue
        kept.append(fixed)
    if len(kept) > MAX_BOXES:
        notes.append(f"the answer has {len(kept)} boxes; kept the first {MAX_BOXES}")
        kept = kept[:MAX_BOXES]
    return kept, notes


def check_answer(text: str, shown: Sequence[int]):
    """``(parsed, boxes, notes)`` of one answer text: the parsed answer, its cleaned 0–1000 boxes and
    the clean-up's notes (``[]`` and ``[]`` for the absent answer). A parse error, or
    :class:`_Unusable` for a slice that was not ``shown`` or no usable box."""
    parsed = parse_answer(text)
    if parsed.absent:
        return parsed, [], []
    if parsed.slice not in set(shown):
        raise _Unusable(f"slice {parsed.slice} is not one of the shown slices")
    boxes, notes = clean_boxes(parsed.boxes_norm)
    if not boxes:
        raise _Unusable("no box with a non-zero width and height")
    return parsed, boxes, notes


def anchor_from_text(text: str, shown: Sequence[int], stack, query: str, notes: Sequence[str] = ()):
    """``(anchor, parsed)`` of one answer text on ``stack``; :class:`_Unusable` (or a parse error) when
    it cannot be one. ``notes`` go first in the anchor's notes, the box fix-ups after them."""
    parsed, boxes, box_notes = check_answer(text, shown)
    kw = dict(query=query, reasoning=parsed.reasoning, source="grounder", notes=list(notes) + box_notes)
    if parsed.absent:
        anchor = EvidenceAnchor.absent_for([stack.width, stack.height], **kw)
    else:
        anchor = EvidenceAnchor.from_norm(parsed.slice, boxes, [stack.width, stack.height], **kw)
    anchor.with_world(stack)
    return anchor, parsed


@dataclass
class GroundingResult:
    """One grounding: the anchor plus what led to it."""

    anchor: EvidenceAnchor
    reasoning: str
    raw_text: str
    shown_slices: List[int]
    timings: Dict[str, float]
    notes: List[str] = field(default_factory=list)
    attempts: int = 1

    def to_dict(self) -> dict:
        return {"anchor": self.anchor.to_dict(), "reasoning": self.reasoning, "raw_text": self.raw_text,
                "shown_slices": list(self.shown_slices), "timings": dict(self.timings), "notes": list(self.notes),
                "attempts": self.attempts}


MAX_SAMPLES = 8


def check_samples(value, what: str = "the number of samples") -> int:
    """``value`` as the number of answers of a consensus, 1..:data:`MAX_SAMPLES` (1: the greedy answer alone)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SAMPLES:
        raise InputError(f"{what} must be a whole number from 1 to {MAX_SAMPLES} (1 = the greedy answer alone), "
                         f"got {value!r}")
    return value


@dataclass
class GroundingSample:
    """One answer of :meth:`QwenVLGrounder.ground_samples` (``index`` 1 is the greedy one).
    ``anchor`` is None when the answer was unusable; ``error`` then says why."""

    index: int
    raw_text: str
    reasoning: str = ""
    anchor: Optional[EvidenceAnchor] = None
    error: str = ""
    signal: Optional[dict] = None

    @property
    def usable(self) -> bool:
        return self.anchor is not None


@dataclass
class SampledGrounding:
    """What :meth:`QwenVLGrounder.ground_samples` returns: the greedy result (``greedy``, exactly
    :meth:`~QwenVLGrounder.ground`'s) and every sample, the greedy one first."""

    greedy: GroundingResult
    samples: List[GroundingSample]
    timings: Dict[str, float]
    seed: Optional[int] = None
