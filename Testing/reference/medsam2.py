#!/usr/bin/env python3
"""Reference propagation loop, written the way MedSAM2's own CT inference script works.

It is the yardstick for ``medvolcore.propagation`` (same weights, same frames), not product
code. Per box, separately:

1. preprocess *all* slices eagerly into one float64 tensor (window → uint8 → RGB → PIL
   bicubic resize → /255 → ImageNet mean/std, as MedSAM2's script does);
2. a fresh inference state over that tensor, with ``init_state``'s warm-up encode of frame 0;
3. add the box on the key slice, propagate forward, ``reset_state``, add the box again,
   propagate backward; OR every predicted mask (logit > 0) into the result.

Everything runs on sam2's stock ``SAM2VideoPredictor`` methods: in particular the stock
``_get_image_feature`` with its one-frame feature cache (our subclass hands any "images"
that are not ``MedSAM2Frames`` to the stock method), so it costs about ``(D + 2) · boxes``
image-encoder calls.

``reference_propagate_prompts`` extends it to ``medvol.anchor/2``'s correction prompts and
``z_range`` (boxes and points on any slice, for the key-slice objects or for new ones), the same
way: per object and direction a fresh state, one ``add_new_points_or_box`` call per (object,
slice), ``propagate_in_video`` from the object's start slice limited by ``max_frame_num_to_track``. A
mask prompt (``medvol.anchor/4``: a painted 2-D mask for an object on a slice) is sam2's own
``add_new_mask`` call for that (object, slice), in place of ``add_new_points_or_box``.

As a script it is the whole-process counterpart of ``medvol propagate``::

    python Testing/reference/medsam2.py --volume CT.nii.gz --slice Z \
        --box X0 Y0 X1 Y1 [--box ...] --out MASK.nii.gz --random-weights SEED --image-size N [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import OrderedDict

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def medsam2_style_frames(stack_hu, image_size, hu_window=None):
    """All frames at once, as MedSAM2's CT script builds them: a (D, 3, S, S) float64 tensor."""
    import torch
    from PIL import Image

    from medvolcore.windowing import window_to_uint8

    u8 = window_to_uint8(stack_hu, hu_window)
    d = u8.shape[0]
    resized = np.zeros((d, 3, image_size, image_size))  # float64, as in MedSAM2's script
    for i in range(d):
        img = Image.fromarray(u8[i]).convert("RGB").resize((image_size, image_size), Image.BICUBIC)
        resized[i] = np.array(img).transpose(2, 0, 1)
    frames = torch.from_numpy(resized / 255.0)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32)[:, None, None]
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32)[:, None, None]
    frames -= mean
    frames /= std
    return frames


def _init_state(model, images, video_height, video_width):
    """sam2 1.1.0's ``init_state`` for an in-memory frame tensor (MedSAM2 patches init_state the
    same way), including its warm-up encode of frame 0 through the stock feature path."""
    device = model.device
    state = {
        "images": images,
        "num_frames": len(images),
        "offload_video_to_cpu": False,
        "offload_state_to_cpu": False,
        "video_height": int(video_height),
        "video_width": int(video_width),
        "device": device,
        "storage_device": device,
        "point_inputs_per_obj": {},
        "mask_inputs_per_obj": {},
        "cached_features": {},
        "constants": {},
        "obj_id_to_idx": OrderedDict(),
        "obj_idx_to_id": OrderedDict(),
        "obj_ids": [],
        "output_dict_per_obj": {},
        "temp_output_dict_per_obj": {},
        "frames_tracked_per_obj": {},
    }
    model._get_image_feature(state, frame_idx=0, batch_size=1)
    return state


@contextlib.contextmanager
def _reference_run(propagator_or_model, stack_hu, hu_window):
    """What both reference loops share: the sam2 model, every frame preprocessed at once (once for
    all objects: redoing it per object could only slow the reference down), an empty (D, H, W)
    uint8 result and a counter of image-encoder passes; inside inference mode, bfloat16 autocast
    on CUDA and sam2's progress bar silenced. Yields ``(model, images, seg, calls)``."""
    import torch

    model = getattr(propagator_or_model, "predictor", propagator_or_model)
    stack = np.asarray(stack_hu)
    calls = [0]

    def _count(_module, _inputs):
        calls[0] += 1

    hook = model.image_encoder.register_forward_pre_hook(_count)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if model.device.type == "cuda" else _nullcontext()
    )
    try:
        with torch.inference_mode(), autocast, _quiet_tqdm():
            images = medsam2_style_frames(stack, int(model.image_size), hu_window)
            if model.device.type == "cuda":
                images = images.to(model.device)
            yield model, images, np.zeros(stack.shape, dtype=np.uint8), calls
    finally:
        hook.remove()


def reference_propagate(propagator_or_model, stack_hu, key_slice, boxes, hu_window=None):
    """MedSAM2-script-style propagation of ``boxes`` (inclusive pixel boxes on ``key_slice``).

    ``propagator_or_model`` is a ``MedSAM2Propagator`` or any sam2 ``SAM2VideoPredictor``.
    Returns ``(mask, encoder_calls)``: the (D, H, W) uint8 union and the number of
    image-encoder forward passes it took.
    """
    with _reference_run(propagator_or_model, stack_hu, hu_window) as (model, images, seg, calls):
        h, w = seg.shape[1:]
        for box in boxes:
            state = _init_state(model, images, h, w)
            bbox = np.asarray(box, dtype=np.float32)
            for reverse in (False, True):
                model.add_new_points_or_box(state, frame_idx=key_slice, obj_id=1, box=bbox)
                for frame_idx, _ids, logits in model.propagate_in_video(
                    state, start_frame_idx=key_slice, reverse=reverse
                ):
                    seg[frame_idx][(logits[0, 0] > 0.0).cpu().numpy()] = 1
                model.reset_state(state)
            del state
    return seg, calls[0]


def _group_prompts(n_boxes, key_slice, boxes, prompts):
    """Per object, in object order: ``(start_slice, [(slice, box or None, [[x, y, label], ...], mask or None), ...])``.

    One entry per (object, slice): the slice's box (the key-slice box for objects 1..N) and all
    its points in list order, or its mask (a mask replaces the key-slice box; nothing else may share
    its slice). Slices are in the order the object first receives a prompt there (for objects 1..N
    the key slice first, for a new object the slice of its first prompt).
    """
    objects = [(key_slice, OrderedDict([(key_slice, [list(b), [], None])])) for b in boxes]
    for i, p in enumerate(prompts):
        k = int(p["object"])
        if k == len(objects) + 1:  # a new object: its first prompt is its start slice
            objects.append((int(p["slice"]), OrderedDict()))
        elif not 1 <= k <= len(objects):
            raise ValueError(f"prompt {i}: object {k} (objects are numbered 1..{len(objects)} without gaps)")
        per_slice = objects[k - 1][1].setdefault(int(p["slice"]), [None, [], None])
        if per_slice[2] is not None:
            raise ValueError(f"prompt {i}: object {k} already has a mask on slice {p['slice']}")
        if p.get("mask") is not None:
            if per_slice[1] or (per_slice[0] is not None and not (k <= n_boxes and int(p["slice"]) == key_slice)):
                raise ValueError(f"prompt {i}: a mask for object {k} on slice {p['slice']}, which has other prompts")
            per_slice[:] = [None, [], np.asarray(p["mask"], dtype=bool)]
            continue
        if p.get("box") is not None:
            if per_slice[0] is not None:
                raise ValueError(f"prompt {i}: a second box for object {k} on slice {p['slice']}")
            per_slice[0] = list(p["box"])
        per_slice[1].extend(list(pt) for pt in p.get("points") or [])
    return [(start, [(z, b, pts, m) for z, (b, pts, m) in per_slice.items()]) for start, per_slice in objects]


def reference_propagate_prompts(
    propagator_or_model, stack_hu, key_slice, boxes, prompts=(), z_range=None, hu_window=None
):
    """The ``medvol.anchor/2`` semantics (correction prompts, ``z_range``) on sam2's stock methods.

    ``boxes`` are objects 1..N on ``key_slice``; ``prompts`` are pixel-form dicts
    ``{"slice": z, "object": k, "box": [x0, y0, x1, y1] or None, "points": [[x, y, label], ...]}``
    or mask prompts ``{"slice": z, "object": k, "mask": (H, W) boolean array}`` (object 1-based: k <= N corrects object k, k = N+1, N+2, ... adds a new object whose start
    slice is the slice of its first prompt). Per object, separately, and per direction (forward,
    then backward after ``reset_state``): one ``add_new_points_or_box`` call per slice of that
    object with the slice's box and all its points (``add_new_mask`` with the mask on a masked
    slice), then ``propagate_in_video`` from the start
    slice, limited to ``z_range`` = [z0, z1] (inclusive) by ``max_frame_num_to_track``. Every mask
    (logit > 0) is ORed into the result; slices outside ``z_range`` stay 0. No early stop.

    With no prompts and no ``z_range`` this is exactly :func:`reference_propagate`.
    Returns ``(mask, encoder_calls)``.
    """
    stack = np.asarray(stack_hu)
    d, h, w = stack.shape
    z0, z1 = (0, d - 1) if z_range is None else (int(z_range[0]), int(z_range[1]))
    if not 0 <= z0 <= z1 < d:
        raise ValueError(f"z_range {z_range} is not inside 0..{d - 1}")
    objects = _group_prompts(len(boxes), int(key_slice), boxes, list(prompts or ()))
    with _reference_run(propagator_or_model, stack, hu_window) as (model, images, seg, calls):
        for start, per_slice in objects:
            if not z0 <= start <= z1 or any(not z0 <= z <= z1 for z, _, _, _ in per_slice):
                raise ValueError("every prompted slice must lie inside z_range")
            state = _init_state(model, images, h, w)
            for reverse in (False, True):
                for z, box, pts, m in per_slice:
                    if m is not None:
                        model.add_new_mask(state, frame_idx=z, obj_id=1, mask=m)
                        continue
                    kwargs = {}
                    if box is not None:
                        kwargs["box"] = np.asarray(box, dtype=np.float32)
                    if pts:
                        kwargs["points"] = np.asarray([p[:2] for p in pts], dtype=np.float32)
                        kwargs["labels"] = np.asarray([p[2] for p in pts], dtype=np.int32)
                    model.add_new_points_or_box(state, frame_idx=z, obj_id=1, **kwargs)
                for frame_idx, _ids, logits in model.propagate_in_video(
                    state,
                    start_frame_idx=start,
                    reverse=reverse,
                    max_frame_num_to_track=(start - z0) if reverse else (z1 - start),
                ):
                    seg[frame_idx][(logits[0, 0] > 0.0).cpu().numpy()] = 1
                model.reset_state(state)
            del state
    return seg, calls[0]


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _quiet_tqdm():
    try:
        from medvolcore.propagation import quiet_sam2_progress

        return quiet_sam2_progress()
    except ImportError:  # pragma: no cover
        return _nullcontext()


# --------------------------------------------------------------------------------------------
# whole-process script
# --------------------------------------------------------------------------------------------


def load_canonical(path, labels: bool = False):
    """(stack, to_source, affine): the canonical axial stack (z S→I, y A→P, x R→L) of a NIfTI.

    Uses ``medvolcore.stack.AxialStack`` when it exists, else a nibabel-only equivalent.
    """
    try:
        from medvolcore.stack import AxialStack
        from medvolcore.volume import load_label_map, load_volume

        vol = (load_label_map if labels else load_volume)(path)
        ax = AxialStack.from_volume(vol)
        data = np.ascontiguousarray(ax.data)
        return data, ax.to_source, vol.affine
    except ImportError:
        pass
    import nibabel as nib
    from nibabel.orientations import apply_orientation, axcodes2ornt, io_orientation, ornt_transform

    img = nib.load(str(path))
    a = np.asarray(img.dataobj, dtype=np.int32 if labels else np.float32)
    # reorient so that axes point to (Left, Posterior, Inferior), then order them (z, y, x)
    t = ornt_transform(io_orientation(img.affine), axcodes2ornt(("L", "P", "I")))
    lpi = apply_orientation(a, t)
    stack = np.ascontiguousarray(lpi.transpose(2, 1, 0))
    inv = ornt_transform(axcodes2ornt(("L", "P", "I")), io_orientation(img.affine))

    def to_source(m):
        return np.ascontiguousarray(apply_orientation(np.asarray(m).transpose(2, 1, 0), inv))

    return stack, to_source, img.affine


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--volume", required=True)
    ap.add_argument("--slice", type=int, required=True)
    ap.add_argument("--box", type=int, nargs=4, action="append", required=True, metavar=("X0", "Y0", "X1", "Y1"))
    ap.add_argument("--out", required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--random-weights", type=int, metavar="SEED")
    g.add_argument("--checkpoint", "--sam-checkpoint", dest="checkpoint")
    ap.add_argument("--image-size", type=int, default=512)
    ap.add_argument("--window", default=None, help="HU window: preset or 'C,W' (default soft tissue)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    import nibabel as nib

    from medvolcore.propagation import MedSAM2Propagator

    if args.checkpoint:
        prop = MedSAM2Propagator.from_checkpoint(args.checkpoint, device=args.device, image_size=args.image_size)
    else:
        prop = MedSAM2Propagator.from_random(args.random_weights, image_size=args.image_size, device=args.device)
    stack, to_source, affine = load_canonical(args.volume)
    t1 = time.perf_counter()
    mask, calls = reference_propagate(prop, stack, args.slice, args.box, hu_window=args.window)
    t2 = time.perf_counter()
    out = nib.Nifti1Image(to_source(mask).astype(np.uint8), affine)
    nib.save(out, args.out)
    info = {
        "out": args.out,
        "voxels": int(mask.sum()),
        "encoder_calls": calls,
        "seconds_propagate": t2 - t1,
        "seconds_total": time.perf_counter() - t0,
    }
    print(json.dumps(info) if args.json else info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
