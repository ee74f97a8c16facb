"""MedSAM2 propagation: an evidence anchor (key slice + boxes) → a 3-D mask on the axial stack.

Built on the real ``sam2`` package (SAM2.1 Hiera-T, configured with the overrides in
``Resources/medsam2/medsam2_512.yaml``). What :class:`MedSAM2Propagator` adds to sam2's video
predictor (``docs/architecture.md``, "MedSAM2 frames" and "Propagation"):

* frames come from the in-memory HU stack and are preprocessed lazily, one at a time
  (:mod:`.frames`); nothing is written to disk;
* all boxes are seeded as separate objects of one inference state, tracked forward from the
  key slice, reset, re-seeded and tracked backward; objects and directions are ORed;
* each slice's image features are computed at most once per request: the key slice's
  features are pinned in the state's feature cache so they survive ``reset_state``, and the
  most recent frame's features are shared by all objects (:mod:`._sam2_predictor`);
* early stop (``stop_after_empty``) and batched tracking of several objects.

The predictor is built in :mod:`.build` (seeded random weights or a checkpoint); the inputs are
checked in :mod:`.inputs`; this module is the propagation itself.

Importing this module is cheap: torch and sam2 are imported by the functions that use them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import CancelledError, InputError
from ..windowing import WindowLike, get_window
from ..progress import cancel_checker
from ..maskprompt import runs_to_mask
from ..prompts import plan_objects
from .build import PREDICTOR_TARGET, check_image_size, checkpoint_predictor, random_predictor  # noqa: F401
from .frames import DEFAULT_IMAGE_SIZE, FeatureStore, MedSAM2Frames
from .inputs import (DEFAULT_STOP_AFTER_EMPTY, MAX_STOP_AFTER_EMPTY, _check_boxes, _check_key_slice, _check_stack,
                     _check_window_span, check_stop_after_empty)

__all__ = [
    "DEFAULT_STOP_AFTER_EMPTY",
    "MAX_STOP_AFTER_EMPTY",
    "MedSAM2Propagator",
    "PropagationResult",
    "check_image_size",
    "check_stop_after_empty",
    "keep_largest_component",
    "quiet_sam2_progress",
]

ProgressFn = Callable[[int, int, str], None]
CancelLike = Union[threading.Event, Callable[[], bool], None]


# --------------------------------------------------------------------------------------------
# sam2's progress bar (sam2 imported lazily)
# --------------------------------------------------------------------------------------------

_TQDM_LOCK = threading.Lock()
_TQDM_DEPTH = 0
_TQDM_SAVED = None


def _no_bar(iterable=None, *args, **kwargs):
    return iterable


@contextlib.contextmanager
def quiet_sam2_progress():
    """Silence sam2's own "propagate in video" tqdm bar (only sam2's video predictor module)."""
    global _TQDM_DEPTH, _TQDM_SAVED
    import sam2.sam2_video_predictor as vp

    with _TQDM_LOCK:
        if _TQDM_DEPTH == 0:
            _TQDM_SAVED = vp.tqdm
            vp.tqdm = _no_bar
        _TQDM_DEPTH += 1
    try:
        yield
    finally:
        with _TQDM_LOCK:
            _TQDM_DEPTH -= 1
            if _TQDM_DEPTH == 0:
                vp.tqdm = _TQDM_SAVED
                _TQDM_SAVED = None


# --------------------------------------------------------------------------------------------
# Results and helpers
# --------------------------------------------------------------------------------------------


@dataclass
class PropagationResult:
    """What :meth:`MedSAM2Propagator.propagate` returns.

    ``mask`` is (D, H, W) uint8 0/1 on the stack; ``object_masks`` (N, D, H, W) bool, one per
    box, when requested. ``slice_range`` is the inclusive range of slices actually propagated
    (visited); ``window_range`` the range that was allowed (the whole stack, or ``[k-W, k+W]``);
    they differ when propagation stopped early. ``encoded_slices`` are the slice indices the image
    encoder ran on, in order. ``stops`` says, per direction (``"forward"``: increasing ``z``,
    towards the feet; ``"backward"``), where propagation went: ``{"last_slice": z, "slices":
    n visited after the key slice, "stopped_early": bool, "objects_stopped": [[object, z], …]}``
    (``objects_stopped``: each object that ended, 0-based in box order, with its last visited
    slice). ``stop_after_empty`` is the K it ran with (0: never stop).
    """

    mask: np.ndarray
    key_slice: int
    slice_range: Tuple[int, int]
    slices_encoded: int
    encoder_calls: int
    seconds: float
    seconds_per_slice: float
    num_objects: int = 1
    encoded_slices: Tuple[int, ...] = ()
    object_masks: Optional[np.ndarray] = None
    window_range: Optional[Tuple[int, int]] = None
    stop_after_empty: int = 0
    stops: Optional[dict] = None
    batched: bool = False

    @property
    def slices_propagated(self) -> int:
        return self.slice_range[1] - self.slice_range[0] + 1

    def stop_summary(self) -> dict:
        """The early-stop facts as plain JSON (what the anchor file and the worker carry)."""
        return {"stop_after_empty": int(self.stop_after_empty), "key_slice": int(self.key_slice),
                "slice_range": [int(v) for v in self.slice_range],
                "window_range": [int(v) for v in (self.window_range or self.slice_range)],
                "directions": {d: dict(v) for d, v in (self.stops or {}).items()}}


def keep_largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 26-connected component of a 3-D boolean mask (ties: the first in scan order)."""
    from scipy import ndimage

    mask = np.asarray(mask, dtype=bool)
    labels, n = ndimage.label(mask, structure=np.ones((3,) * mask.ndim, dtype=bool))
    if n <= 1:
        return mask.copy()
    sizes = np.bincount(labels.ravel())
    sizes[0] = 0
    return labels == int(np.argmax(sizes))


# --------------------------------------------------------------------------------------------
# The propagator
# --------------------------------------------------------------------------------------------


class MedSAM2Propagator:
    """A frozen MedSAM2 (SAM2.1 Hiera-T) that propagates key-slice boxes through an axial stack.

    Build it with :meth:`from_checkpoint` (MedSAM2 weights, image size 512) or
    :meth:`from_random` (seeded random weights, for tests and smoke runs). ``predictor`` is
    the underlying sam2 ``SAM2VideoPredictor`` (a subclass of it). Calls to
    :meth:`propagate` are serialised by a lock; the object is reusable after errors and
    cancellation.
    """

    def __init__(self, predictor, *, image_size: int, device, source: str):
        self.predictor = predictor
        self.image_size = int(image_size)
        self.device = device
        self.source = source
        # bfloat16 autocast on CUDA (MedSAM2's own setting); False keeps fp32 there too (the GPU
        # check compares the two). The CPU always runs fp32.
        self.cuda_bf16 = True
        # torch.compile of the image encoder's trunk (Hiera), made at the first propagation: off by
        # default until measured figures on a GPU show it faster with its warm-up counted
        # (docs/benchmarks.md, "The GPU check")
        self.compile = False
        self._compiled = False
        self._lock = threading.Lock()

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def from_random(cls, seed: int, image_size: int = DEFAULT_IMAGE_SIZE, device="cpu") -> "MedSAM2Propagator":
        """Seeded random weights: the same seed gives the same weights; the caller's RNG is untouched."""
        model, size, dev, source = random_predictor(seed, image_size, device)
        return cls(model, image_size=size, device=dev, source=source)

    @classmethod
    def from_checkpoint(cls, path, device="cpu", image_size: int = DEFAULT_IMAGE_SIZE) -> "MedSAM2Propagator":
        """MedSAM2 weights from a sam2-style checkpoint: ``torch.load(path)["model"]``, loaded strictly."""
        model, size, dev, source = checkpoint_predictor(path, device, image_size)
        return cls(model, image_size=size, device=dev, source=source)

    def __repr__(self) -> str:
        return f"MedSAM2Propagator({self.source}, device={self.device})"

    # -- propagation -------------------------------------------------------------------------

    def _autocast(self):
        import torch

        if self.device.type == "cuda" and self.cuda_bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def propagate_many(
        self,
        stack_hu: np.ndarray,
        prompts: Sequence[Tuple[int, Sequence[Sequence[int]]]],
        *,
        hu_window: WindowLike = None,
        window: Optional[int] = None,
        largest_component: bool = False,
        stop_after_empty: int = 0,
        batch_objects: bool = True,
    ) -> List[PropagationResult]:
        """Propagate several independent prompts ``(key_slice, boxes)`` over one stack.

        Each prompt gives the same mask as its own :meth:`propagate` call, but image features are
        shared between them, so every slice is encoded at most once for the whole list (the
        rollouts of one GRPO group, say, which all look at the same volume). The features of
        every slice touched stay in memory until the call returns: keep ``window`` small.
        ``stop_after_empty`` defaults to 0 here (every slice of the window), the consistency
        reward's semantics; see :meth:`propagate`.
        """
        stack = _check_stack(stack_hu)
        win = get_window(hu_window)
        frames = MedSAM2Frames(stack, self.image_size, win, share_features=True)
        return [self.propagate(stack, k, boxes, hu_window=win, window=window, largest_component=largest_component,
                               stop_after_empty=stop_after_empty, batch_objects=batch_objects, _frames=frames)
                for k, boxes in prompts]

    def propagate(
        self,
        stack_hu: np.ndarray,
        key_slice: int,
        boxes: Sequence[Sequence[int]],
        *,
        prompts: Optional[Sequence[dict]] = None,
        z_range: Optional[Sequence[int]] = None,
        hu_window: WindowLike = None,
        window: Optional[int] = None,
        largest_component: bool = False,
        progress: Optional[ProgressFn] = None,
        cancel: CancelLike = None,
        return_object_masks: bool = False,
        stop_after_empty: int = 0,
        batch_objects: bool = True,
        features: Optional[FeatureStore] = None,
        _frames: Optional[MedSAM2Frames] = None,
    ) -> PropagationResult:
        """Propagate the boxes on ``key_slice``, and any correction prompts, through the stack.

        ``stack_hu``: (D, H, W) HU, canonical axial stack. ``boxes``: inclusive pixel boxes
        ``[x0, y0, x1, y1]`` on the key slice, objects 1..N. ``prompts``: correction prompts in
        pixel form (:mod:`medvolcore.prompts`: boxes, points or a painted mask on any slice for
        objects 1..N, or new objects N+1, …; a mask goes to sam2's ``add_new_mask``); ``z_range = (z0, z1)``: propagate only inside these slices.
        Semantics (``docs/architecture.md``, "Correction prompts"): per object and direction a
        fresh inference state gets every prompt of that object, and tracking starts from the
        object's start slice (the key slice, or a new object's first prompted slice); objects
        whose start slice and prompted slices are the same run in one state, as one batch.
        ``hu_window``: anything :func:`get_window` accepts (default soft tissue 40/400).
        ``window``: propagate only slices ``[k-window, k+window]`` (others stay 0 and are never
        encoded). ``largest_component``: keep each object's largest 3-D (26-connected) component
        before the union. ``progress(done, total, message)`` is called after each slice (and
        once for the slices an early stop skipped, so ``done`` reaches ``total``); ``cancel``
        (an Event or a callable) is checked between slices and raises :class:`CancelledError`.
        ``features``: a :class:`FeatureStore` of this stack (same HU window, same model) whose
        slices need no encoding and which keeps the slices encoded now.

        ``stop_after_empty = K``: in each direction, an object stops being tracked once its
        mask has been empty on ``K`` consecutive slices after its start slice, and the
        direction ends when no object is left; skipped slices stay 0 and are never encoded. A
        prompted slice never counts as empty, and an object is not stopped before its last
        prompted slice. Tracking is causal and objects are independent, so every slice that is
        visited gets exactly the mask of a full run (``K = 0``, the default here: never stop,
        the paper's behaviour); only a target that reappears after ``K`` empty slices is lost.
        ``result.stops`` says where each direction ended. ``batch_objects``: track the objects
        of a state as one batch (same masks as one by one; see ``track_objects``).
        """
        stack = _check_stack(stack_hu)
        depth, height, width = (int(s) for s in stack.shape)
        k = _check_key_slice(key_slice, depth)
        box_list = _check_boxes(boxes, width, height)
        objects = plan_objects(k, box_list, prompts or [], width=width, height=height, depth=depth, z_range=z_range)
        win = get_window(hu_window)
        span = _check_window_span(window)
        stop_k = check_stop_after_empty(stop_after_empty)
        lo, hi = (0, depth - 1) if span is None else (max(0, k - span), min(depth - 1, k + span))
        if z_range is not None:
            lo, hi = max(lo, int(z_range[0])), min(hi, int(z_range[1]))
        for obj in objects:
            outside = [z for z in obj.frames if not lo <= z <= hi]
            if outside:
                raise InputError(f"object {obj.number} is prompted on slice {outside[0]}, outside the propagated "
                                 f"slices {lo}..{hi}")
        is_cancelled = cancel_checker(cancel)
        if progress is not None and not callable(progress):
            raise InputError("progress must be a callable progress(done, total, message)")
        if features is not None and not isinstance(features, FeatureStore):
            raise InputError(f"features must be a FeatureStore, got {type(features).__name__}")

        import torch

        # objects with the same start and prompted slices share a state (and a batch)
        groups: "dict" = {}
        for i, obj in enumerate(objects):
            groups.setdefault((obj.start, tuple(obj.slices)), []).append(i)
        groups = list(groups.values())
        per_group = hi - lo + 1
        total = per_group * len(groups)
        n_obj = len(objects)
        keep_objects = bool(largest_component or return_object_masks)
        with self._lock:
            t0 = time.perf_counter()
            pred = self.predictor
            if self.compile and not self._compiled:
                pred.image_encoder.trunk.compile(dynamic=False)  # in place: the encoder's hooks stay outside
                self._compiled = True
            if _frames is not None:
                frames = _frames
            else:  # several states revisit the same slices: keep their features for the request
                frames = MedSAM2Frames(stack, self.image_size, win, share_features=len(groups) > 1,
                                       feature_store=features)
            n_encoded_before = len(frames.encoded)
            calls = [0]

            def _count(_module, _inputs):
                calls[0] += 1

            hook = pred.image_encoder.register_forward_pre_hook(_count)
            obj_masks = np.zeros((n_obj, depth, height, width), dtype=bool) if keep_objects else None
            mask = np.zeros((depth, height, width), dtype=np.uint8)
            progressed = [0]  # what progress() was last told (visited + skipped slices)
            visited = set()
            stops = {"forward": [], "backward": []}
            if is_cancelled():
                hook.remove()
                raise CancelledError(f"propagation cancelled after 0 of {total} slices")
            try:
                with torch.inference_mode(), self._autocast(), quiet_sam2_progress():
                    for group in groups:
                        members = [objects[i] for i in group]
                        start = members[0].start
                        frames.pinned = set(members[0].frames)
                        state = pred.init_state_from_frames(frames, height, width)
                        passes = [("forward", False, hi - start, hi)]
                        if start > lo:  # sam2 also skips reverse tracking that starts at frame 0
                            passes.append(("backward", True, start - lo, lo))
                        for p_i, (direction, reverse, n_track, edge) in enumerate(passes):
                            if p_i:
                                pred.reset_state(state)
                            for j, obj in enumerate(members):
                                for z, (box, points) in obj.frames.items():
                                    if z in obj.masks:  # a painted slice: sam2's own mask input
                                        pred.add_new_mask(state, frame_idx=z, obj_id=j + 1,
                                                          mask=runs_to_mask(obj.masks[z], width, height))
                                        continue
                                    kw = {}
                                    if box is not None:
                                        kw["box"] = np.asarray(box, dtype=np.float32)
                                    if points:
                                        kw["points"] = np.asarray([[x, y] for x, y, _ in points], dtype=np.float32)
                                        kw["labels"] = np.asarray([lab for _, _, lab in points], dtype=np.int32)
                                    pred.add_new_points_or_box(state, frame_idx=z, obj_id=j + 1, **kw)
                            gen = pred.track_objects(state, start_frame_idx=start, max_frame_num_to_track=n_track,
                                                     reverse=reverse, stop_after_empty=stop_k,
                                                     batch_objects=batch_objects)
                            last = start
                            alive = list(range(len(group)))
                            ended = []
                            try:
                                for frame_idx, objs, logits in gen:
                                    last = frame_idx
                                    for i in alive:
                                        if i not in objs:
                                            ended.append([group[i], int(frame_idx - (1 if not reverse else -1))])
                                    alive = list(objs)
                                    m = (logits[:, 0] > 0).cpu().numpy()
                                    if keep_objects:
                                        obj_masks[[group[i] for i in objs], frame_idx] |= m
                                    else:
                                        mask[frame_idx] |= m.any(axis=0)
                                    visited.add(frame_idx)
                                    if frame_idx == start and p_i:
                                        continue  # the start slice was counted by the forward pass
                                    progressed[0] += 1
                                    if progress is not None:
                                        progress(progressed[0], total, f"slice {frame_idx} ({direction})")
                                    if progressed[0] < total and is_cancelled():
                                        raise CancelledError(f"propagation cancelled after {len(visited)} of "
                                                             f"{per_group} slices")
                            finally:
                                gen.close()
                            early = last != edge
                            if early:
                                ended += [[group[i], int(last)] for i in alive]
                                skipped = abs(edge - last)
                                progressed[0] += skipped
                                if progress is not None:
                                    a, b = sorted((last + (1 if not reverse else -1), edge))
                                    progress(progressed[0], total,
                                             f"slices {a}..{b} skipped ({direction}): every mask empty on {stop_k} slices")
                            stops[direction].append((int(last), bool(early), ended if stop_k else []))
                        if len(passes) == 1:  # the start slice is the lower edge: nothing to go back to
                            stops["backward"].append((int(start), False, []))
                        pred.reset_state(state)
                        state["cached_features"] = {}
            finally:
                hook.remove()
            if keep_objects:
                if largest_component:
                    for i in range(n_obj):
                        obj_masks[i] = keep_largest_component(obj_masks[i])
                mask = obj_masks.any(axis=0).astype(np.uint8)
            merged = {}
            for direction, pick in (("forward", max), ("backward", min)):
                last = pick(v[0] for v in stops[direction])
                merged[direction] = {"last_slice": last, "slices": abs(last - k),
                                     "stopped_early": all(v[1] for v in stops[direction]),
                                     "objects_stopped": sorted(o for v in stops[direction] for o in v[2])}
            slice_range = (merged["backward"]["last_slice"], merged["forward"]["last_slice"])
            seconds = time.perf_counter() - t0
            encoded = tuple(frames.encoded[n_encoded_before:])
            return PropagationResult(
                mask=mask,
                key_slice=k,
                slice_range=slice_range,
                slices_encoded=len(set(encoded)),
                encoder_calls=calls[0],
                seconds=seconds,
                seconds_per_slice=seconds / max(len(visited), 1),
                num_objects=n_obj,
                encoded_slices=encoded,
                object_masks=obj_masks if return_object_masks else None,
                window_range=(lo, hi),
                stop_after_empty=stop_k,
                stops=merged,
                batched=bool(batch_objects and any(len(g) > 1 for g in groups)),
            )
