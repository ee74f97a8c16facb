"""Building the grounder: a Qwen3-VL checkpoint folder, and optionally a LoRA adapter, loaded into
the parts a :class:`~medvolcore.grounder.QwenVLGrounder` predicts with.

:func:`load_grounder_parts` is what :meth:`QwenVLGrounder.from_pretrained
<medvolcore.grounder.QwenVLGrounder.from_pretrained>` runs (the predicting modules import this one
only inside that method): it checks the folder, picks the dtype (:func:`_resolve_dtype`) and the
device, loads the tokenizer, the PIL image processor (no torchvision) and the model, and loads a
PEFT adapter with checks of its own (:func:`load_adapter`): an adapter whose weights do not fit
the model, that has weights for layers the model lacks or lacks weights for adapted layers is a
:class:`~medvolcore.errors.ModelError` naming both folders; one that fits but names another base,
or was not written by ``medvol-train``, loads with a note.

A checkpoint folder may carry ``medvol_model.json`` (``meta``): ``{"smoke": true, "note": …}`` marks
the ``tiny`` smoke model (built by :mod:`medvolcore.models.tiny`, loaded here like any other folder),
which stays fp32 on a CPU so that its answers are the same on every CPU.

Importing this module does not import torch, transformers or peft.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ..devices import resolve_device
from ..errors import DependencyError, InputError, ModelError, ModelNotFoundError
from ..models import folder_listing
from ._common import one_line, require_torch, require_transformers

log = logging.getLogger("medvolcore.grounder")

__all__ = ["GrounderParts", "load_grounder_parts", "load_adapter"]


@dataclass
class GrounderParts:
    """What :func:`load_grounder_parts` loaded: the keyword arguments of ``QwenVLGrounder(...)``
    (``settings`` aside). ``model`` is the base model with the adapter's weights injected;
    ``peft_model`` the PEFT wrapper around it (None without an adapter)."""

    model: object
    tokenizer: object
    image_processor: object
    model_dir: Path
    adapter_dir: Optional[Path] = None
    meta: dict = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    peft_model: object = None


def load_grounder_parts(model_dir, adapter=None, device="cpu", dtype=None) -> GrounderParts:
    """Load a Qwen3-VL checkpoint folder, optionally with a PEFT LoRA adapter folder, onto ``device``.

    ``dtype`` None or ``"auto"``: bfloat16 on CUDA and on a CPU with bf16 arithmetic in hardware,
    fp32 on other CPUs (:func:`medvolcore.cpu.grounder_dtype`) and for a smoke model on any CPU.
    The model is in eval mode; on CUDA it is loaded straight onto the GPU.
    """
    model_dir = Path(model_dir).expanduser()
    _check_qwen3_vl_folder(model_dir)
    torch = require_torch()
    dev = resolve_device(device)
    AutoTokenizer, _, Qwen3VL, ImageProcessor = require_transformers()
    meta_path = model_dir / "medvol_model.json"
    meta = _read_json(meta_path) if meta_path.is_file() else {}
    if not isinstance(meta, dict):
        raise ModelError(f"{meta_path} must hold a JSON object")
    dt = _resolve_dtype(dtype, dev, torch, smoke=bool(meta.get("smoke")))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        image_processor = ImageProcessor.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelError(f"cannot load the tokenizer or image processor of {model_dir}: {e}") from None
    load_kw = {"dtype": dt}
    if dev.type == "cuda":
        load_kw["device_map"] = {"": str(dev)}  # straight onto the GPU, not via host memory
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Loading weights" bar is noise in a CLI or a worker
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = Qwen3VL.from_pretrained(str(model_dir), **load_kw)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ModelError(f"cannot load the Qwen3-VL weights from {model_dir}: {e}") from None
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    if dev.type != "cuda":
        model.to(dev)
    model.eval()
    parts = GrounderParts(model, tokenizer, image_processor, model_dir, meta=meta)
    if adapter is not None:
        parts.adapter_dir = Path(adapter).expanduser()
        parts.peft_model, parts.notes = load_adapter(model, model_dir, meta, parts.adapter_dir)
        parts.model = parts.peft_model.get_base_model()
        parts.model.eval()
    return parts


def load_adapter(model, model_dir: Path, meta: dict, adapter_dir: Path):
    """``(peft_model, notes)``: the PEFT adapter in ``adapter_dir`` on ``model`` (not trainable),
    checked to fit it; ``notes`` say what could not be checked and name the adapter."""
    if not adapter_dir.exists():
        raise ModelNotFoundError(f"adapter folder {adapter_dir} does not exist")
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{adapter_dir} is not a PEFT adapter: it has no adapter_config.json "
                         f"(found {folder_listing(adapter_dir)})")
    acfg = _read_json(cfg_path)
    base = (acfg.get("base_model_name_or_path") if isinstance(acfg, dict) else None) or ""
    try:
        from peft import PeftModel
    except ImportError:
        raise DependencyError("loading an adapter needs peft (`pip install peft`)") from None
    made_for = repr(base) if base else "an unnamed base model (adapter_config.json has no base_model_name_or_path)"
    what = f"adapter {adapter_dir} was made for {made_for} and does not fit the model in {model_dir}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
        except pickle.UnpicklingError as e:  # torch.load(weights_only=True) refused what the pickle names
            weights = next((p.name for p in sorted(adapter_dir.iterdir()) if p.suffix in (".bin", ".pt", ".pth")),
                           "its weights file")
            raise ModelError(f"adapter {adapter_dir}: {weights} is a pickle that holds more than tensors, which is "
                             "refused (loading it could run code it carries): "
                             f"{one_line(str(e).strip().splitlines()[0] if str(e).strip() else 'UnpicklingError', 160)}; "
                             "save the adapter as safetensors (adapter_model.safetensors, peft's default)") from None
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:
            detail = str(e).strip()
            first = next((ln.strip() for ln in detail.splitlines() if "size mismatch" in ln), None)
            detail = (first or detail.splitlines()[0]) if detail else type(e).__name__
            raise ModelError(f"{what}: {one_line(detail, 300)}") from None
    missing = [str(w.message) for w in caught if "missing adapter keys" in str(w.message)]
    if missing:
        keys = re.findall(r"'([^']+)'", missing[0])
        example = f"{len(keys)} weight(s), e.g. {keys[0]}" if keys else one_line(missing[0], 200)
        raise ModelError(f"{what}: the model has adapted layers the adapter has no weights for ({example})")
    unexpected = _unexpected_adapter_keys(peft_model, adapter_dir)
    if unexpected:
        raise ModelError(f"{what}: {len(unexpected)} adapter weight(s) match no layer of the model "
                         f"(e.g. {unexpected[0]})")
    notes = []
    base_name = str(base).rstrip("/").split("/")[-1].lower()
    same_path = False
    if base:
        try:
            same_path = Path(base).expanduser().resolve() == model_dir.resolve()
        except (OSError, ValueError):
            pass
    if base and not same_path and base_name not in _identity_names(model_dir, meta):
        note = (f"adapter {adapter_dir.name} names base model {base!r} but was loaded onto {model_dir}; "
                "its weights fit, check that this is the intended base")
        log.warning(note)
        notes.append(note)
    from ..models.identity import ADAPTER_METADATA, read_adapter_metadata

    if read_adapter_metadata(adapter_dir) is None:
        note = (f"adapter {adapter_dir.name} has no {ADAPTER_METADATA} (not made by medvol-train): the base model "
                "it was trained on could not be checked against this one")
        log.warning(note)
        notes.append(note)
    notes.append(f"LoRA adapter: {adapter_dir}")
    return peft_model, notes


def _unexpected_adapter_keys(peft_model, adapter_dir: Path) -> List[str]:
    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        return []
    try:
        from safetensors import safe_open
        with safe_open(str(weights), framework="pt") as f:
            file_keys = list(f.keys())
    except Exception:  # unreadable here means peft already complained above
        return []
    model_keys = {_normalise_adapter_key(k) for k in peft_model.state_dict().keys()}
    return [k for k in file_keys if _normalise_adapter_key(k) not in model_keys]


def _normalise_adapter_key(key: str) -> str:
    parts = [p for p in key.split(".") if p not in ("default", "modules_to_save", "original_module")]
    return ".".join(parts)


def _identity_names(model_dir: Optional[Path], meta: dict) -> set:
    names = set()
    if model_dir is not None:
        names.add(model_dir.name.lower())
    for key in ("id", "repo_id", "base_model", "name"):
        v = meta.get(key)
        if isinstance(v, str) and v:
            names.add(v.rstrip("/").split("/")[-1].lower())
    return names


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path}: {e}") from None


def _check_qwen3_vl_folder(model_dir: Path) -> dict:
    """The folder's config; one clear error when it is not a complete Qwen3-VL checkpoint."""
    from ..models import check_grounder_dir

    if not model_dir.exists():
        raise ModelNotFoundError(f"model folder {model_dir} does not exist; install the model or check the path")
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir} is not a folder; a Qwen3-VL checkpoint is a folder with config.json")
    return check_grounder_dir(model_dir)


def _resolve_dtype(dtype, dev, torch, smoke: bool = False):
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        from ..cpu import grounder_dtype  # bf16 on CUDA and on CPUs with bf16 arithmetic; fp32 otherwise

        # a smoke model (random weights: tests, benchmarks) stays fp32 on a CPU, so that its answers,
        # which hang on near-ties, are the same on every CPU
        dtype = "fp32" if smoke and dev.type == "cpu" else grounder_dtype(None, dev)
    if isinstance(dtype, str):
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16}
        if dtype.lower() not in names:
            raise InputError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
        return names[dtype.lower()]
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"dtype must be a torch dtype or its name, got {dtype!r}")
    return dtype
