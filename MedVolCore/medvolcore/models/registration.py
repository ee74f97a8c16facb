"""Where a preset's weights live, and what their registration says is there.

Weights live under ``medvol_home()/models/<folder>/`` (``$MEDVOL_HOME``, default ``~/.medvol``),
where ``<folder>`` is the preset's name, or for a preset with ``same_weights_as`` the other
preset's (``medvol-r1`` is ``qwen3-vl-4b`` plus an adapter, so both use ``models/qwen3-vl-4b/``)::

    models/<folder>/grounder/                 the Qwen3-VL folder (config.json, *.safetensors, tokenizer…)
    models/<folder>/adapter/                  a LoRA adapter, when the preset or an import brings one
    models/<folder>/medsam2/MedSAM2_latest.pt
    models/<folder>/medvol_weights.json       the registration: what, where from, sha256, when

``weights_also_in`` names older folders of the same weights, read (and updated in place) when the
preset's own folder holds no registration: before the presets were renamed, Qwen3-VL-4B-Instruct
was downloaded into ``models/medvol-r1/``, and ``qwen3-vl-4b`` still finds it there.

A preset counts as present only when its registration exists and every file it names is still
there (:func:`_missing_parts`). A registered adapter belongs to the preset the registration names
(``"preset"``): a zero-shot preset reading the same folder never picks it up. The functions here
take a :class:`~medvolcore.models.manifest.Preset` (``p``, ``preset``); nothing here reads the
preset table.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import List, Optional

log = logging.getLogger("medvolcore.models")

REGISTRATION = "medvol_weights.json"
REGISTRATION_SCHEMA = "medvol.weights/1"


def medvol_home() -> Path:
    """``$MEDVOL_HOME`` (``~`` expanded), default ``~/.medvol``. Not created here."""
    env = os.environ.get("MEDVOL_HOME")
    return Path(env).expanduser().absolute() if env else Path.home() / ".medvol"


def models_dir(name: str) -> Path:
    """``medvol_home()/models/<name>``: the folder that holds one preset's weights."""
    return medvol_home() / "models" / name


def _registration_in(folder: Path) -> Optional[dict]:
    p = Path(folder) / REGISTRATION
    try:
        reg = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable weights registration %s (%s)", p, e)
        return None
    return reg if isinstance(reg, dict) and reg.get("schema") == REGISTRATION_SCHEMA else None


def _weights_folder(p) -> Path:
    """The folder of preset ``p``'s weights: its own (``models/<name>``, or the ``same_weights_as``
    preset's), unless that holds no registration and one of its ``weights_also_in`` folders does.
    An older folder counts only when its registration is of the same grounder (a downloaded one
    names its repo id; an imported one names none and is taken)."""
    own = models_dir(p.weights_folder_name)
    if _registration_in(own) is not None:
        return own
    for old in p.weights_also_in:
        reg = _registration_in(models_dir(old))
        repo = ((reg or {}).get("grounder") or {}).get("repo_id")
        if reg is not None and (repo is None or repo == p.grounder.get("repo_id")):
            return models_dir(old)
    return own


def _registered_path(folder: Path, entry: Optional[dict]) -> Optional[Path]:
    """An entry's path: relative ones are under the registration's ``folder``; linked imports are absolute."""
    if not entry or not entry.get("path"):
        return None
    p = Path(entry["path"])
    return p if p.is_absolute() else Path(folder) / p


def _registered_adapter(preset, reg: Optional[dict]) -> Optional[dict]:
    """The registration's adapter entry when it belongs to ``preset`` (the registration names it):
    a folder shared with a zero-shot preset never lends that preset its adapter."""
    if not reg or reg.get("preset", preset.name) != preset.name:
        return None
    return reg.get("adapter") or None


def _missing_parts(preset, reg: Optional[dict], folder: Path) -> List[str]:
    """What a hub preset lacks locally in ``folder`` (empty: present)."""
    missing = []
    if reg is None:
        if preset.grounder_kind == "hub":
            missing.append("grounder")
        if preset.medsam2_kind == "hub":
            missing.append("MedSAM2")
        return missing
    if preset.grounder_kind == "hub":
        g = _registered_path(folder, reg.get("grounder"))
        if g is None or not (g / "config.json").is_file():
            missing.append(f"grounder ({g or 'not registered'})")
    if preset.medsam2_kind == "hub":
        m = _registered_path(folder, reg.get("medsam2"))
        if m is None or not m.is_file():
            missing.append(f"MedSAM2 ({m or 'not registered'})")
    a = _registered_adapter(preset, reg)
    if not a and preset.adapter and preset.adapter.get("repo_id"):
        missing.append("adapter (not registered)")
    if a:
        ap = _registered_path(folder, a)
        if ap is None or not (ap / "adapter_config.json").is_file():
            missing.append(f"adapter ({ap})")
    return missing
