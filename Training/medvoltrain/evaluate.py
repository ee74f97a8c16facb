"""``medvol-train evaluate``: the full pipeline on a prepared split, scored like the paper's Table 1.

This module is the command and one case; the settings and their fingerprint are
:mod:`medvoltrain.eval_settings`', the tables :mod:`medvoltrain.eval_tables`', and the run (shards,
resume, records, errors, progress) :mod:`medvolcore.caseruns`', as for ``medvol batch``.

Per sample of the split (``medvol.train.samples/1``, :mod:`medvoltrain.prepare`):

* **grounder mode** (default): :meth:`medvolcore.pipeline.Pipeline.segment` on the sample's CT
  with its query — Qwen3-VL (the preset, optionally with ``--adapter``) picks the evidence anchor
  on the 64 shown slices, with constrained decoding as the product does (``--unconstrained``
  turns the grammar off; decoding stays greedy) — then MedSAM2 propagates it over the whole
  volume;
* **oracle mode** (``--oracle``): the ground-truth anchor (:func:`medvolcore.anchor.anchor_from_mask`
  with ``top_k=1``: the largest-area slice of the whole stack and the boxes of its 8-connected
  components) goes straight to MedSAM2; no language model is loaded. This is the propagation's
  upper bound: grounder DSC against oracle DSC says how much is lost in grounding.

Both modes propagate with early stop (``--stop-after-empty K``, default the product's: each
direction ends once every mask has been empty on K slices), as ``medvol segment`` does; ``K = 0``
propagates through the whole volume, the paper's protocol for Table 1. K is part of the
settings (and so of the fingerprint) and of the method label when it is not 0.

Everything is on the canonical axial stack (docs/architecture.md): the prepared mask, the predicted
mask (``Segmentation.mask_stack``), slice indices and boxes.

Per case (``DIR/cases.csv``): ``dsc_pct`` / ``iou_pct`` (3-D, in %), ``hit`` (1 when the predicted
key slice holds target foreground, ``slice_areas[k] > 0``), ``axial_score``
(:func:`~medvoltrain.rewards.axial_reward`), ``box_iou`` (:func:`~medvoltrain.rewards.box_reward`
of the predicted boxes against the ground-truth boxes of the *predicted* slice), the predicted and
the largest-area slice, the number of boxes, voxel counts, ``seconds`` (inference: grounding +
propagation, not data loading), ``status`` and ``error``.

Negative samples (``"absent": true``: the target is not in that volume, ``prepare
--negative-fraction``) and absent answers (``<answer>[]</answer>``): a negative case is **not
scored for DSC, IoU, hit, axial score or box IoU** (there is no target to overlap; those columns are
empty and every mean is over the positive cases); what counts for it is whether the answer was
``[]``. An absent answer on a positive case scores **DSC = IoU = 0**, a miss and box IoU 0 (the user
gets no mask). Three extra columns, after the paper's: **existence accuracy** (over every scored
case: the answer is ``[]`` exactly when the target is absent; a failed case is wrong), the
**false-positive rate on negative cases** (the model answered a slice and boxes where the target
is absent) and the **false-negative rate on positive cases** (it answered ``[]`` where the target
is present), in %; a failed case is neither a false positive nor a false negative. ``cases.csv``
has ``target_absent`` and ``answer_absent`` (0/1).

``status`` is ``ok``; ``failed`` — the model gave no usable answer
(:class:`~medvolcore.errors.GenerationError`): the product would give the user no mask, so the case
**counts as DSC = IoU = 0, a miss and box IoU 0** in every mean, and the table says how many; or
``error`` — the case could not be evaluated (unreadable data, out of memory, …): **left out of
every mean**, counted in the table, and retried by the next run. Failed cases are kept on a re-run
(greedy decoding would fail again) unless ``--retry-failed``.

Outputs (all written atomically) in ``DIR``::

    settings.json        the settings and their fingerprint (a DIR holds one evaluation)
    cases/<id>.json      one finished case (the resume marker), with its anchor and answer
    masks/<id>.npz       its predicted mask, bool (D, H, W) on the canonical stack ("mask")
    cases.csv            one row per finished case, in split order
    table.md, table.csv  the Table 1 row: DSC and IoU (%) per dataset, their average, hit rate, box IoU
    summary.json         all of it as numbers, plus means over the successful cases only

Per-dataset means are over the cases of that dataset (failed as 0, errors left out); **Average**
is the unweighted mean of the per-dataset means (each dataset counts once, whatever its size).

Resume and shards: the cases run through :func:`medvolcore.caseruns.run_cases`, the loop ``medvol
batch`` runs too. A case whose file carries the current settings' fingerprint is skipped.
``--shard I/N`` (``I`` counts from 1, :func:`medvolcore.caseruns.parse_shard`) evaluates the samples
at 0-based positions ``p`` with ``p % N == I - 1`` (position in the split, after ``--limit``); every
run — and ``--aggregate-only`` — rebuilds the tables from every matching case file in DIR, so
shards run into one DIR give the same table as one run. A DIR made with other
settings is refused unless ``--overwrite`` (which recomputes this shard's cases; case files of the
old settings are ignored by the tables).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from medvolcore.caseruns import (RunProgress, one_line, parse_shard, plan_run, read_record, run_cases, shard_of,
                                 shard_text, status_counts)
from medvolcore.errors import GenerationError, InputError, OutputExistsError

from .datasets import SPLITS
from .errors import DataError
from .eval_settings import (PROTOCOLS, SCHEMA, SMOKE_TEXT, EvalSettings, case_key, dataset_name, method_label,
                            protocol_of, resolve_settings, write_json)
from .eval_tables import CASE_COLUMNS, EXISTENCE_COLUMNS, STATUSES, aggregate, existence, table_row
from .prepare import load_mask, load_samples, load_stack

log = logging.getLogger(__name__)

ERROR_CHARS = 300  # cases.csv keeps the start of an error message; the case file keeps all of it


# ---- models ---------------------------------------------------------------------------------------

def _build_propagator(settings: EvalSettings, device: str):
    from medvolcore import models
    from medvolcore.propagation import MedSAM2Propagator

    if settings.sam.startswith("checkpoint:"):
        return MedSAM2Propagator.from_checkpoint(settings.sam.split(":", 1)[1], device=device)
    if settings.sam.startswith("random:"):
        _, seed, size = settings.sam.split(":")
        return MedSAM2Propagator.from_random(int(seed), image_size=int(size), device=device)
    resolved = models.resolve(settings.preset, require_adapter=False)  # its MedSAM2 only
    if resolved.sam_checkpoint is not None:
        return MedSAM2Propagator.from_checkpoint(resolved.sam_checkpoint, device=device)
    seed, size = resolved.sam_random
    return MedSAM2Propagator.from_random(seed, image_size=size, device=device)


class _Engine:
    """The models, loaded once and only when a case needs them (a fully resumed run loads nothing)."""

    def __init__(self, settings: EvalSettings, device: str):
        self.settings = settings
        self.device_arg = device
        self.device = None
        self.propagator = None
        self.pipeline = None
        self.loaded = False

    def load(self) -> "_Engine":
        if self.loaded:
            return self
        from medvolcore.devices import resolve_device

        self.device = str(resolve_device(self.device_arg))
        self.propagator = _build_propagator(self.settings, self.device)
        if not self.settings.oracle:
            from medvolcore.pipeline import Pipeline

            self.pipeline = Pipeline(self.settings.preset, adapter=self.settings.adapter, device=self.device,
                                     propagator=self.propagator)
            self.pipeline.grounder  # noqa: B018 — load it now: a model problem stops the run, not every case
        self.loaded = True
        return self


# ---- one case -----------------------------------------------------------------------------------

class _StackCache:
    """The CT of the last case (the samples of one case are consecutive in a split)."""

    def __init__(self):
        self.key = None
        self.stack = None
        self.window = None

    def get(self, sample: dict):
        src = sample.get("source") or {}
        key = (src.get("volume"), src.get("labels"), src.get("orientation"), sample.get("intensity"))
        if key != self.key:
            self.key, self.stack = None, None
            self.stack, self.window = load_stack(sample)
            self.key = key
        return self.stack


def _gt_boxes_norm(sample: dict, gt_mask: np.ndarray, z: int) -> list:
    """Ground-truth boxes (0–1000) of stack slice ``z``: the prepared ones for a shown slice, else from the mask."""
    stored = (sample.get("gt_boxes_norm") or {}).get(str(int(z)))
    if stored is not None:
        return stored
    if not 0 <= z < gt_mask.shape[0]:
        return []
    from medvolcore.anchor import box_to_norm, boxes_from_slice_mask

    h, w = gt_mask.shape[1:]
    return [box_to_norm(b, w, h) for b in boxes_from_slice_mask(gt_mask[z])]


def score_case(sample: dict, gt_mask: np.ndarray, pred_mask: np.ndarray, pred_slice: Optional[int],
               pred_boxes_norm) -> dict:
    """The per-case numbers (see the module docstring) of a prediction on the canonical stack for a
    positive sample; ``pred_slice`` None is the absent answer (DSC = IoU = 0, a miss, box IoU 0)."""
    from medvolcore.metrics import dice, iou

    from .rewards import axial_reward, box_reward

    areas = sample["slice_areas"]
    absent = pred_slice is None
    k = None if absent else int(pred_slice)
    return {
        "dsc_pct": 0.0 if absent else 100.0 * dice(pred_mask, gt_mask),
        "iou_pct": 0.0 if absent else 100.0 * iou(pred_mask, gt_mask),
        "hit": int(not absent and 0 <= k < len(areas) and areas[k] > 0), "axial_score": axial_reward(k, areas),
        "box_iou": 0.0 if absent else box_reward(pred_boxes_norm, _gt_boxes_norm(sample, gt_mask, k)),
        "pred_slice": k, "n_boxes": len(pred_boxes_norm),
        "pred_voxels": int(np.count_nonzero(pred_mask)), "gt_voxels": int(np.count_nonzero(gt_mask)),
        "target_absent": 0, "answer_absent": int(absent),
    }


def score_negative(pred_mask: Optional[np.ndarray], pred_slice: Optional[int], pred_boxes_norm) -> dict:
    """The per-case numbers of a negative sample (the target is not in the volume): only whether the
    answer was ``[]`` (``pred_slice`` None); DSC, IoU, hit, axial score and box IoU are not scored."""
    absent = pred_slice is None
    return {"dsc_pct": None, "iou_pct": None, "hit": None, "axial_score": None, "box_iou": None,
            "pred_slice": None if absent else int(pred_slice), "n_boxes": len(pred_boxes_norm),
            "pred_voxels": 0 if pred_mask is None else int(np.count_nonzero(pred_mask)), "gt_voxels": 0,
            "target_absent": 1, "answer_absent": int(absent)}


def evaluate_case(sample: dict, engine: _Engine, stacks: _StackCache,
                  progress=None) -> Tuple[dict, dict, Optional[np.ndarray]]:
    """``(row, details, predicted stack mask)`` of one sample; a model that gives no usable answer
    yields a ``failed`` row (and no mask); an absent answer yields no mask; any other problem
    propagates to the caller. ``progress(stage, fraction, message)``: the segment job's events
    (grounding, propagation), for the run's display."""
    from medvolcore.anchor import EvidenceAnchor, anchor_from_mask

    from .rewards import parsed

    stack = stacks.get(sample)
    gt = load_mask(sample)
    if gt.shape != stack.shape:
        raise DataError(f"sample {sample['id']}: mask {gt.shape} and CT stack {stack.shape} differ in shape")
    negative = bool(sample.get("absent"))
    gt_anchor = None if negative else anchor_from_mask(gt, top_k=1, stack=stack)
    gt_slice = None if negative else gt_anchor.slice
    window = stacks.window
    engine.load()
    t0 = time.perf_counter()
    details = {"gt_anchor": None if negative else {"slice": gt_anchor.slice, "boxes": gt_anchor.boxes},
               "target_absent": negative}
    if engine.settings.oracle:
        if negative:  # the ground-truth anchor of an absent target is the absent anchor: nothing to propagate
            anchor = EvidenceAnchor.absent_for([stack.width, stack.height], query=sample["query"], source="mask")
            pred_mask, boxes_norm = np.zeros(stack.shape, bool), []
            details.update(anchor=anchor.to_dict(), slices_encoded=0)
        else:
            anchor = gt_anchor
            # what Pipeline.repropagate does, without a language model (nor its weights) behind it
            on_slice = None if progress is None else (
                lambda done, total, message: progress("propagate", done / max(total, 1), message))
            r = engine.propagator.propagate(stack.data, anchor.slice, anchor.boxes, hu_window=window,
                                            stop_after_empty=engine.settings.stop_after_empty, progress=on_slice)
            pred_mask, boxes_norm = r.mask, anchor.boxes_norm
            details.update(anchor=anchor.to_dict(), slices_encoded=r.slices_encoded, propagation=r.stop_summary())
    else:
        try:
            seg = engine.pipeline.segment(stack, sample["query"], constrain=engine.settings.constrain,
                                          hu_window=window, stop_after_empty=engine.settings.stop_after_empty,
                                          progress=progress)
        except GenerationError as e:
            details.update(raw_text=getattr(e, "raw_text", ""), failures=getattr(e, "failures", []),
                           error=f"GenerationError: {e}")
            row = {"status": "failed", "error": _short(f"GenerationError: {e}"), "gt_slice": gt_slice,
                   "seconds": time.perf_counter() - t0, "gt_voxels": int(np.count_nonzero(gt))}
            return row, details, None
        pred_mask = seg.mask_stack
        if seg.anchor.absent:
            boxes_norm = []
        else:
            # the boxes as the model wrote them (what the box reward scores), else the anchor's pixel boxes
            ans = parsed(seg.raw_text)
            boxes_norm = (ans.boxes_norm if ans is not None and not ans.absent and int(ans.slice) == seg.anchor.slice
                          else seg.anchor.boxes_norm)
        details.update(anchor=seg.anchor.to_dict(), raw_text=seg.raw_text, reasoning=seg.reasoning,
                       notes=list(seg.notes),
                       timings={k: (None if isinstance(v, float) and not np.isfinite(v) else v)  # strict JSON
                                for k, v in seg.timings.items()})
    seconds = time.perf_counter() - t0
    answer_absent = bool(details["anchor"].get("absent"))
    pred_slice = None if answer_absent else details["anchor"]["slice"]
    boxes = [[float(v) for v in b] for b in boxes_norm]
    if negative:
        row = score_negative(pred_mask, pred_slice, boxes)
    else:
        row = score_case(sample, gt, pred_mask, pred_slice, boxes)
    row.update(status="ok", error="", gt_slice=gt_slice, seconds=seconds)
    return row, details, None if answer_absent else pred_mask


def _short(text: str) -> str:
    text = one_line(text)
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 1] + "…"


def _complete_row(row: dict, sample: dict) -> dict:
    full = {k: "" for k in CASE_COLUMNS}
    full.update(id=sample["id"], case_id=sample.get("case_id", ""), dataset=sample.get("dataset"),
                dataset_name=dataset_name(sample.get("dataset")), label=sample.get("label", ""),
                query=sample.get("query", ""), target_absent=int(bool(sample.get("absent"))))
    full.update(row)
    return full


def _save_mask(path: Path, mask: np.ndarray) -> None:
    from medvolcore.fileio import atomic_path

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, overwrite=True) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, mask=np.asarray(mask, dtype=bool))


class _EvalCase:
    """A sample of the split to :func:`medvolcore.caseruns.run_cases`: its record is
    ``cases/<key>.json`` (the settings' fingerprint, the row, the details), its mask
    ``masks/<key>.npz``. A record of these settings whose status is in ``keep`` is skipped, unless
    ``redo`` (``--overwrite``)."""

    def __init__(self, out_dir: Path, fingerprint: str, engine: _Engine, *, keep: Tuple[str, ...], redo: bool,
                 save_masks: bool):
        self.out_dir, self.fingerprint, self.engine = out_dir, fingerprint, engine
        self.keep, self.redo, self.save_masks = keep, redo, save_masks
        self.stacks = _StackCache()
        self.recorded = 0

    def name(self, sample: dict) -> str:
        return sample["id"]

    def previous(self, sample: dict) -> Optional[dict]:
        if self.redo:
            return None
        rec = read_record(self.out_dir / "cases" / f"{case_key(sample['id'])}.json")
        if rec is None or rec.get("fingerprint") != self.fingerprint:
            return None
        return rec if (rec.get("row") or {}).get("status") in self.keep else None

    def run(self, sample: dict, progress) -> dict:
        row, details, pred = evaluate_case(sample, self.engine, self.stacks, progress)
        return self._record(sample, row, details, pred)

    def failed(self, sample: dict, error: Exception, seconds: float) -> dict:
        """An ``error`` row: left out of every mean, retried by the next run."""
        msg = str(error).strip().splitlines()[0] if str(error).strip() else ""
        log.warning("case %s could not be evaluated: %s: %s", sample["id"], type(error).__name__, msg)
        return self._record(sample, {"status": "error", "error": _short(f"{type(error).__name__}: {msg}")},
                            {"error": f"{type(error).__name__}: {error}"}, None)

    def _record(self, sample: dict, row: dict, details: dict, pred: Optional[np.ndarray]) -> dict:
        key = case_key(sample["id"])
        row = _complete_row(row, sample)
        if pred is not None and self.save_masks:
            _save_mask(self.out_dir / "masks" / f"{key}.npz", pred)
        write_json(self.out_dir / "cases" / f"{key}.json",  # last: the case counts as evaluated
                   {"schema": SCHEMA, "fingerprint": self.fingerprint, "id": sample["id"], "row": row,
                    "device": self.engine.device, "details": details})
        self.recorded += 1
        return row


# ---- the command ------------------------------------------------------------------------------

def _has_cases(out_dir: Path, prev: dict) -> bool:
    """Whether ``out_dir`` holds a finished case of the settings in ``prev`` (a run that stopped before its
    first case, e.g. a model that would not load, leaves nothing worth protecting)."""
    for path in (out_dir / "cases").glob("*.json"):
        rec = read_record(path)
        if rec and rec.get("fingerprint") == prev.get("fingerprint"):
            return True
    return False


def _check_out_dir(out_dir: Path, settings: EvalSettings, fingerprint: str, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--out {out_dir} exists and is not a folder")
    prev_path = out_dir / "settings.json"
    prev = read_record(prev_path) if prev_path.exists() else None
    if prev_path.exists() and prev is None and not overwrite:
        raise DataError(f"{prev_path} is unreadable; pass --overwrite to start this evaluation again")
    if prev is not None and prev.get("fingerprint") != fingerprint and not overwrite and _has_cases(out_dir, prev):
        old = prev.get("settings") or {}
        diff = [f"{k}: {old.get(k)!r} → {v!r}" for k, v in asdict(settings).items() if old.get(k) != v]
        raise OutputExistsError(f"{out_dir} holds an evaluation with other settings ({'; '.join(diff) or 'version'}); "
                                "use another --out, or pass --overwrite to redo it with these settings")
    if prev is None and out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out_dir} is not empty and holds no evaluation (no settings.json); use another "
                                "--out, or pass --overwrite to write into it")


def _split_samples(data_dir, split: str, limit: Optional[int]) -> List[dict]:
    everything = load_samples(data_dir)
    samples = [s for s in everything if s["split"] == split]
    if not samples:
        counts = ", ".join(f"{sum(x['split'] == sp for x in everything)} {sp}" for sp in SPLITS)
        raise DataError(f"{data_dir} has no {split} samples ({counts}); evaluate another split or prepare "
                        f"{split} cases")
    return samples[:limit] if limit else samples


def evaluate(data, out, *, split: str = "test", oracle: bool = False, preset: Optional[str] = None, adapter=None,
             sam_checkpoint=None, random_weights: Optional[int] = None, sam_image_size: Optional[int] = None,
             device: str = "auto", shard=None, limit: Optional[int] = None, constrain: bool = True,
             overwrite: bool = False, retry_failed: bool = False, save_masks: bool = True, progress: bool = True,
             aggregate_only: bool = False, stop_after_empty: Optional[int] = None,
             protocol: Optional[str] = None) -> dict:
    """Evaluate the pipeline (or the oracle anchor) on a prepared split and write the tables (see the
    module docstring); returns the summary, with ``summary["run"]`` saying what this call did.
    ``stop_after_empty``: early stop's K (None: the product default; 0: the whole volume, the paper's).
    ``protocol``: ``"paper"`` (K = 0 on the test split; an explicit K > 0 or another split is refused) or
    ``"product"``/None (the product default K unless ``stop_after_empty`` is given); :data:`PROTOCOLS`.

    ``aggregate_only``: rebuild the tables of ``out`` from its case files and settings (the other
    arguments are not used)."""
    t_start = time.perf_counter()
    out_dir = Path(out).expanduser()
    if aggregate_only:
        prev = read_record(out_dir / "settings.json")
        if prev is None or not isinstance(prev.get("settings"), dict):
            raise DataError(f"{out_dir} holds no evaluation (no readable settings.json) to aggregate")
        try:
            settings = EvalSettings(**prev["settings"])
        except TypeError as e:
            raise DataError(f"{out_dir / 'settings.json'} is not an evaluation's settings ({e})") from None
        samples = _split_samples(settings.data, settings.split, prev.get("limit"))
        summary = aggregate(samples, out_dir, settings, settings.fingerprint())
        summary["run"] = {"evaluated": 0, "resumed": 0, "shard": None, "seconds": time.perf_counter() - t_start}
        return summary

    if split not in SPLITS:
        raise InputError(f"unknown split {split!r}: use {' or '.join(SPLITS)}")
    if protocol not in (None,) + PROTOCOLS:
        raise InputError(f"unknown protocol {protocol!r}: use {' or '.join(PROTOCOLS)}")
    if protocol == "paper":
        if stop_after_empty not in (None, 0):
            raise InputError(f"--protocol paper propagates over the whole volume; drop --stop-after-empty "
                             f"{stop_after_empty} (or use the product's protocol)")
        if split != "test":
            raise InputError(f"--protocol paper evaluates the test split, not {split!r}")
        stop_after_empty = 0
    shard = parse_shard(shard)  # I counts from 1; a bad one (0/N included) is one line, before anything runs
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InputError(f"--limit must be a whole number ≥ 1, got {limit!r}")
    from medvolcore.devices import resolve_device

    resolve_device(device)  # a device that is not there is refused now, not when the first case needs it
    data_dir = Path(data).expanduser().resolve()
    if stop_after_empty is None:
        from medvolcore.propagation import DEFAULT_STOP_AFTER_EMPTY

        stop_after_empty = DEFAULT_STOP_AFTER_EMPTY
    settings = resolve_settings(data_dir, split, oracle, preset, adapter, sam_checkpoint, random_weights,
                                sam_image_size, constrain, stop_after_empty)
    samples = _split_samples(data_dir, split, limit)
    fingerprint = settings.fingerprint()
    _check_out_dir(out_dir, settings, fingerprint, overwrite)
    label, smoke = method_label(settings)
    if smoke:
        log.warning("%s: %s", label, SMOKE_TEXT[0].lower() + SMOKE_TEXT[1:])
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "settings.json", {"schema": SCHEMA, "fingerprint": fingerprint,
                                           "settings": asdict(settings), "limit": limit, "method": label})

    mine = shard_of(samples, shard)
    if not mine:
        log.warning("shard %s has no samples (the split has %d)", shard_text(shard), len(samples))
    engine = _Engine(settings, device)
    keeper = _EvalCase(out_dir, fingerprint, engine, keep=("ok",) if retry_failed else ("ok", "failed"),
                       redo=overwrite, save_masks=save_masks)
    plan = plan_run(mine, keeper)
    display = RunProgress("evaluate" + (f" {shard_text(shard)}" if shard and shard[1] > 1 else ""), len(mine),
                          STATUSES, ((rec.get("row") or {}).get("status") for rec in plan.done_before.values()),
                          enabled=progress, note=_progress_note)
    try:
        # the models load once, only when a case must run; a model that cannot load stops the run there
        outcome = run_cases(plan.to_run, keeper, load=engine.load, display=display)
    except BaseException:
        if keeper.recorded:  # what finished is in the tables, also after an interruption
            try:
                aggregate(samples, out_dir, settings, fingerprint)
            except Exception:  # noqa: BLE001 — the original problem is the one to report
                log.debug("aggregation after an interruption failed", exc_info=True)
        raise
    summary = aggregate(samples, out_dir, settings, fingerprint)
    summary["run"] = {"evaluated": len(plan.to_run), "resumed": len(plan.done_before),
                      "shard": shard_text(shard or (1, 1)), "shard_cases": len(mine),
                      **status_counts(outcome.rows, STATUSES), "device": engine.device,
                      "seconds": time.perf_counter() - t_start}
    return summary


def _progress_note(row: dict) -> str:
    if row["status"] != "ok":
        return ""
    if row["target_absent"]:
        return "absent target: answered " + ("[]" if row["answer_absent"] else "boxes")
    return f"DSC {row['dsc_pct']:.1f}"


def format_result(summary: dict, out_dir) -> str:
    """The lines ``medvol-train evaluate`` prints."""
    run = summary.get("run") or {}
    header, line = table_row(summary)
    lines = []
    if run.get("shard") is not None:
        lines.append(f"shard {run['shard']}: {run.get('evaluated', 0)} case(s) evaluated "
                     f"({run.get('ok', 0)} ok, {run.get('failed', 0)} failed, {run.get('error', 0)} errors), "
                     f"{run.get('resumed', 0)} already done, in {run.get('seconds', 0.0):.1f} s")
    if summary["smoke"]:
        lines.append(SMOKE_TEXT)
    lines += [f"{h}: {v}" for h, v in zip(header, line)]
    if summary["cases_pending"]:
        lines.append(f"partial: {summary['cases_pending']} of {summary['cases_in_split']} case(s) not evaluated yet")
    lines.append(f"written: {Path(out_dir) / 'table.md'}, table.csv, cases.csv, summary.json")
    return "\n".join(lines)


__all__ = ["EvalSettings", "evaluate", "evaluate_case", "score_case", "score_negative", "existence", "aggregate",
           "dataset_name", "protocol_of", "PROTOCOLS", "case_key", "method_label", "format_result", "table_row", "SMOKE_TEXT",
           "EXISTENCE_COLUMNS"]
