"""The model presets the panel offers, and its default, read from the project's model manifest
``Resources/models.json`` (schema ``medvol.models/1``): the file the worker's
``medvolcore.models`` reads, so that the panel and the worker agree. Plain JSON; nothing of
medvolcore is imported (Slicer loads the module before medvolcore is installed).

The manifest is looked for here, the first one found and readable wins:

1. ``$MEDVOL_RESOURCES/models.json``, when that folder holds ``windows.json`` (the rule by which
   the worker's ``medvolcore.resources`` takes it as its resources folder);
2. the repository checkout: ``<MedVolR1Slicer>/../Resources/models.json``;
3. the copy installed with the built extension: ``<MedVolR1Slicer>/Resources/models.json``
   (``MedVolR1Slicer/CMakeLists.txt`` puts it there, in the build tree and at install).

``$MEDVOL_MODELS_JSON``, when set, names a file of the same shape laid over that manifest, as
the worker does (``medvolcore.models.manifest._load_table``): its presets are added to the
manifest's, or replace those of the same name (which keep their place), and its ``default``, when
it has one, wins.

When no manifest is found, or the one found cannot be read, the panel still loads, with the
built-in fallback :data:`FALLBACK`: default ``qwen3-vl-4b``, presets ``qwen3-vl-4b``,
``qwen3-vl-2b``, ``medvol-r1`` and ``tiny`` (the shipped manifest's). An unreadable
``$MEDVOL_MODELS_JSON`` is left out here; the worker refuses it with its reason on the first request.

What a preset runs as, said honestly (:func:`model_text` before a run, :func:`result_model_text`
after it): no trained MedVol-R1 adapter is published, so the Qwen3-VL presets answer zero-shot,
``medvol-r1`` cannot run without an adapter, and only the worker, which reads the adapter's
``medvol_adapter.json``, says whether a result was made by a MedVol-R1 adapter. The labels are
the worker's (``medvolcore.models.preset_identity``); a test keeps them equal.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Dict, Mapping, NamedTuple, Optional, Tuple

MODULE_DIR = Path(__file__).resolve().parent.parent  # the folder of MedVolR1Slicer.py
SCHEMA = "medvol.models/1"
OVERRIDE_ENV = "MEDVOL_MODELS_JSON"
RESOURCES_ENV = "MEDVOL_RESOURCES"

log = logging.getLogger(__name__)


class ModelPresets(NamedTuple):
    """``default``: the preset a new panel selects; ``names``: the presets offered, in manifest
    order; ``descriptions``: name → one line for the user; ``manifest``: the file read (None:
    the built-in fallback); ``override``: the ``$MEDVOL_MODELS_JSON`` file laid over it, if any;
    ``labels``: name → what the preset runs as without an adapter (the worker's identity label)."""

    default: str
    names: Tuple[str, ...]
    descriptions: Dict[str, str]
    manifest: Optional[Path] = None
    override: Optional[Path] = None
    labels: Optional[Dict[str, str]] = None


SMOKE_LABEL = "untrained tiny smoke model (random weights): results are meaningless"
NEEDS_ADAPTER_LABEL = ("MedVol-R1 without an adapter: cannot run (give --adapter DIR; no trained adapter is "
                       "published)")

FALLBACK = ModelPresets(
    default="qwen3-vl-4b",
    names=("qwen3-vl-4b", "qwen3-vl-2b", "medvol-r1", "tiny"),
    descriptions={"qwen3-vl-4b": "Qwen3-VL-4B-Instruct zero-shot + MedSAM2 (GPU)",
                  "qwen3-vl-2b": "Qwen3-VL-2B-Instruct zero-shot + MedSAM2 (smaller)",
                  "medvol-r1": "Qwen3-VL-4B-Instruct + a trained MedVol-R1 adapter (none is published)",
                  "tiny": "random weights: smoke tests only"},
    labels={"qwen3-vl-4b": "Qwen3-VL-4B-Instruct, zero-shot, not trained for this task",
            "qwen3-vl-2b": "Qwen3-VL-2B-Instruct, zero-shot, not trained for this task",
            "medvol-r1": NEEDS_ADAPTER_LABEL, "tiny": SMOKE_LABEL},
)


def manifest_candidates(module_dir: Path = MODULE_DIR, environ: Optional[Mapping[str, str]] = None) -> Tuple[Path, ...]:
    """Where the manifest may be, in the order it is looked for (see the module docstring)."""
    env = os.environ if environ is None else environ
    out = []
    resources = env.get(RESOURCES_ENV)
    if resources and (Path(resources) / "windows.json").is_file():
        out.append(Path(resources) / "models.json")
    module_dir = Path(module_dir)
    out += [module_dir.parent / "Resources" / "models.json", module_dir / "Resources" / "models.json"]
    return tuple(out)


def _read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("presets"), dict) else None


def _descriptions(table: dict) -> Dict[str, str]:
    return {str(name): str(d.get("description", "")) if isinstance(d, dict) else "" for name, d in table["presets"].items()}


def _labels(entries: Dict[str, object]) -> Dict[str, str]:
    """What each preset runs as without an adapter, as the worker's identity says it: the tiny
    smoke model, a preset that needs an adapter, or the base model (its Hub repo's name, through
    ``same_weights_as``) answering zero-shot."""
    out = {}
    for name, d in entries.items():
        d = d if isinstance(d, dict) else {}
        g = d.get("grounder") if isinstance(d.get("grounder"), dict) else {}
        base = entries.get(d.get("same_weights_as")) if d.get("same_weights_as") else None
        if isinstance(base, dict) and isinstance(base.get("grounder"), dict):
            g = dict(base["grounder"], **{k: v for k, v in g.items() if k == "adapter"})
        if d.get("smoke"):
            out[str(name)] = SMOKE_LABEL
        elif d.get("requires_adapter") and not g.get("adapter"):
            out[str(name)] = NEEDS_ADAPTER_LABEL
        else:
            if g.get("repo_id"):
                model = str(g["repo_id"]).rstrip("/").split("/")[-1]
            elif g.get("path"):
                model = f"the Qwen3-VL model in folder {Path(str(g['path'])).name!r}"
            else:
                model = "tiny untrained Qwen3-VL"
            adapter = g.get("adapter")
            out[str(name)] = (f"{model}, zero-shot, not trained for this task" if not adapter else
                              f"{model} + LoRA adapter {_adapter_name(adapter)}")
    return out


def _adapter_name(adapter) -> str:
    """An adapter folder as people know it (``run/adapter`` for medvol-train's layout)."""
    if isinstance(adapter, dict):
        adapter = adapter.get("path") or adapter.get("repo_id") or ""
    p = Path(str(adapter))
    return f"{p.parent.name}/{p.name}" if p.name == "adapter" and p.parent.name else p.name


def read_presets(module_dir: Path = MODULE_DIR, environ: Optional[Mapping[str, str]] = None) -> ModelPresets:
    """The presets and default from the first readable manifest, with ``$MEDVOL_MODELS_JSON``
    laid over it; :data:`FALLBACK` (and the override) when no manifest is found."""
    env = os.environ if environ is None else environ
    result = FALLBACK
    for path in manifest_candidates(module_dir, env):
        table = _read_json(path)
        if table is not None and table.get("schema") == SCHEMA and isinstance(table.get("default"), str):
            entries = dict(table["presets"])
            result = ModelPresets(table["default"], tuple(table["presets"]), _descriptions(table), path,
                                  labels=_labels(entries))
            break
    else:
        entries = None
    if entries is None:
        log.warning("MedVol-R1: no readable Resources/models.json (looked in %s); offering the built-in presets",
                    ", ".join(str(c) for c in manifest_candidates(module_dir, env)))
    override = env.get(OVERRIDE_ENV)
    if override:
        extra = _read_json(Path(override))
        if extra is None:
            log.warning("MedVol-R1: $%s=%s is not a models.json with a 'presets' object; the worker will say why",
                        OVERRIDE_ENV, override)
        else:
            descriptions = dict(result.descriptions)
            descriptions.update(_descriptions(extra))  # dict order: a replaced preset keeps its place
            default = extra.get("default") or result.default
            labels = dict(result.labels or {})
            if entries is not None:
                labels.update(_labels({**entries, **extra["presets"]}))
            else:
                labels.update(_labels(dict(extra["presets"])))
            result = ModelPresets(str(default), tuple(descriptions), descriptions, result.manifest, Path(override),
                                  labels={n: labels.get(n, "") for n in descriptions})
    return result


def model_text(preset: str, adapter: str = "", presets: Optional[ModelPresets] = None) -> str:
    """What the panel says the selected preset will run as, before a run (one line).

    Without an adapter: the preset's label, with "often wrong" for a zero-shot model. With an
    adapter: only the worker can say whether ``medvol-train`` made it (and so whether it is
    MedVol-R1), so the text says so rather than guess."""
    table = presets or model_presets()
    if adapter:
        return (f"Model: {preset} + LoRA adapter {_adapter_name(adapter)}; the result says whether it is a "
                "MedVol-R1 adapter (made by medvol-train).")
    label = (table.labels or {}).get(preset) or f"preset {preset}"
    if label == NEEDS_ADAPTER_LABEL:
        return ("Model: MedVol-R1 needs a trained adapter (Advanced: LoRA adapter) and none is published; "
                "choose qwen3-vl-4b for zero-shot runs.")
    if "zero-shot" in label:
        return f"Model: {label}: results are often wrong; check every result."
    return f"Model: {label}."


def result_model_text(result: dict) -> str:
    """What made a worker's result (its ``model_label``, the worker's honest identity), as the
    first note the panel shows after a run; '' when the reply names no model (propagation only)."""
    label = result.get("model_label") or (result.get("identity") or {}).get("label")
    if not label and result.get("smoke"):
        label = SMOKE_LABEL
    return f"Model: {label}" if label else ""


@functools.lru_cache(maxsize=None)
def model_presets() -> ModelPresets:
    """This Slicer session's presets, read once (Slicer reads the module at start-up, so a changed
    manifest or ``$MEDVOL_MODELS_JSON`` shows after a restart)."""
    return read_presets()


def default_preset() -> str:
    """The preset a new panel, a new :class:`~MedVolR1SlicerLib.session.Options` and the headless
    batch use when none is given."""
    return model_presets().default


class SampleCT(NamedTuple):
    """The small abdominal CT that travels with the module (``Resources/samples``), offered in
    Slicer's Sample Data module. ``sha256``: from ``samples.json``, checked by Sample Data."""

    path: Path
    sha256: str
    query: str


def sample_ct(module_dir: Path = MODULE_DIR) -> Optional[SampleCT]:
    """The demo CT of ``Resources/samples/samples.json``: beside a checkout
    (``<MedVolR1Slicer>/../Resources/samples``) or in the built extension's module Resources
    (``MedVolR1Slicer/CMakeLists.txt`` copies it there). None when neither is found."""
    module_dir = Path(module_dir)
    for folder in (module_dir.parent / "Resources" / "samples", module_dir / "Resources" / "samples"):
        try:
            demo = json.loads((folder / "samples.json").read_text(encoding="utf-8"))["demo"]
            path = folder / demo["file"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if path.is_file():
            return SampleCT(path, str(demo["sha256"]), str(demo.get("query", "")))
    return None
