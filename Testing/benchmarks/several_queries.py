"""Several queries on one CT: what the shared prompt saves, at a real size.

One query at a time, each query's prompt (the slices, then the query) is prefilled whole before
its answer is decoded. ``QwenVLGrounder.ground_queries`` prefills the slices' part once and each
query runs only its own tokens on top of that cache. Decoding costs the same either way, so this
benchmark times the prefills that differ, with the grounder at a real size and random weights
(the checkpoint ``fullsize.py`` builds under ``$MEDVOL_HOME/bench``) on a CT with at least 64
slices (the real prompt: 64 slices, ~5 200 tokens):

- *alone*: one forward pass over a query's whole prompt (what ``ground`` runs before decoding),
  for each query;
- *shared*: ``_share_prompt`` (one forward over the common part, slices encoded once), then for
  each query one forward of its own tokens on that cache, cut back after each.

It also checks that both ways give the same next-token scores at the prompt's end (random
weights: the scores mean nothing, their agreement and the cost are real).

    python Testing/benchmarks/several_queries.py --queries 3 --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUERIES = ["the liver", "the spleen", "the left kidney", "the gallbladder", "the pancreas", "the aorta"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="grounder checkpoint folder (default $MEDVOL_HOME/bench/"
                                                 "qwen3-vl-2b-random, built by fullsize.py)")
    p.add_argument("--ct", default=str(REPO / "Testing" / "data" / "totalsegmentator" / "example_ct.nii.gz"))
    p.add_argument("--queries", type=int, default=3)
    p.add_argument("--alone", type=int, default=1, help="how many queries to prefill alone (each costs the same; "
                                                        "default 1, the others counted at its time)")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    from medvolcore.grounder import QwenVLGrounder
    from medvolcore.pipeline import as_stack

    if args.threads:
        torch.set_num_threads(args.threads)
    home = Path(os.environ.get("MEDVOL_HOME", Path.home() / ".medvol"))
    model = Path(args.model) if args.model else home / "bench" / "qwen3-vl-2b-random"
    if not (model / "config.json").is_file():
        print(f"no checkpoint in {model}: build one with Testing/benchmarks/fullsize.py first", file=sys.stderr)
        return 2
    queries = QUERIES[: args.queries]
    g = QwenVLGrounder.from_pretrained(model, device="cpu", dtype=torch.float32, settings={"preset": "real"})
    stack = as_stack(args.ct)

    def last_scores(inputs, cache=None):
        """One forward over the prompt (or over its tokens after ``cache``) → the last position's logits."""
        if cache is None:
            batch = dict(inputs, pixel_values=inputs["pixel_values"].to(g.dtype))
        else:
            n = cache.get_seq_length()
            ids = inputs["input_ids"]
            batch = {"input_ids": ids[:, n:], "cache_position": torch.arange(n, ids.shape[1])}
        with torch.inference_mode():
            out = g.model(**batch, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1)
        return out.logits[0, -1].float()

    prompts = [g.build_inputs(stack, q)[0] for q in queries]
    lengths = [int(x["input_ids"].shape[1]) for x in prompts]
    print(f"{model.name}, fp32 on CPU, {torch.get_num_threads()} threads; {len(g.build_inputs(stack, queries[0])[1])} "
          f"shown slices; prompts of {min(lengths)}–{max(lengths)} tokens; {len(queries)} queries", flush=True)

    alone_s, alone_scores = [], []
    for inputs in prompts[: args.alone]:
        t = time.perf_counter()
        alone_scores.append(last_scores(inputs))
        alone_s.append(time.perf_counter() - t)
        print(f"  alone: {alone_s[-1]:.1f} s", flush=True)
    per_alone = sum(alone_s) / len(alone_s)

    t = time.perf_counter()
    shared = g._share_prompt(stack, queries, None)
    share_s = time.perf_counter() - t
    print(f"  shared part: {share_s:.1f} s ({shared.length} tokens, slices encoded once)", flush=True)
    own_s, diffs = [], []
    for i, inputs in enumerate(prompts):
        t = time.perf_counter()
        scores = last_scores(inputs, shared.cache)
        own_s.append(time.perf_counter() - t)
        shared.rewind()
        if i < len(alone_scores):
            diffs.append(float((scores - alone_scores[i]).abs().max()))
        print(f"  query {i + 1}: its own {lengths[i] - shared.length} tokens in {own_s[-1]:.1f} s", flush=True)

    n = len(queries)
    alone_total = per_alone * n
    shared_total = share_s + sum(own_s)
    print(f"\nprefill of {n} queries one at a time: {alone_total:.1f} s ({per_alone:.1f} s each"
          + (", measured once" if args.alone < n else "") + ")")
    print(f"prefill of {n} queries sharing the slices: {shared_total:.1f} s ({share_s:.1f} s once + "
          f"{sum(own_s) / n:.1f} s per query)")
    print(f"saved {alone_total - shared_total:.1f} s ({alone_total / shared_total:.2f}× less prefill); decoding is the "
          "same either way")
    print(f"largest difference of the last position's logits, shared vs alone: {max(diffs):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
