"""A segment job's result, declared once: what every front door reports of it.

:class:`SegmentResult` declares each field once, with what it means, which results carry it and
which doors show it: ``medvol segment --json`` and ``medvol demo --json`` (:meth:`~SegmentResult.to_json`),
the worker's ``segment`` and ``propagate`` replies (:meth:`~SegmentResult.to_wire`, to which the
worker adds what only it knows: ``model_label``, ``volume_sha256``, the mask and agreement map as
paths or bytes, ``labels_path``, its own timings). ``medvol batch`` and Python callers read it as
the mapping it is (``res["anchor"]``, ``res.get("identity")``).

Three shapes carry the fields: a one-target result (:data:`ONE`), a several-target result
(:data:`SEVERAL`: ``queries`` given) and each entry of its ``targets`` (:data:`ENTRY`, itself a
:class:`SegmentResult` with its ``label``). A result is a mapping of the fields of its shape;
entries are shown whole by every door.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import List, Optional, Tuple

__all__ = ["SegmentResult", "ONE", "SEVERAL", "ENTRY"]

ONE, SEVERAL, ENTRY = "one", "several", "entry"
_JOB = (ONE, SEVERAL)  # a job's result, either shape
_TARGET = (ONE, ENTRY)  # what one target has: a one-target result, an entry of a several-target one
_ALL = (ONE, SEVERAL, ENTRY)
_OPS = ("segment", "propagate")


def _declare(doc: str, shapes: Tuple[str, ...], *, cli: bool = False, wire: Tuple[str, ...] = ()):
    """A result field: ``doc``, the ``shapes`` that carry it, whether ``medvol segment --json``
    shows it (``cli``) and which worker ops reply with it (``wire``); entries are always whole."""
    return dataclasses.field(default=None, metadata={"doc": doc, "shapes": shapes, "cli": cli, "wire": tuple(wire)})


@dataclass(eq=False)
class SegmentResult(Mapping):
    """The one result of :func:`medvolcore.jobs.run_segment_job`; JSON-ready values."""

    mode: Optional[str] = _declare('"segment" (grounded) or "propagate" (a given anchor)', _JOB)
    out: Optional[str] = _declare(
        "the first mask file written (None when none was: an absent result without empty_mask_on_absent)", _JOB,
        cli=True)
    anchor_out: Optional[str] = _declare("the anchor file written (None if not asked for)", _TARGET, cli=True)
    qc: Optional[str] = _declare("the QC picture written (None if not asked for)", _TARGET, cli=True)
    agreement_out: Optional[str] = _declare(
        "a consensus's agreement map written (whenever asked, absent or not; None if not asked for)", _TARGET, cli=True)
    volume: Optional[str] = _declare("the volume's path (None for an in-memory volume)", _JOB, cli=True)
    outs: Optional[List[str]] = _declare("every mask output written (out is the first)", _JOB, cli=True)
    labels_out: Optional[List[str]] = _declare(
        "the label tables written (*.labels.json beside each plain label map; schema medvol.labels/1)", (SEVERAL,),
        cli=True)
    queries: Optional[List[str]] = _declare("the queries, in order (query k is label k)", (SEVERAL,), cli=True,
                                            wire=_OPS)
    label: Optional[int] = _declare("the target's label value in every mask output (k for query k)", (ENTRY,))
    preset: Optional[str] = _declare("the model preset's name ('' for a propagation-only pipeline)", _JOB, cli=True,
                                     wire=_OPS)
    smoke: Optional[bool] = _declare("True when an untrained smoke model made the anchor or mask", _JOB, cli=True,
                                     wire=_OPS)
    absent: Optional[bool] = _declare(
        "True when the grounder answered that the target is not in this volume (the mask is all zero, nothing was "
        "propagated); of several targets: every target absent", _ALL, cli=True, wire=_OPS)
    identity: Optional[dict] = _declare(
        "what the models are (medvolcore.models.identity: label, zero_shot, trained_for_task, …); None for a "
        "MedSAM2-only pipeline", _JOB, cli=True, wire=_OPS)
    targets: Optional[list] = _declare(
        "one entry per query: its label, the one-target fields, its files and overlap_voxels_lost", (SEVERAL,),
        cli=True, wire=_OPS)
    overlaps: Optional[List[dict]] = _declare(
        "voxels two targets claim: {labels: [j, k], queries, voxels, volume_ml}; j, asked first, keeps them",
        (SEVERAL,), cli=True, wire=_OPS)
    overlap_rule: Optional[str] = _declare("the rule overlaps follow (medvolcore.jobs.OVERLAP_RULE)", (SEVERAL,),
                                           cli=True, wire=_OPS)
    query: Optional[str] = _declare("the query ('' when propagating an anchor without one)", _TARGET)
    terminology: Optional[dict] = _declare(
        "how the query (or the target name) was coded (medvolcore.terminology); None without a query", _TARGET,
        cli=True, wire=_OPS)
    stats: object = _declare(
        "the target's statistics (medvolcore.stats: voxels, mL, HU, key slice, bounding box); of several targets: "
        "one row per target", _ALL, cli=True, wire=_OPS)
    stats_out: Optional[str] = _declare("the statistics file written (None if not asked for)", _JOB, cli=True)
    anchor: Optional[dict] = _declare(
        "the evidence anchor as written to its file (medvol.anchor/1, /2 with corrections, /3 absent), with its "
        "propagation record", _TARGET, cli=True, wire=_OPS)
    reasoning: Optional[str] = _declare("the model's reasoning (the anchor's, when propagating)", _TARGET, cli=True,
                                        wire=_OPS)
    raw_text: Optional[str] = _declare("the model's whole answer ('' when propagating)", _TARGET, cli=True)
    notes: Optional[List[str]] = _declare(
        "remarks a reader must see (smoke model, zero-shot model, reordered boxes, NaN voxels, overlaps, …)", _ALL,
        cli=True, wire=_OPS)
    mask_voxels: Optional[int] = _declare("the mask's voxel count (of several targets: labelled voxels)", _ALL,
                                          cli=True, wire=_OPS)
    propagation: Optional[dict] = _declare("early stop's K and where each direction stopped (as in anchor)", _TARGET,
                                           wire=_OPS)
    slices_encoded: Optional[int] = _declare(
        "slices MedSAM2's image encoder ran on (0 when a kept feature store had every slice visited; of several "
        "targets: for all)", _ALL, wire=_OPS)
    shape: Optional[List[int]] = _declare("the volume's source grid shape", _JOB, wire=_OPS)
    answer_mean_logprob: Optional[float] = _declare(
        "the greedy answer's mean token log-probability under the decoder's scores (None when not measured, e.g. a "
        "given anchor): how peaked the choice was, not the chance that it is right", _TARGET, cli=True,
        wire=("segment",))
    answer_mean_prob: Optional[float] = _declare("exp(answer_mean_logprob)", _TARGET, cli=True, wire=("segment",))
    consensus: Optional[int] = _declare("the number of answers G (1: no consensus)", _TARGET, cli=True,
                                        wire=("segment",))
    consensus_mask: Optional[str] = _declare("the mask of a consensus: greedy or majority", _TARGET, cli=True,
                                             wire=("segment",))
    confidence: Optional[float] = _declare(
        "with G > 1, the samples' mean pairwise agreement in [0, 1] (medvolcore.consensus), else None", _TARGET,
        cli=True, wire=("segment",))
    samples: Optional[List[dict]] = _declare("each sample in compact form (None without a consensus)", _TARGET,
                                             cli=True, wire=("segment",))
    metrics: Optional[dict] = _declare(
        "with a reference mask: {dice, iou, pred_voxels, gt_voxels} (Dice and IoU to 6 places), else None", (ONE,))
    overlap_voxels_lost: Optional[int] = _declare("the target's voxels that went to an earlier target", (ENTRY,))
    timings: Optional[dict] = _declare(
        "seconds per stage (ground_*, propagate_s, propagate_s_per_slice, slices_encoded, slices_propagated, "
        "encoder_calls, total_s: the pipeline's; write_s and job_s: the whole job); of several targets: ground_s for "
        "all queries, shared_prompt, shared_prefill_s, propagate_s, total_s, write_s, job_s", _ALL, cli=True,
        wire=_OPS)

    @property
    def kind(self) -> str:
        """:data:`ONE`, :data:`SEVERAL` or :data:`ENTRY`."""
        return SEVERAL if self.targets is not None else ENTRY if self.label is not None else ONE

    # -- the mapping: the fields of this result's shape ----------------------------------------
    def __getitem__(self, key: str):
        if key not in _names(self.kind):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(_names(self.kind))

    def __len__(self) -> int:
        return len(_names(self.kind))

    # -- what each door shows ------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Every field of this result's shape, as plain JSON values."""
        return {k: _plain(getattr(self, k)) for k in _names(self.kind)}

    def to_json(self) -> dict:
        """What ``medvol segment --json`` and ``medvol demo --json`` show of it."""
        return {k: _plain(getattr(self, k)) for k in _names(self.kind, "cli")}

    def to_wire(self, op: str) -> dict:
        """What the worker's ``op`` reply carries of it (the worker adds its own keys)."""
        return {k: _plain(getattr(self, k)) for k in _names(self.kind, op)}


@lru_cache(maxsize=None)
def _names(kind: str, door: Optional[str] = None) -> Tuple[str, ...]:
    """The fields a result of ``kind`` carries, in declared order; with ``door`` (``"cli"`` or a
    worker op) those the door shows."""
    out = []
    for f in fields(SegmentResult):
        m = f.metadata
        if kind in m["shapes"] and (door is None or (m["cli"] if door == "cli" else door in m["wire"])):
            out.append(f.name)
    return tuple(out)


def _plain(value):
    """Entries as plain dicts (a result's other values are JSON-ready already)."""
    if isinstance(value, list) and value and isinstance(value[0], SegmentResult):
        return [v.to_dict() for v in value]
    return value
