#!/usr/bin/env python3
"""Benchmark: early stop (``--stop-after-empty K``) and objects tracked as one batch, at 512.

    .venv/bin/python Testing/benchmarks/early_stop.py [--targets 2 3 2,3] [--ks 0 1 2 3]
        [--image-size 512] [--threads 2] [--no-batching] [--json-out FILE]

**Early stop, whole process.** For each target (TotalSegmentator label ids of the 112-slice real
CT ``example_ct.nii.gz``: 2 right kidney, 3 left kidney, ``2,3`` both) and each K, one child
process runs ``medvol propagate`` (the real command line: imports, MedSAM2 build with seeded
random weights at 512, NIfTI read and write) on the target's anchor (``medvol anchor``'s:
largest-area slice, one box per connected component). Random weights make masks that never
end, so the child patches the model's mask output to follow the label (Testing/reference/controlled_masks.py:
every sam2 computation still runs at full cost); a target therefore ends where its label ends,
as a good MedSAM2 would. The parent reads the child's CPU seconds (user + system), wall
seconds and peak RSS from ``os.wait4``, and compares each K's mask with K = 0's (the full run).

Goals printed: per direction, slices visited ≤ target extent + 2K + 1 (extent: the key slice to
the label's last slice in that direction); whole-process CPU seconds ≥ 3× lower than K = 0's
for a kidney; masks equal on the kept slices.

**Batching, in process.** ``propagate(batch_objects=True|False)`` with 1, 2 and 4 boxes (right
kidney, + left kidney, + liver and spleen) on the slices ``[k−10, k+10]`` of the same CT, K = 0,
each in its own child process with the model built before the timed region; same masks
required (bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
REAL = Path(os.environ.get("MEDVOL_REAL_DATA", REPO / "Testing" / "data")) / "totalsegmentator"
CT = REAL / "example_ct.nii.gz"
LABELS = REAL / "example_seg_fast_force_split.nii.gz"
NAMES = {1: "spleen", 2: "kidney_right", 3: "kidney_left", 5: "liver"}


def _ids(text: str) -> list:
    return [int(v) for v in str(text).split(",") if v.strip()]


def _stack_labels(label_ids):
    from medvolcore.stack import AxialStack
    from medvolcore.volume import load_label_map

    labels = load_label_map(LABELS)
    st = AxialStack(labels)
    return st, [st.to_stack(np.asarray(labels.array) == i) for i in label_ids]


def _object_targets(anchor: dict, label_ids):
    """Per box of the anchor, the label mask (on the stack) that the box sits on."""
    _, masks = _stack_labels(label_ids)
    z = anchor["slice"]
    out = []
    for x0, y0, x1, y1 in anchor["boxes"]:
        overlap = [int(m[z, y0:y1 + 1, x0:x1 + 1].sum()) for m in masks]
        out.append(masks[int(np.argmax(overlap))])
    return out


# ---- children ------------------------------------------------------------------------------


def child_propagate(args) -> int:
    """``medvol propagate`` with the tracked masks following the target's labels."""
    sys.path.insert(0, str(HERE.parent))  # Testing/: the reference package
    from reference.controlled_masks import controlled_masks
    import torch

    torch.set_num_threads(args.threads)
    from medvolcore.cli import main
    from medvolcore.propagation._sam2_predictor import MedSAM2VideoPredictor

    anchor = json.loads(Path(args.anchor).read_text())
    targets = _object_targets(anchor, _ids(args.target))
    with controlled_masks(MedSAM2VideoPredictor, targets):
        return main(["propagate", "--volume", str(CT), "--anchor", args.anchor, "--out", args.out,
                     "--random-weights", "0", "--image-size", str(args.image_size), "--json", "--no-progress",
                     "--stop-after-empty", str(args.k)])


def child_batching(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    from medvolcore.anchor import anchor_from_mask
    from medvolcore.propagation import MedSAM2Propagator
    from medvolcore.stack import AxialStack
    from medvolcore.volume import load_volume

    _, masks = _stack_labels([2, 3, 5, 1])
    stack = np.ascontiguousarray(AxialStack(load_volume(CT)).data, dtype=np.float32)
    k = int(anchor_from_mask(masks[0] | masks[1]).slice)
    boxes = []
    for m in masks:
        ys, xs = np.nonzero(m[k])
        boxes.append([int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())])
    prop = MedSAM2Propagator.from_random(0, image_size=args.image_size)
    prop.propagate(stack, k, boxes[:1], window=0)  # warm-up outside the timed region
    n = args.boxes
    c0, t0 = time.process_time(), time.perf_counter()
    r = prop.propagate(stack, k, boxes[:n], window=10, batch_objects=args.batch == "on", return_object_masks=True)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    np.save(args.out, r.object_masks)
    print(json.dumps({"boxes": n, "batch": args.batch, "seconds": wall, "cpu_seconds": cpu, "key_slice": k,
                      "slices": r.slices_propagated}))
    return 0


# ---- parent --------------------------------------------------------------------------------


def run_child(argv, threads: int):
    """Run this script as a child; (stdout text, wall s, cpu s, peak MB, exit code)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", *map(str, argv)],
                             stdout=out, stderr=err, env=env)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        text, etext = out.read().decode(), err.read().decode()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.stderr.write(etext[-2000:])
    return text, wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024.0, code


def extents(target_mask: np.ndarray, k: int) -> dict:
    zs = np.nonzero(target_mask.any(axis=(1, 2)))[0]
    return {"forward": int(zs.max()) - k, "backward": k - int(zs.min()), "first": int(zs.min()), "last": int(zs.max())}


def early_stop(args, tmp: Path) -> list:
    from medvolcore.anchor import anchor_from_mask

    rows = []
    for target in args.targets:
        ids = _ids(target)
        st, masks = _stack_labels(ids)
        union = np.any(masks, axis=0)
        anchor = anchor_from_mask(union, stack=st).with_world(st)
        anchor_path = tmp / f"anchor-{target.replace(',', '_')}.json"
        anchor_path.write_text(anchor.to_json())
        ext = extents(union, anchor.slice)
        full_mask = None
        full_cpu = None
        for k in args.ks:
            out = tmp / f"mask-{target.replace(',', '_')}-{k}.nii.gz"
            text, wall, cpu, peak, code = run_child(
                ["propagate", "--target", target, "--anchor", anchor_path, "--out", out, "--k", k,
                 "--image-size", args.image_size, "--threads", args.threads], args.threads)
            if code != 0:
                print(f"target {target} K={k}: the child failed (exit {code})")
                continue
            res = json.loads(text[text.index("{"):])
            import nibabel as nib

            mask = np.asarray(nib.load(str(out)).dataobj) != 0
            mask_stack = st.to_stack(mask)
            lo, hi = res["slice_range"]
            if k == 0:
                full_mask, full_cpu = mask_stack, cpu
            dirs = res["propagation"]["directions"]
            row = {"target": target, "names": "+".join(NAMES.get(i, str(i)) for i in ids), "k": k,
                   "key_slice": anchor.slice, "boxes": len(anchor.boxes), "label_slices": [ext["first"], ext["last"]],
                   "slice_range": [lo, hi], "visited": hi - lo + 1, "encoder_calls": res["encoder_calls"],
                   "forward_visited": dirs["forward"]["slices"], "backward_visited": dirs["backward"]["slices"],
                   "forward_extent": ext["forward"], "backward_extent": ext["backward"],
                   "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_mb": round(peak, 1),
                   "propagate_s": res["seconds"]}
            if full_mask is not None:
                row["cpu_ratio"] = round(full_cpu / cpu, 3)
                row["equal_on_kept"] = bool(np.array_equal(mask_stack[lo:hi + 1], full_mask[lo:hi + 1]))
                row["equal_everywhere"] = bool(np.array_equal(mask_stack, full_mask))
            if k > 0:
                # the goal: per direction, visited ≤ extent + 2K + 1 (visited counts the slices after the key)
                row["goal_slices"] = bool(row["forward_visited"] <= ext["forward"] + 2 * k + 1
                                          and row["backward_visited"] <= ext["backward"] + 2 * k + 1)
            rows.append(row)
            print(f"  {row['names']:<26} K={k}: slices {lo}..{hi} ({row['visited']}), {wall:.1f} s wall, "
                  f"{cpu:.1f} s CPU, {peak:.0f} MB" + (f", CPU ×{row['cpu_ratio']:.2f} less" if "cpu_ratio" in row else ""),
                  flush=True)
    return rows


def batching(args, tmp: Path) -> list:
    rows = []
    for n in (1, 2, 4):
        res = {}
        for mode in ("off", "on"):
            out = tmp / f"objmasks-{n}-{mode}.npy"
            text, wall, cpu, peak, code = run_child(
                ["batching", "--boxes", n, "--batch", mode, "--out", out, "--image-size", args.image_size,
                 "--threads", args.threads], args.threads)
            if code != 0:
                print(f"batching {n} boxes {mode}: the child failed (exit {code})")
                break
            res[mode] = (json.loads(text.strip().splitlines()[-1]), np.load(out), peak)
        if len(res) < 2:
            continue
        (off, m_off, p_off), (on, m_on, p_on) = res["off"], res["on"]
        rows.append({"boxes": n, "slices": on["slices"], "one_by_one_s": round(off["seconds"], 2),
                     "batched_s": round(on["seconds"], 2), "one_by_one_cpu_s": round(off["cpu_seconds"], 2),
                     "batched_cpu_s": round(on["cpu_seconds"], 2), "speedup": round(off["seconds"] / on["seconds"], 3),
                     "identical": bool(np.array_equal(m_off, m_on)), "peak_mb": [round(p_off), round(p_on)]})
        print(f"  {n} box(es): one by one {off['seconds']:.1f} s, batched {on['seconds']:.1f} s, "
              f"identical {rows[-1]['identical']}", flush=True)
    return rows


def print_tables(stop_rows, batch_rows, args):
    steal = _steal()
    print(f"\nEarly stop, whole process (`medvol propagate`, random MedSAM2 at {args.image_size}, masks following "
          f"the label; torch threads {args.threads}{steal})")
    print(f"{'target':<26}{'K':>3} {'key':>4} {'label z':>9} {'visited':>9} {'fwd/ext':>8} {'bwd/ext':>8} "
          f"{'enc':>4} {'wall s':>7} {'CPU s':>7} {'peak MB':>8} {'CPU ×':>6} {'kept=':>6} {'all=':>5} {'goal':>5}")
    for r in stop_rows:
        print(f"{r['names']:<26}{r['k']:>3} {r['key_slice']:>4} {r['label_slices'][0]:>4}-{r['label_slices'][1]:<4}"
              f"{r['slice_range'][0]:>4}-{r['slice_range'][1]:<4}{r['forward_visited']:>4}/{r['forward_extent']:<3}"
              f"{r['backward_visited']:>4}/{r['backward_extent']:<3}{r['encoder_calls']:>5} {r['wall_s']:>7.1f} "
              f"{r['cpu_s']:>7.1f} {r['peak_mb']:>8.0f} {r.get('cpu_ratio', float('nan')):>6.2f} "
              f"{str(r.get('equal_on_kept', '-')):>6} {str(r.get('equal_everywhere', '-')):>5} "
              f"{str(r.get('goal_slices', '-')):>5}")
    if batch_rows:
        print(f"\nObjects tracked as one batch (in process, slices [k-10, k+10], K = 0, random MedSAM2 at "
              f"{args.image_size}; model build and a warm-up excluded)")
        print(f"{'boxes':>5} {'slices':>6} {'one by one s':>13} {'batched s':>10} {'CPU s (1by1/b)':>15} "
              f"{'speed-up':>9} {'identical':>9}")
        for r in batch_rows:
            print(f"{r['boxes']:>5} {r['slices']:>6} {r['one_by_one_s']:>13.2f} {r['batched_s']:>10.2f} "
                  f"{r['one_by_one_cpu_s']:>7.1f}/{r['batched_cpu_s']:<7.1f} {r['speedup']:>9.2f} {str(r['identical']):>9}")


def _steal() -> str:
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
        return f"; CPU steal so far {int(parts[8]) / max(1, sum(map(int, parts[1:]))):.1%}"
    except (OSError, IndexError, ValueError):
        return ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--targets", nargs="+", default=["2", "3", "2,3"], help="label ids, e.g. 2 3 2,3")
    p.add_argument("--ks", nargs="+", type=int, default=[0, 1, 2, 3], help="values of K (0 first: the reference)")
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="torch threads in each child (default 2)")
    p.add_argument("--no-batching", action="store_true", help="skip the batching comparison")
    p.add_argument("--no-early-stop", action="store_true", help="skip the early-stop comparison")
    p.add_argument("--json-out", help="write every figure as JSON")
    # child arguments
    p.add_argument("job", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--anchor", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, help=argparse.SUPPRESS)
    p.add_argument("--boxes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--batch", choices=["on", "off"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return {"propagate": child_propagate, "batching": child_batching}[args.job](args)
    if 0 not in args.ks or args.ks[0] != 0:
        p.error("--ks must start with 0 (the full run every other K is compared with)")
    for path in (CT, LABELS):
        if not path.is_file():
            p.error(f"{path} is missing (Testing/data in the repository, or set MEDVOL_REAL_DATA)")
    print(f"early-stop benchmark: {CT.name}, MedSAM2 random weights at {args.image_size}, "
          f"{os.cpu_count()} CPU(s), {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    with tempfile.TemporaryDirectory(prefix="medvol-earlystop-") as d:
        tmp = Path(d)
        stop_rows = [] if args.no_early_stop else early_stop(args, tmp)
        batch_rows = [] if args.no_batching else batching(args, tmp)
    print_tables(stop_rows, batch_rows, args)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"early_stop": stop_rows, "batching": batch_rows,
                                                   "image_size": args.image_size, "threads": args.threads,
                                                   "date": time.strftime("%Y-%m-%d")}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
