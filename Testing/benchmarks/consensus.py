#!/usr/bin/env python3
"""Consensus benchmark: what ``--consensus G`` costs and what it shares (CPU, random weights).

    .venv/bin/python Testing/benchmarks/consensus.py [--threads 1] [--samples 4] [--no-medium]
        [--volume CT] [--json-out FILE]

Part 1, **the whole job on the tiny preset** (``Pipeline("tiny")``, real generation, no canned
text): ``run_segment_job`` on the 30-slice real CT with G = 1 and with G = 4 (early stop 0, so
every propagation visits every slice, and the default 2). Printed: ground and propagate seconds,
slices encoded and image-encoder calls, the most times any one slice was encoded (must be 1), the
agreement map's shape and affine against the CT's (read back from the written file), whether the
mask lies inside agreement > 0, the confidence and each sample.

Part 2, **the grounder alone**, on the tiny model and on a medium random Qwen3-VL built the same
way with larger numbers (text: 6 layers, hidden 384; vision: 4 blocks, hidden 192; the tiny
tokenizer, so the vocabulary is small), on the 64 slices of the 112-slice real CT:

* the greedy answer (what G = 1 costs): prefill (vision + prompt, up to the first logits), the
  vision encoder's share, decode;
* samples 2..G continuing from its cache: the "prefill" (the uncached last prompt token, G − 1
  rows) and the decode of G − 1 rows; vision-encoder calls (must be 0);
* what ``generate`` with G copies of the prompt would cost before its first token: one forward of
  G rows through the vision encoder and the prompt (``model(**batch)``), the part that is shared;
* ``ground_samples`` whole: seconds, vision-encoder calls (must be 1), greedy attempts.

Random weights cost what trained ones do; the answers are meaningless. Timings on a shared
2-core machine swing a lot: compare within a run.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CT_30 = REPO / "Testing" / "data" / "totalsegmentator" / "example_ct_sm.nii.gz"
CT_112 = REPO / "Testing" / "data" / "totalsegmentator" / "example_ct.nii.gz"
QUERY = "the organ that secretes bile"

MEDIUM_TEXT = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                   num_key_value_heads=2, head_dim=64,
                   rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [16, 8, 8],
                                    "mrope_interleaved": True})
MEDIUM_VISION = dict(depth=4, hidden_size=192, intermediate_size=768, num_heads=3, out_hidden_size=384)


# ---- part 1: the whole job ----------------------------------------------------------------------

def job_run(pipe, volume, path: Path, samples: int, stop: int, out: Path) -> dict:
    import nibabel as nib
    import numpy as np

    from medvolcore.jobs import SegmentOutputs, SegmentRequest, run_segment_job

    mask, agr = out / f"mask_g{samples}_k{stop}.nii.gz", out / f"agreement_g{samples}_k{stop}.nii.gz"
    outputs = SegmentOutputs(mask, anchor=out / f"g{samples}_k{stop}.anchor.json", overwrite=True,
                             agreement=agr if samples > 1 else None)
    seen = []
    orig = pipe._propagate

    def spy(*a, **k):  # every propagation's encoded slices, in order
        seg = orig(*a, **k)
        seen.extend(seg.propagation.encoded_slices)
        return seg

    pipe._propagate = spy
    t = time.perf_counter()
    try:
        res = run_segment_job(pipe, volume, SegmentRequest(query=QUERY, stop_after_empty=stop, consensus=samples),
                              outputs)
    finally:
        pipe._propagate = orig
    wall = time.perf_counter() - t
    tm = res["timings"]
    row = {"samples": samples, "stop_after_empty": stop, "wall_s": wall, "ground_s": tm["ground_s"],
           "propagate_s": tm["propagate_s"], "slices_encoded": tm["slices_encoded"],
           "encoder_calls": tm["encoder_calls"], "propagations": tm.get("propagations", 0 if res["absent"] else 1),
           "max_encodings_of_a_slice": max(collections.Counter(seen).values()) if seen else 0,
           "confidence": res["confidence"], "samples_detail": res["samples"], "absent": res["absent"],
           "greedy_prefill_s": tm.get("ground_prefill_s"), "greedy_decode_s": tm.get("ground_decode_s"),
           "samples_prefill_s": tm.get("ground_samples_prefill_s"), "samples_decode_s": tm.get("ground_samples_decode_s")}
    if samples > 1:
        src, a = nib.load(str(path)), nib.load(str(agr))
        counts = np.asarray(a.dataobj)
        m = np.asarray(nib.load(str(mask)).dataobj) if res["out"] else np.zeros(src.shape, np.uint8)
        row.update(agreement_shape_ok=tuple(a.shape) == tuple(src.shape),
                   agreement_affine_ok=bool(np.allclose(a.affine, src.affine, atol=1e-5)),
                   agreement_max=int(counts.max()), mask_inside_agreement=bool(np.all(counts[m > 0] > 0)))
    return row


# ---- part 2: the grounder -----------------------------------------------------------------------

def build_medium(folder: Path) -> Path:
    from medvolcore.models import tiny

    if (folder / tiny.MARKER).is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    saved = dict(tiny.TEXT_CONFIG), dict(tiny.VISION_CONFIG)
    tiny.TEXT_CONFIG.update(MEDIUM_TEXT)
    tiny.VISION_CONFIG.update(MEDIUM_VISION)
    try:
        tiny.build_tiny_model(folder)
    finally:
        tiny.TEXT_CONFIG.clear()
        tiny.TEXT_CONFIG.update(saved[0])
        tiny.VISION_CONFIG.clear()
        tiny.VISION_CONFIG.update(saved[1])
    return folder


def grounder_run(name: str, folder: Path, stack, samples: int) -> dict:
    """The grounder's pieces timed one by one on one prompt (greedy answer, samples from its
    cache, G copies of the prompt the naive way), then ``ground_samples`` whole."""
    import torch

    from medvolcore.grounder import QwenVLGrounder

    g = QwenVLGrounder.from_pretrained(folder)
    params = sum(p.numel() for p in g.model.parameters())
    visual = g.model.model.visual
    vision = {"calls": 0, "s": 0.0, "t": 0.0}

    def pre(_m, args):
        vision["t"] = time.perf_counter()

    def post(_m, args, _o):
        vision["calls"] += 1
        vision["s"] += time.perf_counter() - vision["t"]

    def took():
        out = dict(vision)
        vision.update(calls=0, s=0.0)
        return out

    inputs, shown = g.build_inputs(stack, QUERY)
    kw = dict(constrain=True, seed=None, max_new_tokens=int(g.settings["max_new_tokens"]))
    hooks = [visual.register_forward_pre_hook(pre), visual.register_forward_hook(post)]
    try:
        g._generate_text(inputs, shown, do_sample=False, **kw)  # warm-up (kernels, the grammar's compilation)
        took()
        g._keep_prefix = True
        try:
            text, one = g._generate_text(inputs, shown, do_sample=False, **kw)
        finally:
            g._keep_prefix = False
        one_vision = took()
        texts, many = g._generate_samples(inputs, shown, samples - 1, constrain=True, seed=0,
                                          max_new_tokens=kw["max_new_tokens"], prefix=one.pop("_prefix"))
        many_vision = took()
        batch, _ = g.build_batch_inputs([(stack, QUERY)] * samples)  # what G copies in generate() start with
        batch = {k: v.to(g.device) for k, v in batch.items()}
        batch["pixel_values"] = batch["pixel_values"].to(g.dtype)
        t = time.perf_counter()
        with torch.inference_mode():
            g.model(**batch, logits_to_keep=1)
        naive_s, naive_vision = time.perf_counter() - t, took()
        t = time.perf_counter()
        whole = g.ground_samples(stack, QUERY, samples, seed=0)
        whole_s, whole_vision = time.perf_counter() - t, took()
    finally:
        for h in hooks:
            h.remove()
    return {
        "model": name, "parameters": params, "prompt_tokens": int(inputs["input_ids"].shape[1]), "samples": samples,
        "greedy_prefill_s": one["prefill_s"], "greedy_decode_s": one["decode_s"], "greedy_tokens": one["new_tokens"],
        "greedy_vision_calls": one_vision["calls"], "greedy_vision_s": one_vision["s"],
        "samples_prefill_s": many["prefill_s"], "samples_decode_s": many["decode_s"],
        "samples_tokens": many["new_tokens"], "samples_vision_calls": many_vision["calls"],
        "samples_shared_prefill": many["shared_prefill"],
        "naive_prefill_s": naive_s, "naive_vision_calls": naive_vision["calls"], "naive_vision_s": naive_vision["s"],
        "ground_samples_s": whole_s, "ground_samples_vision_calls": whole_vision["calls"],
        "ground_samples_attempts": whole.greedy.attempts, "ground_samples_usable": sum(s.usable for s in whole.samples),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--samples", type=int, default=4, help="G (default 4)")
    ap.add_argument("--volume", type=Path, default=CT_30, help="CT of part 1 (default the 30-slice real CT)")
    ap.add_argument("--no-medium", action="store_true", help="skip the medium random model")
    ap.add_argument("--model-dir", type=Path, default=None, help="where to build the medium model (default a temp folder)")
    ap.add_argument("--json-out", type=Path, help="also write the figures as JSON")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(max(1, args.threads))
    from medvolcore.models.tiny import ensure_tiny_model
    from medvolcore.pipeline import Pipeline, as_stack

    res = {"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "samples": args.samples, "jobs": [],
           "grounder": []}
    pipe = Pipeline("tiny", device="cpu").load()
    with tempfile.TemporaryDirectory(prefix="medvol-consensus-") as tmp:
        tmp = Path(tmp)
        stack = as_stack(args.volume)
        pipe.segment(stack, QUERY)  # warm-up of both models
        for stop in (0, 2):
            for g in (1, args.samples):
                res["jobs"].append(job_run(pipe, stack, args.volume, g, stop, tmp))
        print(f"\n== whole job, tiny preset, {args.volume.name} ({stack.depth} slices), {res['threads']} thread(s)")
        print(f"{'G':>2} {'K':>2} {'ground s':>9} {'propagate s':>12} {'encoded':>8} {'enc calls':>9} {'max/slice':>9} "
              f"{'props':>5} {'conf':>6}  agreement grid / mask ⊆ agreement>0")
        for r in res["jobs"]:
            grid = (f"shape {'ok' if r.get('agreement_shape_ok') else 'NO'}, affine "
                    f"{'ok' if r.get('agreement_affine_ok') else 'NO'}, mask ⊆ "
                    f"{'yes' if r.get('mask_inside_agreement') else 'NO'}") if r["samples"] > 1 else "–"
            conf = "–" if r["confidence"] is None else f"{r['confidence']:.3f}"
            print(f"{r['samples']:>2} {r['stop_after_empty']:>2} {r['ground_s']:>9.2f} {r['propagate_s']:>12.2f} "
                  f"{r['slices_encoded']:>8} {r['encoder_calls']:>9} {r['max_encodings_of_a_slice']:>9} "
                  f"{r['propagations']:>5} {conf:>6}  {grid}")
        for r in res["jobs"]:
            if r["samples"] > 1:
                print(f"   K={r['stop_after_empty']} samples: {json.dumps(r['samples_detail'])}")

        ct = as_stack(CT_112)
        models = [("tiny", ensure_tiny_model(tmp / "tiny"))]
        if not args.no_medium:
            t = time.perf_counter()
            models.append(("medium", build_medium(args.model_dir or (tmp / "medium"))))
            print(f"\n(medium model built in {time.perf_counter() - t:.1f} s)")
        for name, folder in models:
            res["grounder"].append(grounder_run(name, folder, ct, args.samples))
    print(f"\n== grounder, 64 slices of {CT_112.name}, G = {args.samples} ({res['threads']} thread(s))")
    for r in res["grounder"]:
        g = r["samples"]
        print(f"{r['model']}: {r['parameters'] / 1e6:.1f} M parameters, prompt {r['prompt_tokens']} tokens")
        print(f"  greedy answer (= G=1): prefill {r['greedy_prefill_s']:.2f} s (vision encoder {r['greedy_vision_calls']} "
              f"call, {r['greedy_vision_s']:.2f} s), decode {r['greedy_decode_s']:.2f} s ({r['greedy_tokens']} tokens)")
        print(f"  + samples 2..{g} from its cache: last prompt token {r['samples_prefill_s']:.3f} s "
              f"(vision encoder {r['samples_vision_calls']} calls), decode {r['samples_decode_s']:.2f} s "
              f"({r['samples_tokens']} tokens over {g - 1} rows)")
        print(f"  G copies of the prompt in generate() would start with {r['naive_vision_calls']} vision call over "
              f"{g}×64 images ({r['naive_vision_s']:.2f} s) in a {g}-row prefill of {r['naive_prefill_s']:.2f} s")
        print(f"  ground_samples(G={g}) whole: {r['ground_samples_s']:.2f} s, vision encoder "
              f"{r['ground_samples_vision_calls']} call(s), greedy attempts {r['ground_samples_attempts']}, "
              f"usable answers {r['ground_samples_usable']}/{g}")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"\nwrote {args.json_out}")
    bad = [r for r in res["jobs"] if r["max_encodings_of_a_slice"] > 1
           or (r["samples"] > 1 and not (r["agreement_shape_ok"] and r["agreement_affine_ok"] and r["mask_inside_agreement"]))]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
