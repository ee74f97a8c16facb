"""One segment job, written once: check the request and the outputs, run the pipeline, write the outputs, return one result.

Every front door runs its volumes through :func:`run_segment_job`: ``medvol segment`` and
``medvol demo``, ``medvol propagate``, each case of ``medvol batch`` and the worker's ``segment``
and ``propagate`` requests. The request (:class:`~medvolcore.request.SegmentRequest`) and the
result (:class:`~medvolcore.result.SegmentResult`) are declared once, each field with its names at
every door; the doors build the one and show the other from that declaration.

The steps, in this order, so that nothing is loaded or written for a job that cannot finish:

1. the request (:meth:`~medvolcore.request.SegmentRequest.check`: every rule, named as the door
   that built it names its fields) and every output
   (:func:`check_outputs`: distinct files, none of them an input, each writable, with a suffix
   of its kind, absent unless ``overwrite``) — before the volume is read;
2. the volume (a path, a :class:`~medvolcore.volume.CTVolume` or an
   :class:`~medvolcore.stack.AxialStack`), then the given anchor against it, if any;
3. the pipeline (a :class:`~medvolcore.pipeline.Pipeline`, or a zero-argument callable returning
   one, so a front door can load models only once the inputs are known good);
4. ground + propagate (``query``) or propagate the given anchor (``anchor``, or ``key_slice`` +
   ``boxes``: the language model is not used);
5. the mask (uint8, on the volume's own grid), then the anchor file, then the QC picture (and
   every other output: labels tables, agreement maps, statistics), as one set
   (:func:`~medvolcore.fileio.output_set`): each is written and checked under a temporary name, and
   they are renamed into place only once all are written, so a failure at any of them leaves the
   previous outputs as they were and no new file. The one exception is a DICOM-SEG (checked when
   the series is read, so a failure there is a surprise): it is left out with a note and the other
   outputs are written, unless it was the only mask output. When the grounder answered that the target is
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

The result is a :class:`~medvolcore.result.SegmentResult`: each of its fields is described there,
with the doors that show it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

from .dicomseg import check_dicom_source, is_dicom_output, referenceable_outputs
from .fileio import (MASK_SUFFIXES, PNG_SUFFIXES, check_distinct, check_output, full_suffix, output_set,
                     write_text_atomic)
from .stats import STATS_SUFFIXES, check_stats_path, stats_text, target_stats
from .models.identity import SMOKE_BANNER  # re-exported here, where it always was
from .request import MAX_TARGETS, SegmentRequest  # declared in medvolcore.request; imported from here too
from .errors import InputError
from .result import SegmentResult

__all__ = ["SegmentRequest", "SegmentResult", "SegmentOutputs", "SMOKE_BANNER", "check_outputs", "default_anchor_path",
           "labels_path", "numbered", "planned_files", "resolve_overlaps", "run_segment_job", "MAX_TARGETS",
           "OVERLAP_RULE"]


PathLike = Union[str, Path]
OVERLAP_RULE = ("a voxel that several targets claim goes to the one asked first (query 1 before query 2, …); "
                "each overlap is reported")
Progress = Callable[[str, float, str], None]  # (stage, fraction 0..1, message), as Pipeline's


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
                  targets: int = 1, dicom=None) -> None:
    """Refuse, before any work, outputs that clash with each other or with an input, that exist
    (without ``overwrite``), that cannot be written, or whose suffix is not of their kind (every
    file of :func:`planned_files` for ``targets`` targets). ``dicom``: the volume's DICOM record
    when it is read already (see :func:`~medvolcore.dicomseg.check_dicom_source`)."""
    files = planned_files(outputs, targets)
    _check_labels_tables(files)
    check_distinct([(name, path) for _, name, path in files], list(inputs))
    create, overwrite = outputs.create_folders, outputs.overwrite
    for kind, name, path in files:
        if kind == "mask" and is_dicom_output(path):  # a DICOM-SEG references the series it segments
            check_dicom_source(inputs[0][1] if inputs else None, name, dicom)
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


def _check_labels_tables(files) -> None:
    """Refuse two label maps whose labels tables would be one file (``organs.nii.gz`` and
    ``organs.nrrd`` both → ``organs.labels.json``), naming both masks and the shared table."""
    import os

    seen, mask = {}, None
    for kind, name, path in files:
        if kind == "mask":
            mask = (name, path)
        elif kind == "labels":
            key = os.path.normcase(os.path.realpath(os.path.expanduser(str(path))))
            if key in seen:
                (n1, m1), (n2, m2) = seen[key], mask
                raise InputError(f"{n1} {m1} and {n2} {m2} would share one labels table, {path}: with several "
                                 "queries each label map gets a table named after it, so give label maps different "
                                 "names before the suffix (organs.nii.gz and organs_copy.nrrd)")
            seen[key] = mask


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

        from .maskprompt import mask_prompt, read_mask_file

        given = [mask_prompt(p["slice"], p["object"], read_mask_file(p["mask_file"], stack, p["slice"]))
                 if isinstance(p, dict) and "mask_file" in p else p for p in request.prompts or []]
        prompts = [{k: v for k, v in p.items() if k != "world"} for p in anchor.prompts] + given
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
                    cancel=None, features=None) -> SegmentResult:
    """Run one job (see the module docstring for the steps; the result: :class:`~medvolcore.result.SegmentResult`).

    ``request``: checked here whoever built it (a copy: the caller's is left as it was), its
    errors naming the fields as its door does. ``pipeline``: a :class:`~medvolcore.pipeline.Pipeline`
    or a zero-argument callable returning one (called once the inputs are read and checked).
    ``volume``: a path, ``CTVolume`` or ``AxialStack``. ``inputs``: ``(name, path)`` pairs no output
    may be (the volume's path is always among them). ``progress(stage, fraction, message)``;
    ``cancel``: an Event checked between slices and before anything is written
    (:class:`~medvolcore.errors.CancelledError`). ``features``: the volume's
    :class:`~medvolcore.propagation.FeatureStore` for this window and MedSAM2, or a callable
    ``features(pipeline, window)`` returning it or None (the worker keeps one per volume).
    """
    from dataclasses import replace

    from .errors import CancelledError
    from .pipeline import as_stack
    from .windowing import get_window

    t0 = time.perf_counter()
    request = replace(request).check(agreement=outputs.agreement_name if outputs.agreement else None)
    query, window, targets = request.query, get_window(request.hu_window), request.targets
    # an in-memory volume still names the file it was read from: no output may replace it
    volume_path = volume if isinstance(volume, (str, Path)) else getattr(getattr(volume, "volume", volume), "path", None)
    check_outputs(outputs, [("--volume", volume_path)] + list(inputs), targets,
                  getattr(getattr(volume, "volume", volume), "dicom", None))

    stack = as_stack(volume)
    warnings = _plausibility(stack, request)
    outputs, refused = referenceable_outputs(outputs, stack.volume)  # before any model loads
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
    with output_set():  # every file to a temporary; all renamed into place once all are written
        if targets > 1:
            res = _write_targets(segs, stack, volume_path, request, outputs, window, warnings)
        else:
            res = _write_target(segs[0], stack, volume_path, request, outputs, window, query, warnings)
    if refused:
        res.notes = list(res.notes or []) + refused
    res.timings["write_s"] = round(time.perf_counter() - t_write, 4)
    res.timings["job_s"] = round(time.perf_counter() - t0, 4)
    if progress is not None:
        progress("write", 1.0, "done")
    return res


def _plausibility(stack, request: SegmentRequest) -> List[str]:
    """The volume's CT plausibility warnings (:func:`medvolcore.volume.ct_plausibility`; an all-air
    volume is refused), or an error with ``strict_ct`` — before any model loads."""
    from .errors import VolumeError
    from .volume import ct_plausibility

    warnings = ct_plausibility(stack.volume.array, stack.volume.name)
    if warnings and request.strict_ct:
        refused = warnings[0].replace("; the result is unreliable", "")
        raise VolumeError(f"{refused} (refused: {request.name('strict_ct')})")
    return [w + f" ({request.name('strict_ct')} refuses such a volume)" for w in warnings]


ALGORITHM_NAME_CHARS = 64  # a DICOM LO value


def _algorithm(seg) -> str:
    """The DICOM-SEG's algorithm name (a DICOM LO: 64 characters): the model that made the anchor,
    or a given anchor's propagation; a longer label is cut at the end of a phrase (before ``:``,
    ``;``, ``,`` or ``(``), never in the middle of one."""
    name = "MedVol " + ((seg.identity or {}).get("label") or "propagation of a given anchor")
    if len(name) <= ALGORITHM_NAME_CHARS:
        return name
    head = name[:ALGORITHM_NAME_CHARS]
    cuts = [head.rfind(sep) for sep in (":", ";", ",", " (")]
    cut = max(cuts)
    if cut > len("MedVol "):
        return head[:cut].rstrip()
    return head[:ALGORITHM_NAME_CHARS - 1].rsplit(" ", 1)[0] + "…"


def _write_masks(labels, stack, volume_path, outputs: SegmentOutputs, segments: List[dict], algorithm: str,
                 notes: list, seg_type: str = "binary") -> List[str]:
    """``labels`` written to every mask output (by suffix: label map, ``.seg.nrrd`` or DICOM-SEG of
    ``seg_type``). A DICOM-SEG that fails to be written (checked up front, so this is a surprise)
    is left out with a note in ``notes``: the other outputs are written all the same."""
    from . import __version__
    from .volume import save_mask

    from .errors import CancelledError, DependencyError, OutputError, VolumeError

    written = []
    for path in outputs.masks:
        if is_dicom_output(path):
            from .dicomseg import save_dicom_seg

            try:
                save_dicom_seg(labels, stack.volume.affine, stack.volume, path, segments, algorithm=algorithm,
                               version=__version__, overwrite=outputs.overwrite, notes=notes, seg_type=seg_type)
            except (CancelledError, DependencyError, OutputError, OSError):
                raise  # a full disk or a cancel fails the whole set: the previous outputs stay as they were
            except Exception as exc:  # noqa: BLE001 - the DICOM-SEG alone is lost, never the other outputs
                reason = " ".join(str(exc).split())[:300] or type(exc).__name__
                if len(outputs.masks) == 1 or Path(path).exists():
                    # the one mask asked for, or a previous SEG that would no longer match the new outputs
                    raise VolumeError(f"{outputs.names[0]} {path} could not be written: {reason}") from None
                notes.append(f"{outputs.names[0]} {path} was not written: {reason}; the other outputs were")
                continue
        else:
            save_mask(labels, stack.volume, path, overwrite=outputs.overwrite, segments=segments)
        written.append(str(path))
    return written


def _target_fields(seg, query: str, term, stats: dict) -> dict:
    """The fields of one target's result, the same in a one-target result and in each ``targets`` entry."""
    return dict(
        query=seg.anchor.query or (query or ""), absent=bool(seg.absent),
        terminology=term.to_dict() if term is not None else None, stats=stats,
        anchor=seg.anchor.to_dict(), reasoning=seg.reasoning, raw_text=seg.raw_text,
        notes=list(seg.notes), mask_voxels=int(stats["voxels"]), propagation=seg.anchor.propagation,
        slices_encoded=int(seg.timings.get("slices_encoded", 0)),
        answer_mean_logprob=(seg.anchor.signal or {}).get("answer_mean_logprob"),
        answer_mean_prob=(seg.anchor.signal or {}).get("answer_mean_prob"),
        consensus=seg.consensus, consensus_mask=seg.consensus_mask,
        confidence=None if seg.confidence is None else round(seg.confidence, 4), samples=seg.samples,
        timings={k: round(v, 4) if isinstance(v, float) else v for k, v in seg.timings.items()})


def _target_stats(seg, mask, stack, name: str) -> dict:
    world = (seg.anchor.world or {}) if not seg.absent else {}
    return target_stats(mask, stack.volume.array, stack.volume.affine, name,
                        None if seg.absent else int(seg.anchor.slice),
                        (world.get("slice_center_ras") or [None, None, None])[2])


def _save_qc(path, stack, seg, mask_stack, request: SegmentRequest, window, title: str, overwrite: bool,
             warnings: Sequence[str] = (), empty_note: str = "") -> None:
    from .qc import save_qc

    save_qc(path, stack, seg.anchor, mask_stack, overwrite=overwrite, title=title, reasoning=seg.reasoning,
            window=window, gt_mask=request.reference, warnings=list(warnings),
            empty_note=empty_note, **_qc_identity(seg, request.grounded))


def _volume_name(stack, volume_path) -> Optional[str]:
    path = stack.volume.path or volume_path
    return str(path) if path else None


def _write_target(seg, stack, volume_path, request: SegmentRequest, outputs: SegmentOutputs, window,
                  query, warnings: Sequence[str] = ()) -> SegmentResult:
    """Write a one-target job's files (see the module docstring's step 5) → its result."""
    from .terminology import match
    from .volume import save_mask

    wrote_mask = not seg.absent or outputs.empty_mask_on_absent
    named = seg.anchor.query or query or ""
    # the segment's coded name and colour (terminology.py)
    term = match(named, target=request.target_name) if named or request.target_name else None
    segments = [{"name": named or "Segment_1", "value": 1, "term": term}]
    outs = _write_masks(seg.mask, stack, volume_path, outputs, segments, _algorithm(seg), seg.notes,
                        request.seg_type) if wrote_mask else []
    if outputs.agreement:
        save_mask(seg.agreement, stack.volume, outputs.agreement, overwrite=outputs.overwrite)
    stats = _target_stats(seg, seg.mask, stack, named)
    if outputs.stats:
        write_text_atomic(outputs.stats, stats_text([stats], outputs.stats), overwrite=outputs.overwrite)
    if outputs.anchor:
        seg.anchor.save(outputs.anchor, outputs.overwrite)
    if outputs.qc:
        title = request.qc_title if request.qc_title is not None else f"query: {seg.anchor.query or query or ''}"
        _save_qc(outputs.qc, stack, seg, seg.mask_stack, request, window, title, outputs.overwrite, warnings)
    metrics = None
    if request.reference is not None:
        from .metrics import overlap

        m = overlap(seg.mask, request.reference)
        metrics = {"dice": round(m["dice"], 6), "iou": round(m["iou"], 6), "pred_voxels": m["pred_voxels"],
                   "gt_voxels": m["gt_voxels"]}
    fields = _target_fields(seg, query, term, stats)
    fields["notes"] = list(dict.fromkeys(list(warnings) + list(seg.notes)))
    return SegmentResult(
        mode="segment" if request.grounded else "propagate", volume=_volume_name(stack, volume_path),
        preset=seg.preset, smoke=bool(seg.smoke), identity=seg.identity, **fields,
        stats_out=str(outputs.stats) if outputs.stats else None, shape=[int(x) for x in stack.volume.shape],
        metrics=metrics, out=outs[0] if outs else None, outs=outs,
        anchor_out=str(outputs.anchor) if outputs.anchor else None, qc=str(outputs.qc) if outputs.qc else None,
        agreement_out=str(outputs.agreement) if outputs.agreement else None)


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


def _write_targets(segs, stack, volume_path, request: SegmentRequest, outputs: SegmentOutputs, window,
                   warnings: Sequence[str] = ()) -> SegmentResult:
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
    notes = list(warnings)
    for o in overlaps:
        j, k = o["labels"]
        o.update(queries=[queries[j - 1], queries[k - 1]], volume_ml=round(o["voxels"] * voxel_ml, 3))
        notes.append(f"targets {j} ({_short(queries[j - 1])}) and {k} ({_short(queries[k - 1])}) overlap in "
                     f"{o['voxels']} voxels ({o['volume_ml']:g} mL): target {j}, asked first, keeps them")
    terms = [match(q, k) for k, q in enumerate(queries, start=1)]
    segments = [{"name": q, "value": k, "term": t} for k, (q, t) in enumerate(zip(queries, terms), start=1)]
    wrote_mask = any(not s.absent for s in segs) or outputs.empty_mask_on_absent
    outs = _write_masks(labels, stack, volume_path, outputs, segments, _algorithm(segs[0]), notes,
                        request.seg_type) if wrote_mask else []
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
            mine = (labels_stack == k).astype("uint8")
            key = None if seg.absent else int(seg.anchor.slice)
            lost_here = key is not None and not mine[key].any() and bool(np.any(seg.mask_stack[key]))
            _save_qc(files["qc"], stack, seg, mine, request, window, title, outputs.overwrite, warnings,
                     empty_note="mask: none left here (taken by an earlier target)"
                     if lost_here else "")
        lost = sum(o["voxels"] for o in overlaps if o["labels"][1] == k)
        targets.append(SegmentResult(label=k, **_target_fields(seg, q, term, stats), overlap_voxels_lost=lost,
                                     anchor_out=files.get("anchor_out"), qc=files.get("qc"),
                                     agreement_out=files.get("agreement_out")))
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
    return SegmentResult(
        mode="segment", volume=_volume_name(stack, volume_path), queries=queries, preset=first.preset,
        smoke=bool(any(s.smoke for s in segs)), identity=first.identity, absent=all(s.absent for s in segs),
        targets=targets, overlaps=overlaps, overlap_rule=OVERLAP_RULE, notes=list(dict.fromkeys(notes)),
        shape=[int(x) for x in stack.volume.shape], mask_voxels=int((labels > 0).sum()), stats=rows,
        stats_out=str(outputs.stats) if outputs.stats else None, slices_encoded=timings["slices_encoded"],
        timings=timings, out=outs[0] if outs else None, outs=outs, labels_out=[str(t) for t in tables])


def _short(query: str, limit: int = 60) -> str:
    q = " ".join(str(query).split())
    return repr(q if len(q) <= limit else q[: limit - 1] + "…")
