"""GRPO on the tiny model (CPU): settings, the TRL reward wrappers, the multimodal scoring hook,
and a two-step run from the SFT adapter that logs every reward term."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from medvolcore.answer import format_answer
from medvoltrain.cli import main
from medvoltrain.config import GRPOSettings, load_settings
from medvoltrain.errors import ConfigError
from medvoltrain.prepare import load_samples, load_slices
from medvoltrain.rewards import TERMS, ConsistencyScorer, RewardFunctions

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def test_defaults_are_the_papers_and_the_yaml_spells_them_out():
    assert GRPOSettings().preset is None  # the manifest's default, resolved when settings are loaded
    s = load_settings(cls=GRPOSettings)
    assert s.preset == "qwen3-vl-4b"
    assert (s.num_generations, s.beta, s.learning_rate, s.num_train_epochs, s.prompts_per_device, s.warmup_ratio,
            s.lr_scheduler_type, s.optim, s.bf16, s.gradient_checkpointing, s.max_completion_length, s.delta) == \
        (4, 0.01, 2e-6, 3.0, 1, 0.1, "cosine", "adamw_torch", "auto", True, 256, 5)
    assert s.reward_weights == {"format": 1.0, "axial": 1.0, "box": 1.0, "consistency": 1.0}
    path = REPO / "Training" / "configs" / "grpo.yaml"
    assert load_settings(str(path), cls=GRPOSettings) == s
    assert set(yaml.safe_load(path.read_text(encoding="utf-8"))) == set(s.to_dict())


def test_consensus_samples_use_the_rollouts_sampling_settings():
    """The product's consensus samples are drawn as the GRPO rollouts were (grounder.json's
    ``consensus_sampling`` for every preset = the rollout settings of Training/configs/grpo.yaml)."""
    from medvolcore.grounder.prompt import load_prompts, resolve_settings

    s = load_settings(str(REPO / "Training" / "configs" / "grpo.yaml"), cls=GRPOSettings)
    for preset in load_prompts()["presets"]:
        assert resolve_settings(preset)["consensus_sampling"] == {"temperature": s.temperature, "top_p": s.top_p,
                                                                  "top_k": s.top_k}


def test_ablation_switches_and_bad_settings():
    s = load_settings(None, {"lambda_consistency": "0", "delta": "10"}, cls=GRPOSettings)
    funcs, weights = RewardFunctions().functions(s.reward_weights)
    assert [f.__name__ for f in funcs] == ["format", "axial", "box"] and weights == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="unknown setting.*lambda_fmt.*valid keys: preset"):
        load_settings(None, {"lambda_fmt": "0"}, cls=GRPOSettings)
    with pytest.raises(ConfigError, match="at least one > 0"):
        load_settings(None, {f"lambda_{t}": "0" for t in TERMS}, cls=GRPOSettings)
    with pytest.raises(ConfigError, match="num_generations must be ≥ 2"):
        load_settings(None, {"num_generations": "1"}, cls=GRPOSettings)
    with pytest.raises(ConfigError, match="delta must be ≥ 0"):
        load_settings(None, {"delta": "-1"}, cls=GRPOSettings)
    assert GRPOSettings().consistency_stop_after_empty == 0  # the paper's reward: every window slice
    with pytest.raises(ConfigError, match="consistency_stop_after_empty must be ≥ 0"):
        load_settings(None, {"consistency_stop_after_empty": "-1"}, cls=GRPOSettings)
    from medvoltrain.grpo import make_scorer

    s = load_settings(None, {"consistency_stop_after_empty": "3", "delta": "2"}, cls=GRPOSettings)
    scorer = make_scorer(s, random_weights=0)
    assert (scorer.stop_after_empty, scorer.delta) == (3, 2)


def _answer(z, boxes):
    return format_answer(z, boxes, "because")


def test_trl_wrappers_return_one_float_per_completion_and_read_the_columns(sm_data):
    sample = next(s for s in load_samples(sm_data, "train") if s["label"] == "kidneys")
    z = int(sample["target_info"]["slice"])
    gt = sample["gt_boxes_norm"][str(z)]
    empty = next(int(k) for k, a in enumerate(sample["slice_areas"]) if a == 0)
    completions = [_answer(z, gt), _answer(z, gt[:1]), "no answer at all", _answer(empty, gt)]
    n = len(completions)
    cols = {"slice_areas": [sample["slice_areas"]] * n, "gt_boxes_norm": [json.dumps(sample["gt_boxes_norm"])] * n,
            "sample_id": [sample["id"]] * n}
    f = RewardFunctions(samples={sample["id"]: sample})
    prompts = [sample["id"]] * n
    assert f.format(prompts, completions, **cols) == [1.0, 1.0, 0.0, 1.0]
    areas = np.asarray(sample["slice_areas"], float)
    assert f.axial(prompts, completions, **cols) == pytest.approx([areas[z] / areas.max()] * 2 + [0.0, 0.0])
    box = f.box(prompts, completions, **cols)
    assert box[0] == pytest.approx(1.0, abs=0.02)  # integer rounding of the text only
    assert box[1] == pytest.approx(box[0] / 2, abs=0.02)  # one of two kidneys
    assert box[2:] == [0.0, 0.0]
    # completions as conversational messages read the same
    conv = [[{"role": "assistant", "content": c}] for c in completions]
    assert f.format(prompts, conv, **cols) == [1.0, 1.0, 0.0, 1.0]


def test_a_negative_sample_goes_through_the_grpo_columns(sm_data):
    """The GRPO dataset row of a negative sample (no key slice) and the rewards TRL computes from it:
    [] scores 1, a box answer 0, on every term that reads those columns."""
    from medvoltrain.grpo import grpo_dataset

    samples = load_samples(sm_data, "train")
    neg = next(s for s in samples if s["absent"])
    rows = grpo_dataset(samples)
    row = next(r for r in rows if r["sample_id"] == neg["id"])
    assert row["prompt"] == neg["id"] and set(row["slice_areas"]) == {0} and json.loads(row["gt_boxes_norm"]) == {}
    completions = ["<think>not seen</think><answer>[]</answer>", _answer(3, [[100, 100, 300, 300]])]
    cols = {k: [row[k]] * 2 for k in ("slice_areas", "gt_boxes_norm", "sample_id")}
    f = RewardFunctions(samples={neg["id"]: neg})
    assert f.format(None, completions, **cols) == [1.0, 1.0]
    assert f.axial(None, completions, **cols) == [1.0, 0.0]
    assert f.box(None, completions, **cols) == [1.0, 0.0]


def test_consistency_wrapper_groups_rollouts_and_counts_failures(sm_data):
    from medvolcore.propagation import MedSAM2Propagator

    samples = {s["id"]: s for s in load_samples(sm_data, "train")}
    sid = next(k for k, s in samples.items() if s["label"] == "liver")
    s = samples[sid]
    z = int(s["target_info"]["slice"])
    scorer = ConsistencyScorer(MedSAM2Propagator.from_random(0, image_size=64), delta=1)
    f = RewardFunctions(scorer=scorer, samples=samples)
    completions = [_answer(z, s["gt_boxes_norm"][str(z)])] * 3 + ["garbage"]
    metrics = {}
    out = f.consistency([sid] * 4, completions, sample_id=[sid] * 4, log_metric=metrics.__setitem__)
    assert len(out) == 4 and out[3] == 0.0
    assert out[0] == out[1] == out[2] and 0.0 <= out[0] <= 1.0
    assert scorer.last_encoder_calls == 3  # one window [z-1, z+1] for the whole group, not 3 × 3
    # a sample that cannot be found is a counted failure (None), not a zero
    out = f.consistency(["x"] * 2, completions[:2], sample_id=["missing", "missing"], log_metric=metrics.__setitem__)
    assert out == [None, None] and f.failures["consistency"] == 2
    assert metrics["reward_failures/consistency"] == 2.0


@pytest.fixture(scope="module")
def grpo_run(sft_run, sm_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("grpo") / "RUN2"
    rc = main(["grpo", "--data", str(sm_data), "--adapter", str(sft_run / "adapter"), "--output", str(run),
               "--preset", "tiny", "--max-steps", "2", "--random-weights", "0", "learning_rate=1e-3",
               "warmup_ratio=0", "save_steps=1", "max_completion_length=48", "delta=1", "max_samples=2",
               "num_generations=2", "eval_steps=2", "eval_max_samples=1", "log_completions=true"])
    assert rc == 0
    return run


@pytest.mark.slow  # GRPO steps on the tiny model
def test_two_grpo_steps_from_the_sft_adapter_log_every_term(grpo_run):
    report = json.loads((grpo_run / "training.json").read_text(encoding="utf-8"))
    assert report["global_step"] == 2 and report["started_from"].endswith("adapter")
    assert report["reward_failures"] == {}
    assert [h["step"] for h in report["history"]] == [1, 2]
    for h in report["history"]:
        assert math.isfinite(h["loss"]) and math.isfinite(h["kl"])
        for term in TERMS:
            assert math.isfinite(h[f"rewards/{term}/mean"]) and math.isfinite(h[f"rewards/{term}/std"])
        assert 0 < h["completions/mean_length"] <= 48
    blob = b"".join(p.read_bytes() for p in (grpo_run / "tensorboard").glob("events.out.tfevents.*"))
    assert b"rewards/consistency/mean" in blob and b"kl" in blob
    meta = json.loads((grpo_run / "adapter" / "medvol_adapter.json").read_text(encoding="utf-8"))
    assert meta["stage"] == "grpo"
    assert not (grpo_run / "adapter" / "ref").exists()  # TRL's frozen reference copy is not the product
    assert {p.name for p in (grpo_run / "checkpoints").glob("checkpoint-*")} == {"checkpoint-1", "checkpoint-2"}
    # the feedback: zero-spread fraction per step, TRL's completion log, and the held-out evaluation at step 2
    assert all(0 <= h["frac_reward_zero_std"] <= 1 for h in report["history"])
    assert sorted(p.name for p in (grpo_run / "checkpoints" / "completions").glob("*.parquet")) == \
        ["completions_00001.parquet", "completions_00002.parquet"]
    [ev] = report["evaluations"]
    assert ev["step"] == 2 and all(math.isfinite(ev[f"eval_rewards/{t}/mean"]) for t in TERMS)


@pytest.mark.slow  # GRPO steps on the tiny model
def test_grpo_adapter_loads_in_the_grounder(grpo_run):
    from medvolcore import models
    from medvolcore.grounder import QwenVLGrounder

    tuned = QwenVLGrounder.from_pretrained(models.resolve("tiny").grounder_dir, adapter=grpo_run / "adapter")
    assert any("LoRA adapter" in n for n in tuned.notes)


def _twin_sample(sample: dict, folder: Path) -> dict:
    """Another volume asked the same question: same query, depth and shown slices (so the same prompt
    token ids), different pixels (the slices inverted)."""
    images = np.stack([im[..., 0] for im in load_slices(sample)])
    np.savez(folder / "twin.npz", images=(255 - images).astype(np.uint8), shown=np.asarray(sample["shown"]))
    return {**sample, "id": sample["id"] + "_twin", "data_dir": str(folder), "slices_file": "twin.npz"}


@pytest.mark.slow  # SFT then GRPO on the tiny model
def test_two_volumes_with_one_prompt_text_keep_their_own_images(sm_data, sft_run, tmp_path):
    """A generation batch holding two volumes with the same prompt text (here two prompts
    per step, two accumulation steps). Every scoring pass — the reference pass inside generation and
    the loss pass on the batch TRL returns — must see each row's own volume, equal to a direct
    forward with that volume's images. Images cached by prompt ids gave both rows the last volume."""
    import torch
    from peft import PeftModel
    from trl import GRPOConfig

    from medvolcore import models
    from medvoltrain._grpo_trainer import GrounderGRPOTrainer
    from medvoltrain.grpo import grpo_dataset
    from medvoltrain.sft import load_grounder

    a = load_samples(sm_data, "train")[0]
    b = _twin_sample(a, tmp_path)
    grounder = load_grounder(models.resolve("tiny").grounder_dir, bf16=False)
    own = {s["id"]: grounder.inputs_from_images(load_slices(s), s["shown"], int(s["depth"]), s["query"])
           for s in (a, b)}
    assert own[a["id"]]["input_ids"].tolist() == own[b["id"]]["input_ids"].tolist()  # one prompt text
    assert not torch.equal(own[a["id"]]["pixel_values"], own[b["id"]]["pixel_values"])
    model = PeftModel.from_pretrained(grounder.model, str(sft_run / "adapter"), is_trainable=True)
    args = GRPOConfig(output_dir=str(tmp_path / "unused"), per_device_train_batch_size=2, num_generations=2,
                      gradient_accumulation_steps=2, beta=0.01, use_cpu=True, report_to=[], max_completion_length=6,
                      remove_unused_columns=False)
    trainer = GrounderGRPOTrainer(model=model, reward_funcs=[lambda prompts, completions, **k: [0.0] * len(prompts)],
                                  args=args, train_dataset=grpo_dataset([a, b]), processing_class=grounder.tokenizer,
                                  grounder=grounder, samples=[a, b])
    for m in model.modules():  # deterministic passes in train mode (the trainer added a "ref" adapter copy)
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    rows = [a["id"], a["id"], b["id"], b["id"]]  # TRL's sampler repeats each prompt G times
    out = trainer._generate_and_score_completions([{"prompt": r, "sample_id": r} for r in rows])
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    n = out["completion_ids"].size(1)

    def direct(r, sid):
        """Row r's completion log-probs from one unbatched forward with sample sid's images."""
        keep = mask[r].bool()
        one = ids[r][keep][None]
        x = own[sid]
        mm = torch.cat([x["mm_token_type_ids"], torch.zeros((1, one.size(1) - x["input_ids"].size(1)), dtype=torch.int32)], 1)
        with torch.no_grad():
            logits = model(input_ids=one, pixel_values=x["pixel_values"], image_grid_thw=x["image_grid_thw"],
                           mm_token_type_ids=mm).logits
        k = int(out["completion_mask"][r].sum())
        logp = torch.log_softmax(logits[0, -k - 1:-1].float(), -1)
        return logp.gather(-1, one[0, -k:, None])[:, 0]

    def check(logps):
        for r, sid in enumerate(rows):
            k = int(out["completion_mask"][r].sum())
            want, other = direct(r, sid), direct(r, b["id"] if sid == a["id"] else a["id"])
            got = logps[r, :k]
            assert torch.allclose(got, want, atol=5e-3), (r, sid)  # left padding and batching: float noise only
            assert (other - want).abs().max() > 10 * (got - want).abs().max()

    # the reference pass inside generation. TRL's reference for a loaded adapter is a frozen copy of it
    # ("ref"): before any update it equals the policy.
    check(out["ref_per_token_logps"])
    # the batch TRL shuffles and splits into accumulation steps carries each row's own pixels ...
    assert out["num_images"] == [len(a["shown"])] * 4
    per_row = torch.split(out["pixel_values"], [int(g.prod(-1).sum()) for g in
                                                torch.split(out["image_grid_thw"], out["num_images"])])
    for r, sid in enumerate(rows):
        assert torch.equal(per_row[r], own[sid]["pixel_values"])
    # ... and the loss pass (what _compute_loss passes) scores each row with them
    with torch.no_grad():
        loss_pass, _, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, n, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
            num_images=out["num_images"], mm_token_type_ids=out["mm_token_type_ids"])
    check(loss_pass)
    # a scoring pass outside a generation batch has no images to give: refused, never run blind
    with pytest.raises(RuntimeError, match="without its images"):
        trainer._get_per_token_logps_and_entropies(model, ids, mask, n)


@pytest.mark.slow  # GRPO steps on the tiny model, resumed
def test_resume_continues_from_the_saved_step(grpo_run, sft_run, sm_data, tmp_path):
    import shutil

    run = tmp_path / "RUN2"
    shutil.copytree(grpo_run, run)
    shutil.rmtree(run / "checkpoints" / "checkpoint-2")  # as if stopped after the first step
    rc = main(["grpo", "--data", str(sm_data), "--adapter", str(sft_run / "adapter"), "--output", str(run),
               "--preset", "tiny", "--max-steps", "2", "--random-weights", "0", "--resume", "learning_rate=1e-3",
               "warmup_ratio=0", "save_steps=1", "max_completion_length=48", "delta=1", "max_samples=2",
               "num_generations=2"])
    assert rc == 0
    report = json.loads((run / "training.json").read_text(encoding="utf-8"))
    assert report["resumed_from"].endswith("checkpoint-1") and report["global_step"] == 2
    original = json.loads((grpo_run / "training.json").read_text(encoding="utf-8"))["history"]
    assert report["history"][0] == original[0]  # step 1 comes from the checkpoint, not run again
    assert (run / "checkpoints" / "checkpoint-2").is_dir()


def test_zero_reward_spread_warns_once_after_n_steps_in_a_row(caplog):
    from types import SimpleNamespace

    from medvoltrain._grpo_trainer import ZeroRewardStdWarning

    def feed(cb, fracs, every=1):
        for i, f in enumerate(fracs, 1):
            cb.on_log(SimpleNamespace(num_generations=4), SimpleNamespace(global_step=i * every), None,
                      logs={"frac_reward_zero_std": f, "loss": 0.0})

    def warnings_():
        return [r for r in caplog.records if "no learning signal" in r.getMessage()]

    with caplog.at_level("WARNING", logger="medvoltrain"):
        feed(ZeroRewardStdWarning(3), [1, 1, 0.5, 1, 1, 0.75])  # never 3 steps in a row
        assert warnings_() == []
        feed(ZeroRewardStdWarning(3), [1, 1, 1, 1, 1])  # once per streak, at step 3
        assert len(warnings_()) == 1 and "for 3 step(s) (steps 1-3)" in warnings_()[0].getMessage()
        caplog.clear()
        feed(ZeroRewardStdWarning(4), [1, 1], every=2)  # logging_steps=2: a log averages 2 steps
        assert len(warnings_()) == 1 and "for 4 step(s)" in warnings_()[0].getMessage()
        caplog.clear()
        feed(ZeroRewardStdWarning(0), [1] * 10)  # 0: never
        assert warnings_() == []
    with pytest.raises(ConfigError, match="zero_std_warn_steps must be ≥ 0"):
        load_settings(None, {"zero_std_warn_steps": "-1"}, cls=GRPOSettings)
    with pytest.raises(ConfigError, match="eval_split must be train or test"):
        load_settings(None, {"eval_split": "val"}, cls=GRPOSettings)
