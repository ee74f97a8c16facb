"""Targets from a mask: the key slice and the boxes of a ``(D, H, W)`` mask (docs/architecture.md,
"Targets from a mask"), the ground-truth anchor of training and the oracle mode."""

from __future__ import annotations

from typing import Iterable, List, Optional, Union

import numpy as np

from ..errors import InputError, VolumeError
from .evidence import EvidenceAnchor
from .geometry import Box
from .schema import MAX_BOXES

MIN_COMPONENT_PIXELS = 10
MIN_COMPONENT_FRACTION = 0.05


def slice_areas(mask: np.ndarray) -> np.ndarray:
    """Foreground pixel count per axial slice of a ``(D, H, W)`` stack mask."""
    m = np.asarray(mask)
    if m.ndim != 3:
        raise InputError(f"expected a (D, H, W) mask, got shape {m.shape}")
    return (m != 0).reshape(m.shape[0], -1).sum(axis=1)


def boxes_from_slice_mask(mask2d: np.ndarray) -> List[Box]:
    """Boxes of the 2-D 8-connected components of one slice's mask, per docs/architecture.md ("Targets from a mask").

    Components under 10 pixels or under 5 % of the largest are dropped (the largest is kept
    even when it is under 10 pixels, so a non-empty slice always yields a box); at most the 8
    largest are kept; boxes are ordered by ``x0`` then ``y0``.
    """
    from scipy import ndimage

    lab, n = ndimage.label(np.asarray(mask2d) != 0, structure=np.ones((3, 3), dtype=bool))
    if n == 0:
        return []
    sizes = np.bincount(lab.ravel())[1:]
    largest = int(sizes.max())
    keep = [i for i in range(n) if sizes[i] >= MIN_COMPONENT_PIXELS and sizes[i] >= MIN_COMPONENT_FRACTION * largest]
    if not keep:
        keep = [int(np.argmax(sizes))]
    keep = sorted(keep, key=lambda i: (-sizes[i], i))[:MAX_BOXES]
    objects = ndimage.find_objects(lab)
    boxes = []
    for i in keep:
        sy, sx = objects[i]
        boxes.append([sx.start, sy.start, sx.stop - 1, sy.stop - 1])
    return sorted(boxes, key=lambda b: (b[0], b[1]))


def rank_slices(mask: np.ndarray, candidates: Optional[Iterable[int]] = None) -> List[int]:
    """Non-empty slices by decreasing foreground area (ties: smaller ``z`` first)."""
    areas = slice_areas(mask)
    zs = range(len(areas)) if candidates is None else sorted(set(int(z) for z in candidates))
    zs = [z for z in zs if 0 <= z < len(areas) and areas[z] > 0]
    return sorted(zs, key=lambda z: (-int(areas[z]), z))


def anchor_from_mask(
    mask: np.ndarray,
    top_k: int = 1,
    rng: Union[np.random.Generator, int, None] = None,
    candidates: Optional[Iterable[int]] = None,
    stack=None,
    **kw,
) -> EvidenceAnchor:
    """The target anchor of a ``(D, H, W)`` mask on the canonical stack (Top-K visibility sampling).

    Slices are ranked by foreground area; the key slice is drawn uniformly from the top
    ``top_k`` (``top_k=1`` is deterministic: the largest, ties to the smaller ``z``).
    ``candidates`` restricts the key slice to given indices (e.g. the 64 shown slices).
    ``rng`` is a numpy Generator or a seed (default seed 0). With ``stack`` the anchor gets
    its ``world`` boxes.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise InputError(f"top_k must be an integer ≥ 1, got {top_k!r}")
    ranked = rank_slices(mask, candidates)
    if not ranked:
        raise VolumeError("the target mask is empty" + (" on the candidate slices" if candidates is not None else ""))
    pool = ranked[: int(top_k)]
    if len(pool) == 1:
        z = pool[0]
    else:
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(0 if rng is None else int(rng))
        z = pool[int(gen.integers(len(pool)))]
    m = np.asarray(mask)
    anchor = EvidenceAnchor(z, boxes_from_slice_mask(m[z]), [m.shape[2], m.shape[1]], source=kw.pop("source", "mask"), **kw)
    return anchor.with_world(stack) if stack is not None else anchor
