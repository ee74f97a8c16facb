"""Arguments, manifests and the summary of the headless Slicer batch script (``batch.py``).

    Slicer --no-main-window --python-script MedVolR1Slicer/Scripts/batch.py \\
        --input CT.nii.gz --query "the organ that secretes bile" --output liver.seg.nrrd
    Slicer --no-main-window --python-script MedVolR1Slicer/Scripts/batch.py --manifest jobs.csv --output-dir out/

A manifest is CSV (header ``input,query[,output]``) or JSON Lines (``{"input", "query",
"output"?}``); relative paths are relative to the manifest. Inputs are volume files (NIfTI,
NRRD, MetaImage…) or DICOM series folders, which only Slicer's DICOM module loads (one series
per folder; a single DICOM file is refused rather than read as if it were the whole series).
Outputs are segmentation files (``.seg.nrrd``) or label maps (``.nii.gz``/``.nii``/``.nrrd``),
never overwritten without ``--overwrite``, and never, even with it, one of the files the batch
reads (any row's input, the manifest, the token file) or another row's output or anchor
(:func:`check_distinct`, before any case runs). The manifest and the token file are read only
when they are regular files (a named pipe or a device is refused, never waited on).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .consensus import MAX_CONSENSUS
from .params import DEFAULTS, DEVICES, PRESETS

OUTPUT_SUFFIXES = (".seg.nrrd", ".nii.gz", ".nii", ".nrrd")
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # a 10,000-row manifest is about 2 MB
MAX_TOKEN_BYTES = 64 * 1024


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
        prog="Slicer --no-main-window --python-script MedVolR1Slicer/Scripts/batch.py",
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
    ap.add_argument("--consensus", type=int, default=1, metavar="G",
                    help=f"answers per case, 1 (default: off) to {MAX_CONSENSUS}: the model answers G times and the segmentation "
                         "gains the samples' agreement (their agreement with each other, not accuracy)")
    ap.add_argument("--threads", default="auto", metavar="N|auto",
                    help="CPU threads of the local worker (default auto: the physical cores other work leaves "
                         "free); a remote worker decides its own")
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
    if not 1 <= args.consensus <= MAX_CONSENSUS:
        ap.error(f"--consensus takes 1 to {MAX_CONSENSUS} answers (1 = off), got {args.consensus}")
    args.threads = _threads(ap, args.threads)
    if args.threads is not None and args.worker_url:
        ap.error("--threads sets the local worker's threads; a remote worker (--worker-url) decides its own")
    return args


def _threads(ap, value: str) -> Optional[int]:
    """``--threads``: ``auto`` → None, else a whole number 1..1024."""
    if str(value).strip().lower() == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= 1024:
        ap.error(f"--threads takes a whole number from 1 to 1024, or auto; got {value!r}")
    return n


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
    """Jobs from a CSV or JSONL manifest; every problem is named with its line. Refuses (in time
    linear in the number of rows) two rows writing one file and an output that is an input or
    the manifest (:func:`check_distinct`)."""
    path = Path(path)
    base = path.parent
    rows = []
    text = read_regular_file(path, "manifest", MAX_MANIFEST_BYTES)
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
        out = str(obj.get("output") or "").strip()
        if "\0" in inp or "\0" in out:
            raise BatchError(f"{path}:{n}: a path holds a NUL character")
        ip = Path(inp) if Path(inp).is_absolute() else base / inp
        if out:
            op = Path(out) if Path(out).is_absolute() else base / out
        elif output_dir is not None:
            op = default_output(ip, Path(output_dir), n)
        else:
            raise BatchError(f"{path}:{n}: no 'output'; give one per row or --output-dir")
        jobs.append(BatchJob(ip, query, _output_ok(op, f"{path}:{n}"), n))
    if not jobs:
        raise BatchError(f"manifest {path} has no rows")
    check_distinct(jobs, reads=[("the manifest", path)])
    return jobs


def jobs_from_args(args: argparse.Namespace) -> List[BatchJob]:
    if args.input:
        return [BatchJob(Path(args.input), " ".join(args.query.split()), _output_ok(Path(args.output), "--output"))]
    return read_manifest(Path(args.manifest), Path(args.output_dir) if args.output_dir else None)


def _row_label(job: BatchJob, what: str) -> str:
    """``"row 3's output"``, or the option's name for the ``--input`` form."""
    if job.row:
        return f"row {job.row}'s {what}"
    return {"input": "--input", "output": "--output"}.get(what, f"the {what}")


class _FileKeys:
    """What makes two paths one file: the path with symbolic links and ``..`` resolved (in the
    order the system resolves them: ``link/..`` is the folder above the link's target), and
    ``(device, inode)`` when it exists (hard links, bind mounts). The rule of MedVolCore's
    ``fileio.check_distinct``, written again here because the module imports nothing of
    ``medvolcore``. Keys instead of pairs, so that checking n rows is linear in n; each folder is
    resolved once and each path once (many rows share a CT and an output folder)."""

    def __init__(self):
        self._cwd = os.getcwd()
        self._folders: Dict[str, str] = {}
        self._paths: Dict[str, List[object]] = {}

    def __call__(self, path) -> List[object]:
        text = str(path)
        keys = self._paths.get(text)
        if keys is not None:
            return keys
        p = os.path.join(self._cwd, os.path.expanduser(text))  # not normalised: '..' after links
        folder, name = os.path.split(p)
        if name in ("", ".", ".."):
            full = os.path.realpath(p)
        else:
            real = self._folders.get(folder)
            if real is None:
                real = self._folders[folder] = os.path.realpath(folder)
            full = os.path.join(real, name)
            if os.path.islink(full):
                full = os.path.realpath(full)
        keys = [os.path.normcase(full)]
        try:
            st = os.stat(p)  # the file the system opens for this path
        except OSError:
            st = None
        if st is not None and st.st_ino:  # 0 where the file system has no inode numbers
            keys.append((st.st_dev, st.st_ino))
        self._paths[text] = keys
        return keys


def check_distinct(jobs: Sequence[BatchJob], anchor_dir=None, reads: Iterable[Tuple[str, object]] = ()) -> None:
    """Refuse, before anything runs and whatever ``--overwrite`` says, a file the batch would
    write (each row's output and, with ``anchor_dir``, its anchor) that is a file it reads (any
    row's input, and ``reads``: ``(label, path)`` pairs such as the manifest) or that another row
    also writes. The message names both rows. Time linear in the number of rows."""
    _check_distinct(jobs, [anchor_path(anchor_dir, j) for j in jobs] if anchor_dir else None, reads)


def _check_distinct(jobs, anchors, reads) -> None:
    keys_of = _FileKeys()
    read: Dict[object, Tuple[str, object]] = {}
    for label, p in [(_row_label(j, "input"), j.input) for j in jobs] + [(lb, p) for lb, p in reads if p]:
        for key in keys_of(p):
            read.setdefault(key, (label, p))
    written: Dict[object, Tuple[str, object]] = {}
    for i, j in enumerate(jobs):
        targets = [(_row_label(j, "output"), j.output)]
        if anchors:
            targets.append((_row_label(j, "anchor"), anchors[i]))
        for label, p in targets:
            keys = keys_of(p)
            for key in keys:
                if key in read:
                    other, q = read[key]
                    raise BatchError(f"{label} {p} is {other} ({q}); write it elsewhere (nothing was run)")
                if key in written:
                    other, q = written[key]
                    raise BatchError(f"{other} and {label} are the same file ({q}); "
                                     "give each its own path (nothing was run)")
            for key in keys:
                written[key] = (label, p)


def check_outputs(jobs: Sequence[BatchJob], overwrite: bool, anchor_dir=None,
                  reads: Iterable[Tuple[str, object]] = ()) -> None:
    """Before any case runs: the files the batch writes are distinct from each other and from
    what it reads (:func:`check_distinct`, even with ``overwrite``), the anchor folder is a
    folder, and, without ``overwrite``, none of the outputs or anchors exists yet."""
    anchors = [anchor_path(anchor_dir, j) for j in jobs] if anchor_dir else []
    _check_distinct(jobs, anchors, reads)
    if anchor_dir and os.path.lexists(anchor_dir) and not os.path.isdir(anchor_dir):
        raise BatchError(f"--anchor-dir {anchor_dir} is not a folder")
    if overwrite:
        return
    existing = [p for p in [j.output for j in jobs] + anchors if os.path.lexists(p)]
    if existing:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise BatchError(f"{existing[0]} exists{more}; pass --overwrite to replace")


_NOT_REGULAR = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")


def read_regular_file(path, what: str, max_bytes: int) -> str:
    """The UTF-8 text of ``path`` (a byte-order mark dropped), which must be a regular file of at
    most ``max_bytes``: a named pipe, a device or a folder is refused after a ``stat`` and never
    opened for a blocking read (the file is opened non-blocking and checked again, in case it was
    swapped in between). Every problem is a :class:`BatchError` naming ``what``."""
    p = os.path.expanduser(str(path))
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise BatchError(f"{what} {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise BatchError(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise BatchError(f"{what} {path} is {_kind(st.st_mode)}, not a regular file")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise BatchError(f"{what} {path} is {_kind(mode)}, not a regular file")
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise BatchError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        size = f"{max_bytes >> 20} MiB" if max_bytes >= 1 << 20 else f"{max_bytes >> 10} KiB"
        raise BatchError(f"{what} {path} is larger than {size}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise BatchError(f"{what} {path} is not UTF-8 text") from None


def read_token_file(path) -> str:
    """The bearer token in ``path`` (surrounding white space dropped); see :func:`read_regular_file`."""
    token = read_regular_file(path, "token file", MAX_TOKEN_BYTES).strip()
    if not token:
        raise BatchError(f"token file {path} is empty")
    return token


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
        if os.path.exists(p):
            raise BatchError(f"input {p} is {_kind(os.stat(p).st_mode)}, not a volume file or a DICOM folder")
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


def anchor_path(anchor_dir, job: BatchJob) -> Path:
    """Where ``--anchor-dir`` puts ``job``'s anchor: ``<output name>.row<N>.anchor.json`` for
    manifest row N (``.row<N>`` once, when the output's name already ends so, as default outputs
    do), ``<output name>.anchor.json`` for the ``--input`` form. The row number makes each row's
    name its own, whatever the outputs are called."""
    name = job.output.name
    for suf in OUTPUT_SUFFIXES:
        if name.lower().endswith(suf):
            name = name[: -len(suf)]
            break
    if job.row and not name.endswith(f".row{job.row}"):
        name += f".row{job.row}"
    return Path(anchor_dir) / (re.sub(r"[^\w.-]+", "_", name) + ".anchor.json")


def summary(results: Sequence[tuple], absent: Sequence = ()) -> Tuple[str, int]:
    """``results``: ``(job, error or None)``; ``absent``: the jobs among them the model answered
    "not present" (finished, no output). Returns the summary text and the exit code (0 none
    failed, 1 some failed)."""
    failed = [(j, e) for j, e in results if e is not None]
    done = len(results) - len(failed) - len(absent)
    lines = [f"medvol batch (Slicer): {done} of {len(results)} done"
             + (f", {len(absent)} not found in their CT (no output written)" if absent else "")]
    for j, e in failed:
        where = f" (row {j.row})" if j.row else ""
        lines.append(f"  failed{where}: {j.input.name}: {e}")
    return "\n".join(lines), (1 if failed else 0)

