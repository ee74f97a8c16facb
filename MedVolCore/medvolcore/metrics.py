"""Overlap metrics on masks, computed on the source grid.

Both masks empty counts as perfect agreement (Dice = IoU = 1.0): a model that correctly
finds nothing should not be penalised.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import numpy as np

from .errors import VolumeError


def _pair(pred, gt):
    p, g = np.asarray(pred) != 0, np.asarray(gt) != 0
    if p.shape != g.shape:
        raise VolumeError(f"prediction shape {p.shape} does not match ground truth {g.shape}")
    return p, g


def dice(pred, gt) -> float:
    """``2|P∩G| / (|P|+|G|)``; 1.0 when both are empty."""
    p, g = _pair(pred, gt)
    total = int(p.sum()) + int(g.sum())
    return 1.0 if total == 0 else 2.0 * int(np.logical_and(p, g).sum()) / total


def iou(pred, gt) -> float:
    """``|P∩G| / |P∪G|``; 1.0 when both are empty."""
    p, g = _pair(pred, gt)
    union = int(np.logical_or(p, g).sum())
    return 1.0 if union == 0 else int(np.logical_and(p, g).sum()) / union


def overlap(pred, gt) -> Dict[str, float]:
    p, g = _pair(pred, gt)
    return {"dice": dice(p, g), "iou": iou(p, g), "pred_voxels": int(p.sum()), "gt_voxels": int(g.sum())}


def label_metrics(pred_labels, gt_labels, labels: Optional[Iterable[int]] = None) -> Dict[int, Dict[str, float]]:
    """Per-label Dice and IoU between two label maps (``labels`` defaults to every non-zero id in either)."""
    p, g = np.asarray(pred_labels), np.asarray(gt_labels)
    if p.shape != g.shape:
        raise VolumeError(f"prediction shape {p.shape} does not match ground truth {g.shape}")
    if labels is None:
        labels = sorted((set(np.unique(p).tolist()) | set(np.unique(g).tolist())) - {0})
    return {int(l): overlap(p == l, g == l) for l in labels if l != 0}
