#!/usr/bin/env python3
"""Benchmark: MedVol's MedSAM2 propagation vs the MedSAM2-script-style reference loop.

    .venv/bin/python Testing/benchmarks/propagation.py [--image-size 512] [--seed 0] [--boxes 1 2 4]
        [--volume CT.nii.gz --labels LABELS.nii.gz] [--checkpoint MedSAM2_latest.pt]
        [--whole-process] [--json-out FILE]

Every measured run happens in its own child process (this script re-invoked with
``--child``), so each gets a fresh interpreter and its peak memory is that process's own
(``ru_maxrss`` from ``os.wait4``). Model building and loading are outside the timed region;
both sides get the same warm-up (one encoder pass on a blank frame). Same weights (seeded
random weights unless ``--checkpoint``), same frames, same key slice and boxes.

Boxes come from the label map: the key slice is the slice where the organs of the largest
box set (liver, spleen, stomach, kidney_left) are all present with ≥ 10 pixels, with the
largest total area; each box is the organ's bounding box on that slice. 1 box: liver;
2: liver + spleen; 4: liver, spleen, stomach, kidney_left.

``--whole-process`` times ``medvol propagate …`` against ``Testing/reference/medsam2.py`` as whole
processes (imports, model build, I/O included); it is skipped when ``medvol`` is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # Testing/: the reference package
from reference.medsam2 import load_canonical  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
REFERENCE = REPO / "Testing" / "reference" / "medsam2.py"  # also a script: the whole-process counterpart
DEFAULT_CT = REPO / "Testing" / "data" / "totalsegmentator" / "example_ct_sm.nii.gz"
DEFAULT_LABELS = REPO / "Testing" / "data" / "totalsegmentator" / "example_seg.nii.gz"
ORGANS = {"liver": 5, "spleen": 1, "kidney_right": 2, "kidney_left": 3, "stomach": 6}
BOX_SETS = {1: ["liver"], 2: ["liver", "spleen"], 4: ["liver", "spleen", "stomach", "kidney_left"]}
FALLBACK_ORDER = ["liver", "spleen", "stomach", "kidney_left", "kidney_right"]


# --------------------------------------------------------------------------------------------
# volume helpers
# --------------------------------------------------------------------------------------------


def bbox(mask2d):
    ys, xs = np.nonzero(mask2d)
    return [int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())]


def choose_anchor(labels_stack, box_counts, min_pixels=10):
    """(key slice, {n: [(organ, box), ...]}) on one common key slice."""
    wanted = BOX_SETS[max(box_counts)] if max(box_counts) in BOX_SETS else FALLBACK_ORDER[: max(box_counts)]
    areas = {o: (labels_stack == ORGANS[o]).sum(axis=(1, 2)) for o in ORGANS}
    ok = np.all([areas[o] >= min_pixels for o in wanted], axis=0)
    total = np.sum([areas[o] for o in wanted], axis=0)
    if ok.any():
        key = int(np.argmax(np.where(ok, total, -1)))
    else:  # no slice shows them all: the largest liver slice, with whatever organs it shows
        key = int(np.argmax(areas["liver"]))
    present = [o for o in FALLBACK_ORDER if areas[o][key] >= min_pixels]
    sets = {}
    for n in box_counts:
        names = [o for o in BOX_SETS.get(n, []) if o in present]
        names += [o for o in present if o not in names][: max(0, n - len(names))]
        if len(names) < n:
            raise SystemExit(f"only {len(present)} organs ({', '.join(present)}) on key slice {key}; cannot make {n} boxes")
        sets[n] = [(o, bbox(labels_stack[key] == ORGANS[o])) for o in names[:n]]
    return key, sets


def dice(a, b):
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    s = a.sum() + b.sum()
    return 1.0 if s == 0 else float(2.0 * np.logical_and(a, b).sum() / s)


# --------------------------------------------------------------------------------------------
# child: one measured run
# --------------------------------------------------------------------------------------------


def _rss_mb():
    import resource

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024.0 if sys.platform != "darwin" else kb / 1024.0 / 1024.0


def _steal_seconds():
    """System-wide CPU steal time so far (a hypervisor taking our CPUs), Linux only."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def run_child(args):
    import torch

    from medvolcore.propagation import MedSAM2Propagator
    from reference.medsam2 import reference_propagate

    boxes = json.loads(args.child_boxes)
    if args.checkpoint:
        prop = MedSAM2Propagator.from_checkpoint(args.checkpoint, image_size=args.image_size)
    else:
        prop = MedSAM2Propagator.from_random(args.seed, image_size=args.image_size)
    stack, _, _ = load_canonical(args.volume)
    with torch.inference_mode():  # same warm-up for both sides
        prop.predictor.forward_image(torch.zeros(1, 3, args.image_size, args.image_size))
    base_rss = _rss_mb()
    steal0, cpu0 = _steal_seconds(), time.process_time()
    t0 = time.perf_counter()
    if args.child == "ours":
        r = prop.propagate(stack, args.child_key, boxes)
        mask, calls, encoded = r.mask, r.encoder_calls, r.slices_encoded
    else:
        mask, calls = reference_propagate(prop, stack, args.child_key, boxes)
        encoded = None
    seconds = time.perf_counter() - t0
    cpu_seconds, steal = time.process_time() - cpu0, _steal_seconds() - steal0
    np.save(args.child_mask, mask)
    out = {
        "impl": args.child,
        "boxes": len(boxes),
        "slices": int(stack.shape[0]),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "steal_seconds": steal,
        "slices_per_s": stack.shape[0] / seconds,
        "encoder_calls": int(calls),
        "slices_encoded": encoded,
        "rss_before_mb": base_rss,
        "peak_rss_self_mb": _rss_mb(),
        "threads": torch.get_num_threads(),
        "voxels": int(mask.sum()),
    }
    Path(args.child_result).write_text(json.dumps(out))


def _spawn(cmd):
    """Run a command; returns (returncode, wall seconds, peak RSS MB of that process, stdout)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        # wait4 gives this child's own rusage (ru_maxrss in KiB on Linux)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if p.returncode != 0:
        sys.stderr.write(stderr[-4000:])
    return p.returncode, wall, ru.ru_maxrss / 1024.0, stdout


# --------------------------------------------------------------------------------------------
# parent
# --------------------------------------------------------------------------------------------


def in_process_benchmark(args, key, box_sets, tmp):
    rows = []
    for n in args.boxes:
        boxes = [b for _, b in box_sets[n]]
        runs = {"ours": [], "reference": []}
        masks = {}
        for rep in range(args.repeat):
            for impl in ("ours", "reference"):  # interleaved, so slow spells hit both sides
                mask_path, res_path = tmp / f"{impl}_{n}.npy", tmp / f"{impl}_{n}.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", impl, "--child-key", str(key),
                       "--child-boxes", json.dumps(boxes), "--child-mask", str(mask_path),
                       "--child-result", str(res_path), "--volume", str(args.volume),
                       "--image-size", str(args.image_size), "--seed", str(args.seed)]
                if args.checkpoint:
                    cmd += ["--checkpoint", args.checkpoint]
                print(f"  {impl} with {n} box(es), run {rep + 1}/{args.repeat} …", end=" ", flush=True)
                rc, wall, peak, _ = _spawn(cmd)
                if rc != 0:
                    raise SystemExit(f"{impl} run with {n} boxes failed (exit {rc})")
                r = json.loads(res_path.read_text())
                r["peak_rss_mb"] = peak
                r["process_wall_s"] = wall
                print(f"{r['seconds']:.1f} s (cpu {r['cpu_seconds']:.1f} s, steal {r['steal_seconds']:.1f} s)", flush=True)
                runs[impl].append(r)
                m = np.load(mask_path)
                if impl in masks and not np.array_equal(masks[impl], m):
                    raise SystemExit(f"{impl} gave different masks on repeated runs")
                masks[impl] = m
        d = dice(masks["ours"], masks["reference"])
        identical = bool(np.array_equal(masks["ours"], masks["reference"]))
        best = {impl: min(runs[impl], key=lambda r: r["seconds"]) for impl in runs}
        ratio = best["reference"]["seconds"] / best["ours"]["seconds"]
        for impl in ("ours", "reference"):
            r = dict(best[impl])
            r.update({"speed_ratio_ref_over_ours": ratio, "dice_vs_other": d, "identical": identical,
                      "organs": [o for o, _ in box_sets[n]], "all_seconds": [x["seconds"] for x in runs[impl]],
                      "peak_rss_mb": max(x["peak_rss_mb"] for x in runs[impl])})
            rows.append(r)
    return rows


def print_table(rows, title):
    print(f"\n{title}")
    hdr = (f"{'boxes':>5} {'impl':<10} {'seconds':>8} {'cpu s':>7} {'slices/s':>8} {'enc calls':>9} {'peak MB':>8} "
           f"{'ref/ours':>8} {'Dice':>7}  identical")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['boxes']:>5} {r['impl']:<10} {r['seconds']:>8.2f} {r['cpu_seconds']:>7.1f} {r['slices_per_s']:>8.3f} "
              f"{r['encoder_calls']:>9} {r['peak_rss_mb']:>8.0f} {r['speed_ratio_ref_over_ours']:>8.2f} "
              f"{r['dice_vs_other']:>7.4f}  {r['identical']}")


def check_goals(rows, n_slices):
    goals = {1: 1.0, 2: 1.4, 4: 1.8}
    res = []
    for r in rows:
        if r["impl"] != "ours":
            continue
        n = r["boxes"]
        res.append((f"{n} box(es): Dice ≥ 0.99", r["dice_vs_other"] >= 0.99))
        res.append((f"{n} box(es): one encoder call per slice ({r['encoder_calls']} for {n_slices})",
                    r["encoder_calls"] == n_slices))
        if n in goals:
            res.append((f"{n} box(es): ref/ours ≥ {goals[n]} (got {r['speed_ratio_ref_over_ours']:.2f})",
                        r["speed_ratio_ref_over_ours"] >= goals[n]))
    print("\nGoals:")
    for text, ok in res:
        print(f"  [{'ok' if ok else 'MISSED'}] {text}")
    return [{"goal": t, "met": ok} for t, ok in res]


def find_medvol():
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    exe = shutil.which("medvol", path=path)
    if not exe:
        return None, "`medvol` is not installed in this environment yet"
    try:
        p = subprocess.run([exe, "propagate", "--help"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"`medvol propagate --help` failed: {e}"
    if p.returncode != 0:
        return None, "`medvol` has no working `propagate` command yet"
    return exe, None


def whole_process_benchmark(args, key, box_sets, tmp, to_source_shape):
    exe, why = find_medvol()
    if exe is None:
        print(f"\nwhole-process benchmark skipped: {why}")
        return {"skipped": why}
    import nibabel as nib

    rows = []
    for n in args.boxes:
        boxes = [b for _, b in box_sets[n]]
        box_args = [a for b in boxes for a in ["--box", *map(str, b)]]
        weights = ["--sam-checkpoint", args.checkpoint] if args.checkpoint else ["--random-weights", str(args.seed)]
        common = ["--volume", str(args.volume), "--slice", str(key), *box_args, *weights,
                  "--image-size", str(args.image_size), "--json"]
        res = {}
        for impl in ("ours", "reference"):
            out = tmp / f"wp_{impl}_{n}.nii.gz"
            if impl == "ours":
                cmd = [exe, "propagate", *common, "--no-progress", "--out", str(out)]
            else:
                cmd = [sys.executable, str(REFERENCE), *common, "--out", str(out)]
            print(f"  whole process: {impl} with {n} box(es) …", flush=True)
            rc, wall, peak, _ = _spawn(cmd)
            if rc != 0:
                raise SystemExit(f"whole-process {impl} run failed (exit {rc}): {' '.join(cmd)}")
            res[impl] = {"wall_s": wall, "peak_rss_mb": peak, "mask": np.asarray(nib.load(str(out)).dataobj) > 0}
        d = dice(res["ours"]["mask"], res["reference"]["mask"])
        ratio = res["reference"]["wall_s"] / res["ours"]["wall_s"]
        for impl in ("ours", "reference"):
            rows.append({"boxes": n, "impl": impl, "wall_s": res[impl]["wall_s"], "peak_rss_mb": res[impl]["peak_rss_mb"],
                         "speed_ratio_ref_over_ours": ratio, "dice_vs_other": d})
    print("\nWhole process (imports, model build, I/O included)")
    hdr = f"{'boxes':>5} {'impl':<10} {'wall s':>8} {'peak MB':>8} {'ref/ours':>8} {'Dice':>7}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['boxes']:>5} {r['impl']:<10} {r['wall_s']:>8.2f} {r['peak_rss_mb']:>8.0f} "
              f"{r['speed_ratio_ref_over_ours']:>8.2f} {r['dice_vs_other']:>7.4f}")
    return {"rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description="MedSAM2 propagation benchmark: ours vs the MedSAM2-style reference loop")
    ap.add_argument("--volume", default=str(DEFAULT_CT), help="CT NIfTI (default: TotalSegmentator example_ct_sm)")
    ap.add_argument("--labels", default=None, help="label map on the same grid (default: example_seg when --volume is the default)")
    ap.add_argument("--image-size", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--checkpoint", default=None, help="use real MedSAM2 weights instead of random ones")
    ap.add_argument("--boxes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=1, help="runs per implementation and box count (interleaved); the fastest is reported")
    ap.add_argument("--whole-process", action="store_true", help="also time `medvol propagate` vs the reference script as whole processes")
    ap.add_argument("--json-out", default=None)
    # internal: one measured run in a child process
    ap.add_argument("--child", choices=["ours", "reference"], help=argparse.SUPPRESS)
    ap.add_argument("--child-key", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-boxes", help=argparse.SUPPRESS)
    ap.add_argument("--child-mask", help=argparse.SUPPRESS)
    ap.add_argument("--child-result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        run_child(args)
        return 0

    args.volume = Path(args.volume).resolve()
    if args.labels is None:
        if args.volume != DEFAULT_CT.resolve():
            raise SystemExit("--labels is needed with --volume (boxes come from organ bounding boxes)")
        args.labels = DEFAULT_LABELS
    stack, _, _ = load_canonical(args.volume)
    labels, _, _ = load_canonical(args.labels, labels=True)
    if labels.shape != stack.shape:
        raise SystemExit(f"label map {labels.shape} and volume {stack.shape} are not on the same grid")
    key, box_sets = choose_anchor(labels, args.boxes)
    import torch

    print(f"volume {args.volume.name}: stack {stack.shape} (D, H, W); image size {args.image_size}; "
          f"{'checkpoint ' + args.checkpoint if args.checkpoint else f'random weights seed {args.seed}'}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"key slice {key}; boxes: " + "; ".join(f"{n}: " + ", ".join(f"{o} {b}" for o, b in box_sets[n]) for n in args.boxes))

    report = {"volume": str(args.volume), "stack_shape": list(stack.shape), "image_size": args.image_size,
              "seed": args.seed, "checkpoint": args.checkpoint, "key_slice": key,
              "boxes": {str(n): box_sets[n] for n in args.boxes}, "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="medvol-bench-") as tmpd:
        tmp = Path(tmpd)
        rows = in_process_benchmark(args, key, box_sets, tmp)
        print_table(rows, "In-process propagation (model build excluded; each run in its own process; "
                          f"best of {args.repeat})")
        report["in_process"] = rows
        report["goals"] = check_goals(rows, stack.shape[0])
        if args.whole_process:
            report["whole_process"] = whole_process_benchmark(args, key, box_sets, tmp, stack.shape)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
