"""Model presets resolved: where a preset's weights are, whether they are present, what runs.

:func:`resolve` turns a preset of the table (:mod:`.manifest`) into local paths
(:class:`ResolvedModels`), from the weights registered in its folder (:mod:`.registration`) and
an adapter checked against its base model (:mod:`.checks`); :func:`preset_status`,
:func:`revisions` and :func:`list_status` say what is on disk for ``medvol models list``, and
:func:`best_available_preset` what ``medvol demo`` runs. The names of those modules that callers
use are importable from here too.

A preset counts as present only when its registration exists and every file it names is still
there; :mod:`medvolcore.models.fetch` writes the registration last, so an interrupted or rejected
transfer leaves the preset missing. A registered adapter belongs to the preset the registration
names (``"preset"``): a zero-shot preset reading the same folder never picks it up. A preset with
``requires_adapter`` (``medvol-r1``) does not resolve without an adapter. Nothing here downloads
anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from ..errors import AdapterRequiredError, ModelError, ModelNotFoundError
from .checks import check_adapter_base, check_adapter_dir, check_grounder_dir, folder_listing
from .identity import describe, identity
from .manifest import COMMIT_RE, OVERRIDE_ENV, SCHEMA, Preset, check_revision, default_preset, get_preset, list_presets
from .registration import (REGISTRATION, REGISTRATION_SCHEMA, _missing_parts, _registered_adapter, _registered_path,
                           _registration_in, _weights_folder, medvol_home, models_dir)
from .registration import log  # noqa: F401  (the models' logger, importable from here as before)

__all__ = [
    "COMMIT_RE", "OVERRIDE_ENV", "REGISTRATION", "REGISTRATION_SCHEMA", "SCHEMA", "Preset", "ResolvedModels",
    "adapter_required_message", "base_model_name", "best_available_preset", "check_adapter_base",
    "check_adapter_dir", "check_adapter_given", "check_grounder_dir", "check_revision", "default_preset",
    "folder_listing", "get_preset", "list_presets", "list_status", "medvol_home", "models_dir", "path",
    "preset_identity", "preset_status", "read_registration", "registration_path", "resolve", "revisions",
    "weights_dir",
]


# ---- where things live -------------------------------------------------------------------

def registration_path(name: str) -> Path:
    """The registration file of preset ``name``, in :func:`weights_dir` (present or not)."""
    return weights_dir(name) / REGISTRATION


def weights_dir(name: str) -> Path:
    """The folder that holds (or will hold) preset ``name``'s weights: its own weights folder
    (``models/<name>``, or the ``same_weights_as`` preset's), unless that holds no registration
    and one of its ``weights_also_in`` folders holds the same weights (see :mod:`.registration`)."""
    return _weights_folder(get_preset(name))


# ---- resolved models ---------------------------------------------------------------------

@dataclass(frozen=True)
class ResolvedModels:
    """Everything a pipeline needs to load one preset, as local paths.

    ``sam_checkpoint`` is a MedSAM2 ``.pt`` file, or None when ``sam_random`` = ``(seed,
    image_size)`` asks for seeded random weights. ``settings`` is the preset's grounder settings
    object (e.g. ``{"think_budget": "real"}``).
    """

    name: str
    grounder_dir: Path
    adapter_dir: Optional[Path]
    sam_checkpoint: Optional[Path]
    sam_random: Optional[Tuple[int, int]]
    smoke: bool
    settings: dict
    base_model: str = ""  # what the grounder is, for people: "Qwen3-VL-4B-Instruct" (see models.identity)

    def to_dict(self) -> dict:
        return {"preset": self.name, "grounder": str(self.grounder_dir),
                "adapter": str(self.adapter_dir) if self.adapter_dir else None,
                "medsam2": str(self.sam_checkpoint) if self.sam_checkpoint else None,
                "medsam2_random": list(self.sam_random) if self.sam_random else None,
                "smoke": self.smoke, "settings": dict(self.settings), "base_model": self.base_model}


def _how_to_get(name: str) -> str:
    return (f"run `medvol models download {name}`, or on a machine without internet copy the weights into a folder "
            f"and run `medvol models import {name} FOLDER` (see `medvol models import --help`); to try the commands "
            "first, `--preset tiny` (an untrained smoke model, meaningless results) or `medvol demo` need no download")


def read_registration(name: str) -> Optional[dict]:
    """Preset ``name``'s ``medvol_weights.json`` (in :func:`weights_dir`), or None when absent or unreadable."""
    return _registration_in(weights_dir(name))


def adapter_required_message(preset: Preset) -> str:
    """Why a ``requires_adapter`` preset cannot run without one, and what to do instead (one line)."""
    instead = preset.same_weights_as or "qwen3-vl-4b"
    return (f"model preset {preset.name!r} needs a trained MedVol-R1 LoRA adapter (--adapter DIR), and no trained "
            f"MedVol-R1 adapter is published: train one with medvol-train (Training/README.md), or use preset "
            f"{instead!r} for zero-shot runs of the same base model (not trained for this task)")


def _has_own_adapter(p: Preset, reg: Optional[dict]) -> bool:
    return bool(p.adapter) or _registered_adapter(p, reg) is not None


def _check_adapter_given(p: Preset, adapter, reg: Optional[dict]) -> None:
    if p.requires_adapter and adapter is None and not _has_own_adapter(p, reg):
        raise AdapterRequiredError(adapter_required_message(p))


def check_adapter_given(name: Optional[str] = None, adapter=None) -> None:
    """:class:`AdapterRequiredError` when preset ``name`` (None: the default) needs an adapter and
    has none, neither ``adapter`` nor one of its own; :class:`AdapterMismatchError` when ``adapter``
    records another base model than the preset's (:func:`check_adapter_base`). Reads no weights,
    so a front door can say so before it reads anything else."""
    p = get_preset(name or default_preset())
    reg = _registration_in(_weights_folder(p)) if p.requires_adapter and p.needs_download else None
    _check_adapter_given(p, adapter, reg)
    if adapter is not None and Path(adapter).expanduser().is_dir():
        check_adapter_base(Path(adapter).expanduser(), p)


def preset_status(name: str) -> dict:
    """``{"present", "available", "status", "needs_adapter"}`` without building or downloading anything.

    ``present``: the weights are on disk now. ``available``: :func:`resolve` needs no network and
    no more arguments (true for present presets and for ``tiny``, which is built on first use;
    false for ``medvol-r1`` until it has an adapter). ``needs_adapter``: a ``requires_adapter``
    preset with no adapter of its own (give ``--adapter``).
    """
    p = get_preset(name)
    if p.grounder_kind == "builder":
        built = (models_dir(name) / "grounder" / "config.json").is_file()
        return {"present": built, "available": True, "status": "present" if built else "built on first use",
                "needs_adapter": False}
    folder = _weights_folder(p)
    reg = _registration_in(folder) if p.needs_download else None
    needs_adapter = p.requires_adapter and not _has_own_adapter(p, reg)
    tail = "; needs --adapter" if needs_adapter else ""
    if p.needs_download and _missing_parts(p, reg, folder):
        return {"present": False, "available": False, "status": "missing" + tail, "needs_adapter": needs_adapter}
    for key, spec in (("grounder", p.grounder), ("medsam2", p.medsam2)):
        if spec.get("path") and not Path(spec["path"]).expanduser().exists():
            return {"present": False, "available": False, "status": f"missing ({key} path)" + tail,
                    "needs_adapter": needs_adapter}
    return {"present": True, "available": not needs_adapter, "status": "present" + tail, "needs_adapter": needs_adapter}


def resolve(name: Optional[str] = None, adapter=None, *, require_adapter: bool = True) -> ResolvedModels:
    """Local paths of a preset's weights (``name`` None: the default preset).

    ``adapter``: a LoRA adapter folder that overrides the preset's (checked: it must exist and
    hold adapter_config.json). A preset with ``requires_adapter`` and no adapter of its own is an
    :class:`AdapterRequiredError` first (``require_adapter=False``: its base weights alone, for
    reports of what was downloaded). Hub presets must have been downloaded or imported
    (:class:`ModelNotFoundError` otherwise, naming both commands); ``tiny`` is built on first use.
    """
    p = get_preset(name or default_preset())
    folder = _weights_folder(p)
    reg = _registration_in(folder) if p.needs_download else None
    if require_adapter:
        _check_adapter_given(p, adapter, reg)
    if p.needs_download:
        missing = _missing_parts(p, reg, folder)
        if missing:
            have = "no weights" if reg is None else f"incomplete weights (missing {', '.join(missing)})"
            raise ModelNotFoundError(f"model preset {p.name!r} has {have} in {folder}; {_how_to_get(p.name)}")

    if p.grounder_kind == "builder":
        grounder_dir = _build_tiny(p)
    elif p.grounder_kind == "path":
        grounder_dir = Path(p.grounder["path"]).expanduser()
        if not (grounder_dir / "config.json").is_file():
            raise ModelNotFoundError(f"model preset {p.name!r}: grounder folder {grounder_dir} has no config.json")
    else:
        grounder_dir = _registered_path(folder, reg["grounder"])

    registered_adapter = _registered_adapter(p, reg)
    if adapter is not None:
        adapter_dir = check_adapter_dir(adapter, p)
    elif registered_adapter:
        adapter_dir = _registered_path(folder, registered_adapter)
    elif p.adapter and p.adapter.get("path"):
        adapter_dir = check_adapter_dir(p.adapter["path"], p)
    else:
        adapter_dir = None

    sam_checkpoint, sam_random = None, None
    if p.medsam2_kind == "random":
        sam_random = (int(p.medsam2["random_seed"]), int(p.medsam2["image_size"]))
    elif p.medsam2_kind == "path":
        sam_checkpoint = Path(p.medsam2["path"]).expanduser()
        if not sam_checkpoint.is_file():
            raise ModelNotFoundError(f"model preset {p.name!r}: MedSAM2 checkpoint {sam_checkpoint} does not exist")
    else:
        sam_checkpoint = _registered_path(folder, reg["medsam2"])
    return ResolvedModels(name=p.name, grounder_dir=grounder_dir, adapter_dir=adapter_dir,
                          sam_checkpoint=sam_checkpoint, sam_random=sam_random, smoke=p.smoke,
                          settings=dict(p.settings), base_model=base_model_name(p))


def preset_identity(name: Optional[str] = None, adapter=None) -> dict:
    """The identity (:mod:`.identity`) preset ``name`` (None: the default) would run with, given
    ``adapter`` (a folder, or None for the preset's own), without resolving or loading weights:
    ``medvol models list`` and the worker's ``hello`` before its models load."""
    p = get_preset(name or default_preset())
    folder = _weights_folder(p)
    reg = _registration_in(folder) if p.needs_download else None
    if adapter is None:
        own = _registered_adapter(p, reg)
        if own:
            adapter = _registered_path(folder, own)
        elif p.adapter:
            adapter = p.adapter.get("path") or p.adapter.get("repo_id")
    return describe(p.name, base_model_name(p), adapter, smoke=p.smoke,
                    needs_adapter=p.requires_adapter and adapter is None)


def base_model_name(p: Preset) -> str:
    """What a preset's grounder is, for people: the Hub repo's name (``Qwen3-VL-4B-Instruct``), a
    local folder's name, or the tiny smoke model."""
    g = p.grounder
    if p.grounder_kind == "hub":
        return str(g["repo_id"]).rstrip("/").split("/")[-1]
    if p.grounder_kind == "path":
        return f"the Qwen3-VL model in folder {Path(g['path']).name!r}"
    return "tiny untrained Qwen3-VL"


def _build_tiny(p: Preset) -> Path:
    try:
        from .tiny import ensure_tiny_model
    except ImportError as e:
        raise ModelError(f"cannot build the {p.name!r} model: medvolcore.models.tiny is not available ({e})") from None
    root = models_dir(p.name) / "grounder"
    out = ensure_tiny_model(root)
    return Path(out) if out is not None else root


def path(name: Optional[str] = None, adapter=None, *, require_adapter: bool = True) -> dict:
    """Resolved local paths of a preset, plus its registration file (or an error; see :func:`resolve`)."""
    r = resolve(name, adapter, require_adapter=require_adapter)
    d = r.to_dict()
    folder = weights_dir(r.name)
    reg = folder / REGISTRATION
    d["registration"] = str(reg) if reg.is_file() else None
    d["home"] = str(folder)
    d["identity"] = identity(r) if r.adapter_dir or not get_preset(r.name).requires_adapter else \
        preset_identity(r.name)
    return d


# ---- listing -----------------------------------------------------------------------------

def revisions(name: str) -> dict:
    """The Hub revision preset ``name`` uses, per Hub part (``grounder``, ``medsam2``):
    ``{"repo_id", "revision", "state", "pinned"}`` where ``state`` is ``registered`` (the commit the
    registered weights were downloaded at), ``pinned`` (not downloaded yet: the table's revision),
    ``unpinned`` (neither: the main branch at download time) or ``unknown`` (imported by hand:
    the commit is not known). ``pinned`` is the table's revision (None: unpinned)."""
    p = get_preset(name)
    reg = _registration_in(_weights_folder(p)) if p.needs_download else None
    out = {}
    for key, spec, kind in (("grounder", p.grounder, p.grounder_kind), ("medsam2", p.medsam2, p.medsam2_kind)):
        if kind != "hub":
            continue
        entry = (reg or {}).get(key) or {}
        pinned = spec.get("revision")
        if entry.get("revision"):
            state, rev = "registered", entry["revision"]
        elif entry:
            state, rev = "unknown", None
        else:
            state, rev = ("pinned", pinned) if pinned else ("unpinned", None)
        out[key] = {"repo_id": spec["repo_id"], "revision": rev, "state": state, "pinned": pinned}
    return out


def list_status() -> List[dict]:
    """One row per preset for ``medvol models list``: name, description, status, estimated GPU memory."""
    default = default_preset()
    rows = []
    for p in list_presets():
        gs, ms = p.source_text()
        gl, ml = p.licences
        sources = {"grounder_licence_source": p.grounder.get("licence_source"),
                   "medsam2_licence_source": p.medsam2.get("licence_source")}
        rows.append({"name": p.name, "default": p.name == default, "description": p.description,
                     **preset_status(p.name), "gpu_memory_gb": p.gpu_memory_gb,
                     "gpu_memory_note": p.gpu_memory_note, "smoke": p.smoke, "grounder": gs, "medsam2": ms,
                     "grounder_licence": gl, "medsam2_licence": ml, **sources, "folder": str(_weights_folder(p)),
                     "requires_adapter": p.requires_adapter, "same_weights_as": p.same_weights_as,
                     "revisions": revisions(p.name), "identity": preset_identity(p.name)})
    return rows


def best_available_preset(requested: Optional[str] = None) -> Tuple[str, str]:
    """The preset ``medvol demo`` should use, and a notice to print (empty when none is needed).

    An explicit ``requested`` preset is used as is. Otherwise the first real preset whose
    weights are on disk (the default first), else ``tiny`` with a notice saying what to get.
    """
    if requested:
        get_preset(requested)
        return requested, ""
    real = [p.name for p in list_presets() if not p.smoke]
    order = sorted(real, key=lambda n: n != default_preset())
    for name in order:
        if preset_status(name)["available"]:
            return name, ""
    smoke = next((p.name for p in list_presets() if p.smoke), "tiny")
    d = default_preset()
    return smoke, (
        f"no real model weights found ({', '.join(order)}): using the untrained '{smoke}' smoke model, whose output "
        f"is meaningless. For a real model run `medvol models download {d}` "
        f"(offline: `medvol models import {d} FOLDER`)"
    )
