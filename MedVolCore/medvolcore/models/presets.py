"""Model presets: what a preset names, where its weights live, whether they are present.

A preset (``Resources/models.json``, schema ``medvol.models/1``) names a **grounder** (a Hugging
Face repo id, a local ``path``, or the local ``tiny`` builder; optionally a LoRA ``adapter``) and a
**MedSAM2** checkpoint (a repo id + filename, a local ``path``, or seeded random weights).
``$MEDVOL_MODELS_JSON`` may name a file of the same shape whose presets are added to, or replace,
the shipped ones, and whose ``default`` replaces the shipped default.

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
there; :mod:`medvolcore.models.fetch` writes the registration last, so an interrupted or rejected
transfer leaves the preset missing. A registered adapter belongs to the preset the registration
names (``"preset"``): a zero-shot preset reading the same folder never picks it up. A preset with
``requires_adapter`` (``medvol-r1``) does not resolve without an adapter. Nothing here downloads
anything.
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

from ..errors import AdapterMismatchError, AdapterRequiredError, InputError, ModelError, ModelNotFoundError
from ..resources import load_json
from .identity import ADAPTER_METADATA, adapter_base, describe, identity, read_adapter_metadata

log = logging.getLogger("medvolcore.models")

SCHEMA = "medvol.models/1"
REGISTRATION = "medvol_weights.json"
REGISTRATION_SCHEMA = "medvol.weights/1"
OVERRIDE_ENV = "MEDVOL_MODELS_JSON"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# a branch or tag name as git allows it (simplified): no spaces, no '..', no leading '-' or '/'
_REF_RE = re.compile(r"^(?!.*\.\.)(?!.*//)[A-Za-z0-9_][A-Za-z0-9._/-]{0,254}(?<![./])$")
_HEXISH_RE = re.compile(r"^(?=.*[0-9])(?=.*[A-Fa-f])[0-9A-Fa-f]{7,}$")  # digits and hex letters only
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
    """The registration file of preset ``name``, in :func:`weights_dir` (present or not)."""
    return weights_dir(name) / REGISTRATION


def weights_dir(name: str) -> Path:
    """The folder that holds (or will hold) preset ``name``'s weights: its own weights folder
    (``models/<name>``, or the ``same_weights_as`` preset's), unless that holds no registration
    and one of its ``weights_also_in`` folders holds the same weights (see the module docstring)."""
    return _weights_folder(get_preset(name))


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
    same_weights_as: Optional[str] = None  # another preset whose grounder, MedSAM2 and folder this one uses
    weights_also_in: Tuple[str, ...] = ()  # older folders of the same weights (read when its own is empty)
    requires_adapter: bool = False  # a trained method: never resolved without its LoRA adapter

    @property
    def weights_folder_name(self) -> str:
        """``models/<this>/``: the preset's own weights folder name."""
        return self.same_weights_as or self.name

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
        reg = _registration_in(_weights_folder(self)) if self.needs_download else None

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

        return {"description": self.description, "smoke": self.smoke, "requires_adapter": self.requires_adapter,
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


def check_revision(revision) -> Optional[str]:
    """A Hub revision as given (``--revision``, the table): a 40-hex commit id, or a branch or tag
    name (``main``, ``v1.0``, ``refs/pr/3``); None stays None (the repo's main branch at download
    time). Anything else is an :class:`InputError` (one line): a shortened or mistyped commit id
    would otherwise be sent to the Hub as a branch name."""
    if revision is None:
        return None
    rev = str(revision).strip()
    if COMMIT_RE.match(rev):
        return rev
    if _HEXISH_RE.match(rev):
        raise InputError(f"revision {revision!r} looks like a commit id but is not 40 lower-case hex digits; give the "
                         "full commit id (the Hub's 'Files and versions' history shows it) or a branch or tag name")
    if not _REF_RE.match(rev) or rev.endswith(".lock"):
        raise InputError(f"revision {revision!r} is neither a 40-hex commit id nor a branch or tag name")
    return rev


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
        if spec.get("revision") is not None:
            try:
                spec["revision"] = check_revision(spec["revision"])
            except InputError as e:
                raise _bad_table(where, f"preset {name!r}: {part}.{e}") from None
        for key in ("licence", "licence_source"):
            if spec.get(key) is not None and not isinstance(spec[key], str):
                raise _bad_table(where, f"preset {name!r}: {part}.{key} must be a string or null")
    gpu = d.get("gpu_memory_gb")
    also = d.get("weights_also_in") or []
    if not isinstance(also, list) or not all(isinstance(a, str) and _NAME_RE.match(a) for a in also):
        raise _bad_table(where, f"preset {name!r}: weights_also_in must be a list of folder names")
    if not isinstance(d.get("requires_adapter", False), bool):
        raise _bad_table(where, f"preset {name!r}: requires_adapter must be true or false")
    return Preset(name=name, description=str(d.get("description", "")), grounder=g, medsam2=m,
                  gpu_memory_gb=float(gpu) if gpu is not None else None,
                  gpu_memory_note=str(d.get("gpu_memory_note", "estimated")), smoke=bool(d.get("smoke", False)),
                  settings=dict(d.get("settings") or {}), same_weights_as=d.get("same_weights_as"),
                  weights_also_in=tuple(also), requires_adapter=bool(d.get("requires_adapter", False)))


def _with_shared_weights(name: str, d: dict, table: Dict[str, tuple], where: str) -> dict:
    """A ``same_weights_as`` preset: the other preset's grounder (with this one's ``adapter``, if
    any), MedSAM2, settings and weights folders, so the two can never drift apart."""
    other = d["same_weights_as"]
    if not isinstance(other, str) or other == name or other not in table:
        raise _bad_table(where, f"preset {name!r}: same_weights_as must name another preset, got {other!r}")
    base, base_where = table[other]
    if not isinstance(base, dict) or base.get("same_weights_as") is not None:
        raise _bad_table(base_where, f"preset {other!r} (same_weights_as of {name!r}) must be a preset with weights "
                         "of its own")
    own = d.get("grounder") or {}
    if not isinstance(own, dict) or set(own) - {"adapter"} or "medsam2" in d or "weights_also_in" in d:
        raise _bad_table(where, f"preset {name!r} takes its weights from {other!r} (same_weights_as): it may give "
                         "grounder.adapter, but no other grounder key, no medsam2 and no weights_also_in")
    merged = dict(base)
    merged.update({k: v for k, v in d.items() if k not in ("grounder",)})
    base_grounder = dict(base.get("grounder") or {})
    merged["grounder"] = dict(base_grounder, adapter=own.get("adapter", base_grounder.get("adapter")))
    merged["medsam2"] = base.get("medsam2")
    merged["weights_also_in"] = base.get("weights_also_in") or []
    return merged


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
    table: Dict[str, tuple] = {}
    for name, d, where in raw:  # a later entry replaces an earlier one in its place
        table[name] = (d, where)
    presets: Dict[str, Preset] = {}
    for name, (d, where) in table.items():
        if isinstance(d, dict) and d.get("same_weights_as") is not None:
            d = _with_shared_weights(name, d, table, where)
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


def _weights_folder(p: Preset) -> Path:
    """See :func:`weights_dir`. An older folder counts only when its registration is of the same
    grounder (a downloaded one names its repo id; an imported one names none and is taken)."""
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


def _registered_adapter(preset: Preset, reg: Optional[dict]) -> Optional[dict]:
    """The registration's adapter entry when it belongs to ``preset`` (the registration names it):
    a folder shared with a zero-shot preset never lends that preset its adapter."""
    if not reg or reg.get("preset", preset.name) != preset.name:
        return None
    return reg.get("adapter") or None


def _missing_parts(preset: Preset, reg: Optional[dict], folder: Path) -> List[str]:
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
