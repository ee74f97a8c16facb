"""One place that turns a device name into a torch device, with one-line errors."""

from __future__ import annotations

from .errors import InputError


def resolve_device(device="cpu"):
    """``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (CUDA when available) → ``torch.device``.

    CUDA asked for where it is not available is an :class:`InputError` saying so.
    """
    import torch

    if isinstance(device, torch.device):
        dev = device
    elif device in (None, "auto"):
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise InputError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto") from None
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device {device!r} is not supported: use cpu, cuda, cuda:N or auto")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available here (no GPU, or a CPU-only torch); use --device cpu")
    return dev
