"""MedSAM2 with masks we choose: the real sam2 model runs in full, then its mask output is replaced.

Random weights make masks that never end (every slice gets something), so early stop could not
be tested or measured with them. :func:`controlled_masks` patches one predictor instance so that
each tracking step still runs everything sam2 runs — image encoder, memory attention, mask
decoder, memory encoder, at full cost — but the mask it returns for object ``i`` on frame ``z``
is made from ``targets[i, z]`` (a boolean (H, W) slice at the video's resolution): logits +10 on
the low-resolution cells that the target touches, -10 elsewhere. So a target that ends on slice
``z`` gives empty masks after ``z``, as a good MedSAM2 would on an organ's last slice.

The prompt frame (the key slice's box) is left alone: only tracking steps are replaced, which is
where ``inference_state["tracking_obj_indices"]`` (set by MedVol's ``track_objects``) names the
objects of the batch. ``targets`` rows may be None: that object keeps sam2's own mask.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import numpy as np


def low_res_logits(target_slices: np.ndarray, size, torch):
    """(B, H, W) bool → (B, 1, h, w) float logits: +10 where a low-res cell holds any target pixel."""
    t = torch.from_numpy(np.ascontiguousarray(target_slices, dtype=np.float32))[:, None]
    cells = torch.nn.functional.adaptive_max_pool2d(t, output_size=tuple(size))
    return cells * 20.0 - 10.0


@contextlib.contextmanager
def controlled_masks(predictor, targets: Sequence[Optional[np.ndarray]]):
    """Within the block, tracked masks of object ``i`` follow ``targets[i]`` ((D, H, W) bool or None).

    Yields a list that records ``(frame_idx, [object indices])`` of every tracking step.
    """
    import torch

    original = predictor._run_single_frame_inference
    steps = []

    def patched(*args, **kwargs):
        out, masks = original(*args, **kwargs)
        state = kwargs["inference_state"]
        objs = state.get("tracking_obj_indices")
        if objs is None:  # the prompt frame: keep sam2's answer to the box
            return out, masks
        frame = int(kwargs["frame_idx"])
        steps.append((frame, list(objs)))
        masks = masks.clone()
        for row, i in enumerate(objs):
            if targets[i] is not None:
                logits = low_res_logits(targets[i][frame][None], masks.shape[-2:], torch)
                masks[row:row + 1] = logits.to(masks.dtype)
        out = dict(out, pred_masks=masks.to(out["pred_masks"].device))
        return out, masks

    predictor._run_single_frame_inference = patched
    try:
        yield steps
    finally:
        del predictor._run_single_frame_inference  # back to the class's method
