"""MedSAM2's frames: an axial HU slice → the model's input, exactly as MedSAM2's scripts make it.

window → uint8 → RGB → PIL bicubic resize to S×S → /255 → ImageNet mean/std (``docs/architecture.md``,
"MedSAM2 frames"). :class:`MedSAM2Frames` serves them lazily, one slice at a time, from the
in-memory stack: nothing is written to disk. Importing this module does not import torch.
"""

from __future__ import annotations

import collections
import threading
from typing import Hashable, Optional

import numpy as np

from ..windowing import WindowLike, get_window, window_to_uint8

__all__ = ["DEFAULT_IMAGE_SIZE", "IMAGENET_MEAN", "IMAGENET_STD", "FeatureCache", "FeatureStore", "MedSAM2Frames",
           "medsam2_frame"]

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

    def __init__(self, stack_hu: np.ndarray, image_size: int, window: WindowLike = None, share_features: bool = False,
                 feature_store: Optional["FeatureStore"] = None):
        self.stack = stack_hu
        self.image_size = int(image_size)
        self.window = get_window(window)
        self.pinned: set = set()
        self.loaded: list = []
        self.encoded: list = []
        if feature_store is None and share_features:
            feature_store = FeatureStore()
        self.feature_store: Optional[FeatureStore] = feature_store

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


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


class FeatureStore:
    """The image features of a volume's encoded slices, kept for later propagations over it.

    Maps a slice index to what sam2's feature cache holds, ``(image, backbone_out)``, stored
    compactly: the predictor never reads the image back (only the backbone's features), so a
    1×1 placeholder stands for it, and the positional encodings, the same for every slice of a
    given size, are kept once. That leaves the three feature maps: about 4.2 MB a slice at
    512 px in fp32 (32×128², 64×64², 256×32² values). ``nbytes`` is what the stored features
    take. With an ``owner`` (a :class:`FeatureCache`), an entry is only kept when the owner
    finds room for it within its budget; a slice not kept is simply encoded again next time.
    """

    def __init__(self, owner: Optional["FeatureCache"] = None):
        self._items: dict = {}
        self._pos = None
        self.nbytes = 0
        self.owner = owner
        self.closed = False  # dropped from its cache: serves what it has, stores no more

    def __contains__(self, frame_idx) -> bool:
        return frame_idx in self._items

    def __getitem__(self, frame_idx):
        return self._items[frame_idx]

    def __len__(self) -> int:
        return len(self._items)

    def __setitem__(self, frame_idx, entry) -> None:
        import torch

        if frame_idx in self._items or self.closed:
            return
        image, out = entry
        fpn, pos = list(out["backbone_fpn"]), list(out["vision_pos_enc"])
        shared = self._pos is not None and len(pos) == len(self._pos) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(pos, self._pos))
        size = _tensor_bytes(fpn) + (0 if shared else _tensor_bytes(pos))
        if self.owner is not None and not self.owner._make_room(self, size):
            return
        if shared:
            pos = self._pos
        elif self._pos is None:
            self._pos = pos
        self._items[frame_idx] = (image[:, :, :1, :1].clone(), {"backbone_fpn": fpn, "vision_pos_enc": pos})
        self.nbytes += size

    def clear(self) -> None:
        self._items.clear()
        self._pos = None
        self.nbytes = 0


class FeatureCache:
    """Feature stores of several volumes within one memory budget, evicted least recently used.

    :meth:`store` gives the :class:`FeatureStore` for a key (the worker uses the volume's content
    sha256 with the HU window, the model's image size and its weights: features depend on all
    of them); when a store grows past the budget, whole stores of other keys are dropped, oldest
    use first, and a store that alone fills the budget keeps what it has and stores no more.
    """

    def __init__(self, budget_bytes: int):
        self.budget = max(0, int(budget_bytes))
        self._stores: "collections.OrderedDict[Hashable, FeatureStore]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def store(self, key: Hashable) -> Optional[FeatureStore]:
        """The store for ``key`` (made on first use), marked most recently used; None with a zero budget."""
        if self.budget == 0:
            return None
        with self._lock:
            st = self._stores.get(key)
            if st is None:
                st = self._stores[key] = FeatureStore(owner=self)
            self._stores.move_to_end(key)
            return st

    def discard(self, key: Hashable) -> None:
        with self._lock:
            st = self._stores.pop(key, None)
        if st is not None:
            st.owner, st.closed = None, True

    def discard_prefix(self, first) -> None:
        """Drop every store whose key is a tuple starting with ``first`` (a volume's stores under
        all of its HU windows and generations)."""
        with self._lock:
            keys = [k for k in self._stores if isinstance(k, tuple) and k[:1] == (first,)]
        for key in keys:
            self.discard(key)

    def clear(self) -> None:
        with self._lock:
            for st in self._stores.values():
                st.owner, st.closed = None, True
            self._stores.clear()

    @property
    def nbytes(self) -> int:
        return sum(st.nbytes for st in self._stores.values())

    def _make_room(self, store: FeatureStore, size: int) -> bool:
        with self._lock:
            while self.nbytes + size > self.budget:
                victim = next((k for k, st in self._stores.items() if st is not store), None)
                if victim is None:
                    return False
                dropped = self._stores.pop(victim)
                dropped.owner, dropped.closed = None, True
                self.evictions += 1
            return True

    def describe(self) -> dict:
        with self._lock:
            return {"volumes": len(self._stores), "slices": sum(len(s) for s in self._stores.values()),
                    "bytes": self.nbytes, "budget_bytes": self.budget, "evictions": self.evictions}
