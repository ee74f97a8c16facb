"""The CVPR 2025 text-guided segmentation challenge's file layout, read and written as it is.

Inputs ``DIR/imgs/<case>.npz``: ``imgs`` (a 3-D array), ``spacing`` (mm per array axis, in the
array's axis order, as the official script hands it to the surface distance) and ``text_prompts``
(a dict: class id → text, plus ``instance_label`` 0 or 1). Ground truth ``DIR/gts/<case>.npz``:
``gts``, a label map of the image's shape. Predictions ``<case>.npz``: ``segs``, uint8, the image's
shape and axis order, each voxel the id of the prompt that claimed it.

``text_prompts`` is a pickled object inside the npz. It is unpickled by a reader that only builds
arrays, dicts and plain scalars (:class:`_PromptUnpickler`): a crafted file cannot run code here.

The image becomes a :class:`~medvolcore.volume.CTVolume` whose array axes 0, 1, 2 are taken as
superior, posterior and left (the order of a SimpleITK array of an LPS image, the challenge's
source): axis 0 is the axial slice index. Only the voxel grid matters for the result: the segs are
written on the image's own grid and axis order.
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import numpy as np

from .errors import DataError

INSTANCE_KEY = "instance_label"
MAX_LABEL = 255  # the official script casts gts and segs to uint8


class _PromptUnpickler(pickle.Unpickler):
    """Unpickles a numpy object array of a dict of texts and numbers, and nothing that runs code."""

    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("builtins", "dict"), ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in text_prompts")


def _read_object(zf: zipfile.ZipFile, member: str):
    with zf.open(member) as f:
        version = np.lib.format.read_magic(f)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = reader(f)
        if dtype.hasobject:
            arr = _PromptUnpickler(io.BytesIO(f.read())).load()
        else:
            return None
    return arr.item() if isinstance(arr, np.ndarray) and arr.shape == () else arr


@dataclass
class ChallengeImage:
    """One input case: its file name (``case.npz``), image, spacing, prompts and instance flag."""

    name: str
    imgs: np.ndarray
    spacing: tuple
    prompts: Dict[int, str] = field(default_factory=dict)
    instance: bool = False

    @property
    def stem(self) -> str:
        return self.name[:-4] if self.name.endswith(".npz") else self.name


def case_files(folder) -> List[Path]:
    """The ``*.npz`` files of ``folder``, sorted by name (the official script's order)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder")
    files = sorted(p for p in folder.iterdir() if p.name.endswith(".npz") and p.is_file())
    if not files:
        raise DataError(f"{folder} holds no .npz file")
    return files


def _prompts(raw, path: Path) -> tuple:
    if not isinstance(raw, dict):
        raise DataError(f"{path.name}: text_prompts is not a dict of class id → text")
    instance = raw.get(INSTANCE_KEY, 0)
    try:
        instance = int(instance)
    except (TypeError, ValueError):
        instance = -1
    if instance not in (0, 1):
        raise DataError(f"{path.name}: text_prompts[{INSTANCE_KEY!r}] must be 0 or 1")
    prompts = {}
    for key, text in raw.items():
        if key == INSTANCE_KEY:
            continue
        try:
            cid = int(str(key).strip())
        except ValueError:
            raise DataError(f"{path.name}: prompt key {key!r} is not a class id") from None
        if not 1 <= cid <= MAX_LABEL:
            raise DataError(f"{path.name}: class id {cid} is outside 1–{MAX_LABEL} (the segs are uint8)")
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{path.name}: the prompt of class {cid} is not a text")
        prompts[cid] = str(text)
    if not prompts:
        raise DataError(f"{path.name}: text_prompts holds no class prompt")
    return prompts, bool(instance)


def read_image(path) -> ChallengeImage:
    """Read one input case; a malformed file is one :class:`DataError` line naming it."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            missing = {"imgs.npy", "spacing.npy", "text_prompts.npy"} - names
            if missing:
                raise DataError(f"{path.name}: missing {', '.join(sorted(n[:-4] for n in missing))}")
            raw_prompts = _read_object(zf, "text_prompts.npy")
        with np.load(path, allow_pickle=False) as z:
            imgs, spacing = z["imgs"], np.asarray(z["spacing"], dtype=float).ravel()
    except DataError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, KeyError) as e:
        raise DataError(f"{path.name}: not a readable challenge npz ({type(e).__name__}: {e})") from None
    if imgs.ndim != 3 or min(imgs.shape) < 1 or not np.issubdtype(imgs.dtype, np.number):
        raise DataError(f"{path.name}: imgs must be a 3-D numeric array, got {imgs.dtype} {imgs.shape}")
    if spacing.size != 3 or not all(math.isfinite(s) and s > 0 for s in spacing):
        raise DataError(f"{path.name}: spacing must be three positive numbers (mm), got {spacing.tolist()}")
    prompts, instance = _prompts(raw_prompts, path)
    return ChallengeImage(path.name, imgs, tuple(float(s) for s in spacing), prompts, instance)


def read_gts(path, shape) -> np.ndarray:
    """The ground truth label map of a case (``gts``), checked against the image's shape."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            gts = z["gts"]
    except (OSError, ValueError, zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"{path}: no readable gts ({type(e).__name__}: {e})") from None
    if tuple(gts.shape) != tuple(shape):
        raise DataError(f"{path.name}: gts {tuple(gts.shape)} and imgs {tuple(shape)} differ in shape")
    return gts


def read_segs(path) -> np.ndarray:
    with np.load(path, allow_pickle=False) as z:
        return z["segs"]


def write_segs(path, segs: np.ndarray, overwrite: bool = True) -> Path:
    """Write ``segs`` (uint8) atomically as ``path`` with the single key ``segs``."""
    from medvolcore.fileio import atomic_path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, overwrite=overwrite) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, segs=np.asarray(segs, dtype=np.uint8))
    return path


def volume_of(image: ChallengeImage):
    """The image as a :class:`~medvolcore.volume.CTVolume` (axes 0, 1, 2: superior, posterior, left)."""
    from medvolcore.volume import CTVolume

    s0, s1, s2 = image.spacing
    affine = np.array([[0.0, 0.0, -s2, 0.0], [0.0, -s1, 0.0, 0.0], [s0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    return CTVolume(np.asarray(image.imgs, dtype=np.float32), affine, spacing=image.spacing, path=image.name)


def write_image(path, imgs: np.ndarray, spacing, prompts: Dict[int, str], instance: bool = False) -> Path:
    """Write an input case in the challenge layout (tests and the conversion of label maps)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tp = {str(k): v for k, v in prompts.items()}
    tp[INSTANCE_KEY] = int(bool(instance))
    np.savez_compressed(path, imgs=imgs, spacing=np.asarray(spacing, dtype=float), text_prompts=tp)
    return path
