"""The commands on one volume: ``medvol info``, ``anchor``, ``propagate``, ``segment``, ``demo`` and ``metrics``.

``segment``, ``demo`` and ``propagate`` run :func:`medvolcore.jobs.run_segment_job`; the other
three read files and compute. Imports are deferred to the command that needs them, so
``medvol propagate`` loads torch and sam2 but nothing else heavy, and ``medvol anchor`` does not
load torch at all.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Optional

from ..errors import InputError
from .common import (PROG, add_compute_options, add_consensus_options, add_ct_options, add_preset_option,
                     add_seg_type_option,
                     add_stop_option, apply_compute_options, emit, index_arg, parse_labels, peak_memory_mb,
                     propagate_weights, seed_arg, stop_text, terminal_safe)
from .pacs import add_dicomweb_options

VOLUME_HELP = "CT file (.nii, .nii.gz, .nrrd, .mha), DICOM folder, or (segment) a DICOMweb series URL"


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


BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {elapsed} < {remaining}  {message}"
_STAGE_WIDTH = 10  # the stage names (read, load, ground, propagate, write) in one column


def bar_line(stage: str, fraction: float, elapsed_s: float, message: str, ncols: int = 100) -> str:
    """The bar's text for one moment of a stage, e.g.
    ``ground     12%|██   | 00:07 < 00:49  decoding 31/256 tokens`` (tqdm draws the bar and
    estimates the time left from the stage's average pace)."""
    from tqdm import tqdm

    return tqdm.format_meter(100 * float(fraction), 100, elapsed_s, ncols=ncols, prefix=stage.ljust(_STAGE_WIDTH),
                             bar_format=BAR_FORMAT, message=terminal_safe(message, one_line=True))


def _bar(desc: str):
    """A progress bar on stderr: the stage, its percent, elapsed time and time left in the stage, and
    its message (none when stderr is not a terminal: :func:`_progress` then writes a line per stage)."""
    from tqdm import tqdm

    class StageBar(tqdm):
        message = ""

        @property
        def format_dict(self):
            return dict(super().format_dict, message=self.message)

    return StageBar(total=100, desc=desc.ljust(_STAGE_WIDTH), file=sys.stderr, disable=None, leave=False,
                    smoothing=0, bar_format=BAR_FORMAT)


def _progress(bar, line_every_s: float = 30.0):
    """The job's ``progress(stage, fraction, message)`` drawn on ``bar`` (None: nothing). Each stage
    restarts the bar's clock, so elapsed and time left are the stage's. When stderr is not a
    terminal (the bar is disabled), one line per stage and one at most every ``line_every_s``."""
    from ..progress import StageClock, clock_text

    clock = StageClock()
    last_line = [0.0]

    def progress(stage, fraction, message):
        if bar is None:
            return
        elapsed, eta, new = clock.update(stage, fraction)
        message = terminal_safe(message, one_line=True)
        if not bar.disable:
            if new:
                bar.reset(total=100)
                bar.set_description_str(stage.ljust(_STAGE_WIDTH), refresh=False)
            bar.n = 100 * float(fraction)
            bar.message = message
            bar.refresh()
        elif new or elapsed - last_line[0] >= line_every_s:
            last_line[0] = 0.0 if new else elapsed
            timing = "" if new else f" ({clock_text(elapsed)} elapsed, about {clock_text(eta)} left)"
            sys.stderr.write(f"{PROG} {stage}: {int(100 * fraction)}%{timing} {message}\n")
            sys.stderr.flush()

    return progress


# ---- medvol segment / demo ---------------------------------------------------------------

def _run_segment(volume, queries, out, anchor_out, qc, args, preset, notice: str = "",
                 inputs=()) -> dict:
    """One ``segment``/``demo`` job: ``queries`` a query or a list of them (several targets), ``out``
    a mask path or a list of them (the same mask in each format). The request and the outputs are
    checked before anything is read and the models load only then (the job's order)."""
    from ..jobs import SegmentOutputs, SegmentRequest, run_segment_job
    from ..models import check_adapter_given

    queries = [queries] if isinstance(queries, str) else list(queries)
    request = SegmentRequest.from_cli(args, **({"query": queries[0]} if len(queries) == 1 else {"queries": queries}))
    adapter = getattr(args, "adapter", None)
    outputs = SegmentOutputs(out, anchor=anchor_out, qc=qc, overwrite=args.overwrite,
                             empty_mask_on_absent=args.empty_mask_on_absent, agreement=args.agreement,
                             stats=args.stats)
    check_adapter_given(preset, adapter)  # medvol-r1 without an adapter: one line, before anything is read
    pipes = []

    def pipeline():  # resolved once the volume is read: a bad volume is reported before a missing model
        from ..pipeline import Pipeline

        pipes.append(Pipeline(preset, adapter=adapter, device=args.device, low_memory=getattr(args, "low_memory", False),
                              grounder_dtype=args.grounder_dtype))
        return pipes[0]

    compute = apply_compute_options(args)
    bar = None if args.no_progress else _bar("segment")
    try:
        res = run_segment_job(pipeline, volume, request, outputs, inputs=[("--adapter", adapter)] + list(inputs),
                              progress=_progress(bar))
    finally:
        if bar is not None:
            bar.close()
    out_res = {**res.to_json(), "model_load_s": {k: round(v, 3) for k, v in pipes[0].load_seconds.items()},
               **compute, "grounder_dtype": _dtype_name(pipes[0]), "peak_memory_mb": peak_memory_mb()}
    out_res["volume"] = out_res["volume"] or str(volume)
    if notice:
        out_res["notice"] = notice
    return out_res


def _dtype_name(pipe) -> Optional[str]:
    g = pipe._grounder  # only a grounder that was loaded (an unreadable volume stops before)
    return None if g is None else str(g.dtype).replace("torch.", "")


def read_queries_file(path) -> list:
    """The queries of a ``--queries`` file: one per line (UTF-8); blank lines and lines starting with
    ``#`` are skipped."""
    from pathlib import Path

    from ..fileio import os_reason

    import stat

    p = Path(path)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):  # a folder, or a FIFO or device that would block or never end
            raise InputError(f"--queries {path} is not a text file; give one with one query per line")
        if st.st_size > 1 << 20:
            raise InputError(f"--queries {path}: over 1 MB; give one query per line")
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--queries {path}: not UTF-8 text") from None
    except OSError as e:
        raise InputError(f"--queries {path}: {os_reason(e)}") from None
    queries = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not queries:
        raise InputError(f"--queries {path}: no query in it (one per line; # starts a comment line)")
    return queries


def _targets_text(res: dict) -> str:
    """The text output of a several-target ``segment``."""
    lines = _model_lines(res)
    for t in res["targets"]:
        head = f"{t['label']}. {terminal_safe(t['query'], one_line=True)}"
        if t["absent"]:
            lines.append(f"{head}: not found in this CT (no voxels)")
            continue
        a, st = t["anchor"], t["stats"]
        vol = f", {st['volume_ml']:.1f} mL, HU mean {st['mean_hu']:.0f}" if st.get("voxels") else ", 0 voxels"
        if t.get("overlap_voxels_lost"):
            vol += f" ({t['overlap_voxels_lost']} voxels went to an earlier target)"
        lines.append(f"{head}: key slice {a['slice']}, {len(a['boxes'])} box(es){vol}")
    lines += [terminal_safe(n, one_line=True) for n in res["notes"]]
    written = list(res["outs"]) + list(res["labels_out"]) + \
        [t[k] for t in res["targets"] for k in ("anchor_out", "qc", "agreement_out") if t.get(k)] + \
        ([res["stats_out"]] if res.get("stats_out") else [])
    lines.append("wrote " + ", ".join(str(f) for f in written) if written else
                 "no mask written: no target was found (--empty-mask-on-absent writes an all-zero one)")
    t = res["timings"]
    lines.append(f"timings: ground {t['ground_s']:.2f} s for {len(res['targets'])} queries"
                 + (f" (slices encoded and prompt prefilled once: {t['shared_prefill_s']:.2f} s)" if t.get("shared_prompt")
                    else "") + f", propagate {t['propagate_s']:.2f} s ({t['slices_encoded']} slices encoded)")
    return "\n".join(lines)


def _model_lines(res: dict) -> list:
    """The smoke or zero-shot warning and the model's label."""
    lines = []
    ident = res.get("identity") or {}
    if res.get("smoke"):
        notes = list(res.get("notes") or []) + [n for t in res.get("targets") or [] for n in t["notes"]]
        lines.append("NOTE: " + next((n for n in notes if "smoke" in n), "untrained smoke model"))
    elif not ident.get("trained_for_task"):
        from ..models.identity import identity_note

        note = identity_note(ident)
        if note:
            lines.append("NOTE: " + note)
    if ident.get("label"):
        lines.append(f"model: {ident['label']}")
    return lines


def _segment_text(res: dict) -> str:
    if "targets" in res:
        return _targets_text(res)
    a = res["anchor"]
    lines = _model_lines(res)
    if res.get("absent"):
        from ..pipeline import absent_note

        written = [f for f in (res["out"], res["anchor_out"], res["qc"], res.get("agreement_out")) if f]
        lines += [terminal_safe(absent_note(a.get("query") or ""), one_line=True),
                  f"reasoning: {res['reasoning']}" if res["reasoning"] else "reasoning: (none)"]
        lines += [t for t in (_sureness_text(res),) if t]
        lines += [("wrote an all-zero mask " + res["out"] + ", " if res["out"] else "no mask written (--empty-mask-on-absent "
                   "writes an all-zero one); wrote ") + ", ".join(str(f) for f in written if f != res["out"])]
        return "\n".join(lines)
    lines += [f"key slice {a['slice']}, {len(a['boxes'])} box(es) {a['boxes']}",
              f"reasoning: {res['reasoning']}" if res["reasoning"] else "reasoning: (none)"]
    lines += [terminal_safe(n, one_line=True) for n in res["notes"] if "smoke" not in n]  # as --json carries them
    sure = _sureness_text(res)
    if sure:
        lines.append(sure)
    written = [res["anchor_out"]] + [res[k] for k in ("qc", "agreement_out", "stats_out") if res.get(k)]
    st = res.get("stats") or {}
    if st.get("voxels"):
        lines.append(f"volume {st['volume_ml']:.1f} mL, HU mean {st['mean_hu']:.0f} (sd {st['std_hu']:.0f}), key slice "
                     f"{st['key_slice']} at S {st['key_slice_s_mm']} mm")
    lines += [f"wrote {', '.join(res['outs'])} ({res['mask_voxels']} voxels), " + ", ".join(written),
              _timings_text(res)]
    if res.get("threads_rule"):
        lines.append(f"compute: {res['threads_rule']}" + (f"; grounder in {res['grounder_dtype']}"
                                                          if res.get("grounder_dtype") else ""))
    return "\n".join(lines)


_TIMING_NAMES = {"ground_s": ("ground", "grounder"), "propagate_s": ("propagate", "medsam2"),
                 "total_s": ("ground + propagate", None), "write_s": ("write", None),
                 "job_s": ("job (reading the volume, loading the models, running and writing)", None)}


def _timings_text(res: dict) -> str:
    """The ``timings:`` line, each figure named, saying which include loading a model (the models
    load on first use, inside the step that first needs them)."""
    loads = res.get("model_load_s") or {}
    parts = []
    for key, value in res["timings"].items():
        if not isinstance(value, float) or key.endswith("per_slice"):
            continue
        name, model = _TIMING_NAMES.get(key, (key.removesuffix("_s"), None))
        load = loads.get(model) if model else None
        parts.append(f"{name} {value:.2f} s" + (f" (loading {'the language model' if model == 'grounder' else 'MedSAM2'}"
                                                 f" included: {load:.2f} s)" if load else ""))
    return "timings: " + ", ".join(parts)


def _sureness_text(res: dict) -> str:
    """The confidence of a consensus, else the answer signal; each with what it is not."""
    if res.get("confidence") is not None:
        samples = res.get("samples") or []
        absent = sum(1 for s in samples if s.get("absent"))
        unusable = sum(1 for s in samples if s.get("unusable"))
        extra = "".join([f", {absent} said not present" if absent else "",
                         f", {unusable} unusable" if unusable else ""])
        return (f"confidence {res['confidence']:.2f}: agreement of {len(samples)} samples (mean pairwise Dice{extra}); "
                f"mask: {res['consensus_mask']}. Agreement of the model with itself, not the chance that it is right")
    if res.get("answer_mean_prob") is not None:
        return (f"answer signal {res['answer_mean_prob']:.2f} (geometric-mean probability of the answer's tokens): "
                "how peaked the model's choice was, not the chance that it is right")
    return ""


def cmd_segment(args) -> int:
    from ..jobs import default_anchor_path

    queries = list(args.query or []) + (read_queries_file(args.queries) if args.queries else [])
    if not queries:
        raise InputError("give what to segment: --query TEXT (repeatable) or --queries FILE (one query per line)")
    from .pacs import dicomweb_run, stored_text

    with dicomweb_run(args, list(args.out)) as (volume, outs, finish):  # a DICOMweb series is retrieved here
        anchor_out = args.anchor_out or default_anchor_path(outs[0])
        res = finish(_run_segment(volume, queries, outs if len(outs) > 1 else outs[0], anchor_out, args.qc, args,
                                  args.preset, inputs=[("--queries", args.queries)]))
    emit(res, args.json, "\n".join(t for t in (_segment_text(res), stored_text(res)) if t))
    return 0


DEMO_OUTPUTS = ("demo_mask.nii.gz", "demo.anchor.json", "demo_qc.png")  # what `medvol demo` writes (and replaces)


def demo_folder_entries(out_dir) -> tuple:
    """``(previous, foreign)``: the names in ``out_dir`` that an earlier ``medvol demo`` wrote
    (:data:`DEMO_OUTPUTS`, and their temporaries) and every other name in it."""
    from ..fileio import _TMP_NAME_RE

    previous, foreign = [], []
    for entry in sorted(out_dir.iterdir(), key=lambda p: p.name):
        m = _TMP_NAME_RE.match(entry.name)
        if entry.name in DEMO_OUTPUTS and not entry.is_dir():
            previous.append(entry.name)
        elif not (m and m.group("name") in DEMO_OUTPUTS):  # a killed demo's temporaries are its own too
            foreign.append(entry.name)
    return previous, foreign


def cmd_demo(args) -> int:
    from pathlib import Path

    from .. import models
    from ..errors import OutputExistsError
    from ..fileio import check_folder
    from ..resources import load_json, resource_path

    sample = load_json("samples", "samples.json")["demo"]
    volume = resource_path("samples", sample["file"])
    query = args.query or sample["query"]
    preset, notice = models.best_available_preset(args.preset)
    out_dir = check_folder(Path(args.out_dir), "--out-dir")
    # the demo's own outputs are its to replace; anything else in the folder is never touched, and
    # without --overwrite it stops the demo (it may be a folder the user meant for something else)
    previous, foreign = demo_folder_entries(out_dir)
    if foreign and not args.overwrite:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputExistsError(f"--out-dir {out_dir} holds files the demo did not write ({shown}); choose another "
                                "--out-dir, or pass --overwrite to write the demo's files beside them")
    args.overwrite = True  # the demo's own files, from an earlier run
    if notice:
        sys.stderr.write(terminal_safe(f"{PROG} demo: {notice}", one_line=True) + "\n")
    res = _run_segment(volume, query, out_dir / DEMO_OUTPUTS[0], out_dir / DEMO_OUTPUTS[1],
                       out_dir / DEMO_OUTPUTS[2], args, preset, notice)
    written = {Path(p).name for p in (res["out"], res["anchor_out"], res["qc"]) if p}
    for name in previous:
        if name not in written:  # e.g. an earlier run's mask, when this answer was "not present"
            (out_dir / name).unlink(missing_ok=True)
    if previous:
        res["replaced"] = previous
        sys.stderr.write(terminal_safe(f"{PROG} demo: replaced the previous demo output in {out_dir} "
                                       f"({', '.join(previous)})", one_line=True) + "\n")
    text = f"demo on {volume.name} with preset '{preset}', query: {query!r}\n" + _segment_text(res)
    emit(res, args.json, text)
    return 0


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

def _add_segment_options(sp) -> None:
    add_preset_option(sp)
    sp.add_argument("--adapter", metavar="PATH", help="LoRA adapter folder for the grounder (overrides the preset's)")
    sp.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                    help="cpu (fp32) or cuda (bfloat16); auto picks cuda when available")
    sp.add_argument("--seed", type=seed_arg, help="random seed for --sample (reproducible sampling)")
    sp.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    sp.add_argument("--no-constrain", action="store_true", help="no grammar-constrained decoding (parse and retry instead)")
    sp.add_argument("--low-memory", action="store_true", help="free the language model from the GPU before MedSAM2 runs")
    add_ct_options(sp)
    add_seg_type_option(sp)
    add_stop_option(sp)
    sp.add_argument("--empty-mask-on-absent", action="store_true",
                    help="when the model answers that the target is not in this CT, still write the mask, all zero, "
                         "on the CT's grid (default: no mask file; the anchor and QC picture say 'not found')")
    add_consensus_options(sp, "--agreement")
    sp.add_argument("--stats", metavar="FILE", help="also write the target's statistics (.json or .csv): voxels, "
                                                    "volume in mL, HU mean/std/min/max, key slice and its S "
                                                    "position, bounding box in mm")
    add_compute_options(sp)
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument("--overwrite", action="store_true", help="replace existing outputs")


def add_volume_commands(add) -> None:
    """Add ``info``, ``anchor``, ``propagate``, ``segment`` and ``demo`` (``add`` as in :func:`~.app.build_parser`)."""
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

    sp = add("segment", "Segment a CT from a free-form query: evidence anchor (Qwen3-VL) + 3-D mask (MedSAM2).", cmd_segment)
    sp.add_argument("--volume", required=True, help=VOLUME_HELP)
    sp.add_argument("--query", action="append", metavar="TEXT",
                    help="what to segment, e.g. 'the organ that secretes bile'; repeat it for several targets in "
                         "one run (label i for the i-th query)")
    sp.add_argument("--queries", metavar="FILE", help="a text file of queries, one per line (after any --query; "
                                                      "blank lines and lines starting with # are skipped)")
    sp.add_argument("--out", required=True, action="append", metavar="PATH",
                    help="mask to write, on the CT's grid: a label map (.nii.gz, .nii, .nrrd, .mha), a Slicer "
                         "segmentation (.seg.nrrd) or, for a DICOM series folder, a DICOM Segmentation (.dcm); "
                         "repeat it to write the same result in several formats, or a DICOMweb study "
                         "(dicomweb://…/studies/S) to store the DICOM-SEG into (docs/pacs.md). With several queries a "
                         "label map gets a table beside it (*.labels.json)")
    sp.add_argument("--target-name", metavar="NAME",
                    help="the structure the query is about, when you know it (e.g. a dataset's label name, "
                         "kidney_left): it names and codes the segment (SNOMED CT, colour); the model still reads "
                         "only the query. One query only")
    sp.add_argument("--anchor-out", metavar="PATH", help="anchor file (default: beside the first --out, *.anchor.json; "
                                                         "with several queries one per target, *.K.anchor.json)")
    sp.add_argument("--qc", metavar="PNG", help="also write a picture of the key slice, boxes, mask outline and "
                                                "reasoning (with several queries one per target, *.K.png)")
    _add_segment_options(sp)
    add_dicomweb_options(sp)

    sp = add("demo", "Run the main job on the sample CT shipped with MedVol, with the best model present.", cmd_demo)
    sp.add_argument("--out-dir", default="medvol-demo",
                    help="where to write the mask, anchor and QC picture (default ./medvol-demo); a second demo "
                         "replaces the demo's own files there without --overwrite, and stops if the folder holds "
                         "anything else (--overwrite: write beside it; other files are never removed)")
    sp.add_argument("--query", help="override the demo query ('the organ that secretes bile')")
    _add_segment_options(sp)
    sp.set_defaults(preset=None)


def add_metrics_command(add) -> None:
    sp = add("metrics", "Dice and IoU of a predicted mask against a label map, compared by geometry on the prediction's grid.", cmd_metrics)
    sp.add_argument("--pred", required=True, help="predicted mask or label map")
    sp.add_argument("--gt", required=True, help="ground-truth label map")
    sp.add_argument("--label", action="append", metavar="N", help="ground-truth label id(s) (default: all non-zero / per label)")
