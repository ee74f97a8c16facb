"""The pipeline's steps one at a time: ``medvol info``, ``anchor``, ``propagate`` and ``metrics``.

``propagate`` runs :func:`medvolcore.jobs.run_segment_job` with MedSAM2 alone; the other three
read files and compute. Imports are deferred to the command that needs them, so
``medvol propagate`` loads torch and sam2 but nothing else heavy, and ``medvol anchor`` does not
load torch at all. The main job (``segment``, ``demo``) is :mod:`.volume`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from ..errors import InputError
from .common import (VOLUME_HELP, _bar, _progress, add_compute_options, add_ct_options, add_seg_type_option,
                     add_stop_option, apply_compute_options, emit, index_arg, parse_labels, peak_memory_mb,
                     propagate_weights, seed_arg, stop_text, terminal_safe)


# ---- medvol info -----------------------------------------------------------------------

def cmd_info(args) -> int:
    from ..stack import AxialStack, axis_codes
    from ..volume import load_volume

    from ..pacs import is_dicomweb

    if is_dicomweb(args.volume):
        raise InputError(f"{args.volume}: medvol info describes a local volume (a CT file or a DICOM folder); read a "
                         "DICOMweb series with medvol segment --keep-downloads DIR, then run medvol info on "
                         "DIR/SERIES_UID")
    vol = load_volume(args.volume)
    stack = AxialStack(vol)
    res = {
        "volume": str(args.volume), "format": vol.source_format, "shape": list(vol.shape),
        "spacing_mm": [round(s, 4) for s in vol.spacing], "orientation": axis_codes(stack),
        "stack_shape_zyx": list(stack.shape), "stack_spacing_zyx_mm": [round(s, 4) for s in stack.spacing],
        "hu_range": [float(vol.array.min()), float(vol.array.max())],
        "affine": [[round(float(v), 5) for v in row] for row in vol.affine],
    }
    text = (f"{args.volume}: {vol.source_format}, {'×'.join(map(str, vol.shape))} voxels, "
            f"spacing {' × '.join(f'{s:g}' for s in vol.spacing)} mm, orientation {res['orientation']}\n"
            f"axial stack: {stack.depth} slices of {stack.width}×{stack.height} (W×H), "
            f"HU {res['hu_range'][0]:g}..{res['hu_range'][1]:g}")
    emit(res, args.json, text)
    return 0


# ---- medvol anchor ---------------------------------------------------------------------

def cmd_anchor(args) -> int:
    from ..anchor import anchor_from_mask
    from ..fileio import check_distinct, check_output
    from ..stack import AxialStack
    from ..volume import label_mask, load_label_map

    if args.out:
        check_distinct([("--out", args.out)], [("--mask", args.mask)])
        check_output(args.out, args.overwrite)
    labels = load_label_map(args.mask)
    stack = AxialStack(labels)
    target = label_mask(labels, parse_labels(args.label))
    anchor = anchor_from_mask(stack.to_stack(target), top_k=args.top_k, rng=args.seed, stack=stack, query=args.query or "")
    if args.out:
        anchor.save(args.out, args.overwrite)
        res = {"out": str(args.out), "anchor": anchor.to_dict()}
        emit(res, args.json, f"wrote {args.out}: slice {anchor.slice}, {len(anchor.boxes)} box(es) {anchor.boxes}")
    else:
        sys.stdout.write(anchor.to_json())
    return 0


# ---- medvol propagate ------------------------------------------------------------------

def cmd_propagate(args) -> int:
    from ..jobs import SegmentOutputs, SegmentRequest, run_segment_job

    t0 = time.perf_counter()
    request = SegmentRequest.from_cli(args)  # the anchor (or key slice and boxes), the range, early stop, …
    kind, weights = propagate_weights(args)  # --preset's, --sam-checkpoint or --random-weights; refused when none
    inputs = [("--anchor", args.anchor), ("--sam-checkpoint", weights if kind == "checkpoint" else None)] + [
        ("--mask-prompt", p["mask_file"]) for p in args.prompts or [] if "mask_file" in p]
    outputs = SegmentOutputs(args.out, anchor=args.anchor_out, qc=args.qc, overwrite=args.overwrite)  # checked by the job
    loaded = {}

    def pipeline():  # MedSAM2 loads once the volume and the anchor are known good
        from ..devices import resolve_device
        from ..pipeline import Pipeline
        from ..propagation import MedSAM2Propagator  # torch + sam2 only from here on

        device = str(resolve_device(args.device))
        t_load = time.perf_counter()
        if kind == "checkpoint":
            propagator = MedSAM2Propagator.from_checkpoint(weights, device=device)
            loaded["weights"] = str(weights)
        else:
            (seed, size) = weights
            logging.getLogger("medvolcore").warning(
                "random MedSAM2 weights (seed %d): the mask is meaningless, for smoke tests and benchmarks only", seed)
            propagator = MedSAM2Propagator.from_random(seed, image_size=size, device=device)
            loaded["weights"] = f"random(seed={seed}, image_size={size})"
        loaded.update(device=device, load_s=time.perf_counter() - t_load)
        return Pipeline.with_propagator(propagator)

    compute = apply_compute_options(args)
    bar = None if args.no_progress else _bar("propagate")
    try:
        res = run_segment_job(pipeline, args.volume, request, outputs, inputs=inputs, progress=_progress(bar))
    finally:
        if bar is not None:
            bar.close()
    t = res["timings"]
    prop = res["propagation"]
    out = {
        "out": res["out"], "outs": res["outs"], "volume": str(args.volume), "anchor": res["anchor"],
        "weights": loaded["weights"],
        "device": loaded["device"], "ct_window": _window_pair(args.ct_window),
        "slice_range": list(prop["slice_range"]), "slices_encoded": t["slices_encoded"], "propagation": prop,
        "encoder_calls": t["encoder_calls"], "mask_voxels": res["mask_voxels"],
        "seconds": round(t["propagate_s"], 3), "seconds_per_slice": round(t["propagate_s_per_slice"], 4),
        "model_load_seconds": round(loaded["load_s"], 3), "total_seconds": round(time.perf_counter() - t0, 3),
        "peak_memory_mb": peak_memory_mb(), "qc": res["qc"], "notes": res["notes"], **compute,
    }
    if loaded["device"].startswith("cuda"):
        import torch

        out["peak_cuda_memory_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    lo, hi = prop["slice_range"]
    n_prompts = len(res["anchor"].get("prompts") or [])
    corrections = f" with {n_prompts} correction prompt{'s' if n_prompts != 1 else ''}" if n_prompts else ""
    text = (f"wrote {', '.join(res['outs'])}{corrections}: {res['mask_voxels']} voxels; slices {lo}..{hi} "
            f"({t['slices_encoded']} encoded, {t['propagate_s_per_slice']:.2f} s/slice{stop_text(prop)}), "
            f"peak memory {out['peak_memory_mb']} MB" + (f"; QC picture {res['qc']}" if res["qc"] else ""))
    text = "\n".join([terminal_safe(n, one_line=True) for n in res["notes"]] + [text])  # as --json carries them
    emit(out, args.json, text)
    return 0


class _PromptAction(argparse.Action):
    """``--add-box``, ``--inside-point`` and ``--outside-point`` append pixel-form prompts to
    ``args.prompts`` in command-line order (the order sam2 receives the points in)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.dest == "mask_prompt":  # Z K FILE: the file is read with the volume, before any model loads
            try:
                z, k = (index_arg(v) for v in values[:2])
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentError(self, str(e)) from None
            values = [z, k, values[2]]
        z, k, *rest = values
        if self.dest == "mask_prompt":
            prompt = {"slice": z, "object": k, "mask_file": rest[0]}
        elif self.dest == "add_box":
            prompt = {"slice": z, "object": k, "box": list(rest), "points": []}
        else:
            prompt = {"slice": z, "object": k, "box": None, "points": [[rest[0], rest[1], int(self.dest == "inside_point")]]}
        prompts = getattr(namespace, "prompts", None) or []
        namespace.prompts = prompts + [prompt]


def _window_pair(ct_window) -> list:
    from ..windowing import get_window

    w = get_window(ct_window)
    return [w.center, w.width]


# ---- medvol metrics --------------------------------------------------------------------

def cmd_metrics(args) -> int:
    import numpy as np

    from ..geometry import gt_on_grid
    from ..metrics import label_metrics, overlap
    from ..volume import CTVolume, label_mask, load_label_map

    pred = load_label_map(args.pred)
    gt = load_label_map(args.gt)
    on = gt_on_grid(pred, gt)  # by geometry: reordered, flipped or resampled onto pred's grid, or refused
    gt = CTVolume(on.array, pred.affine, path=gt.path, source_format=gt.source_format)
    label = parse_labels(args.label)
    binary_pred = int(pred.array.max(initial=0)) <= 1
    if label is not None or binary_pred:
        g = label_mask(gt, label) if label is not None else gt.array != 0
        p = pred.array != 0 if binary_pred else np.isin(pred.array, label if isinstance(label, list) else [label])
        m = overlap(p, g)
        res = {"pred": str(args.pred), "gt": str(args.gt), "label": label, **m, "gt_resampled": on.note}
        text = f"Dice {m['dice']:.4f}  IoU {m['iou']:.4f}  (pred {m['pred_voxels']} voxels, gt {m['gt_voxels']} voxels)"
    else:
        per = label_metrics(pred.array, gt.array)
        res = {"pred": str(args.pred), "gt": str(args.gt), "per_label": {str(k): v for k, v in per.items()},
               "mean_dice": float(np.mean([v["dice"] for v in per.values()])) if per else 1.0, "gt_resampled": on.note}
        text = "\n".join(f"label {k}: Dice {v['dice']:.4f}  IoU {v['iou']:.4f}" for k, v in per.items())
        text += f"\nmean Dice {res['mean_dice']:.4f}"
    if on.note:
        text += f"\nground truth put on the prediction's grid: {on.note}"
    emit(res, args.json, text)
    return 0


# ---- parsers ---------------------------------------------------------------------------

def add_step_commands(add) -> None:
    """Add ``info``, ``anchor`` and ``propagate`` (``add`` as in :func:`~.app.build_parser`)."""
    sp = add("info", "Describe a volume: grid, spacing, orientation and its canonical axial stack.", cmd_info)
    sp.add_argument("volume", help="CT file (.nii, .nii.gz, .nrrd, .mha) or DICOM folder (a local volume)")

    sp = add("anchor", "Evidence anchor (key slice + boxes) of a label in a label map.", cmd_anchor)
    sp.add_argument("--mask", required=True, help="label map (.nii.gz, …)")
    sp.add_argument("--label", action="append", metavar="N",
                    help="label id(s), e.g. 5 or 2,3 (repeatable); default: every non-zero voxel")
    sp.add_argument("--top-k", type=index_arg, default=1, help="draw the key slice from the K largest-area slices (default 1: the largest)")
    sp.add_argument("--seed", type=seed_arg, default=0, help="random seed for --top-k > 1 (default 0)")
    sp.add_argument("--query", help="query text to store in the anchor")
    sp.add_argument("--out", help="anchor file to write (*.anchor.json); default: print it")
    sp.add_argument("--overwrite", action="store_true", help="replace an existing output")

    sp = add("propagate", "Propagate an evidence anchor through the CT with MedSAM2 into a 3-D mask.", cmd_propagate)
    sp.add_argument("--volume", required=True, help=VOLUME_HELP)
    sp.add_argument("--anchor", help="anchor file (*.anchor.json; 'boxes' or 'world')")
    sp.add_argument("--slice", type=index_arg, help="key slice z of the canonical axial stack (0 = most superior)")
    sp.add_argument("--box", type=index_arg, nargs=4, action="append", metavar=("X0", "Y0", "X1", "Y1"),
                    help="inclusive pixel box on the key slice (repeatable)")
    sp.add_argument("--out", required=True, action="append", metavar="PATH",
                    help="mask to write on the volume's grid (.nii.gz, .nii, .nrrd, .mha, .seg.nrrd; .dcm for a DICOM "
                         "folder); repeat it to write every format given")
    c = sp.add_argument_group("corrections (added to the anchor's own; objects are numbered from 1 in the anchor's "
                              "box order, the next free number adds an object)")
    c.add_argument("--add-box", type=index_arg, nargs=6, action=_PromptAction, metavar=("Z", "K", "X0", "Y0", "X1", "Y1"),
                   help="a box on slice Z for object K (inclusive pixel box; repeatable)")
    c.add_argument("--inside-point", type=index_arg, nargs=4, action=_PromptAction, metavar=("Z", "K", "X", "Y"),
                   help="a point inside object K on slice Z (pixel x, y; repeatable)")
    c.add_argument("--outside-point", type=index_arg, nargs=4, action=_PromptAction, metavar=("Z", "K", "X", "Y"),
                   help="a point outside object K on slice Z (repeatable)")
    c.add_argument("--mask-prompt", nargs=3, action=_PromptAction, metavar=("Z", "K", "FILE"),
                   help="a painted mask of object K on slice Z (sam2's mask input): .npy or .png of the slice, or a "
                        "label map on the volume's grid with voxels on slice Z only (repeatable)")
    c.add_argument("--z-range", type=index_arg, nargs=2, metavar=("Z0", "Z1"),
                   help="propagate only inside slices Z0..Z1 (inclusive; replaces the anchor's range)")
    sp.set_defaults(prompts=None)
    w = sp.add_mutually_exclusive_group()
    w.add_argument("--preset", help="the MedSAM2 weights of a model preset (after medvol models download NAME)")
    w.add_argument("--sam-checkpoint", metavar="PATH", help="MedSAM2 checkpoint, e.g. MedSAM2_latest.pt")
    w.add_argument("--random-weights", type=seed_arg, metavar="SEED", help="seeded random weights (tests, benchmarks)")
    sp.add_argument("--image-size", type=index_arg, help="model input size for --random-weights (default 512)")
    sp.add_argument("--window", type=index_arg, metavar="W", help="propagate only slices [k-W, k+W] (default: all)")
    add_ct_options(sp)
    add_seg_type_option(sp)
    sp.add_argument("--largest-component", action="store_true", help="keep each box's largest 3-D connected component")
    add_stop_option(sp)
    sp.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu", help="cpu (fp32) or cuda (bfloat16 autocast)")
    add_compute_options(sp, dtype=False)
    sp.add_argument("--anchor-out", metavar="PATH", help="also write the anchor used, with world coordinates")
    sp.add_argument("--qc", metavar="PNG", help="also write a QC picture (the key slice with its boxes and the mask): "
                                               "what to look at after a correction round")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument("--overwrite", action="store_true", help="replace existing outputs")


def add_metrics_command(add) -> None:
    sp = add("metrics", "Dice and IoU of a predicted mask against a label map, compared by geometry on the prediction's grid.", cmd_metrics)
    sp.add_argument("--pred", required=True, help="predicted mask or label map")
    sp.add_argument("--gt", required=True, help="ground-truth label map")
    sp.add_argument("--label", action="append", metavar="N", help="ground-truth label id(s) (default: all non-zero / per label)")
