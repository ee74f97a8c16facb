"""The field's scores of a text-guided 3-D segmentation, one module for every protocol.

Arrays are label maps in the image's own axis order; ``spacing`` is the voxel size in mm along
those axes (as the challenge files store it and as the CVPR 2025 script uses it). Three protocols:

* **cvpr25** — CVPR 2025 "Foundation Models for Text-Guided 3D Biomedical Image Segmentation"
  (:func:`cvpr25_case`), as its evaluation script ``CVPR25_text_eval.py`` computes them, choices
  included: gts and segs are cast to uint8; a semantic case averages DSC and NSD (2 mm) over the
  prompted classes **that are present in the ground truth** (a prompt for an absent class is not
  scored, whatever was predicted for it; predicted labels that were never prompted are ignored) and
  is NaN when no prompted class is present; a volumetric DSC of two empty masks is NaN; an instance
  case (``instance_label == 1``) gets no DSC/NSD but an F1 at IoU ≥ 0.5 after the prediction is
  split into 6-connected components when it holds exactly one label, with one-to-one matching; a
  prediction with no instance scores F1 = 0 (also when the ground truth has none), and ``DSC_TP``
  is the mean Dice of the matched pairs (0 without any). Values are rounded to 4 decimals.
  Beside them, named, the textbook choices: every prompt averaged with two empty masks counting as
  Dice 1.0 (``DSC_all_prompts``) and the instance F1 with unmatched ground truth counted when nothing
  was predicted and NaN when there is nothing on either side (``F1_textbook``).
* **rexgrounding** — ReXGroundingCT's finding-level scores as its leaderboard (ReXrank) defines
  them (:func:`rexgrounding_summary`): per finding (one prompt with ground truth) its Dice; **global
  Dice** is the mean of the findings' Dice; the **hit rate** is the share of findings with Dice ≥
  0.1; **instance precision/recall/F1** count the 26-connected components of each finding's
  prediction and ground truth, matched one-to-one at Dice ≥ 0.2, pooled over findings. Beside them,
  named, the Dice of the voxels pooled over every finding (``2 Σ|P∩G| / Σ(|P|+|G|)``), what
  "global Dice" means elsewhere.
* **medvol-r1** — the MedVol-R1 paper's Table 1 (:func:`medvol_r1_prompt`): Dice and IoU per prompt
  with two empty masks counting as 1.0 (:mod:`medvolcore.metrics`).

The **absent-target suite** (:func:`absent_prompt`, :func:`absent_summary`) scores the prompts
whose structure is not in the volume under both empty-mask conventions: a refusal (nothing
predicted) is Dice 1.0 in MedVol-R1's convention and unscored (NaN) in the CVPR script's; any
predicted voxel is a false positive, counted in voxels and mL.

NSD is DeepMind's ``surface-distance`` (its surfel areas and distance maps); the cases it cannot
take under NumPy 2 (an empty mask) are decided here by its own formula: one empty side scores 0,
both empty 0/0 (NaN). Connected components are ``connected-components-3d`` (cc3d).
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Sequence

import numpy as np

TOLERANCE_MM = 2.0  # the CVPR 2025 NSD tolerance
CVPR_IOU = 0.5  # the CVPR 2025 instance match threshold (IoU)
REX_HIT_DICE = 0.1  # a ReXGroundingCT finding is hit at Dice ≥ 0.1
REX_INSTANCE_DICE = 0.2  # a ReXGroundingCT instance matches at Dice ≥ 0.2
NAN = float("nan")


# ---- two masks --------------------------------------------------------------------------------------

def dice_nan(gt, pred) -> float:
    """Volumetric Dice; NaN when both masks are empty (the CVPR script's convention)."""
    g, p = np.asarray(gt, bool), np.asarray(pred, bool)
    total = int(g.sum()) + int(p.sum())
    return NAN if total == 0 else 2.0 * int(np.logical_and(g, p).sum()) / total


def nsd(gt, pred, spacing: Sequence[float], tolerance_mm: float = TOLERANCE_MM) -> float:
    """Normalised surface Dice at ``tolerance_mm`` (DeepMind's surface Dice); one empty mask
    scores 0, two empty masks NaN."""
    g, p = np.asarray(gt, bool), np.asarray(pred, bool)
    if g.shape != p.shape:
        raise ValueError(f"ground truth {g.shape} and prediction {p.shape} differ in shape")
    if not g.any() and not p.any():
        return NAN
    if not g.any() or not p.any():
        return 0.0
    import warnings

    import surface_distance

    with warnings.catch_warnings():  # it imports from scipy.ndimage's deprecated namespaces
        warnings.simplefilter("ignore", DeprecationWarning)
        d = surface_distance.compute_surface_distances(g, p, tuple(float(s) for s in spacing))
    return float(surface_distance.compute_surface_dice_at_tolerance(d, tolerance_mm))


# ---- instances ----------------------------------------------------------------------------------------

def relabel_sequential(labels) -> np.ndarray:
    """The labels renumbered 1..n in increasing order of their value, 0 kept as 0 (int64)."""
    a = np.asarray(labels)
    values, inverse = np.unique(a, return_inverse=True)
    out = inverse.reshape(a.shape).astype(np.int64)
    return out if values.size and values[0] == 0 else out + 1


def cvpr25_instances(segs) -> np.ndarray:
    """The CVPR script's instance map of a uint8 prediction: when it holds exactly two values, its
    6-connected components become new labels above the largest one (in uint8, wrapping as the
    script's does); then labels are renumbered 1..n."""
    import cc3d

    seg = np.asarray(segs).astype(np.uint8)  # a copy
    if np.unique(seg).size == 2:
        comp = cc3d.connected_components(seg, connectivity=6)
        fg = comp > 0
        seg[fg] = (comp[fg] + np.max(seg)).astype(np.uint8, casting="unsafe")
    return relabel_sequential(seg)


def components(mask, connectivity: int = 26) -> np.ndarray:
    """Connected components (cc3d) of a binary mask, labelled 1..n."""
    import cc3d

    return np.asarray(cc3d.connected_components(np.asarray(mask, np.uint8), connectivity=connectivity), np.int64)


def _pair_scores(gt_lab: np.ndarray, pred_lab: np.ndarray, score: str) -> np.ndarray:
    """``[n_gt, n_pred]`` IoU or Dice of every pair of instances (labels 1..n, 0 background)."""
    n_g, n_p = int(gt_lab.max(initial=0)), int(pred_lab.max(initial=0))
    inter = np.bincount(gt_lab.ravel() * (n_p + 1) + pred_lab.ravel(),
                        minlength=(n_g + 1) * (n_p + 1)).reshape(n_g + 1, n_p + 1)
    size_g, size_p = inter.sum(axis=1, keepdims=True), inter.sum(axis=0, keepdims=True)
    inter = inter[1:, 1:].astype(float)
    size_g, size_p = size_g[1:].astype(float), size_p[:, 1:].astype(float)
    denom = (size_g + size_p - inter) if score == "iou" else (size_g + size_p) / 2.0
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(denom > 0, inter / np.where(denom > 0, denom, 1.0), 0.0)
    return out


def match_instances(gt_lab, pred_lab, threshold: float, score: str = "iou") -> List[tuple]:
    """One-to-one matches ``(gt_label, pred_label, score)`` at ``score ≥ threshold`` (labels 1..n):
    the assignment that maximises the number of matches, then their summed score (Hungarian)."""
    from scipy.optimize import linear_sum_assignment

    m = _pair_scores(np.asarray(gt_lab, np.int64), np.asarray(pred_lab, np.int64), score)
    if m.size == 0:
        return []
    n_min = min(m.shape)
    rows, cols = linear_sum_assignment(-(m >= threshold).astype(float) - m / (2.0 * n_min))
    return [(int(r) + 1, int(c) + 1, float(m[r, c])) for r, c in zip(rows, cols) if m[r, c] >= threshold]


def _f1(tp: int, fp: int, fn: int, nan_when_empty: bool) -> float:
    if tp + fp + fn == 0:
        return NAN if nan_when_empty else 0.0
    return 2.0 * tp / (2.0 * tp + fp + fn)


# ---- CVPR 2025 -----------------------------------------------------------------------------------------

def _round4(x: float) -> float:
    return NAN if x is None or not math.isfinite(x) else round(float(x), 4)


def cvpr25_case(gts, segs, spacing: Sequence[float], class_ids: Iterable[int], instance: bool) -> Dict[str, object]:
    """One case's CVPR 2025 scores (the module docstring): ``DSC``, ``NSD``, ``F1``, ``DSC_TP`` as the
    official script writes them (rounded, NaN where it gives NaN), and the textbook ``DSC_all_prompts``
    and ``F1_textbook`` beside them."""
    gt = np.asarray(gts).astype(np.uint8)
    seg = np.asarray(segs).astype(np.uint8)
    if gt.shape != seg.shape:
        raise ValueError(f"segs {seg.shape} and gts {gt.shape} differ in shape")
    ids = sorted({int(c) for c in class_ids})
    out: Dict[str, object] = {"DSC": NAN, "NSD": NAN, "F1": NAN, "DSC_TP": NAN, "DSC_all_prompts": NAN,
                              "F1_textbook": NAN}
    if not instance:
        # the script drops the first of the ground truth's sorted values: the background in any real case
        present = sorted(set(int(v) for v in np.unique(gt)[1:]) & set(ids))
        if present:
            out["DSC"] = _round4(float(np.mean([dice_nan(gt == i, seg == i) for i in present])))
            out["NSD"] = _round4(float(np.mean([nsd(gt == i, seg == i, spacing) for i in present])))
        if ids:
            from medvolcore.metrics import dice

            out["DSC_all_prompts"] = _round4(float(np.mean([dice(seg == i, gt == i) for i in ids])))
        return out
    gt_lab, pred_lab = relabel_sequential(gt), cvpr25_instances(seg)
    n_gt, n_pred = int(gt_lab.max(initial=0)), int(pred_lab.max(initial=0))
    pairs = match_instances(gt_lab, pred_lab, CVPR_IOU, "iou") if n_pred else []
    tp = len(pairs)
    # the script counts nothing (tp = fp = fn = 0, F1 = 0) when the prediction has no instance
    out["F1"] = _round4(_f1(tp, n_pred - tp, n_gt - tp if n_pred else 0, nan_when_empty=False))
    out["F1_textbook"] = _round4(_f1(tp, n_pred - tp, n_gt - tp, nan_when_empty=True))
    out["DSC_TP"] = _round4(float(np.mean([dice_nan(gt_lab == g, pred_lab == p) for g, p, _ in pairs]))
                            if pairs else 0.0)
    return out


# ---- per prompt: MedVol-R1, ReXGroundingCT, absent targets ---------------------------------------------

def medvol_r1_prompt(gt_mask, pred_mask) -> Dict[str, float]:
    """Dice and IoU with two empty masks counting as 1.0 (the paper's Table 1)."""
    from medvolcore.metrics import dice, iou

    return {"dice": dice(pred_mask, gt_mask), "iou": iou(pred_mask, gt_mask)}


def finding_counts(gt_mask, pred_mask) -> Dict[str, float]:
    """What ReXGroundingCT's scores pool over, for one finding: voxel counts, Dice, and the instance
    matches (26-connected components, one-to-one at Dice ≥ 0.2)."""
    g, p = np.asarray(gt_mask, bool), np.asarray(pred_mask, bool)
    gl, pl = components(g), components(p)
    n_g, n_p = int(gl.max(initial=0)), int(pl.max(initial=0))
    tp = len(match_instances(gl, pl, REX_INSTANCE_DICE, "dice")) if n_g and n_p else 0
    inter, sg, sp = int(np.logical_and(g, p).sum()), int(g.sum()), int(p.sum())
    return {"dice": NAN if sg + sp == 0 else 2.0 * inter / (sg + sp), "intersection": inter, "gt_voxels": sg,
            "pred_voxels": sp, "gt_instances": n_g, "pred_instances": n_p, "matched_instances": tp}


def rexgrounding_summary(findings: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """Global Dice (the mean of the findings' Dice), hit rate (Dice ≥ 0.1), instance
    precision/recall/F1 and, beside them, the pooled-voxel Dice, over findings (each from
    :func:`finding_counts`, ground truth non-empty)."""
    n = len(findings)
    if n == 0:
        return {"findings": 0, "global_dice": NAN, "pooled_dice": NAN, "hit_rate": NAN, "instance_precision": NAN,
                "instance_recall": NAN, "instance_f1": NAN}
    inter = sum(f["intersection"] for f in findings)
    total = sum(f["gt_voxels"] + f["pred_voxels"] for f in findings)
    tp = sum(f["matched_instances"] for f in findings)
    n_p, n_g = sum(f["pred_instances"] for f in findings), sum(f["gt_instances"] for f in findings)
    prec = tp / n_p if n_p else 0.0
    rec = tp / n_g if n_g else NAN
    f1 = 2 * prec * rec / (prec + rec) if (prec + rec) > 0 else 0.0
    return {"findings": n, "global_dice": float(np.mean([f["dice"] for f in findings])),
            "pooled_dice": 2.0 * inter / total if total else NAN,
            "hit_rate": float(np.mean([f["dice"] >= REX_HIT_DICE for f in findings])),
            "instance_precision": prec, "instance_recall": rec, "instance_f1": f1}


def absent_prompt(predicted, spacing: Sequence[float]) -> Dict[str, float]:
    """A prompt whose structure is not in the volume (``predicted``: its mask, or its voxel count):
    refused (nothing predicted) or not, the false-positive voxels and mL, and its Dice under each
    convention."""
    n = int(predicted) if np.ndim(predicted) == 0 else int(np.count_nonzero(predicted))
    refused = n == 0
    return {"refused": int(refused), "fp_voxels": n, "fp_ml": n * float(np.prod(spacing)) / 1000.0,
            "dice_empty_is_one": 1.0 if refused else 0.0, "dice_empty_is_nan": NAN if refused else 0.0}


def absent_summary(rows: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """Refusal rate, false positives (mean voxels and mL, and their total) and mean Dice under both
    conventions (NaN convention: over the prompts that predicted something, 0 each; NaN if none did)."""
    n = len(rows)
    if n == 0:
        return {"prompts": 0, "refusal_rate": NAN, "fp_voxels_mean": NAN, "fp_ml_mean": NAN, "fp_ml_total": 0.0,
                "dice_empty_is_one": NAN, "dice_empty_is_nan": NAN, "scored_under_nan": 0}
    nan_scored = [r["dice_empty_is_nan"] for r in rows if math.isfinite(r["dice_empty_is_nan"])]
    return {"prompts": n, "refusal_rate": float(np.mean([r["refused"] for r in rows])),
            "fp_voxels_mean": float(np.mean([r["fp_voxels"] for r in rows])),
            "fp_ml_mean": float(np.mean([r["fp_ml"] for r in rows])),
            "fp_ml_total": float(sum(r["fp_ml"] for r in rows)),
            "dice_empty_is_one": float(np.mean([r["dice_empty_is_one"] for r in rows])),
            "dice_empty_is_nan": float(np.mean(nan_scored)) if nan_scored else NAN,
            "scored_under_nan": len(nan_scored)}


PROTOCOL_NOTES = {
    "cvpr25": "CVPR 2025 text-guided 3-D segmentation (CVPR25_text_eval.py): DSC and NSD (2 mm) over the prompted "
              "classes present in the ground truth, NaN for none; instance cases F1 at IoU ≥ 0.5",
    "rexgrounding": "ReXGroundingCT (ReXrank): global Dice = mean Dice per finding, hit rate (Dice ≥ 0.1), instance "
                    "precision/recall/F1 (Dice ≥ 0.2)",
    "medvol-r1": "MedVol-R1 Table 1: Dice and IoU per prompt, two empty masks count as 1.0",
}
