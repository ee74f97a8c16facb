"""Consensus of G sampled answers to one query: the agreement map, the majority mask, the confidence.

Pure numpy, no model: :meth:`medvolcore.pipeline.Pipeline.segment` (``consensus=G``) samples the
answers (:meth:`QwenVLGrounder.ground_samples`), propagates each with one shared feature store
and hands the outcomes here. An *outcome* is, per sample, one of

* a boolean mask (the sample answered with a slice and boxes; the mask is its propagation, on any
  grid, the same for every sample);
* :data:`ABSENT` (the sample answered ``<answer>[]</answer>``: not present in this volume);
* ``None`` (the sample's answer was unusable: it did not parse or had no usable box).

**Confidence** (:func:`confidence`) is the mean, over the G·(G−1)/2 pairs of samples, of their
agreement: the Dice of the two masks for two present answers (1 when both masks are empty); 1 for
two absent answers; 0 for an absent and a present answer, whatever the present one's mask; 0 for a
pair with an unusable answer. It is in [0, 1]: 1 when every sample gave the same mask (or every
sample said absent). It measures how much samples *of the same model* agree with each other, not
the probability that the answer is right: a model can agree with itself on a wrong answer, and an
untrained one often does.

**Agreement map** (:func:`agreement_map`): per voxel, how many samples' masks include it (0..G,
uint8); absent and unusable samples add nothing. **Majority mask** (:func:`majority_mask`): the
voxels that more than half of the G samples include (``2·count > G``), so it is empty whenever half
or more of the samples said absent or were unusable.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import numpy as np

from .errors import InputError

__all__ = ["ABSENT", "MASK_MODES", "check_mask_mode", "pair_agreement", "confidence", "agreement_map",
           "majority_mask", "sample_record"]

ABSENT = "absent"
MASK_MODES = ("greedy", "majority")

Outcome = Union[np.ndarray, str, None]


def check_mask_mode(value, what: str = "the consensus mask") -> str:
    """``value`` as one of :data:`MASK_MODES` (``greedy``: the greedy answer's mask, unchanged;
    ``majority``: the voxels more than half of the samples include)."""
    if value not in MASK_MODES:
        raise InputError(f"{what} must be one of {', '.join(MASK_MODES)}, got {value!r}")
    return value


def _bbox(masks: Sequence[np.ndarray]):
    """The slices of the smallest box holding every mask's voxels (None when all are empty)."""
    union = np.zeros(masks[0].shape, dtype=bool)
    for m in masks:
        union |= m
    if not union.any():
        return None
    return tuple(slice(int(idx.min()), int(idx.max()) + 1) for idx in np.nonzero(union))


def pair_agreement(a: Outcome, b: Outcome) -> float:
    """The agreement of two outcomes, as defined in the module docstring."""
    if a is None or b is None:
        return 0.0
    a_absent, b_absent = isinstance(a, str), isinstance(b, str)
    if a_absent or b_absent:
        return 1.0 if a_absent and b_absent else 0.0
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if a.shape != b.shape:
        raise InputError(f"masks of shapes {a.shape} and {b.shape} cannot be compared")
    na, nb = int(a.sum()), int(b.sum())
    if na + nb == 0:
        return 1.0
    return 2.0 * int(np.logical_and(a, b).sum()) / (na + nb)


def _check(outcomes: Sequence[Outcome]) -> List[Outcome]:
    out = []
    for i, o in enumerate(outcomes):
        if o is None or isinstance(o, np.ndarray):
            out.append(o)
        elif o == ABSENT:
            out.append(ABSENT)
        else:
            raise InputError(f"outcome {i + 1} must be a mask, {ABSENT!r} or None, got {type(o).__name__}")
    return out


def confidence(outcomes: Sequence[Outcome]) -> Optional[float]:
    """Mean pairwise agreement of G ≥ 2 outcomes, in [0, 1]; None for fewer than two."""
    items = _check(outcomes)
    if len(items) < 2:
        return None
    masks = [o for o in items if isinstance(o, np.ndarray)]
    box = _bbox([np.asarray(m, dtype=bool) for m in masks]) if masks else None
    if box is not None:  # Dice only sees voxels inside the union's box: compare those alone
        items = [o[box] if isinstance(o, np.ndarray) else o for o in items]
    elif masks:
        items = [np.zeros(1, bool) if isinstance(o, np.ndarray) else o for o in items]
    total, pairs = 0.0, 0
    for i in range(len(items)):
        for j in range(i + 1, len(items)):
            total += pair_agreement(items[i], items[j])
            pairs += 1
    return total / pairs


def agreement_map(outcomes: Sequence[Outcome], shape=None) -> np.ndarray:
    """Per voxel, the number of outcomes whose mask includes it (uint8, 0..G). ``shape`` is needed
    only when no outcome is a mask."""
    items = _check(outcomes)
    masks = [np.asarray(o, dtype=bool) for o in items if isinstance(o, np.ndarray)]
    if len(items) > 255:
        raise InputError(f"{len(items)} samples do not fit a uint8 agreement map")
    if not masks:
        if shape is None:
            raise InputError("no mask among the outcomes: give the map's shape")
        return np.zeros(tuple(shape), np.uint8)
    out = np.zeros(masks[0].shape, np.uint8)
    for m in masks:
        if m.shape != out.shape:
            raise InputError(f"masks of shapes {out.shape} and {m.shape} cannot be added up")
        out += m
    return out


def majority_mask(agreement: np.ndarray, samples: int) -> np.ndarray:
    """The voxels that more than half of ``samples`` include (uint8 0/1)."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise InputError(f"samples must be a whole number ≥ 1, got {samples!r}")
    return (2 * np.asarray(agreement, dtype=np.int32) > samples).astype(np.uint8)


def sample_record(index: int, anchor=None, error: str = "", signal: Optional[dict] = None,
                  mask_voxels: Optional[int] = None) -> dict:
    """One sample in the compact form an anchor's ``samples`` holds: ``sample`` (1 = the greedy
    answer), then ``absent: true``, or ``slice`` and ``boxes_norm`` (0–1000, one decimal), or
    ``unusable`` (the reason); ``answer_mean_prob`` when known; ``mask_voxels`` of its mask."""
    d: dict = {"sample": int(index)}
    if anchor is None:
        d["unusable"] = " ".join(str(error).split())[:200] or "unusable answer"
    elif anchor.absent:
        d["absent"] = True
    else:
        d["slice"] = int(anchor.slice)
        d["boxes_norm"] = [[round(float(v), 1) for v in b] for b in anchor.boxes_norm]
    if signal and signal.get("answer_mean_prob") is not None:
        d["answer_mean_prob"] = signal["answer_mean_prob"]
    if mask_voxels is not None:
        d["mask_voxels"] = int(mask_voxels)
    return d
