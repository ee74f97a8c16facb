"""The grounder's answer text: parse it strictly, write it canonically.

Format (MedVol-R1, docs/architecture.md, "Answer format")::

    <think>REASONING</think><answer>[{"slice": z, "bbox_2d_list": [[x0, y0, x1, y1], ...]}]</answer>

``z`` is the 0-based key-slice index and every box is ``[x0, y0, x1, y1]`` normalised to
0..1000 over the slice image. The empty list, ``<answer>[]</answer>``, is the *absent* answer:
the target is not present in this volume (no slice, no boxes).

:func:`parse_answer` is strict: anything that does not follow the format raises
:class:`~medvolcore.errors.AnswerFormatError` with a message naming the problem. The rules:

* exactly one ``<think>…</think>`` block and exactly one ``<answer>…</answer>`` block, the
  think block first; only whitespace may sit between ``</think>`` and ``<answer>``;
* the answer content is strict JSON (no single quotes, no trailing commas, no duplicate
  keys, no ``NaN``/``Infinity``) holding exactly one entry with the fields
  ``slice`` and ``bbox_2d_list`` (other fields, e.g. a ``label``, are ignored), or no entry
  at all (``[]``, the absent answer);
* ``slice`` is a non-negative whole number; ``bbox_2d_list`` holds at least one box of four
  finite coordinates, each within 0..1000. Booleans are never numbers.

It is tolerant of exactly these deviations:

* whitespace and newlines anywhere around or inside the tags (``< think >``) and the JSON;
* text before ``<think>`` or after ``</answer>`` (ignored);
* a missing list wrapper: ``<answer>{"slice": 5, "bbox_2d_list": [...]}</answer>``;
* a single box not wrapped in a list: ``"bbox_2d_list": [x0, y0, x1, y1]``;
* numbers given as numeric strings (``"12"``, ``" 12.5 "``), and a slice given as a float
  with an integral value (``12.0``; ``12.5`` is an error);
* an empty think block (the reasoning is then ``""``).

Boxes are returned exactly as given, as floats: an inverted box (``x0 > x1`` or ``y0 > y1``)
or a degenerate one is *not* a format error here; the stage that converts boxes to pixels
reorders them.

:func:`format_answer` writes the canonical text (integer coordinates rounded half away from
zero, compact JSON); ``parse_answer(format_answer(...))`` round-trips. ``format_answer(None, [])``
(or :func:`absent_answer`) writes the absent answer.
:func:`answer_from_anchor` does the same for any object with ``slice``, ``boxes_norm`` and
``reasoning`` attributes (an evidence anchor).

This module imports only the standard library.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass
from typing import Optional

from .errors import AnchorError, AnswerFormatError, InputError
from .strictjson import DuplicateKeyError, unique_keys

__all__ = ["ParsedAnswer", "parse_answer", "format_answer", "absent_answer", "answer_from_anchor", "ABSENT_JSON"]

NORM_MAX = 1000.0
_EXPECTED = ('expected <think>…</think><answer>[{"slice": z, "bbox_2d_list": [[x0, y0, x1, y1]]}]</answer> '
             '(or <answer>[]</answer>: not present)')
ABSENT_JSON = "[]"
_FIELDS = ("slice", "bbox_2d_list")
_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_TAGS = {name: (re.compile(rf"<\s*{name}\s*>"), re.compile(rf"<\s*/\s*{name}\s*>"))
         for name in ("think", "answer")}


@dataclass(frozen=True)
class ParsedAnswer:
    """A parsed model answer. ``boxes_norm`` are 0..1000 floats, as given (not reordered).

    The absent answer (``[]``) has ``slice`` None and no boxes; :attr:`absent` says so."""

    slice: Optional[int]
    boxes_norm: list
    reasoning: str
    raw: str

    @property
    def absent(self) -> bool:
        """True for ``<answer>[]</answer>``: the model says the target is not in this volume."""
        return self.slice is None


def _show(value) -> str:
    """A value as it would read in the answer text."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _number(value, what: str) -> float:
    """A finite float from a JSON number or numeric string; booleans are not numbers."""
    if isinstance(value, str) and _NUMBER_RE.fullmatch(value.strip()):
        value = value.strip()
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AnswerFormatError(f"{what} {_show(value)} is not a number")
    try:
        result = float(value)
    except OverflowError:  # an integer too large for a float
        result = math.inf
    if not math.isfinite(result):
        raise AnswerFormatError(f"{what} {_show(value)} is not a finite number")
    return result


def _block(text: str, name: str) -> tuple:
    """(content start, content end, open start, close end) of the single ``name`` block."""
    opens, closes = (list(rx.finditer(text)) for rx in _TAGS[name])
    if not opens and not closes:
        raise AnswerFormatError(f"answer has no <{name}>…</{name}> block; {_EXPECTED}")
    if len(opens) > 1 or len(closes) > 1:
        raise AnswerFormatError(f"answer has more than one <{name}> block; exactly one is expected")
    if not opens:
        raise AnswerFormatError(f"answer has </{name}> but no opening <{name}> tag")
    if not closes:
        raise AnswerFormatError(f"answer has <{name}> but no closing </{name}> tag")
    if closes[0].start() < opens[0].end():
        raise AnswerFormatError(f"answer has </{name}> before <{name}>")
    return opens[0].end(), closes[0].start(), opens[0].start(), closes[0].end()


def _reject_constant(name):
    raise AnswerFormatError(f"<answer> content contains {name}, which is not a finite number")


def _parse_slice(value) -> int:
    if value is None:
        raise AnswerFormatError("slice is null; expected a non-negative whole number")
    z = _number(value, "slice")
    if not z.is_integer():
        raise AnswerFormatError(f"slice {_show(value)} is not a whole number")
    if z < 0:
        raise AnswerFormatError(f"slice {_show(int(z))} is negative")
    return int(z)


def _parse_boxes(value) -> list:
    if not isinstance(value, list):
        raise AnswerFormatError(f"bbox_2d_list must be a list of boxes, got {_show(value)}")
    if not value:
        raise AnswerFormatError("bbox_2d_list is empty; at least one box is expected")
    nested = [isinstance(item, list) for item in value]
    if not any(nested):
        value = [value]  # a single box given without the outer list
    elif not all(nested):
        raise AnswerFormatError("bbox_2d_list mixes boxes and bare values; expected [[x0, y0, x1, y1], ...]")
    boxes = []
    for i, box in enumerate(value, start=1):
        if len(box) != 4:
            raise AnswerFormatError(f"box {i} has {len(box)} coordinates, expected 4 ([x0, y0, x1, y1])")
        coords = [_number(c, f"box {i} coordinate") for c in box]
        for c in coords:
            if not 0.0 <= c <= NORM_MAX:
                raise AnswerFormatError(f"box {i} coordinate {_show(c)} outside 0..1000")
        boxes.append(coords)
    return boxes


def parse_answer(text: str) -> ParsedAnswer:
    """Parse a model answer (see the module docstring for the exact rules).

    Raises :class:`AnswerFormatError` naming what is wrong.
    """
    if not isinstance(text, str):
        raise AnswerFormatError(f"answer must be text, got {type(text).__name__}")
    t_start, t_end, _, t_close = _block(text, "think")
    a_start, a_end, a_open, _ = _block(text, "answer")
    if a_open < t_close:
        raise AnswerFormatError("the <answer> block must come after the <think> block")
    if text[t_close:a_open].strip():
        raise AnswerFormatError("unexpected text between </think> and <answer>")
    content = text[a_start:a_end].strip()
    if not content:
        raise AnswerFormatError(f"<answer> block is empty; {_EXPECTED}")
    try:
        data = json.loads(content, object_pairs_hook=unique_keys, parse_constant=_reject_constant)
    except DuplicateKeyError as exc:
        raise AnswerFormatError(f"answer entry has the {exc.key!r} field more than once") from None
    except json.JSONDecodeError as exc:
        raise AnswerFormatError(
            f"<answer> content is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})") from None
    if isinstance(data, dict):
        data = [data]  # tolerated: the list wrapper is missing
    if not isinstance(data, list):
        raise AnswerFormatError(f"<answer> content must be a list with one entry, got {_show(data)}")
    if not data:  # the absent answer
        return ParsedAnswer(slice=None, boxes_norm=[], reasoning=text[t_start:t_end].strip(), raw=text)
    if len(data) != 1:
        raise AnswerFormatError(f"answer lists {len(data)} entries; exactly one key slice is expected")
    entry = data[0]
    if not isinstance(entry, dict):
        raise AnswerFormatError(f"answer entry must be a JSON object, got {_show(entry)}")
    for field in _FIELDS:
        if field not in entry:
            raise AnswerFormatError(f"answer entry has no {field!r} field")
    return ParsedAnswer(slice=_parse_slice(entry["slice"]), boxes_norm=_parse_boxes(entry["bbox_2d_list"]),
                        reasoning=text[t_start:t_end].strip(), raw=text)


def _round(v: float) -> int:
    """Round half away from zero (coordinates are non-negative, so half up)."""
    return int(math.floor(v + 0.5))


def _checked_reasoning(reasoning) -> str:
    reasoning = "" if reasoning is None else str(reasoning).strip()
    for name in ("think", "answer"):
        if any(rx.search(reasoning) for rx in _TAGS[name]):
            raise InputError(f"reasoning must not contain a <{name}> or </{name}> tag")
    return reasoning


def absent_answer(reasoning: str | None = "") -> str:
    """Canonical text of the absent answer: ``<think>…</think><answer>[]</answer>``."""
    return f"<think>{_checked_reasoning(reasoning)}</think><answer>{ABSENT_JSON}</answer>"


def format_answer(slice_index, boxes_norm, reasoning: str | None = "") -> str:
    """Canonical answer text for a key slice and its 0..1000 boxes.

    ``boxes_norm`` is a sequence of ``[x0, y0, x1, y1]`` (a single flat box is accepted too);
    coordinates are rounded half up to integers and written as given (not reordered).
    ``slice_index`` None with no boxes writes the absent answer (:func:`absent_answer`).
    Raises :class:`InputError` for values the format cannot hold.
    """
    if slice_index is None:
        if boxes_norm is not None and len(list(boxes_norm)):
            raise InputError("an absent answer (slice None) has no boxes")
        return absent_answer(reasoning)
    if isinstance(slice_index, bool) or not isinstance(slice_index, numbers.Real) \
            or not 0 <= slice_index < math.inf or slice_index != int(slice_index):
        raise InputError(f"slice {slice_index!r} must be a non-negative whole number")
    reasoning = _checked_reasoning(reasoning)
    try:
        boxes = list(boxes_norm)
    except TypeError:
        raise InputError(f"boxes_norm must be a list of [x0, y0, x1, y1] boxes, got {boxes_norm!r}") from None
    if boxes and all(isinstance(c, numbers.Real) for c in boxes):
        boxes = [boxes]  # a single flat box
    if not boxes:
        raise InputError("boxes_norm is empty; at least one box is needed")
    out = []
    for i, box in enumerate(boxes, start=1):
        try:
            box = list(box)
        except TypeError:
            raise InputError(f"box {i} must be [x0, y0, x1, y1], got {box!r}") from None
        if len(box) != 4:
            raise InputError(f"box {i} has {len(box)} coordinates, expected 4 ([x0, y0, x1, y1])")
        row = []
        for c in box:
            if isinstance(c, bool) or not isinstance(c, numbers.Real) or not 0.0 <= c <= NORM_MAX:
                raise InputError(f"box {i} coordinate {c!r} must be a finite number within 0..1000")
            row.append(_round(float(c)))
        out.append(row)
    body = json.dumps([{"slice": int(slice_index), "bbox_2d_list": out}])
    return f"<think>{reasoning}</think><answer>{body}</answer>"


def answer_from_anchor(anchor, reasoning: str | None = None) -> str:
    """Answer text for an evidence anchor (any object with ``slice``, ``boxes_norm`` and
    ``reasoning``); ``reasoning`` overrides the anchor's own. An anchor whose ``absent`` is true
    gives the absent answer. Raises :class:`AnchorError`."""
    if reasoning is None:
        reasoning = getattr(anchor, "reasoning", None) or ""
    if getattr(anchor, "absent", False):
        try:
            return absent_answer(reasoning)
        except InputError as exc:
            raise AnchorError(f"anchor cannot be written as a model answer: {exc}") from None
    for attr in ("slice", "boxes_norm"):
        if getattr(anchor, attr, None) is None:
            raise AnchorError(f"anchor has no {attr!r}; cannot write it as a model answer")
    try:
        return format_answer(anchor.slice, anchor.boxes_norm, reasoning)
    except InputError as exc:
        raise AnchorError(f"anchor cannot be written as a model answer: {exc}") from None
