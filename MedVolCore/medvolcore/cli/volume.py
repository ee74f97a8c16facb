"""The main job on one volume: ``medvol segment`` and ``demo``, and the text they print.

Both run :func:`medvolcore.jobs.run_segment_job` with a preset's grounder and MedSAM2; the
request and outputs are checked before the volume is read, and the models load only then.
The pipeline's steps one at a time (``info``, ``anchor``, ``propagate``, ``metrics``) are
:mod:`.steps`.
"""

from __future__ import annotations

import sys
from typing import Optional

from ..errors import InputError
from .common import (PROG, VOLUME_HELP, _bar, _progress, add_compute_options, add_consensus_options, add_ct_options,
                     add_preset_option, add_seg_type_option, add_stop_option, apply_compute_options, emit,
                     peak_memory_mb, seed_arg, terminal_safe)
from .common import BAR_FORMAT, bar_line  # noqa: F401  (the progress bar, importable from here as before)
from .pacs import add_dicomweb_options


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
    """Add ``segment`` and ``demo`` (``add`` as in :func:`~.app.build_parser`)."""
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
