"""What a trained adapter's folder carries so that others can load and check it (medvoltrain.adapter):
medvol_adapter.json with the base model, a filled model card, the Hub id in adapter_config.json,
and the evaluations run on it. Uses the session's 4-step SFT run on the tiny model (no new training)."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from medvolcore import RESEARCH_USE_NOTICE, models
from medvolcore.errors import AdapterMismatchError

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.mark.slow  # trains the tiny model (the session's SFT run)
def test_a_tiny_sft_adapter_records_its_base_data_and_steps(sft_run, sm_data):
    from huggingface_hub import ModelCard

    adapter = sft_run / "adapter"
    meta = json.loads((adapter / "medvol_adapter.json").read_text(encoding="utf-8"))
    tiny_dir = models.resolve("tiny").grounder_dir
    assert meta["schema"] == "medvol.adapter/1" and meta["stage"] == "sft" and meta["steps"] == 4
    assert meta["preset"] == "tiny"
    assert meta["base_model"]["builder"] == "tiny" and meta["base_model"]["repo_id"] is None
    index_sha = hashlib.sha256((sm_data / "samples.jsonl").read_bytes()).hexdigest()
    assert meta["data"]["index_sha256"] == index_sha and meta["data"]["samples"] == 4
    assert meta["settings"]["lora_r"] == 128 and meta["evaluations"] == []
    # tiny has no Hub id: adapter_config.json keeps the local folder, and the card says why
    cfg = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    assert cfg["base_model_name_or_path"] == str(tiny_dir.resolve())
    card = ModelCard.load(adapter / "README.md")
    assert card.data.library_name == "peft" and "smoke-test" in card.data.tags and card.data.base_model is None
    text = card.text
    assert "has no Hugging Face Hub id" in text and index_sha in text and "optimiser steps: 4" in text
    assert "Not evaluated" in text and RESEARCH_USE_NOTICE in text and "meaningless" in text
    assert "Reward terms" not in text  # an SFT adapter has none
    # it is what the tiny preset accepts, and what a real preset refuses, naming both
    assert models.resolve("tiny", adapter=adapter).adapter_dir == adapter
    with pytest.raises(AdapterMismatchError, match="tiny smoke model .*preset 'qwen3-vl-2b' uses "
                                                   "Qwen/Qwen3-VL-2B-Instruct"):
        models.check_adapter_given("qwen3-vl-2b", adapter)


@pytest.mark.slow  # trains the tiny model (the session's SFT run)
def test_an_adapter_of_a_real_preset_names_its_hub_id_revision_and_licence(sft_run, sm_data, tmp_path):
    """The files for a run on qwen3-vl-4b (the preset's pinned commit, nothing downloaded), written
    over a copy of the tiny adapter: PEFT's config names the Hub id and commit, the card the
    licence; an evaluation recorded later replaces the 'not evaluated' line."""
    from huggingface_hub import ModelCard
    from medvoltrain.adapter import adapter_metadata, record_evaluation, write_adapter_files
    from medvoltrain.config import GRPOSettings

    folder = tmp_path / "adapter"
    shutil.copytree(sft_run / "adapter", folder)
    settings = GRPOSettings(preset="qwen3-vl-4b")
    meta = adapter_metadata("grpo", settings, tmp_path, sm_data, started_from=sft_run / "adapter",
                            reward_weights={"format_reward": 1.0, "consistency_reward": 0.5})
    write_adapter_files(folder, dict(meta, steps=7))
    pin = models.get_preset("qwen3-vl-4b").grounder["revision"]
    cfg = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    assert (cfg["base_model_name_or_path"], cfg["revision"]) == ("Qwen/Qwen3-VL-4B-Instruct", pin)
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == "Qwen/Qwen3-VL-4B-Instruct" and card.data.license == "apache-2.0"
    assert f"revision `{pin}`" in card.text and "| consistency_reward | 0.5 |" in card.text
    assert "optimiser steps: 7" in card.text and "Not evaluated" in card.text
    with pytest.raises(AdapterMismatchError):
        models.check_adapter_given("tiny", folder)

    header, line = ["Method", "Avg DSC"], ["MedVol-R1 (tiny)", "12.50"]
    summary = {"split": "test", "method": "m", "settings": {"data": str(sm_data)}, "cases_in_split": 2,
               "cases_evaluated": 1, "cases_pending": 1, "written": "2026-01-01T00:00:00+00:00"}
    assert record_evaluation(folder, tmp_path / "EVAL", summary, header, line)
    assert record_evaluation(folder, tmp_path / "EVAL", summary, header, ["MedVol-R1 (tiny)", "13.00"])
    text = ModelCard.load(folder / "README.md").text
    assert "Not evaluated" not in text and "| MedVol-R1 (tiny) | 13.00 |" in text and "12.50" not in text
    assert "1 of 2 cases, 1 not evaluated yet (partial)" in text
    assert len(json.loads((folder / "medvol_adapter.json").read_text())["evaluations"]) == 1  # one per output folder
    assert not record_evaluation(tmp_path, tmp_path / "EVAL", summary, header, line)  # not a medvol-train adapter


@pytest.mark.slow  # trains the tiny model (the session's SFT run)
def test_evaluate_records_its_table_in_the_adapters_card(sft_run, tmp_path):
    """`medvol-train evaluate --adapter`'s aggregation (on hand-made case rows, as test_evaluate
    does; no model runs) adds its table row to the adapter's card and record."""
    from huggingface_hub import ModelCard
    from medvoltrain.evaluate import EvalSettings, aggregate, case_key

    folder = tmp_path / "adapter"
    shutil.copytree(sft_run / "adapter", folder)
    out = tmp_path / "EVAL"
    settings = EvalSettings(data=str(tmp_path), preset="tiny", adapter=str(folder), sam="random:0:64")
    row = {"id": "k1", "dataset": "0004", "status": "ok", "dsc_pct": 61.25, "iou_pct": 44.0, "hit": 1,
           "box_iou": 0.5, "axial_score": 1.0, "seconds": 1.0}
    (out / "cases").mkdir(parents=True)
    (out / "cases" / f"{case_key('k1')}.json").write_text(json.dumps({"fingerprint": settings.fingerprint(),
                                                                       "row": row}))
    aggregate([{"id": "k1"}, {"id": "k2"}], out, settings, settings.fingerprint())
    evals = json.loads((folder / "medvol_adapter.json").read_text())["evaluations"]
    assert [(e["out"], e["cases_evaluated"], e["cases_pending"]) for e in evals] == [(str(out.resolve()), 1, 1)]
    text = ModelCard.load(folder / "README.md").text
    assert "Not evaluated" not in text and "| 61.25 | 44.00 |" in text and "(partial)" in text
