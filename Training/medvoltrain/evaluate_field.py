"""``medvol-train evaluate --protocol cvpr25|rexgrounding|medvol-r1`` and ``predict-cvpr25``: the
pipeline on data in the CVPR 2025 challenge layout (:mod:`medvoltrain.challenge`), scored as the
field scores (:mod:`medvoltrain.fieldmetrics`).

Per case ``DIR/imgs/<case>.npz`` every prompt is a query; all the prompts of a case run as one job
(:meth:`medvolcore.pipeline.Pipeline.segment_queries`: the slices rendered and encoded once). A
prompt answered "not present" leaves its label out; where two prompts' masks overlap, the smaller
class id keeps the voxel. Outputs in ``OUT``::

    settings.json           the settings and their fingerprint (an OUT holds one evaluation)
    segs/<case>.npz         the prediction as the challenge wants it (``segs``, uint8, image shape)
    masks/<case>.npz        each prompt's own mask (bool, key: its class id), before overlaps
    cases/<case>.json       one finished case (the resume marker): seconds, answers, status
    metrics.csv             CVPR 2025's columns: CaseName, RunningTime, DSC, NSD, F1, DSC_TP
    prompts.csv             one row per prompt: voxels, the CVPR Dice and NSD (of segs), MedVol-R1's
                            Dice and IoU (of its own mask), absent target, refusal, false-positive mL
    report.md, report.json  every protocol's summary and the absent-target suite; the chosen
                            protocol first

The CVPR numbers are those of ``segs`` (what the challenge scores); MedVol-R1's, ReXGroundingCT's
and the absent-target suite's are those of each prompt's own mask, as a user asking that one
question gets it (a query is answered alone there).

``RunningTime`` is this process's inference time for the case (the official script times the whole
container, loading included). Every protocol scores the same segs; ``--protocol`` chooses which
leads the report. The **absent-target suite** is every prompt whose class has no voxel in ``gts``
(the CVPR script does not score them at all). Resume and shards are :func:`medvolcore.caseruns.run_cases`'s;
every run rebuilds the tables from all finished cases. ``--control blank`` replaces every image by
a constant volume (the images removed): the control a claim of learning needs beside its number.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from medvolcore.caseruns import (RunProgress, input_state, one_line, parse_shard, plan_run, read_record, run_cases,
                                 shard_of, shard_text, status_counts)
from medvolcore.errors import InputError, OutputExistsError
from medvolcore.fileio import write_text_atomic

from . import challenge, fieldmetrics
from .errors import DataError

log = logging.getLogger(__name__)

FIELD_PROTOCOLS = ("cvpr25", "rexgrounding", "medvol-r1")
CONTROLS = ("none", "blank")
SCHEMA = "medvol.train.field-evaluation/1"
FIELD_VERSION = 1  # bump when the segs of the same settings would change
METRIC_COLUMNS = ["CaseName", "RunningTime", "DSC", "NSD", "F1", "DSC_TP"]
PROMPT_COLUMNS = ["CaseName", "class_id", "prompt", "gt_voxels", "mask_voxels", "segs_voxels", "absent_target",
                  "answered_absent", "cvpr_dice", "cvpr_nsd", "r1_dice", "r1_iou", "fp_voxels", "fp_ml"]
SMOKE_TEXT = "Smoke model (tiny and/or random MedSAM2): numbers are meaningless"


@dataclass(frozen=True)
class FieldSettings:
    data: str
    preset: Optional[str] = None
    adapter: Optional[str] = None
    sam: str = "preset"  # "preset", "checkpoint:<path>", "random:<seed>:<size>"
    constrain: bool = True
    stop_after_empty: int = 0
    control: str = "none"
    version: int = FIELD_VERSION

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def _sam_spec(sam_checkpoint, random_weights, sam_image_size) -> str:
    if sam_checkpoint is not None:
        return f"checkpoint:{Path(sam_checkpoint).expanduser().resolve()}"
    if random_weights is not None:
        return f"random:{int(random_weights)}:{int(sam_image_size or 512)}"
    return "preset"


def _is_smoke(settings: FieldSettings) -> bool:
    from medvolcore import models

    return settings.sam.startswith("random:") or bool(models.resolve(settings.preset, require_adapter=False).smoke)


class FieldEngine:
    """The pipeline of the settings, loaded once and only when a case needs it."""

    def __init__(self, settings: FieldSettings, device: str):
        self.settings, self.device_arg = settings, device
        self.pipeline = None
        self.device = None

    def load(self) -> "FieldEngine":
        if self.pipeline is None:
            from medvolcore.devices import resolve_device
            from medvolcore.pipeline import Pipeline

            from .evaluate import _build_propagator

            self.device = str(resolve_device(self.device_arg))
            prop = _build_propagator(self.settings, self.device)
            self.pipeline = Pipeline(self.settings.preset, adapter=self.settings.adapter, device=self.device,
                                     propagator=prop, stop_after_empty=self.settings.stop_after_empty)
            self.pipeline.grounder  # noqa: B018 — a model problem stops the run, not every case
        return self

    def segment(self, image: challenge.ChallengeImage, progress=None):
        """``(segs, answers, masks)``: the uint8 label map of every prompt's mask; per class id (a
        string) what the model answered (``slice``: the key slice, None for "not present"); per class
        id (an int) the prompt's own mask, before overlaps are resolved."""
        self.load()
        if self.settings.control == "blank":
            image = challenge.ChallengeImage(image.name, np.full(image.imgs.shape, float(np.min(image.imgs)),
                                                                 np.float32), image.spacing, image.prompts,
                                             image.instance)
        ids = sorted(image.prompts)
        segs = self.pipeline.segment_queries(challenge.volume_of(image), [image.prompts[i] for i in ids],
                                             constrain=self.settings.constrain, progress=progress)
        out = np.zeros(image.imgs.shape, np.uint8)
        answers, masks = {}, {}
        for cid, seg in zip(ids, segs):
            own = np.asarray(seg.mask) != 0
            answers[str(cid)] = {"slice": None if seg.anchor.absent else int(seg.anchor.slice)}
            masks[cid] = own
            out[own & (out == 0)] = cid
        return out, answers, masks


class _FieldCase:
    """A challenge case to :func:`medvolcore.caseruns.run_cases`: its segs, then its record."""

    def __init__(self, out_dir: Path, fingerprint: str, engine: FieldEngine, redo: bool):
        self.out_dir, self.fingerprint, self.engine, self.redo = out_dir, fingerprint, engine, redo

    def name(self, path: Path) -> str:
        return path.name

    def _record_path(self, path: Path) -> Path:
        return self.out_dir / "cases" / (path.name[:-4] + ".json")

    def previous(self, path: Path) -> Optional[dict]:
        if self.redo:
            return None
        rec = read_record(self._record_path(path))
        if (rec is None or rec.get("fingerprint") != self.fingerprint or rec.get("input") != input_state(path)
                or rec.get("status") != "ok" or not (self.out_dir / "segs" / path.name).is_file()
                or not (self.out_dir / "masks" / path.name).is_file()):
            return None
        return rec

    def run(self, path: Path, progress) -> dict:
        image = challenge.read_image(path)
        t0 = time.perf_counter()
        segs, answers, masks = self.engine.segment(image, progress)
        seconds = time.perf_counter() - t0
        challenge.write_segs(self.out_dir / "segs" / path.name, segs)
        write_masks(self.out_dir / "masks" / path.name, masks)
        return self._record(path, {"status": "ok", "seconds": seconds, "answers": answers})

    def failed(self, path: Path, error: Exception, seconds: float) -> dict:
        msg = one_line(str(error))[:300]
        log.warning("case %s could not be segmented: %s: %s", path.name, type(error).__name__, msg)
        return self._record(path, {"status": "error", "seconds": seconds, "error": f"{type(error).__name__}: {msg}"})

    def _record(self, path: Path, row: dict) -> dict:
        from medvolcore.caseruns import write_record

        row = {"schema": SCHEMA, "fingerprint": self.fingerprint, "case": path.name, "input": input_state(path), **row}
        write_record(self._record_path(path), row)
        return row


# ---- scoring --------------------------------------------------------------------------------------------

def write_masks(path: Path, masks: Dict[int, np.ndarray]) -> Path:
    """Each prompt's own mask (bool), keyed by its class id, atomically."""
    from medvolcore.fileio import atomic_path

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, overwrite=True) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **{str(k): np.asarray(v, bool) for k, v in masks.items()})
    return path


def read_masks(path: Path) -> Dict[int, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {int(k): z[k] for k in z.files}


def score_case(image: challenge.ChallengeImage, gts: np.ndarray, segs: np.ndarray,
               masks: Optional[Dict[int, np.ndarray]] = None, answers: Optional[dict] = None) -> dict:
    """Every protocol's numbers for one case: the CVPR row (of ``segs``), the per-prompt rows, the
    ReXGroundingCT findings (prompts with ground truth) and the absent-target rows (prompts
    without). ``masks``: each prompt's own mask (MedVol-R1, ReXGroundingCT and the absent targets are
    scored on it); a prompt without one is scored on its label in ``segs``. ``answers``: the model's
    (:meth:`FieldEngine.segment`), for the ``answered_absent`` column."""
    masks, answers = masks or {}, answers or {}
    gt8, seg8 = np.asarray(gts).astype(np.uint8), np.asarray(segs).astype(np.uint8)
    cvpr = fieldmetrics.cvpr25_case(gt8, seg8, image.spacing, image.prompts, image.instance)
    prompts, findings, absent = [], [], []
    for cid in sorted(image.prompts):
        g, in_segs = gt8 == cid, seg8 == cid
        own = np.asarray(masks[cid], bool) if cid in masks else in_segs
        if own.shape != g.shape:
            raise DataError(f"{image.name}: the mask of class {cid} is {own.shape}, the image {g.shape}")
        r1 = fieldmetrics.medvol_r1_prompt(g, own)
        answer = answers.get(str(cid))
        row = {"CaseName": image.name, "class_id": cid, "prompt": image.prompts[cid], "gt_voxels": int(g.sum()),
               "mask_voxels": int(own.sum()), "segs_voxels": int(in_segs.sum()), "absent_target": int(not g.any()),
               "answered_absent": "" if not isinstance(answer, dict) else int(answer.get("slice") is None),
               "cvpr_dice": fieldmetrics.dice_nan(g, in_segs), "cvpr_nsd": fieldmetrics.nsd(g, in_segs, image.spacing),
               "r1_dice": r1["dice"], "r1_iou": r1["iou"], "fp_voxels": "", "fp_ml": ""}
        if g.any():
            if not image.instance:
                findings.append(fieldmetrics.finding_counts(g, own))
        else:
            a = fieldmetrics.absent_prompt(own, image.spacing)
            absent.append(a)
            row.update(fp_voxels=a["fp_voxels"], fp_ml=a["fp_ml"])
        prompts.append(row)
    return {"cvpr": cvpr, "prompts": prompts, "findings": findings, "absent": absent}


def _nanmean(values) -> float:
    v = [float(x) for x in values if x is not None and x != "" and math.isfinite(float(x))]
    return float(np.mean(v)) if v else float("nan")


def _fmt(v) -> str:
    if isinstance(v, float):
        return "NaN" if not math.isfinite(v) else f"{v:.4f}"
    return str(v)


def _csv(rows: List[dict], columns: List[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        # NaN as an empty cell, as the official script's pandas writes it
        w.writerow({k: (("" if not math.isfinite(v) else repr(v)) if isinstance(v, float) else v)
                    for k, v in r.items()})
    return buf.getvalue()


def aggregate(data_dir: Path, out_dir: Path, files: List[Path], fingerprint: str, protocol: str,
              smoke: bool, method: str) -> dict:
    """Rebuild metrics.csv, prompts.csv and the report from every finished case of ``fingerprint``."""
    metric_rows, prompt_rows, findings, absent, r1_cases = [], [], [], [], []
    errors = pending = 0
    for path in files:
        rec = read_record(out_dir / "cases" / (path.name[:-4] + ".json"))
        if rec is None or rec.get("fingerprint") != fingerprint:
            pending += 1
            continue
        if rec.get("status") != "ok":
            errors += 1
            metric_rows.append({"CaseName": path.name, "RunningTime": rec.get("seconds", float("nan")),
                                **{k: float("nan") for k in METRIC_COLUMNS[2:]}})
            continue
        image = challenge.read_image(path)
        gts = challenge.read_gts(data_dir / "gts" / path.name, image.imgs.shape)
        mask_path = out_dir / "masks" / path.name
        s = score_case(image, gts, challenge.read_segs(out_dir / "segs" / path.name),
                       read_masks(mask_path) if mask_path.is_file() else None, rec.get("answers"))
        metric_rows.append({"CaseName": path.name, "RunningTime": round(float(rec["seconds"]), 4), **s["cvpr"]})
        prompt_rows += s["prompts"]
        findings += s["findings"]
        absent += s["absent"]
        r1_cases.append(_nanmean(r["r1_dice"] for r in s["prompts"]))
    semantic = [r for r in metric_rows if math.isfinite(r.get("DSC", float("nan")))]
    summary = {
        "protocol": protocol, "method": method, "smoke": smoke,
        "cases": len(files), "cases_scored": len(metric_rows) - errors, "cases_error": errors,
        "cases_pending": pending,
        "cvpr25": {"DSC": _nanmean(r["DSC"] for r in metric_rows), "NSD": _nanmean(r["NSD"] for r in metric_rows),
                   "F1": _nanmean(r["F1"] for r in metric_rows), "DSC_TP": _nanmean(r["DSC_TP"] for r in metric_rows),
                   "semantic_cases_with_a_score": len(semantic),
                   "textbook_DSC_all_prompts": _nanmean(r.get("DSC_all_prompts") for r in metric_rows),
                   "textbook_F1": _nanmean(r.get("F1_textbook") for r in metric_rows)},
        "rexgrounding": fieldmetrics.rexgrounding_summary(findings),
        "medvol-r1": {"dice_mean_of_cases": _nanmean(r1_cases),
                      "dice_mean_of_prompts": _nanmean(r["r1_dice"] for r in prompt_rows),
                      "iou_mean_of_prompts": _nanmean(r["r1_iou"] for r in prompt_rows)},
        "absent_targets": fieldmetrics.absent_summary(absent),
    }
    write_text_atomic(out_dir / "metrics.csv", _csv(metric_rows, METRIC_COLUMNS), overwrite=True)
    write_text_atomic(out_dir / "prompts.csv", _csv(prompt_rows, PROMPT_COLUMNS), overwrite=True)
    write_text_atomic(out_dir / "report.json", json.dumps(summary, indent=1, default=_json_default) + "\n",
                      overwrite=True)
    write_text_atomic(out_dir / "report.md", report_markdown(summary), overwrite=True)
    return summary


def _json_default(v):
    return None if isinstance(v, float) and not math.isfinite(v) else float(v)


def _section(name: str, summary: dict) -> List[str]:
    if name == "cvpr25":
        c = summary["cvpr25"]
        return [f"## cvpr25 — {fieldmetrics.PROTOCOL_NOTES['cvpr25']}", "",
                "| DSC | NSD (2 mm) | F1 (IoU ≥ 0.5) | DSC_TP |", "|---|---|---|---|",
                f"| {_fmt(c['DSC'])} | {_fmt(c['NSD'])} | {_fmt(c['F1'])} | {_fmt(c['DSC_TP'])} |", "",
                f"Means over cases with a score (the official script gives NaN to a semantic case whose prompted "
                f"classes are all absent). Textbook choices, named: DSC over every prompt, two empty masks = 1.0: "
                f"{_fmt(c['textbook_DSC_all_prompts'])}; instance F1 counting missed instances when nothing was "
                f"predicted, NaN when nothing on either side: {_fmt(c['textbook_F1'])}.", ""]
    if name == "rexgrounding":
        r = summary["rexgrounding"]
        return [f"## rexgrounding — {fieldmetrics.PROTOCOL_NOTES['rexgrounding']}", "",
                "| findings | global Dice | hit rate | inst. precision | inst. recall | inst. F1 |",
                "|---|---|---|---|---|---|",
                f"| {r['findings']} | {_fmt(r['global_dice'])} | {_fmt(r['hit_rate'])} | "
                f"{_fmt(r['instance_precision'])} | {_fmt(r['instance_recall'])} | {_fmt(r['instance_f1'])} |", "",
                f"Global Dice is the mean Dice of the findings (ReXrank's definition). Beside it, named: the Dice "
                f"of the voxels pooled over every finding {_fmt(r['pooled_dice'])}.", ""]
    m = summary["medvol-r1"]
    return [f"## medvol-r1 — {fieldmetrics.PROTOCOL_NOTES['medvol-r1']}", "",
            "| Dice (mean of cases) | Dice (mean of prompts) | IoU (mean of prompts) |", "|---|---|---|",
            f"| {_fmt(m['dice_mean_of_cases'])} | {_fmt(m['dice_mean_of_prompts'])} | "
            f"{_fmt(m['iou_mean_of_prompts'])} |", ""]


def report_markdown(summary: dict) -> str:
    lines = [f"# Evaluation ({summary['protocol']}): {summary['method']}", ""]
    if summary["smoke"]:
        lines += [f"**{SMOKE_TEXT}.**", ""]
    lines += [f"{summary['cases_scored']} of {summary['cases']} case(s) scored, {summary['cases_error']} error(s), "
              f"{summary['cases_pending']} pending.", ""]
    order = [summary["protocol"]] + [p for p in FIELD_PROTOCOLS if p != summary["protocol"]]
    for name in order:
        lines += _section(name, summary)
    a = summary["absent_targets"]
    lines += ["## Absent targets (prompts whose structure has no voxel in the ground truth)", "",
              "| prompts | refusal rate | FP voxels (mean) | FP mL (mean) | FP mL (total) | Dice, empty = 1.0 | "
              "Dice, empty = NaN |", "|---|---|---|---|---|---|---|",
              f"| {a['prompts']} | {_fmt(a['refusal_rate'])} | {_fmt(a['fp_voxels_mean'])} | {_fmt(a['fp_ml_mean'])} "
              f"| {_fmt(a['fp_ml_total'])} | {_fmt(a['dice_empty_is_one'])} | {_fmt(a['dice_empty_is_nan'])} "
              f"(over {a['scored_under_nan']}) |", "",
              "Under the CVPR script's convention a refusal is not scored (NaN) and these prompts never enter DSC; "
              "under MedVol-R1's a refusal is Dice 1.0 and any predicted voxel makes it 0.", ""]
    return "\n".join(lines)


# ---- the commands --------------------------------------------------------------------------------------

def _check_out(out_dir: Path, inputs: Path, fingerprint: str, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--out {out_dir} exists and is not a folder")
    resolved = out_dir.resolve()
    if resolved == inputs.resolve() or inputs.resolve() in resolved.parents:
        raise InputError(f"--out {out_dir} lies inside the input folder {inputs}; write elsewhere")
    prev = read_record(out_dir / "settings.json")
    if prev is not None and prev.get("fingerprint") != fingerprint and not overwrite:
        raise OutputExistsError(f"{out_dir} holds an evaluation with other settings; use another --out, or pass "
                                "--overwrite to redo it with these settings")
    if prev is None and out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out_dir} is not empty and holds no evaluation (no settings.json); use another "
                                "--out, or pass --overwrite to write into it")


def _settings(data: Path, preset, adapter, sam_checkpoint, random_weights, sam_image_size, constrain,
              stop_after_empty, control) -> FieldSettings:
    from medvolcore import models

    if control not in CONTROLS:
        raise InputError(f"unknown control {control!r}: use {' or '.join(CONTROLS)}")
    resolved = models.resolve(preset, adapter=adapter)  # an unknown preset or adapter is one line, before any case
    return FieldSettings(data=str(data), preset=resolved.name,
                         adapter=None if adapter is None else str(Path(adapter).expanduser().resolve()),
                         sam=_sam_spec(sam_checkpoint, random_weights, sam_image_size), constrain=constrain,
                         stop_after_empty=0 if stop_after_empty is None else int(stop_after_empty), control=control)


def evaluate_field(data, out, protocol: str, *, preset=None, adapter=None, sam_checkpoint=None,
                   random_weights: Optional[int] = None, sam_image_size: Optional[int] = None, device: str = "auto",
                   shard=None, limit: Optional[int] = None, constrain: bool = True, overwrite: bool = False,
                   progress: bool = True, stop_after_empty: Optional[int] = None, control: str = "none") -> dict:
    """Segment every case of ``data`` (the challenge layout) into ``out`` and score it (module docstring).
    ``stop_after_empty`` defaults to 0 (the whole volume)."""
    if protocol not in FIELD_PROTOCOLS:
        raise InputError(f"unknown protocol {protocol!r}: use {' or '.join(FIELD_PROTOCOLS)}")
    t_start = time.perf_counter()
    data_dir = Path(data).expanduser().resolve()
    if not (data_dir / "imgs").is_dir() or not (data_dir / "gts").is_dir():
        raise DataError(f"{data_dir} is not in the challenge layout (it needs imgs/ and gts/)")
    files = challenge.case_files(data_dir / "imgs")
    missing = [p.name for p in files if not (data_dir / "gts" / p.name).is_file()]
    if missing:
        raise DataError(f"{data_dir / 'gts'} lacks the ground truth of {len(missing)} case(s), e.g. {missing[0]}")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InputError(f"--limit must be a whole number ≥ 1, got {limit!r}")
        files = files[:limit]
    shard = parse_shard(shard)
    from medvolcore.devices import resolve_device

    resolve_device(device)
    settings = _settings(data_dir, preset, adapter, sam_checkpoint, random_weights, sam_image_size, constrain,
                         stop_after_empty, control)
    fingerprint = settings.fingerprint()
    out_dir = Path(out).expanduser()
    _check_out(out_dir, data_dir, fingerprint, overwrite)
    smoke = _is_smoke(settings)
    method = f"{settings.preset}{' + adapter' if settings.adapter else ''} → MedSAM2 ({settings.sam})" + (
        ", control: images removed" if control == "blank" else "")
    if smoke:
        log.warning("%s: %s", method, SMOKE_TEXT[0].lower() + SMOKE_TEXT[1:])
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "settings.json", json.dumps(
        {"schema": SCHEMA, "fingerprint": fingerprint, "settings": asdict(settings), "method": method}, indent=1)
        + "\n", overwrite=True)
    mine = shard_of(files, shard)
    engine = FieldEngine(settings, device)
    keeper = _FieldCase(out_dir, fingerprint, engine, redo=overwrite)
    plan = plan_run(mine, keeper)
    display = RunProgress(f"evaluate {protocol}", len(mine), ("ok", "error"),
                          (rec.get("status") for rec in plan.done_before.values()), enabled=progress)
    outcome = run_cases(plan.to_run, keeper, load=engine.load, display=display)
    summary = aggregate(data_dir, out_dir, files, fingerprint, protocol, smoke, method)
    summary["run"] = {"evaluated": len(plan.to_run), "resumed": len(plan.done_before),
                      "shard": shard_text(shard or (1, 1)), **status_counts(outcome.rows, ("ok", "error")),
                      "seconds": time.perf_counter() - t_start}
    return summary


def format_field_result(summary: dict, out_dir) -> str:
    run = summary.get("run") or {}
    lines = [f"shard {run.get('shard')}: {run.get('evaluated', 0)} case(s) segmented ({run.get('error', 0)} errors), "
             f"{run.get('resumed', 0)} already done"]
    if summary["smoke"]:
        lines.append(SMOKE_TEXT)
    p = summary["protocol"]
    key = {"cvpr25": ("DSC", "NSD", "F1"), "rexgrounding": ("global_dice", "hit_rate", "instance_f1"),
           "medvol-r1": ("dice_mean_of_cases", "iou_mean_of_prompts")}[p]
    lines.append(f"{p}: " + ", ".join(f"{k} {_fmt(summary[p][k])}" for k in key))
    a = summary["absent_targets"]
    lines.append(f"absent targets: {a['prompts']} prompt(s), refusal rate {_fmt(a['refusal_rate'])}, "
                 f"false positives {_fmt(a['fp_ml_mean'])} mL on average")
    lines.append(f"written: {Path(out_dir) / 'metrics.csv'}, prompts.csv, report.md, report.json, segs/")
    return "\n".join(lines)


def predict_folder(inputs, outputs, *, preset=None, adapter=None, sam_checkpoint=None,
                   random_weights: Optional[int] = None, sam_image_size: Optional[int] = None, device: str = "auto",
                   constrain: bool = True, stop_after_empty: Optional[int] = None, overwrite: bool = False) -> Dict:
    """What a challenge container runs: ``OUTPUTS/<case>.npz`` (``segs`` only) for every npz in
    ``INPUTS``. An existing output is refused unless ``overwrite``; a case that fails is reported
    and the others still run. Returns ``{"written": [...], "failed": {name: error}}``."""
    in_dir, out_dir = Path(inputs).expanduser(), Path(outputs).expanduser()
    files = challenge.case_files(in_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir} exists and is not a folder")
    if out_dir.resolve() == in_dir.resolve():
        raise InputError("OUTPUTS must not be the INPUTS folder: the segs would replace the images")
    clash = [p.name for p in files if (out_dir / p.name).exists()]
    if clash and not overwrite:
        raise OutputExistsError(f"{out_dir} already holds {len(clash)} of the outputs (e.g. {clash[0]}); pass "
                                "--overwrite to replace them")
    from medvolcore.devices import resolve_device

    resolve_device(device)
    settings = _settings(in_dir.resolve(), preset, adapter, sam_checkpoint, random_weights, sam_image_size, constrain,
                         stop_after_empty, "none")
    if _is_smoke(settings):
        log.warning("%s", SMOKE_TEXT)
    engine = FieldEngine(settings, device).load()
    written, failed = [], {}
    for path in files:
        try:
            segs, _, _ = engine.segment(challenge.read_image(path))
            challenge.write_segs(out_dir / path.name, segs)
            written.append(path.name)
        except Exception as e:  # noqa: BLE001 — one case's failure must not stop the others
            failed[path.name] = f"{type(e).__name__}: {one_line(str(e))[:300]}"
            log.warning("%s: %s", path.name, failed[path.name])
    return {"written": written, "failed": failed}
