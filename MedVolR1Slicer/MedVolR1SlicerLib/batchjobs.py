"""Arguments, manifests and the summary of the headless Slicer batch script (``batch.py``).

    Slicer --no-main-window --python-script MedVolR1Slicer/batch.py \\
        --input CT.nii.gz --query "the organ that secretes bile" --output liver.seg.nrrd
    Slicer --no-main-window --python-script MedVolR1Slicer/batch.py --manifest jobs.csv --output-dir out/

A manifest is CSV (header ``input,query[,output]``) or JSON Lines (``{"input", "query",
"output"?}``); relative paths are relative to the manifest. Inputs are volume files (NIfTI,
NRRD, MetaImage…) or DICOM series folders, which only Slicer's DICOM module loads (one series
per folder; a single DICOM file is refused rather than read as if it were the whole series).
Outputs are segmentation files (``.seg.nrrd``) or label maps (``.nii.gz``/``.nii``/``.nrrd``),
never overwritten without ``--overwrite``.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .params import DEFAULTS, DEVICES, PRESETS

OUTPUT_SUFFIXES = (".seg.nrrd", ".nii.gz", ".nii", ".nrrd")


class BatchError(ValueError):
    """Bad arguments or manifest: one line for the user."""


@dataclass
class BatchJob:
    input: Path
    query: str
    output: Path
    row: int = 0  # manifest line (1-based), 0 for the --input form

    @property
    def as_labelmap(self) -> bool:
        return not self.output.name.lower().endswith(".seg.nrrd")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="Slicer --no-main-window --python-script MedVolR1Slicer/batch.py",
        description="Segment CTs from free-form queries with MedVol-R1, headless in Slicer.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="a CT volume file (NIfTI, NRRD, MHA) or a folder holding one DICOM series")
    src.add_argument("--manifest", help="CSV or JSONL with input, query and optional output per row")
    ap.add_argument("--query", help="the clinical query (with --input)")
    ap.add_argument("--output", help="output file (with --input): .seg.nrrd, .nii.gz or .nrrd")
    ap.add_argument("--output-dir", help="folder for outputs of manifest rows without an output")
    ap.add_argument("--preset", default=DEFAULTS["preset"], help=f"model preset ({', '.join(PRESETS)}; default %(default)s)")
    ap.add_argument("--adapter", default="", help="LoRA adapter folder")
    ap.add_argument("--device", default=DEFAULTS["device"], choices=list(DEVICES))
    ap.add_argument("--window", default=DEFAULTS["window"], help="window preset or 'centre,width' in HU")
    ap.add_argument("--worker-url", default="", help="use a remote `medvol serve --http` worker instead of a local one")
    ap.add_argument("--token-file", default="", help="file with the remote worker's bearer token")
    ap.add_argument("--anchor-dir", default="", help="also write each evidence anchor (.anchor.json) here")
    ap.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    ap.add_argument("--keep-going", action="store_true", help="go on after a failed case (the exit code still says so)")
    return ap


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(list(argv))
    if args.input and not (args.query and args.output):
        ap.error("--input needs --query and --output")
    if args.manifest and (args.query or args.output):
        ap.error("--query/--output go with --input; a manifest carries them per row")
    return args


def _output_ok(path: Path, what: str) -> Path:
    if not path.name.lower().endswith(OUTPUT_SUFFIXES):
        raise BatchError(f"{what}: output {path} must end in {', '.join(OUTPUT_SUFFIXES)}")
    return path


def default_output(input_path: Path, out_dir: Path, row: int) -> Path:
    stem = input_path.name
    for suf in (".nii.gz", ".nii", ".nrrd", ".mha", ".mhd"):
        if stem.lower().endswith(suf):
            stem = stem[: -len(suf)]
            break
    return out_dir / f"{stem}.row{row}.seg.nrrd"


def read_manifest(path: Path, output_dir: Optional[Path] = None) -> List[BatchJob]:
    """Jobs from a CSV or JSONL manifest; every problem is named with its line."""
    path = Path(path)
    if not path.is_file():
        raise BatchError(f"manifest {path} does not exist")
    base = path.parent
    rows = []
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BatchError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise BatchError(f"{path}:{n}: each line must be a JSON object")
            rows.append((n, obj))
    else:
        reader = csv.DictReader(text.splitlines())
        if not reader.fieldnames or not {"input", "query"} <= {f.strip() for f in reader.fieldnames}:
            raise BatchError(f"{path}: the CSV header must name the columns input, query and optionally output")
        for n, obj in enumerate(reader, 2):
            rows.append((n, {k.strip(): (v or "").strip() for k, v in obj.items() if k}))
    jobs = []
    for n, obj in rows:
        inp, query = str(obj.get("input") or "").strip(), " ".join(str(obj.get("query") or "").split())
        if not inp or not query:
            raise BatchError(f"{path}:{n}: needs both 'input' and 'query'")
        ip = Path(inp) if Path(inp).is_absolute() else base / inp
        out = str(obj.get("output") or "").strip()
        if out:
            op = Path(out) if Path(out).is_absolute() else base / out
        elif output_dir is not None:
            op = default_output(ip, Path(output_dir), n)
        else:
            raise BatchError(f"{path}:{n}: no 'output'; give one per row or --output-dir")
        jobs.append(BatchJob(ip, query, _output_ok(op, f"{path}:{n}"), n))
    if not jobs:
        raise BatchError(f"manifest {path} has no rows")
    outs = [j.output.resolve() for j in jobs]
    dup = sorted({str(o) for o in outs if outs.count(o) > 1})
    if dup:
        raise BatchError(f"{path}: several rows write the same output ({dup[0]})")
    return jobs


def jobs_from_args(args: argparse.Namespace) -> List[BatchJob]:
    if args.input:
        return [BatchJob(Path(args.input), " ".join(args.query.split()), _output_ok(Path(args.output), "--output"))]
    return read_manifest(Path(args.manifest), Path(args.output_dir) if args.output_dir else None)


def check_outputs(jobs: Sequence[BatchJob], overwrite: bool) -> None:
    if overwrite:
        return
    existing = [j.output for j in jobs if j.output.exists()]
    if existing:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise BatchError(f"{existing[0]} exists{more}; pass --overwrite to replace")


def is_dicom_file(path: Path) -> bool:
    """True for a DICOM Part 10 file (``DICM`` after the 128-byte preamble)."""
    try:
        with open(path, "rb") as f:
            head = f.read(132)
    except OSError:
        return False
    return len(head) == 132 and head[128:] == b"DICM"


def input_kind(path: Path) -> str:
    """``"file"`` for a volume file, ``"dicom_folder"`` for a folder holding DICOM files.

    Raises :class:`BatchError` for a path that does not exist, a folder with no DICOM file in
    it, and a single DICOM file: one file is one slice, and reading it "as the series" would
    silently pick whatever else lies in its folder; the folder is what the user must name.
    """
    p = Path(path)
    if p.is_dir():
        if any(f.is_file() and is_dicom_file(f) for f in sorted(p.iterdir())):
            return "dicom_folder"
        raise BatchError(f"{p} is a folder without DICOM files; give a volume file or a folder holding one DICOM series")
    if not p.is_file():
        raise BatchError(f"input {p} does not exist")
    if is_dicom_file(p):
        raise BatchError(f"{p} is a single DICOM file; give the folder that holds its series (one series per folder)")
    return "file"


def check_inputs(jobs: Sequence[BatchJob]) -> None:
    """Every input exists (checked before any case runs, so a typo costs no model loading)."""
    missing = [j for j in jobs if not j.input.exists()]
    if missing:
        j = missing[0]
        where = f" (row {j.row})" if j.row else ""
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise BatchError(f"input {j.input}{where} does not exist{more}")


def anchor_path(anchor_dir: Path, job: BatchJob) -> Path:
    name = job.output.name
    for suf in OUTPUT_SUFFIXES:
        if name.lower().endswith(suf):
            name = name[: -len(suf)]
            break
    return Path(anchor_dir) / (re.sub(r"[^\w.-]+", "_", name) + ".anchor.json")


def summary(results: Sequence[tuple]) -> Tuple[str, int]:
    """``results``: ``(job, error or None)``. Returns the summary text and the exit code
    (0 all done, 1 some failed)."""
    failed = [(j, e) for j, e in results if e is not None]
    lines = [f"medvol batch (Slicer): {len(results) - len(failed)} of {len(results)} done"]
    for j, e in failed:
        where = f" (row {j.row})" if j.row else ""
        lines.append(f"  failed{where}: {j.input.name}: {e}")
    return "\n".join(lines), (1 if failed else 0)

