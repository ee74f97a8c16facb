"""Cold-start SFT with LoRA: TRL's ``SFTTrainer`` on a prepared set, writing ``RUN/adapter/``.

What is ours and what is the libraries'
---------------------------------------
* **The prompt** is the grounder's own (:meth:`medvolcore.grounder.QwenVLGrounder.inputs_from_images`):
  same templates, same shown slices and tags, same window text, same PIL image processor and
  image-token runs, same ``mm_token_type_ids``. So the adapter sees at training exactly what it
  sees behind ``medvol segment --adapter``. No processor chat template, no torchvision.
* **The completion** is the sample's target text tokenised as the model would generate it
  (added tokens such as ``<think>`` kept whole) followed by ``<|im_end|>``, the end-of-turn token
  the grounder stops on.
* **The collator** (:class:`GrounderSFTCollator`) builds ``input_ids``, ``attention_mask``,
  ``labels`` (−100 on the prompt and on padding: the loss is on the completion only),
  ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` for a batch of samples of 64
  images each (right padding).
* **TRL / PEFT / transformers do the rest**: LoRA wrapping (``peft_config``), the optimiser and
  schedule, gradient checkpointing, bf16, checkpoints and resume, TensorBoard logging of loss and
  learning rate, multi-GPU through ``accelerate launch`` (DDP or DeepSpeed ZeRO-2).

LoRA: rank 128 on every linear layer of the language model (q, k, v, o, gate, up, down of each
decoder layer); the vision tower and its mergers stay frozen by default (``lora_scope:
language+vision`` adapts them too). The paper says "all linear layers" without naming the vision
tower; the grounding signal here is in the language side (tags, boxes), the 256×256 slices are
well within what the pretrained vision encoder sees, and freezing it halves the activation memory
that must be kept for backward through 64 images.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import List

from medvolcore.errors import DependencyError, ModelError

from .adapter import adapter_metadata
from .config import SFTSettings
from .errors import ConfigError, DataError
from .prepare import load_samples, load_slices
from .distributed import describe
from .runs import open_run, save_adapter, step_of, tensorboard_dir, trainer_arguments, write_summary

log = logging.getLogger(__name__)

LANGUAGE_TARGETS = r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
VISION_TARGETS = (r".*visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])|merger\.linear_fc[12]"
                  r"|deepstack_merger_list\.\d+\.linear_fc[12])")
IGNORE_INDEX = -100
SAMPLE_COLUMNS = ("id", "query", "target", "shown", "depth", "slices_file", "data_dir", "prompt_window")


def lora_target_modules(scope: str) -> str:
    """The PEFT ``target_modules`` regular expression (matched against full module names)."""
    return LANGUAGE_TARGETS if scope == "language" else f"(?:{LANGUAGE_TARGETS})|(?:{VISION_TARGETS})"


def resolve_model_dir(settings: SFTSettings) -> Path:
    """The base model folder (``model_path`` or the preset's grounder), checked to be Qwen3-VL."""
    from medvolcore import models

    if settings.model_path:
        folder = Path(settings.model_path).expanduser()
        if not folder.is_dir():
            raise ModelError(f"model_path {folder} is not a folder; give a Qwen3-VL checkpoint folder")
    else:
        folder = models.resolve(settings.preset).grounder_dir
    models.check_grounder_dir(folder)  # ModelError naming the model type when it is not Qwen3-VL
    return Path(folder)


def use_bf16(settings: SFTSettings) -> bool:
    import torch

    available = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if settings.bf16 == "auto":
        if not available:
            log.warning("bfloat16 is not supported here (%s); training in float32",
                        "no CUDA GPU" if not torch.cuda.is_available() else "this GPU lacks bf16")
        return available
    if settings.bf16 and not available:
        raise ConfigError("bf16=true needs a CUDA GPU with bfloat16 support; set bf16=auto or bf16=false")
    return bool(settings.bf16)


def load_grounder(model_dir: Path, bf16: bool):
    """A :class:`QwenVLGrounder` around a trainable (not eval-mode) base model."""
    import torch
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from medvolcore.grounder import QwenVLGrounder

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        model = Qwen3VLForConditionalGeneration.from_pretrained(str(model_dir),
                                                                dtype=torch.bfloat16 if bf16 else torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot load the Qwen3-VL model in {model_dir}: {e}") from None
    meta_path = model_dir / "medvol_model.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    return QwenVLGrounder(model, tokenizer, processor, model_dir=model_dir, meta=meta)


class GrounderSFTCollator:
    """Batches of prepared samples → model inputs with completion-only labels (right-padded)."""

    def __init__(self, grounder):
        self.grounder = grounder
        tok = grounder.tokenizer
        self.end_id = int(tok.convert_tokens_to_ids("<|im_end|>"))
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None
                          else tok.convert_tokens_to_ids("<|endoftext|>"))

    def completion_ids(self, target: str) -> List[int]:
        ids = self.grounder.tokenizer(target, add_special_tokens=False)["input_ids"]
        return list(ids) + [self.end_id]

    def encode(self, sample: dict) -> dict:
        """One sample: prompt inputs (the grounder's), completion ids and labels."""
        import torch

        images = load_slices(sample)
        window = sample.get("prompt_window")
        inputs = self.grounder.inputs_from_images(images, sample["shown"], int(sample["depth"]), sample["query"],
                                                  window)
        prompt = inputs["input_ids"][0]
        completion = torch.tensor(self.completion_ids(sample["target"]), dtype=torch.long)
        ids = torch.cat([prompt, completion])
        labels = torch.cat([torch.full_like(prompt, IGNORE_INDEX), completion])
        mm = torch.cat([inputs["mm_token_type_ids"][0], torch.zeros_like(completion, dtype=torch.int32)])
        return {"input_ids": ids, "labels": labels, "mm_token_type_ids": mm, "pixel_values": inputs["pixel_values"],
                "image_grid_thw": inputs["image_grid_thw"]}

    def __call__(self, features: List[dict]) -> dict:
        import torch

        rows = [self.encode(f) for f in features]
        width = max(r["input_ids"].shape[0] for r in rows)

        def pad(t, value):
            return torch.cat([t, torch.full((width - t.shape[0],), value, dtype=t.dtype)])

        return {
            "input_ids": torch.stack([pad(r["input_ids"], self.pad_id) for r in rows]),
            "attention_mask": torch.stack([pad(torch.ones_like(r["input_ids"]), 0) for r in rows]),
            "labels": torch.stack([pad(r["labels"], IGNORE_INDEX) for r in rows]),
            "mm_token_type_ids": torch.stack([pad(r["mm_token_type_ids"], 0) for r in rows]),
            "pixel_values": torch.cat([r["pixel_values"] for r in rows]),
            "image_grid_thw": torch.cat([r["image_grid_thw"] for r in rows]),
        }


def training_dataset(data_dir, settings: SFTSettings):
    """The prepared samples of ``settings.split`` as a ``datasets.Dataset`` (light columns only)."""
    from datasets import Dataset

    samples = load_samples(data_dir, settings.split)
    if settings.max_samples is not None:
        samples = samples[: max(0, int(settings.max_samples))]
    if not samples:
        raise DataError(f"{data_dir} has no {settings.split!r} samples to train on")
    rows = [{k: s.get(k) for k in SAMPLE_COLUMNS} for s in samples]
    return Dataset.from_list(rows)


def _sft_config(settings: SFTSettings, run: Path, bf16: bool):
    from trl import SFTConfig

    return SFTConfig(**trainer_arguments(settings, run, bf16),
                     per_device_train_batch_size=settings.per_device_train_batch_size,
                     dataset_kwargs={"skip_prepare_dataset": True}, max_length=None)


def train_sft(data_dir, run_dir, settings: SFTSettings, resume: bool = False, overwrite: bool = False) -> dict:
    """Run SFT; returns a summary (steps, losses, seconds) also written to ``RUN/training.json``."""
    try:
        import trl  # noqa: F401
        from peft import LoraConfig
    except ImportError as e:
        raise DependencyError(f"SFT needs trl and peft ({e}); install them with `pip install -e Training`") from None

    run, checkpoint = open_run(run_dir, resume, overwrite)
    dataset = training_dataset(data_dir, settings)
    model_dir = resolve_model_dir(settings)
    bf16 = use_bf16(settings)
    grounder = load_grounder(model_dir, bf16)
    collator = GrounderSFTCollator(grounder)
    peft_config = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                             target_modules=lora_target_modules(settings.lora_scope), bias="none",
                             modules_to_save=settings.modules_to_save(), task_type="CAUSAL_LM")
    run.mkdir(parents=True, exist_ok=True)
    args = _sft_config(settings, run, bf16)
    from trl import SFTTrainer

    t0 = time.perf_counter()
    with tensorboard_dir(run):
        trainer = SFTTrainer(model=grounder.model, args=args, train_dataset=dataset, data_collator=collator,
                             processing_class=grounder.tokenizer, peft_config=peft_config)
        result = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    seconds = time.perf_counter() - t0
    adapter = save_adapter(trainer, run, adapter_metadata("sft", settings, model_dir, data_dir))
    history = [h for h in trainer.state.log_history if "loss" in h]
    summary = {"adapter": str(adapter), "base_model": str(model_dir), "samples": len(dataset),
               "global_step": int(trainer.state.global_step), "resumed_from": str(checkpoint) if checkpoint else None,
               "bf16": bf16, "seconds": round(seconds, 2),
               "seconds_per_step": round(seconds / max(1, trainer.state.global_step - step_of(checkpoint)), 3),
               "loss_first": history[0]["loss"] if history else None, "loss_last": history[-1]["loss"] if history else None,
               "loss_history": [{"step": h["step"], "loss": h["loss"], "learning_rate": h.get("learning_rate")}
                                for h in history],
               "train_loss": float(result.training_loss), "settings": settings.to_dict(),
               "distributed": describe(trainer)}
    write_summary(trainer, run, summary)
    return summary


__all__ = ["GrounderSFTCollator", "train_sft", "training_dataset", "load_grounder", "resolve_model_dir",
           "lora_target_modules", "use_bf16", "IGNORE_INDEX"]
