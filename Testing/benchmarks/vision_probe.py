"""Where is the square's position in the vision tower's output? (issue 15, `bench-vision`)

Fits a ridge regression from the vision tower's merged output on the key slice to the square's box
(four coordinates, 0..1000) on a finished ``medvol-train bench-vision`` run's training volumes, and
prints the mean absolute error on its held-out volumes, for two readouts:

* ``grid``: every token's features in grid order (the position can be read from *which* token is
  bright);
* ``attention``: one content-weighted average of the tokens (softmax over each token's distance
  from the mean token, temperature ``--sharpness``), which is what a single attention head reads:
  value vectors carry no rotary position, so this is the position an attention head can copy.

Baseline: predicting the training mean. Run on the trained adapter (default) or, with ``--untrained``,
on the model before training, and optionally with the position table scaled (``--pos-scale``).

    .venv/bin/python Testing/benchmarks/vision_probe.py DIR [--untrained] [--pos-scale 4]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def features(grounder, vision, samples, readout: str, sharpness: float):
    import torch

    from medvoltrain.prepare import load_slices

    xs, ys = [], []
    for s in samples:
        key = int(s["target_info"]["slice"])
        image = load_slices(s)[s["shown"].index(key)]
        px = grounder.image_processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            out = vision(px["pixel_values"].to(grounder.dtype), grid_thw=px["image_grid_thw"])
        f = (out.pooler_output if hasattr(out, "pooler_output") else out[0]).float()
        if readout == "grid":
            xs.append(f.reshape(-1).numpy())
        else:
            w = torch.softmax((f - f.mean(0)).norm(dim=-1) * sharpness, 0)[:, None]
            xs.append((w * f).sum(0).numpy())
        ys.append(s["target_info"]["boxes_norm"][0])
    return np.asarray(xs), np.asarray(ys, dtype=float)


def ridge_mae(xtr, ytr, xte, yte, lam: float) -> np.ndarray:
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
    a, b = (xtr - mu) / sd, (xte - mu) / sd
    ym = ytr.mean(0)
    w = np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ (ytr - ym))  # intercept not penalised
    return np.abs(b @ w + ym - yte).mean(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a finished `medvol-train bench-vision --out DIR` folder")
    p.add_argument("--untrained", action="store_true", help="probe the model before training (no adapter)")
    p.add_argument("--pos-scale", type=float, default=1.0, help="scale the vision position table first")
    p.add_argument("--sharpness", type=float, default=5.0, help="softmax temperature of the attention readout")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from medvolcore.grounder import QwenVLGrounder
    from medvoltrain.prepare import load_samples

    torch.set_num_threads(1)
    run = os.path.abspath(args.run)
    if not os.path.isfile(os.path.join(run, "result.json")):
        sys.stderr.write(f"error: {run} is not a finished bench-vision run (no result.json)\n")
        return 2
    adapter = None if args.untrained else os.path.join(run, "runs", "sft", "adapter")
    g = QwenVLGrounder.from_pretrained(os.path.join(run, "model"), adapter=adapter)
    vision = [m for n, m in g.model.named_modules() if n.endswith("visual")][0]  # the trained copy under PEFT
    if args.pos_scale != 1.0:
        table = [m for n, m in vision.named_modules() if n.endswith("pos_embed")][0]
        with torch.no_grad():
            table.weight.mul_(args.pos_scale)
    train = load_samples(os.path.join(run, "data"), "train")
    test = load_samples(os.path.join(run, "data"), "test")
    print(f"{run}: {'untrained' if args.untrained else 'trained'} vision tower, position table × {args.pos_scale:g}; "
          f"{len(train)} train / {len(test)} test volumes; MAE of the 4 box coordinates (0..1000)")
    for readout in ("grid", "attention"):
        xtr, ytr = features(g, vision, train, readout, args.sharpness)
        xte, yte = features(g, vision, test, readout, args.sharpness)
        base = np.abs(ytr.mean(0) - yte).mean(0)
        print(f"  {readout:<9} baseline (training mean) {np.round(base, 1)}")
        for lam in (1.0, 10.0, 100.0):
            print(f"  {readout:<9} ridge λ={lam:<5g} {np.round(ridge_mae(xtr, ytr, xte, yte, lam), 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
