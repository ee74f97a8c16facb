#!/usr/bin/env python3
"""Full-size cost benchmark: Qwen3-VL-2B/-4B and MedSAM2 at their real sizes, with random weights.

    .venv/bin/python Testing/benchmarks/fullsize.py [--sizes 2b 4b] [--dtypes fp32 bf16]
        [--stacks 112 300] [--device cpu|cuda] [--e2e 112 300] [--model-dir DIR]
        [--json-out FILE] [--dry-run]

Random weights cost exactly what trained ones do, so the figures are the real models' costs
(the answers are meaningless). Nothing is downloaded: the grounders are built from the published
configs' numbers (``Resources/benchmarks/qwen3_vl_configs.json``, with their source) with seeded
random weights, saved once as a bf16 safetensors checkpoint under ``--model-dir`` (default
``$MEDVOL_HOME/bench``) and loaded the way the product loads a downloaded one
(``QwenVLGrounder.from_pretrained``); MedSAM2 is SAM2.1 Hiera-T at 512 with seeded random weights.

What runs, each in its own child process (peak RSS from ``os.wait4``; CUDA peaks from torch):

* **grounder** (per size × dtype): load; one constrained, greedy answer on the 112-slice real CT
  (``example_ct.nii.gz``; the 300-slice stack shows the grounder the same 64 slices, so its cost
  is the same): image-encoder (vision tower) seconds, prefill seconds (vision included: up to
  the first logits), decode tokens/s, the number of tokens, whether the answer parsed;
* **medsam2** (per stack): load, then the right kidney's anchor propagated through the 112-slice
  CT and through a 300-slice stack (the same CT resampled to 1.12 mm slices), K = 0 (every slice):
  seconds per slice;
* **e2e** (per size and stack in ``--e2e``): the whole ``medvol segment`` command (imports,
  model loading, grounding, propagation with the default early stop, writing), with a preset for
  the built model in ``$MEDVOL_MODELS_JSON``; also its time with model loading excluded.

Memory: before each child the need is computed from the parameter count (parameters × bytes per
weight, + the KV cache of the ≈ 4.8 k-token prompt, + a fixed workspace) and compared with
``MemAvailable`` (CPU) or the free GPU memory; a size that does not fit is skipped with one line
saying both numbers. Building a checkpoint needs its bf16 weights in memory once (4.3 GB for 2B,
8.9 GB for 4B) and as much disk.
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # Testing/: the reference package
# the sizes and memory needs (also read by Testing/core/test_fullsize_benchmark.py)
from reference.qwen3_vl_sizes import (BYTES, CONFIGS, GB, PROMPT_TOKENS, WORKSPACE_GB, available_gb,  # noqa: E402,F401
                                      build_config, count_parameters, need_gb, published, size_names, skip_line)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
REAL = Path(os.environ.get("MEDVOL_REAL_DATA", REPO / "Testing" / "data")) / "totalsegmentator"
CT = REAL / "example_ct.nii.gz"
LABELS = REAL / "example_seg_fast_force_split.nii.gz"
KIDNEY_RIGHT = 2
QUERY = "the right kidney"
BUILD_VERSION = "medvol-bench-qwen3-vl/1"
SEED = 20251122
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


# ---- the checkpoint ------------------------------------------------------------------------


def checkpoint_dir(model_dir: Path, name: str) -> Path:
    return model_dir / f"{name}-random"


def is_built(folder: Path, name: str) -> bool:
    marker = folder / "medvol_bench.json"
    try:
        d = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return d.get("build") == BUILD_VERSION and d.get("size") == name


def build_checkpoint(name: str, folder: Path) -> float:
    """Write a random-weight checkpoint of ``name`` (bf16 safetensors) into ``folder``; seconds taken."""
    import shutil

    import torch
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from medvolcore.models.tiny import IMAGE_PROCESSOR, build_tokenizer

    t0 = time.perf_counter()
    tmp = folder.with_name(folder.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = build_tokenizer()
    config = build_config(name, tokenizer)
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: half the memory of fp32
        try:
            model = Qwen3VLForConditionalGeneration(config).eval()
        finally:
            torch.set_default_dtype(previous)
    stop = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config = GenerationConfig(eos_token_id=stop, pad_token_id=stop[1], do_sample=False)
    model.save_pretrained(tmp, max_shard_size="2GB")
    del model
    tokenizer.save_pretrained(tmp)
    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(tmp)
    note = (f"RANDOM WEIGHTS at the real size of {name} (benchmark only): its answers are meaningless; "
            "built by Testing/benchmarks/fullsize.py")
    (tmp / "medvol_model.json").write_text(json.dumps({"smoke": True, "note": note}, indent=2) + "\n")
    (tmp / "medvol_bench.json").write_text(json.dumps({"build": BUILD_VERSION, "size": name, "seed": SEED,
                                                       "source": published(name).get("source")}, indent=2) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return time.perf_counter() - t0


def models_json(path: Path, folders: dict) -> Path:
    """A ``$MEDVOL_MODELS_JSON`` file with one preset per built size (random MedSAM2 at 512)."""
    presets = {}
    for name, folder in folders.items():
        presets[f"bench-{name}"] = {
            "description": f"{name} at its real size with random weights, random MedSAM2 at 512 (benchmark only)",
            "grounder": {"path": str(folder), "model_type": "qwen3_vl"},
            "medsam2": {"random_seed": 0, "image_size": 512},
            "smoke": True, "settings": {"think_budget": "real"}}
    path.write_text(json.dumps({"schema": "medvol.models/1", "presets": presets}, indent=2) + "\n")
    return path


# ---- stacks --------------------------------------------------------------------------------


def make_stacks(tmp: Path, depths) -> dict:
    """``{depth: (ct path, label path)}``: the 112-slice real CT, and resampled copies (linear in z
    for the CT, nearest for the labels) with the same field of view."""
    import nibabel as nib
    from scipy import ndimage

    out = {}
    ct, lab = nib.load(str(CT)), nib.load(str(LABELS))
    k = ct.shape[2]
    for d in depths:
        if d == k:
            out[d] = (CT, LABELS)
            continue
        zoom = d / k
        a = ndimage.zoom(np.asarray(ct.dataobj, dtype=np.float32), (1, 1, zoom), order=1)
        lb = ndimage.zoom(np.asarray(lab.dataobj), (1, 1, zoom), order=0)
        aff = ct.affine.copy()
        aff[:3, 2] = ct.affine[:3, 2] * (k / d)  # thinner slices over the same extent
        paths = (tmp / f"ct_{d}.nii.gz", tmp / f"labels_{d}.nii.gz")
        nib.save(nib.Nifti1Image(np.round(a).astype(np.int16), aff), str(paths[0]))
        nib.save(nib.Nifti1Image(lb.astype(np.uint8), aff), str(paths[1]))
        out[d] = paths
    return out


# ---- children ------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _cuda_peak(device: str):
    if device.startswith("cuda"):
        import torch

        return round(torch.cuda.max_memory_allocated() / GB, 2)
    return None


def child_ground(args) -> dict:
    import torch

    from medvolcore.grounder import QwenVLGrounder
    from medvolcore.pipeline import as_stack

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    g = QwenVLGrounder.from_pretrained(args.folder, device=args.device, dtype=TORCH_DTYPE[args.dtype],
                                       settings={"preset": "real"})
    _sync(args.device)
    load_s = time.perf_counter() - t0
    stack = as_stack(args.ct)
    t0 = time.perf_counter()
    inputs, shown = g.build_inputs(stack, QUERY)
    prompt_s = time.perf_counter() - t0
    vision = {"s": 0.0, "t": None, "calls": 0}
    visual = g.model.model.visual

    def pre(_m, _i):
        _sync(args.device)
        vision["t"] = time.perf_counter()

    def post(_m, _i, _o):
        _sync(args.device)
        vision["s"] += time.perf_counter() - vision["t"]
        vision["calls"] += 1

    h1, h2 = visual.register_forward_pre_hook(pre), visual.register_forward_hook(post)
    max_new = int(args.max_new_tokens or g.settings["max_new_tokens"])
    try:
        if args.device.startswith("cuda"):  # kernels and cuBLAS handles are made on first use
            g._generate_text(inputs, shown, constrain=True, do_sample=False, seed=None, max_new_tokens=2)
            vision["s"], vision["calls"] = 0.0, 0
            torch.cuda.reset_peak_memory_stats()
        text, t = g._generate_text(inputs, shown, constrain=True, do_sample=False, seed=None, max_new_tokens=max_new)
    finally:
        h1.remove()
        h2.remove()
    from medvolcore.answer import parse_answer
    from medvolcore.grounder.answers import check_answer

    try:  # the grammar's promise: the answer format, with a shown slice
        format_ok = parse_answer(text).slice in set(shown)
    except Exception:  # noqa: BLE001 - reported, not raised
        format_ok = False
    try:  # a random model decoding greedily tends to repeat a digit: boxes of zero width
        check_answer(text, shown)
        parsed = True
    except Exception:  # noqa: BLE001
        parsed = False
    decode_tokens = max(0, t["new_tokens"] - 1)  # the first token comes out of the prefill
    return {"load_s": load_s, "prompt_s": prompt_s, "prompt_tokens": int(inputs["input_ids"].shape[1]),
            "image_tokens": int(inputs["mm_token_type_ids"].sum()), "vision_s": vision["s"],
            "vision_calls": vision["calls"], "prefill_s": t["prefill_s"], "decode_s": t["decode_s"],
            "new_tokens": t["new_tokens"], "stopped": t["stopped"],
            "decode_tokens_per_s": decode_tokens / t["decode_s"] if t["decode_s"] > 0 else None,
            "answer_format_ok": format_ok, "answer_parsed": parsed, "answer_head": text[:160], "cuda_peak_gb": _cuda_peak(args.device),
            "dtype": str(g.dtype), "threads": torch.get_num_threads()}


def child_medsam2(args) -> dict:
    import torch

    from medvolcore.anchor import anchor_from_mask
    from medvolcore.propagation import MedSAM2Propagator
    from medvolcore.stack import AxialStack
    from medvolcore.volume import label_mask, load_label_map, load_volume

    if args.threads:
        torch.set_num_threads(args.threads)
    stack = AxialStack(load_volume(args.ct))
    labels = load_label_map(args.labels)
    anchor = anchor_from_mask(AxialStack(labels).to_stack(label_mask(labels, KIDNEY_RIGHT)), stack=stack)
    t0 = time.perf_counter()
    prop = MedSAM2Propagator.from_random(0, image_size=args.image_size, device=args.device)
    _sync(args.device)
    load_s = time.perf_counter() - t0
    data = np.ascontiguousarray(stack.data, dtype=np.float32)
    prop.propagate(data, anchor.slice, anchor.boxes, window=0)  # warm-up: one slice
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    c0 = time.process_time()
    r = prop.propagate(data, anchor.slice, anchor.boxes, stop_after_empty=0)
    _sync(args.device)
    return {"load_s": load_s, "slices": r.slices_propagated, "seconds": r.seconds,
            "seconds_per_slice": r.seconds_per_slice, "cpu_s": time.process_time() - c0,
            "cuda_peak_gb": _cuda_peak(args.device), "key_slice": anchor.slice, "encoder_calls": r.encoder_calls}


def run_child(job: str, argv: list, env: dict) -> dict:
    """This script as a child process; its JSON result plus wall, CPU seconds and peak RSS."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", job, *map(str, argv)],
                             stdout=out, stderr=err, env=env)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        text, etext = out.read().decode(), err.read().decode()
    code = os.waitstatus_to_exitcode(status)
    res = {"exit_code": code, "wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_gb": ru.ru_maxrss / 1024 ** 2}
    if code == 0:
        try:
            res.update(json.loads(text.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            res["error"] = "no result line"
    else:
        last = [ln for ln in etext.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        res["error"] = f"exit {code}: {last[0][:300]}"
    return res


def run_e2e(preset: str, ct: Path, device: str, env: dict, tmp: Path) -> dict:
    """The whole ``medvol segment`` command, as a user runs it."""
    out = tmp / f"e2e-{preset}-{ct.name}"
    # --sample: greedy decoding of random weights repeats one digit (boxes of zero width, retried);
    # sampling costs the same per token and gives usable boxes at once
    cmd = [sys.executable, "-m", "medvolcore.cli", "segment", "--volume", str(ct), "--query", QUERY,
           "--out", str(out), "--preset", preset, "--device", device, "--json", "--no-progress", "--overwrite",
           "--sample", "--seed", "0"]
    with tempfile.TemporaryFile() as so, tempfile.TemporaryFile() as se:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=so, stderr=se, env=env)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        so.seek(0)
        se.seek(0)
        text, etext = so.read().decode(), se.read().decode()
    res = {"exit_code": os.waitstatus_to_exitcode(status), "wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime,
           "peak_rss_gb": ru.ru_maxrss / 1024 ** 2}
    if res["exit_code"] == 0:
        d = json.loads(text)
        tm, loads = d["timings"], d.get("model_load_s", {})
        res.update(segment_s=tm.get("total_s"), ground_s=tm.get("ground_s"), propagate_s=tm.get("propagate_s"),
                   load_s=sum(loads.values()), slices_propagated=tm.get("slices_propagated"),
                   attempts=1 + sum(str(n).startswith("attempt ") for n in d.get("notes", [])),
                   new_tokens=tm.get("ground_new_tokens"), encoder_calls=tm.get("encoder_calls"))
        res["segment_excl_load_s"] = res["segment_s"] - res["load_s"]
    else:
        res["error"] = (etext.strip().splitlines() or ["(no output)"])[-1][:300]
    return res


# ---- the run -------------------------------------------------------------------------------


def plan(args) -> list:
    """[(kind, size, dtype, need GB)], the children this run would start."""
    jobs = []
    for name in size_names(args.sizes):
        params = count_parameters(name)
        for dt in args.dtypes:
            jobs.append(("ground", name, dt, need_gb(params, dt), params))
        for d in args.e2e:
            e2e_dtype = "bf16" if args.device == "cuda" else "fp32"  # what `medvol segment` uses
            jobs.append(("e2e", name, f"{e2e_dtype}@{d}", need_gb(params, e2e_dtype, with_medsam2=True), params))
    return jobs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--sizes", nargs="+", default=["2b", "4b"], help="2b, 4b and/or mini (default: 2b 4b)")
    p.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], help="grounder dtypes (default: fp32 bf16 on "
                   "CPU, bf16 on CUDA)")
    p.add_argument("--stacks", nargs="+", type=int, default=[112, 300],
                   help="slice counts for the MedSAM2 figures (112: the real CT; others: it resampled in z)")
    p.add_argument("--e2e", nargs="*", type=int, help="slice counts on which the whole `medvol segment` command "
                   "runs per size (default: 112 on CPU, 112 300 on CUDA; none: --e2e with no value)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the children (0: torch's default)")
    p.add_argument("--max-new-tokens", type=int, help="decode budget (default: the grounder's, 256)")
    p.add_argument("--model-dir", help="where the random-weight checkpoints are built and kept "
                   "(default $MEDVOL_HOME/bench)")
    p.add_argument("--no-medsam2", action="store_true", help="skip the MedSAM2 figures")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the memory checks, run nothing")
    p.add_argument("--json-out", help="write every figure as JSON")
    # child arguments
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--ct", help=argparse.SUPPRESS)
    p.add_argument("--labels", help=argparse.SUPPRESS)
    p.add_argument("--image-size", type=int, default=512, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        res = {"ground": child_ground, "medsam2": child_medsam2}[args.child](args)
        print(json.dumps(res))
        return 0

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA GPU here")
    args.dtypes = args.dtypes or (["bf16"] if args.device == "cuda" else ["fp32", "bf16"])
    if args.e2e is None:
        args.e2e = [112, 300] if args.device == "cuda" else [112]
    for path in (CT, LABELS):
        if not path.is_file():
            p.error(f"{path} is missing (Testing/data in the repository, or set MEDVOL_REAL_DATA)")
    bad = [d for d in set(args.stacks) | set(args.e2e) if not 2 <= d <= 2000]
    if bad:
        p.error(f"slice counts must be between 2 and 2000, got {bad}")
    from medvolcore.models.tiny import medvol_home

    model_dir = Path(args.model_dir).expanduser() if args.model_dir else medvol_home() / "bench"
    jobs = plan(args)
    print(f"full-size benchmark, {time.strftime('%Y-%m-%d %H:%M')}, device {args.device}, {os.cpu_count()} CPU(s); "
          f"random weights, real sizes; models in {model_dir}", flush=True)
    for kind, name, dt, need, params in jobs:
        print(f"  plan: {kind:<6} {name:<12} {dt:<9} {params['total'] / 1e9:.2f} B parameters, needs ≈ {need:.1f} GB",
              flush=True)
    if args.dry_run:
        print(f"  available now: {available_gb(args.device):.1f} GB ({'free GPU memory' if args.device == 'cuda' else 'MemAvailable'})")
        print("dry run: nothing was built or run")
        return 0

    results = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "cpus": os.cpu_count(),
               "ground": [], "medsam2": [], "e2e": [], "skipped": [], "builds": []}
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="medvol-fullsize-") as d:
        tmp = Path(d)
        folders = {}
        for name in size_names(args.sizes):
            folder = checkpoint_dir(model_dir, name)
            if not is_built(folder, name):
                params = count_parameters(name)
                line = skip_line(f"building {name}", params["total"] * 2 / GB + 1.0, available_gb("cpu"), "cpu")
                if line:
                    print(line, flush=True)
                    results["skipped"].append(line)
                    continue
                print(f"building {name} (random weights, bf16) in {folder} …", flush=True)
                secs = build_checkpoint(name, folder)
                results["builds"].append({"size": name, "seconds": secs})
                print(f"  built in {secs:.0f} s", flush=True)
            folders[name] = folder
        env["MEDVOL_MODELS_JSON"] = str(models_json(tmp / "models.json", folders))
        stacks = make_stacks(tmp, sorted(set(args.stacks) | set(args.e2e)))
        threads = ["--threads", args.threads] if args.threads else []

        for kind, name, dt, need, params in jobs:
            if name not in folders:
                continue
            line = skip_line(f"{kind} {name} {dt}", need, available_gb(args.device), args.device)
            if line:
                print(line, flush=True)
                results["skipped"].append(line)
                continue
            if kind == "ground":
                print(f"grounder {name} {dt} …", flush=True)
                r = run_child("ground", ["--folder", folders[name], "--dtype", dt, "--device", args.device,
                                         "--ct", CT, *threads] + (["--max-new-tokens", args.max_new_tokens]
                                                                  if args.max_new_tokens else []), env)
                r.update(size=name, dtype=dt, params_b=params["total"] / 1e9, need_gb=need)
                results["ground"].append(r)
            else:
                depth = int(dt.split("@")[1])
                print(f"medvol segment {name} on {depth} slices …", flush=True)
                r = run_e2e(f"bench-{name}", stacks[depth][0], args.device, env, tmp)
                r.update(size=name, slices=depth, dtype=dt.split("@")[0])
                results["e2e"].append(r)
            print("  " + (r.get("error") or "done") + f" ({r['wall_s']:.0f} s)", flush=True)
        if not args.no_medsam2:
            for depth in args.stacks:
                print(f"MedSAM2 on {depth} slices …", flush=True)
                r = run_child("medsam2", ["--ct", stacks[depth][0], "--labels", stacks[depth][1],
                                          "--device", args.device, *threads], env)
                r.update(stack_slices=depth)
                results["medsam2"].append(r)
                print("  " + (r.get("error") or "done") + f" ({r['wall_s']:.0f} s)", flush=True)
    print_tables(results)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(results, indent=2, default=str) + "\n")
    failed = [r for group in ("ground", "medsam2", "e2e") for r in results[group] if r.get("error")]
    return 1 if failed else 0


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def print_tables(res: dict) -> None:
    dev = res["device"]
    print(f"\nGrounder (random weights, real sizes; {dev}; one constrained greedy answer on the 112-slice CT, "
          "64 slices shown)")
    print(f"{'model':<13}{'dtype':<6}{'params':>8}{'load s':>8}{'vision s':>9}{'prefill s':>10}{'tokens':>7}"
          f"{'decode tok/s':>13}{'prompt tok':>11}{'peak RSS GB':>12}{'GPU GB':>8}  answer")
    for r in res["ground"]:
        if r.get("error"):
            print(f"{r['size']:<13}{r['dtype']:<6}  failed: {r['error']}")
            continue
        print(f"{r['size']:<13}{r['dtype']:<6}{r['params_b']:>7.2f}B{r['load_s']:>8.1f}{r['vision_s']:>9.1f}"
              f"{r['prefill_s']:>10.1f}{r['new_tokens']:>7}{_f(r['decode_tokens_per_s']):>13}{r['prompt_tokens']:>11}"
              f"{r['peak_rss_gb']:>12.1f}{_f(r['cuda_peak_gb'], '{:.1f}'):>8}  "
              f"{'format ok' if r['answer_format_ok'] else 'FORMAT BROKEN'}"
              f"{', boxes usable' if r['answer_parsed'] else ', boxes degenerate (random weights)'}")
    if res["medsam2"]:
        print(f"\nMedSAM2 (SAM2.1 Hiera-T at 512, random weights; {dev}; one box, every slice, "
              f"{'bf16 autocast' if dev == 'cuda' else 'fp32'})")
        print(f"{'slices':>6}{'load s':>8}{'propagate s':>12}{'s/slice':>9}{'peak RSS GB':>12}{'GPU GB':>8}")
        for r in res["medsam2"]:
            if r.get("error"):
                print(f"{r['stack_slices']:>6}  failed: {r['error']}")
                continue
            print(f"{r['slices']:>6}{r['load_s']:>8.1f}{r['seconds']:>12.1f}{r['seconds_per_slice']:>9.3f}"
                  f"{r['peak_rss_gb']:>12.1f}{_f(r['cuda_peak_gb'], '{:.1f}'):>8}")
    if res["e2e"]:
        print(f"\n`medvol segment` end to end (whole process; {dev}; default early stop; MedSAM2 at 512)")
        print(f"{'model':<13}{'slices':>6}{'wall s':>8}{'load s':>8}{'ground s':>9}{'propag. s':>10}"
              f"{'excl. load s':>13}{'peak RSS GB':>12}{'attempts':>9}")
        for r in res["e2e"]:
            if r.get("error"):
                print(f"{r['size']:<13}{r['slices']:>6}  failed: {r['error']}")
                continue
            print(f"{r['size']:<13}{r['slices']:>6}{r['wall_s']:>8.1f}{r['load_s']:>8.1f}{r['ground_s']:>9.1f}"
                  f"{r['propagate_s']:>10.1f}{r['segment_excl_load_s']:>13.1f}{r['peak_rss_gb']:>12.1f}"
                  f"{r['attempts']:>9}")
    for line in res["skipped"]:
        print(line)


if __name__ == "__main__":
    sys.exit(main())
