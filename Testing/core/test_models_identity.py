"""Honest model identity and the research-use notice (issue 25).

No trained MedVol-R1 adapter is published, so a result is called MedVol-R1 only when an adapter that
``medvol-train`` wrote made it; a grounder without a task adapter is named "zero-shot, not trained
for this task", and every output says which. The checks here load no model: the labels are unit
checks, and the end-to-end run uses fake weight files (resolved as a real preset) with the loaded
grounder replaced by a stand-in that returns a fixed anchor, and seeded random MedSAM2 weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medvolcore import RESEARCH_USE_NOTICE, models
from medvolcore.anchor import EvidenceAnchor
from medvolcore.models.identity import ADAPTER_METADATA, describe, identity_banner, identity_note

WEIGHT_BYTES = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "  # an empty safetensors file
ZERO_SHOT = "Qwen3-VL-4B-Instruct, zero-shot, not trained for this task"


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "medvol_home"
    monkeypatch.setenv("MEDVOL_HOME", str(h))
    monkeypatch.delenv("MEDVOL_MODELS_JSON", raising=False)
    return h


def make_adapter(folder: Path, stage=None) -> Path:
    """A LoRA adapter folder; ``stage``: also the record medvol-train writes beside its adapters."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": "Qwen/Qwen3-VL-4B-Instruct"}))
    (folder / "adapter_model.safetensors").write_bytes(WEIGHT_BYTES)
    if stage:
        (folder / ADAPTER_METADATA).write_text(json.dumps({"stage": stage, "base_model": "/m/Qwen3-VL-4B-Instruct"}))
    return folder


def import_fake_4b(tmp_path) -> None:
    """Register fake Qwen3-VL-4B + MedSAM2 files for qwen3-vl-4b (and so medvol-r1): resolvable, never loaded."""
    src = tmp_path / "weights"
    g = src / "grounder"
    g.mkdir(parents=True)
    (g / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    (g / "model.safetensors").write_bytes(WEIGHT_BYTES)
    for name in ("tokenizer.json", "preprocessor_config.json"):
        (g / name).write_text("{}")
    (src / "MedSAM2_latest.pt").write_bytes(b"not loaded")
    models.import_weights("qwen3-vl-4b", src, link=True, progress=False)


# ---- who made it: the labels ---------------------------------------------------------------------

def test_identity_labels_for_the_base_model_an_adapter_a_medvol_train_adapter_and_tiny(tmp_path, home):
    base = describe("qwen3-vl-4b", "Qwen3-VL-4B-Instruct")
    assert (base["label"], base["name"], base["zero_shot"], base["trained_for_task"]) == \
        (ZERO_SHOT, "Qwen3-VL-4B-Instruct", True, False)

    plain = describe("medvol-r1", "Qwen3-VL-4B-Instruct", make_adapter(tmp_path / "someones-lora"))
    assert plain["label"] == ("Qwen3-VL-4B-Instruct + LoRA adapter someones-lora (not made by medvol-train: not known "
                              "to be trained for this task)")
    assert plain["name"] != "MedVol-R1" and not plain["trained_for_task"] and not plain["zero_shot"]

    trained = describe("medvol-r1", "Qwen3-VL-4B-Instruct", make_adapter(tmp_path / "run7" / "adapter", "grpo"))
    assert trained["label"] == "MedVol-R1 (adapter: run7/adapter, medvol-train grpo stage, on Qwen3-VL-4B-Instruct)"
    assert (trained["name"], trained["adapter_stage"], trained["trained_for_task"]) == ("MedVol-R1", "grpo", True)

    # the tiny smoke model is never MedVol-R1, even with a medvol-train adapter (trained on tiny)
    tiny = describe("tiny", "tiny untrained Qwen3-VL", tmp_path / "run7" / "adapter", smoke=True)
    assert tiny["label"].startswith("untrained tiny smoke model") and tiny["name"] != "MedVol-R1"
    assert tiny["smoke"] and not (tiny["trained_for_task"] or tiny["zero_shot"])

    assert models.preset_identity("tiny")["smoke"] and models.preset_identity("qwen3-vl-4b") == base
    assert models.preset_identity("medvol-r1")["needs_adapter"]


def test_notes_and_banners_say_so_unless_a_medvol_r1_adapter_made_it(tmp_path):
    base = describe("qwen3-vl-4b", "Qwen3-VL-4B-Instruct")
    trained = describe("medvol-r1", "Qwen3-VL-4B-Instruct", make_adapter(tmp_path / "r" / "adapter", "sft"))
    assert "zero-shot guesses that are often wrong" in identity_note(base) and ZERO_SHOT in identity_note(base)
    assert identity_banner(base) == "ZERO-SHOT Qwen3-VL-4B-Instruct: not trained for this task, often wrong"
    assert identity_note(trained) is None and identity_banner(trained) == ""


# ---- the notice in --help --------------------------------------------------------------------------

def test_the_notice_and_the_zero_shot_default_are_in_both_helps():
    from medvolcore.cli.app import build_parser

    text = " ".join(build_parser().format_help().split())
    assert text.count(RESEARCH_USE_NOTICE) == 2  # the description and the epilog
    assert "No trained MedVol-R1 adapter is published" in text and "zero-shot" in text
    medvoltrain = pytest.importorskip("medvoltrain.cli")
    assert RESEARCH_USE_NOTICE in " ".join(medvoltrain.build_parser().format_help().split())


# ---- every output of a run: anchor notes, result, QC picture, batch report -------------------------

class FixedAnchorGrounder:
    """Stands in for a loaded Qwen3-VL: answers every query with one box on slice 1."""

    is_smoke = False

    def ground(self, stack, query, **kw):
        from medvolcore.grounder.model import GroundingResult

        anchor = EvidenceAnchor(1, [[8, 8, 30, 28]], [stack.width, stack.height], source="grounder", query=query)
        return GroundingResult(anchor=anchor, reasoning="the liver is large", raw_text="<think>…</think>",
                               shown_slices=[4], timings={}, notes=[])


@pytest.fixture(scope="module")
def tiny_ct(tmp_path_factory):
    """A 40×40×2 CT (HU, 1 mm voxels): a body of soft tissue in air with a bright block, the smallest
    volume a run takes, cheap to propagate (with air, so that it looks like CT)."""
    import nibabel as nib
    import numpy as np

    data = np.full((40, 40, 2), -1000, np.int16)
    data[4:36, 4:36, :] = -100
    data[10:28, 10:30, :] = 60
    path = tmp_path_factory.mktemp("identity_ct") / "ct.nii.gz"
    nib.save(nib.Nifti1Image(data, np.eye(4)), str(path))
    return path


@pytest.fixture(scope="module")
def propagator():
    from medvolcore.propagation import MedSAM2Propagator

    return MedSAM2Propagator.from_random(0, image_size=64)


@pytest.mark.parametrize("preset, stage", [("qwen3-vl-4b", None), ("medvol-r1", "grpo")], ids=["zero-shot", "medvol-r1"])
def test_a_batch_run_names_its_model_everywhere(tmp_path, home, monkeypatch, tiny_ct, propagator, preset, stage):
    from PIL import Image

    from medvolcore.batch import BatchOptions, run_batch
    from medvolcore.grounder import QwenVLGrounder
    from medvolcore.pipeline import Pipeline

    import_fake_4b(tmp_path)
    adapter = make_adapter(tmp_path / "run1" / "adapter", stage) if stage else None
    monkeypatch.setattr(QwenVLGrounder, "from_pretrained", classmethod(lambda cls, *a, **k: FixedAnchorGrounder()))
    pipe = Pipeline(preset, adapter=adapter, device="cpu", propagator=propagator, stop_after_empty=0)
    manifest = tmp_path / "cases.csv"
    manifest.write_text(f"id,volume,query\nc1,{tiny_ct},the bright block\n")
    res = run_batch(manifest, tmp_path / "out", BatchOptions(device="cpu", progress=False), pipeline=pipe)
    assert res.exit_code == 0, res.rows

    ident = res.info["identity"]
    done = json.loads((tmp_path / "out" / "c1" / "done.json").read_text())
    anchor = json.loads((tmp_path / "out" / "c1" / "anchor.json").read_text())
    page = (tmp_path / "out" / "summary.html").read_text()
    with Image.open(tmp_path / "out" / "c1" / "qc.png") as im:
        chunks = dict(im.text)
    assert done["identity"] == ident and res.info["model_label"] == ident["label"]
    assert res.info["research_use"] == RESEARCH_USE_NOTICE and chunks["Disclaimer"] == RESEARCH_USE_NOTICE
    assert page.count(RESEARCH_USE_NOTICE) == 2 and f"model: {ident['label']}" in page
    assert chunks["Source"] == f"model: {ident['label']}"
    if stage is None:  # the base model: zero-shot, said in the notes, the banner, the report and the JSON
        assert ident["label"] == ZERO_SHOT and ident["zero_shot"] and "MedVol-R1" not in json.dumps(ident)
        assert identity_note(ident) in anchor["notes"] and res.info["notice"] == identity_note(ident)
        assert chunks["Warning"] == identity_banner(ident) and 'class="banner"' in page
    else:  # an adapter medvol-train wrote: MedVol-R1, and no zero-shot warning anywhere
        assert ident["name"] == "MedVol-R1" and ident["label"].startswith("MedVol-R1 (adapter: run1/adapter")
        assert not any("zero-shot" in n for n in anchor.get("notes", [])) and "notice" not in res.info
        assert "Warning" not in chunks and 'class="banner"' not in page


def test_the_worker_hello_carries_the_notice_and_what_its_default_runs_as(home):
    from medvolcore.serve import Worker

    w = Worker(transport="stdio")
    try:
        h = w.hello()
    finally:
        w.close(5)
    assert h["research_use"] == RESEARCH_USE_NOTICE
    assert h["model_label"] == h["models"]["identity"]["label"] == ZERO_SHOT and h["models"]["loaded"] is False


def test_qc_text_never_draws_the_notice_with_a_missing_glyph():
    from PIL import ImageFont

    from medvolcore import RESEARCH_USE_NOTICE
    from medvolcore.qc import _drawable

    font = ImageFont.load_default(size=13)
    assert "—" in RESEARCH_USE_NOTICE  # the default font has no em dash: it would draw an empty box
    assert _drawable(RESEARCH_USE_NOTICE, font) == RESEARCH_USE_NOTICE.replace("—", "-")
    assert _drawable("café ≥ 2 · plain", font) == "cafe >= 2 · plain"  # "·" has a glyph and is kept
