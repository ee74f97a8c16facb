"""``medvol-train bench-learning``: does training work? A grounding task from the real test CTs,
small enough for a CPU, trained with the product's SFT then GRPO; the untrained, SFT and GRPO
models are scored on a held-out split with the same rewards (:class:`~medvoltrain.rewards.RewardFunctions`).

Inputs: ``real_dir`` (``$MEDVOL_REAL_DATA``, else the repository's ``Testing/data``: ``example_ct``,
``example_ct_sm``, their TotalSegmentator label maps and the M3D → TotalSegmentator crosswalk) and
:class:`BenchSettings`. Both CTs are one patient: the test split is held out by z-range of that
patient (:data:`TEST_BANDS`, stack z of ``example_ct``) and by description, not by patient.

Everything it writes stays in ``DIR`` (:func:`run_benchmark`):

* ``cases/*.nii.gz``, ``cases.jsonl``: the crops (:func:`build_cases`), each a NIfTI whose array is
  the canonical stack (``stack[z, y, x]``) with the source's stack-to-RAS affine shifted to the
  crop, so its world coordinates stay the patient's;
* ``data/``: ``prepare``'s output (Top-1 key slice), its SFT targets' reasoning shortened to one
  template (:func:`~medvoltrain.bench.common.short_think_targets`);
* ``model/``: the base model (:func:`~medvoltrain.bench.model.build_model`);
* ``runs/sft``, ``runs/grpo``: the two training runs and their adapters;
* ``result.json``: ``{"untrained": {...}, "sft": {...}, "grpo": {...}}`` (each term's mean reward and
  ``total = format + axial + box``) plus ``reference``, ``ablations`` (the trained models again with
  their slices blacked out and swapped, own − ablated with standard errors), ``settings``,
  ``timings_s``, ``data``, ``model``, ``torch_threads``, ``evaluation``, ``training``, ``notes``;
* ``table.md`` and ``curves.png`` (SFT loss, GRPO reward terms per step).

The task, the held-out split, the model, the training recipe and why each is what it is, with the
measured results: ``docs/learning-benchmarks.md``, "Learning benchmark (`medvol-train bench-learning`)".

This module runs the benchmark; its parts are :mod:`.learning_settings` (:class:`BenchSettings`),
:mod:`.learning_cases` (the task's crops and split) and :mod:`.learning_eval` (sampling and scoring).
Their public names are importable from here too.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Optional

from .common import prepare_out, short_think_targets, swap_partners
from .learning_cases import (MIN_SLICE_AREA, MIN_VOXELS, SM_DEPTH, TARGET_TERMS, TEST_BANDS,  # noqa: F401
                             TRAIN_BAND_WEIGHTS, TRAIN_BANDS, build_cases, default_real_dir, select_test_samples)
from .learning_eval import evaluate_model, label_prior_box, prior_boxes, sample_completions
from .learning_settings import BenchSettings
from .model import build_model, count_parameters, tokenizer_corpus
from .report import ABLATIONS, MODELS, RESULT, TERMS, ablation_table, learning_table, plot_curves, write_result

log = logging.getLogger(__name__)


# ---- the benchmark ---------------------------------------------------------------------------

_OWNED = ("cases", "cases.jsonl", "data", "model", "runs", RESULT, "curves.png", "table.md")

def _sft_settings(settings: BenchSettings, model_dir: Path):
    from ..config import SFTSettings

    return SFTSettings(preset="tiny", model_path=str(model_dir), lora_r=settings.lora_r, lora_alpha=settings.lora_alpha,
                       lora_dropout=0.0, lora_modules_to_save=settings.lora_modules_to_save,
                       learning_rate=settings.sft_lr, max_steps=settings.sft_steps,
                       per_device_train_batch_size=settings.sft_batch, warmup_ratio=0.05, lr_scheduler_type="cosine",
                       gradient_checkpointing=False, logging_steps=1, save_steps=10 ** 6, save_total_limit=1,
                       report_to="none", dataloader_num_workers=0, seed=settings.seed, bf16=False).validate()


def _grpo_settings(settings: BenchSettings, model_dir: Path):
    from ..config import GRPOSettings

    return GRPOSettings(preset="tiny", model_path=str(model_dir), num_generations=settings.num_generations,
                        lora_r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=0.0,
                        lora_modules_to_save=settings.lora_modules_to_save,
                        beta=settings.beta, max_completion_length=settings.max_completion_length,
                        temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                        learning_rate=settings.grpo_lr, max_steps=settings.grpo_steps, prompts_per_device=1,
                        warmup_ratio=0.05, lr_scheduler_type="cosine", gradient_checkpointing=False,
                        lambda_consistency=settings.lambda_consistency, delta=settings.delta, seed=settings.seed,
                        logging_steps=1, save_steps=10 ** 6, save_total_limit=1, report_to="none",
                        dataloader_num_workers=0, bf16=False).validate()


def run_benchmark(out_dir, real_dir=None, settings: Optional[BenchSettings] = None, overwrite: bool = False,
                  echo=None) -> dict:
    """Build the task, train SFT and GRPO, evaluate the three models; returns (and writes) the result.

    ``echo`` (default: print to stdout) receives each progress line, phase times included.
    """
    settings = (settings or BenchSettings()).validate()
    echo = echo or (lambda line: (sys.stdout.write(line + "\n"), sys.stdout.flush()))
    out = Path(out_dir).expanduser().resolve()
    real_dir = Path(real_dir).expanduser().resolve() if real_dir else default_real_dir()
    prepare_out(out, overwrite, _OWNED)
    import torch

    saved_threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(int(settings.threads))
    try:
        return _run(out, real_dir, settings, echo)
    finally:
        torch.set_num_threads(saved_threads)


def _run(out: Path, real_dir: Path, settings: BenchSettings, echo) -> dict:
    import torch

    from ..grpo import train_grpo
    from ..prepare import PrepareSettings, load_samples, prepare
    from ..sft import train_sft

    timings: Dict[str, float] = {}
    t_all = time.perf_counter()

    def phase(name):
        class _Phase:
            def __enter__(self):
                echo(f"[{name}] …")
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timings[name] = round(time.perf_counter() - self.t, 1)
                if exc[0] is None:
                    echo(f"[{name}] {timings[name]:.1f} s")
        return _Phase()

    with phase("data"):
        manifest, rows = build_cases(out, real_dir, settings)
        summary = prepare(manifest, out / "data", PrepareSettings(seed=settings.seed, top_k=1, negative_fraction=0.0),
                          progress=False)
        short_think_targets(out / "data")
        train = load_samples(out / "data", "train")
        test = select_test_samples(load_samples(out / "data", "test"), settings.max_test_samples)
        echo(f"  {len(rows)} cases ({sum(r['split'] == 'train' for r in rows)} train, "
             f"{sum(r['split'] == 'test' for r in rows)} test); {len(train)} train samples, {len(test)} of "
             f"{summary['samples_by_split']['test']} test samples scored, {len({s['label'] for s in train})} labels")
        prior_box = label_prior_box(train, test)
        prior = prior_boxes(train)
        echo(f"  content-blind reference (each label's mean training box, on the true key slice): box {prior_box:.3f}")
        # the swapped-slices ablation shows each test crop another test band's crop (other organs' levels)
        band_of = {r["id"]: next((i for i, (a, b) in enumerate(TEST_BANDS) if a <= r["patient_z"][0] < b), -1)
                   for r in rows if r["split"] == "test"}
        group = lambda smp: band_of.get(smp["case_id"])  # noqa: E731
        if len({group(smp) for smp in test}) < 2:  # a small run may score one band only: another crop then
            group = lambda smp: smp["case_id"]  # noqa: E731
        ablation_kinds = ABLATIONS if len({group(smp) for smp in test}) > 1 else ("black",)
        partners = swap_partners(test, group=group) if "swapped" in ablation_kinds else None
        if "swapped" not in ablation_kinds:
            echo("  every scored test sample shows the same crop: the swapped-slices ablation is skipped")
    with phase("model"):
        model_dir = build_model(out / "model", settings.model, corpus=tokenizer_corpus(train),
                                vocab_size=settings.vocab_size, patch_size=settings.image_patch)
        n_params = count_parameters(model_dir)
        echo(f"  {settings.model} Qwen3-VL, {n_params} parameters, in {model_dir}")
    with phase("sft"):
        sft = train_sft(out / "data", out / "runs" / "sft", _sft_settings(settings, model_dir), overwrite=True)
        echo(f"  {sft['global_step']} steps, loss {sft['loss_first']:.3f} → {sft['loss_last']:.3f}")
    with phase("grpo"):
        grpo = train_grpo(out / "data", out / "runs" / "grpo", _grpo_settings(settings, model_dir),
                          adapter=out / "runs" / "sft" / "adapter", overwrite=True,
                          random_weights=settings.sam_seed if settings.lambda_consistency > 0 else None)
        last = grpo["history"][-1] if grpo["history"] else {}
        echo("  " + f"{grpo['global_step']} steps; last step: " + ", ".join(
            f"{k.split('/')[1]} {v:.3f}" for k, v in last.items() if k.startswith("rewards/") and k.endswith("/mean")))

    from medvolcore.propagation import MedSAM2Propagator

    from ..rewards import ConsistencyScorer

    scorer = ConsistencyScorer(MedSAM2Propagator.from_random(settings.sam_seed, image_size=64), delta=settings.delta)
    adapters = {"untrained": None, "sft": out / "runs" / "sft" / "adapter", "grpo": out / "runs" / "grpo" / "adapter"}
    evals = {}
    for name in MODELS:
        with phase(f"eval_{name}"):
            evals[name] = evaluate_model(model_dir, adapters[name], test, settings, scorer, label=name,
                                         prior=prior if name != "untrained" else None)
            m = evals[name]["means"]
            echo("  " + ", ".join(f"{t} {m[t]:.3f}" for t in (*TERMS, "total")))
    # image ablations of the trained models: the same prompts and seeds, the slices blacked out or swapped
    ablations: Dict[str, Dict[str, dict]] = {}
    for name in ("sft", "grpo"):
        ablations[name] = {"own": evals[name]["means"]}
        for images in ablation_kinds:
            with phase(f"eval_{name}_{images}"):
                ev = evaluate_model(model_dir, adapters[name], test, settings, scorer, label=f"{name} {images}",
                                    images=images, partners=partners, prior=prior)
                ablations[name][images] = ev["means"]
                echo("  " + ", ".join(f"{t} {ev['means'][t]:.3f}" for t in (*TERMS, "total")))
    timings["total"] = round(time.perf_counter() - t_all, 1)

    result = {name: {k: round(v, 4) for k, v in evals[name]["means"].items()
                     if k in (*TERMS, "total")} for name in MODELS}
    result.update({
        "reference": {"label_prior_box": round(prior_box, 4),
                      "what": "box reward of each label's mean training key-slice boxes against the test "
                              "samples' boxes on their true key slice: a model that never looks at the image",
                      "label_prior_box_on_model_slice": {n: round(evals[n]["means"]["box_prior_same_slice"], 4)
                                                         for n in ("sft", "grpo")},
                      "what_on_model_slice": "the same content-blind boxes scored on the slice each of the model's "
                                             "completions chose (0 where the completion does not parse): the model's "
                                             "box column with the slice choice held equal"},
        "ablations": ablation_table(ablations),
        "settings": asdict(settings),
        "timings_s": timings,
        "data": {"cases": rows, "train_samples": len(train), "test_samples_scored": [s["id"] for s in test],
                 "test_samples_prepared": summary["samples_by_split"]["test"],
                 "train_labels": sorted({s["label"] for s in train}), "train_bands": TRAIN_BANDS,
                 "test_bands": TEST_BANDS},
        "model": {"size": settings.model, "parameters": n_params, "dir": str(model_dir)},
        "torch_threads": torch.get_num_threads(),
        "evaluation": {"samples_per_prompt": settings.samples_per_prompt, "temperature": settings.temperature,
                       "top_p": settings.top_p, "top_k": settings.top_k, "constrained": False,
                       "max_new_tokens": settings.max_completion_length, "completions_per_model": evals["sft"]["completions"],
                       "consistency": f"MedSAM2 with seeded random weights (seed {settings.sam_seed}, 64 px), "
                                      f"delta {settings.delta}: noise, not a measure of segmentation",
                       "per_model": {n: {k: evals[n][k] for k in ("per_label_total", "mean_completion_tokens",
                                                                  "examples")} for n in MODELS}},
    })
    result["training"] = {
        "sft": {k: sft[k] for k in ("global_step", "seconds", "seconds_per_step", "loss_first", "loss_last",
                                    "loss_history")},
        "grpo": {k: grpo[k] for k in ("global_step", "seconds", "seconds_per_step", "reward_weights",
                                      "reward_failures", "history")}}
    result["notes"] = [
        "Both CTs are one patient: the test split is held out by z-range of that patient (no test slice is a "
        "training slice) and by description, not by patient.",
        "MedSAM2 has random weights: the consistency column is computed and reported but is noise; GRPO "
        f"trained with lambda_consistency = {settings.lambda_consistency}.",
        "The model is a small Qwen3-VL with random initial weights built locally (no download); its answers "
        "mean nothing outside this benchmark.",
        f"Sampling (GRPO rollouts and evaluation, no grammar): temperature {settings.temperature}, top_p "
        f"{settings.top_p}, top_k {settings.top_k} (the grounder's 'real' preset), {settings.samples_per_prompt} "
        "seeded samples per test prompt, the same seeds for every model.",
        "SFT targets use one short reasoning template (short_think_targets); no reward reads the reasoning.",
    ] + (["--quick: a few steps only, a smoke test of the pipeline; the numbers mean nothing."] if settings.quick
         else [])
    same = result["reference"]["label_prior_box_on_model_slice"]
    table = learning_table(result) + (f"\n\nContent-blind reference: each label's mean training box on the true key "
                                    f"slice scores box {prior_box:.3f}; on the slices the models chose, "
                                    f"{same['sft']:.3f} (SFT's) and {same['grpo']:.3f} (GRPO's).")
    plot_curves(out / "curves.png", sft["loss_history"], grpo["history"],
                title=f"MedVol-R1 learning benchmark ({settings.model} model, seed {settings.seed})")
    write_result(out, result, table)
    echo("")
    echo(table)
    echo("")
    echo("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    echo(f"wrote {out / RESULT}, {out / 'table.md'} and {out / 'curves.png'}")
    return result


__all__ = ["BenchSettings", "run_benchmark", "build_cases", "evaluate_model", "sample_completions",
           "select_test_samples", "default_real_dir", "TRAIN_BANDS", "TEST_BANDS", "prior_boxes", "label_prior_box"]
