#!/usr/bin/env python3
"""bf16 against fp32 for the grounder on this CPU: speed, memory and whether the answers agree.

    .venv/bin/python Testing/benchmarks/cpu_bf16.py [--size 2b] [--slices 2] [--threads 1]
        [--skip-full] [--json-out FILE]

Parts, each figure from its own child process (peak RSS from ``os.wait4``):

1. **This CPU**: its bf16 flags, PyTorch's capability and oneDNN bf16 answer, and what
   ``medvolcore.cpu.grounder_dtype`` picks (what ``medvol segment`` runs without
   ``--grounder-dtype``).
2. **Matrix products at the 2B model's shapes** (1024 tokens × 2048 → 6144, one of its MLP
   projections): seconds per product in fp32 and bf16.
3. **Agreement with the tiny preset** (the smoke model, as the tests use it): the greedy,
   grammar-constrained answer to a fixed set of queries on the 112-slice example CT, fp32 and bf16:
   how many parse to the same anchor (slice and boxes).
4. **The real size** (``--size``, random weights built as ``fullsize.py`` builds them, kept under
   ``$MEDVOL_HOME/bench``): the prompt of a ``--slices``-slice stack of the example CT, fp32 and
   bf16: prefill seconds, decode tokens/s over 8 tokens, peak RSS, and the logit agreement of the
   two (argmax agreement over every prompt position, top-5 overlap at the last one, the largest
   logit difference over the logits' spread). A short prompt keeps the bf16 run short on a CPU
   without bf16 arithmetic, where it is an order of magnitude slower; the cost per token of the
   full 64-slice prompt is in ``fullsize.py``'s figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fullsize  # noqa: E402  (this folder's full-size benchmark: checkpoints, children, the example CT)

QUERIES = ["the right kidney", "the liver", "the spleen", "the organ that secretes bile", "the urinary bladder",
           "the aorta"]
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


# ---- children ------------------------------------------------------------------------------

def child_matmul(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.randn(1024, 2048).to(dt)
        lin = torch.nn.Linear(2048, 6144, bias=False).to(dt)
        with torch.inference_mode():
            lin(x)
            t = time.perf_counter()
            for _ in range(3):
                lin(x)
        out[name] = (time.perf_counter() - t) / 3
    return out


def child_tiny(args) -> dict:
    import torch

    from medvolcore.grounder import QwenVLGrounder
    from medvolcore.models.tiny import ensure_tiny_model
    from medvolcore.pipeline import as_stack

    torch.set_num_threads(args.threads)
    g = QwenVLGrounder.from_pretrained(ensure_tiny_model(), dtype=TORCH_DTYPE[args.dtype])
    stack = as_stack(fullsize.CT)
    answers = []
    for q in QUERIES:
        r = g.ground(stack, q)
        a = r.anchor
        answers.append({"query": q, "slice": a.slice, "boxes": [list(map(int, b)) for b in a.boxes],
                        "absent": bool(a.absent)})
    return {"answers": answers, "dtype": str(g.dtype)}


def child_full(args) -> dict:
    import torch

    import nibabel as nib

    from medvolcore.grounder import QwenVLGrounder
    from medvolcore.pipeline import as_stack

    torch.set_num_threads(args.threads)
    g = QwenVLGrounder.from_pretrained(args.folder, dtype=TORCH_DTYPE[args.dtype], settings={"preset": "real"})
    ct = nib.load(str(fullsize.CT))
    keep = np.linspace(0, ct.shape[2] - 1, args.slices).round().astype(int)  # a few slices of the same CT
    small = Path(args.out_npy).with_suffix(".nii.gz")
    nib.save(nib.Nifti1Image(np.asarray(ct.dataobj)[..., keep], ct.affine), str(small))
    inputs, shown = g.build_inputs(as_stack(small), fullsize.QUERY)
    with torch.inference_mode():
        t = time.perf_counter()
        out = g.model(**{k: v for k, v in inputs.items()}, use_cache=True)
        prefill = time.perf_counter() - t
        logits = out.logits[0].float()
        past = out.past_key_values
        nxt = logits[-1].argmax().view(1, 1)
        t = time.perf_counter()
        steps = 8
        for _ in range(steps):
            o = g.model(input_ids=nxt, past_key_values=past, use_cache=True)
            past, nxt = o.past_key_values, o.logits[0, -1].argmax().view(1, 1)
        decode = time.perf_counter() - t
    np.save(args.out_npy, logits[-1].numpy())
    np.save(args.out_npy.replace(".npy", "_argmax.npy"), logits.argmax(-1).numpy())
    return {"prompt_tokens": int(inputs["input_ids"].shape[1]), "prefill_s": prefill,
            "decode_tokens_per_s": steps / decode, "dtype": str(g.dtype), "threads": torch.get_num_threads()}


# ---- the parent ----------------------------------------------------------------------------

def run_child(job: str, argv: list) -> dict:
    saved = fullsize.__file__
    fullsize.__file__ = __file__  # fullsize.run_child runs "this script --child JOB"
    try:
        return fullsize.run_child(job, argv, dict(os.environ))
    finally:
        fullsize.__file__ = saved


def this_cpu() -> dict:
    import torch

    from medvolcore import cpu

    flags = cpu.cpu_flags() or set()
    return {"bf16_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2"}),
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "onednn_bf16": cpu._mkldnn_bf16(),
            "chosen": cpu.grounder_dtype(None, "cpu")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--out-npy", help=argparse.SUPPRESS)
    p.add_argument("--size", default="2b", help="real size for part 4: 2b (default) or 4b")
    p.add_argument("--slices", type=int, default=2, help="slices in part 4's prompt (default 2, at least 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in every child (default 1)")
    p.add_argument("--skip-full", action="store_true", help="skip part 4 (the real size)")
    p.add_argument("--model-dir", help="where the real-size checkpoint is kept (default $MEDVOL_HOME/bench)")
    p.add_argument("--json-out", help="write the figures here")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps({"matmul": child_matmul, "tiny": child_tiny, "full": child_full}[args.child](args)))
        return 0

    res = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "cpu": this_cpu()}
    c = res["cpu"]
    print(f"this CPU: flags {', '.join(c['bf16_flags']) or '(none of note)'}; PyTorch capability "
          f"{c['torch_capability']}, oneDNN bf16 {c['onednn_bf16']}; the grounder runs in {c['chosen']} here",
          flush=True)
    mm = run_child("matmul", ["--threads", args.threads])
    res["matmul"] = mm
    print(f"matrix product 1024×2048 → 6144, {args.threads} thread(s): fp32 {mm['fp32']:.3f} s, bf16 {mm['bf16']:.3f} s "
          f"(bf16 {mm['fp32'] / mm['bf16']:.2f}× the speed of fp32)", flush=True)

    tiny = {dt: run_child("tiny", ["--dtype", dt, "--threads", args.threads]) for dt in ("fp32", "bf16")}
    same = [a == b for a, b in zip(tiny["fp32"]["answers"], tiny["bf16"]["answers"])]
    res["tiny"] = {dt: {k: tiny[dt].get(k) for k in ("answers", "wall_s", "peak_rss_gb")} for dt in tiny}
    res["tiny"]["same_anchor"] = f"{sum(same)}/{len(same)}"
    print(f"tiny preset, {len(QUERIES)} queries on the example CT: the same anchor in fp32 and bf16 for "
          f"{sum(same)}/{len(same)}", flush=True)
    for a, b, ok in zip(tiny["fp32"]["answers"], tiny["bf16"]["answers"], same):
        if not ok:
            print(f"  differs: {a['query']!r}: fp32 slice {a['slice']} {a['boxes']}, bf16 slice {b['slice']} {b['boxes']}")

    if not args.skip_full:
        from medvolcore.models.tiny import medvol_home

        name = fullsize.size_names([args.size])[0]
        model_dir = Path(args.model_dir).expanduser() if args.model_dir else medvol_home() / "bench"
        folder = fullsize.checkpoint_dir(model_dir, name)
        if not fullsize.is_built(folder, name):
            print(f"building {name} (random weights) in {folder} …", flush=True)
            fullsize.build_checkpoint(name, folder)
        with tempfile.TemporaryDirectory() as d:
            full = {}
            for dt in ("fp32", "bf16"):
                print(f"{name} {dt}: {args.slices}-slice prompt …", flush=True)
                full[dt] = run_child("full", ["--folder", folder, "--dtype", dt, "--threads", args.threads,
                                              "--slices", args.slices, "--out-npy", f"{d}/{dt}.npy"])
                if full[dt].get("error"):
                    raise SystemExit(f"{name} {dt}: {full[dt]['error']}")
            a, b = np.load(f"{d}/fp32.npy"), np.load(f"{d}/bf16.npy")
            am, bm = np.load(f"{d}/fp32_argmax.npy"), np.load(f"{d}/bf16_argmax.npy")
        top_a, top_b = set(np.argsort(a)[-5:]), set(np.argsort(b)[-5:])
        agree = {"argmax_all_positions": float((am == bm).mean()), "last_top1_same": bool(a.argmax() == b.argmax()),
                 "last_top5_overlap": len(top_a & top_b) / 5,
                 "max_abs_diff_over_std": float(np.abs(a - b).max() / a.std()),
                 "correlation": float(np.corrcoef(a, b)[0, 1])}
        res["full"] = {"size": name, "slices": args.slices, "agreement": agree,
                       **{dt: {k: full[dt].get(k) for k in ("prompt_tokens", "prefill_s", "decode_tokens_per_s",
                                                            "peak_rss_gb", "wall_s")} for dt in full}}
        print(f"\n| {name}, {full['fp32']['prompt_tokens']}-token prompt | prefill s | decode tokens/s | peak RSS GB |")
        print("|---|---|---|---|")
        for dt in ("fp32", "bf16"):
            f = full[dt]
            print(f"| {dt} | {f['prefill_s']:.1f} | {f['decode_tokens_per_s']:.2f} | {f['peak_rss_gb']:.2f} |")
        print(f"bf16 prefill is {full['fp32']['prefill_s'] / full['bf16']['prefill_s']:.2f}× the speed of fp32; "
              f"logits: argmax agrees on {agree['argmax_all_positions']:.1%} of prompt positions, last position top-1 "
              f"{'same' if agree['last_top1_same'] else 'different'}, top-5 overlap {agree['last_top5_overlap']:.0%}, "
              f"correlation {agree['correlation']:.4f}, largest difference {agree['max_abs_diff_over_std']:.2f} × the "
              "logits' standard deviation")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
