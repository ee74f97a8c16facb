"""Where is the square's position, and does the answer look there? (`bench-vision`)

Two probes of a finished ``medvol-train bench-vision`` run.

1. **Vision readouts.** A ridge regression from the vision tower's merged output on the key slice
   to the square's box (four coordinates, 0..1000), fitted on the run's training volumes; printed:
   the mean absolute error on its held-out volumes, for four readouts:

   * ``grid``: every token's features in grid order (the position can be read from *which* token
     is bright);
   * ``object``: the features of the one token that holds the square's centre (what an attention
     head that picked out the square's token would copy: value vectors carry no rotary position);
   * ``slice-mean``: the mean of the slice's tokens (what a head spread evenly over the slice copies);
   * ``attention``: one content-weighted average of the tokens (softmax over each token's distance
     from the mean token, temperature ``--sharpness``).

   Baseline: predicting the training mean.

2. **Language-model attention** (``--lm-attention N``): for N held-out volumes, the answer is
   teacher-forced and, at the position that predicts the first digit of the first box, each
   layer's attention is read: the largest weight any head puts on the square's own token, and the
   largest total weight any head puts on the key slice's tokens. A model that reads the position
   attends to the square's token there.

Run on the trained adapter (default) or, with ``--untrained``, on the model before training; the
vision position table can be scaled first (``--pos-scale``).

    .venv/bin/python Testing/benchmarks/vision_probe.py DIR [--untrained] [--pos-scale 4] [--lm-attention 8]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

READOUTS = ("grid", "object", "slice-mean", "attention")


def object_token(box_norm, side: int) -> int:
    """Row-major index, on a ``side`` × ``side`` merged-token grid, of the token holding the box's centre."""
    cx, cy = (box_norm[0] + box_norm[2]) / 2000.0, (box_norm[1] + box_norm[3]) / 2000.0
    return min(side - 1, int(cy * side)) * side + min(side - 1, int(cx * side))


def vision_output(grounder, vision, image):
    import torch

    px = grounder.image_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        out = vision(px["pixel_values"].to(grounder.dtype), grid_thw=px["image_grid_thw"])
    return (out.pooler_output if hasattr(out, "pooler_output") else out[0]).float()


def features(grounder, vision, samples, readout: str, sharpness: float):
    import torch

    from medvoltrain.prepare import load_slices

    xs, ys = [], []
    for s in samples:
        key = int(s["target_info"]["slice"])
        box = s["target_info"]["boxes_norm"][0]
        f = vision_output(grounder, vision, load_slices(s)[s["shown"].index(key)])
        if readout == "grid":
            xs.append(f.reshape(-1).numpy())
        elif readout == "object":
            xs.append(f[object_token(box, int(round(f.shape[0] ** 0.5)))].numpy())
        elif readout == "slice-mean":
            xs.append(f.mean(0).numpy())
        else:
            w = torch.softmax((f - f.mean(0)).norm(dim=-1) * sharpness, 0)[:, None]
            xs.append((w * f).sum(0).numpy())
        ys.append(box)
    return np.asarray(xs), np.asarray(ys, dtype=float)


def ridge_mae(xtr, ytr, xte, yte, lam: float) -> np.ndarray:
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
    a, b = (xtr - mu) / sd, (xte - mu) / sd
    ym = ytr.mean(0)
    w = np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ (ytr - ym))  # intercept not penalised
    return np.abs(b @ w + ym - yte).mean(0)


def lm_attention(grounder, samples):
    """Per sample: the first box digit's query position's attention, per layer, as
    (max over heads of the weight on the square's token, max over heads of the weight on the key slice)."""
    import torch

    from medvoltrain.sft import GrounderSFTCollator

    grounder.model.set_attn_implementation("eager")
    collate, tok = GrounderSFTCollator(grounder), grounder.tokenizer
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    rows = []
    for s in samples:
        batch = collate([s])
        ids = batch["input_ids"][0]
        with torch.no_grad():
            out = grounder.model(**{k: v for k, v in batch.items() if k != "labels"}, output_attentions=True)
        image_pos = (ids == image_id).nonzero().flatten()
        per_slice = len(image_pos) // len(s["shown"])
        k = s["shown"].index(int(s["target_info"]["slice"]))
        key_slice = image_pos[k * per_slice:(k + 1) * per_slice]
        obj = int(key_slice[object_token(s["target_info"]["boxes_norm"][0], int(round(per_slice ** 0.5)))])
        completion = int((batch["labels"][0] != -100).nonzero().flatten()[0])
        # the box list opens with "[[" (its own token, or two "[" tokens): the query position of the
        # token just before the first digit after the completion's first "[["
        text = [tok.decode([int(t)]) for t in ids]
        q = next((i for i in range(completion, len(ids) - 1) if text[i + 1][:1].isdigit()
                  and "".join(text[completion:i + 1]).rstrip().endswith("[[")), None)
        if q is None:
            raise ValueError(f"{s['id']}: its target has no box list to read the attention at")
        rows.append([(float(a[0, :, q, obj].max()), float(a[0, :, q, key_slice].sum(-1).max()))
                     for a in out.attentions])
    return np.asarray(rows)  # samples × layers × 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a finished `medvol-train bench-vision --out DIR` folder")
    p.add_argument("--untrained", action="store_true", help="probe the model before training (no adapter)")
    p.add_argument("--pos-scale", type=float, default=1.0, help="scale the vision position table first")
    p.add_argument("--sharpness", type=float, default=5.0, help="softmax temperature of the attention readout")
    p.add_argument("--lm-attention", type=int, default=0, metavar="N",
                   help="also read the language model's attention on N held-out volumes")
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
    for readout in READOUTS:
        xtr, ytr = features(g, vision, train, readout, args.sharpness)
        xte, yte = features(g, vision, test, readout, args.sharpness)
        base = np.abs(ytr.mean(0) - yte).mean(0)
        print(f"  {readout:<10} baseline (training mean) {np.round(base, 1)}")
        for lam in (1.0, 10.0, 100.0):
            print(f"  {readout:<10} ridge λ={lam:<5g} {np.round(ridge_mae(xtr, ytr, xte, yte, lam), 1)}")
    if args.lm_attention > 0:
        try:
            rows = lm_attention(g, test[:args.lm_attention])
        except ValueError as e:
            sys.stderr.write(f"error: {e}\n")
            return 2
        print(f"language-model attention at the first box digit, {len(rows)} held-out volumes (mean ± SD):")
        for layer in range(rows.shape[1]):
            obj, key = rows[:, layer, 0], rows[:, layer, 1]
            print(f"  layer {layer}: on the square's token (best head) {obj.mean():.3f} ± {obj.std():.3f}; "
                  f"on the key slice (best head) {key.mean():.3f} ± {key.std():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
