"""Coded names for what a query segments: SNOMED CT category and type (+ laterality) and a colour.

The table is TotalSegmentator's mapping of its 170 structures to SNOMED CT
(``Resources/terminology/totalsegmentator_snomed_mapping.csv``, with its source and licence in
that folder's README) plus a few synonyms (``synonyms.json``). :func:`match` reads a free-form
query and says what it matched and how, never more:

* ``name``: the whole query (lower case, punctuation and a leading "the"/"a"/"an" dropped) is a
  structure's name — ``"liver"``, ``"The right kidney"``, ``"kidney_right"``, ``"gall bladder"``;
* ``mentioned``: the query names exactly one structure among other words — ``"the kidney that
  contains the cyst"`` → kidney (no laterality: the query does not say which); where two names
  overlap the longer wins (``"left kidney"`` over ``"kidney"``);
* ``generic``: nothing is named (``"the organ that secretes bile"``: an implicit query; the model
  may find the liver, but the words do not say so), or several structures are (``"the liver and
  the spleen"``): the generic code *Anatomical structure* and a note saying why. No meaning is
  guessed from the query's wording;
* ``target``: the data says what the query is about (a training set's label name such as
  ``kidney_left`` for "the organ that filters blood on the left", given as ``--target-name``): a
  known name codes the segment, and the note says the name, not the query, did.

The codes serve DICOM-SEG and Slicer's segment terminology; the colour is the table's DICOM RGB
colour (a fixed palette colour for a generic entry, by segment number).
"""

from __future__ import annotations

import csv
import functools
import json
import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .resources import resource_path

Code = Tuple[str, str, str]  # (coding scheme designator, code value, code meaning)

ANATOMICAL_STRUCTURE: Code = ("SCT", "123037004", "Anatomical Structure")
GENERIC_TYPE: Code = ("SCT", "91723000", "Anatomical structure")
SLICER_CONTEXT = "Segmentation category and type - DICOM master list"
SLICER_REGION_CONTEXT = "Anatomic codes - DICOM master list"
# colours of generic segments, by segment number (1-based): distinct, readable on a CT
PALETTE = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
           (70, 240, 240), (240, 50, 230)]
_ARTICLES = ("the ", "a ", "an ")


@dataclass(frozen=True)
class Term:
    """What a query was matched to (see the module docstring for ``how``)."""

    structure: str  # the table's name ("kidney_right"); "" for generic
    category: Code
    type: Code
    modifier: Optional[Code]
    color: Tuple[int, int, int]
    how: str  # "name", "mentioned" or "generic"
    matched: str = ""  # the words of the query that named it
    note: str = ""
    region: Optional[Code] = None  # anatomic region (a kidney cyst's kidney)
    region_modifier: Optional[Code] = None

    @property
    def label(self) -> str:
        """A readable name: the type's meaning with its laterality ("Kidney, Right"), and its
        region when it has one ("Cyst (Kidney, Left)")."""
        text = self.type[2] + (f", {self.modifier[2]}" if self.modifier else "")
        if self.region:
            text += f" ({self.region[2]}" + (f", {self.region_modifier[2]}" if self.region_modifier else "") + ")"
        return text

    def slicer_terminology(self) -> str:
        """The entry as Slicer serialises a segment's ``TerminologyEntry`` tag."""
        def c(code):
            return "^".join(code) if code else "^^"

        return (f"{SLICER_CONTEXT}~{c(self.category)}~{c(self.type)}~{c(self.modifier)}"
                f"~{SLICER_REGION_CONTEXT}~{c(self.region)}~{c(self.region_modifier)}")

    def _as(self, how: str, matched: str = "", note: str = "") -> "Term":
        return Term(self.structure, self.category, self.type, self.modifier, self.color, how, matched, note,
                    self.region, self.region_modifier)

    def to_dict(self) -> dict:
        return {"structure": self.structure, "label": self.label, "how": self.how, "matched": self.matched,
                "category": list(self.category), "type": list(self.type),
                "modifier": list(self.modifier) if self.modifier else None,
                "region": list(self.region) if self.region else None,
                "region_modifier": list(self.region_modifier) if self.region_modifier else None,
                "color": list(self.color), "note": self.note, "slicer_terminology": self.slicer_terminology()}


def _code(row: dict, prefix: str) -> Optional[Code]:
    scheme, value, meaning = (row.get(f"{prefix}.{k}", "").strip() for k in
                              ("CodingSchemeDesignator", "CodeValue", "CodeMeaning"))
    return (scheme, value, meaning) if scheme and value else None


def normalise(text: str) -> str:
    """Lower case, every run of non-alphanumerics one space, a leading article dropped."""
    t = " ".join(re.sub(r"[^0-9a-z]+", " ", str(text).lower()).split())
    for a in _ARTICLES:
        if t.startswith(a):
            return t[len(a):]
    return t


@functools.lru_cache(maxsize=1)
def table() -> Dict[str, Term]:
    """Every structure of the mapping by its name, plus the structures without laterality
    (``"kidney"``) under their type meaning; each a ``Term`` with ``how`` unset ("")."""
    out: Dict[str, Term] = {}
    with open(resource_path("terminology", "totalsegmentator_snomed_mapping.csv"), newline="",
              encoding="utf-8") as f:
        for row in csv.DictReader(f):
            color = tuple(int(c) for c in row["DicomRGBColor"].split(","))
            out[row["Structure"]] = Term(row["Structure"], _code(row, "SegmentedPropertyCategoryCodeSequence"),
                                         _code(row, "SegmentedPropertyTypeCodeSequence"),
                                         _code(row, "SegmentedPropertyTypeModifierCodeSequence"), color, "",
                                         region=_code(row, "AnatomicRegionSequence"),
                                         region_modifier=_code(row, "AnatomicRegionModifierSequence"))
    for name, t in list(out.items()):
        if t.modifier is not None and t.region is None:
            plain = normalise(t.type[2]).replace(" ", "_")
            if plain not in out:  # "kidney": the type without its laterality
                out[plain] = Term(plain, t.category, t.type, None, t.color, "")
    return out


@functools.lru_cache(maxsize=1)
def phrases() -> Dict[str, str]:
    """Every phrase that names a structure → its name in :func:`table`."""
    out: Dict[str, str] = {}
    for name in table():
        words = name.split("_")
        out[" ".join(words)] = name
        if words[-1] in ("left", "right") and len(words) > 1:
            out[" ".join([words[-1]] + words[:-1])] = name  # "right kidney"
    with open(resource_path("terminology", "synonyms.json"), encoding="utf-8") as f:
        syn = json.load(f)
    for k, v in syn.items():
        if not k.startswith("_") and v in table():
            out[normalise(k)] = v
    return out


def generic(index: int = 1, note: str = "") -> Term:
    """The generic entry (Anatomical structure), coloured by segment number ``index`` (1-based)."""
    return Term("", ANATOMICAL_STRUCTURE, GENERIC_TYPE, None, PALETTE[(max(index, 1) - 1) % len(PALETTE)],
                "generic", note=note)


def match(query: str, index: int = 1, target: Optional[str] = None) -> Term:
    """The coded entry for ``query`` (see the module docstring); ``index``: the segment's number,
    for a generic entry's colour. ``target``: the structure's name when the data says what the
    query is about (a dataset's label name, ``kidney_left``; ``--target-name``): a known name codes
    the segment (``how`` ``"target"``, said in the note) whatever the query's words; an unknown one
    is said in the note and the query is matched as without it."""
    if target is not None and str(target).strip():
        t = normalise(target)
        ph = phrases()
        if t in ph:
            e = table()[ph[t]]
            return e._as("target", matched=str(target),
                         note=f"coded as {e.label} by the given target name '{target}', not by the query's words")
        base = match(query, index)
        extra = f"the target name '{target}' is not a known structure"
        return base._as(base.how, base.matched, f"{extra}; {base.note}" if base.note else extra)
    q = normalise(query)
    ph = phrases()
    if q in ph:
        return table()[ph[q]]._as("name", matched=q)
    found = []
    padded = f" {q} "
    for p, name in ph.items():
        if f" {p} " in padded:
            found.append((p, name))
    # a phrase inside a longer one found ("kidney" in "left kidney") does not count on its own
    kept = {name: p for p, name in found if not any(p != o and f" {p} " in f" {o} " for o, _ in found)}
    if len(kept) == 1:
        name, p = next(iter(kept.items()))
        t = table()[name]
        return t._as("mentioned", matched=p, note=f"coded as {t.label}: the query mentions '{p}'")
    if kept:
        names = ", ".join(sorted(table()[n].label for n in kept))
        return generic(index, f"the query mentions several structures ({names}): coded as a generic "
                              "anatomical structure")
    return generic(index, "no known structure is named in the query: coded as a generic anatomical structure "
                          "(the model's answer is not used to name it)")


__all__ = ["Term", "match", "generic", "normalise", "table", "phrases", "ANATOMICAL_STRUCTURE", "GENERIC_TYPE"]
