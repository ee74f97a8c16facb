"""One segment job, written once: check the outputs, run the pipeline, write the outputs, return one result.

Every front door runs its volumes through :func:`run_segment_job`: ``medvol segment`` and
``medvol demo``, ``medvol propagate``, each case of ``medvol batch`` and the worker's ``segment``
and ``propagate`` requests. Each front door then names the result's fields the way its users
already read them (the CLI's ``--json``, ``done.json``, the worker's replies).

The steps, in this order, so that nothing is loaded or written for a job that cannot finish:

1. the request's own values (query, early-stop K, display window, slice span) and every output
   (:func:`check_outputs`: distinct files, none of them an input, each writable, with a suffix
   of its kind, absent unless ``overwrite``) — before the volume is read;
2. the volume (a path, a :class:`~medvolcore.volume.CTVolume` or an
   :class:`~medvolcore.stack.AxialStack`), then the given anchor against it, if any;
3. the pipeline (a :class:`~medvolcore.pipeline.Pipeline`, or a zero-argument callable returning
   one, so a front door can load models only once the inputs are known good);
4. ground + propagate (``query``) or propagate the given anchor (``anchor``, or ``key_slice`` +
   ``boxes``: the language model is not used);
5. the mask (uint8, on the volume's own grid), then the anchor file, then the QC picture, each
   written atomically (temporary name, then rename). When the grounder answered that the target is
   not in the volume (an *absent* result), no mask file is written unless the outputs ask for an
   all-zero one (``empty_mask_on_absent``); the anchor file (schema ``medvol.anchor/3``) and the QC
   picture are written as usual and say so.

Several targets (``queries``, the CLI's repeated ``--query`` or ``--queries FILE``; a list of one is
``query``): the models load once, the grounder answers every query from one rendering, encoding
and prefill of the slices (:meth:`~medvolcore.grounder.QwenVLGrounder.ground_queries`), and every
anchor is propagated through one feature store, so MedSAM2 encodes each slice at most once for all
(:meth:`~medvolcore.pipeline.Pipeline.segment_queries`). Target ``k`` (1-based, in the order given)
is label ``k`` in every mask output: a label map gets a table beside it (:func:`labels_path`,
``organs.labels.json``, schema ``medvol.labels/1``: each label's value, query, coded name, colour,
terminology entry, voxels and mL, whether it was found, its anchor and QC files, and the overlaps);
a ``.seg.nrrd`` or DICOM-SEG has one segment per query (an absent target's segment is empty). A
voxel that several targets claim goes to the query asked first (:data:`OVERLAP_RULE`,
:func:`resolve_overlaps`); each overlap is reported (``overlaps`` and a note), and every number of
a target (voxels, statistics) is of its mask as written. Per-target files are numbered
(:func:`numbered`): ``--anchor-out a.anchor.json`` → ``a.1.anchor.json``, ``a.2.anchor.json``, …;
likewise the QC pictures and agreement maps. ``--stats`` has one row per target. The mask files
are written unless every target is absent (then as for one absent target). A reference mask
scores one target only.

The result (:func:`run_segment_job`) is one JSON-ready dict:

``mode``         ``"segment"`` (grounded) or ``"propagate"`` (a given anchor)
``volume``       the volume's path, or None for an in-memory volume
``query``        the query (``""`` when propagating an anchor without one)
``preset``       the model preset's name (``""`` for a propagation-only pipeline)
``smoke``        True when an untrained smoke model made the anchor or mask
``absent``       True when the grounder answered that the target is not in this volume: the mask
                 is all zero, nothing was propagated, and ``out`` is None unless an empty mask was
                 asked for
``identity``     what the models are (:func:`medvolcore.models.identity`: ``label``, ``zero_shot``,
                 ``trained_for_task``, …), None for a MedSAM2-only pipeline
``anchor``       the evidence anchor as written to its file (``medvol.anchor/1``, or ``/2`` with
                 correction prompts or a slice range), with
                 ``propagation``: early stop's K and where each direction stopped
``reasoning``    the model's reasoning (the anchor's, when propagating)
``raw_text``     the model's whole answer (``""`` when propagating)
``notes``        remarks a reader must see (smoke model, reordered boxes, NaN voxels, …)
``shape``        the volume's source grid shape; ``mask_voxels`` the mask's voxel count
``propagation``  the same early-stop record as in ``anchor``
``slices_encoded`` how many slices MedSAM2's image encoder ran on (0 when a kept feature store had
                 every slice the propagation visited)
``metrics``      with a ``reference``: ``{"dice", "iou", "pred_voxels", "gt_voxels"}`` (Dice and IoU
                 rounded to 6 places), else None
``answer_mean_logprob``, ``answer_mean_prob`` the greedy answer's token signal (the anchor's; None when
                 not measured, e.g. propagating a given anchor): how peaked the decoder's choice was,
                 not a probability that the answer is right
``consensus``    the number of samples G (1: no consensus); ``consensus_mask`` ``greedy`` or ``majority``
``confidence``   with G > 1, the samples' mean pairwise agreement in [0, 1] (:mod:`medvolcore.consensus`),
                 else None; ``samples`` each sample in compact form (None without a consensus)
``timings``      seconds per stage (``ground_*``, ``propagate_s``, ``propagate_s_per_slice``,
                 ``slices_encoded``, ``slices_propagated``, ``encoder_calls``, ``total_s`` (the pipeline's),
                 ``write_s`` and ``job_s`` (the whole job: reading, models, writing))
``out``, ``anchor_out``, ``qc``, ``agreement_out``  the files written (None for those not asked for, and
                 ``out`` None for an absent result without ``empty_mask_on_absent``; the agreement map
                 of a consensus is written whenever asked, absent or not); ``outs`` every mask output
                 written (``out`` is the first)

A several-target result has ``mode``, ``volume``, ``preset``, ``smoke``, ``identity``, ``shape``,
``out``/``outs`` as above and: ``queries``; ``targets``, one per query with ``label`` (its value),
the one-target fields ``query`` … ``timings`` (``anchor``, ``reasoning``, ``stats``, ``mask_voxels``,
``terminology``, ``absent``, ``confidence``, …), its files ``anchor_out``, ``qc``, ``agreement_out``
and ``overlap_voxels_lost`` (its voxels that went to an earlier target); ``overlaps`` (``labels``
``[j, k]``, ``queries``, ``voxels``, ``volume_ml``) and ``overlap_rule``; ``absent`` (every target
absent); ``notes`` (the overlaps, generic DICOM codes); ``mask_voxels`` (labelled voxels); ``stats``
(one row per target); ``labels_out`` (the label tables written); ``slices_encoded`` (for all
targets) and ``timings`` (``ground_s`` for all queries, ``shared_prompt``, ``shared_prefill_s``,
``propagate_s``, ``total_s``, ``write_s``, ``job_s``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

from .errors import InputError
from .dicomseg import check_dicom_source, is_dicom_output
from .fileio import MASK_SUFFIXES, PNG_SUFFIXES, check_distinct, check_output, full_suffix, write_text_atomic
from .stats import STATS_SUFFIXES, check_stats_path, stats_text, target_stats
from .models.identity import SMOKE_BANNER  # re-exported here, where it always was

__all__ = ["SegmentRequest", "SegmentOutputs", "SMOKE_BANNER", "check_outputs", "check_queries", "default_anchor_path",
           "labels_path", "numbered", "planned_files", "resolve_overlaps", "run_segment_job", "MAX_TARGETS",
           "OVERLAP_RULE"]


PathLike = Union[str, Path]
MAX_TARGETS = 64  # queries in one job (label values 1..64)
OVERLAP_RULE = ("a voxel that several targets claim goes to the one asked first (query 1 before query 2, …); "
                "each overlap is reported")
Progress = Callable[[str, float, str], None]  # (stage, fraction 0..1, message), as Pipeline's


@dataclass
class SegmentRequest:
    """What to segment and how. Give ``query`` (ground, then propagate) or a given anchor:
    ``anchor`` (an :class:`~medvolcore.anchor.EvidenceAnchor`, its dict, or an ``*.anchor.json``
    path; ``boxes`` or ``world``) or ``key_slice`` + ``boxes`` (inclusive pixel boxes on that
    canonical slice, ``source: "user"``).

    ``hu_window``: the display window (a preset name, ``(centre, width)`` in HU, or None for soft
    tissue). ``stop_after_empty``: early stop's K (None: the pipeline's default; 0: the whole
    volume). ``constrain``/``sample``/``seed``: the grounder's decoding. ``span``: propagate only
    slices ``[k - span, k + span]``; ``largest_component``: keep each box's largest 3-D component.
    ``qc_title``: the QC picture's title (default ``"query: …"``). ``reference``: a ground-truth
    mask on the volume's own grid (a boolean array of its shape) to score the mask against and to draw
    as a contour in the QC picture.
    ``prompts`` (pixel-form correction prompts, :mod:`medvolcore.prompts`) are added after the
    given anchor's own, and ``z_range`` replaces its slice range (``medvol propagate``'s
    ``--add-box``, ``--add-point`` and ``--z-range``); both need a given anchor or key slice.
    ``consensus``: G answers instead of one (1..8; 1 = off; a query only) and ``consensus_mask``
    (``greedy`` or ``majority``), as :meth:`~medvolcore.pipeline.Pipeline.segment` takes them.
    ``queries``: several targets in one job instead of ``query`` (see "Several targets" in the
    module docstring); every other value applies to each of them. ``target_name``: the structure
    the query is about when the data says so (a dataset's label name, ``kidney_left``): it names
    and codes the segment (:func:`medvolcore.terminology.match`); the model still reads the query.
    """

    query: Optional[str] = None
    anchor: object = None
    key_slice: Optional[int] = None
    boxes: Optional[Sequence[Sequence[int]]] = None
    hu_window: object = None
    stop_after_empty: Optional[int] = None
    constrain: bool = True
    sample: bool = False
    seed: Optional[int] = None
    span: Optional[int] = None
    largest_component: bool = False
    qc_title: Optional[str] = None
    reference: object = None
    prompts: Optional[Sequence[dict]] = None
    z_range: Optional[Sequence[int]] = None
    consensus: int = 1
    consensus_mask: str = "greedy"
    queries: Optional[Sequence[str]] = None
    target_name: Optional[str] = None

    @property
    def grounded(self) -> bool:
        return self.anchor is None and self.key_slice is None and not self.boxes

    @property
    def targets(self) -> int:
        """How many targets the job segments (several only with ``queries``)."""
        return len(self.queries) if self.queries else 1


@dataclass
class SegmentOutputs:
    """Where the job writes: the ``mask`` (``.nii.gz``, ``.nii``, ``.nrrd``, ``.mha``, ``.seg.nrrd``, ``.dcm``; one path or several, each
    written from the same mask), optionally the
    ``anchor`` file, the ``qc`` picture (``.png``) and, with a consensus, the ``agreement`` map (a
    mask format). ``names`` are how messages call the first three (the CLI's options by default),
    ``agreement_name`` the fourth. ``create_folders``: make missing parent folders (False for a
    remote client, who must not create folders on the server). ``empty_mask_on_absent``: when the
    grounder answers that the target is not in the volume, still write the mask (all zero, on the
    CT's grid); by default no mask file is written then."""

    mask: Union[PathLike, Sequence[PathLike]]
    anchor: Optional[PathLike] = None
    qc: Optional[PathLike] = None
    overwrite: bool = False
    create_folders: bool = True
    names: Tuple[str, str, str] = ("--out", "--anchor-out", "--qc")
    empty_mask_on_absent: bool = False
    agreement: Optional[PathLike] = None
    agreement_name: str = "--agreement"
    stats: Optional[PathLike] = None  # the target's statistics (.json or .csv; medvolcore.stats)

    @property
    def masks(self) -> List[PathLike]:
        """Every mask output (``mask`` may be one path or several: ``--out`` repeated)."""
        return list(self.mask) if isinstance(self.mask, (list, tuple)) else [self.mask]


def default_anchor_path(mask_path: PathLike) -> str:
    """``kidney.nii.gz`` → ``kidney.anchor.json``: the anchor file written beside a mask."""
    name = str(mask_path)
    suffix = full_suffix(name)
    return (name[: -len(suffix)] if suffix else name) + ".anchor.json"


def numbered(path: PathLike, k: int) -> str:
    """``kidney.anchor.json`` → ``kidney.2.anchor.json``: target ``k``'s own file of a several-target job."""
    name = str(path)
    suffix = full_suffix(name)
    return (name[: -len(suffix)] if suffix else name) + f".{k}" + suffix


def labels_path(mask_path: PathLike) -> str:
    """``organs.nii.gz`` → ``organs.labels.json``: the table of a several-target label map."""
    name = str(mask_path)
    suffix = full_suffix(name)
    return (name[: -len(suffix)] if suffix else name) + ".labels.json"


def _takes_labels_table(path: PathLike) -> bool:
    """A plain label map (not a Slicer segmentation or a DICOM-SEG, which name their segments)."""
    low = str(path).lower()
    return not is_dicom_output(low) and not low.endswith(".seg.nrrd")


def planned_files(outputs: SegmentOutputs, targets: int = 1) -> List[Tuple[str, str, Optional[PathLike]]]:
    """``(kind, name, path)`` of every file a job of ``targets`` targets may write, in writing order:
    the masks (and, for several targets, each plain label map's ``*.labels.json``), then per target
    its agreement map, anchor and QC picture (numbered for several targets: :func:`numbered`), then
    the statistics."""
    m, a, q = outputs.names
    out = []
    for path in outputs.masks:
        out.append(("mask", m, path))
        if targets > 1 and _takes_labels_table(path):
            out.append(("labels", m + " (labels table)", labels_path(path)))
    for kind, name, path in (("agreement", outputs.agreement_name, outputs.agreement), ("anchor", a, outputs.anchor),
                             ("qc", q, outputs.qc)):
        if path:
            out += [(kind, name, path)] if targets == 1 else \
                [(kind, f"{name} (target {k})", numbered(path, k)) for k in range(1, targets + 1)]
    if outputs.stats:
        out.append(("stats", "--stats", outputs.stats))
    return out


def check_outputs(outputs: SegmentOutputs, inputs: Sequence[Tuple[str, Optional[PathLike]]] = (),
                  targets: int = 1) -> None:
    """Refuse, before any work, outputs that clash with each other or with an input, that exist
    (without ``overwrite``), that cannot be written, or whose suffix is not of their kind (every
    file of :func:`planned_files` for ``targets`` targets)."""
    files = planned_files(outputs, targets)
    check_distinct([(name, path) for _, name, path in files], list(inputs))
    create, overwrite = outputs.create_folders, outputs.overwrite
    for kind, name, path in files:
        if kind == "mask" and is_dicom_output(path):  # a DICOM-SEG references the series it segments
            check_dicom_source(inputs[0][1] if inputs else None, name)
            check_output(path, overwrite, suffixes=(".dcm",), what="DICOM segmentation", create_folder=create)
        elif kind in ("mask", "agreement"):
            check_output(path, overwrite, suffixes=MASK_SUFFIXES, what="mask" if kind == "mask" else "agreement map",
                         create_folder=create)
        elif kind == "stats":
            check_stats_path(path)
            check_output(path, overwrite, suffixes=STATS_SUFFIXES, what="statistics", create_folder=create)
        elif kind == "qc":
            check_output(path, overwrite, suffixes=PNG_SUFFIXES, what="QC picture", create_folder=create)
        else:
            check_output(path, overwrite, create_folder=create)


def _check_request(request: SegmentRequest):
    """The request's own values, checked; returns ``(query, window)``."""
    from .propagation import check_stop_after_empty
    from .windowing import get_window

    query = request.query
    if request.queries is not None:
        check_queries(request)
    elif request.grounded:
        from .grounder import validate_query

        if query is None:
            raise InputError("give a query to segment, or an anchor (or a key slice with boxes) to propagate")
        query = validate_query(query)
    elif request.anchor is not None and (request.key_slice is not None or request.boxes):
        raise InputError("give either an anchor or a key slice with boxes, not both")
    elif request.anchor is None and (request.key_slice is None or not request.boxes):
        raise InputError("a key slice needs one or more boxes, and boxes need a key slice")
    if request.grounded and (request.prompts or request.z_range is not None):
        raise InputError("correction prompts and a slice range apply to a given anchor (medvol propagate), "
                         "not to a query")
    if request.consensus != 1 or request.consensus_mask != "greedy":
        from .consensus import check_mask_mode
        from .grounder import check_samples

        check_samples(request.consensus, "consensus (the number of samples)")
        check_mask_mode(request.consensus_mask)
        if not request.grounded:
            raise InputError("a consensus samples the model's answers to a query; a given anchor has none")
        if request.consensus > 1 and request.sample:
            raise InputError("a consensus samples its own answers after the greedy one: do not ask for sampling too")
    if request.target_name is not None:
        if not isinstance(request.target_name, str) or not request.target_name.strip() \
                or len(request.target_name) > 200:
            raise InputError("the target name must be a short text (a structure's name, e.g. kidney_left)")
        if request.queries is not None and len(request.queries) > 1:
            raise InputError("a target name names one target; several queries are each coded by their own words")
    if request.stop_after_empty is not None:
        check_stop_after_empty(request.stop_after_empty)
    if request.span is not None and (isinstance(request.span, bool) or not isinstance(request.span, int)
                                     or request.span < 0):
        raise InputError(f"the slice span must be a whole number ≥ 0, got {request.span!r}")
    return query, get_window(request.hu_window)


def check_queries(request: SegmentRequest) -> None:
    """``queries``: 1..:data:`MAX_TARGETS` distinct valid queries, without ``query``, a given anchor or
    a reference mask; cleaned in place."""
    from .grounder import validate_query

    if request.query is not None:
        raise InputError("give one query or a list of queries, not both")
    if not request.grounded:
        raise InputError("several queries are grounded by the model; a given anchor has one target")
    if isinstance(request.queries, (str, bytes)) or not request.queries:
        raise InputError("queries must be a non-empty list of texts")
    if len(request.queries) > MAX_TARGETS:
        raise InputError(f"at most {MAX_TARGETS} queries in one job, got {len(request.queries)}")
    cleaned, seen = [], {}
    for i, q in enumerate(request.queries, start=1):
        try:
            q = validate_query(q)
        except InputError as e:
            raise InputError(f"query {i}: {e}") from None
        key = " ".join(q.lower().split())
        if key in seen:
            raise InputError(f"query {i} repeats query {seen[key]} ({q!r}): give each target once")
        seen[key] = i
        cleaned.append(q)
    if request.reference is not None and len(cleaned) > 1:
        raise InputError("a reference mask scores one target; score several with `medvol metrics` per label")
    request.queries = cleaned


def _given_anchor(request: SegmentRequest, stack):
    """The anchor to propagate, checked against ``stack`` (world coordinates filled)."""
    from .anchor import EvidenceAnchor

    a = request.anchor
    if a is None:
        stack.check_slice(request.key_slice)
        anchor = EvidenceAnchor(request.key_slice, [list(b) for b in request.boxes], [stack.width, stack.height],
                                source="user")
    elif isinstance(a, EvidenceAnchor):
        anchor = a
    elif isinstance(a, dict):
        anchor = EvidenceAnchor.from_dict(a, stack)
    else:
        anchor = EvidenceAnchor.load(a, stack)
    if request.prompts or request.z_range is not None:
        from dataclasses import replace

        prompts = [{k: v for k, v in p.items() if k != "world"} for p in anchor.prompts] + list(request.prompts or [])
        anchor = replace(anchor, prompts=prompts,
                         z_range=list(request.z_range) if request.z_range is not None else anchor.z_range)
    return anchor.with_world(stack)


def _qc_identity(seg, grounded: bool) -> dict:
    """The QC picture's banner and model line: who drew the anchor (a given anchor was not drawn
    by the model now), with the smoke model's or a zero-shot model's warning."""
    from .models.identity import identity_banner

    if not grounded:
        return {"banner": SMOKE_BANNER if seg.smoke else "",
                "model": "anchor given (no language model ran); mask by MedSAM2"}
    ident = seg.identity
    banner = SMOKE_BANNER if seg.smoke else identity_banner(ident)
    return {"banner": banner, "model": f"model: {ident['label']}" if ident else ""}


def run_segment_job(pipeline, volume, request: SegmentRequest, outputs: SegmentOutputs, *,
                    inputs: Sequence[Tuple[str, Optional[PathLike]]] = (), progress: Optional[Progress] = None,
                    cancel=None, features=None) -> dict:
    """Run one job (see the module docstring for the steps and the result's fields).

    ``pipeline``: a :class:`~medvolcore.pipeline.Pipeline` or a zero-argument callable returning
    one (called once the inputs are read and checked). ``volume``: a path, ``CTVolume`` or
    ``AxialStack``. ``inputs``: ``(name, path)`` pairs no output may be (the volume's path is
    always among them). ``progress(stage, fraction, message)``; ``cancel``: an Event checked
    between slices and before anything is written (:class:`~medvolcore.errors.CancelledError`).
    ``features``: the volume's :class:`~medvolcore.propagation.FeatureStore` for this window and
    MedSAM2, or a callable ``features(pipeline, window)`` returning it or None (the worker keeps one
    per volume).
    """
    from dataclasses import replace

    from .errors import CancelledError
    from .pipeline import as_stack

    t0 = time.perf_counter()
    query, window = _check_request(request)
    if request.queries is not None and len(request.queries) == 1:  # one line of a queries file: one query
        request = replace(request, query=request.queries[0], queries=None)
        query = request.query
    targets = request.targets
    if outputs.agreement and request.consensus < 2:
        raise InputError(f"{outputs.agreement_name} writes the agreement of a consensus: it needs a consensus of 2 "
                         "or more samples")
    # an in-memory volume still names the file it was read from: no output may replace it
    volume_path = volume if isinstance(volume, (str, Path)) else getattr(getattr(volume, "volume", volume), "path", None)
    check_outputs(outputs, [("--volume", volume_path)] + list(inputs), targets)

    stack = as_stack(volume)
    anchor = None if request.grounded else _given_anchor(request, stack)
    pipe = pipeline() if callable(pipeline) else pipeline
    store = features(pipe, window) if callable(features) else features
    if targets > 1:
        segs = pipe.segment_queries(stack, request.queries, constrain=request.constrain, seed=request.seed,
                                    do_sample=request.sample, hu_window=window, progress=progress, cancel=cancel,
                                    stop_after_empty=request.stop_after_empty, features=store,
                                    consensus=request.consensus, consensus_mask=request.consensus_mask)
    elif request.grounded:
        segs = [pipe.segment(stack, query, constrain=request.constrain, seed=request.seed, do_sample=request.sample,
                             hu_window=window, progress=progress, cancel=cancel,
                             stop_after_empty=request.stop_after_empty, features=store, consensus=request.consensus,
                             consensus_mask=request.consensus_mask)]
    else:
        segs = [pipe.repropagate(stack, anchor, hu_window=window, progress=progress, cancel=cancel,
                                 stop_after_empty=request.stop_after_empty, span=request.span,
                                 largest_component=request.largest_component, features=store)]
    if cancel is not None and cancel.is_set():
        raise CancelledError("the job was cancelled")
    queries = request.queries if targets > 1 else [query]
    for seg, q in zip(segs, queries):
        if request.grounded:
            seg.anchor.query = q
            seg.anchor.reasoning = seg.reasoning
            seg.anchor.source = "grounder"
    if progress is not None:
        progress("write", 0.0, "writing the mask" if targets == 1 else f"writing the {targets} targets")
    t_write = time.perf_counter()
    if targets > 1:
        res = _write_targets(segs, stack, volume_path, request, outputs, window)
    else:
        res = _write_target(segs[0], stack, volume_path, request, outputs, window, query)
    res["timings"]["write_s"] = round(time.perf_counter() - t_write, 4)
    res["timings"]["job_s"] = round(time.perf_counter() - t0, 4)
    if progress is not None:
        progress("write", 1.0, "done")
    return res


def _algorithm(seg) -> str:
    """The DICOM-SEG's algorithm name: the model that made the anchor, or a given anchor's propagation."""
    return "MedVol " + ((seg.identity or {}).get("label") or "propagation of a given anchor")


def _write_masks(labels, stack, volume_path, outputs: SegmentOutputs, segments: List[dict], algorithm: str,
                 notes: list) -> List[str]:
    """``labels`` written to every mask output (by suffix: label map, ``.seg.nrrd`` or DICOM-SEG)."""
    from . import __version__
    from .volume import save_mask

    written = []
    for path in outputs.masks:
        if is_dicom_output(path):
            from .dicomseg import save_dicom_seg

            save_dicom_seg(labels, stack.volume.affine, volume_path or stack.volume.path, path, segments,
                           algorithm=algorithm, version=__version__, overwrite=outputs.overwrite, notes=notes)
        else:
            save_mask(labels, stack.volume, path, overwrite=outputs.overwrite, segments=segments)
        written.append(str(path))
    return written


def _target_fields(seg, query: str, term, stats: dict) -> dict:
    """The fields of one target's result, the same in a one-target result and in each ``targets`` entry."""
    return {
        "query": seg.anchor.query or (query or ""), "absent": bool(seg.absent),
        "terminology": term.to_dict() if term is not None else None,
        "stats": stats,
        "anchor": seg.anchor.to_dict(), "reasoning": seg.reasoning, "raw_text": seg.raw_text,
        "notes": list(seg.notes), "mask_voxels": int(stats["voxels"]),
        "propagation": seg.anchor.propagation,
        "slices_encoded": int(seg.timings.get("slices_encoded", 0)),
        "answer_mean_logprob": (seg.anchor.signal or {}).get("answer_mean_logprob"),
        "answer_mean_prob": (seg.anchor.signal or {}).get("answer_mean_prob"),
        "consensus": seg.consensus, "consensus_mask": seg.consensus_mask,
        "confidence": None if seg.confidence is None else round(seg.confidence, 4), "samples": seg.samples,
        "timings": {k: round(v, 4) if isinstance(v, float) else v for k, v in seg.timings.items()},
    }


def _target_stats(seg, mask, stack, name: str) -> dict:
    world = (seg.anchor.world or {}) if not seg.absent else {}
    return target_stats(mask, stack.volume.array, stack.volume.affine, name,
                        None if seg.absent else int(seg.anchor.slice),
                        (world.get("slice_center_ras") or [None, None, None])[2])


def _save_qc(path, stack, seg, mask_stack, request: SegmentRequest, window, title: str, overwrite: bool) -> None:
    from .qc import save_qc

    save_qc(path, stack, seg.anchor, mask_stack, overwrite=overwrite, title=title, reasoning=seg.reasoning,
            window=window, gt_mask=request.reference, **_qc_identity(seg, request.grounded))


def _write_target(seg, stack, volume_path, request: SegmentRequest, outputs: SegmentOutputs, window, query) -> dict:
    """Write a one-target job's files (see the module docstring's step 5) → its result."""
    from .terminology import match
    from .volume import save_mask

    wrote_mask = not seg.absent or outputs.empty_mask_on_absent
    named = seg.anchor.query or query or ""
    # the segment's coded name and colour (terminology.py)
    term = match(named, target=request.target_name) if named or request.target_name else None
    segments = [{"name": named or "Segment_1", "value": 1, "term": term}]
    outs = _write_masks(seg.mask, stack, volume_path, outputs, segments, _algorithm(seg), seg.notes) if wrote_mask else []
    if outputs.agreement:
        save_mask(seg.agreement, stack.volume, outputs.agreement, overwrite=outputs.overwrite)
    stats = _target_stats(seg, seg.mask, stack, named)
    if outputs.stats:
        write_text_atomic(outputs.stats, stats_text([stats], outputs.stats), overwrite=outputs.overwrite)
    if outputs.anchor:
        seg.anchor.save(outputs.anchor, outputs.overwrite)
    if outputs.qc:
        title = request.qc_title if request.qc_title is not None else f"query: {seg.anchor.query or query or ''}"
        _save_qc(outputs.qc, stack, seg, seg.mask_stack, request, window, title, outputs.overwrite)
    metrics = None
    if request.reference is not None:
        from .metrics import overlap

        m = overlap(seg.mask, request.reference)
        metrics = {"dice": round(m["dice"], 6), "iou": round(m["iou"], 6), "pred_voxels": m["pred_voxels"],
                   "gt_voxels": m["gt_voxels"]}
    fields = _target_fields(seg, query, term, stats)
    fields["notes"] = list(dict.fromkeys(seg.notes))
    return {
        "mode": "segment" if request.grounded else "propagate",
        "volume": str(stack.volume.path or volume_path) if (stack.volume.path or volume_path) else None,
        "preset": seg.preset, "smoke": bool(seg.smoke), "identity": seg.identity,
        **fields,
        "stats_out": str(outputs.stats) if outputs.stats else None,
        "shape": [int(x) for x in stack.volume.shape], "metrics": metrics,
        "out": outs[0] if outs else None, "outs": outs,
        "anchor_out": str(outputs.anchor) if outputs.anchor else None,
        "qc": str(outputs.qc) if outputs.qc else None,
        "agreement_out": str(outputs.agreement) if outputs.agreement else None,
    }


def resolve_overlaps(masks: Sequence, shape) -> Tuple[object, List[dict]]:
    """One label map from several boolean masks (label k for mask k, 1-based) by :data:`OVERLAP_RULE`
    → ``(labels, overlaps)``; ``overlaps``: ``{"labels": [j, k], "voxels": n}`` for each pair that
    claims common voxels (``j``, asked first, keeps them)."""
    import numpy as np

    labels = np.zeros(shape, np.uint8)
    overlaps = []
    for k, mask in enumerate(masks, start=1):
        m = np.asarray(mask).astype(bool)
        taken = labels[m]
        for j, n in zip(*np.unique(taken[taken > 0], return_counts=True)):
            overlaps.append({"labels": [int(j), k], "voxels": int(n)})
        labels[m & (labels == 0)] = k
    return labels, overlaps


def _write_targets(segs, stack, volume_path, request: SegmentRequest, outputs: SegmentOutputs, window) -> dict:
    """Write a several-target job's files → its result (see "Several targets" in the module docstring)."""
    from . import RESEARCH_USE_NOTICE
    from .terminology import match
    from .volume import save_mask

    queries = list(request.queries)
    n = len(queries)
    labels, overlaps = resolve_overlaps([s.mask for s in segs], stack.volume.shape)
    labels_stack, _ = resolve_overlaps([s.mask_stack for s in segs], stack.data.shape)
    import numpy as np

    voxel_ml = abs(float(np.linalg.det(np.asarray(stack.volume.affine, dtype=np.float64)[:3, :3]))) / 1000.0
    notes = []
    for o in overlaps:
        j, k = o["labels"]
        o.update(queries=[queries[j - 1], queries[k - 1]], volume_ml=round(o["voxels"] * voxel_ml, 3))
        notes.append(f"targets {j} ({_short(queries[j - 1])}) and {k} ({_short(queries[k - 1])}) overlap in "
                     f"{o['voxels']} voxels ({o['volume_ml']:g} mL): target {j}, asked first, keeps them")
    terms = [match(q, k) for k, q in enumerate(queries, start=1)]
    segments = [{"name": q, "value": k, "term": t} for k, (q, t) in enumerate(zip(queries, terms), start=1)]
    wrote_mask = any(not s.absent for s in segs) or outputs.empty_mask_on_absent
    outs = _write_masks(labels, stack, volume_path, outputs, segments, _algorithm(segs[0]), notes) if wrote_mask else []
    targets, rows = [], []
    for k, (seg, q, term) in enumerate(zip(segs, queries, terms), start=1):
        mask = labels == k
        stats = _target_stats(seg, mask, stack, q)
        rows.append(stats)
        files = {}
        if outputs.agreement:
            files["agreement_out"] = numbered(outputs.agreement, k)
            save_mask(seg.agreement, stack.volume, files["agreement_out"], overwrite=outputs.overwrite)
        if outputs.anchor:
            files["anchor_out"] = numbered(outputs.anchor, k)
            seg.anchor.save(files["anchor_out"], outputs.overwrite)
        if outputs.qc:
            files["qc"] = numbered(outputs.qc, k)
            title = (f"{request.qc_title} · " if request.qc_title else "") + f"target {k}/{n} · query: {q}"
            _save_qc(files["qc"], stack, seg, (labels_stack == k).astype("uint8"), request, window, title,
                     outputs.overwrite)
        lost = sum(o["voxels"] for o in overlaps if o["labels"][1] == k)
        targets.append({"label": k, **_target_fields(seg, q, term, stats), "overlap_voxels_lost": lost,
                        "anchor_out": files.get("anchor_out"), "qc": files.get("qc"),
                        "agreement_out": files.get("agreement_out")})
    tables = []
    if outs:
        for path in outs:
            if not _takes_labels_table(path):
                continue
            table = {"schema": "medvol.labels/1", "notice": RESEARCH_USE_NOTICE, "mask": Path(path).name,
                     "volume": Path(str(stack.volume.path or volume_path or "")).name,  # a name, not where it lies
                     "model": (segs[0].identity or {}).get("label"), "overlap_rule": OVERLAP_RULE,
                     "labels": [{"value": t["label"], "query": t["query"], "name": (t["terminology"] or {}).get("label"),
                                 "absent": t["absent"], "voxels": t["mask_voxels"],
                                 "volume_ml": t["stats"]["volume_ml"],
                                 "color": (t["terminology"] or {}).get("color"), "terminology": t["terminology"],
                                 "anchor": Path(t["anchor_out"]).name if t["anchor_out"] else None,
                                 "qc": Path(t["qc"]).name if t["qc"] else None} for t in targets],
                     "overlaps": overlaps}
            tables.append(write_text_atomic(labels_path(path), json.dumps(table, indent=1) + "\n",
                                            overwrite=outputs.overwrite))
    if outputs.stats:
        write_text_atomic(outputs.stats, stats_text(rows, outputs.stats), overwrite=outputs.overwrite)
    first = segs[0]
    timings = {"ground_s": round(first.timings.get("ground_all_s", 0.0), 4),
               "propagate_s": round(sum(s.timings.get("propagate_s", 0.0) for s in segs), 4),
               "total_s": round(first.timings.get("all_s", 0.0), 4),
               "slices_encoded": sum(int(s.timings.get("slices_encoded", 0)) for s in segs),
               "shared_prompt": bool(first.timings.get("ground_shared_prompt", False)),
               "shared_prefill_s": round(first.timings.get("ground_shared_prefill_s", 0.0), 4)}
    return {
        "mode": "segment", "volume": str(stack.volume.path or volume_path) if (stack.volume.path or volume_path) else None,
        "queries": queries, "preset": first.preset, "smoke": bool(any(s.smoke for s in segs)),
        "identity": first.identity, "absent": all(s.absent for s in segs),
        "targets": targets, "overlaps": overlaps, "overlap_rule": OVERLAP_RULE,
        "notes": list(dict.fromkeys(notes)), "shape": [int(x) for x in stack.volume.shape],
        "mask_voxels": int((labels > 0).sum()), "stats": rows, "stats_out": str(outputs.stats) if outputs.stats else None,
        "slices_encoded": timings["slices_encoded"], "timings": timings,
        "out": outs[0] if outs else None, "outs": outs, "labels_out": [str(t) for t in tables],
    }


def _short(query: str, limit: int = 60) -> str:
    q = " ".join(str(query).split())
    return repr(q if len(q) <= limit else q[: limit - 1] + "…")
