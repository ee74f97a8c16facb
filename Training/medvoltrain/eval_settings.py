"""What one ``medvol-train evaluate`` is: its settings (:class:`EvalSettings`, whose fingerprint guards
a folder against mixing settings), the protocol they make, the method label its tables carry, and
the names of its files (see :mod:`medvoltrain.evaluate`, the command, for the whole contract)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from medvolcore.caseruns import write_record
from medvolcore.errors import InputError

from . import resources
from .datasets import safe_name

SCHEMA = "medvol.train.evaluation/1"
# Bump when the per-case numbers would change for the same settings (a resume then redoes them).
EVAL_VERSION = 1
PAPER_DATASETS = ("0012", "0003", "0004")  # the paper's Table 1 columns, in its order
PAPER_NAMES = {"0012": "CT-ORG", "0003": "AbdomenCT-1K", "0004": "KiTS23"}  # as the paper spells them
SMOKE_TEXT = "Smoke model (tiny / random MedSAM2): numbers are meaningless"
# --protocol: named settings of a whole evaluation. "paper": Table 1 as the MedVol-R1 paper measures it, MedSAM2
# propagating the anchor over the whole volume (no early stop) on the test split; "product": what `medvol
# segment` does (early stop, K = the product default). Decoding is the same in both (64 shown slices, greedy,
# at most 256 new tokens, constrained unless --unconstrained).
PROTOCOLS = ("product", "paper")


def protocol_of(settings: "EvalSettings") -> str:
    """``paper`` when the settings are the paper's Table 1 protocol (whole volume, test split), else ``product``."""
    return "paper" if settings.stop_after_empty == 0 and settings.split == "test" else "product"


@dataclass(frozen=True)
class EvalSettings:
    """What decides the per-case numbers; its fingerprint guards a DIR against mixing settings."""

    data: str
    split: str = "test"
    oracle: bool = False
    preset: Optional[str] = None  # the preset's name; None in oracle mode with explicit MedSAM2 weights
    adapter: Optional[str] = None
    sam: str = "preset"  # "preset", "checkpoint:<path>" or "random:<seed>:<image size>"
    constrain: bool = True
    version: int = EVAL_VERSION
    # 0 here (not the product default) so that a settings.json written before early stop existed
    # reads back as what it was: whole-volume propagation; evaluate() passes the product default
    stop_after_empty: int = 0

    def fingerprint(self) -> str:
        d = asdict(self)
        if d["stop_after_empty"] == 0:  # the fingerprint of every evaluation made before the field existed
            del d["stop_after_empty"]
        blob = json.dumps(d, sort_keys=True)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def dataset_name(code: Optional[str]) -> str:
    """CT-ORG / AbdomenCT-1K / KiTS23 (any M3D-Seg code's name), the code itself if unknown, or "custom"."""
    if code is None or str(code).strip() == "":
        return "custom"
    if str(code).strip() in PAPER_NAMES:
        return PAPER_NAMES[str(code).strip()]
    info = resources.dataset_info().get(str(code).strip())
    return info["dataset"] if info else str(code)


def case_key(sample_id: str) -> str:
    """File name stem of a case: readable and collision-free (``a/b_c`` and ``a_b/c`` differ)."""
    return f"{safe_name(sample_id)}-{hashlib.sha1(sample_id.encode('utf-8')).hexdigest()[:8]}"


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def write_json(path: Path, obj) -> None:
    """One of the evaluation's JSON files (settings, a case, the summary), written atomically."""
    write_record(path, obj, indent=1, default=_json_default)


def resolve_settings(data_dir: Path, split: str, oracle: bool, preset: Optional[str], adapter, sam_checkpoint,
                     random_weights: Optional[int], sam_image_size: Optional[int], constrain: bool,
                     stop_after_empty: int = 0) -> EvalSettings:
    """Check the model options and return the :class:`EvalSettings`; nothing is loaded here."""
    from medvolcore import models
    from medvolcore.propagation import check_stop_after_empty

    stop_after_empty = check_stop_after_empty(stop_after_empty, "--stop-after-empty")

    if sam_checkpoint is not None and random_weights is not None:
        raise InputError("give either --sam-checkpoint or --random-weights, not both")
    if random_weights is not None and (isinstance(random_weights, bool) or not isinstance(random_weights, int)):
        raise InputError(f"--random-weights takes an integer seed, got {random_weights!r}")
    if sam_image_size is not None and random_weights is None:
        raise InputError("--sam-image-size applies to --random-weights only (MedSAM2 checkpoints run at 512)")
    if oracle and adapter is not None:
        raise InputError("--adapter has no effect with --oracle (no language model runs); drop one of them")
    if oracle and not constrain:
        raise InputError("--unconstrained has no effect with --oracle (no language model runs); drop one of them")
    preset_name = preset or models.default_preset()
    p = models.get_preset(preset_name)  # an unknown preset is one line, before anything loads
    if not oracle:  # medvol-r1 without --adapter: one line, before anything loads
        models.check_adapter_given(preset_name, adapter)
    adapter_path = None
    if adapter is not None:
        adapter_path = Path(adapter).expanduser().resolve()
        if not (adapter_path / "adapter_config.json").is_file():
            raise InputError(f"--adapter {adapter}: not a LoRA adapter folder (no adapter_config.json); give the "
                             "folder `medvol-train sft` wrote, e.g. RUN/adapter")
    if sam_checkpoint is not None:
        ckpt = Path(sam_checkpoint).expanduser().resolve()
        if not ckpt.is_file():
            raise InputError(f"--sam-checkpoint {sam_checkpoint} does not exist (or is not a file)")
        sam = f"checkpoint:{ckpt}"
    elif random_weights is not None:
        from medvolcore.propagation import check_image_size

        size = sam_image_size
        if size is None:  # the preset's own random size (tiny: 64 px), else MedSAM2's 512
            size = int(p.medsam2["image_size"]) if p.medsam2_kind == "random" else 512
        size = check_image_size(size)
        sam = f"random:{int(random_weights)}:{int(size)}"
    else:
        sam = "preset"
    return EvalSettings(
        data=str(data_dir), split=split, oracle=bool(oracle),
        # the oracle with its own MedSAM2 weights uses nothing of the preset
        preset=None if (oracle and sam != "preset") else preset_name,
        adapter=str(adapter_path) if adapter_path else None, sam=sam, constrain=bool(constrain),
        stop_after_empty=stop_after_empty)


def _sam_description(settings: EvalSettings) -> Tuple[str, bool]:
    """Human text of the MedSAM2 weights and whether they are random."""
    if settings.sam.startswith("checkpoint:"):
        return Path(settings.sam.split(":", 1)[1]).name, False
    if settings.sam.startswith("random:"):
        _, seed, size = settings.sam.split(":")
        return f"random weights, seed {seed}, {size} px", True
    from medvolcore import models

    p = models.get_preset(settings.preset)
    if p.medsam2_kind == "random":
        return f"random weights, seed {p.medsam2['random_seed']}, {p.medsam2['image_size']} px", True
    return (p.medsam2_filename or p.source_text()[1]), False


def method_label(settings: EvalSettings) -> Tuple[str, bool]:
    """The table's method label and whether the run is a smoke run (tiny grounder or random MedSAM2)."""
    from medvolcore import models

    sam_text, sam_random = _sam_description(settings)
    if settings.stop_after_empty:
        sam_text += f", early stop K={settings.stop_after_empty}"
    if settings.oracle:
        return f"Oracle anchor → MedSAM2 ({sam_text})", sam_random
    p = models.get_preset(settings.preset)
    label = settings.preset
    if settings.adapter:
        a = Path(settings.adapter)
        label += f" + LoRA {a.parent.name}/{a.name}" if a.parent.name else f" + LoRA {a.name}"
    if not settings.constrain:
        label += " (unconstrained)"
    return f"{label} → MedSAM2 ({sam_text})", bool(p.smoke) or sam_random


__all__ = ["EvalSettings", "SCHEMA", "EVAL_VERSION", "PAPER_DATASETS", "PAPER_NAMES", "SMOKE_TEXT", "PROTOCOLS",
           "protocol_of", "dataset_name", "case_key", "write_json", "resolve_settings", "method_label"]
