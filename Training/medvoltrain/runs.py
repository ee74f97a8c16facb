"""The run folder both training stages share::

    RUN/checkpoints/checkpoint-N   TRL/transformers checkpoints (``--resume`` continues the newest)
    RUN/tensorboard/               TensorBoard events
    RUN/adapter/                   the PEFT adapter + medvol_adapter.json + README.md model card (written
                                   atomically at the end; see medvoltrain.adapter)
    RUN/training.json              the stage's summary

An existing run is never overwritten without ``overwrite``; ``resume`` needs a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Optional

from medvolcore.errors import OutputExistsError

from .adapter import write_adapter_files
from .distributed import is_main_process
from .errors import DataError


def last_checkpoint(run: Path) -> Optional[Path]:
    from transformers.trainer_utils import get_last_checkpoint

    folder = Path(run) / "checkpoints"
    found = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    return Path(found) if found else None


def step_of(checkpoint: Optional[Path]) -> int:
    if checkpoint is None:
        return 0
    try:
        return int(Path(checkpoint).name.rsplit("-", 1)[-1])
    except ValueError:
        return 0


def open_run(run_dir, resume: bool, overwrite: bool) -> tuple:
    """``(run, checkpoint)``: the run folder, and the checkpoint to resume from (None: a fresh run)."""
    run = Path(run_dir).expanduser()
    if resume:
        checkpoint = last_checkpoint(run)
        if checkpoint is None:
            raise DataError(f"--resume: {run / 'checkpoints'} holds no checkpoint to resume from")
        return run, checkpoint
    if (run / "checkpoints").exists() or (run / "adapter").exists():
        if not overwrite:
            raise OutputExistsError(f"{run} already holds a run; pass --resume to continue it or --overwrite to "
                                    "start again")
        if is_main_process():  # one process clears the folder (the others may still be looking at it)
            shutil.rmtree(run / "checkpoints", ignore_errors=True)
            shutil.rmtree(run / "adapter", ignore_errors=True)
    return run, None


@contextlib.contextmanager
def tensorboard_dir(run: Path):
    """Point transformers' TensorBoard callback at ``RUN/tensorboard`` for the duration."""
    old = os.environ.get("TENSORBOARD_LOGGING_DIR")
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(Path(run) / "tensorboard")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TENSORBOARD_LOGGING_DIR", None)
        else:
            os.environ["TENSORBOARD_LOGGING_DIR"] = old


def zero3_state_dict(trainer) -> Optional[dict]:
    """Under DeepSpeed ZeRO-3 the model's weights are sharded over the processes: the whole state dict,
    gathered (a collective: every process must call this; configs/zero3.json sets
    ``stage3_gather_16bit_weights_on_model_save``), as transformers' ``Trainer.save_model`` does.
    None otherwise (the model's own weights are whole). Not run here: no GPU, no DeepSpeed."""
    engine = getattr(trainer, "deepspeed", None)
    if not getattr(trainer, "is_deepspeed_enabled", False) or engine is None:
        return None
    if (engine.config.get("zero_optimization") or {}).get("stage") != 3:
        return None
    return trainer.accelerator.get_state_dict(engine)


def save_adapter(trainer, run: Path, meta: dict) -> Path:
    """Write the trained adapter, ``medvol_adapter.json`` (``meta``, see :func:`.adapter.adapter_metadata`)
    and its model card to ``RUN/adapter`` atomically (main process only)."""
    adapter = Path(run) / "adapter"
    state_dict = zero3_state_dict(trainer)  # every process takes part in gathering ZeRO-3's shards
    if not trainer.is_world_process_zero():
        return adapter
    tmp = Path(run) / f".adapter.tmp-{uuid.uuid4().hex[:8]}"
    try:
        # only the trained adapter: GRPO's TRL also holds a frozen "ref" copy of the SFT adapter
        names = getattr(trainer.model, "peft_config", {})
        trainer.model.save_pretrained(str(tmp), **({"selected_adapters": ["default"]} if "ref" in names else {}),
                                      **({"state_dict": state_dict} if state_dict is not None else {}))
        write_adapter_files(tmp, dict(meta, steps=int(trainer.state.global_step)))  # card, metadata, Hub id
        if adapter.exists():
            shutil.rmtree(adapter)
        os.replace(tmp, adapter)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return adapter


def trainer_arguments(settings, run: Path, bf16: bool) -> dict:
    """The ``TrainingArguments`` both stages set the same way from their settings."""
    import torch

    return dict(
        output_dir=str(Path(run) / "checkpoints"),
        learning_rate=settings.learning_rate, num_train_epochs=settings.num_train_epochs, max_steps=settings.max_steps,
        gradient_accumulation_steps=settings.gradient_accumulation_steps, optim=settings.optim,
        weight_decay=settings.weight_decay, warmup_steps=settings.warmup_ratio,  # a float < 1 is a ratio
        lr_scheduler_type=settings.lr_scheduler_type, max_grad_norm=settings.max_grad_norm,
        bf16=bf16, fp16=False, use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=settings.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if settings.gradient_checkpointing else None,
        seed=settings.seed, logging_steps=settings.logging_steps, logging_first_step=True,
        save_strategy="steps", save_steps=settings.save_steps, save_total_limit=settings.save_total_limit,
        report_to=[] if settings.report_to in ("none", "", None) else [settings.report_to],
        dataloader_num_workers=settings.dataloader_num_workers, remove_unused_columns=False,
        deepspeed=settings.deepspeed, disable_tqdm=False,
        # every trainable LoRA weight gets a gradient in every forward (the LoRA sits on layers each
        # token passes through), so DDP need not search the graph for unused ones; PEFT models are not
        # PreTrainedModel, for which transformers' default would be True (and DDP warns about it)
        ddp_find_unused_parameters=False,
        log_level_replica="error",  # the other ranks print errors only (distributed.quiet_other_ranks)
    )


def write_summary(trainer, run: Path, summary: dict) -> None:
    if trainer.is_world_process_zero():
        from medvolcore.fileio import write_text_atomic

        write_text_atomic(Path(run) / "training.json", json.dumps(summary, indent=1) + "\n", overwrite=True)


__all__ = ["last_checkpoint", "step_of", "open_run", "tensorboard_dir", "save_adapter", "zero3_state_dict", "trainer_arguments",
           "write_summary"]
