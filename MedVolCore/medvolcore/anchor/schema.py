"""The anchor file's format: its schema names, its limits, the types of its fields, and how it is
laid out as JSON (docs/architecture.md, "Evidence anchor file")."""

from __future__ import annotations

import json
import re
from typing import List

import numpy as np

from ..errors import AnchorError
from .geometry import MAX_COORD, _in_range, _show

SCHEMA = "medvol.anchor/1"
SCHEMA_V2 = "medvol.anchor/2"
SCHEMA_V3 = "medvol.anchor/3"
SCHEMA_V4 = "medvol.anchor/4"
SCHEMAS = (SCHEMA, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4)
SOURCES = ("grounder", "mask", "user")
MAX_BOXES = 8
# An anchor file is read only when it is at most this size (checked with stat before reading).
# The largest anchor the limits allow (8 boxes, 64 prompts with boxes, 256 points, each in pixel
# and world form, a 2000-character query, 16 kB of reasoning) is about 48 kB; mask prompts add at most
# 32,768 runs (two numbers each, under 500 kB): 1 MB holds both.
MAX_ANCHOR_FILE_BYTES = 1 << 20


def dumps(obj) -> str:
    """JSON with two-space indentation but numeric lists (boxes, points) kept on one line."""
    text = json.dumps(obj, indent=2)
    return re.sub(r"\[[-0-9.,\se+]*\]", lambda m: re.sub(r"\s+", " ", m.group(0)).replace("[ ", "[").replace(" ]", "]"), text) + "\n"


def _is_text(value) -> bool:
    """A str that is valid Unicode (a lone surrogate from a JSON ``\\ud800`` escape is not)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _image_size(size) -> List[int]:
    """``[W, H]``: two whole numbers of pixels, 1 to :data:`MAX_COORD`."""
    if (isinstance(size, (str, bytes, dict)) or not hasattr(size, "__len__") or len(size) != 2
            or not all(not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating))
                       and _in_range(v, MAX_COORD) and float(v).is_integer() and v >= 1 for v in size)):
        raise AnchorError(f"image_size must be [W, H] in whole pixels (1 to {MAX_COORD:,}), got {_show(size)}")
    return [int(v) for v in size]


def _check_fields(d: dict, origin: str) -> None:
    """Types of an anchor object's fields, so a malformed one is an AnchorError, not a crash."""
    for name in ("query", "reasoning", "source"):
        v = d.get(name)
        if v is not None and not _is_text(v):
            raise AnchorError(f"{origin}: '{name}' " + ("is not valid Unicode text (a lone surrogate)" if isinstance(v, str)
                                                         else f"must be text, got {type(v).__name__}"))
    notes = d.get("notes")
    if notes is not None and not (isinstance(notes, list) and all(_is_text(n) for n in notes)):
        raise AnchorError(f"{origin}: 'notes' must be a list of texts")
    for name in ("boxes", "boxes_norm", "image_size"):
        v = d.get(name)
        if v is not None and not isinstance(v, list):
            raise AnchorError(f"{origin}: '{name}' must be a list, got {type(v).__name__}")
    for name in ("boxes", "boxes_norm"):
        v = d.get(name)
        if v is not None and len(v) > MAX_BOXES:
            raise AnchorError(f"{origin}: {len(v)} boxes; at most {MAX_BOXES} are allowed")
    world = d.get("world")
    if world is not None:
        if not isinstance(world, dict):
            raise AnchorError(f"{origin}: 'world' must be an object with 'boxes_ras', got {type(world).__name__}")
        boxes_ras = world.get("boxes_ras")
        if boxes_ras is not None and not isinstance(boxes_ras, list):
            raise AnchorError(f"{origin}: 'world.boxes_ras' must be a list of [[r, a, s], [r, a, s]] pairs")
        if boxes_ras is not None and len(boxes_ras) > MAX_BOXES:
            raise AnchorError(f"{origin}: {len(boxes_ras)} world boxes; at most {MAX_BOXES} are allowed")
