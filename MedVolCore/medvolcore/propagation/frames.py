"""MedSAM2's frames: an axial HU slice → the model's input, exactly as MedSAM2's scripts make it.

window → uint8 → RGB → PIL bicubic resize to S×S → /255 → ImageNet mean/std (``docs/architecture.md``,
"MedSAM2 frames"). :class:`MedSAM2Frames` serves them lazily, one slice at a time, from the
in-memory stack: nothing is written to disk. Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..windowing import WindowLike, get_window, window_to_uint8

__all__ = ["DEFAULT_IMAGE_SIZE", "IMAGENET_MEAN", "IMAGENET_STD", "MedSAM2Frames", "medsam2_frame"]

DEFAULT_IMAGE_SIZE = 512
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def medsam2_frame(slice_hu: np.ndarray, image_size: int = DEFAULT_IMAGE_SIZE, window: WindowLike = None) -> np.ndarray:
    """One axial slice (H, W) in HU → MedSAM2's model input, a (3, S, S) float32 array.

    window → uint8 → RGB → PIL bicubic resize to S×S → /255 → ImageNet mean/std. The
    arithmetic after the resize is done in float64 and rounded once to float32, which is
    what MedSAM2's scripts get (a float64 array normalised with float32 constants, cast to
    float32 by the predictor).
    """
    from PIL import Image

    u8 = window_to_uint8(slice_hu, window)
    rgb = Image.fromarray(u8).convert("RGB").resize((image_size, image_size), Image.BICUBIC)
    x = np.asarray(rgb, dtype=np.float64).transpose(2, 0, 1) / 255.0
    mean = np.asarray(IMAGENET_MEAN, dtype=np.float32).astype(np.float64)[:, None, None]
    std = np.asarray(IMAGENET_STD, dtype=np.float32).astype(np.float64)[:, None, None]
    return ((x - mean) / std).astype(np.float32)


class MedSAM2Frames:
    """A lazy sequence of MedSAM2 frames over an HU stack, used as an inference state's "images".

    ``frames[z]`` preprocesses slice ``z`` on demand (see :func:`medsam2_frame`) and returns a
    (3, S, S) float32 CPU tensor; nothing is cached here (the predictor caches features).
    It also carries the per-request bookkeeping of the feature cache: ``pinned`` (frame
    indices whose features must survive cache eviction and ``reset_state``), ``loaded`` and
    ``encoded`` (frame indices in the order they were preprocessed / encoded). With
    ``share_features`` the image features of every encoded slice are also kept in
    ``feature_store`` and reused by later propagations over the same frames (several box
    prompts on one volume, e.g. the rollouts of one GRPO group): each slice is encoded once.
    """

    def __init__(self, stack_hu: np.ndarray, image_size: int, window: WindowLike = None, share_features: bool = False):
        self.stack = stack_hu
        self.image_size = int(image_size)
        self.window = get_window(window)
        self.pinned: set = set()
        self.loaded: list = []
        self.encoded: list = []
        self.feature_store: Optional[dict] = {} if share_features else None

    def __len__(self) -> int:
        return int(self.stack.shape[0])

    @property
    def video_height(self) -> int:
        return int(self.stack.shape[1])

    @property
    def video_width(self) -> int:
        return int(self.stack.shape[2])

    def __getitem__(self, index):
        import torch

        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"frame index must be an int, got {type(index).__name__}")
        n = len(self)
        z = int(index) + n if index < 0 else int(index)
        if not 0 <= z < n:
            raise IndexError(f"frame {index} out of range for {n} frames")
        self.loaded.append(z)
        return torch.from_numpy(medsam2_frame(self.stack[z], self.image_size, self.window))

    def __repr__(self) -> str:
        return f"MedSAM2Frames({len(self)} frames {self.video_height}x{self.video_width} → {self.image_size}, window={self.window})"
