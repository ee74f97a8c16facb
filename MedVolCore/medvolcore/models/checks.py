"""Checking weights before they are used: a Qwen3-VL model folder, a LoRA adapter folder, and
the base model an adapter was trained on against a preset's. Each check raises one plain
:class:`ModelError` (or :class:`AdapterMismatchError`) saying what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..errors import AdapterMismatchError, ModelError
from .identity import ADAPTER_METADATA, adapter_base, read_adapter_metadata
from .manifest import Preset, list_presets
from .registration import _registration_in, _weights_folder, log

_LFS_POINTER = b"version https://git-lfs.github.com/spec/"
_WEIGHT_SUFFIXES = (".safetensors",)


def folder_listing(folder: Path, limit: int = 8) -> str:
    """What a folder holds, for error messages: ``a, b, … (N more)``."""
    try:
        names = sorted(p.name for p in Path(folder).iterdir())
    except OSError:
        return "nothing readable"
    if not names:
        return "an empty folder"
    more = f", … ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_grounder_dir(folder: Path, model_type: str = "qwen3_vl") -> dict:
    """Check a Hugging Face model folder: config.json of ``model_type``, weights, tokenizer, processor.

    Returns the parsed config. Raises :class:`ModelError` saying what is wrong.
    """
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{folder} is not a Qwen3-VL checkpoint: it has no config.json (found {folder_listing(folder)})")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{cfg_path} is not valid JSON ({e})") from None
    found = cfg.get("model_type") if isinstance(cfg, dict) else None
    if found != model_type:
        arch = ", ".join(cfg.get("architectures") or []) if isinstance(cfg, dict) else ""
        raise ModelError(f"{folder} holds a {found or 'model of unknown type'!s} model (config.json model_type "
                         f"{found!r}{f', {arch}' if arch else ''}); this preset needs model_type {model_type!r} (Qwen3-VL)")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ModelError(f"{index} is not a valid safetensors index ({e})") from None
        absent = [s for s in shards if not (folder / s).is_file()]
        if absent:
            raise ModelError(f"{folder} is incomplete: missing weight file(s) {', '.join(absent)}")
        weights = [folder / s for s in shards]
    else:
        weights = [f for f in folder.iterdir() if f.suffix in _WEIGHT_SUFFIXES and f.is_file()]
        if not weights:
            raise ModelError(f"{folder} has no weights (*.safetensors)")
    for w in weights:
        _check_not_lfs_pointer(w)
    if not ((folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()):
        raise ModelError(f"{folder} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    if not (folder / "preprocessor_config.json").is_file():
        raise ModelError(f"{folder} has no image processor (preprocessor_config.json)")
    return cfg


def _check_not_lfs_pointer(path: Path) -> None:
    """A Git LFS pointer copied instead of the file is a common mistake: say so plainly."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_LFS_POINTER))
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e}") from None
    if head == _LFS_POINTER:
        raise ModelError(f"{path} is a Git LFS pointer, not the weights; fetch the real file "
                         "(`git lfs pull`, or download it from the Hugging Face web page)")


def _base_text(base: dict) -> str:
    if base.get("builder"):
        return f"the {base['builder']} smoke model (built locally, random weights)"
    if base.get("repo_id"):
        return base["repo_id"] + (f"@{base['revision']}" if base.get("revision") else "")
    return f"the local model folder {base.get('path') or base.get('name') or '?'}"


def check_adapter_base(adapter_dir, preset: Preset) -> Optional[dict]:
    """Check that the base model an adapter's ``medvol_adapter.json`` records is ``preset``'s grounder.

    Returns the recorded base (None: the folder records none, i.e. made elsewhere or by an older
    medvol-train; nothing can be checked, and the grounder notes that when it loads the adapter).
    A different Hub repo, or the tiny smoke model against a real preset (or the reverse), is an
    :class:`AdapterMismatchError` naming both. A preset whose grounder is a local folder cannot be
    compared with a Hub id: not checked. The same repo at another revision loads (the shapes are
    the same), with a warning.
    """
    base = adapter_base(read_adapter_metadata(adapter_dir))
    if base is None or preset.grounder_kind == "path":
        return base
    if preset.grounder_kind == "builder":
        want, ok = f"the {preset.grounder['builder']} smoke model", base.get("builder") == preset.grounder["builder"]
    else:
        want = preset.grounder["repo_id"]
        ok = bool(base.get("repo_id")) and base["repo_id"].lower() == want.lower()
        if not base.get("repo_id") and not base.get("builder"):
            return base  # trained on a local folder of unknown origin: nothing to compare
    if not ok:
        def same_base(q: Preset) -> bool:
            if base.get("builder"):
                return q.grounder.get("builder") == base["builder"]
            return str(q.grounder.get("repo_id", "")).lower() == str(base.get("repo_id")).lower()

        others = [q.name for q in list_presets() if q.name != preset.name and not q.requires_adapter and same_base(q)]
        hint = f"use preset {others[0]!r}" if others else "use a preset with that base model"
        raise AdapterMismatchError(f"adapter {adapter_dir} was trained on {_base_text(base)} ({ADAPTER_METADATA}), "
                                   f"but preset {preset.name!r} uses {want}: {hint}")
    reg = _registration_in(_weights_folder(preset)) if preset.needs_download else None
    used = ((reg or {}).get("grounder") or {}).get("revision") or preset.grounder.get("revision")
    if base.get("revision") and used and base["revision"] != used:
        log.warning("adapter %s was trained on %s at revision %s; preset %s uses revision %s (same model, other "
                    "commit: check that results compare)", adapter_dir, want, base["revision"], preset.name, used)
    return base


def check_adapter_dir(folder, preset: Optional[Preset] = None) -> Path:
    """A LoRA adapter folder: exists, has adapter_config.json and adapter weights.

    With ``preset``: the base model its ``medvol_adapter.json`` records must be the preset's
    (:func:`check_adapter_base`: :class:`AdapterMismatchError` otherwise); and when
    adapter_config.json names a Qwen3-VL base model of another size than the preset's, that is a
    :class:`ModelError` too (its weights would not fit).
    """
    p = Path(folder).expanduser()
    if not p.exists():
        raise ModelError(f"adapter {p} does not exist")
    cfg_path = p / "adapter_config.json"
    if not p.is_dir() or not cfg_path.is_file():
        raise ModelError(f"{p} is not a LoRA adapter folder (no adapter_config.json); pass the folder that "
                         "training wrote, which holds adapter_config.json and adapter_model.safetensors")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{cfg_path} is not valid JSON ({e})") from None
    if not any((p / w).is_file() for w in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ModelError(f"{p} has no adapter weights (adapter_model.safetensors)")
    if preset is not None:
        check_adapter_base(p, preset)
    base = str(cfg.get("base_model_name_or_path") or "") if isinstance(cfg, dict) else ""
    if base and preset is not None and preset.grounder_kind == "hub":
        want = preset.grounder["repo_id"].rstrip("/").split("/")[-1].lower()
        got = Path(base).name.lower()
        if got.startswith("qwen3-vl-") and want.startswith("qwen3-vl-") and got != want:
            raise ModelError(f"adapter {p} was trained on {base}, but preset {preset.name!r} uses "
                             f"{preset.grounder['repo_id']}; pick the preset with that base model")
    return p
