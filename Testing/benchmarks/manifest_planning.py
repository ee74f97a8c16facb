#!/usr/bin/env python3
"""Benchmark: planning a 10,000-row batch manifest, before the first case starts.

Builds, in a temporary folder, ROWS cases whose CTs and label maps are tiny NIfTI files (planning
reads every distinct file's header, never its voxels): by default every row has its own CT and label map, 100 files per
folder (``--shared`` makes every row name the same two files). Then times what each batch front
door does before its first case would start:

- ``medvol batch``, new output folder: :func:`medvolcore.batch.run_batch` with a stand-in
  pipeline that stops it where the models would load (manifest read and checked, inputs checked
  against the case folders, cases planned);
- ``medvol batch --resume``, every case already finished: :func:`medvolcore.batch.plan_batch`
  (each case's ``done.json`` read and its volume and label map fingerprinted);
- the Slicer batch script: ``MedVolR1SlicerLib.batchjobs.read_manifest`` (imported by path; its
  manifest is ``input,query``, outputs from ``--output-dir``), then ``check_inputs`` and
  ``check_outputs`` where they exist, in a child process stopped after ``--timeout`` seconds.

    .venv/bin/python Testing/benchmarks/manifest_planning.py [--rows 10000] [--shared] [--timeout 120]
           [--json-out F]

Goal: each under 10 s for 10,000 rows on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUERY = "the organ that secretes bile"
GOAL_S = 10.0


def _tiny_nifti() -> bytes:
    """A 6×5×4 NIfTI's bytes: planning reads its header (and checks the label map's grid against the CT's)."""
    import gzip

    import nibabel as nib
    import numpy as np

    img = nib.Nifti1Image(np.zeros((6, 5, 4), dtype=np.uint8), np.eye(4))
    return gzip.compress(img.header.binaryblock + b"\0" * 4 + np.asarray(img.dataobj).tobytes(order="F"))


def _inputs(work: Path, rows: int, shared: bool):
    """(volume, label map) paths per row; tiny NIfTI files whose headers only are read."""
    data = _tiny_nifti()
    if shared:
        ct, seg = work / "data" / "ct.nii.gz", work / "data" / "seg.nii.gz"
        ct.parent.mkdir(parents=True)
        ct.write_bytes(data)
        seg.write_bytes(data)
        return [(ct, seg)] * rows
    pairs = []
    for i in range(rows):
        folder = work / "data" / f"batch{i // 100:03d}"
        if i % 100 == 0:
            folder.mkdir(parents=True)
        ct, seg = folder / f"ct{i:05d}.nii.gz", folder / f"seg{i:05d}.nii.gz"
        ct.write_bytes(data)
        seg.write_bytes(data)
        pairs.append((ct, seg))
    return pairs


class _StopAtLoad:
    """A pipeline stand-in: run_batch plans with it and stops where the models would load."""

    preset, smoke = "tiny", True

    def load(self):
        raise _Loading()


class _Loading(Exception):
    pass


def _medvol_rows(work: Path, pairs) -> list:
    from medvolcore.batch import OUTPUTS, BatchOptions, plan_batch, read_manifest, run_batch

    manifest = work / "cases.csv"
    with open(manifest, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "volume", "query", "gt", "label"])
        for i, (ct, seg) in enumerate(pairs):
            w.writerow([f"case{i:05d}", ct.relative_to(work), QUERY, seg.relative_to(work), 5])
    out = work / "out"
    t = time.perf_counter()
    try:
        run_batch(manifest, out, BatchOptions(progress=False), pipeline=_StopAtLoad())
        raise SystemExit("run_batch did not reach the models: nothing to plan?")
    except _Loading:
        pass
    first = time.perf_counter() - t

    # every case finished, as a run leaves it; then plan --resume
    for case in read_manifest(manifest):
        cdir = out / case.id
        cdir.mkdir(parents=True, exist_ok=True)
        for name in OUTPUTS:
            (cdir / name).write_bytes(b"x")
        (cdir / "done.json").write_text(json.dumps({"id": case.id, "status": "done", "seconds": 1.0,
                                                    "case": case.fingerprint("tiny", None),
                                                    "anchor": {"slice": 1, "n_boxes": 1}}))
    t = time.perf_counter()
    plan = plan_batch(manifest, out, BatchOptions(resume=True, progress=False), "tiny")
    resume = time.perf_counter() - t
    if plan.to_run:
        raise SystemExit(f"--resume would rerun {len(plan.to_run)} finished case(s)")
    return [("medvol batch: plan, new --out-dir (run_batch up to the models)", first, "ok"),
            ("medvol batch --resume: plan, every case finished", resume, "ok")]


def _slicer_child(manifest: str, out_dir: str) -> None:
    """In a child process: the Slicer script's steps before its first case; prints JSON seconds."""
    sys.path.insert(0, str(REPO / "MedVolR1Slicer"))
    from MedVolR1SlicerLib import batchjobs

    read = batchjobs.read_manifest
    kw = {"output_dir": Path(out_dir)} if "output_dir" in inspect.signature(read).parameters else {}
    t = time.perf_counter()
    jobs = read(Path(manifest), **kw)
    read_s = time.perf_counter() - t
    for name, args in (("check_inputs", (jobs,)), ("check_outputs", (jobs, False))):
        fn = getattr(batchjobs, name, None)
        if fn is not None:
            fn(*args)
    print(json.dumps({"read_s": read_s, "all_s": time.perf_counter() - t, "jobs": len(jobs)}))


def _slicer_rows(work: Path, pairs, timeout: float) -> list:
    manifest = work / "slicer.csv"
    with open(manifest, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["input", "query"])
        for ct, _seg in pairs:
            w.writerow([ct.relative_to(work), QUERY])
    name = "Slicer batch: read_manifest"
    t = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, __file__, "--slicer-child", str(manifest), str(work / "slicer-out")],
                           capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        s = time.perf_counter() - t
        return [(name + " (+ check_inputs, check_outputs)", s, f"stopped after {timeout:.0f} s")]
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return [(name, float("nan"), f"failed: {last[:120]}")]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return [(name, got["read_s"], "ok"), (name + " + check_inputs + check_outputs", got["all_s"], "ok")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--shared", action="store_true", help="every row names the same CT and label map")
    ap.add_argument("--timeout", type=float, default=120.0, help="stop the Slicer reader after this many seconds")
    ap.add_argument("--json-out")
    ap.add_argument("--slicer-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.slicer_child:
        _slicer_child(*args.slicer_child)
        return 0

    with tempfile.TemporaryDirectory(prefix="medvol-plan-bench-") as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        pairs = _inputs(work, args.rows, args.shared)
        setup = time.perf_counter() - t
        rows = _medvol_rows(work, pairs) + _slicer_rows(work, pairs, args.timeout)
    layout = "one CT and label map for every row" if args.shared else "a CT and a label map per row, 100 per folder"
    print(f"{args.rows} rows ({layout}; files made in {setup:.1f} s); goal: under {GOAL_S:.0f} s each\n")
    print(f"| {'planning':<66} | {'seconds':>8} | outcome |")
    print(f"|{'-' * 68}|{'-' * 10}|---------|")
    for name, seconds, outcome in rows:
        mark = "" if outcome != "ok" else (" (goal met)" if seconds < GOAL_S else " (over the goal)")
        print(f"| {name:<66} | {seconds:8.2f} | {outcome}{mark} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": args.rows, "shared": args.shared, "results": [
            {"what": n, "seconds": round(s, 3), "outcome": o} for n, s, o in rows]}, indent=2) + "\n")
    return 0 if all(o == "ok" and s < GOAL_S for _n, s, o in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
