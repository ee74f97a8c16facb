"""A painted slice as a prompt: a 2-D mask's run-length form and the files a mask is read from.

A mask prompt (``medvol.anchor/4``, :mod:`medvolcore.prompts`) carries ``{"runs": [s0, n0, ...]}``:
the foreground runs of a ``W × H`` canonical slice in row-major order (pixel ``(x, y)`` is index
``y·W + x``). :func:`mask_to_runs` and :func:`runs_to_mask` convert between that and a boolean
``(H, W)`` array; :func:`mask_prompt` builds the prompt; :func:`read_mask_file` reads the mask of
``medvol propagate --mask-prompt Z K FILE``:

* ``.npy``: a 2-D ``(H, W)`` array on canonical slice ``Z`` (rows ``y``, columns ``x``, as box
  pixels), any real or boolean type, non-zero = inside;
* ``.png``: a grayscale, black-and-white or palette PNG of ``W × H`` pixels (image row = ``y``),
  non-zero = inside;
* ``.nii``, ``.nii.gz``, ``.nrrd``, ``.nhdr``, ``.mha``, ``.mhd`` (a label map): a 3-D mask on
  the volume's own grid (its axes may be stored in another order or direction; it is put on the
  volume's grid exactly, never resampled), whose non-zero voxels all lie on slice ``Z`` of the
  canonical stack (what Slicer's "export to label map" of one painted slice gives).

Every problem is one :class:`~medvolcore.errors.InputError` naming the file: a missing file, an
unknown suffix, another shape or grid, voxels off slice ``Z``, an empty mask.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import numpy as np

from .errors import InputError, MedVolError

__all__ = ["MASK_FILE_SUFFIXES", "mask_prompt", "mask_to_runs", "read_mask_file", "runs_to_mask"]

MASK_FILE_SUFFIXES = (".npy", ".png", ".nii", ".nii.gz", ".nrrd", ".nhdr", ".mha", ".mhd")
_LABEL_MAP_SUFFIXES = MASK_FILE_SUFFIXES[2:]
_MAX_MASK_FILE_BYTES = 256 << 20  # a 2-D mask file larger than this is not a slice's mask


def mask_to_runs(mask) -> List[int]:
    """The row-major foreground runs ``[s0, n0, s1, n1, ...]`` of a 2-D mask (non-zero = inside)."""
    m = np.asarray(mask)
    if m.ndim != 2:
        raise InputError(f"a mask prompt is a 2-D (H, W) mask, got shape {m.shape}")
    flat = np.concatenate(([False], (m != 0).ravel(), [False]))
    edges = np.flatnonzero(flat[1:] != flat[:-1])
    starts, ends = edges[0::2], edges[1::2]
    return np.stack([starts, ends - starts], axis=1).ravel().astype(int).tolist()


def runs_to_mask(runs, width: int, height: int) -> np.ndarray:
    """The boolean ``(H, W)`` mask of runs already checked (:func:`medvolcore.prompts.check_mask_runs`)."""
    flat = np.zeros(int(width) * int(height), dtype=bool)
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    for s, n in r:
        flat[s:s + n] = True
    return flat.reshape(int(height), int(width))


def mask_prompt(slice_index: int, obj: int, mask) -> dict:
    """The pixel-form mask prompt of object ``obj`` (1-based) on slice ``slice_index``."""
    return {"slice": int(slice_index), "object": int(obj), "box": None, "points": [],
            "mask": {"runs": mask_to_runs(mask)}}


def _suffix(path: Path) -> str:
    name = path.name.lower()
    return ".nii.gz" if name.endswith(".nii.gz") else path.suffix.lower()


def read_mask_file(path, stack, z: int, what: str = "--mask-prompt") -> np.ndarray:
    """The boolean ``(H, W)`` mask of canonical slice ``z`` of ``stack`` (an
    :class:`~medvolcore.stack.AxialStack`) that file ``path`` holds (formats: the module's docstring)."""
    p = Path(path)
    head = f"{what} {p}"
    if not 0 <= int(z) < stack.depth:
        raise InputError(f"{what}: slice {z} is outside the stack (0..{stack.depth - 1})")
    if not p.is_file():
        raise InputError(f"{head} does not exist" if not p.exists() else f"{head} is not a file")
    suffix = _suffix(p)
    if suffix not in MASK_FILE_SUFFIXES:
        raise InputError(f"{head}: a mask file is .npy or .png (the {stack.width}×{stack.height} slice) or a label "
                         f"map on the volume's grid ({', '.join(_LABEL_MAP_SUFFIXES)}), not {suffix or 'no suffix'}")
    if p.stat().st_size > _MAX_MASK_FILE_BYTES:
        raise InputError(f"{head} is {p.stat().st_size / 2**20:.0f} MB: too large for one slice's mask")
    if suffix in _LABEL_MAP_SUFFIXES:
        m = _label_map_slice(p, stack, int(z), head)
    else:
        m = _read_2d(p, suffix, head)
        if m.shape != (stack.height, stack.width):
            raise InputError(f"{head} is {m.shape[1]}×{m.shape[0]} pixels but the volume's axial slices are "
                             f"{stack.width}×{stack.height} (W×H): is it for another volume?")
    if not m.any():
        raise InputError(f"{head} is empty: paint the object on slice {z} (a mask prompt needs at least one pixel)")
    return m


def _read_2d(p: Path, suffix: str, head: str) -> np.ndarray:
    if suffix == ".npy":
        try:
            a = np.load(p, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise InputError(f"{head} is not a readable .npy array ({str(e).splitlines()[0] if str(e) else e})") from None
        if not (a.dtype == bool or np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
            raise InputError(f"{head} holds {a.dtype} values; a mask is boolean or numbers (non-zero = inside)")
        if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
            raise InputError(f"{head} holds NaN or infinite values; a mask is 0 outside, non-zero inside")
    else:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(p) as im:
                if im.mode not in ("1", "L", "P", "I", "I;16", "F"):
                    raise InputError(f"{head} is a {im.mode} picture; save the mask as a grayscale PNG "
                                     "(0 outside, non-zero inside)")
                a = np.asarray(im)
        except (UnidentifiedImageError, OSError) as e:
            raise InputError(f"{head} is not a readable PNG ({e})") from None
    if a.ndim != 2:
        raise InputError(f"{head} holds a {a.ndim}-D array of shape {a.shape}; a slice's mask is 2-D (H, W)")
    return a != 0


def _label_map_slice(p: Path, stack, z: int, head: str) -> np.ndarray:
    from .geometry import match_grids
    from .volume import load_label_map

    vol = stack.volume
    try:
        labels = load_label_map(p, max_voxels=int(np.prod(vol.shape)) * 2)
        m = match_grids(vol.shape, vol.affine, labels.shape, labels.affine, "the volume", str(p))
    except MedVolError as e:
        raise InputError(f"{head}: {e}") from None
    if m.kind == "resampled":
        raise InputError(f"{head} is not on the volume's grid ({m.note}); write the mask on the volume's own voxels")
    from nibabel.orientations import apply_orientation

    arr = np.asarray(labels.array) != 0
    if m.kind == "reoriented":
        arr = np.ascontiguousarray(apply_orientation(arr, m.ornt))
    on_stack = stack.to_stack(arr)
    others = sorted(set(np.flatnonzero(on_stack.any(axis=(1, 2))).tolist()) - {z})
    if others:
        raise InputError(f"{head} has voxels on slice{'s' if len(others) > 1 else ''} "
                         f"{', '.join(map(str, others[:5]))}{', …' if len(others) > 5 else ''}, not only on slice {z}: "
                         "a mask prompt is one painted slice")
    return np.array(on_stack[z], dtype=bool)
