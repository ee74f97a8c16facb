"""Headless MedVol-R1 in Slicer: segment one CT or a manifest of CTs without a window.

    Slicer --no-main-window --python-script MedVolR1Slicer/batch.py \\
        --input CT.nii.gz --query "the organ that secretes bile" --output liver.seg.nrrd [--preset tiny]
    Slicer --no-main-window --python-script MedVolR1Slicer/batch.py --manifest jobs.csv --output-dir out/

Exits 0 when every case was segmented, 1 when one failed, 2 on bad arguments. Arguments,
manifests and the summary live in ``MedVolR1SlicerLib.batchjobs`` (tested there); this script
only loads volumes, runs the module's logic and saves nodes.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import slicer  # noqa: E402

from MedVolR1SlicerLib import batchjobs, params  # noqa: E402
from MedVolR1SlicerLib.client import WorkerError  # noqa: E402
from MedVolR1SlicerLib.geometry import GeometryError  # noqa: E402


def _save(node, path):
    """Write a node to ``path`` through a temporary name in the same folder (never half-written)."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    name = os.path.basename(path)
    tmp = os.path.join(folder, f".{name}.part-{os.getpid()}" + name[name.index("."):])
    if not slicer.util.exportNode(node, tmp):
        raise OSError(f"could not write {path}")
    os.replace(tmp, path)


def run_job(logic, job, options, anchor_dir):
    volume = slicer.util.loadVolume(str(job.input), {"show": False})
    try:
        seg, segment_id, rois, anchor = logic.segmentBlocking(volume, job.query, options)
        if job.as_labelmap:
            label = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLLabelMapVolumeNode")
            slicer.modules.segmentations.logic().ExportSegmentsToLabelmapNode(seg, [segment_id], label, volume)
            _save(label, str(job.output))
            slicer.mrmlScene.RemoveNode(label)
        else:
            _save(seg, str(job.output))
        if anchor_dir:
            path = batchjobs.anchor_path(anchor_dir, job)
            os.makedirs(anchor_dir, exist_ok=True)
            with open(str(path) + ".part", "w", encoding="utf-8") as f:
                json.dump(anchor, f, indent=2)
            os.replace(str(path) + ".part", path)
        for node in [seg] + list(rois):
            slicer.mrmlScene.RemoveNode(node)
    finally:
        slicer.mrmlScene.RemoveNode(volume)


def main(argv):
    try:
        args = batchjobs.parse_args(argv)
        jobs = batchjobs.jobs_from_args(args)
        batchjobs.check_outputs(jobs, args.overwrite)
        token = open(args.token_file, encoding="utf-8").read().strip() if args.token_file else ""
        options = params.options_from_panel(args.preset, args.adapter, args.device, args.window,
                                            "remote" if args.worker_url else "local", args.worker_url, token)
    except SystemExit as e:  # argparse already printed its message
        return int(e.code or 0)
    except (batchjobs.BatchError, ValueError, OSError) as e:
        print(f"medvol batch (Slicer): error: {e}", file=sys.stderr)
        return 2

    import MedVolR1Slicer

    logic = MedVolR1Slicer.MedVolR1SlicerLogic()
    results = []
    try:
        for i, job in enumerate(jobs, 1):
            print(f"[{i}/{len(jobs)}] {job.input.name}: {job.query}", flush=True)
            try:
                run_job(logic, job, options, args.anchor_dir)
                results.append((job, None))
            except (WorkerError, GeometryError, OSError, ValueError, RuntimeError) as e:
                results.append((job, str(e)))
                print(f"  failed: {e}", file=sys.stderr, flush=True)
                if not args.keep_going:
                    break
    finally:
        logic.shutdown()
    text, code = batchjobs.summary(results)
    if len(results) < len(jobs):
        text += f"\n  not run: {len(jobs) - len(results)} (stopped at the first failure; --keep-going goes on)"
        code = 1
    print(text, flush=True)
    return code


if __name__ == "__main__":
    slicer.util.exit(main(sys.argv[1:]))
