"""One case of ``medvol batch``: its folder ``DIR/<id>``, what it writes, its record and its row.

:class:`BatchCase` is what :func:`medvolcore.caseruns.run_cases` runs each case through: the
segment job (:func:`medvolcore.jobs.run_segment_job`) on the case's CT, its outputs, then
``done.json`` last; a failure leaves ``error.json`` alone in the folder. A case folder that is a
symbolic link is refused: the run never writes or deletes through a link.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Optional

from ..caseruns import one_line, read_record, write_record
from ..errors import MedVolError, OutputError
from ..fileio import remove_stale_temporaries
from .manifest import Case

CASE_SCHEMA = "medvol.batch-case/1"
OUTPUTS = ("mask.nii.gz", "anchor.json", "qc.png")
AGREEMENT = "agreement.nii.gz"  # with --consensus G ≥ 2
_CASE_FILES = OUTPUTS + (AGREEMENT,)
DONE, ERROR = "done.json", "error.json"
FINISHED = ("done", "absent")  # statuses of a complete case
FAILED = "failed"
INVALID = "invalid"  # a row that failed the check before the run (recorded with --skip-invalid, never run)
STATUSES = FINISHED + (FAILED, INVALID)
_LEGACY_TMP_RE = re.compile(r"[a-z0-9_]{8}\.part")


# ---- the case folder ---------------------------------------------------------------------------

def completed_record(case_dir: Path, case: Case, fingerprint: Optional[dict] = None) -> Optional[dict]:
    """``done.json`` of a complete case (all outputs present, same inputs), else None."""
    d = read_record(case_dir / DONE)
    if not d or d.get("status") not in FINISHED or d.get("id") != case.id:
        return None
    outputs = d.get("outputs") if isinstance(d.get("outputs"), list) else []
    listed = outputs if d.get("status") == "absent" else OUTPUTS
    if not set(OUTPUTS[1:]) <= set(listed) or not set(listed) <= set(_CASE_FILES):
        listed = OUTPUTS
    extra = (AGREEMENT,) if AGREEMENT in outputs else ()  # written with --consensus
    if not all((case_dir / name).is_file() for name in tuple(n for n in listed if n != AGREEMENT) + extra):
        return None
    if fingerprint is not None and d.get("case") != fingerprint:
        return None
    return d


def has_outputs(case_dir: Path) -> bool:
    return case_dir.is_dir() and any((case_dir / n).exists() for n in _CASE_FILES + (DONE, ERROR))


def _clear_case(case_dir: Path) -> None:
    """Remove this tool's files from a case folder: done.json first, then the rest and leftovers.

    A case folder that is a symbolic link is refused (:class:`OutputError`), never emptied: its
    target may be anything (checked when the run is planned, and again here in case it was swapped)."""
    if os.path.islink(case_dir):
        raise OutputError(f"the case folder {case_dir} is a symbolic link; medvol batch never writes or deletes "
                          "through a link")
    for name in (DONE, ERROR) + _CASE_FILES:
        try:
            (case_dir / name).unlink()
        except FileNotFoundError:
            pass
    if case_dir.is_dir():
        for name in _CASE_FILES + (DONE, ERROR):
            remove_stale_temporaries(case_dir / name)  # a killed run's (fileio.atomic_path names them with its pid)
            for tmp in case_dir.glob(f".{name}.*.part*"):  # those of versions that named no pid
                if _LEGACY_TMP_RE.match(tmp.name[len(name) + 2:]):
                    try:
                        tmp.unlink()
                    except FileNotFoundError:
                        pass


# ---- rows (what the summaries are made of) -------------------------------------------------------

def case_row(case_id, status, error="", slice_=None, boxes=None, seconds=None, dice=None, iou=None, **extra) -> dict:
    """A summary row: the :data:`~medvolcore.batch.report.CASE_COLUMNS` fields, ``stats``, ``confidence``
    and the report's own fields (``_query``, ``_reasoning``, ``_smoke``, ``_skipped``, …)."""
    r = {"id": case_id, "status": status, "error": error, "slice": slice_, "boxes": boxes, "seconds": seconds,
         "dice": dice, "iou": iou}
    r.update(extra)
    return r


def row_from_done(d: dict) -> dict:
    """The row of a case finished by an earlier run, read back from its ``done.json``."""
    a = d.get("anchor") or {}
    m = d.get("metrics") or {}
    return case_row(d["id"], d.get("status", "done"), "", a.get("slice"), a.get("n_boxes"), d.get("seconds"),
                    m.get("dice"), m.get("iou"),
                    _query=d.get("case", {}).get("query", ""), _reasoning=d.get("reasoning", ""), _smoke=d.get("smoke"),
                    _skipped=True, _run_seconds=None, confidence=d.get("confidence"),
                    _agreement=AGREEMENT in (d.get("outputs") or []),
                    stats=d.get("stats") if isinstance(d.get("stats"), dict) else None)  # None: an older done.json


def invalid_row(c: Case) -> dict:
    """The row of a case refused by the check before the run (``--skip-invalid``): never run."""
    return case_row(c.id, INVALID, c.problem, _query=c.query, _reasoning="", _smoke=None, _skipped=False,
                    _run_seconds=None)


def _failed_row(c: Case, error: str, seconds: float) -> dict:
    return case_row(c.id, FAILED, error, None, None, seconds, None, None, _query=c.query, _reasoning="", _smoke=None,
                    _skipped=False, _run_seconds=seconds)


# ---- the case, run ---------------------------------------------------------------------------------

class BatchCase:
    """A manifest case to :func:`medvolcore.caseruns.run_cases` (a
    :class:`~medvolcore.caseruns.CaseKeeper`): its folder is ``out/<id>``, its record ``done.json``
    whose ``case`` is the case's fingerprint (:meth:`Case.fingerprint`). ``opts``: the run's
    :class:`~medvolcore.batch.run.BatchOptions`; ``preset``: the resolved preset's name;
    ``pipeline`` and ``hu_window``: what runs the cases (None to plan only)."""

    def __init__(self, out: Path, opts, preset: str, pipeline=None, hu_window=None):
        self.out, self.opts, self.preset, self.pipeline, self.hu_window = Path(out), opts, preset, pipeline, hu_window
        self._started = (None, None)  # (id, fingerprint) of the case running: error.json records that fingerprint

    def fingerprint(self, c: Case) -> dict:
        o = self.opts
        d = c.fingerprint(self.preset, o.adapter, o.consensus, o.consensus_mask)
        if c.source and o.store_seg:  # a case finished without storing its SEG runs again to store it
            d["store_seg"] = True
        return d

    def name(self, c: Case) -> str:
        return c.id

    def previous(self, c: Case) -> Optional[dict]:
        """With ``--resume``: ``done.json`` of a complete case with the same fingerprint."""
        return completed_record(self.out / c.id, c, self.fingerprint(c)) if self.opts.resume else None

    def run(self, c: Case, progress) -> dict:
        t0 = time.perf_counter()
        fingerprint = self.fingerprint(c)  # before the volume is read: a file replaced later reruns
        self._started = (c.id, fingerprint)
        cdir = self.out / c.id
        _clear_case(cdir)  # a case folder swapped for a link after planning: refused, nothing written into it
        cdir.mkdir(parents=True, exist_ok=True)
        if c.source:
            with _retrieved(c, self.opts.dicomweb, progress) as (local, retrieved, work, store):
                rec = _segment_case(local, cdir, self.pipeline, self.opts, self.hu_window, progress, fingerprint, t0,
                                    retrieved, seg=work / "seg.dcm" if self.opts.store_seg else None, store=store)
        else:
            rec = _segment_case(c, cdir, self.pipeline, self.opts, self.hu_window, progress, fingerprint, t0)
        return case_row(c.id, rec["status"], "", rec["anchor"]["slice"], rec["anchor"]["n_boxes"], rec["seconds"],
                        (rec["metrics"] or {}).get("dice"), (rec["metrics"] or {}).get("iou"), _query=c.query,
                        _reasoning=rec["reasoning"], _smoke=rec["smoke"], _skipped=False, _run_seconds=rec["seconds"],
                        confidence=rec.get("confidence"), _agreement=AGREEMENT in rec["outputs"], stats=rec["stats"])

    def failed(self, c: Case, error: Exception, seconds: float) -> dict:
        """``error.json`` (the error's code and one-line message) alone in the case folder."""
        if isinstance(error, MedVolError):
            code, message = error.code, one_line(str(error))
        else:
            code, message = "internal_error", one_line(f"{type(error).__name__}: {error}")
        cdir = self.out / c.id
        try:
            _clear_case(cdir)  # a failed case keeps only its error.json
        except OutputError:  # a link: nothing is written through it
            return _failed_row(c, f"{code}: {message}", seconds)
        started, fingerprint = self._started
        if started != c.id:
            fingerprint = self.fingerprint(c)
        write_record(cdir / ERROR, {"schema": CASE_SCHEMA, "id": c.id, "status": FAILED,
                                    "error": {"code": code, "message": message}, "seconds": seconds,
                                    "case": fingerprint, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        return _failed_row(c, f"{code}: {message}", seconds)


@contextmanager
def _retrieved(c: Case, access, progress):
    """``(case, retrieved, work, store)``: the case with its series retrieved into a private
    folder (or ``KEEP/SERIES_UID`` with ``--keep-downloads``) as its volume, a private folder
    ``work`` for the DICOM-SEG, and ``store(path)`` that stores a DICOM-SEG into the series' study
    on the same server. ``work`` (and the download, unless kept) is removed when the case ends,
    whatever the outcome."""
    from ..pacs import DicomWebURL, SeriesAccess, retrieve_series, store_seg

    access = access or SeriesAccess()
    url, token, limits = access.source(c.source)
    work = Path(tempfile.mkdtemp(prefix="medvol-dicomweb-"))  # 0700: patient data
    folder = Path(access.keep) / url.series if access.keep else work / "series"
    try:
        retrieved = retrieve_series(url, folder, token, limits)
        yield (replace(c, volume=folder), retrieved, work,
               lambda seg: store_seg(seg, DicomWebURL(url.base, url.study), token))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _segment_case(c: Case, cdir: Path, pipe, opts, hu_window, progress, fingerprint, t0, retrieved=None, seg=None,
                  store=None) -> dict:
    """Segment the case, write its outputs (and the DICOM-SEG ``seg``, stored by ``store``), then
    ``done.json`` (returned)."""
    from ..geometry import gt_on_grid
    from ..jobs import SegmentOutputs, run_segment_job
    from ..request import SegmentRequest
    from ..pipeline import as_stack
    from ..errors import GroundTruthError, VolumeError
    from ..volume import CTVolume, label_mask, load_label_map

    stack = as_stack(c.volume)
    target = on = None
    if c.gt is not None:  # read before the model runs: a bad label map fails the case cheaply
        try:
            labels = load_label_map(c.gt)
            on = gt_on_grid(stack.volume, labels)  # by geometry (medvolcore.geometry), or refused
            labels = CTVolume(on.array, stack.volume.affine, path=labels.path)
            target = label_mask(labels, c.label)
        except VolumeError as e:
            raise GroundTruthError(f"the ground truth {c.gt.name}: {e}") from None
    request = SegmentRequest.from_manifest({"id": c.id, "query": c.query}, reference=target,
                                           **opts.request_settings(hu_window))
    agreement = cdir / AGREEMENT if opts.consensus > 1 else None
    outputs = SegmentOutputs([cdir / OUTPUTS[0], seg] if seg else cdir / OUTPUTS[0], anchor=cdir / OUTPUTS[1], qc=cdir / OUTPUTS[2], overwrite=True,
                             names=OUTPUTS, empty_mask_on_absent=opts.empty_mask_on_absent, agreement=agreement,
                             agreement_name=AGREEMENT)
    res = run_segment_job(pipe, stack, request, outputs, inputs=[("volume", c.volume), ("gt", c.gt)],
                          progress=progress)
    a = res["anchor"]
    written = [name for name, path in zip(OUTPUTS, (res["out"], res["anchor_out"], res["qc"])) if path]
    rec = {
        "schema": CASE_SCHEMA, "id": c.id, "status": "absent" if res["absent"] else "done",
        "seconds": round(time.perf_counter() - t0, 3),
        "case": fingerprint,
        "metrics": dict(res["metrics"], gt_resampled=on.note) if res["metrics"] is not None and on is not None
        else res["metrics"],
        "anchor": {"slice": a["slice"], "n_boxes": len(a["boxes"]), "boxes": [list(b) for b in a["boxes"]]},
        "reasoning": res["reasoning"], "mask_voxels": res["mask_voxels"], "smoke": res["smoke"],
        "identity": res.get("identity"),
        "notes": res["notes"], "outputs": written + ([AGREEMENT] if res["agreement_out"] else []),
        "propagation": res["propagation"], "answer_mean_prob": res["answer_mean_prob"],
        "consensus": res["consensus"], "consensus_mask": res["consensus_mask"], "confidence": res["confidence"],
        "stats": res["stats"],
        "timings": {k: v for k, v in res["timings"].items() if isinstance(v, float)},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if retrieved is not None:
        rec["retrieved"] = retrieved
    if seg is not None:  # stored before done.json: a case is finished only once the server took its SEG
        rec["stored"] = store(seg) if Path(seg).is_file() else None
    write_record(cdir / DONE, rec)  # last: marks the case complete
    return rec


__all__ = ["BatchCase", "completed_record", "has_outputs", "case_row", "row_from_done", "invalid_row", "CASE_SCHEMA",
           "OUTPUTS", "AGREEMENT", "DONE", "ERROR", "FINISHED", "FAILED", "INVALID", "STATUSES"]
