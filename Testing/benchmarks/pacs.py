#!/usr/bin/env python3
"""Benchmark of the DICOMweb round trip against a real Orthanc on loopback.

Writes the CT (default: the 30-slice sample CT) as a DICOM series, starts Orthanc with its
DICOMweb plugin on a free loopback port (Testing/reference/orthanc.py), uploads the series, then
measures: retrieval alone (WADO-RS, ``medvolcore.pacs.retrieve_series``, into a fresh folder each
time; MB/s of DICOM files written), and the whole ``medvol segment --volume dicomweb://…
--out dicomweb://…`` as a user runs it (a new process: start-up and model loading included), with
the retrieval and store times it reports.

    .venv/bin/python Testing/benchmarks/pacs.py [--volume CT] [--matrix 512] [--preset tiny] [--repeats 3] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "Testing"), str(REPO / "MedVolCore")]
DEFAULT_CT = REPO / "Testing" / "data" / "totalsegmentator" / "example_ct_sm.nii.gz"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--volume", default=str(DEFAULT_CT))
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--matrix", type=int, help="resample each slice to N×N first (512: a clinical CT's slice size)")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    import SimpleITK as sitk  # noqa: N813

    from conftest import _write_dicom_series
    from reference.orthanc import Orthanc, why_not_available
    from medvolcore import pacs

    why = why_not_available()
    if why:
        raise SystemExit(why)
    uid = "1.2.826.0.1.3680043.2.1125.5511"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        img = sitk.Cast(sitk.ReadImage(args.volume), sitk.sitkInt16)
        if args.matrix:
            size = [args.matrix, args.matrix, img.GetSize()[2]]
            spacing = [img.GetSpacing()[i] * img.GetSize()[i] / size[i] for i in (0, 1)] + [img.GetSpacing()[2]]
            img = sitk.Resample(img, size, sitk.Transform(), sitk.sitkLinear, img.GetOrigin(), spacing,
                                img.GetDirection(), -1024, sitk.sitkInt16)
        _write_dicom_series(sitk, img, tmp / "series", uid=uid)
        server = Orthanc(tmp / "orthanc")
        try:
            n = server.upload(tmp / "series")
            url = f"{server.dicomweb}/studies/{uid}.1/series/{uid}.2"
            retrievals = []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                got = pacs.retrieve_series(pacs.parse_url(url), tmp / f"r{r}")
                wall = time.perf_counter() - t0
                retrievals.append({"seconds": round(wall, 3), "mb": round(got["bytes"] / 2**20, 2),
                                   "mb_per_s": round(got["bytes"] / 2**20 / wall, 1)})
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "medvolcore.cli", "segment", "--volume", url, "--query", "the liver",
                                "--out", f"{server.dicomweb}/studies/{uid}.1", "--out", str(tmp / "m.nii.gz"),
                                "--preset", args.preset, "--device", "cpu", "--no-progress", "--json"],
                               capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode:
                raise SystemExit(p.stderr)
            res = json.loads(p.stdout)
        finally:
            server.stop()
    out = {"instances": n, "shape": list(img.GetSize()), "retrieval": retrievals,
           "round_trip": {"wall_s": round(wall, 2), "retrieve_s": res["retrieved"]["seconds"],
                          "job_s": res["timings"].get("job_s"), "store_s": res["stored"]["seconds"],
                          "model_load_s": res.get("model_load_s")}}
    print(json.dumps(out, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
