"""SFT targets and reward ground truth from a target mask on the canonical stack.

Everything here is in the frame of :class:`medvolcore.stack.AxialStack`: masks are ``(D, H, W)``
stack arrays, ``z`` is the stack slice index, boxes are inclusive pixel boxes ``[x0, y0, x1, y1]``
on the slice's own grid (``W × H``) and their 0–1000 normalised form as
:func:`medvolcore.anchor.box_to_norm` gives it (docs/architecture.md, "Pixel and box geometry").

The target follows docs/architecture.md, "Targets from a mask": the key slice is drawn from the
``top_k`` largest-area slices **among the shown slices** (the model can only name a shown tag),
boxes are the slice's 8-connected components (small ones dropped, at most 8, ordered by ``x0``).
The completion is ``<think>{sentence}</think><answer>[{"slice": z, "bbox_2d_list": [[…]]}]</answer>``
written by :func:`medvolcore.answer.format_answer` (integer coordinates, the canonical text the
grounder's grammar also produces); the sentence comes from ``Resources/training/think_templates.json``.

A **negative** sample (the target is not in the volume, :func:`absent_target`) has the absent answer
``<think>{sentence}</think><answer>[]</answer>`` (:func:`medvolcore.answer.absent_answer`), no key
slice and no boxes; its sentence comes from the same file's ``absent_templates``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from medvolcore.anchor import anchor_from_mask, box_to_norm, boxes_from_slice_mask, slice_areas
from medvolcore.answer import absent_answer, format_answer

from . import resources
from .errors import DataError


@dataclass
class SFTTarget:
    """The SFT completion for one sample and the anchor it encodes (``slice`` None and no boxes for
    a negative sample: the absent answer)."""

    slice: Optional[int]
    boxes: List[List[int]]  # inclusive pixel boxes on the stack slice
    boxes_norm: List[List[float]]  # 0–1000, continuous
    think: str
    text: str  # the completion text, without the end-of-turn token

    @property
    def absent(self) -> bool:
        return self.slice is None

    def to_dict(self) -> dict:
        return {"slice": self.slice, "boxes": self.boxes, "boxes_norm": self.boxes_norm, "think": self.think,
                "text": self.text, "absent": self.absent}


def think_sentence(target_name: str, z: int, n_boxes: int, rng: np.random.Generator,
                   templates: Optional[dict] = None) -> str:
    """A templated reasoning sentence naming the target and the key slice."""
    t = templates if templates is not None else resources.think_templates()
    tpl = t["templates"][int(rng.integers(len(t["templates"])))]
    regions = t["regions"].get(str(n_boxes), t["regions"]["other"]).replace("{count}", str(n_boxes))
    text = (tpl.replace("{target}", target_name).replace("{slice}", str(int(z)))
            .replace("{regions}", regions).replace("{count}", str(n_boxes)))
    if "<" in text:
        raise DataError(f"think template {tpl!r} gives text with '<', which the answer grammar forbids")
    return text


def sft_target(mask: np.ndarray, shown: Sequence[int], target_name: str, top_k: int = 1,
               rng: Optional[np.random.Generator] = None, templates: Optional[dict] = None) -> SFTTarget:
    """The SFT target of a ``(D, H, W)`` stack mask, with the key slice among ``shown``.

    Raises :class:`medvolcore.errors.VolumeError` when the mask is empty on every shown slice.
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    anchor = anchor_from_mask(mask, top_k=int(top_k), rng=rng, candidates=[int(z) for z in shown])
    width, height = int(mask.shape[2]), int(mask.shape[1])
    boxes_norm = [box_to_norm(b, width, height) for b in anchor.boxes]
    think = think_sentence(target_name, anchor.slice, len(anchor.boxes), rng, templates)
    text = format_answer(anchor.slice, boxes_norm, think)
    return SFTTarget(int(anchor.slice), [list(map(int, b)) for b in anchor.boxes], boxes_norm, think, text)


def absent_think(target_name: str, rng: np.random.Generator, templates: Optional[dict] = None) -> str:
    """A templated reasoning sentence for a negative sample (the target is not in the volume)."""
    t = templates if templates is not None else resources.think_templates()
    options = t.get("absent_templates") or []
    if not options:
        raise DataError("think_templates.json has no 'absent_templates' for negative samples")
    tpl = options[int(rng.integers(len(options)))]
    text = tpl.replace("{target}", target_name)
    if "<" in text:
        raise DataError(f"think template {tpl!r} gives text with '<', which the answer grammar forbids")
    return text


def absent_target(target_name: str, rng: Optional[np.random.Generator] = None,
                  templates: Optional[dict] = None) -> SFTTarget:
    """The SFT target of a negative sample: ``<think>…</think><answer>[]</answer>``, no slice, no boxes."""
    rng = rng if rng is not None else np.random.default_rng(0)
    think = absent_think(target_name, rng, templates)
    return SFTTarget(None, [], [], think, absent_answer(think))


def reward_ground_truth(mask: np.ndarray, shown: Sequence[int]) -> Dict[str, object]:
    """What the rewards need: per-slice areas of the whole stack and boxes on each shown slice.

    ``slice_areas[z]`` is the foreground pixel count of stack slice ``z`` (every slice, not only
    the shown ones); ``boxes_norm[str(z)]`` / ``boxes[str(z)]`` hold the target boxes of each
    shown slice with foreground (normalised 0–1000 floats / inclusive pixels); shown slices
    without foreground are absent.
    """
    m = np.asarray(mask) != 0
    width, height = int(m.shape[2]), int(m.shape[1])
    areas = slice_areas(m)
    boxes, boxes_norm = {}, {}
    for z in shown:
        z = int(z)
        if areas[z] == 0:
            continue
        bx = boxes_from_slice_mask(m[z])
        boxes[str(z)] = [list(map(int, b)) for b in bx]
        boxes_norm[str(z)] = [[round(v, 4) for v in box_to_norm(b, width, height)] for b in bx]
    return {"slice_areas": [int(a) for a in areas], "boxes": boxes, "boxes_norm": boxes_norm}


__all__ = ["SFTTarget", "sft_target", "absent_target", "think_sentence", "absent_think", "reward_ground_truth"]
