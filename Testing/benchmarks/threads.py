#!/usr/bin/env python3
"""`medvol demo` beside busy processes: the default thread rule against fixed thread counts.

    .venv/bin/python Testing/benchmarks/threads.py [--busy 2] [--repeat 1] [--json-out FILE]

Each run is a whole `medvol demo` process (imports, model loading, grounding, propagation,
writing), timed by wall clock, while ``--busy`` other processes spin on the CPU (pure Python
loops, started before the demo and killed after it), then once more with none. Settings:

* ``auto``: no ``--threads``, no ``OMP_NUM_THREADS`` (the default a user gets: medvolcore.cpu's rule);
* ``1``: ``--threads 1``;
* ``all``: ``--threads`` = the number of CPUs, which is PyTorch's own default (the behaviour before
  the rule).

Goal: beside two busy processes on a 2-core machine, ``auto`` within 1.5× of ``1``. Prints a
table and what the rule chose (the demo's ``threads_rule``); exits 1 when the goal is missed.
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

SPIN = "import time\nt = time.time()\nwhile time.time() - t < 3600: pass\n"


def run_demo(threads, out_dir: Path, env: dict) -> dict:
    cmd = [sys.executable, "-m", "medvolcore.cli", "demo", "--out-dir", str(out_dir), "--overwrite",
           "--no-progress", "--json"]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"medvol demo failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    res = json.loads(p.stdout)
    return {"wall_s": round(wall, 2), "threads": res.get("threads"), "rule": res.get("threads_rule")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="busy processes beside the demo (default 2)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per setting; the fastest is reported")
    ap.add_argument("--json-out", help="write the figures here")
    args = ap.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    settings = [("auto", None), ("1", 1), ("all", ncpu)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for busy in (args.busy, 0):
            for name, threads in settings:
                best = None
                for _ in range(args.repeat):
                    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
                    try:
                        time.sleep(0.5)
                        r = run_demo(threads, Path(tmp) / "demo", env)
                    finally:
                        for s in spinners:
                            s.kill()
                            s.wait()
                    best = r if best is None or r["wall_s"] < best["wall_s"] else best
                rows.append(dict(best, busy=busy, setting=name))
                print(f"busy {busy}  --threads {name:4s}  {best['wall_s']:7.1f} s  ({best['rule']})", flush=True)
    by = {(r["busy"], r["setting"]): r["wall_s"] for r in rows}
    ratio = by[(args.busy, "auto")] / by[(args.busy, "1")]
    collapse = by[(args.busy, "all")] / by[(args.busy, "1")]
    print(f"\n{ncpu} CPU(s). Beside {args.busy} busy process(es): auto / 1 thread = {ratio:.2f}× (goal ≤ 1.5); "
          f"all CPUs (PyTorch's default) / 1 thread = {collapse:.2f}×")
    print(f"Idle: auto {by[(0, 'auto')]:.1f} s, 1 thread {by[(0, '1')]:.1f} s, all CPUs {by[(0, 'all')]:.1f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"cpus": ncpu, "rows": rows, "auto_over_1": ratio,
                                                   "all_over_1": collapse}, indent=1), encoding="utf-8")
    return 0 if ratio <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
