"""Cold-start SFT on the tiny model (CPU): loss, completion-only labels, adapter, resume, config errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from medvolcore.errors import ModelError, OutputExistsError
from medvoltrain.cli import main
from medvoltrain.config import SFTSettings, load_settings, parse_overrides
from medvoltrain.errors import ConfigError

from training_data import SFT_OVERRIDES

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.mark.slow  # trains the tiny model (the session's SFT run)
def test_sft_lowers_the_loss_and_logs_loss_and_lr(sft_run):
    report = json.loads((sft_run / "training.json").read_text(encoding="utf-8"))
    steps = [h["step"] for h in report["loss_history"]]
    assert steps == [1, 2, 3, 4] and report["global_step"] == 4
    losses = [h["loss"] for h in report["loss_history"]]
    assert losses[-1] < losses[0] - 0.05, losses  # 4 steps at lr 0.02 (test override) on 4 samples
    assert report["samples"] == 4  # three positives and the negative (brain: target [], through the collator)
    assert report["bf16"] is False  # CPU: fp32 with a notice
    assert {p.name for p in (sft_run / "checkpoints").iterdir() if p.name.startswith("checkpoint-")} == \
        {"checkpoint-2", "checkpoint-4"}
    events = list((sft_run / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    blob = b"".join(p.read_bytes() for p in events)
    assert b"train/loss" in blob and b"train/learning_rate" in blob


@pytest.mark.slow  # trains the tiny model (the session's SFT run)
def test_adapter_loads_back_through_the_grounder_and_changes_its_output(sft_run, sm_data, ct_sm_path):
    import torch
    from safetensors import safe_open

    from medvolcore import models
    from medvolcore.grounder import QwenVLGrounder
    from medvolcore.stack import AxialStack
    from medvolcore.volume import load_volume

    adapter = sft_run / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    assert cfg["r"] == 128 and cfg["lora_alpha"] == 256
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert keys and all("language_model" in k for k in keys)  # vision tower frozen, no LoRA there
    assert {k.split(".")[-3] for k in keys if "lora_A" in k} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"}
    base_dir = models.resolve("tiny").grounder_dir
    base = QwenVLGrounder.from_pretrained(base_dir)
    tuned = QwenVLGrounder.from_pretrained(base_dir, adapter=adapter)
    assert any("LoRA adapter" in n for n in tuned.notes)
    inputs, _ = base.build_inputs(AxialStack(load_volume(ct_sm_path)), "the organ that secretes bile")
    with torch.no_grad():
        a = base.model(**inputs).logits[0, -1]
        b = tuned.model(**inputs).logits[0, -1]
    assert not torch.allclose(a, b, atol=1e-4)
    # and through the CLI's model resolution (what `medvol segment --adapter` does)
    assert models.resolve("tiny", adapter=adapter).adapter_dir == adapter


@pytest.mark.slow  # trains the tiny model (the session's SFT run)
def test_resume_continues_from_the_saved_step(sft_run, sm_data, tmp_path):
    run = tmp_path / "RUN"
    shutil.copytree(sft_run, run)
    shutil.rmtree(run / "checkpoints" / "checkpoint-4")  # as if killed between the two saves
    rc = main(["sft", "--data", str(sm_data), "--output", str(run), "--preset", "tiny", "--max-steps", "5",
               "--resume", *SFT_OVERRIDES])
    assert rc == 0
    report = json.loads((run / "training.json").read_text(encoding="utf-8"))
    assert report["resumed_from"].endswith("checkpoint-2") and report["global_step"] == 5
    original = json.loads((sft_run / "training.json").read_text(encoding="utf-8"))["loss_history"]
    assert [h["step"] for h in report["loss_history"]] == [1, 2, 3, 4, 5]
    assert report["loss_history"][:2] == original[:2]  # steps 1-2 come from the checkpoint, not run again
    state = json.loads((run / "checkpoints" / "checkpoint-2" / "trainer_state.json").read_text(encoding="utf-8"))
    assert state["global_step"] == 2


def test_defaults_are_the_papers_and_the_yaml_spells_them_out():
    assert SFTSettings().preset is None  # the manifest's default, resolved when settings are loaded
    s = load_settings()
    assert (s.lora_r, s.learning_rate, s.num_train_epochs, s.per_device_train_batch_size, s.optim,
            s.warmup_ratio, s.lr_scheduler_type, s.bf16, s.gradient_checkpointing, s.preset) == \
        (128, 2e-5, 1.0, 2, "adamw_torch", 0.1, "cosine", "auto", True, "qwen3-vl-4b")
    assert load_settings(str(REPO / "Training" / "configs" / "sft.yaml")) == s
    data = yaml.safe_load((REPO / "Training" / "configs" / "sft.yaml").read_text(encoding="utf-8"))
    assert set(data) == set(s.to_dict())


def test_config_layers_and_errors(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("learning_rate: 1.0e-4\nmax_steps: 10\nlora_scope: language+vision\n", encoding="utf-8")
    s = load_settings(str(cfg), parse_overrides(["max_steps=3", "save_total_limit=null", "bf16=false"]), preset="tiny")
    assert (s.learning_rate, s.max_steps, s.lora_scope, s.preset, s.save_total_limit, s.bf16) == \
        (1e-4, 3, "language+vision", "tiny", None, False)
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) lora_rank .*valid keys: preset, model_path, lora_r,"):
        load_settings(None, {"lora_rank": "8"})
    cfg.write_text("learning_rat: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="learning_rat in .*c.yaml; valid keys"):
        load_settings(str(cfg))
    with pytest.raises(ConfigError, match="lora_r must be int, got 'big'"):
        load_settings(None, {"lora_r": "big"})
    with pytest.raises(ConfigError, match="lora_scope must be one of"):
        load_settings(None, {"lora_scope": "everything"})
    with pytest.raises(ConfigError, match="not key=value"):
        parse_overrides(["learning_rate"])
    cfg.write_text("[1, 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(str(cfg))


def test_a_base_model_that_is_not_qwen3_vl_is_refused(sm_data, tmp_path, capsys):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}), encoding="utf-8")
    from medvoltrain.sft import resolve_model_dir

    with pytest.raises(ModelError, match="holds a llama model .*needs model_type 'qwen3_vl'"):
        resolve_model_dir(load_settings(None, {"model_path": str(folder)}))
    rc = main(["sft", "--data", str(sm_data), "--output", str(tmp_path / "R"), f"model_path={folder}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("medvol-train: error: ") and "llama" in err[0]
    assert not (tmp_path / "R" / "adapter").exists()


@pytest.mark.slow  # trains the tiny model (the session's SFT run)
def test_cli_one_line_errors_for_runs_and_data(sft_run, sm_data, tmp_path, capsys):
    cases = [
        (["sft", "--data", str(sm_data), "--output", str(sft_run), "--preset", "tiny"], "already holds a run"),
        (["sft", "--data", str(sm_data), "--output", str(tmp_path / "new"), "--preset", "tiny", "--resume"],
         "holds no checkpoint"),
        (["sft", "--data", str(tmp_path), "--output", str(tmp_path / "x"), "--preset", "tiny"],
         "not a prepared training set"),
        (["sft", "--data", str(sm_data), "--output", str(tmp_path / "x"), "lr=1"], "unknown setting(s) lr"),
        (["sft", "--data", str(sm_data), "--output", str(tmp_path / "x"), "--preset", "tiny", "split=validation"],
         "split must be train or test"),
    ]
    for argv, expected in cases:
        rc = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and expected in err[0] and err[0].startswith("medvol-train: error: "), \
            (argv, err)
    with pytest.raises(OutputExistsError):
        from medvoltrain.sft import train_sft

        train_sft(sm_data, sft_run, load_settings(None, {"preset": "tiny"}))


def test_the_printed_losses_are_rounded(monkeypatch, capsys, tmp_path):
    """The run's one line shows losses as a person reads them (``6.452``), not every float digit."""
    import medvoltrain.sft
    from medvoltrain.cli import main as train_main

    def fake_run(data, output, settings, resume=False, overwrite=False):
        return {"adapter": str(output), "global_step": 2, "seconds": 1.0, "loss_first": 6.451651573181152,
                "loss_last": 6.451651573181152}

    monkeypatch.setattr(medvoltrain.sft, "train_sft", fake_run)
    code = train_main(["sft", "--data", str(tmp_path), "--output", str(tmp_path / "a"), "--preset", "tiny",
                       "--max-steps", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "loss 6.452 → 6.452" in out and "6.4516" not in out
