"""The ``medvol`` command line.

Every command has ``--help``. Errors are one line on stderr and a non-zero exit code
(``--debug`` shows the traceback). Long work shows a progress bar on stderr; ``--json``
prints a machine-readable result on stdout.

Imports are deferred to the command that needs them, so ``medvol propagate`` loads torch and
sam2 but nothing else heavy, and ``medvol anchor`` does not load torch at all.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from typing import List, Optional

from . import __version__
from .errors import InputError, MedVolError

PROG = "medvol"


class Terminated(KeyboardInterrupt):
    """SIGTERM (a cluster's time limit, ``kill``): unwinds like Ctrl-C, so temporary files go."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump)."""

    def error(self, message):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _OneLineWarnings(logging.Handler):
    def emit(self, record):
        sys.stderr.write(f"{PROG}: warning: {record.getMessage()}\n")


def _emit(result: dict, as_json: bool, text: str) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        sys.stdout.write(text + "\n")


def _peak_memory_mb() -> Optional[float]:
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024, 1)


def _parse_labels(values: Optional[List[str]]):
    """``--label 5``, ``--label 2,3`` or ``--label 2 --label 3`` → int or list of ints (None: all)."""
    if not values:
        return None
    ids = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                n = int(part)
            except ValueError:
                raise InputError(f"--label takes integer label ids, got {part!r}") from None
            if n <= 0:
                raise InputError(f"--label ids must be positive (0 is background), got {n}")
            ids.append(n)
    return ids[0] if len(ids) == 1 else ids


# ---- medvol info -----------------------------------------------------------------------

def cmd_info(args) -> int:
    from .stack import AxialStack, axis_codes
    from .volume import load_volume

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
    _emit(res, args.json, text)
    return 0


# ---- medvol anchor ---------------------------------------------------------------------

def cmd_anchor(args) -> int:
    from .anchor import anchor_from_mask
    from .fileio import check_distinct, check_output
    from .stack import AxialStack
    from .volume import label_mask, load_label_map

    if args.out:
        check_distinct([("--out", args.out)], [("--mask", args.mask)])
        check_output(args.out, args.overwrite)
    labels = load_label_map(args.mask)
    stack = AxialStack(labels)
    target = label_mask(labels, _parse_labels(args.label))
    anchor = anchor_from_mask(stack.to_stack(target), top_k=args.top_k, rng=args.seed, stack=stack, query=args.query or "")
    if args.out:
        anchor.save(args.out, args.overwrite)
        res = {"out": str(args.out), "anchor": anchor.to_dict()}
        _emit(res, args.json, f"wrote {args.out}: slice {anchor.slice}, {len(anchor.boxes)} box(es) {anchor.boxes}")
    else:
        sys.stdout.write(anchor.to_json())
    return 0


# ---- medvol propagate ------------------------------------------------------------------

def cmd_propagate(args) -> int:
    from .anchor import EvidenceAnchor
    from .fileio import MASK_SUFFIXES, check_distinct, check_output
    from .stack import AxialStack
    from .volume import load_volume, save_mask
    from .windowing import get_window

    t0 = time.perf_counter()
    check_distinct([("--out", args.out), ("--anchor-out", args.anchor_out)],
                   [("--volume", args.volume), ("--anchor", args.anchor), ("--sam-checkpoint", args.sam_checkpoint)])
    check_output(args.out, args.overwrite, suffixes=MASK_SUFFIXES, what="mask")
    if args.anchor_out:
        check_output(args.anchor_out, args.overwrite)
    if args.anchor and (args.slice is not None or args.box):
        raise InputError("give either --anchor or --slice/--box, not both")
    if not args.anchor and (args.slice is None or not args.box):
        raise InputError("give an anchor: --anchor A.anchor.json, or --slice Z with one or more --box X0 Y0 X1 Y1")
    if args.sam_checkpoint is None and args.random_weights is None:
        raise InputError("no MedSAM2 weights: pass --sam-checkpoint PATH (e.g. MedSAM2_latest.pt), "
                         "or --random-weights SEED for an untrained smoke test")
    if args.window is not None and args.window < 0:
        raise InputError(f"--window must be ≥ 0 slices, got {args.window}")
    from .propagation import check_stop_after_empty

    check_stop_after_empty(args.stop_after_empty, "--stop-after-empty")
    hu_window = get_window(args.ct_window)

    vol = load_volume(args.volume)
    stack = AxialStack(vol)
    if args.anchor:
        anchor = EvidenceAnchor.load(args.anchor, stack)
    else:
        stack.check_slice(args.slice)
        anchor = EvidenceAnchor(args.slice, [list(b) for b in args.box], [stack.width, stack.height],
                                source="user").with_world(stack)

    from .devices import resolve_device

    device = str(resolve_device(args.device))
    from .propagation import MedSAM2Propagator  # torch + sam2 only from here on

    t_load = time.perf_counter()
    if args.sam_checkpoint is not None:
        if args.image_size not in (None, 512):
            raise InputError("--image-size applies to --random-weights only; MedSAM2 checkpoints run at 512")
        propagator = MedSAM2Propagator.from_checkpoint(args.sam_checkpoint, device=device)
        weights = str(args.sam_checkpoint)
    else:
        logging.getLogger("medvolcore").warning(
            "random MedSAM2 weights (seed %d): the mask is meaningless, for smoke tests and benchmarks only", args.random_weights)
        propagator = MedSAM2Propagator.from_random(args.random_weights, image_size=args.image_size or 512, device=device)
        weights = f"random(seed={args.random_weights}, image_size={args.image_size or 512})"
    load_s = time.perf_counter() - t_load

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=stack.depth, desc="propagate", unit="slice", file=sys.stderr, disable=None, leave=False)

    def progress(done, total, message):
        if bar is not None:
            if bar.total != total:
                bar.total = total
            bar.n = done
            bar.refresh()

    try:
        result = propagator.propagate(stack.data, anchor.slice, anchor.boxes, hu_window=hu_window,
                                      window=args.window, largest_component=args.largest_component, progress=progress,
                                      stop_after_empty=args.stop_after_empty)
    finally:
        if bar is not None:
            bar.close()
    anchor.propagation = result.stop_summary()
    mask = stack.to_source(result.mask)
    save_mask(mask, vol, args.out, args.overwrite)
    if args.anchor_out:
        anchor.save(args.anchor_out, args.overwrite)
    res = {
        "out": str(args.out), "volume": str(args.volume), "anchor": anchor.to_dict(), "weights": weights,
        "device": device, "ct_window": [hu_window.center, hu_window.width],
        "slice_range": list(result.slice_range), "slices_encoded": result.slices_encoded,
        "propagation": result.stop_summary(),
        "encoder_calls": result.encoder_calls, "mask_voxels": int(mask.sum()),
        "seconds": round(result.seconds, 3), "seconds_per_slice": round(result.seconds_per_slice, 4),
        "model_load_seconds": round(load_s, 3), "total_seconds": round(time.perf_counter() - t0, 3),
        "peak_memory_mb": _peak_memory_mb(),
    }
    if device.startswith("cuda"):
        import torch

        res["peak_cuda_memory_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    text = (f"wrote {args.out}: {res['mask_voxels']} voxels; slices {result.slice_range[0]}..{result.slice_range[1]} "
            f"({result.slices_encoded} encoded, {result.seconds_per_slice:.2f} s/slice{_stop_text(result)}), "
            f"peak memory {res['peak_memory_mb']} MB")
    _emit(res, args.json, text)
    return 0


def _stop_text(result) -> str:
    """'; stopped early (every mask empty on K slices): forward at 47, backward at 8' when a direction
    ended before the edge of the stack (or window), else ''."""
    parts = [f"{d} at {v['last_slice']}" for d, v in (result.stops or {}).items() if v.get("stopped_early")]
    return f"; stopped early (every mask empty on {result.stop_after_empty} slices): " + ", ".join(parts) if parts else ""


def _add_stop_option(sp) -> None:
    from .propagation import DEFAULT_STOP_AFTER_EMPTY

    sp.add_argument("--stop-after-empty", type=int, default=DEFAULT_STOP_AFTER_EMPTY, metavar="K",
                    help="in each direction, stop once every box's mask has been empty on K consecutive slices "
                         f"(default {DEFAULT_STOP_AFTER_EMPTY}; 0 = propagate through the whole volume, as the paper)")


# ---- medvol segment / demo ---------------------------------------------------------------

def _default_anchor_path(out) -> str:
    from .fileio import full_suffix

    name = str(out)
    suffix = full_suffix(name)
    return (name[: -len(suffix)] if suffix else name) + ".anchor.json"


def _run_segment(volume, query, out, anchor_out, qc, args, preset, notice: str = "") -> dict:
    from .fileio import MASK_SUFFIXES, PNG_SUFFIXES, check_distinct, check_output
    from .pipeline import Pipeline, as_stack
    from .qc import save_qc
    from .volume import save_mask
    from .windowing import get_window

    from .grounder import validate_query

    from .propagation import check_stop_after_empty

    query = validate_query(query)
    check_stop_after_empty(args.stop_after_empty, "--stop-after-empty")
    # every output checked before the models load: distinct files, not an input, writable, right type
    check_distinct([("--out", out), ("--anchor-out", anchor_out), ("--qc", qc)],
                   [("--volume", volume), ("--adapter", getattr(args, "adapter", None))])
    check_output(out, args.overwrite, suffixes=MASK_SUFFIXES, what="mask")
    check_output(anchor_out, args.overwrite)
    if qc:
        check_output(qc, args.overwrite, suffixes=PNG_SUFFIXES, what="QC picture")
    hu_window = get_window(args.ct_window)
    stack = as_stack(volume)
    pipe = Pipeline(preset, adapter=getattr(args, "adapter", None), device=args.device,
                    low_memory=getattr(args, "low_memory", False))
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=100, desc="segment", unit="%", file=sys.stderr, disable=None, leave=False,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix}")

    def progress(stage, fraction, message):
        if bar is not None:
            bar.set_description(stage)
            bar.n = int(100 * fraction)
            bar.set_postfix_str(message)
            bar.refresh()

    try:
        seg = pipe.segment(stack, query, constrain=not args.no_constrain, seed=args.seed,
                           do_sample=args.sample, hu_window=hu_window, progress=progress,
                           stop_after_empty=args.stop_after_empty)
    finally:
        if bar is not None:
            bar.close()
    seg.anchor.query = query
    seg.anchor.reasoning = seg.reasoning
    seg.anchor.source = "grounder"
    save_mask(seg.mask, stack.volume, out, args.overwrite)
    seg.anchor.save(anchor_out, args.overwrite)
    if qc:
        banner = "UNTRAINED SMOKE MODEL: meaningless output" if seg.smoke else ""
        save_qc(qc, stack, seg.anchor, seg.mask_stack, overwrite=args.overwrite, title=f"query: {query}",
                reasoning=seg.reasoning, banner=banner, window=hu_window)
    res = {"out": str(out), "anchor_out": str(anchor_out), "qc": str(qc) if qc else None, "volume": str(
        stack.volume.path or volume), **seg.summary(), "model_load_s": {k: round(v, 3) for k, v in pipe.load_seconds.items()},
        "peak_memory_mb": _peak_memory_mb()}
    if notice:
        res["notice"] = notice
    return res


def _segment_text(res: dict) -> str:
    a = res["anchor"]
    lines = []
    if res.get("smoke"):
        lines.append("NOTE: " + next((n for n in res["notes"] if "smoke" in n), "untrained smoke model"))
    lines += [f"key slice {a['slice']}, {len(a['boxes'])} box(es) {a['boxes']}",
              f"reasoning: {res['reasoning']}" if res["reasoning"] else "reasoning: (none)",
              f"wrote {res['out']} ({res['mask_voxels']} voxels), {res['anchor_out']}" + (f", {res['qc']}" if res["qc"] else ""),
              "timings: " + ", ".join(f"{k} {v:.2f}" for k, v in res["timings"].items() if isinstance(v, float))]
    return "\n".join(lines)


def cmd_segment(args) -> int:
    anchor_out = args.anchor_out or _default_anchor_path(args.out)
    res = _run_segment(args.volume, args.query, args.out, anchor_out, args.qc, args, args.preset)
    _emit(res, args.json, _segment_text(res))
    return 0


def cmd_demo(args) -> int:
    from pathlib import Path

    from . import models
    from .resources import load_json, resource_path

    sample = load_json("samples", "samples.json")["demo"]
    volume = resource_path("samples", sample["file"])
    query = args.query or sample["query"]
    preset, notice = models.best_available_preset(args.preset)
    from .fileio import check_folder

    out_dir = check_folder(Path(args.out_dir), "--out-dir")
    if notice:
        sys.stderr.write(f"{PROG} demo: {notice}\n")
    res = _run_segment(volume, query, out_dir / "demo_mask.nii.gz", out_dir / "demo.anchor.json",
                       out_dir / "demo_qc.png", args, preset, notice)
    text = f"demo on {volume.name} with preset '{preset}', query: {query!r}\n" + _segment_text(res)
    _emit(res, args.json, text)
    return 0


# ---- medvol metrics --------------------------------------------------------------------

def cmd_metrics(args) -> int:
    import numpy as np

    from .metrics import label_metrics, overlap
    from .volume import label_mask, load_label_map

    pred = load_label_map(args.pred)
    gt = load_label_map(args.gt)
    if pred.shape != gt.shape:
        raise MedVolError(f"{args.pred} ({pred.shape}) and {args.gt} ({gt.shape}) are not on the same grid")
    if not np.allclose(pred.affine, gt.affine, atol=1e-3):
        logging.getLogger("medvolcore").warning("%s and %s have different affines; comparing voxel by voxel", args.pred, args.gt)
    label = _parse_labels(args.label)
    binary_pred = int(pred.array.max(initial=0)) <= 1
    if label is not None or binary_pred:
        g = label_mask(gt, label) if label is not None else gt.array != 0
        p = pred.array != 0 if binary_pred else np.isin(pred.array, label if isinstance(label, list) else [label])
        m = overlap(p, g)
        res = {"pred": str(args.pred), "gt": str(args.gt), "label": label, **m}
        text = f"Dice {m['dice']:.4f}  IoU {m['iou']:.4f}  (pred {m['pred_voxels']} voxels, gt {m['gt_voxels']} voxels)"
    else:
        per = label_metrics(pred.array, gt.array)
        res = {"pred": str(args.pred), "gt": str(args.gt), "per_label": {str(k): v for k, v in per.items()},
               "mean_dice": float(np.mean([v["dice"] for v in per.values()])) if per else 1.0}
        text = "\n".join(f"label {k}: Dice {v['dice']:.4f}  IoU {v['iou']:.4f}" for k, v in per.items())
        text += f"\nmean Dice {res['mean_dice']:.4f}"
    _emit(res, args.json, text)
    return 0


# ---- parser ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="MedVol-R1 engine: CT → evidence anchor → MedSAM2 3-D mask.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name, help_, func):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(func=func)
        sp.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        sp.add_argument("--debug", action="store_true", help="show tracebacks")
        return sp

    sp = add("info", "Describe a volume: grid, spacing, orientation and its canonical axial stack.", cmd_info)
    sp.add_argument("volume", help="CT file (.nii, .nii.gz, .nrrd, .mha) or DICOM folder")

    sp = add("anchor", "Evidence anchor (key slice + boxes) of a label in a label map.", cmd_anchor)
    sp.add_argument("--mask", required=True, help="label map (.nii.gz, …)")
    sp.add_argument("--label", action="append", metavar="N",
                    help="label id(s), e.g. 5 or 2,3 (repeatable); default: every non-zero voxel")
    sp.add_argument("--top-k", type=int, default=1, help="draw the key slice from the K largest-area slices (default 1: the largest)")
    sp.add_argument("--seed", type=int, default=0, help="random seed for --top-k > 1 (default 0)")
    sp.add_argument("--query", help="query text to store in the anchor")
    sp.add_argument("--out", help="anchor file to write (*.anchor.json); default: print it")
    sp.add_argument("--overwrite", action="store_true", help="replace an existing output")

    sp = add("propagate", "Propagate an evidence anchor through the CT with MedSAM2 into a 3-D mask.", cmd_propagate)
    sp.add_argument("--volume", required=True, help="CT file (.nii, .nii.gz, .nrrd, .mha) or DICOM folder")
    sp.add_argument("--anchor", help="anchor file (*.anchor.json; 'boxes' or 'world')")
    sp.add_argument("--slice", type=int, help="key slice z of the canonical axial stack (0 = most superior)")
    sp.add_argument("--box", type=int, nargs=4, action="append", metavar=("X0", "Y0", "X1", "Y1"),
                    help="inclusive pixel box on the key slice (repeatable)")
    sp.add_argument("--out", required=True, help="mask to write (.nii.gz, .nii or .nrrd), on the volume's grid")
    w = sp.add_mutually_exclusive_group()
    w.add_argument("--sam-checkpoint", metavar="PATH", help="MedSAM2 checkpoint, e.g. MedSAM2_latest.pt")
    w.add_argument("--random-weights", type=int, metavar="SEED", help="seeded random weights (tests, benchmarks)")
    sp.add_argument("--image-size", type=int, help="model input size for --random-weights (default 512)")
    sp.add_argument("--window", type=int, metavar="W", help="propagate only slices [k-W, k+W] (default: all)")
    sp.add_argument("--ct-window", default=None, metavar="PRESET|C,W",
                    help="display window for the frames: soft_tissue (default), lung, bone, … or CENTER,WIDTH in HU")
    sp.add_argument("--largest-component", action="store_true", help="keep each box's largest 3-D connected component")
    _add_stop_option(sp)
    sp.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu", help="cpu (fp32) or cuda (bfloat16 autocast)")
    sp.add_argument("--anchor-out", metavar="PATH", help="also write the anchor used, with world coordinates")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument("--overwrite", action="store_true", help="replace existing outputs")

    def add_segment_options(sp):
        sp.add_argument("--preset", default="medvol-r1", help="model preset (medvol models list); default medvol-r1")
        sp.add_argument("--adapter", metavar="PATH", help="LoRA adapter folder for the grounder (overrides the preset's)")
        sp.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                        help="cpu (fp32) or cuda (bfloat16); auto picks cuda when available")
        sp.add_argument("--seed", type=int, help="random seed for --sample (reproducible sampling)")
        sp.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
        sp.add_argument("--no-constrain", action="store_true", help="no grammar-constrained decoding (parse and retry instead)")
        sp.add_argument("--low-memory", action="store_true", help="free the language model from the GPU before MedSAM2 runs")
        sp.add_argument("--ct-window", default=None, metavar="PRESET|C,W", help="display window (default soft_tissue 40/400)")
        _add_stop_option(sp)
        sp.add_argument("--no-progress", action="store_true", help="no progress bar")
        sp.add_argument("--overwrite", action="store_true", help="replace existing outputs")

    sp = add("segment", "Segment a CT from a free-form query: evidence anchor (Qwen3-VL) + 3-D mask (MedSAM2).", cmd_segment)
    sp.add_argument("--volume", required=True, help="CT file (.nii, .nii.gz, .nrrd, .mha) or DICOM folder")
    sp.add_argument("--query", required=True, help="what to segment, e.g. 'the organ that secretes bile'")
    sp.add_argument("--out", required=True, help="mask to write (.nii.gz, .nii or .nrrd), on the CT's grid")
    sp.add_argument("--anchor-out", metavar="PATH", help="anchor file (default: beside --out, *.anchor.json)")
    sp.add_argument("--qc", metavar="PNG", help="also write a picture of the key slice, boxes, mask outline and reasoning")
    add_segment_options(sp)

    sp = add("demo", "Run the main job on the sample CT shipped with MedVol, with the best model present.", cmd_demo)
    sp.add_argument("--out-dir", default="medvol-demo", help="where to write the mask, anchor and QC picture (default ./medvol-demo)")
    sp.add_argument("--query", help="override the demo query ('the organ that secretes bile')")
    add_segment_options(sp)
    sp.set_defaults(preset=None)

    from .cli_batch import add_batch_command
    from .cli_models import add_models_command
    from .cli_serve import add_serve_command

    add_models_command(sub, add)
    add_serve_command(sub, add)
    add_batch_command(sub, add)

    sp = add("metrics", "Dice and IoU of a predicted mask against a label map, on the source grid.", cmd_metrics)
    sp.add_argument("--pred", required=True, help="predicted mask or label map")
    sp.add_argument("--gt", required=True, help="ground-truth label map")
    sp.add_argument("--label", action="append", metavar="N", help="ground-truth label id(s) (default: all non-zero / per label)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    logger = logging.getLogger("medvolcore")
    if not any(isinstance(h, _OneLineWarnings) for h in logger.handlers):
        logger.addHandler(_OneLineWarnings(level=logging.WARNING))
    logger.propagate = False
    previous = _on_sigterm_unwind()
    try:
        return int(args.func(args) or 0)
    except MedVolError as e:
        if args.debug:
            raise
        sys.stderr.write(f"{PROG} {args.command}: error: {e}\n")
        return e.exit_code
    except KeyboardInterrupt as e:
        hint = getattr(args, "interrupt_hint", "")
        how = "terminated" if isinstance(e, Terminated) else "interrupted"
        sys.stderr.write(f"{PROG} {args.command}: {how}" + (f"; {hint}" if hint else "") + "\n")
        return 143 if isinstance(e, Terminated) else 130
    except Exception as e:  # an unexpected failure: still one line, with a hint
        if args.debug:
            raise
        sys.stderr.write(f"{PROG} {args.command}: internal error: {type(e).__name__}: {e} (rerun with --debug for details)\n")
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _on_sigterm_unwind():
    """Make SIGTERM raise :class:`Terminated` in the main thread (so ``finally`` blocks run and
    temporary outputs are removed, as for Ctrl-C); returns the previous handler, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def _term(signum, frame):
        raise Terminated()

    return signal.signal(signal.SIGTERM, _term)


if __name__ == "__main__":
    sys.exit(main())
