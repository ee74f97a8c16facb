#!/usr/bin/env python3
"""The GPU check on a bare, offline machine (``bash Testing/gpu/device.sh``), in priority order under
one time budget; ``report.json`` is rewritten after each check, so a run stopped at the budget keeps
what it measured.

``cuda``       the device, its memory, a bf16 matrix product (TFLOP/s).
``query4b``    query → 3-D mask for a 300-slice 512×512 CT (the real CT resampled) with Qwen3-VL-4B
               (random weights at its real size, bf16) and MedSAM2 at 512: the grounder's vision,
               prefill and decode timed apart (a child of Testing/benchmarks/fullsize.py), then the
               whole ``medvol segment`` with grounding, propagation, encoder calls; model loading and
               the checkpoint's build reported apart.
``query2b``    the same with Qwen3-VL-2B.
``compile``    MedSAM2 slices/s per object with torch.compile off and on (warm-up reported apart).
``train``      two SFT and two GRPO steps of the 2B with LoRA (Testing/gpu/check.py's checks): finite
               losses, peak memory.
``agreement``  MedSAM2 bf16 vs fp32 (Testing/gpu/check.py's check).

``--small`` runs the same checks at rehearsal sizes (the ``mini`` grounder decoding at most 96 tokens,
a 40-slice 128×128 CT, MedSAM2 at 256) for ``--device cpu``. Exit 0 when every check that ran passed, 1 otherwise, 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "Testing" / "benchmarks"))
sys.path.insert(0, str(HERE))
CHECKS = ("cuda", "query4b", "query2b", "compile", "train", "agreement")
FULL = {"grounders": {"query4b": "qwen3-vl-4b", "query2b": "qwen3-vl-2b", "train": "qwen3-vl-2b"},
        "shape": (512, 512, 300), "image_size": 512, "compile_slices": 64, "max_new_tokens": None}
SMALL = {"grounders": {"query4b": "mini", "query2b": "mini", "train": "mini"},
         "shape": (128, 128, 40), "image_size": 256, "compile_slices": 8, "max_new_tokens": 96}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"device check: error: {message} (see --help)\n")


def parse_args(argv=None):
    p = _Parser(prog="Testing/gpu/device.sh", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all checks together (default 420)")
    p.add_argument("--out", default="gpu-check", help="where report.json goes when $OUT is not set")
    p.add_argument("--only", nargs="+", choices=CHECKS, metavar="CHECK", help=f"run only these ({', '.join(CHECKS)})")
    p.add_argument("--small", action="store_true", help="rehearsal sizes (see below)")
    p.add_argument("--dry-run", action="store_true", help="list the checks, run nothing")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget <= 0:
        p.error(f"--budget must be positive, got {args.budget:g}")
    args.out = Path(os.environ.get("OUT") or args.out)
    args.checks = [c for c in CHECKS if c in (args.only or CHECKS)]
    args.sizes = SMALL if args.small else FULL
    return args


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _peak_gb(device):
    import torch

    return round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if device == "cuda" else None


# ---- the checks (each runs in its own child process) ---------------------------------------


def run_cuda(args, work: Path) -> dict:
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            return {"status": "FAIL", "detail": "torch sees no CUDA GPU"}
        prop = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info = {"name": prop.name, "total_gb": round(total / 2 ** 30, 1), "free_gb": round(free / 2 ** 30, 1),
                "multiprocessors": prop.multi_processor_count, "cuda": torch.version.cuda,
                "bf16": torch.cuda.is_bf16_supported()}
        n = 8192
    else:
        info = {"name": "cpu", "threads": torch.get_num_threads()}
        n = 512
    a = torch.randn(n, n, device=args.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=args.device, dtype=torch.bfloat16)
    (a @ b).sum().item()
    _sync(args.device)
    t0 = time.perf_counter()
    for _ in range(5):
        c = a @ b
    _sync(args.device)
    s = (time.perf_counter() - t0) / 5
    ok = bool(torch.isfinite(c.float()).all())
    info["bf16_matmul_tflops"] = round(2 * n ** 3 / s / 1e12, 2)
    return {"status": "PASS" if ok else "FAIL", "torch": torch.__version__, **info,
            "detail": f"{info['name']}, bf16 {n}³ matmul {info['bf16_matmul_tflops']} TFLOP/s"}


def _ct(args, work: Path) -> tuple:
    """The real CT and its labels resampled to the check's shape (built once)."""
    import nibabel as nib
    import numpy as np
    from scipy import ndimage

    import fullsize

    shape = args.sizes["shape"]
    paths = (work / f"ct_{'x'.join(map(str, shape))}.nii.gz", work / f"labels_{'x'.join(map(str, shape))}.nii.gz")
    if all(p.is_file() for p in paths):
        return paths
    ct, lab = nib.load(str(fullsize.CT)), nib.load(str(fullsize.LABELS))
    zoom = [t / s for t, s in zip(shape, ct.shape)]
    a = ndimage.zoom(np.asarray(ct.dataobj, dtype=np.float32), zoom, order=1)
    lb = ndimage.zoom(np.asarray(lab.dataobj), zoom, order=0)
    aff = ct.affine.copy()
    aff[:3, :3] = ct.affine[:3, :3] / np.asarray(zoom)  # the same field of view, smaller voxels
    nib.save(nib.Nifti1Image(np.round(a).astype(np.int16), aff), str(paths[0]))
    nib.save(nib.Nifti1Image(lb.astype(np.uint8), aff), str(paths[1]))
    return paths


def _checkpoint(name: str, work: Path) -> tuple:
    import fullsize

    folder = fullsize.checkpoint_dir(work / "models", name)
    if fullsize.is_built(folder, name):
        return folder, 0.0
    return folder, fullsize.build_checkpoint(name, folder)


def run_query(args, work: Path, check: str) -> dict:
    import fullsize

    name = args.sizes["grounders"][check]
    folder, build_s = _checkpoint(name, work)
    ct, labels = _ct(args, work)
    env = dict(os.environ)
    models = json.loads(fullsize.models_json(work / f"models-{name}.json", {name: folder}).read_text())
    preset = models["presets"][f"bench-{name}"]
    preset["medsam2"]["image_size"] = args.sizes["image_size"]
    budget = args.sizes["max_new_tokens"]  # None: the grounder's own (256); the rehearsal decodes fewer
    if budget:
        preset["settings"]["max_new_tokens"] = budget
    (work / f"models-{name}.json").write_text(json.dumps(models))
    env["MEDVOL_MODELS_JSON"] = str(work / f"models-{name}.json")
    ground = fullsize.run_child("ground", ["--folder", folder, "--dtype", "bf16", "--ct", ct, "--device",
                                           args.device] + (["--max-new-tokens", budget] if budget else []), env)
    prop = fullsize.run_child("medsam2", ["--ct", ct, "--labels", labels, "--device", args.device,
                                          "--image-size", args.sizes["image_size"]], env)
    e2e = fullsize.run_e2e(f"bench-{name}", ct, args.device, env, work)
    # random weights may answer with boxes of zero width every time: then the whole command has no
    # mask, and grounding + propagation (timed apart above) stand for it
    unusable = "no usable answer" in str(e2e.get("error", ""))
    ok = "error" not in ground and "error" not in prop and ("error" not in e2e or unusable)
    nan = float("nan")
    est = ground.get("prefill_s", nan) + ground.get("decode_s", nan) + prop.get("seconds", nan)
    detail = (f"{name}: grounding vision {ground.get('vision_s', nan):.2f} s, prefill {ground.get('prefill_s', nan):.2f} s, "
              f"decode {ground.get('decode_s', nan):.2f} s ({ground.get('new_tokens')} tokens); propagation "
              f"{prop.get('slices')} slices {prop.get('seconds', nan):.2f} s ({prop.get('encoder_calls')} encoder calls); "
              f"sum {est:.2f} s; ")
    detail += (f"medvol segment excl. load {e2e['segment_excl_load_s']:.2f} s ({e2e.get('encoder_calls')} encoder calls, "
               f"{e2e.get('attempts')} attempt(s))" if "error" not in e2e else
               "medvol segment: no usable random answer" if unusable else f"medvol segment: {e2e['error']}")
    detail += f"; load {ground.get('load_s', nan):.1f} + {prop.get('load_s', nan):.1f} s, build {build_s:.0f} s"
    if "error" in ground or "error" in prop:
        detail = f"{name}: {ground.get('error') or prop.get('error')}"
    return {"status": "PASS" if ok else "FAIL", "detail": detail, "grounder": name, "build_s": build_s,
            "ct_shape": list(args.sizes["shape"]), "ground_plus_propagate_s": est, "grounding": ground,
            "propagation": prop, "query_to_mask": e2e}


def run_compile(args, work: Path) -> dict:
    import numpy as np
    import torch

    from medvolcore.anchor import anchor_from_mask
    from medvolcore.propagation import MedSAM2Propagator
    from medvolcore.stack import AxialStack
    from medvolcore.volume import label_mask, load_label_map, load_volume

    import fullsize

    ct, labels = _ct(args, work)
    stack = AxialStack(load_volume(ct))
    lab = load_label_map(labels)
    anchor = anchor_from_mask(AxialStack(lab).to_stack(label_mask(lab, fullsize.KIDNEY_RIGHT)), stack=stack)
    data = np.ascontiguousarray(stack.data, dtype=np.float32)
    window = args.sizes["compile_slices"] // 2
    out = {}
    for mode in ("eager", "compiled"):
        prop = MedSAM2Propagator.from_random(0, image_size=args.sizes["image_size"], device=args.device)
        prop.compile = mode == "compiled"
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        # warm-up: the same slices once (the compiled encoder is built, and rebuilt for any new shape)
        prop.propagate(data, anchor.slice, anchor.boxes, window=window, stop_after_empty=0)
        _sync(args.device)
        warm = time.perf_counter() - t0
        r = prop.propagate(data, anchor.slice, anchor.boxes, window=window, stop_after_empty=0)
        _sync(args.device)
        out[mode] = {"warmup_s": round(warm, 2), "slices": r.slices_propagated, "seconds": round(r.seconds, 3),
                     "slices_per_s": round(r.slices_propagated / r.seconds, 1), "encoder_calls": r.encoder_calls,
                     "cuda_peak_gb": _peak_gb(args.device)}
        del prop
    e, c = out["eager"], out["compiled"]
    detail = (f"{e['slices_per_s']} slices/s eager, {c['slices_per_s']} compiled (warm-up {e['warmup_s']} s vs "
              f"{c['warmup_s']} s) at {args.sizes['image_size']}, 1 object")
    return {"status": "PASS", "detail": detail, **out}


def run_train(args, work: Path) -> dict:
    import check

    name = args.sizes["grounders"]["train"]
    folder, build_s = _checkpoint(name, work)
    check._model_2b = lambda _a, _c: folder  # the model is this check's (mini in the rehearsal)
    cargs = argparse.Namespace(out=work / "train")
    cargs.out.mkdir(parents=True, exist_ok=True)
    ctx = {"model_dir": str(work / "models")}
    res = {}
    for stage, fn in (("sft", check.check_sft), ("grpo", check.check_grpo)):
        r = fn(cargs, ctx)
        summary = check._train_summary(cargs.out / f"{stage}-run")
        r["losses"] = [h.get("loss") for h in summary.get("loss_history", []) if h.get("loss") is not None]
        r["peak"] = {k: v for k, v in summary.items() if "peak" in k or "memory" in k}
        res[stage] = r
        if r["status"] != "PASS":
            break
    ok = all(r["status"] == "PASS" for r in res.values()) and len(res) == 2
    return {"status": "PASS" if ok else "FAIL", "grounder": name,
            "detail": "; ".join(f"{k}: {v['detail']}" for k, v in res.items()), **res}


def run_agreement(args, work: Path) -> dict:
    import check

    code = check.AGREEMENT.replace('device="cuda"', f'device="{args.device}"').replace(
        "image_size=512", f"image_size={args.sizes['image_size']}")
    p = subprocess.run([sys.executable, "-c", code, str(check.REAL / "example_ct.nii.gz"),
                        str(check.REAL / "example_seg_fast_force_split.nii.gz")], capture_output=True, text=True,
                       cwd=REPO)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    if p.returncode != 0 or not lines:
        return {"status": "FAIL", "detail": (p.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    r = json.loads(lines[-1])
    ok = r["key_dice"] >= 0.95 and r["volume_dice"] >= 0.5
    note = "" if args.device == "cuda" else " (the CPU runs fp32 both times)"
    return {"status": "PASS" if ok else "FAIL", **r,
            "detail": f"Dice key slice {r['key_dice']:.4f}, volume {r['volume_dice']:.4f}{note}"}


RUNNERS = {"cuda": run_cuda, "query4b": lambda a, w: run_query(a, w, "query4b"),
           "query2b": lambda a, w: run_query(a, w, "query2b"), "compile": run_compile, "train": run_train,
           "agreement": run_agreement}


def child(args) -> int:
    work = Path(args.work)
    t0 = time.perf_counter()
    try:
        r = RUNNERS[args.child](args, work)
    except Exception as e:  # noqa: BLE001 - one failed check; the next ones still run
        r = {"status": "FAIL", "detail": f"{type(e).__name__}: {e}"[:400]}
    r["seconds"] = round(time.perf_counter() - t0, 2)
    (work / f"{args.child}.json").write_text(json.dumps(r, default=str))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    sizes = args.sizes
    plan = {"cuda": "device, memory, bf16 matmul",
            "query4b": f"{sizes['grounders']['query4b']} + MedSAM2 {sizes['image_size']}, CT {sizes['shape']}",
            "query2b": f"{sizes['grounders']['query2b']} + MedSAM2 {sizes['image_size']}, CT {sizes['shape']}",
            "compile": f"MedSAM2 {sizes['image_size']} slices/s, torch.compile off and on",
            "train": f"2 SFT + 2 GRPO steps, {sizes['grounders']['train']} with LoRA",
            "agreement": f"MedSAM2 {sizes['image_size']} bf16 vs fp32"}
    if args.dry_run:
        print(f"device check (dry run): device {args.device}, budget {args.budget:g} s, report {args.out / 'report.json'}")
        for c in args.checks:
            print(f"  {c:<10} {plan[c]}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for c in RUNNERS:  # what an earlier run left here is never reported as this run's
        (args.out / f"{c}.log").unlink(missing_ok=True)
    (args.out / "report.json").unlink(missing_ok=True)
    # a fresh folder per run, outside $OUT (which then holds only this run's report and logs)
    work = Path(tempfile.mkdtemp(prefix="medvol-device-check-"))
    try:
        return _run(args, plan, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args, plan: dict, work: Path) -> int:
    start = time.perf_counter()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": args.device,
              "budget_s": args.budget, "small": args.small, "checks": {}}
    for c in args.checks:
        left = args.budget - (time.perf_counter() - start)
        if left < 5:
            report["checks"][c] = {"status": "NOT RUN", "detail": "budget spent"}
            continue
        print(f"- {c} ({plan[c]}), {left:.0f} s left …", flush=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", c, "--work", str(work),
               "--device", args.device, "--budget", str(args.budget)] + (["--small"] if args.small else [])
        t0 = time.perf_counter()
        with open(args.out / f"{c}.log", "w") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
            try:
                p.wait(timeout=left)
                found = (work / f"{c}.json").is_file()
                if p.returncode == 0 and found:
                    res = json.loads((work / f"{c}.json").read_text())
                else:  # a crashed check is FAIL, whatever it wrote before it died
                    res = {"status": "FAIL", "detail": f"exit {p.returncode}, "
                                                       f"{'a result written before it' if found else 'no result'} "
                                                       f"(see {c}.log)"}
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
                res = {"status": "TIMEOUT", "detail": f"stopped at the budget after {time.perf_counter() - t0:.0f} s"}
        res.setdefault("seconds", round(time.perf_counter() - t0, 2))
        report["checks"][c] = res
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"  {res['status']} in {res['seconds']:.0f} s: {res.get('detail', '')}", flush=True)
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\n{'check':<10} {'status':<8} {'seconds':>8}")
    for c, r in report["checks"].items():
        print(f"{c:<10} {r['status']:<8} {r.get('seconds', 0):>8.1f}")
    print(f"report: {args.out / 'report.json'} ({report['elapsed_s']:.0f} s of {args.budget:g})")
    return 0 if all(r["status"] == "PASS" for r in report["checks"].values() if r["status"] != "NOT RUN") else 1


if __name__ == "__main__":
    sys.exit(main())
