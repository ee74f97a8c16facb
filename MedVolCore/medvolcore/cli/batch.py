"""``medvol batch``: segment every case of a manifest, resumably, optionally one shard of it.

:func:`~medvolcore.cli.app.build_parser` wires it in with ``add_batch_command(sub, add)``; the work
is :func:`medvolcore.batch.run_batch`. ``python -m medvolcore.cli_batch --manifest CASES.csv
--out-dir DIR …`` is the same as ``medvol batch …``.

Exit codes: 0 every case done; 3 some case failed (each is in ``error.json`` and the summary) or was
recorded invalid (``--skip-invalid``); 2 the run could not start (bad manifest or files, bad ``--shard``, outputs already present, a model that
cannot load); 130 interrupted (Ctrl-C), 143 terminated (SIGTERM, e.g. a cluster's time limit).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..caseruns import SHARD_HELP
from .pacs import add_dicomweb_options, series_access
from .common import (add_compute_options, add_consensus_options, add_ct_options, add_preset_option, add_seg_type_option,
                     add_stop_option,
                     seed_arg, terminal_safe)

HELP = "Segment every case of a manifest (CSV or JSONL); resumable, shardable, with a summary table and page."

EPILOG = """\
manifest: CSV with a header row, or JSONL (one object per line); fields id, volume, query and
optionally gt (label map) and label (5, or 2,3 in CSV / [2,3] in JSONL; default: every non-zero
voxel of gt). Relative paths are resolved against the manifest's folder. Ids must be safe folder
names (letters, digits, '.', '_', '-'). A volume may be a DICOMweb series URL
(dicomweb://HOST[:PORT]/PATH/studies/S/series/SE, or https://…; medvol pacs find writes such a
manifest): the case retrieves it into a private folder, removed when the case ends (unless
--keep-downloads DIR), and reads it as a local series. A finished case is identified by its URL:
--resume does not retrieve it again.

outputs: DIR/<id>/mask.nii.gz, anchor.json, qc.png, then done.json (written last: a case counts
as finished only with it); a failed case gets DIR/<id>/error.json and the run continues.
A case the model answers with "not present in this CT" finishes with status 'absent': its
anchor.json and qc.png say so and no mask.nii.gz is written (--empty-mask-on-absent writes an
all-zero one).
DIR/summary.csv (id,status,error,slice,boxes,seconds,dice,iou,confidence, then the target's
statistics voxels,volume_ml,mean_hu,std_hu,min_hu,max_hu,key_slice_s_mm,bbox_ras_min,bbox_ras_max)
and DIR/summary.html; with --shard I/N they are summary.shard-I-of-N.csv/.html. With --consensus G
(G >= 2) each case also gets DIR/<id>/agreement.nii.gz and a confidence (agreement of its samples,
not accuracy).

aggregates: summary.csv ends with the rows summary.mean and summary.median (no case id may start
with 'summary.'): seconds, dice, iou, confidence, voxels and volume_ml, each over the finished
cases (done or absent) that have a value in it (dice/iou: those with gt); failed and invalid
cases never count; the status cell says over how many. summary.html shows them first and --json
carries them as 'aggregate'.

--shard I/N (I counts from 1: 1/4 is the first of 4) takes the cases at 0-based manifest
positions p with p % N == I-1 (for a cluster job array: --shard $((SLURM_ARRAY_TASK_ID+1))/N).

checked before any model loads: every row's fields, and for this shard's rows the files (exist,
headers read as 3-D images) and the ground truth's grid against the CT's (by geometry, as medvol
metrics compares). Every problem is printed, one line each, then the count, and nothing runs
(exit 2) unless --skip-invalid: then those rows get status 'invalid' in the summaries and the rest
run. --dry-run stops after the check and lists what would run.

exit codes: 0 no case failed (done or absent), 3 some failed or were invalid, 2 the run could not start,
130 interrupted, 143 terminated (SIGTERM)."""


def add_batch_command(sub, add):
    """Add ``batch`` to the ``medvol`` subcommands (``add(name, help, func)`` as in :func:`~.app.build_parser`)."""
    sp = add("batch", HELP, cmd_batch)
    sp.set_defaults(interrupt_hint="rerun with --resume to finish the remaining cases")
    sp.formatter_class = argparse.RawDescriptionHelpFormatter
    sp.epilog = EPILOG
    sp.add_argument("--manifest", required=True, metavar="CASES", help="cases to run: .csv or .jsonl")
    sp.add_argument("--out-dir", required=True, metavar="DIR", help="one folder per case, plus the summaries")
    add_preset_option(sp)
    sp.add_argument("--adapter", metavar="PATH", help="LoRA adapter folder for the grounder (overrides the preset's)")
    sp.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                    help="cpu (fp32) or cuda (bfloat16); auto picks cuda when available")
    sp.add_argument("--shard", metavar="I/N", help=SHARD_HELP)
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="skip finished cases (done.json); rerun failed or incomplete ones")
    g.add_argument("--overwrite", action="store_true", help="redo every case of the shard, replacing its outputs")
    sp.add_argument("--seed", type=seed_arg, help="random seed for --sample (reproducible sampling)")
    sp.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    add_ct_options(sp)
    add_seg_type_option(sp)
    add_stop_option(sp)
    sp.add_argument("--empty-mask-on-absent", action="store_true",
                    help="for a case the model answers 'not present', still write mask.nii.gz, all zero")
    add_consensus_options(sp, agreement=None)
    add_compute_options(sp)
    sp.add_argument("--skip-invalid", action="store_true",
                    help="run the rows that pass the check and record the others as 'invalid' (default: any problem "
                         "stops the run before a model loads)")
    sp.add_argument("--dry-run", action="store_true",
                    help="check the manifest and every file's header, say what would run, then stop (loads no model, "
                         "writes nothing)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_dicomweb_options(sp, batch=True)
    return sp


def _dry_text(info: dict) -> str:
    shard = f" (shard {info['shard']} of {info['manifest_cases']})" if info.get("shard") else ""
    lines = [f"dry run: {info['cases']} case(s){shard} checked with preset {info['preset']}; nothing was loaded or written",
             f"would run {len(info['would_run'])}: {', '.join(info['would_run']) or 'none'}"]
    if info["would_skip"]:
        lines.append(f"would skip {len(info['would_skip'])} as already finished: {', '.join(info['would_skip'])}")
    for c in info["invalid_cases"]:
        lines.append(terminal_safe(f"invalid {c['id']} (not run): {c['error']}", one_line=True))
    return "\n".join(lines)


def _aggregate_text(agg: dict) -> str:
    """One line of the run's aggregates (``info["aggregate"]``, :func:`medvolcore.batch.aggregate`)."""
    if not agg.get("finished"):
        return "aggregate: no finished case, nothing to aggregate"
    parts = []
    if agg.get("scored"):
        parts.append(f"Dice mean {agg['dice_mean']:.3f} / median {agg['dice_median']:.3f} over {agg['scored']} "
                     "case(s) with ground truth")
    else:
        parts.append("no finished case with ground truth (no Dice)")
    k = (agg.get("counts") or {}).get("volume_ml")
    if k:
        parts.append(f"volume mean {agg['volume_ml_mean']:.1f} mL / median {agg['volume_ml_median']:.1f} mL over {k} "
                     f"finished case(s)")
    return "aggregate: " + "; ".join(parts)


def _text(info: dict) -> str:
    if info.get("dry_run"):
        return _dry_text(info)
    lines = [f"model: {info['model_label']}"] if info.get("model_label") else []
    if info.get("notice"):
        lines.append("NOTE: " + info["notice"])
    shard = f" (shard {info['shard']} of {info['manifest_cases']})" if info.get("shard") else ""
    earlier = (f"; {info['skipped']} of them finished by an earlier run (kept, not run again), {info.get('ran', 0)} "
               "run now" if info.get("skipped") else "")
    lines.append(f"{info['cases']} case(s){shard}: {info['done']} done, {info.get('absent', 0)} not found in their CT, "
                 f"{info['failed']} failed, {info.get('invalid', 0)} invalid (not run){earlier}; "
                 f"{info['seconds']:.1f} s")
    if info.get("aggregate"):
        lines.append(_aggregate_text(info["aggregate"]))
    if info.get("confidence"):
        c = info["confidence"]
        lines.append(f"confidence over {c['cases']} case(s): mean {c['mean']:.3f}, lowest {c['min']:.3f} "
                     f"(agreement of {info['consensus']} samples per case, not accuracy)")
    if info.get("threads_rule"):
        lines.append(f"compute: {info['threads_rule']}")
    for f in info["failures"]:
        lines.append(terminal_safe(f"failed {f['id']}: {f['error']}", one_line=True))
    for f in info.get("invalid_cases", []):
        lines.append(terminal_safe(f"invalid {f['id']} (not run): {f['error']}", one_line=True))
    lines.append(f"summary: {info['summary_csv']}, {info['summary_html']}")
    return "\n".join(lines)


def cmd_batch(args) -> int:
    from ..batch import BatchOptions, run_batch
    from ..caseruns import parse_shard

    opts = BatchOptions(preset=args.preset, adapter=args.adapter, device=args.device, seed=args.seed,
                        sample=args.sample, ct_window=args.ct_window, strict_ct=args.strict_ct, seg_type=args.seg_type,
                        stop_after_empty=args.stop_after_empty,
                        consensus=args.consensus, consensus_mask=args.consensus_mask, shard=parse_shard(args.shard),
                        resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
                        empty_mask_on_absent=args.empty_mask_on_absent, threads=args.threads,
                        grounder_dtype=args.grounder_dtype, skip_invalid=args.skip_invalid, dry_run=args.dry_run,
                        dicomweb=series_access(args), store_seg=args.store_seg)

    # a cluster's time limit (SIGTERM) stops the run like Ctrl-C: cli.main turns it into an
    # exception, so temporary files are removed and --resume finishes the rest
    res = run_batch(args.manifest, args.out_dir, opts)
    if args.json:
        sys.stdout.write(json.dumps(res.info, indent=2) + "\n")
    else:
        sys.stdout.write(terminal_safe(_text(res.info)) + "\n")
    return res.exit_code
