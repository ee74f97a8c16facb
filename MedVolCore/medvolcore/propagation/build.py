"""Building MedSAM2's predictor: sam2's packaged SAM2.1 Hiera-T config with MedSAM2's overrides
(``Resources/medsam2/medsam2_512.yaml``), with seeded random weights or a checkpoint loaded strictly.

Hydra instantiates :data:`PREDICTOR_TARGET` (:mod:`._sam2_predictor`, imported only here, inside
the function that builds). Importing this module is cheap: torch and sam2 are imported by the
functions that use them. :class:`~.propagator.MedSAM2Propagator`'s ``from_random`` and
``from_checkpoint`` build through :func:`random_predictor` and :func:`checkpoint_predictor`.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Tuple

from ..devices import resolve_device
from ..errors import CheckpointError, DependencyError, InputError
from ..resources import resource_path

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


def _require_sam2() -> None:
    """:class:`DependencyError` (one line, with how to install) unless torch and sam2 import."""
    try:
        import torch  # noqa: F401
        import sam2  # noqa: F401  (initialises hydra with sam2's config module)
        from sam2.sam2_video_predictor import SAM2VideoPredictor  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DependencyError(f"MedSAM2 propagation needs torch and sam2 ({e}); {_SAM2_HINT}") from e


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


def random_predictor(seed: int, image_size: int, device) -> tuple:
    """``(predictor, image size, device, source)`` of seeded random weights: the same seed gives
    the same weights; the caller's RNG is untouched."""
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
    return model, size, dev, f"random weights (seed {int(seed)}, image size {size})"


def checkpoint_predictor(path, device, image_size: int) -> tuple:
    """``(predictor, image size, device, source)`` of MedSAM2 weights from a sam2-style checkpoint:
    ``torch.load(path)["model"]``, loaded strictly (:class:`CheckpointError` naming what differs)."""
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
    return model, size, dev, str(p)
