#!/usr/bin/env python3
"""Benchmark of ``medvol batch``: throughput in cases per minute.

Builds a manifest of N copies of one case (the same CT under N ids; default the 30-slice
real CT ``example_ct_sm.nii.gz`` with its liver label as ground truth), runs it with one
loaded pipeline exactly as ``medvol batch`` does (all outputs, metrics, summaries), and prints
cases/minute for the whole run (model loading included) and for the cases alone.

    .venv/bin/python Testing/benchmarks/batch.py [--copies 6] [--preset tiny] [--device cpu]
           [--volume CT --gt LABELS --label 5] [--query Q] [--out-dir DIR] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REAL = Path(os.environ.get("MEDVOL_REAL_DATA", REPO / "Testing" / "data")) / "totalsegmentator"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=6, help="number of cases (copies of the one case)")
    ap.add_argument("--volume", default=str(REAL / "example_ct_sm.nii.gz"))
    ap.add_argument("--gt", default=str(REAL / "example_seg.nii.gz"), help="label map ('' for none)")
    ap.add_argument("--label", default="5", help="ground-truth label id(s) (default 5, liver)")
    ap.add_argument("--query", default="the organ that secretes bile")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out-dir", help="keep the outputs here (default: a temporary folder, removed)")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)

    from medvolcore.batch import BatchOptions, run_batch

    with tempfile.TemporaryDirectory(prefix="medvol-batch-bench-") as tmp:
        work = Path(tmp)
        manifest = work / "cases.jsonl"
        with open(manifest, "w") as f:
            for i in range(args.copies):
                rec = {"id": f"case{i:03d}", "volume": str(Path(args.volume).resolve()), "query": args.query}
                if args.gt:
                    rec.update(gt=str(Path(args.gt).resolve()), label=args.label)
                f.write(json.dumps(rec) + "\n")
        out = Path(args.out_dir) if args.out_dir else work / "out"
        opts = BatchOptions(preset=args.preset, device=args.device, overwrite=True, progress=True)
        t = time.perf_counter()
        res = run_batch(manifest, out, opts)
        wall = time.perf_counter() - t
        info = res.info
        per_case = [r["seconds"] for r in res.rows if r["status"] == "done"]
        summary = {
            "preset": info["preset"], "smoke": info["smoke"], "device": args.device, "volume": Path(args.volume).name,
            "cases": info["cases"], "done": info["done"], "failed": info["failed"],
            "wall_s": round(wall, 2), "model_load_s": info["model_load_s"], "cases_s": info["cases_seconds"],
            "cases_per_minute": round(60.0 * info["ran"] / wall, 2),
            "cases_per_minute_excluding_load": round(60.0 * info["ran"] / max(info["cases_seconds"], 1e-9), 2),
            "case_seconds_median": round(statistics.median(per_case), 2) if per_case else None,
            "case_seconds_min_max": [round(min(per_case), 2), round(max(per_case), 2)] if per_case else None,
            "loadavg_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        }
    print(f"medvol batch, preset {summary['preset']}{' (smoke)' if summary['smoke'] else ''}, device {args.device}, "
          f"{summary['cases']} × {summary['volume']}: {summary['done']} done, {summary['failed']} failed")
    print(f"wall {summary['wall_s']:.1f} s (model load {summary['model_load_s']:.1f} s); "
          f"per case median {summary['case_seconds_median']} s, min/max {summary['case_seconds_min_max']}")
    print(f"throughput: {summary['cases_per_minute']:.1f} cases/minute "
          f"({summary['cases_per_minute_excluding_load']:.1f} excluding model load)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json_out}")
    return 0 if summary["failed"] == 0 else 3


if __name__ == "__main__":
    sys.exit(main())
