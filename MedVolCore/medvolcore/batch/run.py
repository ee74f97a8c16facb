"""A ``medvol batch`` run: check everything, plan, run the cases through
:func:`medvolcore.caseruns.run_cases`, write the summaries (the contract: :mod:`medvolcore.batch`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .. import RESEARCH_USE_NOTICE
from ..caseruns import RunProgress, Shard, plan_run, run_cases, shard_of, shard_text, status_counts
from ..errors import InputError, OutputError, OutputExistsError
from ..fileio import check_distinct, check_folder, resolve_paths
from ..models.identity import identity_note
from .case import FAILED, FINISHED, INVALID, STATUSES, BatchCase, has_outputs, invalid_row, row_from_done
from .manifest import Case, _problems_error, _read_cases, check_case_files
from .report import aggregate, aggregate_info, write_summary_csv, write_summary_html


def shard_cases(cases: Sequence[Case], shard: Optional[Shard]) -> List[Case]:
    """The cases of shard ``(I, N)``: manifest positions ``p`` (``Case.index``) with ``p % N == I - 1``."""
    return shard_of(cases, shard, position=lambda c: c.index)


def summary_names(shard: Optional[Shard]) -> Tuple[str, str]:
    """``summary.csv``/``.html``, or ``summary.shard-I-of-N.*`` for shard I of N > 1 (shards share ``DIR``)."""
    if shard is None or shard[1] == 1:
        return "summary.csv", "summary.html"
    i, n = shard
    return f"summary.shard-{i}-of-{n}.csv", f"summary.shard-{i}-of-{n}.html"


@dataclass
class BatchOptions:
    """A run's settings (``medvol batch``'s options); ``shard`` is :func:`medvolcore.caseruns.parse_shard`'s."""

    preset: Optional[str] = None  # None: the manifest's default preset (models.default_preset())
    adapter: Optional[str] = None
    device: str = "auto"
    seed: Optional[int] = None
    sample: bool = False
    ct_window: Optional[str] = None
    strict_ct: bool = False  # refuse a volume that does not look like CT (default: a warning in the result)
    seg_type: str = "binary"  # a DICOM-SEG output's type (--seg-type): binary or labelmap
    stop_after_empty: Optional[int] = None  # None: the pipeline's default (DEFAULT_STOP_AFTER_EMPTY)
    consensus: int = 1  # G samples per case (1: off); G ≥ 2 writes agreement.nii.gz and a confidence
    consensus_mask: str = "greedy"
    shard: Optional[Shard] = None
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    empty_mask_on_absent: bool = False  # write an all-zero mask for a case the model answers "not present"
    skip_invalid: bool = False  # run the valid rows and record the others as "invalid" (default: refuse the run)
    dry_run: bool = False  # check everything, say what would run, load and write nothing
    threads: Optional[int] = None  # CPU threads (None: medvolcore.cpu's rule)
    grounder_dtype: Optional[str] = None  # fp32, bf16, or None/auto (medvolcore.cpu.grounder_dtype)
    dicomweb: Optional[object] = None  # medvolcore.pacs.SeriesAccess: how rows naming a series by URL are read
    store_seg: bool = False  # store each URL case's DICOM-SEG into its series' study on the same server

    def request_settings(self, hu_window=None) -> dict:
        """The options every case's segment request takes (:meth:`SegmentRequest.from_manifest`)."""
        return dict(hu_window=hu_window if hu_window is not None else self.ct_window,
                    stop_after_empty=self.stop_after_empty, sample=self.sample, seed=self.seed,
                    consensus=self.consensus, consensus_mask=self.consensus_mask, strict_ct=self.strict_ct,
                    seg_type=self.seg_type)


@dataclass
class BatchResult:
    rows: List[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 0 if all(r["status"] in FINISHED for r in self.rows) else 3


@dataclass
class BatchPlan:
    """What a run will do, decided before any model loads: the manifest's cases, this shard's
    (``mine``), the summaries' names, the cases already complete (``done_before``, by id, with
    ``--resume``) and those to run, in manifest order."""

    cases: List[Case]
    mine: List[Case]
    out: Path
    csv_name: str
    html_name: str
    done_before: Dict[str, dict] = field(default_factory=dict)
    to_run: List[Case] = field(default_factory=list)


def plan_batch(manifest, out_dir, options: Optional[BatchOptions] = None, preset: str = "") -> BatchPlan:
    """Read and check the manifest and the output folder and decide which cases run: everything
    :func:`run_batch` does before it loads a model (no volume is read). ``preset`` is the resolved
    preset's name (what ``--resume`` compares with finished cases). Linear in the number of cases:
    each input path and case folder is resolved once."""
    opts = options or BatchOptions()
    plan = _check_batch_inputs(manifest, out_dir, opts)
    _plan_cases(plan, opts, BatchCase(plan.out, opts, preset))
    return plan


def _check_settings(opts: BatchOptions) -> None:
    """The options' rules, once for every case and before any row is read: the request's own
    (:meth:`SegmentRequest.check_settings`), named as ``medvol batch``'s options."""
    from ..request import SegmentRequest

    SegmentRequest(door="manifest", **opts.request_settings()).check_settings()


def _check_sources(cases: Sequence[Case], mine: Sequence[Case], opts: BatchOptions) -> None:
    """Set ``problem`` on each row of this shard whose series URL this run may not read (a server
    not allowed, or a second server for one token); no server is contacted. The DICOMweb options
    of a manifest without any series URL (in any shard) are refused."""
    from ..pacs import SeriesAccess, check_sources

    access = opts.dicomweb
    given = opts.store_seg or (access is not None and (access.token or access.keep or access.servers is not None))
    if given and not any(c.source for c in cases):
        raise InputError("--store-seg, --keep-downloads, --dicomweb-token-file and --pacs-config go with a manifest "
                         "naming series by DICOMweb URL; this one names none")
    urls = [c for c in mine if c.source and not c.problem]
    if not urls:
        return
    problems = check_sources([c.source for c in urls], opts.dicomweb or SeriesAccess())
    for c in urls:
        c.problem = problems.get(c.source, c.problem)


def _check_batch_inputs(manifest, out_dir, opts: BatchOptions) -> BatchPlan:
    if opts.resume and opts.overwrite:
        raise InputError("--resume and --overwrite do not go together: --resume keeps finished cases, "
                         "--overwrite redoes every case")
    manifest_path, cases, fatal = _read_cases(manifest)
    mine = shard_cases(cases, opts.shard)
    check_case_files(mine)  # headers only: a missing file in row 500 is found before any model loads
    _check_sources(cases, mine, opts)  # series URLs: their servers, nothing contacted
    # every row's fields are checked (a shard refuses a manifest with a bad row anywhere, as before);
    # files only for this shard's rows (each shard checks its own)
    problems = fatal + [f"line {c.line} ({c.id}): {c.problem}" for c in cases if c.problem]
    if fatal or (problems and not opts.skip_invalid):
        hint = ("; nothing ran (fix them, or pass --skip-invalid to run the other rows)" if not fatal
                else "; nothing ran")
        raise _problems_error(manifest_path, problems, hint)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(f"cannot use --out-dir {out}: it is a file, not a folder")
    csv_name, html_name = summary_names(opts.shard)
    # a case folder that is a symbolic link would make the run write and delete in its target
    linked = [c.id for c in mine if os.path.islink(out / c.id)]
    if linked:
        shown = ", ".join(linked[:5]) + (f" and {len(linked) - 5} more" if len(linked) > 5 else "")
        raise OutputError(f"the case folder(s) {shown} in {out} are symbolic links; medvol batch never writes or "
                          "deletes through a link: remove the link(s) or choose another --out-dir")
    # nothing a run writes or clears may be one of its inputs: refuse before any work
    check_distinct([("the summary table", out / csv_name), ("the summary page", out / html_name)],
                   [("--manifest", manifest)])
    inputs = [(f"case {c.id} {k}", p) for c in mine if not c.problem
              for k, p in (("volume", c.volume), ("gt", c.gt)) if p is not None]
    check_outside_cases(out, [c.id for c in mine], inputs,
                        [("the summary table", out / csv_name), ("the summary page", out / html_name)])
    return BatchPlan(cases=cases, mine=mine, out=out, csv_name=csv_name, html_name=html_name)


def check_outside_cases(out: Path, ids: Sequence[str], inputs: Sequence[Tuple[str, Path]],
                        outputs: Sequence[Tuple[str, Path]] = ()) -> None:
    """Refuse an input that is one of ``outputs`` or lies in one of the case folders ``out/<id>``
    (whose files a run replaces), symbolic links and ``..`` resolved. O(inputs + ids): each input's
    folder is resolved once (:func:`~medvolcore.fileio.resolve_paths`) and its ancestors are looked
    up in a set of the resolved case folders."""
    if not inputs:
        return
    root = resolve_paths([out])[0]
    case_dirs = {os.path.normcase(os.path.join(root, cid)): cid for cid in ids}  # no case folder is a link (checked)
    resolved = resolve_paths([p for _label, p in inputs])
    out_ids = {r: label for (label, _p), r in zip(outputs, resolve_paths([p for _l, p in outputs]))}
    out_inodes = {}
    for label, p in outputs:
        try:
            st = os.stat(p)
            out_inodes[(st.st_dev, st.st_ino)] = label
        except OSError:
            pass
    for (label, p), r in zip(inputs, resolved):
        if r in out_ids:
            raise InputError(f"{out_ids[r]} {p} is the input {label}; write the output elsewhere")
        if out_inodes:  # hard links of an existing summary
            try:
                st = os.stat(p)
            except OSError:
                st = None
            if st is not None and (st.st_dev, st.st_ino) in out_inodes:
                raise InputError(f"{out_inodes[(st.st_dev, st.st_ino)]} is the input {label} ({p}); "
                                 "write the output elsewhere")
        if not r.startswith(root.rstrip(os.sep) + os.sep):
            continue
        folder = r
        while len(folder) > len(root):
            if folder in case_dirs:
                cid = case_dirs[folder]
                raise InputError(f"{label} {p} is inside the output folder of case {cid} ({out / cid}), whose "
                                 "files a run replaces; move it out of --out-dir")
            folder = os.path.dirname(folder)


def _plan_cases(plan: BatchPlan, opts: BatchOptions, keeper: BatchCase) -> None:
    """Which cases run and which are already complete (``--resume``: :func:`medvolcore.caseruns.plan_run`);
    refuse a run that would replace outputs it was not asked to replace; the output folder must be
    writable. A row refused by the check (``--skip-invalid``) is recorded as invalid, never run, its
    folder untouched."""
    split = plan_run(plan.mine, keeper, runnable=lambda c: not c.problem)
    plan.done_before, plan.to_run = split.done_before, split.to_run
    if not opts.resume and not opts.overwrite:
        occupied = [c.id for c in plan.to_run if has_outputs(plan.out / c.id)]
        if occupied:
            shown = ", ".join(occupied[:5]) + (f" and {len(occupied) - 5} more" if len(occupied) > 5 else "")
            raise OutputExistsError(f"{plan.out} already holds outputs for {len(occupied)} case(s) ({shown}); pass "
                                    "--resume to skip finished cases and rerun the others, or --overwrite to redo "
                                    "them all")
    if not opts.dry_run:
        check_folder(plan.out, "--out-dir")  # exists and writable, before the models load


def run_batch(manifest, out_dir, options: Optional[BatchOptions] = None, *, pipeline=None,
              on_case: Optional[Callable[[dict], None]] = None) -> BatchResult:
    """Run every case of the (shard of the) manifest; write the outputs and the summaries.

    ``pipeline``: an already built :class:`~medvolcore.pipeline.Pipeline` to use instead of
    building one from ``options`` (tests, the benchmark). ``on_case``: called with each row.
    """
    opts = options or BatchOptions()
    t_start = time.perf_counter()
    _check_settings(opts)
    plan = _check_batch_inputs(manifest, out_dir, opts)

    from ..windowing import get_window

    hu_window = get_window(opts.ct_window)
    if opts.dry_run:
        return _dry_run(plan, opts, pipeline, manifest)
    if pipeline is None:
        from ..pipeline import Pipeline

        pipeline = Pipeline(opts.preset, adapter=opts.adapter, device=opts.device,  # resolves the preset: fails early
                            grounder_dtype=opts.grounder_dtype)
    preset = pipeline.preset
    keeper = BatchCase(plan.out, opts, preset, pipeline, hu_window)
    _plan_cases(plan, opts, keeper)
    cases, mine, out, csv_name, html_name = plan.cases, plan.mine, plan.out, plan.csv_name, plan.html_name
    done_before = plan.done_before

    from ..cpu import apply_threads

    threads = apply_threads(opts.threads)
    display = RunProgress("batch", len(mine), FINISHED + (FAILED,), (rec.get("status", "done") for rec in
                                                                      done_before.values()), enabled=opts.progress)
    # the models load once, only when a case must run; a model that cannot load stops the run there
    outcome = run_cases(plan.to_run, keeper, load=pipeline.load, display=display, on_case=on_case)
    ran, load_s = len(outcome.rows), outcome.load_s
    rows_by_id: Dict[str, dict] = {cid: row_from_done(rec) for cid, rec in done_before.items()}
    rows_by_id.update((c.id, invalid_row(c)) for c in mine if c.problem)
    rows_by_id.update((r["id"], r) for r in outcome.rows)
    rows = [rows_by_id[c.id] for c in mine if c.id in rows_by_id]
    smoke = bool(getattr(pipeline, "smoke", False)) or any(r.get("_smoke") for r in rows)
    identity = _run_identity(pipeline, smoke)
    agg = aggregate(rows)
    write_summary_csv(out / csv_name, rows, agg)
    write_summary_html(out / html_name, rows, title=f"MedVol batch: {Path(str(manifest)).name}"
                       + (f", shard {shard_text(opts.shard)}" if opts.shard else ""), preset=preset, smoke=smoke,
                       identity=identity, agg=agg)
    seconds = time.perf_counter() - t_start
    run_s = sum(r["_run_seconds"] for r in rows if r.get("_run_seconds") is not None)
    info = {
        "manifest": str(manifest), "out_dir": str(out), "preset": preset, "smoke": smoke, "identity": identity,
        "model_label": (identity or {}).get("label"), "research_use": RESEARCH_USE_NOTICE,
        "shard": shard_text(opts.shard),
        "cases": len(mine), "manifest_cases": len(cases),
        **status_counts(rows, STATUSES),  # done, absent, failed, invalid
        "skipped": len(done_before), "ran": ran,
        "seconds": round(seconds, 3), "model_load_s": round(load_s, 3), "cases_seconds": round(run_s, 3),
        "cases_per_minute": round(60.0 * ran / seconds, 3) if ran and seconds > 0 else None,
        "summary_csv": str(out / csv_name), "summary_html": str(out / html_name),
        "failures": [{"id": r["id"], "error": r["error"]} for r in rows if r["status"] == FAILED],
        "invalid_cases": [{"id": r["id"], "error": r["error"]} for r in rows if r["status"] == INVALID],
        "consensus": opts.consensus, "consensus_mask": opts.consensus_mask,
        "threads": threads.threads, "threads_rule": threads.describe(),
        "aggregate": aggregate_info(agg),
    }
    confidences = [r["confidence"] for r in rows if r.get("confidence") is not None]
    if confidences:  # agreement of each case's samples: not accuracy
        info["confidence"] = {"cases": len(confidences), "mean": round(sum(confidences) / len(confidences), 4),
                              "min": min(confidences)}
    if smoke:
        info["notice"] = "made with the untrained 'tiny' smoke model: anchors, masks and metrics are meaningless"
    elif identity_note(identity):
        info["notice"] = identity_note(identity)
    return BatchResult(rows=rows, info=info)


def _dry_run(plan: BatchPlan, opts: BatchOptions, pipeline, manifest) -> BatchResult:
    """What a run would do, after every check and without loading a model or writing a file."""
    if pipeline is not None:
        preset = pipeline.preset
    else:
        from ..models import resolve

        preset = resolve(opts.preset, adapter=opts.adapter).name
    _plan_cases(plan, opts, BatchCase(plan.out, opts, preset))
    info = {"manifest": str(manifest), "out_dir": str(plan.out), "preset": preset, "dry_run": True,
            "shard": shard_text(opts.shard),
            "cases": len(plan.mine), "manifest_cases": len(plan.cases),
            "would_run": [c.id for c in plan.to_run], "would_skip": sorted(plan.done_before),
            "invalid_cases": [{"id": c.id, "error": c.problem} for c in plan.mine if c.problem],
            "research_use": RESEARCH_USE_NOTICE}
    return BatchResult(rows=[], info=info)


def _run_identity(pipeline, smoke: bool) -> Optional[dict]:
    """What made this run's anchors (the pipeline's models; a smoke run is said to be one)."""
    ident = getattr(pipeline, "identity", None)
    if ident is not None and smoke and not ident.get("smoke"):
        ident = dict(ident, smoke=True, zero_shot=False, trained_for_task=False,
                     label="untrained tiny smoke model (random weights): results are meaningless")
    return ident


__all__ = ["BatchOptions", "BatchPlan", "BatchResult", "plan_batch", "run_batch", "check_outside_cases",
           "shard_cases", "summary_names"]
