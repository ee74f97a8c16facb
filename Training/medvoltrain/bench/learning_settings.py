"""The learning benchmark's settings (:class:`BenchSettings`): the task's size, the model, SFT, GRPO,
sampling and evaluation, each with why it is what it is (:mod:`.learning` runs them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from medvolcore.errors import InputError

from .model import MODEL_SIZES


@dataclass
class BenchSettings:
    """Everything the benchmark does; ``quick()`` is the few-step smoke version used by the tests."""

    seed: int = 0
    # a key of MODEL_SIZES; "seeing" (the vision stage's model) because with the tiny sizes the trained
    # adapters scored the same with their slices blacked out (docs/learning-benchmarks.md, "Image ablations on the real CTs")
    model: str = "seeing"
    # BPE vocabulary learnt from the training split's text (0: the tiny preset's 640-merge tokenizer)
    vocab_size: int = 2048
    # vision patch of the bench model (the tiny preset's is 16: 64 tokens per 256 × 256 slice; 32 gives 16)
    image_patch: int = 32
    # -- cases --
    train_cases: int = 240  # ≈ 1290 samples: SFT sees each about 4 times (60 crops: 13 times)
    test_cases: int = 10  # two per test band
    crop_min: int = 6
    crop_max: int = 10
    max_shift: int = 10  # in-plane shift, pixels of the 122 × 101 slice, each axis
    hu_scale: float = 0.08  # HU' = HU · U(1 − s, 1 + s) + U(−o, o)
    hu_offset: float = 30.0
    sm_fraction: float = 0.5  # share of the train crops within z < 30 taken from example_ct_sm + example_seg
    max_test_samples: int = 64  # at most this many test samples (round-robin over labels)
    # -- SFT --
    sft_steps: int = 2500
    sft_lr: float = 1e-3  # 5e-3 with the vision tower trained in full made its output constant (ablations all equal)
    sft_batch: int = 2
    lora_r: int = 32
    lora_alpha: int = 64
    # trained in full beside the LoRA (PEFT modules_to_save): a LoRA on a *random* model cannot move its
    # token embeddings, and without that it never learnt which organ a query names; nor its random vision
    # tower (docs/learning-benchmarks.md, "Training." under the learning benchmark)
    lora_modules_to_save: str = "embed_tokens,lm_head,visual,q_norm,k_norm"
    # -- GRPO --
    grpo_steps: int = 150
    grpo_lr: float = 1e-4
    num_generations: int = 4
    beta: float = 0.01
    lambda_consistency: float = 0.0
    delta: int = 5
    max_completion_length: int = 112
    # -- sampling, the same for the GRPO rollouts and the evaluation; None: the grounder's "real" preset
    #    (Resources/prompts/grounder.json: temperature 0.7, top_p 0.8, top_k 20) --
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    # -- evaluation --
    samples_per_prompt: int = 4
    sam_seed: int = 0
    # torch threads for the whole run (None: leave torch's choice). One thread by default: on a
    # shared 2-core machine two threads spin against the other jobs (measured: docs/learning-benchmarks.md).
    threads: Optional[int] = 1
    quick: bool = False

    @classmethod
    def quick_settings(cls, **kw) -> "BenchSettings":
        base = dict(train_cases=4, test_cases=2, max_test_samples=3, sft_steps=3, grpo_steps=2, num_generations=2,
                    samples_per_prompt=2, max_completion_length=48, model="tiny", quick=True)
        base.update(kw)
        return cls(**base)

    def validate(self) -> "BenchSettings":
        from medvolcore.grounder import resolve_settings

        real = resolve_settings("real")
        for key in ("temperature", "top_p", "top_k"):
            if getattr(self, key) is None:
                setattr(self, key, real[key])
        if self.model not in MODEL_SIZES:
            raise InputError(f"model must be one of {', '.join(MODEL_SIZES)}, got {self.model!r}")
        for key in ("train_cases", "test_cases", "crop_min", "sft_steps", "grpo_steps", "sft_batch",
                    "samples_per_prompt", "max_test_samples", "max_completion_length"):
            if getattr(self, key) < 1:
                raise InputError(f"{key} must be ≥ 1, got {getattr(self, key)}")
        if self.image_patch not in (16, 32, 64):
            raise InputError(f"image_patch must be 16, 32 or 64 (a 256-pixel slice in whole merged patches), "
                             f"got {self.image_patch}")
        if self.vocab_size < 0:
            raise InputError(f"vocab_size must be ≥ 0 (0: the tiny preset's tokenizer), got {self.vocab_size}")
        if self.num_generations < 2:
            raise InputError(f"num_generations must be ≥ 2, got {self.num_generations}")
        if self.crop_max < self.crop_min:
            raise InputError(f"crop_max ({self.crop_max}) < crop_min ({self.crop_min})")
        if self.lambda_consistency < 0:
            raise InputError(f"lambda_consistency must be ≥ 0, got {self.lambda_consistency}")
        if self.threads is not None and self.threads < 0:
            raise InputError(f"threads must be ≥ 0 (0: torch's choice), got {self.threads}")
        return self
