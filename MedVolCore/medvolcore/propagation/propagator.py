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

Importing this module is cheap: torch and sam2 are imported by the functions that use them.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..devices import resolve_device
from ..errors import CancelledError, CheckpointError, DependencyError, InputError
from ..resources import resource_path
from ..windowing import WindowLike, get_window
from ..progress import cancel_checker
from ..maskprompt import runs_to_mask
from ..prompts import plan_objects
from .frames import DEFAULT_IMAGE_SIZE, FeatureStore, MedSAM2Frames

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

# Early stop: each direction ends once every object's mask has been empty on this many
# consecutive slices (0 = never: the MedVol-R1 paper's whole-volume propagation). Why 2: see
# docs/benchmarks.md, "Early stop" (no interior gap in any reference label at 3 mm; a mask
# that vanishes on one slice and comes back is still followed; each extra slice costs ~2
# slices of work per target).
DEFAULT_STOP_AFTER_EMPTY = 2
MAX_STOP_AFTER_EMPTY = 10000
# Hiera's windowed positional embedding needs (image_size / 4) to be a multiple of 8.
_IMAGE_SIZE_MULTIPLE = 32
_IMAGE_SIZE_MIN, _IMAGE_SIZE_MAX = 32, 2048

# what hydra instantiates (a module-level class in a module only predictor builders import)
PREDICTOR_TARGET = "medvolcore.propagation._sam2_predictor.MedSAM2VideoPredictor"

_SAM2_HINT = (
    "run `python3 MedVolCore/bootstrap.py`, or install it with "
    "`SAM2_BUILD_CUDA=0 pip install --no-deps --no-build-isolation sam2==1.1.0` "
    "(plus hydra-core, iopath, pillow and tqdm)"
)

ProgressFn = Callable[[int, int, str], None]
CancelLike = Union[threading.Event, Callable[[], bool], None]


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


def check_image_size(image_size) -> int:
    """``image_size`` as a model input size sam2's Hiera accepts; :class:`InputError` otherwise."""
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
    overrides = [f"++model._target_={PREDICTOR_TARGET}"] + overrides
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
    from ._sam2_predictor import MedSAM2VideoPredictor

    if not isinstance(model, MedSAM2VideoPredictor):  # pragma: no cover - defensive
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
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise InputError(f"seed must be an integer, got {seed!r}")
        size = check_image_size(image_size)
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
        size = check_image_size(image_size)
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
