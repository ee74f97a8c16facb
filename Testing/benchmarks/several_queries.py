"""Several queries on one CT: one at a time (``ground`` per query) against ``ground_queries`` (the
slices' part of the prompt rendered, encoded and prefilled once, each query continuing from it).

Runs the grounder at a real size with random weights (the checkpoint ``fullsize.py`` builds under
``$MEDVOL_HOME/bench``) on a CT with at least 64 slices, so the prompt is the real one (64 slices,
~4 300 tokens). Prints the seconds of each way, the shared prefill and whether the answers agree
(random weights: the answers are meaningless, the cost is real). Speed is the point here, not the
answers: both ways decode the same number of tokens.

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
    p.add_argument("--max-new-tokens", type=int, default=100)
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
    inputs, shown = g.build_inputs(stack, queries[0])
    print(f"{model.name}, fp32 on CPU, {torch.get_num_threads()} threads; {len(shown)} shown slices, prompt of "
          f"{inputs['input_ids'].shape[1]} tokens; {len(queries)} queries, {args.max_new_tokens} new tokens at most",
          flush=True)
    kw = dict(max_new_tokens=args.max_new_tokens, retries=0)

    t = time.perf_counter()
    alone = []
    for q in queries:
        try:
            alone.append(g.ground(stack, q, **kw))
        except Exception as e:  # noqa: BLE001 - a random model's answer may be unusable; its cost still counts
            alone.append(e)
    alone_s = time.perf_counter() - t
    t = time.perf_counter()
    try:
        shared = [s.greedy for s in g.ground_queries(stack, queries, **kw)]
    except Exception as e:  # noqa: BLE001
        shared = [e] * len(queries)
    shared_s = time.perf_counter() - t
    same = sum(1 for a, s in zip(alone, shared) if not isinstance(a, Exception) and not isinstance(s, Exception)
               and a.raw_text == s.raw_text)
    first = shared[0] if not isinstance(shared[0], Exception) else None
    print(f"one query at a time: {alone_s:.1f} s ({alone_s / len(queries):.1f} s per query)")
    print(f"ground_queries:      {shared_s:.1f} s ({shared_s / len(queries):.1f} s per query); shared prefill "
          f"{first.timings['shared_prefill_s']:.1f} s of {first.timings['shared_prompt_tokens']} tokens"
          if first else f"ground_queries:      {shared_s:.1f} s")
    print(f"saved {alone_s - shared_s:.1f} s ({100 * (1 - shared_s / alone_s):.0f} %); identical answers: "
          f"{same} of {len(queries)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
