"""The preset table: ``Resources/models.json`` and ``$MEDVOL_MODELS_JSON``, read and checked.

A preset (schema ``medvol.models/1``) names a **grounder** (a Hugging Face repo id, a local
``path``, or the local ``tiny`` builder; optionally a LoRA ``adapter``) and a **MedSAM2**
checkpoint (a repo id + filename, a local ``path``, or seeded random weights).
``$MEDVOL_MODELS_JSON`` may name a file of the same shape whose presets are added to, or replace,
the shipped ones, and whose ``default`` replaces the shipped default. A preset with
``same_weights_as`` takes the other preset's grounder, MedSAM2 and weights folder (it may add an
adapter); one with ``requires_adapter`` (``medvol-r1``) does not resolve without an adapter. A
table that breaks these rules is a :class:`ModelError` naming the file and the preset.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..errors import InputError, ModelError
from ..resources import load_json
from .registration import _registration_in, _weights_folder

SCHEMA = "medvol.models/1"
OVERRIDE_ENV = "MEDVOL_MODELS_JSON"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# a branch or tag name as git allows it (simplified): no spaces, no '..', no leading '-' or '/'
_REF_RE = re.compile(r"^(?!.*\.\.)(?!.*//)[A-Za-z0-9_][A-Za-z0-9._/-]{0,254}(?<![./])$")
_HEXISH_RE = re.compile(r"^(?=.*[0-9])(?=.*[A-Fa-f])[0-9A-Fa-f]{7,}$")  # digits and hex letters only


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
