#!/usr/bin/env python3
"""Benchmark: a correction round on a volume the worker has seen, against its first propagation.

    .venv/bin/python Testing/benchmarks/corrections.py [--image-size 512] [--seed 0] [--threads N]
        [--json-out FILE] [--figure PNG]

What a clinician does in Slicer, timed the way the worker runs it: the 112-slice CT
(``Testing/data/totalsegmentator/example_ct.nii.gz``), a liver box on its largest slice from the
label map, propagated once with the worker's feature store (early stop K = 2, the default); then
two correction rounds with the same store: (1) the same object corrected — a box for the liver 12
slices further down and an outside point on it, so the tracking work equals the first run's and
the difference is the encoding saved; (2) the same plus a new object (the right kidney, from one
inside point), which adds a second object's tracking. Printed per run: CPU seconds
(``time.process_time``; run it with ``--threads 1`` for figures that do not depend on other load)
and wall seconds, image-encoder calls (a forward hook on MedSAM2's image encoder), the ratios to
the first run, and the control: round (1) without the store (every slice encoded again), whose
mask must equal the cached round's bit for bit. Weights are seeded random weights at the real
size, which cost what real weights cost; the masks are meaningless, so nothing here says
anything about segmentation quality.

``--figure`` draws the corrected case (key slice, then the corrected slice before and after) for
the documentation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
CT = REPO / "Testing" / "data" / "totalsegmentator" / "example_ct.nii.gz"
LABELS = REPO / "Testing" / "data" / "totalsegmentator" / "example_seg_fast_force_split.nii.gz"
LIVER, KIDNEY_RIGHT = 5, 2


def _case():
    from medvolcore.anchor import anchor_from_mask, boxes_from_slice_mask
    from medvolcore.stack import AxialStack
    from medvolcore.volume import load_label_map, load_volume

    stack = AxialStack(load_volume(CT))
    seg = stack.to_stack(load_label_map(LABELS).array)
    liver = seg == LIVER
    anchor = anchor_from_mask(liver)
    k = anchor.slice
    z = k + 12
    box = boxes_from_slice_mask(liver[z])[0]
    outside = [int(box[0]), int(box[1]), 0]  # the box's corner: outside the liver on most slices
    kidney = seg == KIDNEY_RIGHT
    zk = int(np.argmax(kidney.reshape(len(kidney), -1).sum(1)))
    ky, kx = (int(np.median(v)) for v in np.nonzero(kidney[zk]))
    prompts = [{"slice": z, "object": 1, "box": [int(v) for v in box], "points": [outside]},
               {"slice": zk, "object": 2, "box": None, "points": [[kx, ky, 1]]}]
    return stack, anchor, prompts


def _timed(prop, stack, anchor, prompts, store, stop_k):
    calls = [0]
    hook = prop.predictor.image_encoder.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        c0, w0 = time.process_time(), time.perf_counter()
        r = prop.propagate(stack.data, anchor.slice, anchor.boxes, prompts=prompts, features=store,
                           stop_after_empty=stop_k)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    finally:
        hook.remove()
    return r, {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "encoder_calls": calls[0],
               "slices_encoded": r.slices_encoded, "slices_visited": r.slices_propagated,
               "mask_voxels": int(r.mask.sum())}


def _figure(path, stack, anchor, prompts, before, after):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from medvolcore.windowing import window_to_uint8

    z = prompts[0]["slice"]
    panels = [(anchor.slice, after, f"key slice {anchor.slice}: the model's box", [(anchor.boxes[0], [])]),
              (z, before, f"slice {z} before: no correction", []),
              (z, after, f"slice {z} after: a box and an outside point", [(prompts[0]["box"], prompts[0]["points"])])]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.4))
    for ax, (zz, mask, title, marks) in zip(axes, panels):
        ax.imshow(window_to_uint8(stack.data[zz]), cmap="gray")
        ax.contour(mask[zz] > 0, levels=[0.5], colors=["#00e5ff"], linewidths=1.5)
        for box, points in marks:
            x0, y0, x1, y1 = box
            ax.add_patch(Rectangle((x0 - 0.5, y0 - 0.5), x1 - x0 + 1, y1 - y0 + 1, fill=False, ec="#ffcc00", lw=1.5))
            for x, y, label in points:
                ax.plot(x, y, "o" if label else "x", color="#33ff33" if label else "#ff3333", ms=8, mew=2)
        ax.set_title(title, fontsize=10)
        ax.axis("off")
    fig.suptitle("Correcting a propagation (random MedSAM2 weights: the mechanics, not a segmentation)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"figure: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image-size", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--stop-after-empty", type=int, default=2)
    ap.add_argument("--json-out")
    ap.add_argument("--figure")
    args = ap.parse_args(argv)

    import torch

    from medvolcore.propagation import FeatureCache, MedSAM2Propagator

    if args.threads:
        torch.set_num_threads(args.threads)
    stack, anchor, prompts = _case()
    prop = MedSAM2Propagator.from_random(args.seed, image_size=args.image_size)
    # warm-up outside the timed runs: one encoder pass on a slice
    prop.propagate(stack.data[anchor.slice:anchor.slice + 1], 0, anchor.boxes)
    cache = FeatureCache(2048 << 20)
    store = cache.store(("example_ct", args.image_size))
    first, t_first = _timed(prop, stack, anchor, [], store, args.stop_after_empty)
    print(f"first propagation: {t_first}", flush=True)
    cached, t_cached = _timed(prop, stack, anchor, prompts[:1], store, args.stop_after_empty)
    print(f"(1) object 1 corrected, features kept: {t_cached}", flush=True)
    plus, t_plus = _timed(prop, stack, anchor, prompts, store, args.stop_after_empty)
    print(f"(2) object 1 corrected + a new object, features kept: {t_plus}", flush=True)
    fresh, t_fresh = _timed(prop, stack, anchor, prompts[:1], None, args.stop_after_empty)
    print(f"(1) without the store (control): {t_fresh}", flush=True)
    same = bool(np.array_equal(cached.mask, fresh.mask))
    out = {
        "date": time.strftime("%Y-%m-%d"), "ct": CT.name, "shape_zyx": list(stack.data.shape),
        "image_size": args.image_size, "threads": torch.get_num_threads(), "stop_after_empty": args.stop_after_empty,
        "prompts": prompts, "first": t_first, "correction_cached": t_cached, "correction_new_object_cached": t_plus,
        "correction_uncached": t_fresh,
        "cpu_ratio": round(t_cached["cpu_s"] / t_first["cpu_s"], 3),
        "wall_ratio": round(t_cached["wall_s"] / t_first["wall_s"], 3),
        "cpu_ratio_new_object": round(t_plus["cpu_s"] / t_first["cpu_s"], 3),
        "cpu_ratio_uncached": round(t_fresh["cpu_s"] / t_first["cpu_s"], 3),
        "masks_identical_with_and_without_the_store": same,
        "store": cache.describe(),
        "store_mb_per_slice": round(cache.nbytes / max(len(store), 1) / 2**20, 2),
    }
    print(json.dumps({k: out[k] for k in ("cpu_ratio", "wall_ratio", "cpu_ratio_new_object", "cpu_ratio_uncached",
                                          "masks_identical_with_and_without_the_store",
                                          "store", "store_mb_per_slice")}))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
    if args.figure:
        _figure(args.figure, stack, anchor, prompts, first.mask, cached.mask)
    return 0 if same and t_cached["encoder_calls"] == t_plus["encoder_calls"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
