"""GRPO with the four MedVol-R1 rewards: TRL's ``GRPOTrainer`` on a prepared set, starting from the
SFT adapter, writing ``RUN/adapter/``.

What is ours and what is TRL's
------------------------------
* **The prompt** is the grounder's own (:meth:`QwenVLGrounder.inputs_from_images`), as in SFT and
  at inference. TRL builds VLM prompts with a processor chat template, which our grounder does not
  use (it needs no torchvision and no video processor), so
  :class:`~medvoltrain._grpo_trainer.GrounderGRPOTrainer` (a module of its own, imported only to
  train, so that importing this one loads neither torch nor trl) overrides three hooks:
  ``_tokenize_prompts`` returns our prompt ids and image inputs for generation;
  ``_get_per_token_logps_and_entropies`` adds the same image inputs to the forward passes that
  score completions inside generation (old policy, reference); ``_generate_and_score_completions``
  attaches each row's images to the batch it returns, so TRL's shuffling, accumulation split and
  loss pass keep every row with its own pixels. Images belong to the *sample* a row was generated
  for: the prompt text alone cannot tell two volumes apart. Everything else — sampling G rollouts
  per prompt, group-normalised advantages, the clipped objective with the KL term, LoRA via PEFT,
  checkpoints, resume, logging, ``accelerate launch`` — is TRL's.
* **Rollouts sample the policy itself** (temperature 1, no constrained decoding: a grammar would
  hide the format errors the format reward is there to teach away).
* **The reference** for the KL term (β = 0.01) is the SFT model: TRL adds a frozen copy of the
  loaded adapter (named ``ref``) and scores the reference with it; a new LoRA (no ``--adapter``)
  is scored against the base model with the adapter disabled. Only the trained adapter
  (``default``) is saved.
* **Rewards** are :class:`medvoltrain.rewards.RewardFunctions`: one TRL reward function per term,
  weighted by ``lambda_*`` (0 switches a term off), consistency on MedSAM2 with features shared
  across the group.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

from medvolcore.errors import DependencyError, ModelError

from .adapter import adapter_metadata
from .config import GRPOSettings
from .errors import ConfigError, DataError
from .prepare import load_samples
from .rewards import ConsistencyScorer, RewardFunctions
from .distributed import describe
from .runs import open_run, save_adapter, step_of, tensorboard_dir, trainer_arguments, write_summary
from .sft import load_grounder, lora_target_modules, resolve_model_dir, use_bf16

log = logging.getLogger(__name__)

COLUMNS = ("sample_id", "slice_areas", "gt_boxes_norm")


def grpo_dataset(samples):
    """A ``datasets.Dataset`` with TRL's ``prompt`` column (the sample id: the trainer rebuilds the
    real prompt) and the columns the rewards read."""
    from datasets import Dataset

    rows = [{"prompt": s["id"], "sample_id": s["id"], "slice_areas": [int(a) for a in s["slice_areas"]],
             "gt_boxes_norm": json.dumps(s["gt_boxes_norm"])} for s in samples]
    return Dataset.from_list(rows)


VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def _suppressed_ids(tokenizer) -> list:
    """Vision placeholder tokens may never be sampled: one in a completion would be read as an
    image slot in the scoring forward pass (and is never a valid answer anyway)."""
    ids = []
    for t in VISION_TOKENS:
        i = tokenizer.convert_tokens_to_ids(t)
        if i is not None and i != tokenizer.unk_token_id:
            ids.append(int(i))
    return ids


def _grpo_config(settings: GRPOSettings, run: Path, bf16: bool, weights, suppress=(), evaluate: bool = False):
    from trl import GRPOConfig

    per_device = settings.prompts_per_device * settings.num_generations
    feedback = dict(log_completions=settings.log_completions,
                    eval_strategy="steps" if evaluate else "no", eval_steps=settings.eval_steps or None,
                    per_device_eval_batch_size=per_device)
    return GRPOConfig(**trainer_arguments(settings, run, bf16), **feedback,
                      num_generations=settings.num_generations, beta=settings.beta,
                      max_completion_length=settings.max_completion_length, temperature=settings.temperature,
                      top_p=settings.top_p, top_k=settings.top_k,
                      per_device_train_batch_size=per_device,
                      reward_weights=list(weights), use_vllm=settings.use_vllm,
                      generation_kwargs={"suppress_tokens": list(suppress)} if suppress else None)


def make_scorer(settings: GRPOSettings, sam_checkpoint=None, random_weights: Optional[int] = None, device="cpu"):
    """The MedSAM2 that scores consistency (None when that term is off)."""
    if settings.lambda_consistency <= 0:
        return None
    from medvolcore.propagation import MedSAM2Propagator

    if sam_checkpoint and random_weights is not None:
        raise ConfigError("give either --sam-checkpoint or --random-weights, not both")
    if sam_checkpoint:
        prop = MedSAM2Propagator.from_checkpoint(sam_checkpoint, device=device)
    elif random_weights is not None:
        prop = MedSAM2Propagator.from_random(int(random_weights), image_size=64 if device == "cpu" else 512,
                                             device=device)
    else:
        from medvolcore import models

        m = models.resolve(settings.preset)
        if m.sam_checkpoint is not None:
            prop = MedSAM2Propagator.from_checkpoint(m.sam_checkpoint, device=device)
        else:
            seed, size = m.sam_random
            prop = MedSAM2Propagator.from_random(seed, image_size=size, device=device)
    return ConsistencyScorer(prop, delta=settings.delta, stop_after_empty=settings.consistency_stop_after_empty)


def _policy(grounder, adapter, settings: GRPOSettings):
    """The trainable policy: the SFT adapter on the base (``is_trainable``), or a new LoRA."""
    from peft import LoraConfig, PeftModel

    if adapter is None:
        log.warning("GRPO without an SFT adapter: a new LoRA starts from the base model (the paper reports that "
                    "RL without cold-start SFT does not converge; this is the ablation)")
        return grounder.model, LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha,
                                          lora_dropout=settings.lora_dropout,
                                          target_modules=lora_target_modules(settings.lora_scope), bias="none",
                                          modules_to_save=settings.modules_to_save(), task_type="CAUSAL_LM")
    from medvolcore import models

    # the SFT adapter must record this run's base model (medvol_adapter.json), as for `medvol segment`
    preset = None if settings.model_path else models.get_preset(settings.preset_name())
    folder = models.check_adapter_dir(adapter, preset)
    try:
        model = PeftModel.from_pretrained(grounder.model, str(folder), is_trainable=True)
    except (ValueError, RuntimeError, KeyError, OSError) as e:
        raise ModelError(f"the adapter {folder} does not fit the base model {settings.model_path or settings.preset}: "
                         f"{str(e).splitlines()[0]}") from None
    return model, None


def train_grpo(data_dir, run_dir, settings: GRPOSettings, adapter=None, resume: bool = False,
               overwrite: bool = False, sam_checkpoint=None, random_weights: Optional[int] = None) -> dict:
    """Run GRPO; returns a summary (steps, reward means per step, KL, failures) also written to
    ``RUN/training.json``."""
    try:
        import trl  # noqa: F401
    except ImportError as e:
        raise DependencyError(f"GRPO needs trl ({e}); install it with `pip install -e Training`") from None

    run, checkpoint = open_run(run_dir, resume, overwrite)
    samples = load_samples(data_dir, settings.split)
    if settings.max_samples is not None:
        samples = samples[: max(0, int(settings.max_samples))]
    if not samples:
        raise DataError(f"{data_dir} has no {settings.split!r} samples to train on")
    eval_samples = []
    if settings.eval_steps:
        eval_samples = load_samples(data_dir, settings.eval_split)[: settings.eval_max_samples]
        if not eval_samples:
            raise DataError(f"eval_steps={settings.eval_steps}: {data_dir} has no {settings.eval_split!r} samples "
                            "to evaluate on (set eval_split, or eval_steps=0)")
    if adapter is not None and not Path(adapter).expanduser().is_dir():
        raise ModelError(f"--adapter {adapter} is not a folder; give RUN/adapter of `medvol-train sft`")
    model_dir = resolve_model_dir(settings)
    bf16 = use_bf16(settings)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    scorer = make_scorer(settings, sam_checkpoint, random_weights, device=device)
    grounder = load_grounder(model_dir, bf16)
    model, peft_config = _policy(grounder, adapter, settings)
    rewards = RewardFunctions(tokenizer=grounder.tokenizer, scorer=scorer,
                              samples={s["id"]: s for s in samples + eval_samples})
    funcs, weights = rewards.functions(settings.reward_weights)
    run.mkdir(parents=True, exist_ok=True)
    args = _grpo_config(settings, run, bf16, weights, _suppressed_ids(grounder.tokenizer), evaluate=bool(eval_samples))
    from ._grpo_trainer import GrounderGRPOTrainer, ZeroRewardStdWarning

    t0 = time.perf_counter()
    with tensorboard_dir(run):
        trainer = GrounderGRPOTrainer(model=model, reward_funcs=funcs, args=args,
                                      train_dataset=grpo_dataset(samples), processing_class=grounder.tokenizer,
                                      eval_dataset=grpo_dataset(eval_samples) if eval_samples else None,
                                      peft_config=peft_config, grounder=grounder, samples=samples + eval_samples,
                                      callbacks=[ZeroRewardStdWarning(settings.zero_std_warn_steps)])
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    seconds = time.perf_counter() - t0
    out_adapter = save_adapter(trainer, run, adapter_metadata(
        "grpo", settings, model_dir, data_dir, started_from=adapter,
        reward_weights=dict(zip([f.__name__ for f in funcs], weights))))
    history = [h for h in trainer.state.log_history if "loss" in h]
    keys = [k for k in (history[0] if history else {}) if k.startswith("rewards/") or k in
            ("loss", "kl", "reward", "reward_std", "frac_reward_zero_std", "learning_rate", "completions/mean_length")]
    evaluations = [{k: v for k, v in h.items() if k == "step" or k.startswith("eval_")}
                   for h in trainer.state.log_history if "eval_loss" in h]
    summary = {"adapter": str(out_adapter), "base_model": str(model_dir), "started_from": str(adapter) if adapter else None,
               "samples": len(samples), "global_step": int(trainer.state.global_step),
               "resumed_from": str(checkpoint) if checkpoint else None, "bf16": bf16, "seconds": round(seconds, 2),
               "seconds_per_step": round(seconds / max(1, trainer.state.global_step - step_of(checkpoint)), 3),
               "reward_weights": dict(zip([f.__name__ for f in funcs], weights)),
               "reward_failures": dict(rewards.failures),
               "history": [{"step": h["step"], **{k: h[k] for k in keys if k in h}} for h in history],
               "evaluations": evaluations,
               "settings": settings.to_dict(),
               "distributed": describe(trainer)}
    write_summary(trainer, run, summary)
    return summary


__all__ = ["train_grpo", "grpo_dataset", "make_scorer"]
