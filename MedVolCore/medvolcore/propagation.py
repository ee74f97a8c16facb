"""MedSAM2 propagation: an evidence anchor (key slice + boxes) → a 3-D mask on the axial stack.

Built on the real ``sam2`` package (SAM2.1 Hiera-T, configured with the overrides in
``Resources/medsam2/medsam2_512.yaml``). What this module adds to sam2's video predictor
(ARCHITECTURE.md, "MedSAM2 frames"):

* frames come from the in-memory HU stack and are preprocessed lazily, one at a time, exactly
  as MedSAM2's scripts do (window → uint8 → RGB → PIL bicubic resize → /255 → ImageNet
  mean/std); nothing is written to disk;
* all boxes are seeded as separate objects of one inference state, tracked forward from the
  key slice, reset, re-seeded and tracked backward; objects and directions are ORed;
* each slice's image features are computed at most once per request: the key slice's
  features are pinned in the state's feature cache so they survive ``reset_state``, and the
  most recent frame's features are shared by all objects (sam2 tracks objects one by one).

Importing this module is cheap: torch and sam2 are imported by the functions that use them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .devices import resolve_device
from .errors import CancelledError, CheckpointError, DependencyError, InputError
from .resources import resource_path
from .windowing import WindowLike, get_window, window_to_uint8

__all__ = [
    "DEFAULT_IMAGE_SIZE",
    "DEFAULT_STOP_AFTER_EMPTY",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "MedSAM2Frames",
    "MedSAM2Propagator",
    "PropagationResult",
    "check_stop_after_empty",
    "keep_largest_component",
    "medsam2_frame",
    "quiet_sam2_progress",
]

DEFAULT_IMAGE_SIZE = 512
# Early stop: each direction ends once every object's mask has been empty on this many
# consecutive slices (0 = never: the MedVol-R1 paper's whole-volume propagation). Why 2: see
# the README's "Early stop" section (no interior gap in any reference label at 3 mm; a mask
# that vanishes on one slice and comes back is still followed; each extra slice costs ~2
# slices of work per target).
DEFAULT_STOP_AFTER_EMPTY = 2
MAX_STOP_AFTER_EMPTY = 10000
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Hiera's windowed positional embedding needs (image_size / 4) to be a multiple of 8.
_IMAGE_SIZE_MULTIPLE = 32
_IMAGE_SIZE_MIN, _IMAGE_SIZE_MAX = 32, 2048

_SAM2_HINT = (
    "run `python3 MedVolCore/bootstrap.py`, or install it with "
    "`SAM2_BUILD_CUDA=0 pip install --no-deps --no-build-isolation sam2==1.1.0` "
    "(plus hydra-core, iopath, pillow and tqdm)"
)

ProgressFn = Callable[[int, int, str], None]
CancelLike = Union[threading.Event, Callable[[], bool], None]


# --------------------------------------------------------------------------------------------
# Frames
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# sam2 glue (imported lazily)
# --------------------------------------------------------------------------------------------


def _require_sam2():
    try:
        import torch  # noqa: F401
        import sam2  # noqa: F401  (initialises hydra with sam2's config module)
        from sam2.sam2_video_predictor import SAM2VideoPredictor  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DependencyError(f"MedSAM2 propagation needs torch and sam2 ({e}); {_SAM2_HINT}") from e


@functools.lru_cache(maxsize=None)
def _predictor_class():
    """The sam2 video predictor subclass (defined on first use so importing us stays cheap)."""
    _require_sam2()
    import torch
    from sam2.sam2_video_predictor import SAM2VideoPredictor

    class _MedSAM2VideoPredictor(SAM2VideoPredictor):
        """sam2's video predictor with in-memory lazy frames and a pinned feature cache."""

        @torch.inference_mode()
        def init_state_from_frames(self, frames, video_height: int, video_width: int, warm_up: bool = False) -> dict:
            """An inference state over ``frames`` (any sequence of (3, S, S) tensors).

            Same keys as sam2 1.1.0's ``init_state``, which only accepts a path. Unlike it,
            there is no warm-up encode of frame 0 unless ``warm_up`` is true.
            """
            device = self.device
            state = {}
            state["images"] = frames
            state["num_frames"] = len(frames)
            state["offload_video_to_cpu"] = False
            state["offload_state_to_cpu"] = False
            state["video_height"] = int(video_height)
            state["video_width"] = int(video_width)
            state["device"] = device
            state["storage_device"] = device
            state["point_inputs_per_obj"] = {}
            state["mask_inputs_per_obj"] = {}
            state["cached_features"] = {}
            state["constants"] = {}
            state["obj_id_to_idx"] = OrderedDict()
            state["obj_idx_to_id"] = OrderedDict()
            state["obj_ids"] = []
            state["output_dict_per_obj"] = {}
            state["temp_output_dict_per_obj"] = {}
            state["frames_tracked_per_obj"] = {}
            if warm_up:
                self._get_image_feature(state, frame_idx=0, batch_size=1)
            return state

        def _get_image_feature(self, inference_state, frame_idx, batch_size):
            frames = inference_state["images"]
            if isinstance(frames, MedSAM2Frames):
                cache = inference_state["cached_features"]
                store = frames.feature_store
                if frame_idx not in cache:
                    if store is not None and frame_idx in store:
                        entry = store[frame_idx]
                    else:
                        image = frames[frame_idx].to(inference_state["device"]).float().unsqueeze(0)
                        entry = (image, self.forward_image(image))
                        frames.encoded.append(int(frame_idx))
                        if store is not None:
                            store[frame_idx] = entry
                    # keep the pinned frames (the key slice) and the most recent one
                    kept = {k: v for k, v in cache.items() if k in frames.pinned}
                    kept[frame_idx] = entry
                    inference_state["cached_features"] = kept
            # a cache hit now for our frames; sam2's stock behaviour for any other "images"
            return super()._get_image_feature(inference_state, frame_idx, batch_size)

        @torch.inference_mode()
        def track_objects(self, inference_state, start_frame_idx: int, max_frame_num_to_track: int,
                          reverse: bool = False, stop_after_empty: int = 0, batch_objects: bool = True):
            """sam2's ``propagate_in_video`` for one direction, with early stop and batched tracking.

            Yields ``(frame_idx, obj_indices, video_res_logits)`` per frame, in sam2's processing
            order (the same frames ``propagate_in_video`` visits for these arguments), where
            ``obj_indices`` are the 0-based indices of the objects still tracked on that frame and
            ``video_res_logits`` is ``(len(obj_indices), 1, H, W)`` at the video's resolution.

            ``stop_after_empty = K > 0``: an object whose mask (logit > 0) has been empty on ``K``
            consecutive frames after the start frame stops being tracked; the generator ends when
            no object is left. ``K = 0`` tracks every object to the end (sam2's behaviour).
            sam2 1.1 tracks objects one by one, each with its own memory; ``batch_objects`` runs
            the still-tracked objects of a frame as one batch instead (the way sam2 1.0 tracked
            them), on a batched view of their memories. Objects never interact either way (no
            non-overlap constraint is applied: ``non_overlap_masks*`` are False in MedSAM2's
            config, and batching is refused otherwise), so dropping one object leaves the
            others' masks unchanged.

            During each tracking step ``inference_state["tracking_obj_indices"]`` holds the
            objects of that step (a list of indices, in batch order), for instrumentation.
            """
            self.propagate_in_video_preflight(inference_state)
            per_obj = inference_state["output_dict_per_obj"]
            n_obj = self._get_obj_num(inference_state)
            num_frames = inference_state["num_frames"]
            if reverse:
                end = max(start_frame_idx - max_frame_num_to_track, 0)
                # sam2 skips reverse tracking that starts at frame 0
                order = range(start_frame_idx, end - 1, -1) if start_frame_idx > 0 else range(0)
            else:
                end = min(start_frame_idx + max_frame_num_to_track, num_frames - 1)
                order = range(start_frame_idx, end + 1)
            if batch_objects and (self.non_overlap_masks or self.non_overlap_masks_for_mem_enc):
                batch_objects = False  # objects interact there: keep sam2's one-by-one tracking
            active = list(range(n_obj))
            empty_run = [0] * n_obj
            batched = None  # output dict of the active objects, batched along dim 0
            for frame_idx in order:
                preds = {}
                todo = []
                for i in active:
                    cond = per_obj[i]["cond_frame_outputs"]
                    if frame_idx in cond:  # the prompted frame: its output is already there
                        preds[i] = cond[frame_idx]["pred_masks"].to(inference_state["device"], non_blocking=True)
                        if self.clear_non_cond_mem_around_input:
                            self._clear_obj_non_cond_mem_around_input(inference_state, frame_idx, i)
                    else:
                        todo.append(i)
                if todo and batch_objects and len(todo) > 1:
                    if batched is None or batched["objects"] != todo:
                        batched = _batched_outputs(per_obj, todo, batched)
                    inference_state["tracking_obj_indices"] = list(todo)
                    out, masks = self._run_single_frame_inference(
                        inference_state=inference_state, output_dict=batched, frame_idx=frame_idx,
                        batch_size=len(todo), is_init_cond_frame=False, point_inputs=None, mask_inputs=None,
                        reverse=reverse, run_mem_encoder=True)
                    batched["non_cond_frame_outputs"][frame_idx] = out
                    for row, i in enumerate(todo):
                        preds[i] = masks[row:row + 1]
                else:
                    for i in todo:
                        if batched is not None:  # back to one by one: hand the batched memory back
                            _unbatch_outputs(per_obj, batched)
                            batched = None
                        inference_state["tracking_obj_indices"] = [i]
                        out, masks = self._run_single_frame_inference(
                            inference_state=inference_state, output_dict=per_obj[i], frame_idx=frame_idx,
                            batch_size=1, is_init_cond_frame=False, point_inputs=None, mask_inputs=None,
                            reverse=reverse, run_mem_encoder=True)
                        per_obj[i]["non_cond_frame_outputs"][frame_idx] = out
                        preds[i] = masks
                inference_state.pop("tracking_obj_indices", None)
                for i in active:
                    inference_state["frames_tracked_per_obj"][i][frame_idx] = {"reverse": reverse}
                objs = list(active)
                all_masks = torch.cat([preds[i] for i in objs], dim=0) if len(objs) > 1 else preds[objs[0]]
                _, video_res = self._get_orig_video_res_output(inference_state, all_masks)
                yield frame_idx, objs, video_res
                if stop_after_empty > 0 and frame_idx != start_frame_idx:
                    nonempty = (video_res[:, 0] > 0).flatten(1).any(dim=1).tolist()
                    for i, ne in zip(objs, nonempty):
                        empty_run[i] = 0 if ne else empty_run[i] + 1
                    active = [i for i in objs if empty_run[i] < stop_after_empty]
                    if not active:
                        return
            if batched is not None:
                _unbatch_outputs(per_obj, batched)

    _MedSAM2VideoPredictor.__module__ = __name__
    _MedSAM2VideoPredictor.__qualname__ = "_MedSAM2VideoPredictor"
    return _MedSAM2VideoPredictor


def _stack_outputs(outs: list) -> dict:
    """sam2 per-frame outputs of single objects → one output with the objects along dim 0."""
    import torch

    first = outs[0]
    merged = {}
    for key, value in first.items():
        if value is None:
            merged[key] = None
        elif key == "maskmem_pos_enc":  # the same for every object (sam2 stores one expanded copy)
            merged[key] = [x[:1].expand(len(outs), *x.shape[1:]) for x in value]
        else:
            merged[key] = torch.cat([o[key] for o in outs], dim=0)
    return merged


def _row_output(out: dict, row: int) -> dict:
    return {key: (None if v is None else [x[row:row + 1] for x in v] if isinstance(v, list) else v[row:row + 1])
            for key, v in out.items()}


def _batched_outputs(per_obj: dict, objects: list, previous: Optional[dict]) -> dict:
    """A sam2 output dict for ``objects`` tracked as one batch (rows in the order of ``objects``).

    ``previous`` (a batched dict of an earlier object set) is handed back to the per-object dicts
    first, so every object's memory is complete before the new batch is built.
    """
    if previous is not None:
        _unbatch_outputs(per_obj, previous)
    batched = {"objects": list(objects), "cond_frame_outputs": {}, "non_cond_frame_outputs": {}}
    for key in ("cond_frame_outputs", "non_cond_frame_outputs"):
        frames = per_obj[objects[0]][key].keys()
        for t in frames:
            batched[key][t] = _stack_outputs([per_obj[i][key][t] for i in objects])
    return batched


def _unbatch_outputs(per_obj: dict, batched: dict) -> None:
    """Write the frames tracked in a batch back to each object's own output dict (as row views)."""
    for t, out in batched["non_cond_frame_outputs"].items():
        for row, i in enumerate(batched["objects"]):
            per_obj[i]["non_cond_frame_outputs"][t] = _row_output(out, row)


def __getattr__(name):
    # lets hydra locate "medvolcore.propagation._MedSAM2VideoPredictor" without importing
    # sam2 when this module is imported
    if name == "_MedSAM2VideoPredictor":
        return _predictor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _check_image_size(image_size) -> int:
    if isinstance(image_size, bool) or not isinstance(image_size, numbers.Integral):
        raise InputError(f"image_size must be an integer, got {image_size!r}")
    s = int(image_size)
    if s % _IMAGE_SIZE_MULTIPLE or not _IMAGE_SIZE_MIN <= s <= _IMAGE_SIZE_MAX:
        raise InputError(
            f"image_size {s} is not supported: use a multiple of {_IMAGE_SIZE_MULTIPLE} between "
            f"{_IMAGE_SIZE_MIN} and {_IMAGE_SIZE_MAX} (MedSAM2 itself is 512; 64 or 128 for quick tests)"
        )
    return s


def _hydra_overrides(image_size: int) -> Tuple[list, str]:
    from omegaconf import OmegaConf

    spec = OmegaConf.load(resource_path("medsam2", "medsam2_512.yaml"))
    fmt = {"image_size": image_size, "feat_size": image_size // 16}
    return [str(o).format(**fmt) for o in spec.overrides], str(spec.base_config)


def _build_predictor(image_size: int):
    """A randomly initialised predictor on the CPU, in eval mode (uses the global torch RNG)."""
    _require_sam2()
    from sam2.build_sam import build_sam2_video_predictor

    overrides, base_config = _hydra_overrides(image_size)
    overrides = [f"++model._target_={__name__}._MedSAM2VideoPredictor"] + overrides
    # sam2's builder adds its postprocessing defaults after ours (dynamic multimask,
    # binarised click masks for memory, fill_hole_area=8); hole filling needs sam2's CUDA
    # extension and makes CPU and GPU disagree, so it is switched off again below.
    try:
        model = build_sam2_video_predictor(
            base_config, ckpt_path=None, device="cpu", mode="eval", hydra_overrides_extra=overrides
        )
    except Exception as e:
        raise DependencyError(
            f"could not build MedSAM2 from sam2's packaged config {base_config} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); is sam2 1.1.0 installed? {_SAM2_HINT}"
        ) from e
    model.fill_hole_area = 0
    if not isinstance(model, _predictor_class()):  # pragma: no cover - defensive
        raise DependencyError(f"sam2 built {type(model).__name__}, not MedVol's predictor; {_SAM2_HINT}")
    return model


def _summarise(names, limit: int = 4) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (", …" if len(names) > limit else "")


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


def _cancel_checker(cancel: CancelLike) -> Callable[[], bool]:
    if cancel is None:
        return lambda: False
    if hasattr(cancel, "is_set"):
        return cancel.is_set
    if callable(cancel):
        return lambda: bool(cancel())
    raise InputError(f"cancel must be a threading.Event or a zero-argument callable, got {type(cancel).__name__}")


def _check_stack(stack_hu) -> np.ndarray:
    a = np.asarray(stack_hu)
    if a.ndim != 3 or min(a.shape) < 1:
        raise InputError(f"the stack must be a 3-D (D, H, W) array with every side ≥ 1, got shape {a.shape}")
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == bool) or np.issubdtype(a.dtype, np.complexfloating):
        raise InputError(f"the stack must hold real numbers (HU), got dtype {a.dtype}")
    if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
        raise InputError("the stack holds NaN or infinite values; replace them (e.g. with -1024 HU) first")
    return a


def _as_index(v, what: str) -> int:
    if isinstance(v, (bool, np.bool_)):
        raise InputError(f"{what} must be an integer pixel index, got {v!r}")
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real) and math.isfinite(float(v)) and float(v).is_integer():
        return int(v)
    raise InputError(f"{what} must be an integer pixel index, got {v!r}")


def _check_key_slice(key_slice, depth: int) -> int:
    try:
        k = _as_index(key_slice, "key_slice")
    except InputError:
        raise InputError(f"key_slice must be an integer slice index in 0..{depth - 1}, got {key_slice!r}") from None
    if not 0 <= k < depth:
        raise InputError(f"key slice {k} is outside the stack: it has {depth} slices (0..{depth - 1})")
    return k


def _check_boxes(boxes, width: int, height: int) -> list:
    if boxes is None:
        raise InputError("at least one box [x0, y0, x1, y1] is needed on the key slice")
    try:
        items = list(boxes)
    except TypeError:
        raise InputError(f"boxes must be a list of [x0, y0, x1, y1] pixel boxes, got {boxes!r}") from None
    if not items:
        raise InputError("at least one box [x0, y0, x1, y1] is needed on the key slice")
    if len(items) == 4 and all(isinstance(v, numbers.Real) for v in items):
        raise InputError(f"boxes must be a list of boxes; wrap a single box in a list: [{list(items)}]")
    out = []
    for i, b in enumerate(items):
        try:
            vals = list(np.asarray(b).ravel().tolist()) if not isinstance(b, (list, tuple)) else list(b)
        except Exception:
            vals = None
        if vals is None or len(vals) != 4:
            raise InputError(f"box {i} must be [x0, y0, x1, y1], got {b!r}")
        x0, y0, x1, y1 = (_as_index(v, f"box {i} coordinate") for v in vals)
        if not (0 <= x0 <= x1 < width and 0 <= y0 <= y1 < height):
            raise InputError(
                f"box {i} [{x0}, {y0}, {x1}, {y1}] is not an inclusive pixel box on a {width}×{height} slice: "
                f"need 0 ≤ x0 ≤ x1 < {width} and 0 ≤ y0 ≤ y1 < {height}"
            )
        out.append((x0, y0, x1, y1))
    return out


def check_stop_after_empty(value, what: str = "stop_after_empty") -> int:
    """``value`` as an integer K ≥ 0 (0: never stop early); :class:`InputError` otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise InputError(f"{what} must be an integer number of slices ≥ 0 (0 = never stop early), got {value!r}")
    if int(value) > MAX_STOP_AFTER_EMPTY:
        raise InputError(f"{what} {int(value)} is too large: use 0 (never stop) or at most {MAX_STOP_AFTER_EMPTY}")
    return int(value)


def _check_window_span(window) -> Optional[int]:
    if window is None:
        return None
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, numbers.Integral) or int(window) < 0:
        raise InputError(f"window must be None (whole stack) or an integer number of slices ≥ 0, got {window!r}")
    return int(window)


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
        self._lock = threading.Lock()

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def from_random(cls, seed: int, image_size: int = DEFAULT_IMAGE_SIZE, device="cpu") -> "MedSAM2Propagator":
        """Seeded random weights: the same seed gives the same weights; the caller's RNG is untouched."""
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise InputError(f"seed must be an integer, got {seed!r}")
        size = _check_image_size(image_size)
        _require_sam2()
        import torch

        dev = resolve_device(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            model = _build_predictor(size)
        model = model.to(dev)
        return cls(model, image_size=size, device=dev, source=f"random weights (seed {int(seed)}, image size {size})")

    @classmethod
    def from_checkpoint(cls, path, device="cpu", image_size: int = DEFAULT_IMAGE_SIZE) -> "MedSAM2Propagator":
        """MedSAM2 weights from a sam2-style checkpoint: ``torch.load(path)["model"]``, loaded strictly."""
        size = _check_image_size(image_size)
        _require_sam2()
        import torch

        dev = resolve_device(device)
        p = Path(path).expanduser()
        if not p.is_file():
            raise CheckpointError(f"MedSAM2 checkpoint {p} does not exist (or is not a file)")
        try:
            ckpt = torch.load(str(p), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"{p} is not a loadable MedSAM2 checkpoint ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                "expected a torch.save file holding {'model': state_dict}"
            ) from e
        if not isinstance(ckpt, dict) or "model" not in ckpt or not isinstance(ckpt["model"], dict):
            what = f"a dict with keys {_summarise(map(str, ckpt))}" if isinstance(ckpt, dict) else type(ckpt).__name__
            raise CheckpointError(f"{p} is not a MedSAM2 checkpoint: expected a dict with a 'model' state dict, found {what}")
        sd = ckpt["model"]
        with torch.random.fork_rng(devices=[]):
            model = _build_predictor(size)
        expected = model.state_dict()
        missing = [k for k in expected if k not in sd]
        unexpected = [k for k in sd if k not in expected]
        wrong = [
            f"{k}: {tuple(getattr(sd[k], 'shape', ()))} vs {tuple(v.shape)}"
            for k, v in expected.items()
            if k in sd and (not isinstance(sd[k], torch.Tensor) or tuple(sd[k].shape) != tuple(v.shape))
        ]
        if missing or unexpected or wrong:
            parts = []
            if missing:
                parts.append(f"{len(missing)} missing keys ({_summarise(missing)})")
            if unexpected:
                parts.append(f"{len(unexpected)} unexpected keys ({_summarise(unexpected)})")
            if wrong:
                parts.append(f"{len(wrong)} tensors with the wrong shape (checkpoint vs model: {_summarise(wrong, 3)})")
            raise CheckpointError(
                f"{p} is not a MedSAM2 checkpoint: " + ", ".join(parts)
                + f"; expected SAM2.1 Hiera-T weights (MedSAM2_latest.pt) for image size {size}"
            )
        try:
            model.load_state_dict(sd, strict=True)
        except RuntimeError as e:  # pragma: no cover - the checks above should catch everything
            raise CheckpointError(f"{p} is not a MedSAM2 checkpoint: {str(e).splitlines()[0]}") from e
        model = model.to(dev).eval()
        return cls(model, image_size=size, device=dev, source=str(p))

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
        hu_window: WindowLike = None,
        window: Optional[int] = None,
        largest_component: bool = False,
        progress: Optional[ProgressFn] = None,
        cancel: CancelLike = None,
        return_object_masks: bool = False,
        stop_after_empty: int = 0,
        batch_objects: bool = True,
        _frames: Optional[MedSAM2Frames] = None,
    ) -> PropagationResult:
        """Propagate the boxes on ``key_slice`` through the stack; returns a :class:`PropagationResult`.

        ``stack_hu``: (D, H, W) HU, canonical axial stack. ``boxes``: inclusive pixel boxes
        ``[x0, y0, x1, y1]`` on the key slice, one object each. ``hu_window``: anything
        :func:`get_window` accepts (default soft tissue 40/400). ``window``: propagate only
        slices ``[k-window, k+window]`` (others stay 0 and are never encoded).
        ``largest_component``: keep each object's largest 3-D (26-connected) component
        before the union. ``progress(done, total, message)`` is called after each slice (and
        once for the slices an early stop skipped, so ``done`` reaches ``total``);
        ``cancel`` (an Event or a callable) is checked between slices and raises
        :class:`CancelledError`.

        ``stop_after_empty = K``: in each direction, an object stops being tracked once its
        mask has been empty on ``K`` consecutive slices after the key slice, and the direction
        ends when no object is left; skipped slices stay 0 and are never encoded. Tracking is
        causal and objects are independent, so every slice that is visited gets exactly the
        mask of a full run (``K = 0``, the default here: never stop, the paper's behaviour);
        only a target that reappears after ``K`` empty slices is lost. ``result.stops`` says
        where each direction ended. ``batch_objects``: track all objects of a slice as one
        batch (same masks as one by one; see ``track_objects``).
        """
        stack = _check_stack(stack_hu)
        depth, height, width = (int(s) for s in stack.shape)
        k = _check_key_slice(key_slice, depth)
        box_list = _check_boxes(boxes, width, height)
        win = get_window(hu_window)
        span = _check_window_span(window)
        stop_k = check_stop_after_empty(stop_after_empty)
        lo, hi = (0, depth - 1) if span is None else (max(0, k - span), min(depth - 1, k + span))
        is_cancelled = _cancel_checker(cancel)
        if progress is not None and not callable(progress):
            raise InputError("progress must be a callable progress(done, total, message)")

        import torch

        total = hi - lo + 1
        n_obj = len(box_list)
        keep_objects = bool(largest_component or return_object_masks)
        with self._lock:
            t0 = time.perf_counter()
            pred = self.predictor
            frames = _frames if _frames is not None else MedSAM2Frames(stack, self.image_size, win)
            frames.pinned = {k}
            n_encoded_before = len(frames.encoded)
            calls = [0]

            def _count(_module, _inputs):
                calls[0] += 1

            hook = pred.image_encoder.register_forward_pre_hook(_count)
            obj_masks = np.zeros((n_obj, depth, height, width), dtype=bool) if keep_objects else None
            mask = np.zeros((depth, height, width), dtype=np.uint8)
            done = set()
            progressed = [0]  # what progress() was last told (visited + skipped slices)
            stops = {}
            if is_cancelled():
                hook.remove()
                raise CancelledError(f"propagation cancelled after 0 of {total} slices")
            try:
                with torch.inference_mode(), self._autocast(), quiet_sam2_progress():
                    state = pred.init_state_from_frames(frames, height, width)
                    passes = [("forward", False, hi - k, hi)]
                    if k > lo:  # sam2 also skips reverse tracking that starts at frame 0
                        passes.append(("backward", True, k - lo, lo))
                    for p_i, (direction, reverse, n_track, edge) in enumerate(passes):
                        if p_i:
                            pred.reset_state(state)
                        for obj_i, box in enumerate(box_list):
                            pred.add_new_points_or_box(
                                state, frame_idx=k, obj_id=obj_i + 1, box=np.asarray(box, dtype=np.float32)
                            )
                        gen = pred.track_objects(state, start_frame_idx=k, max_frame_num_to_track=n_track,
                                                 reverse=reverse, stop_after_empty=stop_k,
                                                 batch_objects=batch_objects)
                        last = k
                        alive = list(range(n_obj))
                        ended = []
                        try:
                            for frame_idx, objs, logits in gen:
                                last = frame_idx
                                for i in alive:
                                    if i not in objs:
                                        ended.append([i, int(frame_idx - (1 if not reverse else -1))])
                                alive = list(objs)
                                m = (logits[:, 0] > 0).cpu().numpy()
                                if keep_objects:
                                    obj_masks[objs, frame_idx] |= m
                                else:
                                    mask[frame_idx] |= m.any(axis=0)
                                if frame_idx in done:
                                    continue
                                done.add(frame_idx)
                                progressed[0] += 1
                                if progress is not None:
                                    progress(progressed[0], total, f"slice {frame_idx} ({direction})")
                                if len(done) < total and is_cancelled():
                                    raise CancelledError(f"propagation cancelled after {len(done)} of {total} slices")
                        finally:
                            gen.close()
                        early = last != edge
                        if early:
                            ended += [[i, int(last)] for i in alive]
                            skipped = abs(edge - last)
                            progressed[0] += skipped
                            if progress is not None:
                                a, b = sorted((last + (1 if not reverse else -1), edge))
                                progress(progressed[0], total,
                                         f"slices {a}..{b} skipped ({direction}): every mask empty on {stop_k} slices")
                        stops[direction] = {"last_slice": int(last), "slices": int(abs(last - k)),
                                            "stopped_early": bool(early),
                                            "objects_stopped": sorted(ended) if stop_k else []}
                    pred.reset_state(state)
                    state["cached_features"] = {}
            finally:
                hook.remove()
            if keep_objects:
                if largest_component:
                    for i in range(n_obj):
                        obj_masks[i] = keep_largest_component(obj_masks[i])
                mask = obj_masks.any(axis=0).astype(np.uint8)
            if "backward" not in stops:  # the key slice is the lower edge: nothing to go back to
                stops["backward"] = {"last_slice": k, "slices": 0, "stopped_early": False, "objects_stopped": []}
            visited = (stops["backward"]["last_slice"], stops["forward"]["last_slice"])
            seconds = time.perf_counter() - t0
            return PropagationResult(
                mask=mask,
                key_slice=k,
                slice_range=visited,
                slices_encoded=len(set(frames.encoded[n_encoded_before:])),
                encoder_calls=calls[0],
                seconds=seconds,
                seconds_per_slice=seconds / (visited[1] - visited[0] + 1),
                num_objects=n_obj,
                encoded_slices=tuple(frames.encoded[n_encoded_before:]),
                object_masks=obj_masks if return_object_masks else None,
                window_range=(lo, hi),
                stop_after_empty=stop_k,
                stops=stops,
                batched=bool(batch_objects and n_obj > 1),
            )
