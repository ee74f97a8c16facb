"""``medvol batch``: the main job over a manifest of CTs, resumable and shardable.

The package: :mod:`.manifest` (the rows, checked before any model loads), :mod:`.case` (what one
case does and writes), :mod:`.run` (:func:`run_batch`: check, plan, run, summarise) and
:mod:`.report` (``summary.csv``/``.html`` from the cases' rows). Shards, resume, the per-case
record, failures recorded while the run goes on and the progress display are
:mod:`medvolcore.caseruns`', the loop ``medvol-train evaluate`` runs too.

A manifest lists cases, one per CSV row or JSONL line, with the fields ``id``, ``volume``,
``query`` and optionally ``gt`` (a label map) and ``label`` (an id, or several: ``2,3`` in CSV,
``[2, 3]`` in JSONL; without ``label`` every non-zero voxel of ``gt`` is the target). Relative
paths are resolved against the manifest's folder. Everything is checked before any model loads:
every row's fields (missing columns, empty fields, duplicate ids, ids that are not safe folder
names, ``label`` without ``gt``) and, for this shard's rows, their files from headers only
(:func:`check_case_files`: they exist, read as 3-D images, and the ground truth covers the CT's
space by :mod:`medvolcore.geometry`'s rule). Every problem is reported at once (``details``: one
line each) and nothing runs, unless ``skip_invalid``: rows with a problem are then recorded with
status ``invalid`` (no case folder) and the rest run. ``dry_run`` stops after the check and the plan.

For each case the run writes, in this order and each atomically (temporary name + rename),

- ``DIR/<id>/mask.nii.gz``  the 3-D mask on the CT's grid,
- ``DIR/<id>/anchor.json``  the evidence anchor (schema ``medvol.anchor/1``),
- ``DIR/<id>/qc.png``       the QC picture,
- ``DIR/<id>/agreement.nii.gz``  with ``--consensus G`` (G ≥ 2): per voxel, how many of the G samples
  include it (0..G, on the CT's grid),
- ``DIR/<id>/done.json``    status, seconds, metrics, anchor summary and the target's statistics
  (``stats``: :func:`medvolcore.stats.target_stats`): written LAST.

A case whose query the model answers with "not present in this CT" finishes with status ``absent``:
its ``anchor.json`` (schema ``medvol.anchor/3``) and ``qc.png`` say so, and no ``mask.nii.gz`` is
written unless ``--empty-mask-on-absent`` asks for an all-zero one. ``done.json`` lists the outputs
the case wrote.

A case is *complete* only when ``done.json`` is present, readable, says ``"status": "done"`` (or ``"absent"``),
matches the manifest entry (same volume, query, gt, label, preset, and the volume and gt files
as they are now: size and modification time of a file, names, sizes and times of a DICOM
folder's files) and the outputs it lists exist. A run killed at any moment therefore never leaves a case that counts as done without
its outputs. A case that fails (missing or corrupt file, model error, …) gets
``DIR/<id>/error.json`` (its error code and message) and the run goes on.

A ``volume`` may be a DICOMweb series URL (:mod:`medvolcore.pacs`; ``BatchOptions.dicomweb`` says
how it is read): checked before any model loads without contacting a server (its form, and the
servers allowed), the case retrieves it into its own private folder, reads it as a local DICOM
series and removes it when the case ends (unless kept). Its fingerprint is its URL (a DICOM UID
names one series forever), so ``--resume`` skips it without retrieving it. ``store_seg`` also
writes its DICOM-SEG into that folder and stores it into the series' study; ``done.json`` (with
``retrieved`` and ``stored``) is written only after the server accepted it.

``--resume`` skips complete cases and reruns failed or incomplete ones (their leftovers are
removed first), and cases whose volume or gt file was replaced since. A case folder that is a
symbolic link is refused: the run never writes or deletes through a link. Without ``--resume`` or ``--overwrite`` the run refuses to start when any of its
case folders already holds outputs. ``--overwrite`` reruns every case of the shard.

``--shard I/N`` (1-based ``I``, :func:`medvolcore.caseruns.parse_shard`) takes the cases whose
0-based position in the manifest ``p`` satisfies ``p % N == I - 1``: a deterministic partition (every case in exactly one shard, for
any manifest order), suited to a cluster job array (``--shard $((SLURM_ARRAY_TASK_ID+1))/N``).
Shards of one manifest may share ``DIR``: case folders never clash, and the summaries are
named ``summary.shard-I-of-N.csv`` / ``.html`` (``summary.csv`` / ``summary.html`` without
``--shard`` or with ``N = 1``).

``summary.html`` opens with the research-use notice and the model that made the run
(:func:`medvolcore.models.identity`: a zero-shot base model gets a warning banner); the run's
``info`` (``--json``) carries the same ``identity``, ``model_label`` and ``research_use``.

The summary covers every case of the shard, including those skipped by ``--resume`` (read back
from their ``done.json``; one written before statistics were recorded leaves those cells empty).
``summary.csv`` has exactly the columns :data:`SUMMARY_COLUMNS`:
``id,status,error,slice,boxes,seconds,dice,iou,confidence`` (``status`` ``done``, ``absent``, ``failed`` or ``invalid``;
``boxes`` is the number of boxes on the key slice; ``dice``/``iou`` empty without ``gt``; an absent case is
scored as an all-zero mask, so Dice is 0 when the ground truth has the target and 1 when it has none;
``confidence`` the agreement of the case's samples with ``--consensus``, empty without), then the
target's statistics ``voxels,volume_ml,mean_hu,std_hu,min_hu,max_hu,key_slice_s_mm,bbox_ras_min,bbox_ras_max``
(:data:`medvolcore.stats.COLUMNS` less ``query``, which is the manifest's, and ``key_slice``, which
is ``slice``; a box corner as ``r a s`` in RAS mm; an absent case has 0 voxels, 0 mL and empty HU;
a failed or invalid case empty cells).

After the cases come two aggregate rows, ``summary.mean`` and ``summary.median`` (no case can
have these ids: :func:`check_case_id` refuses ids starting with ``summary.``). One rule: each
aggregated column (:data:`AGGREGATED`: ``seconds``, ``dice``, ``iou``, ``confidence``, ``voxels``,
``volume_ml``) is the mean / median of that column over the *finished* cases (status ``done`` or
``absent``) that have a value in it; failed and invalid cases never count. So ``dice``/``iou`` are
over the finished cases with ``gt`` (an absent case scored as an empty mask, as above),
``voxels``/``volume_ml`` over every finished case (an absent one counts as 0 mL), ``confidence``
only with ``--consensus``. A column with no value to aggregate is empty, and so are the columns
that are not aggregated (HU, positions, boxes). The ``status`` cell says over what, e.g.
``mean of 12 finished; dice, iou: 9 with gt``. The run's ``info`` carries the same numbers as
``aggregate`` (:func:`aggregate`), and ``summary.html`` shows them in a table before the cases.
The exit code is 0 when no case failed: ``absent`` is an answer, not a failure.
"""

from ..caseruns import input_state, parse_shard
from .case import (AGREEMENT, CASE_SCHEMA, DONE, ERROR, FINISHED, INVALID, OUTPUTS, BatchCase, _clear_case,
                   completed_record)
from .manifest import (OPTIONAL_FIELDS, REQUIRED_FIELDS, Case, ManifestError, check_case_files, check_case_id,
                       parse_label, read_manifest)
from .report import (AGGREGATE_IDS, AGGREGATED, CASE_COLUMNS, STATS_COLUMNS, SUMMARY_COLUMNS, aggregate,
                     aggregate_csv_rows, aggregate_info, render_summary_html, summary_csv_rows, write_summary_csv,
                     write_summary_html)
from .run import (BatchOptions, BatchPlan, BatchResult, check_outside_cases, plan_batch, run_batch, shard_cases,
                  summary_names)

__all__ = ["Case", "ManifestError", "BatchOptions", "BatchPlan", "BatchResult", "BatchCase", "read_manifest",
           "parse_shard", "shard_cases", "summary_names", "completed_record", "plan_batch", "run_batch", "input_state",
           "check_outside_cases", "check_case_files", "SUMMARY_COLUMNS", "CASE_COLUMNS", "STATS_COLUMNS",
           "AGGREGATE_IDS", "AGGREGATED", "OUTPUTS", "AGREEMENT", "DONE", "ERROR", "FINISHED", "INVALID", "CASE_SCHEMA",
           "REQUIRED_FIELDS", "OPTIONAL_FIELDS", "aggregate", "aggregate_info", "aggregate_csv_rows",
           "summary_csv_rows", "write_summary_csv", "render_summary_html", "write_summary_html", "check_case_id",
           "parse_label"]

