#!/usr/bin/env python3
"""Peak memory per voxel of the worker's request path, stage by stage, and what the defaults allow.

    PYTHONPATH=MedVolCore .venv/bin/python Testing/benchmarks/memory.py [--slices 600] [--request-slices 24]
        [--json-out FILE]

A 512×512×``--slices`` int16 CT of zeros (the worst case for compression: its ``.nii.gz`` is
about 0.3 MB for 157 M voxels at 600 slices) is written as ``.nii`` and ``.nii.gz``; each stage
runs in a fresh child process, which resets its peak RSS (``/proc/self/clear_refs``) once its
imports and inputs are ready, runs the stage and reports ``(VmHWM − VmRSS before) / voxels``:

- ``upload``: an HTTP body (the ``.nii.gz``) read from a socket-like stream, its header checked
  and the body stored to a private file (:mod:`medvolcore.serve.upload`), as the transport does;
- ``decompress+read``: :func:`medvolcore.volume.load_volume` of the ``.nii.gz`` (decompression,
  slab reads, float32 HU, the non-finite check);
- ``read``: the same for the ``.nii``;
- ``window+stack``: :class:`medvolcore.stack.AxialStack` over the volume read, every slice windowed
  to uint8 and made a MedSAM2 frame (512 px), as propagation does one slice at a time;
- ``request``: a whole ``propagate`` request to an HTTP-transport worker on the ``tiny`` preset
  (upload file → read → stack → propagate → mask written and returned as ``mask_b64``), on a
  512×512×``--request-slices`` CT (the tiny MedSAM2 encodes every slice, so a full-size run is
  slow on a CPU); its volume stays in memory for the request, the figure per voxel holds.

Printed: bytes/voxel per stage, the request path's peak (the largest stage), and the worst case
the defaults allow: that peak × the default ``--max-voxels``, beside the 8 GB goal.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGES = ("upload", "decompress+read", "read", "window+stack", "request")
GOAL_BYTES_PER_VOXEL = 12.0
GOAL_WORST_CASE = 8 << 30


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; return that RSS in bytes."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status("VmRSS")


def _write(folder: Path, slices: int) -> dict:
    import nibabel as nib
    import numpy as np

    img = nib.Nifti1Image(np.zeros((512, 512, slices), np.int16), np.diag([0.8, 0.8, 2.0, 1.0]))
    out = {}
    for suffix in (".nii", ".nii.gz"):
        out[suffix] = folder / f"zeros{slices}{suffix}"
        if not out[suffix].exists():
            nib.save(img, str(out[suffix]))
    return out


def _stage(name: str, path: Path) -> dict:
    """Run one stage in this process; ``{"voxels", "peak_bytes"}``."""
    import numpy as np  # noqa: F401 - imported before the baseline, as in the worker

    from medvolcore.volume import load_volume

    voxels = 512 * 512
    if name == "upload":
        import io

        from medvolcore.serve.upload import HEADER_PREFIX_MAX, read_header, store_body

        data = path.read_bytes()
        stream = io.BytesIO(data)
        folder = Path(tempfile.mkdtemp(prefix="medvol-mem-"))
        base = _reset_peak()
        prefix = stream.read(min(len(data), HEADER_PREFIX_MAX))
        info = read_header(prefix, len(prefix) == len(data), None)
        up = store_body(prefix, stream.read, len(data), info, folder)
        peak = _status("VmHWM") - base
        voxels = int(np.prod(info.shape))
        up.remove()
        return {"voxels": voxels, "peak_bytes": peak}
    if name in ("decompress+read", "read"):
        base = _reset_peak()
        vol = load_volume(path)
        peak = _status("VmHWM") - base
        return {"voxels": int(vol.array.size), "peak_bytes": peak, "kept_bytes": int(vol.array.nbytes)}
    if name == "window+stack":
        from medvolcore.propagation.frames import medsam2_frame
        from medvolcore.stack import AxialStack

        vol = load_volume(path)
        base = _reset_peak()
        stack = AxialStack(vol)
        for z in range(stack.depth):
            stack.windowed(z)
            medsam2_frame(stack.data[z])
        return {"voxels": int(vol.array.size), "peak_bytes": _status("VmHWM") - base}
    if name == "request":
        import queue

        from medvolcore.pipeline import Pipeline
        from medvolcore.serve import Worker
        from medvolcore.serve.upload import HEADER_PREFIX_MAX, read_header, store_body

        w = Worker(transport="http", device="cpu", feature_cache_mb=float(os.environ.get("MEDVOL_MEM_FEATURE_MB", 0)))
        w.pipeline = Pipeline("tiny", device="cpu").load()
        data = path.read_bytes()
        prefix = data[:HEADER_PREFIX_MAX]
        info = read_header(prefix, len(prefix) == len(data), None)
        up = store_body(prefix, __import__("io").BytesIO(data[len(prefix):]).read, len(data), info, w.tmp_dir)
        anchor = {"schema": "medvol.anchor/1", "slice": int(info.shape[2]) // 2, "boxes": [[100, 100, 300, 300]],
                  "source": "user"}
        replies = queue.Queue()
        base = _reset_peak()
        w.handle({"id": "m", "op": "propagate", "anchor": anchor, "stop_after_empty": 0}, reply=replies.put,
                 body=up)
        r = replies.get(timeout=3600)
        while "event" in r:
            r = replies.get(timeout=3600)
        peak = _status("VmHWM") - base
        w.close(10)
        if not r.get("ok"):
            raise SystemExit(f"request failed: {r}")
        return {"voxels": int(np.prod(info.shape)), "peak_bytes": peak}
    raise SystemExit(f"unknown stage {name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slices", type=int, default=600, help="slices of the 512×512 CT for the stages (default 600)")
    ap.add_argument("--request-slices", type=int, default=120,
                    help="slices of the CT for the whole request on the tiny preset (default 120)")
    ap.add_argument("--tree", help="the MedVolCore folder to measure (default: this checkout's), e.g. an older "
                    "checkout's, to compare")
    ap.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    ap.add_argument("--folder", help="where the test CTs are written (default: a temporary folder)")
    ap.add_argument("--json-out", metavar="FILE")
    ap.add_argument("--child", nargs=2, metavar=("STAGE", "FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_stage(args.child[0], Path(args.child[1]))))
        return 0
    tree = Path(args.tree).resolve() if args.tree else REPO / "MedVolCore"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    default_max = int(subprocess.run([sys.executable, "-c", "from medvolcore.serve.cache import DEFAULT_MAX_VOXELS as "
                                      "v; print(v)"], env=env, capture_output=True, text=True, check=True).stdout)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="medvol-mem-"))
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {stage: (args.request_slices if stage == "request" else args.slices) for stage in STAGES}
    rows = []
    print(f"MedVolCore: {tree}")
    print(f"{'stage':16} {'voxels':>13} {'peak MB':>9} {'bytes/voxel':>12} {'marginal':>9} {'fixed MB':>9}")
    for stage in args.stages:
        got = []
        for slices in (sizes[stage] // 2, sizes[stage]):  # two sizes: the cost per voxel, apart from fixed costs
            files = _write(folder, slices)
            path = files[".nii" if stage == "read" else ".nii.gz"]
            out = subprocess.run([sys.executable, __file__, "--child", stage, str(path)], env=env,
                                 capture_output=True, text=True, timeout=7200)
            if out.returncode != 0:
                print(f"{stage:16} failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
                break
            got.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if len(got) < 2:
            rows.append({"stage": stage, "error": "failed"})
            continue
        small, r = got
        marginal = (r["peak_bytes"] - small["peak_bytes"]) / (r["voxels"] - small["voxels"])
        fixed = max(0.0, r["peak_bytes"] - marginal * r["voxels"])
        r.update(stage=stage, bytes_per_voxel=round(r["peak_bytes"] / r["voxels"], 2),
                 marginal_bytes_per_voxel=round(marginal, 2), fixed_bytes=int(fixed))
        rows.append(r)
        print(f"{stage:16} {r['voxels']:13,} {r['peak_bytes'] / 2**20:9.1f} {r['bytes_per_voxel']:12.2f} "
              f"{marginal:9.2f} {fixed / 2**20:9.1f}")
    measured = [r["marginal_bytes_per_voxel"] for r in rows if "marginal_bytes_per_voxel" in r]
    worst = max(measured) if measured else float("nan")
    fixed = max((r["fixed_bytes"] for r in rows if "fixed_bytes" in r), default=0)
    allowed = worst * default_max + fixed
    print(f"\nrequest path peak: {worst:.2f} bytes/voxel (the largest stage's cost per voxel; goal ≤ "
          f"{GOAL_BYTES_PER_VOXEL:g}), plus {fixed / 2**20:.0f} MB fixed")
    print(f"default --max-voxels {default_max:,}: worst case {allowed / 2**30:.2f} GiB "
          f"(goal ≤ {GOAL_WORST_CASE / 2**30:g} GiB; the models' own memory apart)")
    summary = {"date": datetime.date.today().isoformat(), "machine": platform.platform(), "cpus": os.cpu_count(),
               "tree": str(tree), "rows": rows, "peak_bytes_per_voxel": worst, "default_max_voxels": default_max,
               "worst_case_bytes": allowed}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    ok = worst <= GOAL_BYTES_PER_VOXEL and allowed <= GOAL_WORST_CASE
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
