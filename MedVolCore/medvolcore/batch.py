"""``medvol batch``: the main job over a manifest of CTs, resumable and shardable.

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

``--resume`` skips complete cases and reruns failed or incomplete ones (their leftovers are
removed first), and cases whose volume or gt file was replaced since. A case folder that is a
symbolic link is refused: the run never writes or deletes through a link. Without ``--resume`` or ``--overwrite`` the run refuses to start when any of its
case folders already holds outputs. ``--overwrite`` reruns every case of the shard.

``--shard I/N`` (1-based ``I``) takes the cases whose 0-based position in the manifest ``p``
satisfies ``p % N == I - 1``: a deterministic partition (every case in exactly one shard, for
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

from __future__ import annotations

import csv
import hashlib
import html
import io
import json
import logging
import math
import os
import re
import stat
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union
from urllib.parse import quote

from . import RESEARCH_USE_NOTICE
from .errors import InputError, MedVolError, OutputError, OutputExistsError
from .fileio import check_distinct, check_folder, remove_stale_temporaries, resolve_paths, write_text_atomic
from .models.identity import identity_note
from .stats import COLUMNS as _STATS_COLUMNS
from .stats import stats_cell
from .strictjson import DuplicateKeyError, unique_keys

log = logging.getLogger(__name__)

CASE_SCHEMA = "medvol.batch-case/1"
CASE_COLUMNS = ("id", "status", "error", "slice", "boxes", "seconds", "dice", "iou", "confidence")
# the target's statistics (medvolcore.stats) after them, less the query (the manifest's) and key_slice (``slice``)
STATS_COLUMNS = tuple(c for c in _STATS_COLUMNS if c not in ("query", "key_slice"))
SUMMARY_COLUMNS = CASE_COLUMNS + STATS_COLUMNS
# the aggregate rows' ids: check_case_id refuses ids starting with "summary.", so no case has them
AGGREGATE_IDS = ("summary.mean", "summary.median")
AGGREGATED = ("seconds", "dice", "iou", "confidence", "voxels", "volume_ml")  # over finished cases with a value
_DIGITS = {"seconds": 2, "dice": 4, "iou": 4, "confidence": 3, "voxels": 1, "volume_ml": 3}  # in the CSV and page
OUTPUTS = ("mask.nii.gz", "anchor.json", "qc.png")
FINISHED = ("done", "absent")  # statuses of a complete case
INVALID = "invalid"  # a row that failed the check before the run (recorded with --skip-invalid, never run)
AGREEMENT = "agreement.nii.gz"  # with --consensus G ≥ 2
_CASE_FILES = OUTPUTS + (AGREEMENT,)
DONE, ERROR = "done.json", "error.json"
REQUIRED_FIELDS = ("id", "volume", "query")
OPTIONAL_FIELDS = ("gt", "label")
MAX_ID_CHARS = 128
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_WINDOWS_RESERVED = {"con", "prn", "aux", "nul"} | {f"com{i}" for i in range(1, 10)} | {f"lpt{i}" for i in range(1, 10)}


class ManifestError(InputError):
    """The batch manifest cannot be used (missing columns, duplicate or unsafe ids, …)."""

    code = "bad_manifest"


# ---- the manifest --------------------------------------------------------------------------

@dataclass
class Case:
    """One manifest entry; ``index`` is its 0-based position in the manifest, ``line`` its line."""

    id: str
    volume: Optional[Path]
    query: str
    gt: Optional[Path] = None
    label: Optional[Union[int, List[int]]] = None
    index: int = 0
    line: int = 0
    problem: Optional[str] = None  # why the row cannot run (checked before any model loads); None: valid

    def fingerprint(self, preset: str = "", adapter=None, consensus: int = 1, consensus_mask: str = "greedy") -> dict:
        """What a finished case must match to be skipped by ``--resume``: its fields, the model,
        the consensus (when G > 1), and what its volume and ground truth files are now
        (:func:`input_state`), so a CT replaced at the same path runs again."""
        d = {"volume": str(self.volume), "query": self.query, "gt": str(self.gt) if self.gt else None,
             "label": self.label, "preset": preset, "adapter": str(adapter) if adapter else None,
             "volume_state": input_state(self.volume), "gt_state": input_state(self.gt) if self.gt else None}
        if consensus > 1:
            d.update(consensus=consensus, consensus_mask=consensus_mask)
        return d


_DETACHED_DATA_RE = re.compile(rb"^\s*(?:ElementDataFile\s*=|data file\s*:)\s*(\S[^\r\n]*?)\s*$", re.IGNORECASE | re.MULTILINE)


def input_state(path: Optional[Path]) -> Optional[dict]:
    """What an input file or DICOM folder is now, cheaply (no pixel is read): a file's size and
    ``mtime_ns`` (symbolic links followed; a detached header's data file, ``.mhd``/``.nhdr``, as
    well); a folder's file count and a sha256 over its files' names, sizes and ``mtime_ns``.
    None when the path does not exist (the case then fails when it runs)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        h = hashlib.sha256()
        n = 0
        try:
            with os.scandir(path) as it:
                entries = sorted((e.name, e.stat()) for e in it if e.is_file())
        except OSError:
            return None
        for name, est in entries:
            n += 1
            h.update(f"{name}\0{est.st_size}\0{est.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
        return {"files": n, "sha256": h.hexdigest()}
    state = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if str(path).lower().endswith((".mhd", ".nhdr")):
        try:
            with open(path, "rb") as f:
                m = _DETACHED_DATA_RE.search(f.read(64 * 1024))
        except OSError:
            m = None
        if m is not None:
            data = Path(path).parent / os.fsdecode(m.group(1))
            state["data"] = input_state(data) if data.is_file() else None
    return state


def check_case_id(value: str) -> Optional[str]:
    """Why ``value`` is not usable as a case folder name, or None when it is."""
    if not value:
        return "the id is empty"
    if len(value) > MAX_ID_CHARS:
        return f"id {value[:40]!r}… is longer than {MAX_ID_CHARS} characters"
    if not _ID_RE.match(value):
        return (f"id {value!r} is not safe as a folder name (use letters, digits, '.', '_' and '-', "
                "starting with a letter or digit)")
    if value.split(".")[0].lower() in _WINDOWS_RESERVED:
        return f"id {value!r} is a reserved device name on Windows"
    if value.lower().startswith("summary."):
        return f"id {value!r} would clash with the summary files (ids may not start with 'summary.')"
    return None


def parse_label(value, where: str = "label") -> Optional[Union[int, List[int]]]:
    """``5`` / ``"5"`` / ``"2,3"`` / ``[2, 3]`` → int or list of ints; empty → None."""
    if value is None:
        return None
    items = []
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected label ids, got {value!r}")
    if isinstance(value, int):
        items = [value]
    elif isinstance(value, str):
        parts = [p.strip() for p in re.split(r"[,;\s]+", value.strip().strip("[]")) if p.strip()]
        for p in parts:
            try:
                items.append(int(p))
            except ValueError:
                raise ValueError(f"{where}: {p!r} is not an integer label id") from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{where}: {v!r} is not an integer label id")
            items.append(v)
    else:
        raise ValueError(f"{where}: expected an integer or a list of integers, got {type(value).__name__}")
    if not items:
        return None
    bad = [v for v in items if v <= 0]
    if bad:
        raise ValueError(f"{where}: label ids must be positive (0 is background), got {bad[0]}")
    items = list(dict.fromkeys(items))
    return items[0] if len(items) == 1 else items


def _resolve(value: str, base: Path) -> Path:
    p = Path(os.path.expanduser(value))
    return p if p.is_absolute() else base / p


def _read_rows(path: Path) -> Tuple[List[Tuple[int, dict]], List[str]]:
    """(line, raw record) pairs of the manifest, and the problems found while reading it."""
    problems: List[str] = []
    rows: List[Tuple[int, dict]] = []
    name = path.name.lower()
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise ManifestError(f"cannot read the manifest {path}: {e.strerror or e}") from None
    if name.endswith(".csv"):
        reader = csv.DictReader(io.StringIO(text, newline=""))
        header = [h.strip() for h in (reader.fieldnames or [])]
        if not header:
            raise ManifestError(f"{path}: empty manifest; expected a header row with the columns {', '.join(REQUIRED_FIELDS)}")
        missing = [c for c in REQUIRED_FIELDS if c not in header]
        if missing:
            raise ManifestError(f"{path}: missing column(s) {', '.join(missing)} (found: {', '.join(header) or 'none'}); "
                                f"required: {', '.join(REQUIRED_FIELDS)}, optional: {', '.join(OPTIONAL_FIELDS)}")
        repeated = sorted(h for h, n in Counter(header).items() if h and n > 1)
        if repeated:
            raise ManifestError(f"{path}: the column {repeated[0]!r} appears more than once in the header row")
        reader.fieldnames = header
        for rec in reader:
            line = reader.line_num
            if None in rec:
                problems.append(f"line {line}: more fields than columns")
                continue
            if all((v or "").strip() == "" for v in rec.values()):
                continue
            rows.append((line, {k: (v.strip() if isinstance(v, str) else v) for k, v in rec.items()}))
    elif name.endswith((".jsonl", ".ndjson")):
        for line, raw in enumerate(text.splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw, object_pairs_hook=unique_keys)
            except DuplicateKeyError as e:
                problems.append(f"line {line}: the key {e.key!r} appears more than once; give each field once")
                continue
            except json.JSONDecodeError as e:
                problems.append(f"line {line}: not valid JSON ({e.msg})")
                continue
            except RecursionError:
                problems.append(f"line {line}: not valid JSON (nested too deeply)")
                continue
            if not isinstance(rec, dict):
                problems.append(f"line {line}: expected a JSON object, got {type(rec).__name__}")
                continue
            rows.append((line, rec))
    else:
        raise ManifestError(f"{path}: unknown manifest type; use .csv (a header row with {', '.join(REQUIRED_FIELDS)}) "
                            "or .jsonl (one JSON object per line)")
    return rows, problems


def read_manifest(path) -> List[Case]:
    """Read and validate a manifest (``.csv`` or ``.jsonl``); every problem is reported at once."""
    path, cases, fatal = _read_cases(path)
    problems = fatal + [f"line {c.line} ({c.id}): {c.problem}" for c in cases if c.problem]
    if problems:
        raise _problems_error(path, problems)
    return cases


def _problems_error(path, problems: Sequence[str], hint: str = "") -> "ManifestError":
    """One error for many problems: its message names the first ten and the count; ``details``
    holds one line per problem (the CLI prints each)."""
    shown = problems[:10]
    more = f"; … and {len(problems) - 10} more" if len(problems) > 10 else ""
    e = ManifestError(f"{path}: {len(problems)} problem(s){hint}: " + "; ".join(shown) + more)
    e.details = list(problems)
    e.summary = f"{path}: {len(problems)} problem(s){hint}"
    return e


def _read_cases(path) -> Tuple[Path, List[Case], List[str]]:
    """``(path, cases, fatal problems)``: every row with a usable, unique id is a :class:`Case`,
    with ``problem`` set when one of its other fields is wrong (``--skip-invalid`` records it as
    ``invalid``); a row without a usable id is a fatal problem (nothing could name its folder)."""
    from .grounder import validate_query

    path = Path(os.path.abspath(os.path.expanduser(str(path))))
    if not path.exists():
        raise ManifestError(f"manifest {path} does not exist")
    if path.is_dir():
        raise ManifestError(f"manifest {path} is a folder; give a .csv or .jsonl file")
    base = path.parent
    rows, problems = _read_rows(path)
    cases: List[Case] = []
    seen: Dict[str, Tuple[str, int]] = {}
    for line, rec in rows:
        where = f"line {line}"
        cid = rec.get("id")
        if cid is None or (isinstance(cid, str) and not cid.strip()):
            problems.append(f"{where}: missing id")
            continue
        if isinstance(cid, int) and not isinstance(cid, bool):
            cid = str(cid)
        if not isinstance(cid, str):
            problems.append(f"{where}: id must be text, got {type(cid).__name__}")
            continue
        cid = cid.strip()
        why = check_case_id(cid)
        if why:
            problems.append(f"{where}: {why}")
            continue
        key = cid.lower()  # case-insensitive file systems (macOS, Windows) would merge these folders
        if key in seen:
            first, first_line = seen[key]
            if first == cid:
                problems.append(f"{where}: duplicate id {cid!r} (first on line {first_line})")
            else:
                problems.append(f"{where}: id {cid!r} differs from {first!r} (line {first_line}) only in letter case; "
                                "their folders would clash on case-insensitive file systems")
            continue
        seen[key] = (cid, line)
        # positions are manifest positions (invalid rows included), so shards are stable
        case = Case(id=cid, volume=None, query=rec.get("query") if isinstance(rec.get("query"), str) else "",
                    index=len(cases), line=line)
        cases.append(case)
        missing = [k for k in REQUIRED_FIELDS[1:] if rec.get(k) is None or (isinstance(rec.get(k), str) and not rec[k].strip())]
        if missing:
            case.problem = f"missing {', '.join(missing)}"
            continue
        bad = [k for k in ("volume", "query", "gt") if rec.get(k) is not None and not isinstance(rec.get(k), str)]
        if bad:
            case.problem = f"{', '.join(bad)} must be text"
            continue
        try:
            case.query = validate_query(rec["query"])
        except InputError as e:
            case.problem = str(e)
            continue
        gt_text = (rec.get("gt") or "").strip()
        try:
            case.label = parse_label(rec.get("label"), "label")
        except ValueError as e:
            case.problem = str(e)
            continue
        if case.label is not None and not gt_text:
            case.problem = "'label' is given without 'gt'; give the label map in 'gt'"
            continue
        case.volume = _resolve(rec["volume"].strip(), base)
        case.gt = _resolve(gt_text, base) if gt_text else None
    if not cases and not problems:
        raise ManifestError(f"{path}: the manifest lists no cases")
    return path, cases, problems


def check_case_files(cases: Sequence[Case]) -> None:
    """Set ``problem`` on each valid case whose files cannot be used, from headers only (no voxel
    read, nothing loaded): the volume and the ground truth exist, are regular files or DICOM
    folders and their headers read as 3-D scalar images (:func:`medvolcore.volume.read_grid`), and
    the ground truth covers the volume's space (:func:`medvolcore.geometry.match_grids`: the rule
    ``medvol metrics`` uses). Each distinct file is read once. A DICOM folder's geometry needs
    every slice scanned: its files are checked here, its grid when the case runs."""
    from .geometry import match_grids
    from .volume import read_grid

    grids: Dict[str, object] = {}

    def grid(p: Path):
        key = str(p)
        if key not in grids:
            try:
                grids[key] = read_grid(p)
            except MedVolError as e:
                grids[key] = e
        if isinstance(grids[key], MedVolError):
            raise grids[key]
        return grids[key]

    for c in cases:
        if c.problem:
            continue
        try:
            vg = grid(c.volume)
            gg = grid(c.gt) if c.gt is not None else None
            if vg is not None and gg is not None:
                match_grids(vg[0], vg[1], gg[0], gg[1], pred_name=f"the CT {c.volume.name}",
                            gt_name=f"the ground truth {c.gt.name}")
        except MedVolError as e:
            c.problem = _one_line(str(e))


# ---- shards ----------------------------------------------------------------------------------

def parse_shard(spec: Optional[str]) -> Optional[Tuple[int, int]]:
    """``"2/4"`` → ``(2, 4)``; None → None. ``I`` is 1-based, ``1 ≤ I ≤ N``."""
    if spec is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(spec))
    if not m:
        raise InputError(f"--shard takes I/N with 1 ≤ I ≤ N (e.g. 2/4), got {spec!r}")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 1 <= i <= n:
        raise InputError(f"--shard {spec}: need 1 ≤ I ≤ N and N ≥ 1 (I is 1-based), got I={i}, N={n}")
    return i, n


def shard_cases(cases: Sequence[Case], shard: Optional[Tuple[int, int]]) -> List[Case]:
    """The cases of shard ``(I, N)``: manifest positions ``p`` with ``p % N == I - 1``."""
    if shard is None:
        return list(cases)
    i, n = shard
    return [c for c in cases if c.index % n == i - 1]


def summary_names(shard: Optional[Tuple[int, int]]) -> Tuple[str, str]:
    if shard is None or shard[1] == 1:
        return "summary.csv", "summary.html"
    i, n = shard
    return f"summary.shard-{i}-of-{n}.csv", f"summary.shard-{i}-of-{n}.html"


# ---- case folders ----------------------------------------------------------------------------

def _read_json(path: Path) -> Optional[dict]:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def completed_record(case_dir: Path, case: Case, fingerprint: Optional[dict] = None) -> Optional[dict]:
    """``done.json`` of a complete case (all outputs present, same inputs), else None."""
    d = _read_json(case_dir / DONE)
    if not d or d.get("status") not in FINISHED or d.get("id") != case.id:
        return None
    outputs = d.get("outputs") if isinstance(d.get("outputs"), list) else []
    listed = outputs if d.get("status") == "absent" else OUTPUTS
    if not set(OUTPUTS[1:]) <= set(listed) or not set(listed) <= set(_CASE_FILES):
        listed = OUTPUTS
    extra = (AGREEMENT,) if AGREEMENT in outputs else ()  # written with --consensus
    if not all((case_dir / name).is_file() for name in tuple(n for n in listed if n != AGREEMENT) + extra):
        return None
    if fingerprint is not None and d.get("case") != fingerprint:
        return None
    return d


def _has_outputs(case_dir: Path) -> bool:
    return case_dir.is_dir() and any((case_dir / n).exists() for n in _CASE_FILES + (DONE, ERROR))


def _clear_case(case_dir: Path) -> None:
    """Remove this tool's files from a case folder: done.json first, then the rest and leftovers.

    A case folder that is a symbolic link is refused (:class:`OutputError`), never emptied: its
    target may be anything (checked when the run is planned, and again here in case it was swapped)."""
    if os.path.islink(case_dir):
        raise OutputError(f"the case folder {case_dir} is a symbolic link; medvol batch never writes or deletes "
                          "through a link")
    for name in (DONE, ERROR) + _CASE_FILES:
        try:
            (case_dir / name).unlink()
        except FileNotFoundError:
            pass
    if case_dir.is_dir():
        for name in _CASE_FILES + (DONE, ERROR):
            remove_stale_temporaries(case_dir / name)  # a killed run's (fileio.atomic_path names them with its pid)
            for tmp in case_dir.glob(f".{name}.*.part*"):  # those of versions that named no pid
                if _LEGACY_TMP_RE.match(tmp.name[len(name) + 2:]):
                    try:
                        tmp.unlink()
                    except FileNotFoundError:
                        pass


_LEGACY_TMP_RE = re.compile(r"[a-z0-9_]{8}\.part")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# ---- the run ---------------------------------------------------------------------------------

@dataclass
class BatchOptions:
    preset: Optional[str] = None  # None: the manifest's default preset (models.default_preset())
    adapter: Optional[str] = None
    device: str = "auto"
    seed: Optional[int] = None
    sample: bool = False
    ct_window: Optional[str] = None
    stop_after_empty: Optional[int] = None  # None: the pipeline's default (DEFAULT_STOP_AFTER_EMPTY)
    consensus: int = 1  # G samples per case (1: off); G ≥ 2 writes agreement.nii.gz and a confidence
    consensus_mask: str = "greedy"
    shard: Optional[Tuple[int, int]] = None
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    empty_mask_on_absent: bool = False  # write an all-zero mask for a case the model answers "not present"
    skip_invalid: bool = False  # run the valid rows and record the others as "invalid" (default: refuse the run)
    dry_run: bool = False  # check everything, say what would run, load and write nothing
    threads: Optional[int] = None  # CPU threads (None: medvolcore.cpu's rule)
    grounder_dtype: Optional[str] = None  # fp32, bf16, or None/auto (medvolcore.cpu.grounder_dtype)


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
    _plan_cases(plan, opts, preset)
    return plan


def _check_consensus(opts: BatchOptions) -> None:
    from .consensus import check_mask_mode
    from .grounder import check_samples

    check_samples(opts.consensus, "--consensus")
    check_mask_mode(opts.consensus_mask, "--consensus-mask")
    if opts.consensus_mask != "greedy" and opts.consensus < 2:
        raise InputError(f"--consensus-mask {opts.consensus_mask} needs --consensus G (G ≥ 2)")
    if opts.consensus > 1 and opts.sample:
        raise InputError("--sample and --consensus do not go together: a consensus samples its own answers after "
                         "the greedy one")


def _check_batch_inputs(manifest, out_dir, opts: BatchOptions) -> BatchPlan:
    if opts.resume and opts.overwrite:
        raise InputError("--resume and --overwrite do not go together: --resume keeps finished cases, "
                         "--overwrite redoes every case")
    manifest_path, cases, fatal = _read_cases(manifest)
    mine = shard_cases(cases, opts.shard)
    check_case_files(mine)  # headers only: a missing file in row 500 is found before any model loads
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


def _plan_cases(plan: BatchPlan, opts: BatchOptions, preset: str) -> None:
    """Which cases run and which are already complete (``--resume``); refuse a run that would
    replace outputs it was not asked to replace; the output folder must be writable."""
    out = plan.out
    occupied = []
    for c in plan.mine:
        if c.problem:  # --skip-invalid: recorded as invalid, never run, its folder untouched
            continue
        cdir = out / c.id
        if opts.resume:
            rec = completed_record(cdir, c, c.fingerprint(preset, opts.adapter, opts.consensus, opts.consensus_mask))
            if rec is not None:
                plan.done_before[c.id] = rec
                continue
        elif not opts.overwrite and _has_outputs(cdir):
            occupied.append(c.id)
        plan.to_run.append(c)
    if occupied:
        shown = ", ".join(occupied[:5]) + (f" and {len(occupied) - 5} more" if len(occupied) > 5 else "")
        raise OutputExistsError(f"{out} already holds outputs for {len(occupied)} case(s) ({shown}); pass --resume to "
                                "skip finished cases and rerun the others, or --overwrite to redo them all")
    if not opts.dry_run:
        check_folder(out, "--out-dir")  # exists and writable, before the models load


def run_batch(manifest, out_dir, options: Optional[BatchOptions] = None, *, pipeline=None,
              on_case: Optional[Callable[[dict], None]] = None) -> BatchResult:
    """Run every case of the (shard of the) manifest; write the outputs and the summaries.

    ``pipeline``: an already built :class:`~medvolcore.pipeline.Pipeline` to use instead of
    building one from ``options`` (tests, the benchmark). ``on_case``: called with each row.
    """
    opts = options or BatchOptions()
    t_start = time.perf_counter()
    if opts.stop_after_empty is not None:
        from .propagation import check_stop_after_empty

        check_stop_after_empty(opts.stop_after_empty, "--stop-after-empty")
    _check_consensus(opts)
    plan = _check_batch_inputs(manifest, out_dir, opts)

    from .windowing import get_window

    hu_window = get_window(opts.ct_window)
    if opts.dry_run:
        return _dry_run(plan, opts, pipeline, manifest)
    if pipeline is None:
        from .pipeline import Pipeline

        pipeline = Pipeline(opts.preset, adapter=opts.adapter, device=opts.device,  # resolves the preset: fails early
                            grounder_dtype=opts.grounder_dtype)
    preset = pipeline.preset
    _plan_cases(plan, opts, preset)
    cases, mine, out, csv_name, html_name = plan.cases, plan.mine, plan.out, plan.csv_name, plan.html_name
    done_before, to_run = plan.done_before, plan.to_run

    from .cpu import apply_threads

    threads = apply_threads(opts.threads)
    t_load = time.perf_counter()
    if to_run:
        pipeline.load()  # once for the whole run; a model that cannot load stops the run here
    load_s = time.perf_counter() - t_load

    bar = None
    log_lines = False
    if opts.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(mine), initial=len(done_before), desc="batch", unit="case", file=sys.stderr,
                   dynamic_ncols=True, smoothing=0.1, disable=None,  # no bar when stderr is not a terminal
                   bar_format="{desc}: {n_fmt}/{total_fmt}|{bar}| {elapsed}<{remaining}{postfix}")
        if bar.disable:  # a log file (cluster job): one line per case instead
            bar = None
            log_lines = True
    counts = Counter({"done": 0, "absent": 0, "failed": 0})
    counts.update(rec.get("status", "done") for rec in done_before.values())

    def show(case_id: str = "", stage: str = "") -> None:
        if bar is not None:
            text = f"done {counts['done']}, absent {counts['absent']}, failed {counts['failed']}"
            if case_id:
                text += f" | {case_id} {stage}"
            bar.set_postfix_str(text, refresh=False)
            bar.refresh()

    show()
    from .progress import StageClock, clock_text

    rows_by_id: Dict[str, dict] = {cid: _row_from_done(rec) for cid, rec in done_before.items()}
    for c in mine:
        if c.problem:
            rows_by_id[c.id] = _row(c.id, INVALID, c.problem, _query=c.query, _reasoning="", _smoke=None,
                                    _skipped=False, _run_seconds=None)
    ran = 0
    t_loop = time.perf_counter()
    try:
        for c in to_run:
            last = [0.0]
            clock = StageClock()  # the case's stages (ground: encoding, prefill, decoding) with time left

            def progress(stage, fraction, message, _id=c.id, clock=clock):
                _, eta, _ = clock.update(stage, fraction)
                now = time.monotonic()
                if now - last[0] > 0.5:
                    last[0] = now
                    show(_id, f"{stage} {int(100 * fraction)}%" + (f", {clock_text(eta)} left" if eta else ""))

            show(c.id, "starting")
            row = _run_case(c, out / c.id, pipeline, opts, hu_window, progress)
            ran += 1
            rows_by_id[c.id] = row
            counts[row["status"]] += 1
            if bar is not None:
                bar.update(1)
            elif log_lines:
                finished = sum(counts.values())
                per_case = (time.perf_counter() - t_loop) / ran
                left = per_case * (len(to_run) - ran)
                sys.stderr.write(f"batch: [{finished}/{len(mine)}] {c.id} {row['status']} ({row['seconds']:.1f} s); "
                                 f"done {counts['done']}, absent {counts['absent']}, failed {counts['failed']}, "
                                 f"about {left / 60:.1f} min left\n")
                sys.stderr.flush()
            show()
            if on_case is not None:
                on_case(row)
    finally:
        if bar is not None:
            bar.close()

    rows = [rows_by_id[c.id] for c in mine if c.id in rows_by_id]
    smoke = bool(getattr(pipeline, "smoke", False)) or any(r.get("_smoke") for r in rows)
    identity = _run_identity(pipeline, smoke)
    agg = aggregate(rows)
    write_summary_csv(out / csv_name, rows, agg)
    write_summary_html(out / html_name, rows, title=f"MedVol batch: {Path(str(manifest)).name}"
                       + (f", shard {opts.shard[0]}/{opts.shard[1]}" if opts.shard else ""), preset=preset, smoke=smoke,
                       identity=identity, agg=agg)
    seconds = time.perf_counter() - t_start
    run_s = sum(r["_run_seconds"] for r in rows if r.get("_run_seconds") is not None)
    info = {
        "manifest": str(manifest), "out_dir": str(out), "preset": preset, "smoke": smoke, "identity": identity,
        "model_label": (identity or {}).get("label"), "research_use": RESEARCH_USE_NOTICE,
        "shard": f"{opts.shard[0]}/{opts.shard[1]}" if opts.shard else None,
        "cases": len(mine), "manifest_cases": len(cases),
        "done": sum(r["status"] == "done" for r in rows), "absent": sum(r["status"] == "absent" for r in rows),
        "failed": sum(r["status"] == "failed" for r in rows), "invalid": sum(r["status"] == INVALID for r in rows),
        "skipped": len(done_before), "ran": ran,
        "seconds": round(seconds, 3), "model_load_s": round(load_s, 3), "cases_seconds": round(run_s, 3),
        "cases_per_minute": round(60.0 * ran / seconds, 3) if ran and seconds > 0 else None,
        "summary_csv": str(out / csv_name), "summary_html": str(out / html_name),
        "failures": [{"id": r["id"], "error": r["error"]} for r in rows if r["status"] == "failed"],
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
        from .models import resolve

        preset = resolve(opts.preset, adapter=opts.adapter).name
    _plan_cases(plan, opts, preset)
    info = {"manifest": str(manifest), "out_dir": str(plan.out), "preset": preset, "dry_run": True,
            "shard": f"{opts.shard[0]}/{opts.shard[1]}" if opts.shard else None,
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


def _row(case_id, status, error="", slice_=None, boxes=None, seconds=None, dice=None, iou=None, **extra) -> dict:
    r = {"id": case_id, "status": status, "error": error, "slice": slice_, "boxes": boxes, "seconds": seconds,
         "dice": dice, "iou": iou}
    r.update(extra)
    return r


def _row_from_done(d: dict) -> dict:
    a = d.get("anchor") or {}
    m = d.get("metrics") or {}
    return _row(d["id"], d.get("status", "done"), "", a.get("slice"), a.get("n_boxes"), d.get("seconds"), m.get("dice"),
                m.get("iou"),
                _query=d.get("case", {}).get("query", ""), _reasoning=d.get("reasoning", ""), _smoke=d.get("smoke"),
                _skipped=True, _run_seconds=None, confidence=d.get("confidence"),
                _agreement=AGREEMENT in (d.get("outputs") or []),
                stats=d.get("stats") if isinstance(d.get("stats"), dict) else None)  # None: an older done.json


def _run_case(c: Case, cdir: Path, pipe, opts: BatchOptions, hu_window, progress) -> dict:
    """Segment one case and write its files; any failure is recorded in ``error.json``."""
    t0 = time.perf_counter()
    fingerprint = c.fingerprint(pipe.preset, opts.adapter, opts.consensus, opts.consensus_mask)  # before the volume is read: a file replaced later reruns
    try:
        _clear_case(cdir)
    except OutputError as e:  # a case folder swapped for a link after planning: nothing written into it
        seconds = round(time.perf_counter() - t0, 3)
        return _row(c.id, "failed", f"{e.code}: {_one_line(str(e))}", None, None, seconds, None, None, _query=c.query,
                    _reasoning="", _smoke=None, _skipped=False, _run_seconds=seconds)
    cdir.mkdir(parents=True, exist_ok=True)
    try:
        rec = _segment_case(c, cdir, pipe, opts, hu_window, progress, fingerprint, t0)
        return _row(c.id, rec["status"], "", rec["anchor"]["slice"], rec["anchor"]["n_boxes"], rec["seconds"],
                    (rec["metrics"] or {}).get("dice"), (rec["metrics"] or {}).get("iou"), _query=c.query,
                    _reasoning=rec["reasoning"], _smoke=rec["smoke"], _skipped=False, _run_seconds=rec["seconds"],
                    confidence=rec.get("confidence"), _agreement=AGREEMENT in rec["outputs"], stats=rec["stats"])
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001 - one case's failure must not stop the run
        seconds = round(time.perf_counter() - t0, 3)
        if isinstance(e, MedVolError):
            code, message = e.code, _one_line(str(e))
        else:
            log.debug("case %s failed", c.id, exc_info=True)
            code, message = "internal_error", _one_line(f"{type(e).__name__}: {e}")
        try:
            _clear_case(cdir)  # a failed case keeps only its error.json
        except OutputError:
            return _row(c.id, "failed", f"{code}: {message}", None, None, seconds, None, None, _query=c.query,
                        _reasoning="", _smoke=None, _skipped=False, _run_seconds=seconds)
        err = {"schema": CASE_SCHEMA, "id": c.id, "status": "failed", "error": {"code": code, "message": message},
               "seconds": seconds, "case": fingerprint, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_text_atomic(cdir / ERROR, json.dumps(err, indent=2) + "\n", overwrite=True)
        return _row(c.id, "failed", f"{code}: {message}", None, None, seconds, None, None, _query=c.query,
                    _reasoning="", _smoke=None, _skipped=False, _run_seconds=seconds)


def _segment_case(c: Case, cdir: Path, pipe, opts: BatchOptions, hu_window, progress, fingerprint, t0) -> dict:
    from .geometry import gt_on_grid
    from .jobs import SegmentOutputs, SegmentRequest, run_segment_job
    from .pipeline import as_stack
    from .volume import CTVolume, label_mask, load_label_map

    stack = as_stack(c.volume)
    target = on = None
    if c.gt is not None:  # read before the model runs: a bad label map fails the case cheaply
        labels = load_label_map(c.gt)
        on = gt_on_grid(stack.volume, labels)  # by geometry (medvolcore.geometry), or refused
        labels = CTVolume(on.array, stack.volume.affine, path=labels.path)
        target = label_mask(labels, c.label)
    request = SegmentRequest(query=c.query, hu_window=hu_window, stop_after_empty=opts.stop_after_empty,
                             sample=opts.sample, seed=opts.seed, reference=target, qc_title=f"{c.id} · query: {c.query}",
                             consensus=opts.consensus, consensus_mask=opts.consensus_mask)
    agreement = cdir / AGREEMENT if opts.consensus > 1 else None
    outputs = SegmentOutputs(cdir / OUTPUTS[0], anchor=cdir / OUTPUTS[1], qc=cdir / OUTPUTS[2], overwrite=True,
                             names=OUTPUTS, empty_mask_on_absent=opts.empty_mask_on_absent, agreement=agreement,
                             agreement_name=AGREEMENT)
    res = run_segment_job(pipe, stack, request, outputs, inputs=[("volume", c.volume), ("gt", c.gt)],
                          progress=progress)
    a = res["anchor"]
    written = [name for name, path in zip(OUTPUTS, (res["out"], res["anchor_out"], res["qc"])) if path]
    rec = {
        "schema": CASE_SCHEMA, "id": c.id, "status": "absent" if res["absent"] else "done",
        "seconds": round(time.perf_counter() - t0, 3),
        "case": fingerprint,
        "metrics": dict(res["metrics"], gt_resampled=on.note) if res["metrics"] is not None and on is not None
        else res["metrics"],
        "anchor": {"slice": a["slice"], "n_boxes": len(a["boxes"]), "boxes": [list(b) for b in a["boxes"]]},
        "reasoning": res["reasoning"], "mask_voxels": res["mask_voxels"], "smoke": res["smoke"],
        "identity": res.get("identity"),
        "notes": res["notes"], "outputs": written + ([AGREEMENT] if res["agreement_out"] else []),
        "propagation": res["propagation"], "answer_mean_prob": res["answer_mean_prob"],
        "consensus": res["consensus"], "consensus_mask": res["consensus_mask"], "confidence": res["confidence"],
        "stats": res["stats"],
        "timings": {k: v for k, v in res["timings"].items() if isinstance(v, float)},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_text_atomic(cdir / DONE, json.dumps(rec, indent=2) + "\n", overwrite=True)  # last: marks the case complete
    return rec


# ---- summaries -------------------------------------------------------------------------------

def _fmt(v, digits: Optional[int] = None) -> str:
    if v is None or v == "":
        return ""
    if digits is not None and isinstance(v, (int, float)):
        return f"{float(v):.{digits}f}"
    return str(v)


def summary_csv_rows(rows: Sequence[dict]) -> List[List[str]]:
    """The cases' cells, in :data:`SUMMARY_COLUMNS` order (no aggregate rows)."""
    out = []
    for r in rows:
        st = r.get("stats") or {}
        out.append([r["id"], r["status"], r["error"] or "", _fmt(r["slice"]), _fmt(r["boxes"]),
                    _fmt(r["seconds"], _DIGITS["seconds"]), _fmt(r["dice"], _DIGITS["dice"]),
                    _fmt(r["iou"], _DIGITS["iou"]), _fmt(r.get("confidence"), _DIGITS["confidence"])]
                   + [stats_cell(st.get(c)) for c in STATS_COLUMNS])
    return out


def _number(v) -> Optional[float]:
    """A finite number, or None (missing, text, a bool, NaN: nothing to aggregate)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _column_value(r: dict, column: str):
    return (r.get("stats") or {}).get(column) if column in STATS_COLUMNS else r.get(column)


def aggregate(rows: Sequence[dict]) -> dict:
    """The run's aggregates (the module docstring's rule): the counts by status, ``finished``
    (done + absent), ``scored`` (finished cases with a Dice), and for each column of
    :data:`AGGREGATED` its ``<column>_mean`` and ``<column>_median`` over the finished cases with
    a value (None when there is none) and, in ``counts``, how many cases that was. Unrounded."""
    finished = [r for r in rows if r["status"] in FINISHED]
    agg = {"cases": len(rows), "done": sum(r["status"] == "done" for r in rows),
           "absent": sum(r["status"] == "absent" for r in rows), "failed": sum(r["status"] == "failed" for r in rows),
           "invalid": sum(r["status"] == INVALID for r in rows), "finished": len(finished)}
    counts = {}
    for column in AGGREGATED:
        values = [v for v in (_number(_column_value(r, column)) for r in finished) if v is not None]
        counts[column] = len(values)
        agg[f"{column}_mean"] = statistics.fmean(values) if values else None
        agg[f"{column}_median"] = float(statistics.median(values)) if values else None
    agg["scored"] = counts["dice"]
    agg["counts"] = counts
    return agg


def aggregate_info(agg: dict) -> dict:
    """:func:`aggregate` for ``--json``: means and medians rounded to 6 decimals."""
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in agg.items()}


_OVER = {"dice": "with gt", "iou": "with gt", "voxels": "with statistics", "volume_ml": "with statistics"}


def _aggregate_status(kind: str, agg: dict) -> str:
    """What an aggregate row is over: ``mean of 12 finished; dice, iou: 9 with gt``."""
    n = agg["finished"]
    groups: Dict[Tuple[int, str], List[str]] = {}
    for column in AGGREGATED:
        k = agg["counts"][column]
        if k and k != n:
            groups.setdefault((k, _OVER.get(column, "with a value")), []).append(column)
    parts = [f"{kind} of {n} finished"] + [f"{', '.join(cols)}: {k} {why}" for (k, why), cols in groups.items()]
    return "; ".join(parts)


def aggregate_csv_rows(agg: dict) -> List[List[str]]:
    """The ``summary.mean`` and ``summary.median`` rows, in :data:`SUMMARY_COLUMNS` order."""
    out = []
    for row_id in AGGREGATE_IDS:
        kind = row_id.split(".", 1)[1]
        cells = dict.fromkeys(SUMMARY_COLUMNS, "")
        cells.update(id=row_id, status=_aggregate_status(kind, agg))
        for column in AGGREGATED:
            cells[column] = _fmt(agg[f"{column}_{kind}"], _DIGITS[column])
        out.append([cells[c] for c in SUMMARY_COLUMNS])
    return out


def write_summary_csv(path: Path, rows: Sequence[dict], agg: Optional[dict] = None) -> Path:
    """The cases, then the aggregate rows (``agg``: :func:`aggregate` of ``rows`` when not given)."""
    buf = io.StringIO(newline="")
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(SUMMARY_COLUMNS)
    w.writerows(summary_csv_rows(rows))
    w.writerows(aggregate_csv_rows(agg if agg is not None else aggregate(rows)))
    return write_text_atomic(path, buf.getvalue(), overwrite=True)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.5em auto;max-width:1100px;
color:#222;background:#fafafa;padding:0 1em}
h1{font-size:1.4em} table{border-collapse:collapse;font-size:.9em} td,th{border:1px solid #ccc;padding:.2em .5em}
th{background:#eee} .banner{background:#b00020;color:#fff;padding:.6em 1em;font-weight:bold;border-radius:4px}
.case{background:#fff;border:1px solid #ddd;border-radius:6px;margin:1.2em 0;padding:.8em 1em}
.case h2{font-size:1.1em;margin:.2em 0 .5em} .done{color:#087f23} .failed{color:#b00020} .absent{color:#8a5a00}
.case img{max-width:100%;height:auto;border:1px solid #333;display:block;margin:.5em 0}
.reasoning{white-space:pre-wrap;background:#f4f4f4;padding:.5em;border-radius:4px;font-size:.9em}
.error{white-space:pre-wrap;color:#b00020} .invalid{color:#b00020} .meta{color:#555;font-size:.9em}
.notice{font-weight:bold;color:#7a4d00} table.aggregate{margin:.8em 0 1.2em}
table.aggregate caption{text-align:left;font-weight:bold;padding:.3em 0}
"""


def _aggregate_html(agg: dict) -> str:
    """The aggregates' table (the module docstring's rule), shown before the cases."""
    esc = html.escape
    n = agg["finished"]
    lines = [f"<table class=\"aggregate\"><caption>Aggregates over the {n} finished case(s) (done or not found); "
             f"failed and invalid cases are not counted</caption>",
             "<tr><th></th><th>mean</th><th>median</th><th>over</th></tr>"]

    def row(label, column, over):
        mean, median = agg[f"{column}_mean"], agg[f"{column}_median"]
        lines.append(f"<tr><th>{esc(label)}</th><td>{esc(_fmt(mean, _DIGITS[column]) or '—')}</td>"
                     f"<td>{esc(_fmt(median, _DIGITS[column]) or '—')}</td><td>{esc(over)}</td></tr>")

    k = agg["counts"]["dice"]
    over = (f"{k} case(s) with ground truth (a case not found is scored as an empty mask)" if k
            else "no finished case with ground truth")
    row("Dice", "dice", over)
    row("IoU", "iou", over)
    k = agg["counts"]["volume_ml"]
    row("volume (mL)", "volume_ml",
        f"{k} case(s) with statistics (a case not found counts as 0 mL)" if k else "no case")
    if agg["counts"]["confidence"]:
        row("confidence", "confidence", f"{agg['counts']['confidence']} case(s) (agreement of the model's samples, "
                                        "not accuracy)")
    k = agg["counts"]["seconds"]
    row("seconds per case", "seconds", f"{k} case(s)" if k else "no case")
    lines.append("</table>")
    return "\n".join(lines)


def _stats_text(st: Optional[dict]) -> List[str]:
    """A done case's statistics for its section: volume and the HU inside the mask."""
    if not st or _number(st.get("volume_ml")) is None:
        return []
    out = [f"volume {st['volume_ml']:.3f} mL ({st.get('voxels')} voxels)"]
    if _number(st.get("mean_hu")) is not None:
        spread = f" ± {st['std_hu']:.1f} (SD)" if _number(st.get("std_hu")) is not None else ""
        out.append(f"HU in the mask: mean {st['mean_hu']:.1f}{spread}, min {_fmt(st.get('min_hu'))}, "
                   f"max {_fmt(st.get('max_hu'))}")
    return out


def render_summary_html(rows: Sequence[dict], title: str = "MedVol batch", preset: str = "", smoke: bool = False,
                        identity: Optional[dict] = None, agg: Optional[dict] = None) -> str:
    """The batch report: the research-use notice, which model made it (``identity``, see
    :func:`medvolcore.models.identity`) with a warning banner unless a MedVol-R1 adapter did, the
    aggregates (``agg``: :func:`aggregate` of ``rows`` when not given), a table of the cases and
    one section per case."""
    esc = html.escape
    n_done = sum(r["status"] == "done" for r in rows)
    n_absent = sum(r["status"] == "absent" for r in rows)
    n_invalid = sum(r["status"] == INVALID for r in rows)
    n_failed = len(rows) - n_done - n_absent - n_invalid
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>",
             f"<style>{_CSS}</style></head><body>", f"<h1>{esc(title)}</h1>",
             f"<p class=\"notice\">{esc(RESEARCH_USE_NOTICE)}</p>"]
    if smoke:
        parts.append("<p class=\"banner\">Made with the untrained 'tiny' smoke model: every anchor, mask and metric "
                     "on this page is meaningless. Use a real preset (medvol models download qwen3-vl-4b) for results.</p>")
    elif identity and not identity.get("trained_for_task"):
        parts.append(f"<p class=\"banner\">{esc(identity_note(identity) or identity['label'])}.</p>")
    model = f"model: {identity['label']} · " if identity else ""
    parts.append(f"<p class=\"meta\">{esc(model)}preset {esc(preset)} · {len(rows)} case(s): {n_done} done, "
                 f"{n_absent} not found, {n_failed} failed, {n_invalid} invalid (not run) · written {esc(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>")
    parts.append(_aggregate_html(agg if agg is not None else aggregate(rows)))
    parts.append("<table class=\"cases\"><tr>" + "".join(f"<th>{c}</th>" for c in SUMMARY_COLUMNS) + "</tr>")
    for r, cells in zip(rows, summary_csv_rows(rows)):
        anchor = "case-" + quote(r["id"])
        tds = [f"<td><a href=\"#{anchor}\">{esc(cells[0])}</a></td>", f"<td class=\"{r['status']}\">{esc(cells[1])}</td>"]
        tds += [f"<td>{esc(v)}</td>" for v in cells[2:]]
        parts.append("<tr>" + "".join(tds) + "</tr>")
    parts.append("</table>")
    for r in rows:
        cid = r["id"]
        link = quote(cid)
        parts.append(f"<section class=\"case\" id=\"case-{link}\"><h2>{esc(cid)} "
                     f"<span class=\"{r['status']}\">[{esc(r['status'])}]</span></h2>")
        parts.append(f"<p><b>query:</b> {esc(r.get('_query') or '')}</p>")
        if r["status"] == "done":
            metrics = []
            if r["dice"] is not None:
                metrics.append(f"Dice {r['dice']:.4f}, IoU {r['iou']:.4f}")
            s_mm = _number((r.get("stats") or {}).get("key_slice_s_mm"))
            at = f" (S {s_mm:.1f} mm)" if s_mm is not None else ""
            metrics.append(f"key slice {r['slice']}{at}, {r['boxes']} box(es)")
            metrics += _stats_text(r.get("stats"))
            if r.get("confidence") is not None:
                metrics.append(f"confidence {r['confidence']:.3f} (agreement of the model's samples, not accuracy)")
            metrics.append(f"{_fmt(r['seconds'], 2)} s" + (" (from an earlier run)" if r.get("_skipped") else ""))
            agreement = f" · <a href=\"{link}/{AGREEMENT}\">agreement</a>" if r.get("_agreement") else ""
            parts.append(f"<p class=\"meta\">{esc(' · '.join(metrics))} · <a href=\"{link}/mask.nii.gz\">mask</a> · "
                         f"<a href=\"{link}/anchor.json\">anchor</a>{agreement}</p>")
            parts.append(f"<img src=\"{link}/qc.png\" alt=\"QC picture of {esc(cid)}\" loading=\"lazy\">")
            parts.append(f"<div class=\"reasoning\"><b>reasoning:</b> {esc(r.get('_reasoning') or '(none)')}</div>")
        elif r["status"] == "absent":
            metrics = ["not found in this CT: the model answered that the target is not present; no mask"]
            if r["dice"] is not None:
                metrics.append(f"scored as an empty mask: Dice {r['dice']:.4f}")
            if r.get("confidence") is not None:
                metrics.append(f"confidence {r['confidence']:.3f} (agreement of the model's samples, not accuracy)")
            agreement = f" · <a href=\"{link}/{AGREEMENT}\">agreement</a>" if r.get("_agreement") else ""
            parts.append(f"<p class=\"meta\">{esc(' · '.join(metrics))} · <a href=\"{link}/anchor.json\">anchor</a>"
                         f"{agreement}</p>")
            parts.append(f"<img src=\"{link}/qc.png\" alt=\"QC picture of {esc(cid)}\" loading=\"lazy\">")
            parts.append(f"<div class=\"reasoning\"><b>reasoning:</b> {esc(r.get('_reasoning') or '(none)')}</div>")
        else:
            parts.append(f"<p class=\"error\"><b>error:</b> {esc(r['error'] or '')}</p>")
        parts.append("</section>")
    parts.append(f"<footer class=\"notice\">{esc(RESEARCH_USE_NOTICE)}</footer>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_summary_html(path: Path, rows: Sequence[dict], **kw) -> Path:
    """:func:`render_summary_html` written atomically."""
    return write_text_atomic(path, render_summary_html(rows, **kw), overwrite=True)


__all__ = ["Case", "ManifestError", "BatchOptions", "BatchPlan", "BatchResult", "read_manifest", "parse_shard",
           "shard_cases", "summary_names", "completed_record", "plan_batch", "run_batch", "input_state",
           "check_outside_cases", "SUMMARY_COLUMNS", "CASE_COLUMNS", "STATS_COLUMNS", "AGGREGATE_IDS", "AGGREGATED",
           "aggregate", "aggregate_info", "aggregate_csv_rows", "summary_csv_rows", "check_case_id", "parse_label"]
