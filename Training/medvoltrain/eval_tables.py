"""The tables of ``medvol-train evaluate``, made from its case files: ``cases.csv``, ``table.md``,
``table.csv`` (Table 1's row, then the existence columns) and ``summary.json``. The rules (failed
cases as 0, errors left out, negatives scored for existence only, Average = the unweighted mean of
the per-dataset means) are in :mod:`medvoltrain.evaluate`'s docstring."""

from __future__ import annotations

import csv
import io
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from medvolcore.caseruns import mean_median, read_record

from .adapter import record_evaluation
from .eval_settings import (PAPER_DATASETS, SCHEMA, SMOKE_TEXT, EvalSettings, case_key, dataset_name, method_label,
                            protocol_of, write_json)

STATUSES = ("ok", "failed", "error")  # of a case row (see the module docstring)
CASE_COLUMNS = ("id", "case_id", "dataset", "dataset_name", "label", "status", "dsc_pct", "iou_pct", "hit",
                "axial_score", "box_iou", "pred_slice", "gt_slice", "n_boxes", "pred_voxels", "gt_voxels",
                "seconds", "target_absent", "answer_absent", "query", "error")
# the extra columns after the paper's (existence: is the target there?)
EXISTENCE_COLUMNS = ("Existence acc. (%)", "FP rate, negatives (%)", "FN rate, positives (%)")
EXISTENCE_DEFINITION = ("existence accuracy: the answer is [] exactly when the target is absent, over every scored "
                        "case (a failed case is wrong); FP rate: negative cases answered with a slice and boxes; FN "
                        "rate: positive cases answered []; in %; negative cases are not scored for DSC, IoU, hit or "
                        "box IoU, and an absent answer on a positive case scores DSC = IoU = 0")
FAILURE_POLICY = ("failed cases (the model gave no usable answer) count as DSC = IoU = 0, a miss and box IoU 0; "
                  "cases that could not be evaluated (errors) are left out of every mean")


def _write_text(path: Path, text: str) -> None:
    from medvolcore.fileio import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text, overwrite=True)


def _mean(values) -> Optional[float]:
    return mean_median(values)[0]


def _flag(row: dict, key: str) -> bool:
    """A 0/1 column of a case row; absent (a case file from before the column existed) is 0."""
    v = row.get(key)
    return bool(int(v)) if v not in (None, "") else False


def existence(scored: List[dict]) -> dict:
    """Existence accuracy and the false-positive / false-negative rates (%) over scored case rows (ok
    and failed; see the module docstring)."""
    neg = [r for r in scored if _flag(r, "target_absent")]
    pos = [r for r in scored if not _flag(r, "target_absent")]

    def right(r):
        return r["status"] == "ok" and _flag(r, "answer_absent") == _flag(r, "target_absent")

    fp = sum(r["status"] == "ok" and not _flag(r, "answer_absent") for r in neg)
    fn = sum(r["status"] == "ok" and _flag(r, "answer_absent") for r in pos)
    return {"accuracy_pct": _mean(100.0 * right(r) for r in scored),
            "fp_rate_pct": 100.0 * fp / len(neg) if neg else None,
            "fn_rate_pct": 100.0 * fn / len(pos) if pos else None,
            "negatives": len(neg), "positives": len(pos), "false_positives": fp, "false_negatives": fn,
            "true_negatives": sum(right(r) for r in neg), "definition": EXISTENCE_DEFINITION}


def aggregate(samples: List[dict], out_dir: Path, settings: EvalSettings, fingerprint: str) -> dict:
    """Read every case file of the current settings and write cases.csv, table.md, table.csv and
    summary.json; returns the summary."""
    rows = []
    for s in samples:
        rec = read_record(out_dir / "cases" / f"{case_key(s['id'])}.json")
        if rec and rec.get("fingerprint") == fingerprint and isinstance(rec.get("row"), dict):
            rows.append(rec["row"])
    label, smoke = method_label(settings)
    scored_all = [r for r in rows if r["status"] in ("ok", "failed")]  # failed count as 0 (FAILURE_POLICY)
    # DSC, IoU, hit, axial and box are over positive cases only (a negative has no target to overlap)
    scored = [r for r in scored_all if not _flag(r, "target_absent")]
    ok = [r for r in scored if r["status"] == "ok"]

    def val(r, key):
        return float(r[key]) if r["status"] == "ok" else 0.0

    codes = sorted({r["dataset"] for r in rows},
                   key=lambda c: (PAPER_DATASETS.index(c) if c in PAPER_DATASETS else len(PAPER_DATASETS),
                                  c is None, str(c)))
    per_dataset = {}
    for c in codes:
        rs = [r for r in scored if r["dataset"] == c]
        rs_ok = [r for r in ok if r["dataset"] == c]
        per_dataset[dataset_name(c)] = {
            "code": c, "cases": len(rs), "failed": sum(r["status"] == "failed" for r in rs),
            "negatives": sum(1 for r in scored_all if r["dataset"] == c and _flag(r, "target_absent")),
            "errors": sum(r["status"] == "error" for r in rows if r["dataset"] == c),
            "dsc_pct": _mean(val(r, "dsc_pct") for r in rs), "iou_pct": _mean(val(r, "iou_pct") for r in rs),
            "dsc_pct_ok_only": _mean(float(r["dsc_pct"]) for r in rs_ok),
            "iou_pct_ok_only": _mean(float(r["iou_pct"]) for r in rs_ok),
        }
    ds_with_cases = [d for d in per_dataset.values() if d["cases"]]
    summary = {
        "schema": SCHEMA, "method": label, "smoke": smoke, "settings": asdict(settings), "fingerprint": fingerprint,
        "protocol": protocol_of(settings), "split": settings.split, "cases_in_split": len(samples), "cases_evaluated": len(rows),
        "cases_pending": len(samples) - len(rows), "cases_ok": sum(r["status"] == "ok" for r in rows),
        "cases_failed": sum(r["status"] == "failed" for r in rows),
        "cases_error": sum(r["status"] == "error" for r in rows),
        "failure_policy": FAILURE_POLICY,
        "per_dataset": per_dataset,
        "average": {"dsc_pct": _mean(d["dsc_pct"] for d in ds_with_cases),
                    "iou_pct": _mean(d["iou_pct"] for d in ds_with_cases),
                    "definition": "unweighted mean of the per-dataset means"},
        "all_cases": {"dsc_pct": _mean(val(r, "dsc_pct") for r in scored),
                      "iou_pct": _mean(val(r, "iou_pct") for r in scored)},
        "hit_rate_pct": _mean(100.0 * val(r, "hit") for r in scored),
        "box_iou": _mean(val(r, "box_iou") for r in scored),
        "axial_score": _mean(val(r, "axial_score") for r in scored),
        "ok_only": {"cases": len(ok), "dsc_pct": _mean(float(r["dsc_pct"]) for r in ok),
                    "iou_pct": _mean(float(r["iou_pct"]) for r in ok),
                    "hit_rate_pct": _mean(100.0 * float(r["hit"]) for r in ok),
                    "box_iou": _mean(float(r["box_iou"]) for r in ok)},
        "existence": existence(scored_all),
        "seconds_per_case": _mean(float(r["seconds"]) for r in rows if r.get("seconds") not in (None, "")),
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    _write_text(out_dir / "cases.csv", _cases_csv(rows))
    header, line = table_row(summary)
    _write_text(out_dir / "table.csv", _csv_text([header, line]))
    _write_text(out_dir / "table.md", table_markdown(summary, header, line))
    write_json(out_dir / "summary.json", summary)
    record_evaluation(settings.adapter, out_dir, summary, header, line)  # into a medvol-train adapter's card
    return summary


def _fmt(v, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _csv_text(rows: Sequence[Sequence]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for r in rows:
        w.writerow(r)
    return buf.getvalue()


def _cases_csv(rows: List[dict]) -> str:
    def cell(r, k):
        v = r.get(k, "")
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.4f}"
        return v

    return _csv_text([list(CASE_COLUMNS)] + [[cell(r, k) for k in CASE_COLUMNS] for r in rows])


def table_row(summary: dict) -> Tuple[List[str], List[str]]:
    """Header and the one row of Table 1 (DSC and IoU in % per dataset, average, hit rate, box IoU, cases),
    then the extra existence columns (:data:`EXISTENCE_COLUMNS`)."""
    header, line = ["Method"], [summary["method"]]
    for name, d in summary["per_dataset"].items():
        header += [f"{name} DSC", f"{name} IoU"]
        line += [_fmt(d["dsc_pct"]), _fmt(d["iou_pct"])]
    box = summary["box_iou"]
    header += ["Average DSC", "Average IoU", "Hit rate (%)", "Box IoU (%)", "Cases", "Failed", "Errors"]
    line += [_fmt(summary["average"]["dsc_pct"]), _fmt(summary["average"]["iou_pct"]), _fmt(summary["hit_rate_pct"]),
             _fmt(None if box is None else 100.0 * box), f"{summary['cases_evaluated']}/{summary['cases_in_split']}",
             str(summary["cases_failed"]), str(summary["cases_error"])]
    ex = summary.get("existence") or {}  # extra columns, after the paper's
    header += list(EXISTENCE_COLUMNS)
    line += [_fmt(ex.get("accuracy_pct")), _fmt(ex.get("fp_rate_pct")), _fmt(ex.get("fn_rate_pct"))]
    return header, line


def table_markdown(summary: dict, header: List[str], line: List[str]) -> str:
    s = summary
    out = [f"# Evaluation: {s['split']} split of {s['settings']['data']}", ""]
    if s["smoke"]:
        out += [f"**{SMOKE_TEXT}.**", ""]
    out += ["DSC and IoU in %, mean over cases (3-D masks on the canonical axial stack).", ""]
    out += ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
            "| " + " | ".join(c.replace("|", "\\|") for c in line) + " |", ""]
    k = s["settings"].get("stop_after_empty", 0)
    notes = [("Protocol: the paper's (Table 1): MedSAM2 propagates the anchor over the whole volume, test split."
              if s.get("protocol") == "paper" else
              "Protocol: not the paper's: " + (f"early stop (each direction ends once every mask has been empty on "
                                               f"{k} slices), as `medvol segment` does" if k else
                                               f"whole-volume propagation on the {s['split']} split")
              + "; `--protocol paper` gives the paper's Table 1 protocol."),
             f"Cases: {s['cases_evaluated']} of {s['cases_in_split']} in the split evaluated — {s['cases_ok']} ok, "
             f"{s['cases_failed']} failed, {s['cases_error']} errors."]
    if s["cases_pending"]:
        notes.append(f"**Partial:** {s['cases_pending']} case(s) not evaluated yet (other shards, --limit, or an "
                     "interrupted run); run them into this folder, then `--aggregate-only`.")
    notes.append("Failed cases (the model gave no usable answer) count as DSC = IoU = 0, a key-slice miss and box "
                 "IoU 0; errors (the case could not be evaluated) are left out of every mean and retried by the "
                 "next run; see cases.csv.")
    notes.append("Average: the unweighted mean of the per-dataset means. Hit rate: the predicted key slice holds "
                 "target foreground. Box IoU: Hungarian-matched IoU of the predicted boxes with the ground-truth "
                 "boxes of the predicted slice (the box reward), in %.")
    ex = s.get("existence") or {}
    notes.append(f"Extra columns (not in the paper): existence accuracy over all "
                 f"{ex.get('positives', 0) + ex.get('negatives', 0)} scored case(s), {ex.get('negatives', 0)} of them "
                 "negative (the target is not in the volume); the "
                 "false-positive rate is over the negative cases (a slice and boxes answered), the false-negative "
                 "rate over the positive ones ([] answered). Negative cases are not in DSC, IoU, hit rate or box "
                 "IoU; an absent answer on a positive case counts as DSC = IoU = 0 there.")
    if s["settings"]["oracle"]:
        notes.append("Oracle anchor: MedSAM2 is given the ground-truth anchor (largest-area slice, its "
                     "connected-component boxes), so hit rate and box IoU are 100 by construction and DSC is the "
                     "propagation's upper bound.")
    ok = s["ok_only"]
    n_ok = ok.get("cases", s["cases_ok"])
    notes.append(f"Over the {n_ok} successful {'positive ' if ex.get('negatives') else ''}case(s) only: "
                 f"DSC {_fmt(ok['dsc_pct'])}, IoU {_fmt(ok['iou_pct'])}.")
    out += [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


__all__ = ["STATUSES", "CASE_COLUMNS", "EXISTENCE_COLUMNS", "EXISTENCE_DEFINITION", "FAILURE_POLICY", "existence",
           "aggregate", "table_row", "table_markdown"]
