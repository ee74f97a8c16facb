#!/usr/bin/env python3
"""Benchmark of the main job, ``Pipeline.segment``: per-stage time and peak memory.

For each preset whose weights are present (``tiny`` always is: it is built locally), it runs
``segment`` twice on one loaded pipeline — the second call shows the cost without any model
loading — and prints model load times, grounding (prefill, decode), propagation and total
seconds, and peak memory (process RSS; CUDA peak on a GPU).

    .venv/bin/python Testing/benchmarks/segment.py [--volume CT] [--query Q] [--presets tiny qwen3-vl-4b] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_preset(name, volume, query, device):
    from medvolcore.errors import MedVolError
    from medvolcore.pipeline import Pipeline, as_stack

    try:
        pipe = Pipeline(name, device=device)
    except MedVolError as e:
        return {"preset": name, "skipped": str(e)}
    stack = as_stack(volume)
    t = time.perf_counter()
    pipe.load()
    load_s = time.perf_counter() - t
    rows = []
    for call in (1, 2):
        t = time.perf_counter()
        seg = pipe.segment(stack, query)
        rows.append({"call": call, "wall_s": time.perf_counter() - t,
                     **{k: v for k, v in seg.timings.items() if isinstance(v, (int, float))},
                     "slice": seg.anchor.slice, "boxes": len(seg.anchor.boxes)})
    res = {"preset": name, "smoke": pipe.smoke, "device": device, "load_s": load_s, "load_detail_s": pipe.load_seconds,
           "calls": rows, "peak_rss_mb": peak_rss_mb()}
    if device.startswith("cuda"):
        import torch

        res["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return res


def main(argv=None) -> int:
    from medvolcore.resources import load_json, resource_path

    sample = load_json("samples", "samples.json")["demo"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--volume", default=str(resource_path("samples", sample["file"])))
    ap.add_argument("--query", default=sample["query"])
    ap.add_argument("--presets", nargs="+", default=["tiny", "qwen3-vl-2b", "qwen3-vl-4b"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)

    results = []
    for name in args.presets:
        print(f"preset {name} …", file=sys.stderr, flush=True)
        results.append(bench_preset(name, args.volume, args.query, args.device))
    print(f"volume {Path(args.volume).name}, query {args.query!r}, device {args.device}")
    print(f"{'preset':12s} {'call':>4s} {'wall s':>7s} {'prefill':>8s} {'decode':>7s} {'tokens':>6s} "
          f"{'propag.':>8s} {'s/slice':>8s} {'load s':>7s} {'peak MB':>8s}")
    for r in results:
        if "skipped" in r:
            print(f"{r['preset']:12s} skipped: {r['skipped']}")
            continue
        for c in r["calls"]:
            print(f"{r['preset']:12s} {c['call']:4d} {c['wall_s']:7.2f} {c.get('ground_prefill_s', float('nan')):8.2f} "
                  f"{c.get('ground_decode_s', float('nan')):7.2f} {int(c.get('ground_new_tokens', 0)):6d} "
                  f"{c.get('propagate_s', float('nan')):8.2f} {c.get('propagate_s_per_slice', float('nan')):8.3f} "
                  f"{r['load_s'] if c['call'] == 1 else 0.0:7.2f} {r['peak_rss_mb']:8.0f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
