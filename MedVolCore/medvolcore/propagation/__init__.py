"""MedSAM2 propagation: an evidence anchor (key slice + boxes) → a 3-D mask on the axial stack.

- :mod:`.frames` — MedSAM2's preprocessing of an axial HU slice, served lazily from memory, and
  the stores that keep a volume's encoded slices for later propagations;
- :mod:`.build` — building the predictor: sam2's config with MedSAM2's overrides, seeded random
  weights or a checkpoint loaded strictly;
- :mod:`.inputs` — the inputs of a propagation checked (stack, key slice, boxes, window, early stop);
- :mod:`.propagator` — :class:`MedSAM2Propagator` (``from_checkpoint``/``from_random`` through
  :mod:`.build`; propagate forward and backward, early stop) and :class:`PropagationResult`;
- :mod:`._sam2_predictor` — the subclass of sam2's video predictor that hydra builds (imports
  torch and sam2; only :mod:`.build` imports it, inside the function that builds).

Importing this package is cheap: torch and sam2 are imported by the functions that use them.
"""

from .frames import (DEFAULT_IMAGE_SIZE, IMAGENET_MEAN, IMAGENET_STD, FeatureCache, FeatureStore, MedSAM2Frames,
                     medsam2_frame)
from .propagator import (DEFAULT_STOP_AFTER_EMPTY, MAX_STOP_AFTER_EMPTY, MedSAM2Propagator, PropagationResult,
                         check_image_size, check_stop_after_empty, keep_largest_component, quiet_sam2_progress)

__all__ = [
    "DEFAULT_IMAGE_SIZE",
    "DEFAULT_STOP_AFTER_EMPTY",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "FeatureCache",
    "FeatureStore",
    "MAX_STOP_AFTER_EMPTY",
    "MedSAM2Frames",
    "MedSAM2Propagator",
    "PropagationResult",
    "check_image_size",
    "check_stop_after_empty",
    "keep_largest_component",
    "medsam2_frame",
    "quiet_sam2_progress",
]
