#!/usr/bin/env python3
"""The one-command GPU check (``bash Testing/gpu/run.sh``): everything this project says about CUDA.

Checks, in order (``--only`` / ``--skip`` choose; each runs in its own process):

``fullsize``   Testing/benchmarks/fullsize.py on CUDA in bf16: Qwen3-VL-2B/-4B (random weights,
               real sizes) load, vision encoding, prefill, decode tokens/s; MedSAM2 at 512 per
               slice on the 112-slice CT and a 300-slice stack; ``medvol segment`` end to end on
               both. Fails when a part fails. Target (reported, fails only with
               ``--strict-goals``): a 300-slice CT end to end, model loading excluded, < 10 s.
``decoding``   the grounder's constrained decoding at full size (from ``fullsize``): the answer of
               every size follows the answer format and names a shown slice (with random weights
               greedy decoding may repeat one digit, so zero-width boxes are reported, not failed).
``agreement``  MedSAM2 (random weights, 512) on the 112-slice CT in bf16 autocast vs fp32 on the
               GPU: Dice on the key slice (no tracking: must be ≥ ``--min-dice``) and over the
               volume (tracking amplifies rounding; must be ≥ ``--min-volume-dice``).
``sft``        ``medvol-train prepare`` on the real CT, then two SFT steps of a random-weight
               Qwen3-VL-2B with LoRA (bf16): finite loss, an adapter written.
``grpo``       two GRPO steps from that adapter, with MedSAM2 (random weights, 512) scoring the
               consistency reward on the GPU: finite figures, an adapter written.
``zero2``      ``accelerate launch --config_file Training/configs/accelerate_zero2.yaml
               --num_processes 1 -m medvoltrain sft …``, two steps (needs ``deepspeed``:
               ``pip install 'medvoltrain[deepspeed]'``; the bootstrap installs it on GPU machines).

It prints one table (check, status, figures, seconds) and exits 1 when a check failed, 0 otherwise;
2 for bad arguments. Outputs go to ``--out`` (default ``gpu-check/``; ``report.json`` holds every
figure). On a machine where torch sees no CUDA GPU it says so and exits 0 after checking its
arguments and printing its plan (a dry run; ``--dry-run`` does the same anywhere).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKS = ("fullsize", "decoding", "agreement", "sft", "grpo", "zero2")
SIZES = ("2b", "4b")
TARGET_S = 10.0  # the GPU target (docs/benchmarks.md): 300 slices end to end, loading excluded
REAL = Path(os.environ.get("MEDVOL_REAL_DATA", REPO / "Testing" / "data")) / "totalsegmentator"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        self.exit(2, f"gpu check: error: {message} (see --help)\n")


def parse_args(argv=None):
    p = _Parser(prog="Testing/gpu/run.sh", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), help="grounder sizes for fullsize (default: 2b 4b)")
    p.add_argument("--only", nargs="+", metavar="CHECK", help=f"run only these checks ({', '.join(CHECKS)})")
    p.add_argument("--skip", nargs="+", metavar="CHECK", default=[], help="skip these checks")
    p.add_argument("--out", default="gpu-check", help="output folder (default gpu-check/)")
    p.add_argument("--min-dice", type=float, default=0.95, help="bf16 vs fp32 Dice on the key slice (default 0.95)")
    p.add_argument("--min-volume-dice", type=float, default=0.5,
                   help="bf16 vs fp32 Dice over the volume, random weights (default 0.5)")
    p.add_argument("--strict-goals", action="store_true", help="fail when the < 10 s target is missed")
    p.add_argument("--dry-run", action="store_true", help="check the arguments, print the plan, run nothing")
    args = p.parse_args(argv)
    for group, name in ((args.only or [], "--only"), (args.skip, "--skip")):
        bad = [c for c in group if c not in CHECKS]
        if bad:
            p.error(f"{name}: unknown check(s) {', '.join(bad)}; the checks are {', '.join(CHECKS)}")
    bad = [s for s in args.sizes if s.lower() not in SIZES]
    if bad:
        p.error(f"--sizes: unknown size(s) {', '.join(bad)}; use {' and/or '.join(SIZES)}")
    for name in ("min_dice", "min_volume_dice"):
        v = getattr(args, name)
        if not 0.0 <= v <= 1.0:
            p.error(f"--{name.replace('_', '-')} must be between 0 and 1, got {v}")
    args.checks = [c for c in (args.only or CHECKS) if c not in args.skip]
    if "decoding" in args.checks and "fullsize" not in args.checks:
        p.error("the decoding check reads the fullsize check's answers: keep fullsize, or skip decoding")
    if "grpo" in args.checks and "sft" not in args.checks:
        p.error("the grpo check starts from the sft check's adapter: keep sft, or skip grpo")
    if not args.checks:
        p.error("no check left to run")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {out} is a file, not a folder")
    args.out = out
    return args


def plan_lines(args) -> list:
    lines = [f"checks: {', '.join(args.checks)}", f"outputs: {args.out.resolve()}"]
    if "fullsize" in args.checks:
        lines.append(f"fullsize: Qwen3-VL {', '.join(s.upper() for s in args.sizes)} bf16 on CUDA + MedSAM2 at 512 on "
                     f"112 and 300 slices; target: 300 slices end to end < {TARGET_S:g} s (load excluded)")
    if "agreement" in args.checks:
        lines.append(f"agreement: key-slice Dice ≥ {args.min_dice}, volume Dice ≥ {args.min_volume_dice}")
    return lines


# ---- the checks ----------------------------------------------------------------------------


def _run(cmd, log: Path, env=None, timeout=None) -> tuple:
    """Run ``cmd`` with its output in ``log``; (exit code, seconds, last line)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return code, time.perf_counter() - t0, (lines[-1] if lines else "")[:200]


def check_fullsize(args, ctx) -> dict:
    out = args.out / "fullsize.json"
    code, secs, last = _run([sys.executable, REPO / "Testing/benchmarks/fullsize.py", "--device", "cuda", "--dtypes",
                             "bf16", "--sizes", *args.sizes, "--stacks", "112", "300", "--e2e", "112", "300",
                             "--model-dir", ctx["model_dir"], "--json-out", out], args.out / "fullsize.log")
    res = json.loads(out.read_text()) if out.is_file() else {}
    ctx["fullsize"] = res
    e2e300 = [r for r in res.get("e2e", []) if r.get("slices") == 300 and "segment_excl_load_s" in r]
    figures = "; ".join(f"{r['size']} 300 slices {r['segment_excl_load_s']:.1f} s excl. load" for r in e2e300)
    status = "PASS" if code == 0 and not res.get("skipped") else "FAIL"
    detail = figures or last
    goal = None
    if e2e300:
        best = min(r["segment_excl_load_s"] for r in e2e300)
        goal = best < TARGET_S
        detail += f"; target < {TARGET_S:g} s {'met' if goal else 'NOT met'}"
        if args.strict_goals and not goal:
            status = "FAIL"
    if res.get("skipped"):
        detail += "; " + "; ".join(res["skipped"])
    return {"status": status, "detail": detail, "seconds": secs, "goal_met": goal}


def check_decoding(args, ctx) -> dict:
    rows = (ctx.get("fullsize") or {}).get("ground", [])
    if not rows:
        return {"status": "FAIL", "detail": "fullsize produced no grounder answer", "seconds": 0.0}
    # the grammar's promise is the format and a shown slice; random weights decoding greedily may
    # still draw boxes of zero width (reported, not failed)
    bad = [r["size"] for r in rows if r.get("error") or not r.get("answer_format_ok")]
    detail = "; ".join(f"{r['size']}: {r.get('new_tokens')} tokens, {_num(r.get('decode_tokens_per_s'))} tok/s, "
                       f"{'format ok' if r.get('answer_format_ok') else 'FORMAT BROKEN'}"
                       f"{'' if r.get('answer_parsed') else ' (boxes degenerate)'}" for r in rows)
    return {"status": "FAIL" if bad else "PASS", "detail": detail, "seconds": 0.0}


def _num(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


AGREEMENT = r'''
import json, sys, numpy as np, torch
from medvolcore.anchor import anchor_from_mask
from medvolcore.metrics import dice
from medvolcore.propagation import MedSAM2Propagator
from medvolcore.stack import AxialStack
from medvolcore.volume import label_mask, load_label_map, load_volume
ct, labels = sys.argv[1], sys.argv[2]
stack = AxialStack(load_volume(ct))
lab = load_label_map(labels)
anchor = anchor_from_mask(AxialStack(lab).to_stack(label_mask(lab, 2)), stack=stack)
prop = MedSAM2Propagator.from_random(0, image_size=512, device="cuda")
data = np.ascontiguousarray(stack.data, dtype=np.float32)
out = {}
for name, bf16 in (("bf16", True), ("fp32", False)):
    prop.cuda_bf16 = bf16
    r = prop.propagate(data, anchor.slice, anchor.boxes, stop_after_empty=0)
    out[name] = r.mask.astype(bool)
k = anchor.slice
print(json.dumps({"key_dice": float(dice(out["bf16"][k], out["fp32"][k])),
                  "volume_dice": float(dice(out["bf16"], out["fp32"])),
                  "voxels": [int(out["bf16"].sum()), int(out["fp32"].sum())]}))
'''


def check_agreement(args, ctx) -> dict:
    log = args.out / "agreement.log"
    code, secs, last = _run([sys.executable, "-c", AGREEMENT, REAL / "example_ct.nii.gz",
                             REAL / "example_seg_fast_force_split.nii.gz"], log)
    if code != 0:
        return {"status": "FAIL", "detail": last, "seconds": secs}
    r = json.loads(last)
    ok = r["key_dice"] >= args.min_dice and r["volume_dice"] >= args.min_volume_dice
    return {"status": "PASS" if ok else "FAIL", "seconds": secs, **r,
            "detail": f"Dice key slice {r['key_dice']:.4f}, volume {r['volume_dice']:.4f} "
                      f"({r['voxels'][0]} vs {r['voxels'][1]} voxels)"}


def _training_data(args, ctx) -> Path:
    if "data" in ctx:
        return ctx["data"]
    d = args.out / "train-data"
    manifest = args.out / "train-cases.jsonl"
    rows = [{"id": "ts_train", "volume": str(REAL / "example_ct.nii.gz"),
             "labels": str(REAL / "example_seg_fast_force_split.nii.gz"),
             "targets": {"liver": 5, "kidneys": [2, 3], "spleen": 1}, "split": "train"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, last = _run([sys.executable, "-m", "medvoltrain", "prepare", "--manifest", manifest, "--out", d,
                          "--no-progress"], args.out / "prepare.log")
    if code != 0:
        raise RuntimeError(f"medvol-train prepare failed: {last}")
    ctx["data"] = d
    return d


def _model_2b(args, ctx) -> Path:
    """The random-weight Qwen3-VL-2B checkpoint (built by fullsize, or here)."""
    sys.path.insert(0, str(REPO / "Testing" / "benchmarks"))
    import fullsize  # noqa: E402 - the benchmark owns the builder

    folder = fullsize.checkpoint_dir(Path(ctx["model_dir"]), "qwen3-vl-2b")
    if not fullsize.is_built(folder, "qwen3-vl-2b"):
        fullsize.build_checkpoint("qwen3-vl-2b", folder)
    return folder


def _train_summary(run: Path) -> dict:
    try:
        return json.loads((run / "training.json").read_text())
    except (OSError, ValueError):
        return {}


def _training_check(args, ctx, stage: str, cmd_prefix: list, extra: list, run: Path, log: str) -> dict:
    data = _training_data(args, ctx)
    model = _model_2b(args, ctx)
    code, secs, last = _run(cmd_prefix + [stage, "--data", data, "--output", run, "--max-steps", "2", "--overwrite",
                                          *extra, f"model_path={model}", "logging_steps=1", "save_steps=1000"],
                            args.out / log)
    s = _train_summary(run)
    losses = [h.get("loss") for h in s.get("loss_history", []) if h.get("loss") is not None]
    finite = bool(losses) and all(math.isfinite(v) for v in losses)
    adapter = (run / "adapter" / "adapter_config.json").is_file()
    ok = code == 0 and s.get("global_step") == 2 and adapter and (finite or stage == "grpo")
    detail = (f"{s.get('global_step')} steps, {_num(s.get('seconds_per_step'), '{:.2f}')} s/step, "
              f"loss {losses}, adapter {'written' if adapter else 'MISSING'}") if s else last
    return {"status": "PASS" if ok else "FAIL", "detail": detail, "seconds": secs, "summary_keys": sorted(s)}


def check_sft(args, ctx) -> dict:
    run = args.out / "sft-run"
    r = _training_check(args, ctx, "sft", [sys.executable, "-m", "medvoltrain"], [], run, "sft.log")
    ctx["sft_adapter"] = run / "adapter"
    return r


def check_grpo(args, ctx) -> dict:
    return _training_check(args, ctx, "grpo", [sys.executable, "-m", "medvoltrain"],
                           ["--adapter", ctx["sft_adapter"], "--random-weights", "0"], args.out / "grpo-run",
                           "grpo.log")


def check_zero2(args, ctx) -> dict:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return {"status": "FAIL", "seconds": 0.0,
                "detail": "deepspeed is not installed: pip install 'medvoltrain[deepspeed]' (then run this check again)"}
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    if not accelerate:
        return {"status": "FAIL", "seconds": 0.0, "detail": "accelerate's command is not installed"}
    prefix = [accelerate, "launch", "--config_file", REPO / "Training/configs/accelerate_zero2.yaml",
              "--num_processes", "1", "-m", "medvoltrain"]
    return _training_check(args, ctx, "sft", prefix, [], args.out / "zero2-run", "zero2.log")


RUNNERS = {"fullsize": check_fullsize, "decoding": check_decoding, "agreement": check_agreement,
           "sft": check_sft, "grpo": check_grpo, "zero2": check_zero2}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.dry_run or not torch.cuda.is_available():
        if not torch.cuda.is_available():
            print("gpu check: no CUDA GPU here (torch.cuda.is_available() is False, torch "
                  f"{torch.__version__}); nothing was run. Dry run of the plan:")
        else:
            print("gpu check: dry run, nothing was run. Plan:")
        for line in plan_lines(args):
            print("  " + line)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    from medvolcore.models.tiny import medvol_home

    ctx = {"model_dir": os.environ.get("MEDVOL_BENCH_DIR") or str(medvol_home() / "bench")}
    name = torch.cuda.get_device_name(0)
    print(f"gpu check on {name} (torch {torch.__version__}, CUDA {torch.version.cuda}, bf16 "
          f"{'supported' if torch.cuda.is_bf16_supported() else 'NOT supported'}); logs in {args.out}", flush=True)
    results = {}
    for check in args.checks:
        print(f"- {check} …", flush=True)
        try:
            r = RUNNERS[check](args, ctx)
        except Exception as e:  # noqa: BLE001 - a check that breaks is a failed check, the others still run
            r = {"status": "FAIL", "detail": f"{type(e).__name__}: {e}"[:300], "seconds": 0.0}
        results[check] = r
        print(f"  {r['status']}: {r['detail']}", flush=True)
    print(f"\n{'check':<10} {'status':<6} {'seconds':>8}  figures")
    for check, r in results.items():
        print(f"{check:<10} {r['status']:<6} {r['seconds']:>8.1f}  {r['detail']}")
    report = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": time.strftime("%Y-%m-%d"), "checks": results}
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    failed = [c for c, r in results.items() if r["status"] == "FAIL"]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
