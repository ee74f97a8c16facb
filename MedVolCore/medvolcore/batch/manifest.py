"""The manifest of ``medvol batch``: its rows read and checked before any model loads.

A manifest lists cases, one per CSV row or JSONL line, with the fields ``id``, ``volume``,
``query`` and optionally ``gt`` (a label map) and ``label`` (an id, or several: ``2,3`` in CSV,
``[2, 3]`` in JSONL; without ``label`` every non-zero voxel of ``gt`` is the target). Relative
paths are resolved against the manifest's folder; a ``volume`` that is a DICOMweb series URL is
kept as ``Case.source`` (retrieved when the case runs). :func:`read_manifest` checks every row's fields
(missing columns, empty fields, duplicate ids, ids that are not safe folder names, ``label``
without ``gt``) and reports every problem at once; :func:`check_case_files` checks a row's files
from their headers only. A :class:`Case`'s position in the manifest (``index``, invalid rows
included) places it in a shard (:func:`medvolcore.caseruns.shard_of`).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..caseruns import input_state, one_line
from ..errors import InputError, MedVolError
from ..pacs import is_dicomweb, parse_url
from ..strictjson import DuplicateKeyError, unique_keys

REQUIRED_FIELDS = ("id", "volume", "query")
OPTIONAL_FIELDS = ("gt", "label")
MAX_ID_CHARS = 128
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_WINDOWS_RESERVED = {"con", "prn", "aux", "nul"} | {f"com{i}" for i in range(1, 10)} | {f"lpt{i}" for i in range(1, 10)}


class ManifestError(InputError):
    """The batch manifest cannot be used (missing columns, duplicate or unsafe ids, …)."""

    code = "bad_manifest"


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
    source: Optional[str] = None  # a DICOMweb series URL (``volume`` is then None until it is retrieved)

    def fingerprint(self, preset: str = "", adapter=None, consensus: int = 1, consensus_mask: str = "greedy") -> dict:
        """What a finished case must match to be skipped by ``--resume``: its fields, the model,
        the consensus (when G > 1), and what its volume and ground truth files are now
        (:func:`medvolcore.caseruns.input_state`), so a CT replaced at the same path runs again.
        A series named by URL is identified by its URL: DICOM never gives a UID to two series, so
        a case finished on that URL is not retrieved again (``--overwrite`` redoes it)."""
        d = {"volume": self.source or str(self.volume), "query": self.query, "gt": str(self.gt) if self.gt else None,
             "label": self.label, "preset": preset, "adapter": str(adapter) if adapter else None,
             "volume_state": {"dicomweb": self.source} if self.source else input_state(self.volume),
             "gt_state": input_state(self.gt) if self.gt else None}
        if consensus > 1:
            d.update(consensus=consensus, consensus_mask=consensus_mask)
        return d


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
    from ..grounder import validate_query

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
        volume = rec["volume"].strip()
        if is_dicomweb(volume):  # a series on a DICOMweb server: retrieved when the case runs
            try:
                case.source = str(parse_url(volume, "volume"))
            except InputError as e:
                case.problem = str(e)
                continue
        else:
            case.volume = _resolve(volume, base)
        case.gt = _resolve(gt_text, base) if gt_text else None
    if not cases and not problems:
        raise ManifestError(f"{path}: the manifest lists no cases")
    return path, cases, problems


def check_case_files(cases: Sequence[Case]) -> None:
    """Set ``problem`` on each valid case whose files cannot be used, from headers only (no voxel
    read, nothing loaded): the volume and the ground truth exist, are regular files or DICOM
    folders and their headers read as 3-D scalar images (:func:`medvolcore.volume.read_grid`), and
    the ground truth covers the volume's space (:func:`medvolcore.geometry.match_grids`: the rule
    ``medvol metrics`` uses), and holds the requested label (one read of its voxels, the one cheap
    read this check makes). Each distinct file is read once. A DICOM folder's geometry needs every
    slice scanned: here it must hold at least one DICOM file (the ``DICM`` mark of a DICOM file's
    header), its grid is checked when the case runs. A ground truth's problem says so
    (``bad_ground_truth: …``)."""
    from ..errors import GroundTruthError
    from ..geometry import match_grids
    from ..volume import label_mask, load_label_map, read_grid

    def read_once(read):
        """``read(path)``, once per path: its answer, or its error raised again."""
        seen: Dict[str, object] = {}

        def get(p: Path):
            key = str(p)
            if key not in seen:
                try:
                    seen[key] = read(p)
                except MedVolError as e:
                    seen[key] = e
            if isinstance(seen[key], MedVolError):
                raise seen[key]
            return seen[key]
        return get

    labels_of, grid = read_once(load_label_map), read_once(read_grid)

    for c in cases:
        if c.problem:
            continue
        try:
            vg = grid(c.volume) if c.source is None else None  # a series URL: checked when it is retrieved
            if vg is None and c.source is None:
                _check_dicom_folder(c.volume)
        except MedVolError as e:
            c.problem = one_line(str(e))
            continue
        if c.gt is None:
            continue
        try:
            gg = grid(c.gt)
            if vg is not None and gg is not None:
                match_grids(vg[0], vg[1], gg[0], gg[1], pred_name=f"the CT {c.volume.name}",
                            gt_name=f"the ground truth {c.gt.name}")
            label_mask(labels_of(c.gt), c.label)
        except MedVolError as e:
            c.problem = one_line(f"{GroundTruthError.code}: {e}")


def _check_dicom_folder(folder: Path) -> None:
    """Refuse a folder in which no file is a DICOM file (none has the ``DICM`` mark at byte 128 of
    the DICOM file format), reading 132 bytes of each file until one is."""
    from ..errors import VolumeError

    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not entry.is_file():
            continue
        try:
            with open(entry.path, "rb") as f:
                if f.read(132)[128:] == b"DICM":
                    return
        except OSError:
            continue
    raise VolumeError(f"{folder} holds no DICOM file (no file in it has the DICOM file mark), so no DICOM series; "
                      "give the folder of one series")


__all__ = ["Case", "ManifestError", "read_manifest", "check_case_files", "check_case_id", "parse_label",
           "REQUIRED_FIELDS", "OPTIONAL_FIELDS"]
