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
                 of a consensus is written whenever asked, absent or not)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple, Union

from .errors import InputError
from .dicomseg import check_dicom_source, is_dicom_output
from .fileio import MASK_SUFFIXES, PNG_SUFFIXES, check_distinct, check_output, full_suffix, write_text_atomic
from .stats import STATS_SUFFIXES, check_stats_path, stats_text, target_stats
from .models.identity import SMOKE_BANNER  # re-exported here, where it always was

__all__ = ["SegmentRequest", "SegmentOutputs", "SMOKE_BANNER", "check_outputs", "default_anchor_path",
           "run_segment_job"]


PathLike = Union[str, Path]
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

    @property
    def grounded(self) -> bool:
        return self.anchor is None and self.key_slice is None and not self.boxes


@dataclass
class SegmentOutputs:
    """Where the job writes: the ``mask`` (``.nii.gz``, ``.nii``, ``.nrrd``, ``.mha``), optionally the
    ``anchor`` file, the ``qc`` picture (``.png``) and, with a consensus, the ``agreement`` map (a
    mask format). ``names`` are how messages call the first three (the CLI's options by default),
    ``agreement_name`` the fourth. ``create_folders``: make missing parent folders (False for a
    remote client, who must not create folders on the server). ``empty_mask_on_absent``: when the
    grounder answers that the target is not in the volume, still write the mask (all zero, on the
    CT's grid); by default no mask file is written then."""

    mask: PathLike
    anchor: Optional[PathLike] = None
    qc: Optional[PathLike] = None
    overwrite: bool = False
    create_folders: bool = True
    names: Tuple[str, str, str] = ("--out", "--anchor-out", "--qc")
    empty_mask_on_absent: bool = False
    agreement: Optional[PathLike] = None
    agreement_name: str = "--agreement"
    stats: Optional[PathLike] = None  # the target's statistics (.json or .csv; medvolcore.stats)


def default_anchor_path(mask_path: PathLike) -> str:
    """``kidney.nii.gz`` → ``kidney.anchor.json``: the anchor file written beside a mask."""
    name = str(mask_path)
    suffix = full_suffix(name)
    return (name[: -len(suffix)] if suffix else name) + ".anchor.json"


def check_outputs(outputs: SegmentOutputs, inputs: Sequence[Tuple[str, Optional[PathLike]]] = ()) -> None:
    """Refuse, before any work, outputs that clash with each other or with an input, that exist
    (without ``overwrite``), that cannot be written, or whose suffix is not of their kind."""
    m, a, q = outputs.names
    check_distinct([(m, outputs.mask), (a, outputs.anchor), (q, outputs.qc), (outputs.agreement_name, outputs.agreement),
                    ("--stats", outputs.stats)], list(inputs))
    create = outputs.create_folders
    if is_dicom_output(outputs.mask):  # a DICOM-SEG references the series it segments
        check_dicom_source(inputs[0][1] if inputs else None, m)
        check_output(outputs.mask, outputs.overwrite, suffixes=(".dcm",), what="DICOM segmentation",
                     create_folder=create)
    else:
        check_output(outputs.mask, outputs.overwrite, suffixes=MASK_SUFFIXES, what="mask", create_folder=create)
    if outputs.agreement:
        check_output(outputs.agreement, outputs.overwrite, suffixes=MASK_SUFFIXES, what="agreement map",
                     create_folder=create)
    if outputs.anchor:
        check_output(outputs.anchor, outputs.overwrite, create_folder=create)
    if outputs.stats:
        check_stats_path(outputs.stats)
        check_output(outputs.stats, outputs.overwrite, suffixes=STATS_SUFFIXES, what="statistics",
                     create_folder=create)
    if outputs.qc:
        check_output(outputs.qc, outputs.overwrite, suffixes=PNG_SUFFIXES, what="QC picture", create_folder=create)


def _check_request(request: SegmentRequest):
    """The request's own values, checked; returns ``(query, window)``."""
    from .propagation import check_stop_after_empty
    from .windowing import get_window

    query = request.query
    if request.grounded:
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
    if request.stop_after_empty is not None:
        check_stop_after_empty(request.stop_after_empty)
    if request.span is not None and (isinstance(request.span, bool) or not isinstance(request.span, int)
                                     or request.span < 0):
        raise InputError(f"the slice span must be a whole number ≥ 0, got {request.span!r}")
    return query, get_window(request.hu_window)


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
    from .errors import CancelledError
    from .pipeline import as_stack
    from .terminology import match
    from .volume import save_mask

    t0 = time.perf_counter()
    query, window = _check_request(request)
    if outputs.agreement and request.consensus < 2:
        raise InputError(f"{outputs.agreement_name} writes the agreement of a consensus: it needs a consensus of 2 "
                         "or more samples")
    # an in-memory volume still names the file it was read from: no output may replace it
    volume_path = volume if isinstance(volume, (str, Path)) else getattr(getattr(volume, "volume", volume), "path", None)
    check_outputs(outputs, [("--volume", volume_path)] + list(inputs))

    stack = as_stack(volume)
    anchor = None if request.grounded else _given_anchor(request, stack)
    pipe = pipeline() if callable(pipeline) else pipeline
    store = features(pipe, window) if callable(features) else features
    if request.grounded:
        seg = pipe.segment(stack, query, constrain=request.constrain, seed=request.seed, do_sample=request.sample,
                           hu_window=window, progress=progress, cancel=cancel,
                           stop_after_empty=request.stop_after_empty, features=store, consensus=request.consensus,
                           consensus_mask=request.consensus_mask)
    else:
        seg = pipe.repropagate(stack, anchor, hu_window=window, progress=progress, cancel=cancel,
                               stop_after_empty=request.stop_after_empty, span=request.span,
                               largest_component=request.largest_component, features=store)
    if cancel is not None and cancel.is_set():
        raise CancelledError("the job was cancelled")
    if request.grounded:
        seg.anchor.query = query
        seg.anchor.reasoning = seg.reasoning
        seg.anchor.source = "grounder"
    if progress is not None:
        progress("write", 0.0, "writing the mask")
    t_write = time.perf_counter()
    wrote_mask = not seg.absent or outputs.empty_mask_on_absent
    named = seg.anchor.query or query or ""
    term = match(named) if named else None  # the segment's coded name and colour (terminology.py)
    segments = [{"name": named or "Segment_1", "value": 1, "term": term}]
    if wrote_mask and is_dicom_output(outputs.mask):
        from . import __version__
        from .dicomseg import save_dicom_seg

        save_dicom_seg(seg.mask, stack.volume.affine, volume_path or stack.volume.path, outputs.mask, segments,
                       algorithm="MedVol " + ((seg.identity or {}).get("label") or "propagation of a given anchor"),
                       version=__version__, overwrite=outputs.overwrite, notes=seg.notes)
    elif wrote_mask:
        save_mask(seg.mask, stack.volume, outputs.mask, overwrite=outputs.overwrite, segments=segments)
    if outputs.agreement:
        save_mask(seg.agreement, stack.volume, outputs.agreement, overwrite=outputs.overwrite)
    world = (seg.anchor.world or {}) if not seg.absent else {}
    stats = target_stats(seg.mask, stack.volume.array, stack.volume.affine, named,
                         None if seg.absent else int(seg.anchor.slice),
                         (world.get("slice_center_ras") or [None, None, None])[2])
    if outputs.stats:
        write_text_atomic(outputs.stats, stats_text([stats], outputs.stats), overwrite=outputs.overwrite)
    if outputs.anchor:
        seg.anchor.save(outputs.anchor, outputs.overwrite)
    if outputs.qc:
        from .qc import save_qc

        title = request.qc_title if request.qc_title is not None else f"query: {seg.anchor.query or query or ''}"
        save_qc(outputs.qc, stack, seg.anchor, seg.mask_stack, overwrite=outputs.overwrite, title=title,
                reasoning=seg.reasoning, window=window, gt_mask=request.reference, **_qc_identity(seg, request.grounded))
    metrics = None
    if request.reference is not None:
        from .metrics import overlap

        m = overlap(seg.mask, request.reference)
        metrics = {"dice": round(m["dice"], 6), "iou": round(m["iou"], 6), "pred_voxels": m["pred_voxels"],
                   "gt_voxels": m["gt_voxels"]}
    timings = {k: round(v, 4) if isinstance(v, float) else v for k, v in seg.timings.items()}
    timings["write_s"] = round(time.perf_counter() - t_write, 4)
    timings["job_s"] = round(time.perf_counter() - t0, 4)
    if progress is not None:
        progress("write", 1.0, "done")
    return {
        "mode": "segment" if request.grounded else "propagate",
        "volume": str(stack.volume.path or volume_path) if (stack.volume.path or volume_path) else None,
        "query": seg.anchor.query or (query or ""), "preset": seg.preset, "smoke": bool(seg.smoke),
        "absent": bool(seg.absent),
        "identity": seg.identity,
        "terminology": term.to_dict() if term is not None else None,
        "stats": stats, "stats_out": str(outputs.stats) if outputs.stats else None,
        "anchor": seg.anchor.to_dict(), "reasoning": seg.reasoning, "raw_text": seg.raw_text,
        "notes": list(seg.notes), "shape": [int(s) for s in stack.volume.shape], "mask_voxels": int(seg.mask.sum()),
        "propagation": seg.anchor.propagation, "metrics": metrics, "timings": timings,
        "slices_encoded": int(seg.timings.get("slices_encoded", 0)),
        "answer_mean_logprob": (seg.anchor.signal or {}).get("answer_mean_logprob"),
        "answer_mean_prob": (seg.anchor.signal or {}).get("answer_mean_prob"),
        "consensus": seg.consensus, "consensus_mask": seg.consensus_mask,
        "confidence": None if seg.confidence is None else round(seg.confidence, 4), "samples": seg.samples,
        "out": str(outputs.mask) if wrote_mask else None, "anchor_out": str(outputs.anchor) if outputs.anchor else None,
        "qc": str(outputs.qc) if outputs.qc else None,
        "agreement_out": str(outputs.agreement) if outputs.agreement else None,
    }
