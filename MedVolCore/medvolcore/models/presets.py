"""Model presets: what a preset names, where its weights live, whether they are present.

A preset (``Resources/models.json``, schema ``medvol.models/1``) names a **grounder** (a Hugging
Face repo id, a local ``path``, or the local ``tiny`` builder; optionally a LoRA ``adapter``) and a
**MedSAM2** checkpoint (a repo id + filename, a local ``path``, or seeded random weights).
``$MEDVOL_MODELS_JSON`` may name a file of the same shape whose presets are added to, or replace,
the shipped ones, and whose ``default`` replaces the shipped default.

Weights live under ``medvol_home()/models/<preset>/`` (``$MEDVOL_HOME``, default ``~/.medvol``)::

    models/<preset>/grounder/                 the Qwen3-VL folder (config.json, *.safetensors, tokenizer…)
    models/<preset>/adapter/                  a LoRA adapter, when the preset or an import brings one
    models/<preset>/medsam2/MedSAM2_latest.pt
    models/<preset>/medvol_weights.json       the registration: what, where from, sha256, when

A preset counts as present only when its registration exists and every file it names is still
there; :mod:`medvolcore.models.fetch` writes the registration last, so an interrupted or rejected
transfer leaves the preset missing. Nothing here downloads anything.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..errors import InputError, ModelError, ModelNotFoundError
from ..resources import load_json

log = logging.getLogger("medvolcore.models")

SCHEMA = "medvol.models/1"
REGISTRATION = "medvol_weights.json"
REGISTRATION_SCHEMA = "medvol.weights/1"
OVERRIDE_ENV = "MEDVOL_MODELS_JSON"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"
_WEIGHT_SUFFIXES = (".safetensors",)


# ---- where things live -------------------------------------------------------------------

def medvol_home() -> Path:
    """``$MEDVOL_HOME`` (``~`` expanded), default ``~/.medvol``. Not created here."""
    env = os.environ.get("MEDVOL_HOME")
    return Path(env).expanduser().absolute() if env else Path.home() / ".medvol"


def models_dir(name: str) -> Path:
    """``medvol_home()/models/<name>``: the folder that holds one preset's weights."""
    return medvol_home() / "models" / name


def registration_path(name: str) -> Path:
    return models_dir(name) / REGISTRATION


# ---- presets -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Preset:
    """One entry of the preset table (see ``Resources/models.json``).

    ``grounder``: ``{"repo_id", "revision", "allow_patterns", "model_type", "adapter"}``, or
    ``{"path", …}`` for a local folder, or ``{"builder": "tiny", …}``. ``medsam2``:
    ``{"repo_id", "revision", "filename", "sha256"}``, ``{"path", "sha256"}`` or
    ``{"random_seed", "image_size"}``. ``settings`` go to the grounder unchanged. Either may
    carry ``licence`` (the weights' licence as their model card declares it, e.g. ``apache-2.0``)
    and ``licence_source`` (where that was read).
    """

    name: str
    description: str
    grounder: dict
    medsam2: dict
    gpu_memory_gb: Optional[float] = None
    gpu_memory_note: str = "estimated"
    smoke: bool = False
    settings: dict = field(default_factory=dict)

    @property
    def grounder_kind(self) -> str:
        """``hub``, ``path`` or ``builder``."""
        return "builder" if "builder" in self.grounder else "path" if "path" in self.grounder else "hub"

    @property
    def medsam2_kind(self) -> str:
        """``hub``, ``path`` or ``random``."""
        return "random" if "random_seed" in self.medsam2 else "path" if "path" in self.medsam2 else "hub"

    @property
    def adapter(self):
        """The preset's own adapter: None, ``{"path": …}`` or ``{"repo_id": …}``."""
        a = self.grounder.get("adapter")
        return {"path": a} if isinstance(a, str) else a

    @property
    def medsam2_filename(self) -> Optional[str]:
        if self.medsam2_kind == "hub":
            return self.medsam2["filename"]
        if self.medsam2_kind == "path":
            return Path(self.medsam2["path"]).name
        return None

    @property
    def needs_download(self) -> bool:
        """True when some of its weights come from the Hub (download or import them first)."""
        a = self.adapter
        return self.grounder_kind == "hub" or self.medsam2_kind == "hub" or bool(a and a.get("repo_id"))

    def public_info(self) -> dict:
        """Where this preset's models come from and their licences, as a remote client may see
        them (the worker's ``hello``): repo ids, revisions, licences; never a local path. The
        revision is the commit actually downloaded when the weights are registered, else the
        manifest's (None: the repo's main branch at download time)."""
        reg = read_registration(self.name) if self.needs_download else None

        def part(spec: dict, kind: str, registered: Optional[dict]) -> dict:
            if kind == "hub":
                d = {"source": "hub", "repo_id": spec.get("repo_id"),
                     "revision": (registered or {}).get("revision") or spec.get("revision")}
                if spec.get("filename"):
                    d["filename"] = spec["filename"]
            elif kind == "path":
                d = {"source": "local folder"}
            else:
                d = {"source": "built locally (random weights)"}
            d["licence"] = spec.get("licence")
            d["licence_source"] = spec.get("licence_source")
            return d

        return {"description": self.description, "smoke": self.smoke,
                "grounder": part(self.grounder, self.grounder_kind, (reg or {}).get("grounder")),
                "medsam2": part(self.medsam2, self.medsam2_kind, (reg or {}).get("medsam2"))}

    @property
    def licences(self) -> Tuple[Optional[str], Optional[str]]:
        """The grounder's and MedSAM2's ``licence`` (None where the manifest gives none)."""
        return self.grounder.get("licence"), self.medsam2.get("licence")

    def source_text(self) -> Tuple[str, str]:
        """Short human descriptions of the grounder and MedSAM2 sources."""
        g = self.grounder
        gs = (g.get("repo_id") or g.get("path") or f"built locally ({g.get('builder')})")
        m = self.medsam2
        if self.medsam2_kind == "random":
            ms = f"random weights (seed {m['random_seed']}, {m['image_size']} px)"
        elif self.medsam2_kind == "path":
            ms = m["path"]
        else:
            ms = f"{m['repo_id']}/{m['filename']}"
        return gs, ms


def _bad_table(where: str, msg: str) -> ModelError:
    return ModelError(f"model preset table {where}: {msg}")


def _check_sha(where: str, sha) -> Optional[str]:
    if sha is None:
        return None
    if not isinstance(sha, str) or not _SHA256_RE.match(sha.lower()):
        raise _bad_table(where, f"sha256 must be 64 hex digits or null, got {sha!r}")
    return sha.lower()


def _preset_from_dict(name: str, d: dict, where: str) -> Preset:
    if not _NAME_RE.match(name):
        raise _bad_table(where, f"preset name {name!r} must be letters, digits, '.', '_' or '-'")
    if not isinstance(d, dict):
        raise _bad_table(where, f"preset {name!r} must be an object")
    g = dict(d.get("grounder") or {})
    m = dict(d.get("medsam2") or {})
    kinds = [k for k in ("repo_id", "path", "builder") if g.get(k)]
    if len(kinds) != 1:
        raise _bad_table(where, f"preset {name!r}: grounder needs exactly one of repo_id, path or builder")
    if "builder" in kinds and g["builder"] != "tiny":
        raise _bad_table(where, f"preset {name!r}: unknown grounder builder {g['builder']!r} (known: tiny)")
    g.setdefault("model_type", "qwen3_vl")
    a = g.get("adapter")
    if a is not None and not (isinstance(a, str) or (isinstance(a, dict) and (a.get("path") or a.get("repo_id")))):
        raise _bad_table(where, f"preset {name!r}: grounder.adapter must be null, a path, or {{'repo_id': …}}")
    if "random_seed" in m:
        if not isinstance(m.get("random_seed"), int) or not isinstance(m.get("image_size"), int):
            raise _bad_table(where, f"preset {name!r}: medsam2 random_seed and image_size must be integers")
    elif m.get("path"):
        m["sha256"] = _check_sha(where, m.get("sha256"))
    elif m.get("repo_id") and m.get("filename"):
        m["sha256"] = _check_sha(where, m.get("sha256"))
    else:
        raise _bad_table(where, f"preset {name!r}: medsam2 needs repo_id + filename, path, or random_seed + image_size")
    for part, spec in (("grounder", g), ("medsam2", m)):
        for key in ("licence", "licence_source"):
            if spec.get(key) is not None and not isinstance(spec[key], str):
                raise _bad_table(where, f"preset {name!r}: {part}.{key} must be a string or null")
    gpu = d.get("gpu_memory_gb")
    return Preset(name=name, description=str(d.get("description", "")), grounder=g, medsam2=m,
                  gpu_memory_gb=float(gpu) if gpu is not None else None,
                  gpu_memory_note=str(d.get("gpu_memory_note", "estimated")), smoke=bool(d.get("smoke", False)),
                  settings=dict(d.get("settings") or {}))


def _load_table() -> Tuple[Dict[str, Preset], str]:
    table = copy.deepcopy(load_json("models.json"))
    if table.get("schema") != SCHEMA:
        raise _bad_table("Resources/models.json", f"schema is {table.get('schema')!r}, expected {SCHEMA!r}")
    raw = [(name, d, "Resources/models.json") for name, d in table.get("presets", {}).items()]
    default = table.get("default")
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        where = f"{override} (${OVERRIDE_ENV})"
        try:
            extra = json.loads(Path(override).expanduser().read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise _bad_table(where, f"cannot be read as JSON: {e}") from None
        if not isinstance(extra, dict) or not isinstance(extra.get("presets"), dict):
            raise _bad_table(where, "must be an object with a 'presets' object, like Resources/models.json")
        raw += [(name, d, where) for name, d in extra["presets"].items()]
        default = extra.get("default") or default
    presets: Dict[str, Preset] = {}
    for name, d, where in raw:
        presets[name] = _preset_from_dict(name, d, where)
    return presets, default


def list_presets() -> List[Preset]:
    """Every preset, shipped ones first, in table order."""
    return list(_load_table()[0].values())


def default_preset() -> str:
    return _load_table()[1]


def get_preset(name: str) -> Preset:
    presets, _ = _load_table()
    if name not in presets:
        raise InputError(f"unknown model preset {name!r}; known presets: {', '.join(presets)}")
    return presets[name]


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

    def to_dict(self) -> dict:
        return {"preset": self.name, "grounder": str(self.grounder_dir),
                "adapter": str(self.adapter_dir) if self.adapter_dir else None,
                "medsam2": str(self.sam_checkpoint) if self.sam_checkpoint else None,
                "medsam2_random": list(self.sam_random) if self.sam_random else None,
                "smoke": self.smoke, "settings": dict(self.settings)}


def _how_to_get(name: str) -> str:
    return (f"run `medvol models download {name}`, or on a machine without internet copy the weights into a folder "
            f"and run `medvol models import {name} FOLDER` (see `medvol models import --help`)")


def read_registration(name: str) -> Optional[dict]:
    """The preset's ``medvol_weights.json``, or None when absent or unreadable."""
    p = registration_path(name)
    try:
        reg = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable weights registration %s (%s)", p, e)
        return None
    return reg if isinstance(reg, dict) and reg.get("schema") == REGISTRATION_SCHEMA else None


def _registered_path(name: str, entry: Optional[dict]) -> Optional[Path]:
    """An entry's path: relative ones are under ``models_dir(name)``; linked imports are absolute."""
    if not entry or not entry.get("path"):
        return None
    p = Path(entry["path"])
    return p if p.is_absolute() else models_dir(name) / p


def _missing_parts(preset: Preset, reg: Optional[dict]) -> List[str]:
    """What a hub preset lacks locally (empty: present)."""
    missing = []
    if reg is None:
        if preset.grounder_kind == "hub":
            missing.append("grounder")
        if preset.medsam2_kind == "hub":
            missing.append("MedSAM2")
        return missing
    if preset.grounder_kind == "hub":
        g = _registered_path(preset.name, reg.get("grounder"))
        if g is None or not (g / "config.json").is_file():
            missing.append(f"grounder ({g or 'not registered'})")
    if preset.medsam2_kind == "hub":
        m = _registered_path(preset.name, reg.get("medsam2"))
        if m is None or not m.is_file():
            missing.append(f"MedSAM2 ({m or 'not registered'})")
    a = reg.get("adapter")
    if not a and preset.adapter and preset.adapter.get("repo_id"):
        missing.append("adapter (not registered)")
    if a:
        ap = _registered_path(preset.name, a)
        if ap is None or not (ap / "adapter_config.json").is_file():
            missing.append(f"adapter ({ap})")
    return missing


def preset_status(name: str) -> dict:
    """``{"present", "available", "status"}`` without building or downloading anything.

    ``present``: the weights are on disk now. ``available``: :func:`resolve` needs no network
    (true for present presets and for ``tiny``, which is built on first use).
    """
    p = get_preset(name)
    if p.grounder_kind == "builder":
        built = (models_dir(name) / "grounder" / "config.json").is_file()
        return {"present": built, "available": True, "status": "present" if built else "built on first use"}
    if p.needs_download:
        missing = _missing_parts(p, read_registration(name))
        if missing:
            return {"present": False, "available": False, "status": "missing"}
    for key, spec in (("grounder", p.grounder), ("medsam2", p.medsam2)):
        if spec.get("path") and not Path(spec["path"]).expanduser().exists():
            return {"present": False, "available": False, "status": f"missing ({key} path)"}
    return {"present": True, "available": True, "status": "present"}


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


def check_adapter_dir(folder, preset: Optional[Preset] = None) -> Path:
    """A LoRA adapter folder: exists, has adapter_config.json and adapter weights.

    When the adapter names a Qwen3-VL base model of another size than the preset's, that is a
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
    base = str(cfg.get("base_model_name_or_path") or "") if isinstance(cfg, dict) else ""
    if base and preset is not None and preset.grounder_kind == "hub":
        want = preset.grounder["repo_id"].rstrip("/").split("/")[-1].lower()
        got = Path(base).name.lower()
        if got.startswith("qwen3-vl-") and want.startswith("qwen3-vl-") and got != want:
            raise ModelError(f"adapter {p} was trained on {base}, but preset {preset.name!r} uses "
                             f"{preset.grounder['repo_id']}; pick the preset with that base model")
    return p


def resolve(name: Optional[str] = None, adapter=None) -> ResolvedModels:
    """Local paths of a preset's weights (``name`` None: the default preset).

    ``adapter``: a LoRA adapter folder that overrides the preset's (checked: it must exist and
    hold adapter_config.json). Hub presets must have been downloaded or imported
    (:class:`ModelNotFoundError` otherwise, naming both commands); ``tiny`` is built on first use.
    """
    p = get_preset(name or default_preset())
    reg = read_registration(p.name) if p.needs_download else None
    if p.needs_download:
        missing = _missing_parts(p, reg)
        if missing:
            have = "no weights" if reg is None else f"incomplete weights (missing {', '.join(missing)})"
            raise ModelNotFoundError(f"model preset {p.name!r} has {have} in {models_dir(p.name)}; {_how_to_get(p.name)}")

    if p.grounder_kind == "builder":
        grounder_dir = _build_tiny(p)
    elif p.grounder_kind == "path":
        grounder_dir = Path(p.grounder["path"]).expanduser()
        if not (grounder_dir / "config.json").is_file():
            raise ModelNotFoundError(f"model preset {p.name!r}: grounder folder {grounder_dir} has no config.json")
    else:
        grounder_dir = _registered_path(p.name, reg["grounder"])

    if adapter is not None:
        adapter_dir = check_adapter_dir(adapter, p)
    elif reg and reg.get("adapter"):
        adapter_dir = _registered_path(p.name, reg["adapter"])
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
        sam_checkpoint = _registered_path(p.name, reg["medsam2"])
    return ResolvedModels(name=p.name, grounder_dir=grounder_dir, adapter_dir=adapter_dir,
                          sam_checkpoint=sam_checkpoint, sam_random=sam_random, smoke=p.smoke,
                          settings=dict(p.settings))


def _build_tiny(p: Preset) -> Path:
    try:
        from .tiny import ensure_tiny_model
    except ImportError as e:
        raise ModelError(f"cannot build the {p.name!r} model: medvolcore.models.tiny is not available ({e})") from None
    root = models_dir(p.name) / "grounder"
    out = ensure_tiny_model(root)
    return Path(out) if out is not None else root


def path(name: Optional[str] = None, adapter=None) -> dict:
    """Resolved local paths of a preset, plus its registration file (or an error)."""
    r = resolve(name, adapter)
    d = r.to_dict()
    reg = registration_path(r.name)
    d["registration"] = str(reg) if reg.is_file() else None
    d["home"] = str(models_dir(r.name))
    return d



# ---- listing -----------------------------------------------------------------------------

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
                     "grounder_licence": gl, "medsam2_licence": ml, **sources, "folder": str(models_dir(p.name))})
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
        if preset_status(name)["present"]:
            return name, ""
    smoke = next((p.name for p in list_presets() if p.smoke), "tiny")
    d = default_preset()
    return smoke, (
        f"no real model weights found ({', '.join(order)}): using the untrained '{smoke}' smoke model, whose output "
        f"is meaningless. For real results run `medvol models download {d}` "
        f"(offline: `medvol models import {d} FOLDER`)"
    )
