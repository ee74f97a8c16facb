"""The ``medvol-train`` command line: ``prepare``, ``sft`` and ``m3dseg-manifest``.

Errors are one line on stderr (``medvol-train: error: …``) and a non-zero exit code, never a
traceback (``--debug`` shows it). Exit codes: 0 done; 2 bad input, configuration or data
(``prepare`` exits 2 only when not a single sample could be prepared — skipped rows alone are
reported, not fatal); 1 an unexpected internal error; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import List, Optional

from medvolcore import RESEARCH_USE_NOTICE
from medvolcore.caseruns import SHARD_HELP
from medvolcore.cpu import threads_arg
from medvolcore.errors import MedVolError

from . import __version__
from .distributed import check_launcher, is_main_process, quiet_other_ranks, rank as rank_text
from .evaluate_field import FIELD_PROTOCOLS

PROG = "medvol-train"
log = logging.getLogger("medvoltrain")
THREADS_HELP = ("CPU threads for torch (default auto: the physical cores this process may use, less those other "
                "work keeps busy; OMP_NUM_THREADS when set, as torchrun sets it to 1 for several processes)")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


class _OneLineWarnings(logging.Handler):
    def emit(self, record):
        sys.stderr.write(f"{PROG}: warning: {record.getMessage()}\n")


def cmd_prepare(args) -> int:
    from .prepare import PrepareSettings, format_summary, prepare

    extra = {} if args.negative_fraction is None else {"negative_fraction": args.negative_fraction}
    settings = PrepareSettings(seed=args.seed, top_k=args.top_k, query_kind=args.query_kind,
                               test_fraction=args.test_fraction, relational=not args.no_relational,
                               prompt_window=args.prompt_window, **extra)
    summary = prepare(args.manifest, args.out, settings, workers=args.workers, progress=not args.no_progress,
                      overwrite=args.overwrite)
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=1) + "\n")
    else:
        sys.stdout.write(format_summary(summary) + "\n")
    return 0


def _apply_threads(args) -> None:
    """``--threads`` (or medvolcore.cpu's rule; under torchrun, OMP_NUM_THREADS) set for torch."""
    from medvolcore.cpu import apply_threads

    plan = apply_threads(args.threads)
    log.info("%s", plan.describe())


def cmd_sft(args) -> int:
    from .config import load_settings, parse_overrides
    from .sft import train_sft

    settings = load_settings(args.config, parse_overrides(args.overrides), preset=args.preset,
                             max_steps=args.max_steps)
    _apply_threads(args)
    summary = train_sft(args.data, args.output, settings, resume=args.resume, overwrite=args.overwrite)
    if not is_main_process():  # rank 0 reports the run
        return 0
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=1) + "\n")
    else:
        sys.stdout.write(f"adapter written to {summary['adapter']} after {summary['global_step']} step(s) "
                         f"({summary['seconds']:.1f} s); loss {_loss(summary['loss_first'])} → "
                         f"{_loss(summary['loss_last'])}\n")
    return 0


def _loss(value) -> str:
    """A loss for people: four significant digits (``6.452``), or ``n/a`` when none was recorded."""
    return "n/a" if value is None else f"{float(value):.4g}"


def cmd_grpo(args) -> int:
    from .config import GRPOSettings, load_settings, parse_overrides
    from .grpo import train_grpo

    settings = load_settings(args.config, parse_overrides(args.overrides, GRPOSettings), cls=GRPOSettings,
                             preset=args.preset, max_steps=args.max_steps)
    _apply_threads(args)
    summary = train_grpo(args.data, args.output, settings, adapter=args.adapter, resume=args.resume,
                         overwrite=args.overwrite, sam_checkpoint=args.sam_checkpoint,
                         random_weights=args.random_weights)
    if not is_main_process():  # rank 0 reports the run
        return 0
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=1) + "\n")
    else:
        last = summary["history"][-1] if summary["history"] else {}
        terms = ", ".join(f"{k.split('/')[1]} {last[k]:.3f}" for k in last if k.startswith("rewards/") and k.endswith("/mean"))
        sys.stdout.write(f"adapter written to {summary['adapter']} after {summary['global_step']} step(s) "
                         f"({summary['seconds']:.1f} s); last step rewards: {terms or 'none logged'}"
                         + (f"; reward failures: {summary['reward_failures']}" if summary["reward_failures"] else "")
                         + "\n")
    return 0


def cmd_m3dseg_manifest(args) -> int:
    from .datasets import m3dseg_rows, write_manifest

    rows = []
    for code in args.code:
        rows += m3dseg_rows(args.root, code, args.nifti_map, args.orientation)
    write_manifest(rows, args.out, overwrite=args.overwrite)
    sys.stdout.write(f"wrote {len(rows)} case(s) to {args.out}\n")
    return 0


def cmd_evaluate(args) -> int:
    from medvolcore.errors import InputError

    from .evaluate import evaluate, format_result

    if not args.aggregate_only and (not args.data or not args.out):
        raise InputError("evaluate needs --data DATA and --out DIR (or --out DIR --aggregate-only)")
    if args.aggregate_only and not args.out:
        raise InputError("--aggregate-only needs --out DIR")
    if not args.aggregate_only:
        _apply_threads(args)
    if args.protocol in FIELD_PROTOCOLS:
        return _evaluate_field(args)
    summary = evaluate(args.data, args.out, split=args.split, oracle=args.oracle, preset=args.preset,
                       adapter=args.adapter, sam_checkpoint=args.sam_checkpoint, random_weights=args.random_weights,
                       sam_image_size=args.sam_image_size, device=args.device, shard=args.shard, limit=args.limit,
                       constrain=not args.unconstrained, overwrite=args.overwrite, retry_failed=args.retry_failed,
                       save_masks=not args.no_masks, progress=not args.no_progress,
                       aggregate_only=args.aggregate_only, stop_after_empty=args.stop_after_empty,
                       protocol=args.protocol)
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=1) + "\n")
    else:
        sys.stdout.write(format_result(summary, args.out) + "\n")
    return 0


def _evaluate_field(args) -> int:
    from medvolcore.errors import InputError

    from .evaluate_field import evaluate_field, format_field_result

    if args.aggregate_only or args.oracle or args.split != "test":
        raise InputError(f"--protocol {args.protocol} reads the challenge layout (DIR/imgs, DIR/gts) and runs the "
                         "grounder: drop --aggregate-only, --oracle and --split")
    summary = evaluate_field(args.data, args.out, args.protocol, preset=args.preset, adapter=args.adapter,
                             sam_checkpoint=args.sam_checkpoint, random_weights=args.random_weights,
                             sam_image_size=args.sam_image_size, device=args.device, shard=args.shard,
                             limit=args.limit, constrain=not args.unconstrained, overwrite=args.overwrite,
                             progress=not args.no_progress, stop_after_empty=args.stop_after_empty,
                             control=args.control)
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=1, default=str) + "\n")
    else:
        sys.stdout.write(format_field_result(summary, args.out) + "\n")
    return 0


def cmd_predict_cvpr25(args) -> int:
    from .evaluate_field import predict_folder

    _apply_threads(args)
    result = predict_folder(args.inputs, args.outputs, preset=args.preset, adapter=args.adapter,
                            sam_checkpoint=args.sam_checkpoint, random_weights=args.random_weights,
                            sam_image_size=args.sam_image_size, device=args.device,
                            stop_after_empty=args.stop_after_empty, overwrite=args.overwrite)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        sys.stdout.write(f"{len(result['written'])} segmentation(s) written to {args.outputs}"
                         + (f", {len(result['failed'])} case(s) failed" if result["failed"] else "") + "\n")
    return 1 if result["failed"] else 0


def cmd_bench_vision(args) -> int:
    import os

    from medvolcore.errors import InputError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally; never reach the hub
    echo = (lambda line: None) if args.json else None
    if args.task == "presence":
        from .bench.presence import PresenceBenchSettings, run_presence_benchmark

        for flag in ("placement", "hold_out"):
            if getattr(args, flag) is not None:
                raise InputError(f"--{flag.replace('_', '-')} is a setting of the key-slice task, not of --task presence")
        knobs = {k: getattr(args, k) for k in ("steps", "lr", "train_cases", "test_cases", "threads")
                 if getattr(args, k) is not None}
        settings = (PresenceBenchSettings.quick_settings if args.quick else PresenceBenchSettings)(seed=args.seed,
                                                                                                  **knobs)
        result = run_presence_benchmark(args.out, settings=settings, overwrite=args.overwrite, echo=echo)
        keys = ("presence", "goals", "timings_s")
    else:
        from .bench.vision import VisionBenchSettings, run_vision_benchmark

        knobs = {k: getattr(args, k)
                 for k in ("steps", "lr", "train_cases", "test_cases", "threads", "placement", "hold_out")
                 if getattr(args, k) is not None}
        settings = (VisionBenchSettings.quick_settings if args.quick else VisionBenchSettings)(seed=args.seed, **knobs)
        result = run_vision_benchmark(args.out, settings=settings, overwrite=args.overwrite, echo=echo)
        keys = ("scores", "chance", "goals", "timings_s")
    if args.json:
        sys.stdout.write(json.dumps({k: result[k] for k in keys}, indent=1) + "\n")
    return 0


def cmd_bench_learning(args) -> int:
    import os

    from .bench.learning import BenchSettings, run_benchmark

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally; never reach the hub
    knobs = {k: getattr(args, k) for k in ("model", "sft_steps", "sft_lr", "grpo_steps", "grpo_lr", "num_generations",
                                           "beta", "lambda_consistency", "delta", "samples_per_prompt",
                                           "max_test_samples", "train_cases", "test_cases", "threads", "vocab_size",
                                           "image_patch", "lora_modules_to_save")
             if getattr(args, k) is not None}
    settings = (BenchSettings.quick_settings if args.quick else BenchSettings)(seed=args.seed, **knobs)
    result = run_benchmark(args.out, real_dir=args.real_dir, settings=settings, overwrite=args.overwrite,
                           echo=(lambda line: None) if args.json else None)
    if args.json:
        sys.stdout.write(json.dumps({k: result[k] for k in ("untrained", "sft", "grpo", "timings_s")}, indent=1) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="MedVol-R1 training: prepare data, cold-start SFT with LoRA, GRPO, evaluate. "
                + RESEARCH_USE_NOTICE,
                epilog="The adapter a run writes (RUN/adapter, with medvol_adapter.json) is what `medvol segment "
                       "--preset medvol-r1 --adapter RUN/adapter` runs as MedVol-R1; no trained adapter is published. "
                       + RESEARCH_USE_NOTICE)
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name, help_, func):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(func=func)
        sp.add_argument("--debug", action="store_true", help="show tracebacks")
        sp.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
        return sp

    sp = add("prepare", "Turn a manifest of cases into a training set (64 rendered slices, query, SFT target, "
                        "reward ground truth per sample).", cmd_prepare)
    sp.add_argument("--manifest", required=True, help="CASES.csv or CASES.jsonl (id, volume, labels, targets or "
                                                      "dataset, split)")
    sp.add_argument("--out", required=True, help="output folder DATA (samples.jsonl, summary.json, cases/)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the queries, think sentences and Top-K draws")
    sp.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    sp.add_argument("--top-k", type=int, default=3, help="key slice drawn among the K largest shown slices (default 3)")
    sp.add_argument("--query-kind", choices=["implicit", "explicit"], default="implicit",
                    help="implicit: a description that does not name the label (default); explicit: the label name")
    sp.add_argument("--test-fraction", type=float, default=0.2,
                    help="fraction of each label's descriptions held out for test queries (default 0.2)")
    sp.add_argument("--no-relational", action="store_true", help="no KiTS23-style relational test queries")
    sp.add_argument("--prompt-window", default=None, help="window named in the prompt (default: the grounder's)")
    sp.add_argument("--negative-fraction", type=float, metavar="F",
                    help="about this fraction of each split are negative samples: a query for a structure that is "
                         "not in that volume, answered <answer>[]</answer> (default 0.10; 0 = none, as in the "
                         "MedVol-R1 paper: set 0 for paper-faithful runs)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument("--overwrite", action="store_true",
                    help="let the output replace --manifest when it is one of the files written into --out")

    sp = add("sft", "Cold-start SFT with LoRA (TRL SFTTrainer); writes RUN/adapter/.", cmd_sft)
    sp.add_argument("--data", required=True, help="a folder made by `medvol-train prepare`")
    sp.add_argument("--output", required=True, help="run folder RUN (checkpoints/, tensorboard/, adapter/)")
    sp.add_argument("--config", help="YAML settings (e.g. Training/configs/sft.yaml)")
    sp.add_argument("--preset", help="base model preset (medvol models list); default: the manifest's default preset; tiny for smoke runs")
    sp.add_argument("--max-steps", type=int, help="stop after N optimiser steps")
    sp.add_argument("--resume", action="store_true", help="continue from the last checkpoint in RUN/checkpoints")
    sp.add_argument("--overwrite", action="store_true", help="start again in a RUN folder that holds a run")
    sp.add_argument("--threads", type=threads_arg, default=None, metavar="N|auto", help=THREADS_HELP)
    sp.add_argument("overrides", nargs="*", metavar="key=value", help="override any setting, e.g. learning_rate=1e-4")

    sp = add("grpo", "GRPO with the four MedVol-R1 rewards (TRL GRPOTrainer), from the SFT adapter; writes "
                     "RUN/adapter/.", cmd_grpo)
    sp.add_argument("--data", required=True, help="a folder made by `medvol-train prepare`")
    sp.add_argument("--adapter", help="the SFT adapter to start from (RUN/adapter); without it a new LoRA starts "
                                      "from the base model (the paper's no-SFT ablation)")
    sp.add_argument("--output", required=True, help="run folder RUN2 (checkpoints/, tensorboard/, adapter/)")
    sp.add_argument("--config", help="YAML settings (e.g. Training/configs/grpo.yaml)")
    sp.add_argument("--preset", help="base model preset; default: the manifest's default preset; tiny for smoke runs")
    sp.add_argument("--max-steps", type=int, help="stop after N optimiser steps")
    sam = sp.add_mutually_exclusive_group()
    sam.add_argument("--sam-checkpoint", help="MedSAM2 checkpoint for the consistency reward (default: the preset's)")
    sam.add_argument("--random-weights", type=int, metavar="SEED",
                     help="seeded random MedSAM2 weights (tests, CPU benchmarks: the consistency term is then noise)")
    sp.add_argument("--resume", action="store_true", help="continue from the last checkpoint in RUN2/checkpoints")
    sp.add_argument("--overwrite", action="store_true", help="start again in a RUN2 folder that holds a run")
    sp.add_argument("--threads", type=threads_arg, default=None, metavar="N|auto", help=THREADS_HELP)
    sp.add_argument("overrides", nargs="*", metavar="key=value",
                    help="override any setting, e.g. lambda_consistency=0 delta=10 beta=0.04")

    sp = add("m3dseg-manifest", "Write a manifest for M3D-Seg datasets (their train/test split and label lists).",
             cmd_m3dseg_manifest)
    sp.add_argument("--root", required=True, help="the M3D_Seg folder (holding 0003/, 0004/, 0012/, …)")
    sp.add_argument("--code", action="append", required=True, help="dataset code, e.g. 0012 (repeatable)")
    sp.add_argument("--nifti-map", help="CSV case,volume,labels: use the original NIfTI (HU) files for these cases")
    sp.add_argument("--orientation", help="axis codes of the M3D arrays (default RAS)")
    sp.add_argument("--out", required=True, help="manifest to write (.jsonl)")
    sp.add_argument("--overwrite", action="store_true", help="replace an existing manifest")

    sp = add("evaluate", "Evaluate the pipeline (or the oracle anchor) on a prepared split: DSC/IoU per dataset as in "
                         "the paper's Table 1 (DIR/table.md, table.csv), per-case rows (cases.csv), key-slice hit "
                         "rate and box IoU.", cmd_evaluate)
    sp.add_argument("--data", help="a folder made by `medvol-train prepare`")
    sp.add_argument("--split", default="test", help="split to evaluate: test (default) or train")
    sp.add_argument("--out", help="output folder DIR (one evaluation per folder; resumable)")
    sp.add_argument("--adapter", help="LoRA adapter folder for the grounder (e.g. RUN/adapter)")
    sp.add_argument("--oracle", action="store_true",
                    help="feed the ground-truth anchor to MedSAM2 (no language model): the propagation's upper bound")
    sp.add_argument("--preset", help="model preset (medvol models list); default: the manifest's default preset; tiny for smoke runs")
    w = sp.add_mutually_exclusive_group()
    w.add_argument("--sam-checkpoint", help="MedSAM2 checkpoint (default: the preset's)")
    w.add_argument("--random-weights", type=int, metavar="SEED", help="seeded random MedSAM2 weights (smoke runs)")
    sp.add_argument("--sam-image-size", type=int, help="image size for --random-weights (default: the preset's, else 512)")
    sp.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    sp.add_argument("--shard", metavar="I/N", help=SHARD_HELP + " (one shard per GPU)")
    sp.add_argument("--limit", type=int, help="only the first N samples of the split")
    sp.add_argument("--unconstrained", action="store_true", help="decode without the answer grammar (still greedy)")
    sp.add_argument("--protocol", choices=("product", "paper") + FIELD_PROTOCOLS,
                    help="paper: the paper's Table 1 protocol (MedSAM2 over the whole volume, no early stop; test "
                         "split); product (default): early stop as `medvol segment` does; cvpr25, rexgrounding, "
                         "medvol-r1: --data in the CVPR 2025 challenge layout (DIR/imgs, DIR/gts), OUT/segs and "
                         "OUT/metrics.csv as the challenge has them, scored by that protocol (whole volume unless "
                         "--stop-after-empty)")
    sp.add_argument("--control", choices=("none", "blank"), default="none",
                    help="with cvpr25/rexgrounding/medvol-r1: blank replaces every image by a constant volume "
                         "(the control of a claim that the model reads its images)")
    sp.add_argument("--stop-after-empty", type=int, metavar="K",
                    help="early stop: each direction ends once every mask has been empty on K slices (default: "
                         "medvol's default; 0 = the whole volume, as --protocol paper)")
    sp.add_argument("--overwrite", action="store_true",
                    help="redo this shard's cases, also in a DIR made with other settings")
    sp.add_argument("--retry-failed", action="store_true",
                    help="redo cases whose model gave no usable answer (errors are always retried)")
    sp.add_argument("--aggregate-only", action="store_true",
                    help="only rebuild DIR's tables from its finished cases (e.g. after all shards ran)")
    sp.add_argument("--no-masks", action="store_true", help="do not save the predicted masks (DIR/masks/)")
    sp.add_argument("--threads", type=threads_arg, default=None, metavar="N|auto", help=THREADS_HELP)
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp = add("predict-cvpr25", "What a CVPR 2025 challenge container runs: OUTPUTS/<case>.npz (key segs, the "
                               "image's shape, labels = prompt ids) for every npz in INPUTS; nothing else is written.",
             cmd_predict_cvpr25)
    sp.add_argument("inputs", help="folder of challenge npz files (imgs, spacing, text_prompts)")
    sp.add_argument("outputs", help="folder for the segs (made if missing)")
    sp.add_argument("--preset", help="model preset (default: the manifest's default preset; tiny for smoke runs)")
    sp.add_argument("--adapter", help="LoRA adapter folder for the grounder")
    w = sp.add_mutually_exclusive_group()
    w.add_argument("--sam-checkpoint", help="MedSAM2 checkpoint (default: the preset's)")
    w.add_argument("--random-weights", type=int, metavar="SEED", help="seeded random MedSAM2 weights (smoke runs)")
    sp.add_argument("--sam-image-size", type=int, help="image size for --random-weights")
    sp.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    sp.add_argument("--stop-after-empty", type=int, metavar="K", help="early stop K (default 0: the whole volume)")
    sp.add_argument("--overwrite", action="store_true", help="replace segs already in OUTPUTS")
    sp.add_argument("--threads", type=threads_arg, default=None, metavar="N|auto", help=THREADS_HELP)

    sp = add("bench-vision", "Vision sanity check on a CPU: synthetic volumes with a bright square, SFT through the "
                             "product's data path, and the model scored on held-out volumes with their own slices, "
                             "another volume's and black ones (DIR/result.json, table.md). A model that does not read "
                             "its images scores the same in all three. --task key-slice (default): which slice and "
                             "where; --task presence: is the object there at all (half the volumes have none; "
                             "the answer [] means not present).", cmd_bench_vision)
    sp.add_argument("--out", required=True, help="output folder DIR (cases, prepared data, model, run, results)")
    sp.add_argument("--task", choices=("key-slice", "presence"), default="key-slice",
                    help="key-slice (default): find the square's slice and box; presence: say whether the volume "
                         "holds the square at all, through the answer grammar and parser (result.json: presence)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the volumes and the training (default 0)")
    sp.add_argument("--quick", action="store_true",
                    help="the test suite's variant (key-slice: 4 slices, one with the square, 150 training volumes, "
                         "≈ 2 min; presence: 120 training volumes, ≈ 1 min)")
    sp.add_argument("--overwrite", action="store_true", help="run again in a DIR that holds a vision benchmark")
    sp.add_argument("--placement", choices=("grid", "free"),
                    help="grid: the square is exactly one image token (default); free: any pixel, 16-32 px (--quick)")
    sp.add_argument("--hold-out", choices=("volumes", "positions"),
                    help="volumes: test volumes are new, their positions from the same grid (default); positions: "
                         "test squares start on the black cells of a checkerboard, never seen in training (--quick)")
    sp.add_argument("--steps", type=int, help="SFT optimiser steps (key-slice: default 2400, --quick 600; presence: "
                                              "see docs/learning-benchmarks.md)")
    sp.add_argument("--lr", type=float, help="SFT learning rate (default 1e-3)")
    sp.add_argument("--train-cases", type=int, help="training volumes (key-slice: default 2400, --quick 150)")
    sp.add_argument("--test-cases", type=int, help="held-out volumes (key-slice: default 40, --quick 24; presence: a "
                                                   "multiple of 4)")
    sp.add_argument("--threads", type=int, help="torch threads (default 1; 0 = torch's choice)")
    sp = add("bench-learning", "Learning benchmark on a CPU: a small grounding task from the real test CTs, SFT then "
                               "GRPO on a small local Qwen3-VL, and the untrained, SFT and GRPO models scored on a "
                               "held-out split with the same rewards (DIR/result.json, table.md, curves.png).",
             cmd_bench_learning)
    sp.add_argument("--out", required=True, help="output folder DIR (cases, prepared data, model, runs, results)")
    sp.add_argument("--real-dir", help="the real test data folder (default: $MEDVOL_REAL_DATA, else "
                                       "Testing/data of the repository)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the cases, queries, training and sampling (default 0)")
    sp.add_argument("--quick", action="store_true", help="a few steps on the tiny model: a smoke test, not a result")
    sp.add_argument("--overwrite", action="store_true", help="run again in a DIR that holds a benchmark")
    sp.add_argument("--model", choices=["tiny", "bench", "seeing"],
                    help="model size: seeing (default; the vision stage's model: head_dim 32, rope_theta 10 000, "
                         "sine/cosine vision positions), tiny (the tiny preset's sizes) or bench (wider and deeper)")
    sp.add_argument("--lora-modules-to-save",
                    help="modules trained in full beside the LoRA (default embed_tokens,lm_head,visual,q_norm,k_norm)")
    sp.add_argument("--sft-steps", type=int, help="SFT optimiser steps")
    sp.add_argument("--sft-lr", type=float, help="SFT learning rate (LoRA)")
    sp.add_argument("--grpo-steps", type=int, help="GRPO optimiser steps (one prompt, G rollouts each)")
    sp.add_argument("--grpo-lr", type=float, help="GRPO learning rate")
    sp.add_argument("--num-generations", type=int, help="GRPO group size G")
    sp.add_argument("--beta", type=float, help="GRPO KL weight (default 0.01, the paper's)")
    sp.add_argument("--lambda-consistency", type=float,
                    help="weight of the consistency reward in GRPO (default 0: MedSAM2 has random weights here)")
    sp.add_argument("--delta", type=int, help="consistency window half-width (default 5)")
    sp.add_argument("--samples-per-prompt", type=int, help="sampled completions per test prompt and model")
    sp.add_argument("--max-test-samples", type=int, help="test samples scored (round-robin over labels)")
    sp.add_argument("--train-cases", type=int, help="augmented training crops")
    sp.add_argument("--test-cases", type=int, help="augmented test crops")
    sp.add_argument("--threads", type=int, help="torch threads (default 1: robust on a shared CPU; 0 = torch's choice)")
    sp.add_argument("--vocab-size", type=int,
                    help="BPE vocabulary learnt from the training text (default 2048; 0: the tiny preset's tokenizer)")
    sp.add_argument("--image-patch", type=int, choices=[16, 32, 64],
                    help="vision patch of the bench model (default 32: 16 tokens per slice; 16 as the tiny preset)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    handler = _OneLineWarnings(level=logging.WARNING)
    loggers = [logging.getLogger(n) for n in ("medvoltrain", "medvolcore")]
    saved = [(lg, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    where = "" if is_main_process() else f" (rank {rank_text()})"
    try:
        if args.command in ("sft", "grpo"):
            check_launcher(argv)
            quiet_other_ranks()
        return int(args.func(args) or 0)
    except MedVolError as e:
        if args.debug:
            raise
        if not where:  # every rank meets the same bad input: rank 0 says it once
            sys.stderr.write(f"{PROG}: error: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted" + ("; rerun with --resume to continue" if args.command in ("sft", "grpo")
                                                   else "; rerun the same command to continue") + "\n")
        return 130
    except Exception as e:  # noqa: BLE001 — still one line, with a hint
        if args.debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        sys.stderr.write(f"{PROG}: internal error{where}: {type(e).__name__}: {msg} (rerun with --debug for details)\n")
        return 1
    finally:
        for lg, prop in saved:
            lg.removeHandler(handler)
            lg.propagate = prop


if __name__ == "__main__":
    sys.exit(main())
