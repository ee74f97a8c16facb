"""Segment names and colours: what a result's segments are called in the segmentation (the
query, one short line, unique), the "not found" message, the coded colour and terminology a
result carries, and the consensus's agreement segment. Plain values; the Scene puts them in MRML."""

from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

SEGMENT_NAME_MAX = 64


def segment_name(query: str) -> str:
    """A segment name from the query: one line, at most :data:`SEGMENT_NAME_MAX` characters."""
    q = " ".join(str(query or "").split())
    if not q:
        return "MedVol segment"
    if len(q) > SEGMENT_NAME_MAX:
        q = q[: SEGMENT_NAME_MAX - 1].rstrip() + "…"
    return q


def absent_message(query: str) -> str:
    """What the panel says when the model answered that the target is not in this CT: no segment
    is added, and the clinician is told how to go on."""
    q = " ".join(str(query or "").split()) or "the target"
    return (f"Not found in this CT: {q}. The model answered that it is not present, so no segment was added. "
            "It may be wrong: if you can see it, rephrase the query, or draw it with the Segment Editor.")


def segment_style(terminology) -> Optional[Tuple[Tuple[float, float, float], str]]:
    """``((r, g, b) in 0..1, Slicer terminology entry)`` for a new segment, from a result's
    ``terminology`` (medvolcore.terminology: the SNOMED CT code its query was matched to, or the
    generic one, and the colour that goes with it); None when the result has none (an older worker)."""
    if not isinstance(terminology, dict):
        return None
    color, entry = terminology.get("color"), terminology.get("slicer_terminology")
    if not (isinstance(color, list) and len(color) == 3 and all(isinstance(c, int) and 0 <= c <= 255 for c in color)
            and isinstance(entry, str) and entry.count("~") == 6):
        return None
    return (color[0] / 255.0, color[1] / 255.0, color[2] / 255.0), entry


def unique_name(name: str, existing: Sequence[str]) -> str:
    """``name`` or ``name (2)``, ``name (3)``… whichever is not in ``existing``."""
    taken = set(existing)
    if name not in taken:
        return name
    base = re.sub(r" \(\d+\)$", "", name)
    n = 2
    while f"{base} ({n})" in taken:
        n += 1
    return f"{base} ({n})"


def agreement_segment_name(query: str, level: int, samples: int) -> str:
    """``"<query> agreement ≥ k/G"``, the query cut so that the name stays one short line."""
    suffix = f" agreement ≥ {int(level)}/{int(samples)}"
    name = segment_name(query)
    room = max(8, SEGMENT_NAME_MAX - len(suffix))
    if len(name) > room:
        name = name[: room - 1].rstrip() + "…"
    return name + suffix
