"""The summaries of ``medvol batch``, rendered from the cases' rows: ``summary.csv`` (one row per
case, then the aggregate rows ``summary.mean`` and ``summary.median``) and ``summary.html``.

The rule (:func:`aggregate`): each column of :data:`AGGREGATED` is the mean / median of that column
over the *finished* cases (status ``done`` or ``absent``) that have a value in it
(:func:`medvolcore.caseruns.column_stats`); failed and invalid cases never count. Details in
:mod:`medvolcore.batch`.
"""

from __future__ import annotations

import csv
import html
import io
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple
from urllib.parse import quote

from .. import RESEARCH_USE_NOTICE
from ..caseruns import column_stats, finite, status_counts
from ..fileio import write_text_atomic
from ..models.identity import identity_note
from ..stats import COLUMNS as _STATS_COLUMNS
from ..stats import spreadsheet_rows, stats_cell
from .case import AGREEMENT, FINISHED, INVALID, STATUSES

CASE_COLUMNS = ("id", "status", "error", "slice", "boxes", "seconds", "dice", "iou", "confidence")
# the target's statistics (medvolcore.stats) after them, less the query (the manifest's) and key_slice (``slice``)
STATS_COLUMNS = tuple(c for c in _STATS_COLUMNS if c not in ("query", "key_slice"))
SUMMARY_COLUMNS = CASE_COLUMNS + STATS_COLUMNS
# the aggregate rows' ids: check_case_id refuses ids starting with "summary.", so no case has them
AGGREGATE_IDS = ("summary.mean", "summary.median")
AGGREGATED = ("seconds", "dice", "iou", "confidence", "voxels", "volume_ml")  # over finished cases with a value
_DIGITS = {"seconds": 2, "dice": 4, "iou": 4, "confidence": 3, "voxels": 1, "volume_ml": 3}  # in the CSV and page


def _fmt(v, digits: Optional[int] = None) -> str:
    if v is None or v == "":
        return ""
    if digits is not None and isinstance(v, (int, float)):
        return f"{float(v):.{digits}f}"
    return str(v)


def summary_csv_rows(rows: Sequence[dict]) -> List[List[str]]:
    """The cases' cells, in :data:`SUMMARY_COLUMNS` order (no aggregate rows)."""
    out = []
    for r in rows:
        st = r.get("stats") or {}
        out.append([r["id"], r["status"], r["error"] or "", _fmt(r["slice"]), _fmt(r["boxes"]),
                    _fmt(r["seconds"], _DIGITS["seconds"]), _fmt(r["dice"], _DIGITS["dice"]),
                    _fmt(r["iou"], _DIGITS["iou"]), _fmt(r.get("confidence"), _DIGITS["confidence"])]
                   + [stats_cell(st.get(c)) for c in STATS_COLUMNS])
    return out


def _column_value(r: dict, column: str):
    return (r.get("stats") or {}).get(column) if column in STATS_COLUMNS else r.get(column)


def aggregate(rows: Sequence[dict]) -> dict:
    """The run's aggregates (the module docstring's rule): the counts by status, ``finished``
    (done + absent), ``scored`` (finished cases with a Dice), and for each column of
    :data:`AGGREGATED` its ``<column>_mean`` and ``<column>_median`` over the finished cases with
    a value (None when there is none) and, in ``counts``, how many cases that was. Unrounded."""
    finished = [r for r in rows if r["status"] in FINISHED]
    agg = {"cases": len(rows), **status_counts(rows, STATUSES), "finished": len(finished)}
    counts = {}
    for column, s in column_stats(finished, AGGREGATED, _column_value).items():
        counts[column] = s["n"]
        agg[f"{column}_mean"], agg[f"{column}_median"] = s["mean"], s["median"]
    agg["scored"] = counts["dice"]
    agg["counts"] = counts
    return agg


def aggregate_info(agg: dict) -> dict:
    """:func:`aggregate` for ``--json``: means and medians rounded to 6 decimals."""
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in agg.items()}


_OVER = {"dice": "with gt", "iou": "with gt", "voxels": "with statistics", "volume_ml": "with statistics"}


def _aggregate_status(kind: str, agg: dict) -> str:
    """What an aggregate row is over: ``mean of 12 finished; dice, iou: 9 with gt``."""
    n = agg["finished"]
    groups: Dict[Tuple[int, str], List[str]] = {}
    for column in AGGREGATED:
        k = agg["counts"][column]
        if k and k != n:
            groups.setdefault((k, _OVER.get(column, "with a value")), []).append(column)
    parts = [f"{kind} of {n} finished"] + [f"{', '.join(cols)}: {k} {why}" for (k, why), cols in groups.items()]
    return "; ".join(parts)


def aggregate_csv_rows(agg: dict) -> List[List[str]]:
    """The ``summary.mean`` and ``summary.median`` rows, in :data:`SUMMARY_COLUMNS` order."""
    out = []
    for row_id in AGGREGATE_IDS:
        kind = row_id.split(".", 1)[1]
        cells = dict.fromkeys(SUMMARY_COLUMNS, "")
        cells.update(id=row_id, status=_aggregate_status(kind, agg))
        for column in AGGREGATED:
            cells[column] = _fmt(agg[f"{column}_{kind}"], _DIGITS[column])
        out.append([cells[c] for c in SUMMARY_COLUMNS])
    return out


def write_summary_csv(path: Path, rows: Sequence[dict], agg: Optional[dict] = None) -> Path:
    """The cases, then the aggregate rows (``agg``: :func:`aggregate` of ``rows`` when not given)."""
    buf = io.StringIO(newline="")
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(SUMMARY_COLUMNS)
    w.writerows(spreadsheet_rows(summary_csv_rows(rows)))  # ids, errors and queries are text from the manifest
    w.writerows(spreadsheet_rows(aggregate_csv_rows(agg if agg is not None else aggregate(rows))))
    return write_text_atomic(path, buf.getvalue(), overwrite=True)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.5em auto;max-width:1100px;
color:#222;background:#fafafa;padding:0 1em}
h1{font-size:1.4em} table{border-collapse:collapse;font-size:.9em} td,th{border:1px solid #ccc;padding:.2em .5em}
th{background:#eee} .banner{background:#b00020;color:#fff;padding:.6em 1em;font-weight:bold;border-radius:4px}
.case{background:#fff;border:1px solid #ddd;border-radius:6px;margin:1.2em 0;padding:.8em 1em}
.case h2{font-size:1.1em;margin:.2em 0 .5em} .done{color:#087f23} .failed{color:#b00020} .absent{color:#8a5a00}
.case img{max-width:100%;height:auto;border:1px solid #333;display:block;margin:.5em 0}
.reasoning{white-space:pre-wrap;background:#f4f4f4;padding:.5em;border-radius:4px;font-size:.9em}
.error{white-space:pre-wrap;color:#b00020} .invalid{color:#b00020} .meta{color:#555;font-size:.9em}
.notice{font-weight:bold;color:#7a4d00} table.aggregate{margin:.8em 0 1.2em}
table.aggregate caption{text-align:left;font-weight:bold;padding:.3em 0}
.scroll{overflow-x:auto;max-width:100%} table.cases td{white-space:nowrap}
"""


def _aggregate_html(agg: dict) -> str:
    """The aggregates' table (the module docstring's rule), shown before the cases."""
    esc = html.escape
    n = agg["finished"]
    lines = [f"<table class=\"aggregate\"><caption>Aggregates over the {n} finished case(s) (done or not found); "
             f"failed and invalid cases are not counted</caption>",
             "<tr><th></th><th>mean</th><th>median</th><th>over</th></tr>"]

    def row(label, column, over):
        mean, median = agg[f"{column}_mean"], agg[f"{column}_median"]
        lines.append(f"<tr><th>{esc(label)}</th><td>{esc(_fmt(mean, _DIGITS[column]) or '—')}</td>"
                     f"<td>{esc(_fmt(median, _DIGITS[column]) or '—')}</td><td>{esc(over)}</td></tr>")

    k = agg["counts"]["dice"]
    over = (f"{k} case(s) with ground truth (a case not found is scored as an empty mask)" if k
            else "no finished case with ground truth")
    row("Dice", "dice", over)
    row("IoU", "iou", over)
    k = agg["counts"]["volume_ml"]
    row("volume (mL)", "volume_ml",
        f"{k} case(s) with statistics (a case not found counts as 0 mL)" if k else "no case")
    if agg["counts"]["confidence"]:
        row("confidence", "confidence", f"{agg['counts']['confidence']} case(s) (agreement of the model's samples, "
                                        "not accuracy)")
    k = agg["counts"]["seconds"]
    row("seconds per case", "seconds", f"{k} case(s)" if k else "no case")
    lines.append("</table>")
    return "\n".join(lines)


def _stats_text(st: Optional[dict]) -> List[str]:
    """A done case's statistics for its section: volume and the HU inside the mask."""
    if not st or finite(st.get("volume_ml")) is None:
        return []
    out = [f"volume {st['volume_ml']:.3f} mL ({st.get('voxels')} voxels)"]
    if finite(st.get("mean_hu")) is not None:
        spread = f" ± {st['std_hu']:.1f} (SD)" if finite(st.get("std_hu")) is not None else ""
        out.append(f"HU in the mask: mean {st['mean_hu']:.1f}{spread}, min {_fmt(st.get('min_hu'))}, "
                   f"max {_fmt(st.get('max_hu'))}")
    return out


def render_summary_html(rows: Sequence[dict], title: str = "MedVol batch", preset: str = "", smoke: bool = False,
                        identity: Optional[dict] = None, agg: Optional[dict] = None) -> str:
    """The batch report: the research-use notice, which model made it (``identity``, see
    :func:`medvolcore.models.identity`) with a warning banner unless a MedVol-R1 adapter did, the
    aggregates (``agg``: :func:`aggregate` of ``rows`` when not given), a table of the cases and
    one section per case."""
    esc = html.escape
    n_done = sum(r["status"] == "done" for r in rows)
    n_absent = sum(r["status"] == "absent" for r in rows)
    n_invalid = sum(r["status"] == INVALID for r in rows)
    n_failed = len(rows) - n_done - n_absent - n_invalid
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>",
             f"<style>{_CSS}</style></head><body>", f"<h1>{esc(title)}</h1>",
             f"<p class=\"notice\">{esc(RESEARCH_USE_NOTICE)}</p>"]
    if smoke:
        parts.append("<p class=\"banner\">Made with the untrained 'tiny' smoke model: every anchor, mask and metric "
                     "on this page is meaningless. Use a real preset (medvol models download qwen3-vl-4b) for results.</p>")
    elif identity and not identity.get("trained_for_task"):
        parts.append(f"<p class=\"banner\">{esc(identity_note(identity) or identity['label'])}.</p>")
    model = f"model: {identity['label']} · " if identity else ""
    parts.append(f"<p class=\"meta\">{esc(model)}preset {esc(preset)} · {len(rows)} case(s): {n_done} done, "
                 f"{n_absent} not found, {n_failed} failed, {n_invalid} invalid (not run) · written {esc(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>")
    parts.append(_aggregate_html(agg if agg is not None else aggregate(rows)))
    # a wide table scrolls in its own box: the page keeps its width
    parts.append("<div class=\"scroll\"><table class=\"cases\"><tr>" + "".join(f"<th>{c}</th>" for c in SUMMARY_COLUMNS)
                 + "</tr>")
    for r, cells in zip(rows, summary_csv_rows(rows)):
        anchor = "case-" + quote(r["id"])
        tds = [f"<td><a href=\"#{anchor}\">{esc(cells[0])}</a></td>", f"<td class=\"{r['status']}\">{esc(cells[1])}</td>"]
        tds += [f"<td>{esc(v)}</td>" for v in cells[2:]]
        parts.append("<tr>" + "".join(tds) + "</tr>")
    parts.append("</table></div>")
    for r in rows:
        cid = r["id"]
        link = quote(cid)
        parts.append(f"<section class=\"case\" id=\"case-{link}\"><h2>{esc(cid)} "
                     f"<span class=\"{r['status']}\">[{esc(r['status'])}]</span></h2>")
        parts.append(f"<p><b>query:</b> {esc(r.get('_query') or '')}</p>")
        if r["status"] == "done":
            metrics = []
            if r["dice"] is not None:
                metrics.append(f"Dice {r['dice']:.4f}, IoU {r['iou']:.4f}")
            s_mm = finite((r.get("stats") or {}).get("key_slice_s_mm"))
            at = f" (S {s_mm:.1f} mm)" if s_mm is not None else ""
            metrics.append(f"key slice {r['slice']}{at}, {r['boxes']} box(es)")
            metrics += _stats_text(r.get("stats"))
            if r.get("confidence") is not None:
                metrics.append(f"confidence {r['confidence']:.3f} (agreement of the model's samples, not accuracy)")
            metrics.append(f"{_fmt(r['seconds'], 2)} s" + (" (from an earlier run)" if r.get("_skipped") else ""))
            agreement = f" · <a href=\"{link}/{AGREEMENT}\">agreement</a>" if r.get("_agreement") else ""
            parts.append(f"<p class=\"meta\">{esc(' · '.join(metrics))} · <a href=\"{link}/mask.nii.gz\">mask</a> · "
                         f"<a href=\"{link}/anchor.json\">anchor</a>{agreement}</p>")
            parts.append(f"<img src=\"{link}/qc.png\" alt=\"QC picture of {esc(cid)}\" loading=\"lazy\">")
            parts.append(f"<div class=\"reasoning\"><b>reasoning:</b> {esc(r.get('_reasoning') or '(none)')}</div>")
        elif r["status"] == "absent":
            metrics = ["not found in this CT: the model answered that the target is not present; no mask"]
            if r["dice"] is not None:
                metrics.append(f"scored as an empty mask: Dice {r['dice']:.4f}")
            if r.get("confidence") is not None:
                metrics.append(f"confidence {r['confidence']:.3f} (agreement of the model's samples, not accuracy)")
            agreement = f" · <a href=\"{link}/{AGREEMENT}\">agreement</a>" if r.get("_agreement") else ""
            parts.append(f"<p class=\"meta\">{esc(' · '.join(metrics))} · <a href=\"{link}/anchor.json\">anchor</a>"
                         f"{agreement}</p>")
            parts.append(f"<img src=\"{link}/qc.png\" alt=\"QC picture of {esc(cid)}\" loading=\"lazy\">")
            parts.append(f"<div class=\"reasoning\"><b>reasoning:</b> {esc(r.get('_reasoning') or '(none)')}</div>")
        else:
            parts.append(f"<p class=\"error\"><b>error:</b> {esc(r['error'] or '')}</p>")
        parts.append("</section>")
    parts.append(f"<footer class=\"notice\">{esc(RESEARCH_USE_NOTICE)}</footer>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_summary_html(path: Path, rows: Sequence[dict], **kw) -> Path:
    """:func:`render_summary_html` written atomically."""
    return write_text_atomic(path, render_summary_html(rows, **kw), overwrite=True)


__all__ = ["SUMMARY_COLUMNS", "CASE_COLUMNS", "STATS_COLUMNS", "AGGREGATE_IDS", "AGGREGATED", "aggregate",
           "aggregate_info", "aggregate_csv_rows", "summary_csv_rows", "write_summary_csv", "render_summary_html",
           "write_summary_html"]
