"""A segment job's request, declared once: the contract every front door builds.

:class:`SegmentRequest` declares each field once — its type, default and limits, what it means,
and its name at each door: the command line's option (``--consensus``), the worker's wire key
(``consensus``, with its JSON type and the ops that read it) and the batch manifest's column
(``query``). :meth:`SegmentRequest.check` holds every rule between fields, each written once. The
doors build a request with :meth:`~SegmentRequest.from_cli`, :meth:`~SegmentRequest.from_wire` or
:meth:`~SegmentRequest.from_manifest`; a request remembers the door that built it, so an error
names the field as that door's user knows it: ``--stop-after-empty`` on the command line,
``'stop_after_empty'`` on the wire, the column ``'query'`` in a manifest, ``stop_after_empty`` for a
request built in Python. :func:`medvolcore.jobs.run_segment_job` checks every request again
(built anywhere, it is checked before anything is read). Its result is declared in
:mod:`medvolcore.result`.

The rules of one value live with the code that owns the value, and the request calls them with
the door's name: the query's text (:func:`medvolcore.grounder.validate_query`), a consensus's size
(:func:`medvolcore.grounder.check_samples`), its mask mode (:func:`medvolcore.consensus.check_mask_mode`),
early stop's K (:func:`medvolcore.propagation.check_stop_after_empty`) and the display window
(:func:`medvolcore.windowing.get_window`). A broken field rule is a :class:`~medvolcore.errors.FieldError`
(the worker's ``bad_request``); a query's text is the user's content (``bad_input``).
"""

from __future__ import annotations

import dataclasses
import unicodedata
from dataclasses import dataclass, fields
from typing import Optional, Sequence

from .errors import FieldError, InputError

__all__ = ["SegmentRequest", "FieldError", "MAX_TARGETS", "DOORS", "MAX_WIRE_INT", "is_unicode", "wire_value"]

MAX_TARGETS = 64  # queries in one job (label values 1..64)
DOORS = ("api", "cli", "wire", "manifest")  # who built a request: Python, `medvol`, the worker, a batch manifest
OPS = ("segment", "propagate")  # the worker's ops that carry a request
MAX_WIRE_INT = 2 ** 63  # every integer a worker client sends (ids included) is within ±2**63


# ---- the wire's JSON values ------------------------------------------------------------------

_MISSING = object()
_TYPE_NAMES = {"str": "a string", "int": "an integer", "bool": "true/false", "dict": "an object", "list": "a list",
               "float": "a number"}
_PLURAL_NAMES = {"str": "strings", "int": "integers", "float": "numbers", "dict": "objects"}


def is_unicode(text: str) -> bool:
    """False for text holding a lone surrogate (JSON allows ``\\ud800``; UTF-8 does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def wire_value(req: dict, name: str, types, *, required: bool = False, default=None, what: str = "", items=None):
    """Field ``name`` of a worker request (a JSON object), type-checked: bool is never a number, text
    must be valid Unicode, an integer lies within ±:data:`MAX_WIRE_INT`; ``items``: a list's element
    type (the list must not be empty). Missing or null → ``default`` (or refused when ``required``)."""
    op = req.get("op")
    value = req.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise FieldError(f"{op}: missing field '{name}'{what}")
        return default
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join(_TYPE_NAMES[t.__name__] for t in types)
        raise FieldError(f"{op}: field '{name}' must be {names}, got {type(value).__name__}")
    if isinstance(value, str) and not is_unicode(value):
        raise FieldError(f"{op}: field '{name}' is not valid Unicode text (a lone surrogate)", "bad_input")
    if isinstance(value, int) and not isinstance(value, bool) and not -MAX_WIRE_INT < value < MAX_WIRE_INT:
        raise FieldError(f"{op}: field '{name}' is out of range")
    if items is not None:
        if not value or not all(isinstance(v, items) and not isinstance(v, bool) for v in value):
            raise FieldError(f"{op}: field '{name}' must be a non-empty list of {_PLURAL_NAMES[items.__name__]}")
        if items is str and not all(is_unicode(v) for v in value):
            raise FieldError(f"{op}: field '{name}' holds text that is not valid Unicode", "bad_input")
    return value


def _wire_window(value, op: str):
    """``window`` on the wire: a preset name (or ``"C,W"``), or ``[centre, width]`` in HU."""
    if isinstance(value, list):
        if len(value) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise FieldError(f"{op}: field 'window' must be a preset name or [centre, width] in HU, got {value!r}")
        return tuple(value)
    return value


# ---- the declaration -------------------------------------------------------------------------

def _declare(default=None, *, doc: str, label: str = "", cli: Optional[str] = None, dest=..., invert: bool = False,
             wire: Optional[str] = None, ops: Sequence[str] = OPS, types=None, items=None, read=None,
             required: Sequence[str] = (), unless: Optional[str] = None, what: str = "",
             manifest: Optional[str] = None):
    """One request field: its default and description; ``label``: how a Python caller's messages
    call it (default: its name); ``cli``: the command line's option (``dest``: the argparse
    attribute it is read from, None when the command assembles the value itself; ``invert``: the
    option says the opposite, ``--no-constrain``); ``wire``: the worker's key, read by ``ops`` as
    JSON ``types`` (``items``: a list's element type; ``read``: turns the JSON value into the
    field's), ``required`` by those ops (``unless`` field ``unless`` is given; ``what`` completes
    the message); ``manifest``: the batch manifest's column."""
    if dest is ...:
        dest = cli[2:].replace("-", "_") if cli else None
    return dataclasses.field(default=default, metadata={
        "doc": doc, "label": label, "cli": cli, "dest": dest, "invert": invert, "wire": wire, "ops": tuple(ops),
        "types": types, "items": items, "read": read, "required": tuple(required), "unless": unless, "what": what,
        "manifest": manifest})


@dataclass
class SegmentRequest:
    """What to segment and how: ``query`` (ground, then propagate), ``queries`` (several targets), or
    a given anchor (``anchor``, or ``key_slice`` + ``boxes``: the language model is not used).
    Each field below is declared once; :meth:`check` applies every rule."""

    query: Optional[str] = _declare(
        doc="what to find, in the clinician's words (at most 2000 characters, stripped): ground it, then propagate",
        label="a query", cli="--query", dest=None, wire="query", ops=("segment",), types=str,
        required=("segment",), unless="queries", what=" (or 'queries': a list of them, one target each)",
        manifest="query")
    anchor: object = _declare(
        doc="a given anchor to propagate: an EvidenceAnchor, its dict or an *.anchor.json path (boxes or world)",
        label="an anchor", cli="--anchor", wire="anchor", ops=("propagate",), types=dict, required=("propagate",),
        what=" (a medvol.anchor/1, /2 or /4 object)")
    key_slice: Optional[int] = _declare(
        doc="a given anchor's key slice (canonical stack z), with boxes; source 'user'", label="a key slice",
        cli="--slice")
    boxes: Optional[Sequence[Sequence[int]]] = _declare(
        doc="inclusive pixel boxes [x0, y0, x1, y1] on the key slice", label="boxes", cli="--box")
    hu_window: object = _declare(
        doc="the display window: a preset name, 'C,W' or (centre, width) in HU; None: soft tissue",
        label="the display window", cli="--ct-window", wire="window", types=(str, list), read=_wire_window)
    stop_after_empty: Optional[int] = _declare(
        doc="early stop's K: an integer ≥ 0 (None: the pipeline's default; 0: the whole volume)",
        cli="--stop-after-empty", wire="stop_after_empty", types=int)
    constrain: bool = _declare(
        True, doc="grammar-constrained decoding", cli="--no-constrain", invert=True, wire="constrain",
        ops=("segment",), types=bool)
    sample: bool = _declare(
        False, doc="sample the answer instead of greedy decoding", cli="--sample", wire="sample", ops=("segment",),
        types=bool)
    seed: Optional[int] = _declare(
        doc="the random seed of sampling (and of a consensus's samples)", cli="--seed", wire="seed", ops=("segment",),
        types=int)
    span: Optional[int] = _declare(
        doc="propagate only slices [k - span, k + span] (a whole number ≥ 0; None: all)", label="the slice span",
        cli="--window")
    largest_component: bool = _declare(
        False, doc="keep each box's largest 3-D connected component", cli="--largest-component")
    qc_title: Optional[str] = _declare(
        doc="the QC picture's title (default 'query: …'; a manifest's: '<id> · query: …')", label="the QC title")
    reference: object = _declare(
        doc="a ground-truth mask on the volume's own grid (a boolean array of its shape): scored and drawn in the QC",
        label="a reference mask")
    prompts: Optional[Sequence[dict]] = _declare(
        doc="pixel-form correction prompts (medvolcore.prompts), added after the given anchor's own; a prompt "
            "{slice, object, mask_file} is a mask prompt read from that file (medvolcore.maskprompt) with the volume",
        label="correction prompts", cli="--add-box/--inside-point/--outside-point/--mask-prompt", dest="prompts")
    z_range: Optional[Sequence[int]] = _declare(
        doc="[z0, z1]: replaces the given anchor's slice range", label="a slice range", cli="--z-range")
    consensus: int = _declare(
        1, doc="G answers instead of one, 1..MAX_SAMPLES (1 = off), for a query only; the wire's propagate reads it "
               "too, to refuse it", cli="--consensus", wire="consensus", types=int)
    consensus_mask: str = _declare(
        "greedy", doc="a consensus's mask: 'greedy' (the greedy answer's) or 'majority' (more than half the samples)",
        cli="--consensus-mask", wire="consensus_mask", types=str)
    queries: Optional[Sequence[str]] = _declare(
        doc=f"several targets in one job instead of query: 1..{MAX_TARGETS} distinct queries, label k for query k; "
            "every other value applies to each", cli="--query/--queries", dest=None, wire="queries",
        ops=("segment",), types=list, items=str)
    target_name: Optional[str] = _declare(
        doc="the structure the query is about when the data says so (a dataset's label name, kidney_left): it names "
            "and codes the segment; the model still reads the query. Short text, one query only",
        label="the target name", cli="--target-name", wire="target_name", ops=("segment",), types=str)
    strict_ct: bool = _declare(
        False, doc="refuse a volume that does not look like CT in HU (no air, label-like values) instead of warning",
        cli="--strict-ct", wire="strict_ct", types=bool)
    seg_type: str = _declare(
        "binary", doc="a DICOM-SEG output's type: 'binary' (one BINARY frame set per segment, which every PACS, viewer "
                      "and validator takes) or 'labelmap' (one LABELMAP frame set of every segment: smaller, newer "
                      "than many readers)", label="the DICOM-SEG type", cli="--seg-type", wire="seg_type", types=str)
    door: str = dataclasses.field(default="api", compare=False, repr=False)  # who built it: one of DOORS

    @property
    def grounded(self) -> bool:
        return self.anchor is None and self.key_slice is None and not self.boxes

    @property
    def targets(self) -> int:
        """How many targets the job segments (several only with ``queries``)."""
        return len(self.queries) if self.queries else 1

    # -- names ---------------------------------------------------------------------------------
    def name(self, field_name: str) -> str:
        """How this request's door calls field ``field_name`` (its label where the door has no name for it)."""
        meta = _FIELDS[field_name]
        label = meta["label"] or field_name
        if self.door == "cli":
            return meta["cli"] or label
        if self.door == "wire":
            return f"'{meta['wire']}'" if meta["wire"] else label
        if self.door == "manifest":
            return f"'{meta['manifest']}'" if meta["manifest"] else meta["cli"] or label
        return label

    def _shown(self, door_name: str) -> str:
        """A name the door gave (an output's): quoted on the wire, as the fields are."""
        return f"'{door_name}'" if self.door == "wire" else door_name

    def _limit(self, checker, field_name: str):
        """``checker(value, name)`` (the value's owner's rule) on this field, as a FieldError."""
        try:
            return checker(getattr(self, field_name), self.name(field_name))
        except FieldError:
            raise
        except InputError as e:
            raise FieldError(str(e)) from None

    # -- the rules -----------------------------------------------------------------------------
    def check(self, agreement: Optional[str] = None) -> "SegmentRequest":
        """Apply every rule; clean the query text(s) in place (a list of one query becomes
        ``query``). ``agreement``: the door's name of the agreement-map output when one is asked
        for (it needs a consensus). Returns the request."""
        from .grounder import validate_query

        n = self.name
        if self.queries is not None:
            self._check_queries()
        elif self.grounded:
            if self.query is None:
                raise FieldError(f"give {n('query')} to segment, or {n('anchor')} (or {n('key_slice')} with "
                                 f"{n('boxes')}) to propagate")
            self.query = validate_query(self.query)
        elif self.anchor is not None and (self.key_slice is not None or self.boxes):
            raise FieldError(f"give either {n('anchor')} or {n('key_slice')} with {n('boxes')}, not both")
        elif self.anchor is None and (self.key_slice is None or not self.boxes):
            raise FieldError(f"{n('key_slice')} needs one or more {n('boxes')}, and {n('boxes')} need "
                             f"{n('key_slice')}")
        if self.grounded and (self.prompts or self.z_range is not None):
            raise FieldError(f"{n('prompts')} and {n('z_range')} apply to a given anchor (medvol propagate), not to "
                             "a query")
        if self.target_name is not None:
            if not isinstance(self.target_name, str) or not self.target_name.strip() or len(self.target_name) > 200 \
                    or any(unicodedata.category(c) == "Cc" for c in self.target_name):
                raise FieldError(f"{n('target_name')} must be a short text without control characters (a structure's "
                                 "name, e.g. kidney_left)")
            if self.queries is not None:
                raise FieldError(f"{n('target_name')} names one target; several queries are each coded by their "
                                 "own words")
        self.check_settings(agreement)
        if self.consensus > 1 and not self.grounded:
            raise FieldError(f"{n('consensus')} asks for a consensus of the model's answers to a query; a given "
                             "anchor has none")
        return self

    def check_settings(self, agreement: Optional[str] = None) -> "SegmentRequest":
        """The rules on the job's settings alone (consensus, sampling, early stop, span, window), not
        on its target: what a door checks once for many requests (``medvol batch``'s options, before
        any row is read). :meth:`check` applies them too. Returns the request."""
        from .consensus import check_mask_mode
        from .grounder import MAX_SAMPLES, check_samples
        from .propagation import check_stop_after_empty
        from .windowing import get_window

        n = self.name
        self._limit(check_samples, "consensus")
        self._limit(check_mask_mode, "consensus_mask")
        if self.consensus < 2 and self.consensus_mask != "greedy":
            raise FieldError(f"{n('consensus_mask')} {self.consensus_mask} needs {n('consensus')} from 2 to "
                             f"{MAX_SAMPLES} (a consensus of that many answers)")
        if self.consensus < 2 and agreement:
            raise FieldError(f"{self._shown(agreement)} writes the agreement of a consensus: add {n('consensus')} G "
                             f"(G from 2 to {MAX_SAMPLES})")
        if self.consensus > 1 and self.sample:
            raise FieldError(f"{n('sample')} and {n('consensus')} do not go together: a consensus samples its own "
                             "answers after the greedy one")
        if self.stop_after_empty is not None:
            self._limit(check_stop_after_empty, "stop_after_empty")
        if self.span is not None and (isinstance(self.span, bool) or not isinstance(self.span, int) or self.span < 0):
            raise FieldError(f"{n('span')} must be a whole number of slices ≥ 0, got {self.span!r}")
        get_window(self.hu_window)
        if self.seg_type not in ("binary", "labelmap"):
            raise FieldError(f"{n('seg_type')} must be binary or labelmap, got {self.seg_type!r}")
        return self

    def _check_queries(self) -> None:
        """``queries``: 1..:data:`MAX_TARGETS` distinct valid queries, without ``query``, a given
        anchor or a reference mask; cleaned in place, a list of one becomes ``query``."""
        from .grounder import validate_query

        n = self.name
        if self.query is not None:
            raise FieldError(f"give {n('query')} or {n('queries')}, not both")
        if not self.grounded:
            raise FieldError(f"{n('queries')} are grounded by the model; a given anchor has one target")
        if isinstance(self.queries, (str, bytes)) or not self.queries:
            raise FieldError(f"{n('queries')} must be a non-empty list of texts")
        if len(self.queries) > MAX_TARGETS:
            raise FieldError(f"{n('queries')}: at most {MAX_TARGETS} queries in one job, got {len(self.queries)}")
        cleaned, seen = [], {}
        for i, q in enumerate(self.queries, start=1):
            try:
                q = validate_query(q)
            except InputError as e:
                raise InputError(f"{n('queries')}: query {i}: {e}") from None
            key = " ".join(q.lower().split())
            if key in seen:
                raise InputError(f"{n('queries')}: query {i} repeats query {seen[key]} ({q!r}): give each target once")
            seen[key] = i
            cleaned.append(q)
        if self.reference is not None and len(cleaned) > 1:
            raise FieldError(f"{n('reference')} scores one target; score several with `medvol metrics` per label")
        self.queries = cleaned
        if len(cleaned) == 1:  # one line of a queries file: one query
            self.query, self.queries = cleaned[0], None

    # -- the doors -----------------------------------------------------------------------------
    @classmethod
    def from_cli(cls, args, **given) -> "SegmentRequest":
        """The request of a ``medvol`` command: every declared option the command has (``args``, an
        argparse namespace), and ``given`` (what the command assembles itself: ``query`` or ``queries``
        from ``--query`` repeated and ``--queries FILE``), checked, with the options' names."""
        values = {}
        for f in fields(cls):
            dest = f.metadata.get("dest")
            if dest and f.name not in given and hasattr(args, dest):
                value = getattr(args, dest)
                values[f.name] = (not value) if f.metadata["invert"] else value
        agreement = "--agreement" if getattr(args, "agreement", None) else None
        return cls(**values, **given, door="cli").check(agreement=agreement)

    @classmethod
    def from_wire(cls, req: dict) -> "SegmentRequest":
        """The request of a worker's ``segment`` or ``propagate`` (a parsed JSON object): every
        declared key its op reads, type-checked, then checked, with the keys' names; the op prefixes
        each message. Keys the op does not read are left to the worker (its own: ``volume``, ``out``,
        ``agreement``, …) or ignored, as protocol 1 always did. An ``agreement`` key asks for an
        agreement map (the worker checks its path)."""
        op = req.get("op")
        values = {}
        for f in fields(cls):
            m = f.metadata
            if not m.get("wire") or op not in m["ops"]:
                continue
            unless = _FIELDS[m["unless"]]["wire"] if m["unless"] else None
            required = op in m["required"] and (unless is None or req.get(unless) is None)
            value = wire_value(req, m["wire"], m["types"], required=required, what=m["what"], items=m["items"])
            if value is not None:
                values[f.name] = m["read"](value, op) if m["read"] else value
        request = cls(**values, door="wire")
        try:
            return request.check(agreement="agreement" if req.get("agreement") is not None else None)
        except InputError as e:
            e.args = (f"{op}: {e}",)
            raise

    @classmethod
    def from_manifest(cls, row: dict, **settings) -> "SegmentRequest":
        """The request of one row of a ``medvol batch`` manifest (a dict of its columns): the declared
        columns (``query``), the QC title ``'<id> · query: …'``, and ``settings`` (the run's options,
        by field name: ``hu_window``, ``stop_after_empty``, ``consensus``, ``reference``, …), checked;
        messages name a column as the manifest does (``'query'``) and an option as ``medvol batch``
        does (``--consensus``)."""
        values = {f.name: row[f.metadata["manifest"]] for f in fields(cls)
                  if f.metadata.get("manifest") and row.get(f.metadata["manifest"]) is not None}
        request = cls(**{**values, **settings}, door="manifest").check()
        if request.qc_title is None and row.get("id") is not None:
            request.qc_title = f"{row['id']} · query: {request.query}"
        return request


_FIELDS = {f.name: f.metadata for f in fields(SegmentRequest) if f.metadata}
