"""Free-form clinical queries for training samples (MedVol-R1: descriptions, not label names).

Sources (``Resources/training/``): M3D's term dictionary (label → descriptions) and M3D's
segmentation question templates (``Seg_templates``: ``des_questions`` wrap a description,
``cls_questions`` a label name), both MIT; and our relational paraphrases for KiTS23-style
test queries.

Rules
-----
* **Implicit queries** (the default, ``kind="implicit"``) use a description that does not name
  its own label (:func:`names_label`: the label phrase, singular or plural, with or without the
  space of a compound such as "gall bladder", in either word order with up to two words
  between, case-insensitive). "Abnormal growth of cells in the kidney" stays for *kidney tumor*;
  "Left kidney is one of a pair …" goes for *left kidney*.
* **Held-out descriptions.** Each label's usable descriptions are split once, independently of
  any seed, into a test part (a fraction ``test_fraction``, at least one when the label has two
  or more) and a train part, by the sha256 of the normalised text. Train-split samples draw only
  from the train part and test-split samples only from the test part, so no description used in
  training appears in a test query of the same label (or of an alias sharing the text).
* **Seeded draws.** The description and the template of a sample depend only on
  ``(seed, case id, label, split)``, through a sha256-derived generator: the same seed gives the
  same queries in any process or order.
* **Explicit queries** (``kind="explicit"``) wrap the label name in a ``cls_questions`` template;
  they are used when a label has no dictionary entry (with a note) or when asked for.
* **Relational queries** (KiTS23, M3D-Seg 0004, test split): "the kidney containing an obvious
  fluid-filled sac" — a template and a lesion attribute from ``relational_queries.json``.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from . import resources
from .errors import DataError

KINDS = ("implicit", "explicit")
SPLITS = ("train", "test")
DEFAULT_TEST_FRACTION = 0.2


@dataclass(frozen=True)
class Query:
    """One drawn query: its text and where it came from."""

    text: str
    kind: str  # implicit | explicit | relational
    description: Optional[str] = None
    template: Optional[str] = None
    term: Optional[str] = None  # the dictionary key used
    notes: tuple = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return {"text": self.text, "kind": self.kind, "description": self.description, "template": self.template,
                "term": self.term, "notes": list(self.notes)}


def seeded_rng(seed: int, *parts) -> np.random.Generator:
    """A generator that depends only on ``seed`` and ``parts`` (stable across processes)."""
    h = hashlib.sha256(repr((int(seed),) + tuple(str(p) for p in parts)).encode("utf-8")).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", str(text).strip().lower())


def label_key(name: str) -> str:
    """A target name as the queries see it (case, spaces and ``_`` folded): two names with one key
    would draw the same descriptions, so a row may not hold both."""
    return _norm(str(name).replace("_", " "))


def _word_variants(word: str) -> str:
    w = re.escape(word)
    return rf"{w}(?:s|es)?" if not word.endswith("s") else rf"(?:{w}|{re.escape(word[:-1])})"


# Compounds written in one word or two (the term dictionary has both "gallbladder" and "gall bladder").
_COMPOUNDS = {"gallbladder": "gall bladder", "postcava": "post cava"}


def names_label(description: str, label: str) -> bool:
    """Whether ``description`` names ``label`` itself (see the module docstring)."""
    key = _norm(label).replace("_", " ")
    alias = _COMPOUNDS.get(key) or next((k for k, v in _COMPOUNDS.items() if v == key), None)
    if alias and names_label(description, alias.replace(" ", "_") if " " in alias else alias + "_"):
        return True
    words = [w for w in re.split(r"[\s_\-]+", _norm(label)) if w]
    if not words:
        return False
    text = _norm(description)
    patterns = [r"\b" + r"[\s\-]*".join(_word_variants(w) for w in words) + r"\b"]
    if len(words) == 2:
        a, b = (_word_variants(w) for w in words)
        patterns.append(rf"\b{b}\W+(?:\w+\W+){{0,2}}{a}\b")
        patterns.append(rf"\b{a}\W+(?:\w+\W+){{0,2}}{b}\b")
    return any(re.search(p, text) for p in patterns)


def term_key(label: str, terms: dict) -> Optional[str]:
    """The term-dictionary key for a label name (``kidney_left`` → ``left kidney``), or None."""
    cand = _norm(label).replace("_", " ")
    options = [cand]
    words = cand.split()
    if len(words) >= 2 and words[-1] in ("left", "right"):
        options.append(" ".join([words[-1]] + words[:-1]))
    if len(words) >= 2 and words[0] in ("left", "right"):
        options.append(" ".join(words[1:] + [words[0]]))
    options += [cand.rstrip("s"), cand + "s", cand.replace("gallbladder", "gall bladder"),
                cand.replace("gall bladder", "gallbladder")]
    lower = {k.lower(): k for k in terms}
    for o in options:
        if o in lower:
            return lower[o]
    return None


def split_descriptions(descriptions: List[str], test_fraction: float = DEFAULT_TEST_FRACTION) -> Dict[str, List[str]]:
    """Deterministic train/test split of one label's descriptions (seed-independent)."""
    if not 0.0 <= test_fraction < 1.0:
        raise DataError(f"test_fraction must be in [0, 1), got {test_fraction}")
    uniq = list(dict.fromkeys(d.strip() for d in descriptions if d and d.strip()))
    order = sorted(uniq, key=lambda d: hashlib.sha256(_norm(d).encode("utf-8")).hexdigest())
    n_test = math.ceil(test_fraction * len(order)) if len(order) >= 2 else 0
    if test_fraction > 0 and len(order) >= 2:
        n_test = max(1, min(n_test, len(order) - 1))
    test = set(order[:n_test])
    return {"train": [d for d in uniq if d not in test], "test": [d for d in uniq if d in test]}


class QueryBank:
    """Draws queries for (case, label, split) from the term dictionary and the templates."""

    def __init__(self, test_fraction: float = DEFAULT_TEST_FRACTION, kind: str = "implicit",
                 terms: Optional[dict] = None, templates: Optional[dict] = None, relational: Optional[dict] = None):
        if kind not in KINDS:
            raise DataError(f"unknown query kind {kind!r}; choose one of {', '.join(KINDS)}")
        self.kind = kind
        self.test_fraction = float(test_fraction)
        self.terms = terms if terms is not None else resources.term_dictionary()
        seg = (templates if templates is not None else resources.prompt_templates())["Seg_templates"]
        self.des_templates = [t for t in seg["des_questions"] if t.count("{}") == 1]
        self.cls_templates = [t for t in seg["cls_questions"] if t.count("{}") == 1]
        self.relational = (relational if relational is not None else resources.relational_queries())["datasets"]
        self._splits: Dict[str, Dict[str, List[str]]] = {}

    def descriptions(self, label: str, split: str) -> List[str]:
        """The descriptions ``split`` may use for ``label`` (implicit: those not naming the label)."""
        if split not in SPLITS:
            raise DataError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        key = term_key(label, self.terms)
        if key is None:
            return []
        if key not in self._splits:
            usable = [d for d in self.terms[key] if not names_label(d, key) and not names_label(d, label)]
            self._splits[key] = split_descriptions(usable, self.test_fraction)
        return list(self._splits[key][split])

    def draw(self, case_id: str, label: str, split: str, seed: int = 0) -> Query:
        """A seeded query for one (case, label) on ``split``."""
        rng = seeded_rng(seed, "query", case_id, label, split)
        key = term_key(label, self.terms)
        notes = []
        if self.kind == "implicit":
            pool = self.descriptions(label, split)
            if pool:
                desc = pool[int(rng.integers(len(pool)))]
                tpl = self.des_templates[int(rng.integers(len(self.des_templates)))]
                return Query(tpl.format(desc), "implicit", desc, tpl, key)
            notes.append(f"no usable description of {label!r} in the term dictionary for the {split} split; "
                         "used an explicit query naming the label")
        name = _norm(label).replace("_", " ")
        tpl = self.cls_templates[int(rng.integers(len(self.cls_templates)))]
        return Query(tpl.format(name), "explicit", None, tpl, key, tuple(notes))

    def relational_spec(self, dataset: Optional[str]) -> Optional[dict]:
        return self.relational.get(str(dataset)) if dataset is not None else None

    def draw_relational(self, case_id: str, dataset: str, lesion: str, seed: int = 0) -> Query:
        """A relational query naming the organ that contains ``lesion`` (e.g. "kidney cyst")."""
        spec = self.relational_spec(dataset)
        if spec is None or lesion not in spec["lesions"]:
            raise DataError(f"no relational paraphrases for lesion {lesion!r} of dataset {dataset!r}")
        rng = seeded_rng(seed, "relational", case_id, lesion)
        tpl = spec["templates"][int(rng.integers(len(spec["templates"])))]
        phrases = spec["lesions"][lesion]
        phrase = phrases[int(rng.integers(len(phrases)))]
        return Query(tpl.replace("{lesion}", phrase), "relational", phrase, tpl, spec["organ"])


__all__ = ["Query", "QueryBank", "names_label", "term_key", "split_descriptions", "seeded_rng", "KINDS"]
