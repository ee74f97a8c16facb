"""Several processes: which process this is, keeping the other ranks quiet, and the launcher check.

Training runs on several processes through the launchers that set torch.distributed's environment
(``torchrun``, ``accelerate launch --multi_gpu`` / a DDP or DeepSpeed config, ``srun torchrun`` on
SLURM): every process reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, and transformers'
``Trainer`` (through accelerate) sets up the process group — gloo on a CPU, nccl on GPUs — and DDP.
Nothing here starts processes or wraps models.

What is ours: rank 0 alone prints the run's lines and warnings and writes the adapter and
``training.json`` (:func:`is_main_process`; the Trainer itself writes checkpoints and TensorBoard
events from rank 0); the other ranks keep their errors only (:func:`quiet_other_ranks`); and
:func:`check_launcher` refuses ``accelerate launch --cpu --num_processes N`` (N > 1), which starts
ONE process without saying so (accelerate's ``--cpu`` uses its simple launcher, which needs
``mpirun`` to start several), with the command that starts N.

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import List, Optional

from medvolcore.errors import InputError

# environment variables MPI launchers set (accelerate's simple launcher runs several CPU processes under mpirun)
MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def world_size() -> int:
    """Processes in the run (``WORLD_SIZE``; 1 when no launcher set it)."""
    return max(1, _env_int("WORLD_SIZE", 1))


def rank() -> int:
    """This process's global rank (``RANK``; 0 when no launcher set it)."""
    return _env_int("RANK", 0)


def is_main_process() -> bool:
    """True on rank 0, the process that prints and writes the run's own files."""
    return rank() == 0


def describe(trainer) -> dict:
    """``training.json``'s ``distributed`` block: processes and batch sizes as the Trainer ran them.

    ``per_device_batch`` is what one process feeds per micro-step (TRL's GRPO counts completions);
    ``global_batch`` = per-device batch × gradient accumulation × processes, per optimiser step."""
    args = trainer.args
    state = getattr(trainer, "accelerator", None)
    state = getattr(state, "state", None)
    processes = int(getattr(args, "world_size", 1) or 1)
    per_device = int(args.per_device_train_batch_size)
    accumulation = int(args.gradient_accumulation_steps)
    return {
        "world_size": processes,
        "distributed_type": str(getattr(getattr(state, "distributed_type", None), "value", "NO")),
        "backend": getattr(state, "backend", None),
        "per_device_batch": per_device,
        "gradient_accumulation_steps": accumulation,
        "global_batch": per_device * accumulation * processes,
        "ddp_find_unused_parameters": getattr(args, "ddp_find_unused_parameters", None),
    }


def quiet_other_ranks() -> None:
    """On ranks other than 0: no warnings, info lines or progress bars (errors still print)."""
    if is_main_process():
        return
    warnings.simplefilter("ignore")
    for name in ("medvoltrain", "medvolcore"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:  # the command then fails on its own, with one line
        pass


def _parent_num_processes() -> Optional[int]:
    """The ``--num_processes`` of the ``accelerate launch`` that started this process (Linux; None elsewhere)."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode("utf-8", "replace").split("\0")
    except OSError:
        return None
    for i, arg in enumerate(argv):
        for flag in ("--num_processes", "--num-processes"):
            value = arg[len(flag) + 1:] if arg.startswith(flag + "=") else (
                argv[i + 1] if arg == flag and i + 1 < len(argv) else None)
            if value is not None:
                try:
                    return int(value)
                except ValueError:
                    return None
    return None


def check_launcher(argv: Optional[List[str]] = None) -> None:
    """Refuse ``accelerate launch --cpu`` asked for several processes: it would run one, silently.

    accelerate's simple launcher (what ``--cpu`` selects, with or without a config file) sets
    ``ACCELERATE_USE_CPU`` and, for more than one process, ``MASTER_ADDR``, but starts a single
    process unless it runs under ``mpirun``; no ``WORLD_SIZE`` reaches that process. ``argv``: the
    ``medvol-train`` arguments, for the command in the message (default ``sys.argv[1:]``)."""
    if "ACCELERATE_USE_CPU" not in os.environ or "MASTER_ADDR" not in os.environ:
        return
    if "WORLD_SIZE" in os.environ or any(v in os.environ for v in MPI_SIZE_VARS):
        return
    n = _parent_num_processes()
    if n is not None and n < 2:
        return
    count = str(n) if n else "N"
    args = " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    raise InputError(f"`accelerate launch --cpu` starts ONE process here, not {count} (its simple launcher needs "
                     f"mpirun for more); for {count} CPU processes run: torchrun --nproc_per_node {count} -m medvoltrain "
                     f"{args} (or: accelerate launch --multi_gpu --num_processes {count} -m medvoltrain {args}, "
                     "which uses gloo on a CPU)")


__all__ = ["world_size", "rank", "is_main_process", "describe", "quiet_other_ranks", "check_launcher"]
