#!/usr/bin/env python3
"""How long the Slicer module's hand-over of a CT to the local worker takes: the volume node
written by Slicer's ``vtkMRMLVolumeArchetypeStorageNode`` (slicer-core) as the module does
now (uncompressed ``.nii``) and as it did before (``.nii.gz``: ``useCompression: 0`` had no
effect on that name), then read by ``medvolcore.volume.load_volume`` as the worker does.

The CT is the real ``example_ct.nii.gz`` (122×101×112) enlarged by repeating voxels to the size of
a clinical abdominal CT (``--zoom 4 4 3``: 488×404×336, int16, 126 MiB). Repeated voxels compress
better than real noise, so the ``.nii.gz`` figures are a lower bound.

    .venv/bin/python Testing/benchmarks/slicer_export.py [--volume CT] [--zoom 4 4 3] [--repeat 3] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CT = REPO / "Testing" / "data" / "totalsegmentator" / "example_ct.nii.gz"


def volume_node(volume: Path, zoom):
    import slicer
    import vtk
    from vtk.util import numpy_support

    img = nib.load(str(volume))
    arr = np.asarray(img.dataobj).astype(np.int16)
    for axis, z in enumerate(zoom):
        arr = np.repeat(arr, int(z), axis=axis)
    affine = img.affine.copy()
    affine[:3, :3] = affine[:3, :3] / np.asarray(zoom, dtype=float)
    image = vtk.vtkImageData()
    image.SetDimensions(*arr.shape)
    image.GetPointData().SetScalars(numpy_support.numpy_to_vtk(np.ascontiguousarray(arr.transpose(2, 1, 0)).ravel(),
                                                               deep=True, array_type=vtk.VTK_SHORT))
    node = slicer.vtkMRMLScalarVolumeNode()
    node.SetAndObserveImageData(image)
    node.SetIJKToRASMatrix(slicer.util.vtkMatrixFromArray(affine))
    node.SetName("CT")
    return node, arr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--volume", default=str(DEFAULT_CT))
    ap.add_argument("--zoom", type=int, nargs=3, default=[4, 4, 3])
    ap.add_argument("--repeat", type=int, default=3, help="runs per format; the fastest is reported")
    ap.add_argument("--json-out", default="")
    args = ap.parse_args(argv)
    try:
        import slicer  # noqa: F401

        slicer.vtkMRMLVolumeArchetypeStorageNode
    except (ImportError, AttributeError):
        print("slicer-core is not installed (python3 MedVolCore/bootstrap.py installs it)", file=sys.stderr)
        return 2
    import slicer
    from medvolcore.volume import load_volume

    node, arr = volume_node(Path(args.volume), args.zoom)
    mib = arr.nbytes / 2 ** 20
    print(f"volume {arr.shape} int16 ({mib:.0f} MiB), {args.repeat} runs per format, fastest shown")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, compress in (("nii", False), ("nii.gz", True)):
            best_w = best_r = float("inf")
            size = 0
            for i in range(args.repeat):
                path = os.path.join(tmp, f"ct{i}.{name}")
                storage = slicer.vtkMRMLVolumeArchetypeStorageNode()
                storage.SetFileName(path)
                storage.SetUseCompression(1 if compress else 0)
                t = time.perf_counter()
                assert storage.WriteData(node), path
                best_w = min(best_w, time.perf_counter() - t)
                size = os.path.getsize(path)
                t = time.perf_counter()
                ct = load_volume(path)
                best_r = min(best_r, time.perf_counter() - t)
                assert ct.shape == arr.shape
                os.remove(path)
            rows.append({"format": name, "write_s": best_w, "read_s": best_r, "total_s": best_w + best_r,
                         "file_mib": size / 2 ** 20})
    print(f"{'format':8} {'write s':>8} {'read s':>8} {'total s':>8} {'file MiB':>9}")
    for r in rows:
        print(f"{r['format']:8} {r['write_s']:8.2f} {r['read_s']:8.2f} {r['total_s']:8.2f} {r['file_mib']:9.1f}")
    print(f".nii.gz / .nii total: {rows[1]['total_s'] / rows[0]['total_s']:.1f}x")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"shape": list(arr.shape), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
