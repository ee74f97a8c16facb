"""What a trained adapter's folder carries besides PEFT's files, so that others can load and check it.

``RUN/adapter/`` after ``medvol-train sft`` or ``grpo``::

    adapter_model.safetensors   the LoRA weights (PEFT)
    adapter_config.json         PEFT's config; ``base_model_name_or_path`` is the base model's Hub id
                                and ``revision`` its commit (for ``tiny``, which has no Hub id: the
                                local folder it was built in)
    medvol_adapter.json         ours (schema ``medvol.adapter/1``): preset, base model (repo id,
                                revision, or the tiny builder), stage, steps, training settings, the
                                data's hash, reward weights (GRPO), medvol versions, evaluations
    README.md                   a filled Hugging Face model card (huggingface_hub ``ModelCard``)

:func:`adapter_metadata` builds ``medvol_adapter.json``'s content before training ends,
:func:`write_adapter_files` finishes a folder PEFT has just saved, and :func:`record_evaluation`
adds an evaluation (``medvol-train evaluate --adapter``) to both files. ``medvolcore`` reads the
record back (:func:`medvolcore.models.identity.read_adapter_metadata`) and refuses the adapter with
a preset of another base model (:func:`medvolcore.models.presets.check_adapter_base`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from medvolcore import RESEARCH_USE_NOTICE
from medvolcore.models.identity import ADAPTER_METADATA, ADAPTER_SCHEMA, read_adapter_metadata

from . import __version__

log = logging.getLogger(__name__)

CARD_TEMPLATE = "adapter_model_card.md"  # Resources/training/
_CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/\\]+?)--(?P<name>[^/\\]+)[/\\]snapshots[/\\](?P<rev>[0-9a-f]{40})$")
# the settings the model card lists (all of them are in medvol_adapter.json)
CARD_SETTINGS = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                 "prompts_per_device", "num_generations", "gradient_accumulation_steps", "lora_r", "lora_alpha",
                 "lora_dropout", "lora_scope", "lora_modules_to_save", "beta", "temperature", "delta", "seed")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def sha256_of(path) -> Optional[str]:
    p = Path(path)
    if not p.is_file():
        return None
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def base_model_record(settings, model_dir) -> dict:
    """The base model an adapter is trained on: ``{"preset", "repo_id", "revision", "builder",
    "path", "name", "licence", "licence_source"}``.

    A preset with a Hub grounder: its repo id and the commit its registered weights were downloaded
    at (else the table's pin; None for weights imported by hand, whose commit nobody recorded).
    ``tiny``: ``builder`` ``"tiny"`` and its local folder (it has no Hub id). A ``model_path``
    folder: the repo id and commit when it is a Hugging Face cache snapshot
    (``…/models--ORG--NAME/snapshots/COMMIT``), else only its path (nothing to check against).
    """
    from medvolcore import models

    model_dir = Path(model_dir).resolve()
    rec = {"preset": None, "repo_id": None, "revision": None, "builder": None, "path": str(model_dir),
           "name": model_dir.name, "licence": None, "licence_source": None}
    if settings.model_path:
        m = _CACHE_SNAPSHOT.search(model_dir.as_posix())
        if m:
            rec.update(repo_id=f"{m['org']}/{m['name']}", revision=m["rev"], name=m["name"])
        return rec
    p = models.get_preset(settings.preset_name())
    rec.update(preset=p.name, licence=p.grounder.get("licence"), licence_source=p.grounder.get("licence_source"))
    if p.grounder_kind == "builder":
        rec.update(builder=p.grounder["builder"], name=models.presets.base_model_name(p))
    elif p.grounder_kind == "hub":
        rev = models.revisions(p.name).get("grounder") or {}
        rec.update(repo_id=p.grounder["repo_id"], revision=rev.get("revision"),
                   name=p.grounder["repo_id"].rstrip("/").split("/")[-1])
    return rec


def adapter_metadata(stage: str, settings, model_dir, data_dir, *, started_from=None, reward_weights=None) -> dict:
    """``medvol_adapter.json``'s content for a run of ``stage`` (``sft``/``grpo``) on ``data_dir``
    (a prepared folder: its ``samples.jsonl`` is hashed); ``steps`` is added when it is written."""
    import medvolcore
    from .prepare import INDEX, load_samples

    data = Path(data_dir).resolve()
    try:
        samples = len(load_samples(data, settings.split))
    except Exception:  # the count is for people; training already read the set
        samples = None
    base = base_model_record(settings, model_dir)
    return {"schema": ADAPTER_SCHEMA, "stage": stage, "preset": base["preset"], "base_model": base,
            # kept from before schema medvol.adapter/1: the base model folder as a path
            "base_model_path": base["path"],
            "started_from": str(started_from) if started_from else None,
            "data": {"path": str(data), "index": INDEX, "index_sha256": sha256_of(data / INDEX),
                     "split": settings.split, "samples": samples},
            "reward_weights": dict(reward_weights) if reward_weights else None,
            "settings": settings.to_dict(), "created": _now(),
            "versions": {"medvoltrain": __version__, "medvolcore": medvolcore.__version__},
            "research_use": RESEARCH_USE_NOTICE, "evaluations": []}


def _point_config_at_base(folder: Path, base: dict) -> None:
    """adapter_config.json names the base model's Hub id and commit (PEFT's own config class reads
    and writes it; the trainer saved the local folder it loaded). ``tiny`` keeps its local path."""
    if not base.get("repo_id"):
        return
    from peft import PeftConfig

    cfg = PeftConfig.from_pretrained(str(folder))
    cfg.base_model_name_or_path = base["repo_id"]
    cfg.revision = base.get("revision")
    cfg.save_pretrained(str(folder))


def _settings_lines(settings: dict) -> list:
    return [f"{k}: {settings[k]}" for k in CARD_SETTINGS if k in settings and settings[k] not in (None, "")]


def _base_text(meta: dict) -> str:
    b = meta.get("base_model") or {}
    if b.get("builder"):
        return (f"The `{b['builder']}` smoke model: an untrained Qwen3-VL built locally with seeded random weights. It "
                f"has no Hugging Face Hub id, so `adapter_config.json` names the local folder it was built in "
                f"(`{b.get('path')}`); anyone with medvol builds the same model with the `tiny` preset. This adapter "
                "is for tests only: its outputs are meaningless, and it cannot be used with a real model.")
    if b.get("repo_id"):
        rev = b.get("revision")
        return (f"[{b['repo_id']}](https://huggingface.co/{b['repo_id']}) at revision "
                + (f"`{rev}`" if rev else "unknown (the weights were imported by hand; their commit was not recorded)"))
    return (f"A local Qwen3-VL folder (`{b.get('path')}`) of unknown origin: no Hub id is known, so "
            "`adapter_config.json` names that path and nobody else can check which model it was.")


def _short(path) -> Optional[str]:
    """A local path as the card shows it: its last two parts (the card is for sharing; the full
    paths stay in medvol_adapter.json)."""
    if not path:
        return None
    parts = Path(str(path)).parts
    return "/".join(parts[-2:]) if len(parts) > 1 else str(path)


def model_card(meta: dict):
    """The filled model card (a huggingface_hub ``ModelCard``) for ``meta`` (``medvol_adapter.json``)."""
    from huggingface_hub import ModelCard, ModelCardData
    from medvolcore.resources import resource_path

    b = meta.get("base_model") or {}
    licence = b.get("licence") if b.get("licence") not in (None, "none") else None
    smoke = bool(b.get("builder"))
    data = meta.get("data") or {}
    card_data = ModelCardData(
        base_model=b.get("repo_id") or None, library_name="peft", license=licence,
        tags=["medvol-r1", "lora", "medical-imaging", "ct", "segmentation", "research-use-only", meta.get("stage")]
        + (["smoke-test"] if smoke else []),
        pipeline_tag="image-text-to-text")
    rewards = sorted((meta.get("reward_weights") or {}).items())
    def cases(e: dict) -> str:
        pending = f", {e['cases_pending']} not evaluated yet (partial)" if e.get("cases_pending") else ""
        return f"{e.get('cases_evaluated')} of {e.get('cases_in_split')} cases{pending}"

    evaluations = [dict(e, table="\n".join(e.get("table_markdown") or []), out=_short(e.get("out")),
                        data=_short(e.get("data")), cases=cases(e)) for e in meta.get("evaluations") or []]
    template = Path(resource_path("training", CARD_TEMPLATE)).read_text(encoding="utf-8")
    stage = meta.get("stage") or "?"
    title = f"MedVol-R1 LoRA adapter ({stage} stage) on {b.get('name') or 'an unknown base model'}"
    honesty = ("Made on the untrained tiny smoke model: its outputs are meaningless." if smoke else
               "Whether it grounds well is what the Evaluation section below says; without one, it is untested.")
    return ModelCard.from_template(
        card_data, template_str=template, title=title, research_notice=RESEARCH_USE_NOTICE, honesty=honesty,
        stage=stage, medvol_version=(meta.get("versions") or {}).get("medvoltrain", "?"),
        created=meta.get("created", "?"), base_text=_base_text(meta), preset=meta.get("preset") or "(model_path)",
        licence=b.get("licence") or "unknown", licence_source=b.get("licence_source"),
        started_from=_short(meta.get("started_from")), steps=meta.get("steps", "?"),
        data_name=_short(data.get("path")) or "?", samples=data.get("samples", "?"), split=data.get("split", "?"),
        data_sha256=data.get("index_sha256") or "unknown", settings_lines=_settings_lines(meta.get("settings") or {}),
        rewards=rewards, evaluations=evaluations)


def _write_meta_and_card(folder: Path, meta: dict) -> None:
    from medvolcore.fileio import write_text_atomic

    write_text_atomic(folder / ADAPTER_METADATA, json.dumps(meta, indent=1) + "\n", overwrite=True)
    write_text_atomic(folder / "README.md", str(model_card(meta)), overwrite=True)


def write_adapter_files(folder, meta: dict) -> None:
    """Finish an adapter folder PEFT has just saved: point adapter_config.json at the base model's
    Hub id and commit, write ``medvol_adapter.json`` (``meta``) and the model card (``README.md``,
    replacing PEFT's empty template)."""
    folder = Path(folder)
    _point_config_at_base(folder, meta.get("base_model") or {})
    _write_meta_and_card(folder, meta)


def record_evaluation(adapter_dir, out_dir, summary: dict, header, line) -> bool:
    """Add an evaluation of the adapter in ``adapter_dir`` (``medvol-train evaluate``'s ``summary``
    and table row) to its ``medvol_adapter.json`` and model card; one entry per output folder (a
    later run into the same folder replaces it). Only for adapters medvol-train wrote
    (``medvol.adapter/1``) and evaluations of at least one case; returns whether it was recorded
    (a read-only folder: a warning, the evaluation's own files are written all the same)."""
    if not adapter_dir:
        return False
    folder = Path(adapter_dir)
    meta = read_adapter_metadata(folder)
    if not meta or meta.get("schema") != ADAPTER_SCHEMA or not summary.get("cases_evaluated"):
        return False
    out = str(Path(out_dir).resolve())
    settings = summary.get("settings") or {}
    entry = {"out": out, "split": summary.get("split"), "data": settings.get("data"), "method": summary.get("method"),
             "stop_after_empty": settings.get("stop_after_empty"), "fingerprint": summary.get("fingerprint"),
             "cases_in_split": summary.get("cases_in_split"), "cases_evaluated": summary.get("cases_evaluated"),
             "cases_pending": summary.get("cases_pending"), "average": summary.get("average"),
             "written": summary.get("written") or _now(),
             "table_markdown": ["| " + " | ".join(str(c).replace("|", "\\|") for c in header) + " |",
                                "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
                                "| " + " | ".join(str(c).replace("|", "\\|") for c in line) + " |"]}
    meta["evaluations"] = [e for e in meta.get("evaluations") or [] if e.get("out") != out] + [entry]
    try:
        _write_meta_and_card(folder, meta)
    except OSError as e:
        log.warning("could not record the evaluation in %s (%s); the results are in %s", folder, e, out)
        return False
    return True


__all__ = ["CARD_TEMPLATE", "adapter_metadata", "base_model_record", "model_card", "record_evaluation",
           "write_adapter_files"]
