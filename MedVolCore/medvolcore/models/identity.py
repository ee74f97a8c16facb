"""What made a result, said honestly: one function decides a run's model identity.

No trained MedVol-R1 adapter is published. A grounder without a task adapter is the general
Qwen3-VL-Instruct model answering zero-shot, and every output says so; only an adapter that
``medvol-train`` wrote (its folder holds ``medvol_adapter.json``, see
``Training/medvoltrain/runs.py``) is called MedVol-R1. Any other LoRA adapter is named for what
is known of it: a LoRA adapter of unknown training.

:func:`identity` takes a resolved preset, :func:`~medvolcore.models.presets.preset_identity` a
preset name (no weights needed: ``medvol models list``, the worker's ``hello`` before loading).
Both return a JSON-ready dict (:func:`describe`):

``preset``            the preset's name
``name``              ``"MedVol-R1"`` with a medvol-train adapter, else the base model's name
``label``             one line for people, e.g. "Qwen3-VL-4B-Instruct, zero-shot, not trained for this task"
``base_model``        the grounder (``"Qwen3-VL-4B-Instruct"``)
``adapter``           the adapter's folder name (``run/adapter`` for medvol-train's layout), or None
``adapter_stage``     the medvol-train stage that wrote it (``"sft"``, ``"grpo"``), or None
``trained_for_task``  True only for a medvol-train adapter on a real model
``zero_shot``         True when no adapter is used on a real model
``smoke``             True for the untrained tiny smoke model (results are meaningless)
``needs_adapter``     True for a preset that cannot run without an adapter it was not given
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

ADAPTER_METADATA = "medvol_adapter.json"  # written by medvol-train beside the adapter (medvoltrain.adapter)
ADAPTER_SCHEMA = "medvol.adapter/1"  # its "schema" since the base model is recorded (older files have none)
SMOKE_BANNER = "UNTRAINED SMOKE MODEL: meaningless output"


def read_adapter_metadata(adapter_dir) -> Optional[dict]:
    """``medvol_adapter.json`` of the adapter in ``adapter_dir`` as a dict, or None when the folder
    holds none (an adapter made elsewhere) or it cannot be read."""
    if adapter_dir is None:
        return None
    try:
        meta = json.loads((Path(adapter_dir) / ADAPTER_METADATA).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def adapter_base(meta: Optional[dict]) -> Optional[dict]:
    """The base model an adapter's metadata records (``medvol.adapter/1``): ``{"repo_id",
    "revision", "builder", "path", "name"}`` (missing keys None), or None for metadata without one
    (none at all, or written before the base model was recorded)."""
    base = (meta or {}).get("base_model")
    if not isinstance(base, dict):
        return None
    return {k: base.get(k) for k in ("repo_id", "revision", "builder", "path", "name")}


def adapter_stage(adapter_dir) -> Optional[str]:
    """The medvol-train stage that wrote the adapter in ``adapter_dir`` (``medvol_adapter.json``'s
    ``stage``), or None when the folder holds no such record (an adapter of unknown origin)."""
    meta = read_adapter_metadata(adapter_dir)
    stage = meta.get("stage") if meta else None
    return stage if isinstance(stage, str) and stage.strip() else None


def adapter_name(adapter_dir) -> Optional[str]:
    """An adapter as people know it: its folder's name, with the run's name in front for
    medvol-train's ``RUN/adapter`` layout (never a whole path)."""
    if adapter_dir is None:
        return None
    p = Path(str(adapter_dir))
    return f"{p.parent.name}/{p.name}" if p.name == "adapter" and p.parent.name else p.name


def describe(preset_name: str, base_model: str, adapter_dir=None, *, smoke: bool = False,
             needs_adapter: bool = False) -> dict:
    """The identity of preset ``preset_name`` (grounder ``base_model``) with ``adapter_dir``."""
    stage = adapter_stage(adapter_dir)
    name = adapter_name(adapter_dir)
    medvol_r1 = stage is not None and not smoke
    if smoke:
        label = "untrained tiny smoke model (random weights): results are meaningless"
        if name:
            label += f"; LoRA adapter {name}"
    elif medvol_r1:
        label = f"MedVol-R1 (adapter: {name}, medvol-train {stage} stage, on {base_model})"
    elif name:
        label = (f"{base_model} + LoRA adapter {name} (not made by medvol-train: not known to be trained for "
                 "this task)")
    elif needs_adapter:
        label = "MedVol-R1 without an adapter: cannot run (give --adapter DIR; no trained adapter is published)"
    else:
        label = f"{base_model}, zero-shot, not trained for this task"
    return {"preset": preset_name, "name": "MedVol-R1" if medvol_r1 else base_model, "label": label,
            "base_model": base_model, "adapter": name, "adapter_stage": stage, "trained_for_task": medvol_r1,
            "zero_shot": not smoke and not name and not needs_adapter, "smoke": bool(smoke),
            "needs_adapter": bool(needs_adapter and not name)}


def identity(resolved, smoke: Optional[bool] = None) -> dict:
    """The identity of a :class:`~medvolcore.models.ResolvedModels` (``smoke``: override its flag,
    e.g. when the loaded grounder turned out to be the tiny smoke model)."""
    return describe(resolved.name, resolved.base_model or "Qwen3-VL", resolved.adapter_dir,
                    smoke=resolved.smoke if smoke is None else bool(smoke))


def identity_note(ident: Optional[dict]) -> Optional[str]:
    """The note a result made without a task-trained model carries (anchor ``notes``, stdout), or
    None (a MedVol-R1 adapter; the tiny smoke model has a note of its own)."""
    if not ident or ident.get("smoke") or ident.get("trained_for_task"):
        return None
    if ident.get("zero_shot"):
        return (f"made with {ident['label']}: no trained MedVol-R1 adapter was used, so the anchor and mask are "
                "zero-shot guesses that are often wrong; check them before any use")
    return f"made with {ident['label']}; check the anchor and mask before any use"


def identity_banner(ident: Optional[dict]) -> str:
    """A short warning for the QC picture's banner ('' for a MedVol-R1 adapter)."""
    if not ident or ident.get("trained_for_task"):
        return ""
    if ident.get("smoke"):
        return SMOKE_BANNER
    if ident.get("zero_shot"):
        return f"ZERO-SHOT {ident['base_model']}: not trained for this task, often wrong"
    return f"LoRA adapter {ident['adapter']} of unknown training: not known to be trained for this task"


__all__ = ["ADAPTER_METADATA", "ADAPTER_SCHEMA", "SMOKE_BANNER", "adapter_base", "adapter_name", "adapter_stage",
           "describe", "identity", "identity_banner", "identity_note", "read_adapter_metadata"]
