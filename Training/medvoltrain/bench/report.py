"""Tables, reward curves and result files of the two benchmark stages.

The learning benchmark (:mod:`medvoltrain.bench.learning`): :func:`learning_table` and
:func:`ablation_table` (``table.md``, ``result.json`` → ``ablations``), :func:`plot_curves`
(``curves.png``). The vision stage (:mod:`medvoltrain.bench.vision`): :func:`vision_table`. Both:
:func:`write_result` (``table.md``, then ``result.json``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from .common import CONDITIONS

RESULT = "result.json"
# the learning benchmark: its three models, the reward terms each is scored on, the image ablations
MODELS = ("untrained", "sft", "grpo")
TERMS = ("format", "axial", "box", "consistency")
ABLATIONS = ("black", "swapped")
# the vision stage: the scores of each image condition
METRICS = ("key", "box", "box_true_slice", "format")


# ---- tables --------------------------------------------------------------------------------

def ablation_table(ablations: Dict[str, Dict[str, dict]]) -> dict:
    """Per trained model and image condition, each term's mean and standard error, and the image
    contribution (own − ablated) with its standard error (the two conditions' errors combined as if
    independent: conservative, since both use the same prompts and seeds)."""
    out: Dict[str, dict] = {}
    for name, conds in ablations.items():
        out[name] = {c: {t: [round(m[t], 4), round(m[f"{t}_se"], 4)] for t in (*TERMS, "total")}
                     for c, m in conds.items()}
        own = conds["own"]
        out[name]["own_minus"] = {
            c: {t: [round(own[t] - conds[c][t], 4), round(math.hypot(own[f"{t}_se"], conds[c][f"{t}_se"]), 4)]
                for t in (*TERMS, "total")} for c in conds if c != "own"}
    return out


def learning_table(result: dict) -> str:
    """The learning benchmark's ``table.md``: each model's mean rewards, each ablation's, and the
    own − ablated differences with their standard errors."""
    head = f"| model | {' | '.join(TERMS)} | total (f+a+b) |"
    rows = [head, "|" + "---|" * (len(TERMS) + 2)]
    for m in MODELS:
        r = result[m]
        rows.append(f"| {m} | " + " | ".join(f"{r[t]:.3f}" for t in TERMS) + f" | {r['total']:.3f} |")
    for m, conds in result.get("ablations", {}).items():
        for c in ABLATIONS:
            if c in conds:
                r = conds[c]
                rows.append(f"| {m}, {c} slices | " + " | ".join(f"{r[t][0]:.3f}" for t in TERMS)
                            + f" | {r['total'][0]:.3f} |")
    for m, conds in result.get("ablations", {}).items():
        for c, d in conds.get("own_minus", {}).items():
            rows.append(f"| {m}: own − {c} | " + " | ".join(f"{d[t][0]:+.3f} ± {d[t][1]:.3f}" for t in TERMS)
                        + f" | {d['total'][0]:+.3f} ± {d['total'][1]:.3f} |")
    return "\n".join(rows)


def vision_table(result: dict) -> str:
    """The vision stage's ``table.md``: each image condition's scores (mean ± standard error), the
    key slice's chance level and what was held out."""
    rows = ["| images | " + " | ".join(METRICS) + " |", "|" + "---|" * (len(METRICS) + 1)]
    for cond in CONDITIONS:
        if cond in result["scores"]:
            r = result["scores"][cond]
            rows.append(f"| {cond} | " + " | ".join(f"{r[m]['mean']:.3f} ± {r[m]['se']:.3f}" for m in METRICS) + " |")
    rows.append("")
    rows.append(f"Chance for the key slice: {result['chance']['key']:.3f} (one of {result['chance']['key_positions']} "
                f"possible key slices).")
    held = result.get("settings", {}).get("hold_out")
    if held:
        rows.append("Held out: " + ("new volumes; their squares sit at positions training has seen."
                                    if held == "volumes" else "positions: no test square starts where a training "
                                                              "square did (checkerboard)."))
    return "\n".join(rows)


# ---- reward curves (PIL: matplotlib is not a dependency) --------------------------------------

_COLOURS = {"loss": (31, 119, 180), "format": (31, 119, 180), "axial": (255, 127, 14), "box": (44, 160, 44),
            "consistency": (148, 103, 189), "reward": (60, 60, 60)}


def _panel(draw, box, title: str, series: Dict[str, List[Tuple[float, float]]], y_label: str, font) -> None:
    x0, y0, x1, y1 = box
    left, right, top, bottom = x0 + 56, x1 - 12, y0 + 28, y1 - 40
    draw.text((x0 + 8, y0 + 6), title, fill=(0, 0, 0), font=font)
    pts = [p for s in series.values() for p in s]
    if not pts:
        draw.text((left + 10, (top + bottom) // 2), "nothing logged", fill=(120, 120, 120), font=font)
        return
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    xmin, xmax = min(xs), max(xs)
    ymin, ymax = min(0.0, min(ys)), max(ys)
    if xmax == xmin:
        xmax = xmin + 1
    if ymax - ymin < 1e-9:
        ymax = ymin + 1
    ymax += 0.05 * (ymax - ymin)

    def px(x, y):
        return (left + (x - xmin) / (xmax - xmin) * (right - left), bottom - (y - ymin) / (ymax - ymin) * (bottom - top))

    draw.rectangle([left, top, right, bottom], outline=(0, 0, 0))
    for k in range(6):
        yv = ymin + k * (ymax - ymin) / 5
        _, yy = px(xmin, yv)
        draw.line([left - 4, yy, left, yy], fill=(0, 0, 0))
        draw.line([left + 1, yy, right - 1, yy], fill=(230, 230, 230))
        draw.text((x0 + 4, yy - 6), f"{yv:.2f}", fill=(0, 0, 0), font=font)
        xv = xmin + k * (xmax - xmin) / 5
        xx, _ = px(xv, ymin)
        draw.line([xx, bottom, xx, bottom + 4], fill=(0, 0, 0))
        draw.text((xx - 8, bottom + 6), f"{xv:.0f}", fill=(0, 0, 0), font=font)
    draw.text(((left + right) // 2 - 12, bottom + 22), "step", fill=(0, 0, 0), font=font)
    draw.text((left + 4, top + 4), y_label, fill=(90, 90, 90), font=font)
    for i, (name, s) in enumerate(series.items()):
        colour = _COLOURS.get(name, (0, 0, 0))
        line = [px(x, y) for x, y in s]
        if len(line) > 1:
            draw.line(line, fill=colour, width=2)
        for x, y in line:
            draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colour)
        lx, ly = right - 110, top + 6 + 14 * i
        draw.line([lx, ly + 6, lx + 18, ly + 6], fill=colour, width=3)
        draw.text((lx + 22, ly), name, fill=(0, 0, 0), font=font)


def plot_curves(path, sft_history: List[dict], grpo_history: List[dict], title: str = "") -> Path:
    """``path`` (PNG): SFT loss per step (left) and GRPO per-term reward means per step (right)."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (1100, 420), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    sft = {"loss": [(h["step"], h["loss"]) for h in sft_history if h.get("loss") is not None]}
    grpo = {}
    for term in (*TERMS, "reward"):
        key = "reward" if term == "reward" else f"rewards/{term}/mean"
        pts = [(h["step"], h[key]) for h in grpo_history if key in h and h[key] is not None
               and math.isfinite(h[key])]
        if pts:
            grpo[term] = pts
    _panel(draw, (0, 20, 550, 420), "SFT: training loss (completion tokens)", sft, "loss", font)
    _panel(draw, (550, 20, 1100, 420), "GRPO: mean reward per term (rollouts)", grpo, "reward", font)
    if title:
        draw.text((8, 4), title, fill=(0, 0, 0), font=font)
    from medvolcore.fileio import atomic_path

    with atomic_path(path, overwrite=True) as tmp:
        img.save(str(tmp), format="PNG")
    return Path(path)


# ---- result files --------------------------------------------------------------------------

def write_result(out: Path, result: dict, table: str) -> None:
    """``out/table.md`` (``table``), then ``out/result.json`` (``result``; written last, so a folder
    that holds it is a finished run)."""
    from medvolcore.fileio import write_text_atomic

    write_text_atomic(out / "table.md", table + "\n", overwrite=True)
    write_text_atomic(out / RESULT, json.dumps(result, indent=1, default=_json_default) + "\n", overwrite=True)


def finish_stage(out: Path, result: dict, table: str, timings: dict, echo) -> dict:
    """Write a vision stage's result (:func:`write_result`) and echo its table, goals and timings."""
    write_result(out, result, table)
    echo("")
    echo(table)
    echo("goals: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in result["goals"].items()))
    echo("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    return result


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


__all__ = ["RESULT", "MODELS", "TERMS", "ABLATIONS", "METRICS", "ablation_table", "learning_table", "vision_table",
           "plot_curves", "write_result", "finish_stage"]
