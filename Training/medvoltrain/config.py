"""Training configuration: a dataclass whose defaults are the MedVol-R1 paper's SFT settings.

Order of precedence: the dataclass defaults < the YAML file (``--config``) < the command line's
named options (``--preset``, ``--max-steps``) < ``key=value`` overrides. Every key is checked: an
unknown key is refused with the list of valid keys, a value of the wrong type is refused naming
the expected type. ``Training/configs/sft.yaml`` spells the defaults out.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional, Union

from .errors import ConfigError

LORA_SCOPES = ("language", "language+vision")


@dataclass
class ModelSettings:
    """The base model and the LoRA both stages use."""

    # -- model: a preset of Resources/models.json, or a Qwen3-VL folder (model_path wins) --
    # None: the manifest's default preset (qwen3-vl-4b = Qwen3-VL-4B-Instruct, the paper's base model),
    # resolved by load_settings so that a run's recorded settings name it
    preset: Optional[str] = None
    model_path: Optional[str] = None
    # -- LoRA (paper: rank 128, all linear layers); GRPO uses it only when it starts without an SFT adapter --
    lora_r: int = 128
    lora_alpha: int = 256  # 2·r: the usual choice at this rank; keeps the update scale alpha/r = 2 at lr 2e-5
    lora_dropout: float = 0.05
    lora_scope: str = "language"  # every linear layer of the language model; "language+vision" adds the vision tower
    # modules trained in full beside the LoRA and saved in the adapter (PEFT's modules_to_save), comma-separated,
    # e.g. "embed_tokens,lm_head"; empty (the paper's recipe): none. Meant for small models trained from random
    # weights (the learning benchmark): for Qwen3-VL-4B it would store 2 × 151k × 2560 weights in the adapter.
    lora_modules_to_save: str = ""

    def preset_name(self) -> str:
        """``preset``, or the manifest's default preset when it is None."""
        from medvolcore.models import default_preset

        return self.preset or default_preset()

    def modules_to_save(self) -> Optional[list]:
        names = [n.strip() for n in str(self.lora_modules_to_save or "").split(",") if n.strip()]
        return names or None


@dataclass
class TrainSettings(ModelSettings):
    """What both stages share: optimisation and bookkeeping (defaults = the SFT stage's; GRPO
    redeclares the ones the paper sets differently)."""

    # -- optimisation (paper) --
    learning_rate: float = 2e-5
    num_train_epochs: float = 1.0
    max_steps: int = -1  # > 0 stops after that many optimiser steps (smoke runs, tests)
    gradient_accumulation_steps: int = 1
    optim: str = "adamw_torch"
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    lr_scheduler_type: str = "cosine"
    max_grad_norm: float = 1.0
    bf16: Union[bool, str] = "auto"  # auto: bfloat16 where the GPU supports it, else fp32 (with a notice)
    gradient_checkpointing: bool = True
    # -- bookkeeping --
    seed: int = 42
    logging_steps: int = 10
    save_steps: int = 500
    save_total_limit: Optional[int] = 3
    report_to: str = "tensorboard"  # "none" to switch logging off
    dataloader_num_workers: int = 2
    split: str = "train"
    max_samples: Optional[int] = None  # use only the first N samples (smoke runs)
    deepspeed: Optional[str] = None  # a DeepSpeed json (e.g. Training/configs/zero2.json); usually set by accelerate

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self):
        if self.lora_scope not in LORA_SCOPES:
            raise ConfigError(f"lora_scope must be one of {', '.join(LORA_SCOPES)}, got {self.lora_scope!r}")
        if not (self.bf16 in (True, False) or self.bf16 == "auto"):
            raise ConfigError(f"bf16 must be true, false or auto, got {self.bf16!r}")
        for key in ("lora_r", "lora_alpha", "per_device_train_batch_size", "gradient_accumulation_steps",
                    "logging_steps", "save_steps"):
            if hasattr(self, key) and getattr(self, key) < 1:
                raise ConfigError(f"{key} must be ≥ 1, got {getattr(self, key)}")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"max_steps must be -1 (whole epochs) or ≥ 1, got {self.max_steps}")
        if self.split not in ("train", "test"):
            raise ConfigError(f"split must be train or test, got {self.split!r}")
        return self


@dataclass
class SFTSettings(TrainSettings):
    """Cold-start SFT settings (defaults = the paper's recipe: lr 2e-5, 1 epoch, batch 2 per GPU)."""

    per_device_train_batch_size: int = 2


DELTAS = (2, 5, 10, 15)  # the paper's ablation of the consistency window


@dataclass
class GRPOSettings(TrainSettings):
    """GRPO settings (defaults = the paper's second stage where the paper gives one).

    ``prompts_per_device`` is the paper's "per-GPU batch 1": one prompt per GPU per step, whose
    ``num_generations`` rollouts form its group (TRL counts completions, so its
    ``per_device_train_batch_size`` is ``prompts_per_device × num_generations``).
    """

    # -- GRPO (paper) --
    num_generations: int = 4
    beta: float = 0.01  # KL to the frozen reference = TRL's frozen copy of the SFT adapter
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0  # rollout nucleus sampling (1.0 = off, TRL's default)
    top_k: int = 0  # rollout top-k sampling (0 = off, TRL's default)
    prompts_per_device: int = 1
    use_vllm: bool = False  # optional: TRL's vLLM generation where vllm is installed
    # -- rewards: λ per term (0 switches a term off) and the consistency window Δ --
    lambda_format: float = 1.0
    lambda_axial: float = 1.0
    lambda_box: float = 1.0
    lambda_consistency: float = 1.0
    delta: int = 5
    # early stop inside the consistency window (0 = every window slice, the paper's reward; K > 0
    # skips the rest of a direction once the masks have been empty on K slices, which then count
    # as predicted empty: the Dice is still taken over the whole window)
    consistency_stop_after_empty: int = 0
    # -- feedback while training --
    # warn when every group's rewards have been equal (TRL's frac_reward_zero_std = 1: zero advantages,
    # no learning signal) for this many steps in a row; 0 never warns
    zero_std_warn_steps: int = 5
    log_completions: bool = False  # TRL's: print sampled completions (rich) at every log, RUN/checkpoints/completions/*.parquet
    # periodic evaluation (TRL's eval_strategy "steps"): rewards of G rollouts per prompt of eval_split every
    # eval_steps steps, logged as eval_* (TensorBoard, training.json); 0 = off
    eval_steps: int = 0
    eval_split: str = "test"
    eval_max_samples: Optional[int] = None  # only the first N samples of eval_split
    # -- shared settings with other defaults here (lr and epochs are the paper's) --
    learning_rate: float = 2e-6
    num_train_epochs: float = 3.0
    logging_steps: int = 1
    save_steps: int = 100
    dataloader_num_workers: int = 0

    @property
    def reward_weights(self) -> dict:
        return {"format": self.lambda_format, "axial": self.lambda_axial, "box": self.lambda_box,
                "consistency": self.lambda_consistency}

    def validate(self) -> "GRPOSettings":
        super().validate()
        if self.num_generations < 2:
            raise ConfigError(f"num_generations must be ≥ 2 (GRPO compares rollouts within a group), got "
                              f"{self.num_generations}")
        for key in ("prompts_per_device", "max_completion_length"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be ≥ 1, got {getattr(self, key)}")
        if self.beta < 0 or not self.temperature > 0:
            raise ConfigError(f"beta must be ≥ 0 and temperature > 0, got beta={self.beta}, temperature={self.temperature}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"top_p must be in (0, 1] and top_k ≥ 0, got top_p={self.top_p}, top_k={self.top_k}")
        if self.delta < 0:
            raise ConfigError(f"delta must be ≥ 0 (the paper's ablation uses {', '.join(map(str, DELTAS))}), got {self.delta}")
        for key in ("zero_std_warn_steps", "eval_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be ≥ 0 (0 = off), got {getattr(self, key)}")
        if self.eval_split not in ("train", "test"):
            raise ConfigError(f"eval_split must be train or test, got {self.eval_split!r}")
        if self.eval_max_samples is not None and self.eval_max_samples < 1:
            raise ConfigError(f"eval_max_samples must be ≥ 1 or null (all), got {self.eval_max_samples}")
        if self.consistency_stop_after_empty < 0:
            raise ConfigError("consistency_stop_after_empty must be ≥ 0 (0 = propagate the whole window, the paper's "
                              f"reward), got {self.consistency_stop_after_empty}")
        weights = self.reward_weights
        if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
            raise ConfigError(f"reward weights must be ≥ 0 with at least one > 0, got {weights}")
        return self


def valid_keys(cls=None) -> list:
    return [f.name for f in fields(cls or SFTSettings)]


def _types(tp) -> tuple:
    origin = typing.get_origin(tp)
    if origin is Union:
        return tuple(t for a in typing.get_args(tp) for t in _types(a))
    return (tp,)


def _coerce(key: str, value, tp):
    kinds = _types(tp)
    if value is None and type(None) in kinds:
        return None
    if isinstance(value, str):
        import yaml

        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        # text becomes a number/bool/null where the field takes one ("false" for bf16: auto|bool)
        if str not in kinds or (parsed is None and type(None) in kinds) or \
                (isinstance(parsed, bool) and bool in kinds):
            value = parsed
    if isinstance(value, str) and str in kinds:
        return value
    if isinstance(value, str) and float in kinds:
        try:
            value = float(value)  # YAML 1.1 reads "5e-3" as text
        except ValueError:
            pass
    if isinstance(value, bool):
        if bool in kinds:
            return value
    elif isinstance(value, int) and int in kinds:
        return value
    elif isinstance(value, (int, float)) and float in kinds:
        return float(value)
    if value is None and type(None) in kinds:
        return None
    names = " or ".join("null" if t is type(None) else t.__name__ for t in kinds)
    raise ConfigError(f"{key} must be {names}, got {value!r}")


def apply(settings, values: dict, where: str):
    """``settings`` with ``values`` applied; unknown keys and wrong types → :class:`ConfigError`."""
    hints = typing.get_type_hints(type(settings))
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} in {where}; valid keys: "
                          f"{', '.join(valid_keys(type(settings)))}")
    changes = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    return dataclasses.replace(settings, **changes)


def parse_overrides(items, cls=None) -> dict:
    """``["key=value", …]`` → dict (values still text; :func:`apply` converts them)."""
    out = {}
    for item in items or []:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"override {item!r} is not key=value; valid keys: {', '.join(valid_keys(cls))}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def load_settings(config: Optional[str] = None, overrides: Optional[dict] = None, cls=None, **named):
    """Defaults of ``cls`` (:class:`SFTSettings` unless given), then the YAML ``config``, then
    ``named`` (non-None), then ``overrides``."""
    s = (cls or SFTSettings)()
    if config:
        import yaml

        path = Path(config).expanduser()
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a mapping of key: value")
        s = apply(s, data, str(path))
    s = apply(s, {k: v for k, v in named.items() if v is not None}, "the command line")
    s = apply(s, dict(overrides or {}), "the overrides")
    if s.preset is None:
        s = dataclasses.replace(s, preset=s.preset_name())
    return s.validate()


__all__ = ["ModelSettings", "TrainSettings", "SFTSettings", "GRPOSettings", "DELTAS", "load_settings", "parse_overrides", "apply", "valid_keys", "LORA_SCOPES"]
