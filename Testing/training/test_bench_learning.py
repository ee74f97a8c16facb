"""The learning benchmark (``medvol-train bench-learning``): a --quick run end to end on the CPU, and
the held-out split really held out (z-ranges of the one patient, and descriptions)."""

from __future__ import annotations

import json
import math
import re
import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from medvoltrain.bench.learning import (TEST_BANDS, TRAIN_BANDS, BenchSettings, build_cases, label_prior_box,
                                        select_test_samples)
from medvoltrain.bench.model import build_model, tokenizer_corpus
from medvoltrain.bench.report import MODELS, TERMS
from medvoltrain.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.mark.slow  # a research bench: trains three models
def test_quick_run_writes_three_models_and_the_curves(tmp_path, real_dir):
    out = tmp_path / "BENCH"
    t0 = time.perf_counter()
    rc = main(["bench-learning", "--out", str(out), "--real-dir", str(real_dir), "--quick", "--seed", "3"])
    seconds = time.perf_counter() - t0
    assert rc == 0
    result = json.loads((out / "result.json").read_text(encoding="utf-8"))
    for model in MODELS:
        row = result[model]
        assert set(row) == {*TERMS, "total"}
        for term in TERMS:
            assert math.isfinite(row[term]) and 0.0 <= row[term] <= 1.0, (model, term, row[term])
        assert 0.0 <= row["total"] <= 3.0
        assert row["total"] == pytest.approx(row["format"] + row["axial"] + row["box"], abs=2e-4)
    assert result["settings"]["quick"] and result["settings"]["lambda_consistency"] == 0.0
    assert result["evaluation"]["constrained"] is False
    assert result["training"]["grpo"]["reward_weights"] == {"format": 1.0, "axial": 1.0, "box": 1.0}
    assert result["training"]["grpo"]["reward_failures"] == {}
    # the SFT and GRPO adapters carry the fully trained embeddings and head beside the LoRA
    from safetensors.torch import load_file

    base = load_file(str(out / "model" / "model.safetensors"))
    emb = [k for k in base if k.endswith("embed_tokens.weight")][0]
    tuned = {}
    for stage in ("sft", "grpo"):
        cfg = json.loads((out / "runs" / stage / "adapter" / "adapter_config.json").read_text(encoding="utf-8"))
        assert sorted(cfg["modules_to_save"]) == ["embed_tokens", "k_norm", "lm_head", "q_norm", "visual"]
        weights = load_file(str(out / "runs" / stage / "adapter" / "adapter_model.safetensors"))
        keys = [k for k in weights if "embed_tokens" in k]
        assert len(keys) == 1 and any("lm_head" in k for k in weights) and any("lora_A" in k for k in weights)
        assert any(".visual." in k and "patch_embed" in k for k in weights)  # the vision tower, trained in full
        tuned[stage] = weights[keys[0]]
        assert tuned[stage].shape == base[emb].shape and not np.allclose(tuned[stage].numpy(), base[emb].numpy())
    # the bench model's processor and vision tower agree on the patch (32: 16 tokens per 256 x 256 slice)
    pre = json.loads((out / "model" / "preprocessor_config.json").read_text(encoding="utf-8"))
    conf = json.loads((out / "model" / "config.json").read_text(encoding="utf-8"))
    assert pre["patch_size"] == conf["vision_config"]["patch_size"] == result["settings"]["image_patch"] == 32
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(out / "curves.png") as im:
        assert im.size == (1100, 420)
    table = (out / "table.md").read_text(encoding="utf-8")
    assert "| grpo |" in table and "Content-blind reference" in table
    assert 0.0 <= result["reference"]["label_prior_box"] <= 1.0
    # the trained models are also scored with their slices blacked out and swapped for another test band's
    for stage in ("sft", "grpo"):
        abl = result["ablations"][stage]
        assert set(abl) == {"own", "black", "swapped", "own_minus"}
        assert abl["own"]["total"][0] == pytest.approx(result[stage]["total"], abs=2e-4)
        for cond in ("black", "swapped"):
            for term in ("format", "axial", "box", "total"):
                mean, se = abl[cond][term]
                assert math.isfinite(mean) and math.isfinite(se) and se >= 0
                diff = abl["own_minus"][cond][term]
                assert diff[0] == pytest.approx(abl["own"][term][0] - mean, abs=2e-4)
        assert 0.0 <= result["reference"]["label_prior_box_on_model_slice"][stage] <= 1.0
    assert "| sft, black slices |" in table and "| grpo: own − swapped |" in table
    assert seconds < 240, f"--quick took {seconds:.0f} s"  # ~60 s on an idle 2-core CPU
    # nothing is replaced without --overwrite
    assert main(["bench-learning", "--out", str(out), "--real-dir", str(real_dir), "--quick"]) == 2


def _overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.slow  # a research bench's cases on the real CTs
def test_held_out_z_ranges_and_descriptions_are_disjoint_from_training(tmp_path, real_dir):
    from medvoltrain.prepare import PrepareSettings, load_samples, prepare

    settings = BenchSettings()
    manifest, rows = build_cases(tmp_path, real_dir, settings)
    train = [r for r in rows if r["split"] == "train"]
    test = [r for r in rows if r["split"] == "test"]
    assert len(train) >= 30 and len(test) >= 6
    for a, b in TRAIN_BANDS:
        for c, d in TEST_BANDS:
            assert not _overlap((a, b), (c, d))
    for r in test:
        for t in train:
            assert not _overlap(r["patient_z"], t["patient_z"]), (r["id"], t["id"])
    # example_ct_sm is example_ct's stack slices 0..29: its crops stay there, inside a train band
    assert any(r["source"] == "ct_sm" for r in train)
    assert all(r["patient_z"][1] <= 30 for r in rows if r["source"] == "ct_sm")
    # the written crop is the source stack slab, shifted in plane (never flipped) and jittered
    from medvolcore.stack import AxialStack
    from medvolcore.volume import load_label_map, load_volume

    r = test[0]
    src = AxialStack(load_volume(real_dir / "totalsegmentator" / "example_ct.nii.gz"))
    src_lab = src.to_stack(load_label_map(real_dir / "totalsegmentator" / "example_seg_fast_force_split.nii.gz").array)
    crop = AxialStack(load_volume(r["volume"]))
    lab = crop.to_stack(load_label_map(r["labels"]).array)
    (z0, z1), (dy, dx) = r["patient_z"], r["shift_yx"]
    h, w = src.height, src.width
    want = src_lab[z0:z1, max(0, -dy):h - max(0, dy), max(0, -dx):w - max(0, dx)]
    got = lab[:, max(0, dy):h - max(0, -dy), max(0, dx):w - max(0, -dx)]
    assert crop.shape == (z1 - z0, h, w) and np.array_equal(got, want)
    np.testing.assert_allclose(crop.stack_to_ras([0, max(0, dy), max(0, dx)]),
                               src.stack_to_ras([z0, max(0, -dy), max(0, -dx)]), atol=1e-4)

    prepare(manifest, tmp_path / "data", PrepareSettings(seed=0, top_k=1, negative_fraction=0.0), progress=False)
    tr, te = load_samples(tmp_path / "data", "train"), load_samples(tmp_path / "data", "test")
    assert {s["label"] for s in te} <= {s["label"] for s in tr}
    assert all(s["query_info"]["kind"] == "implicit" for s in tr + te)
    train_desc = {s["query_info"]["description"] for s in tr}
    test_desc = {s["query_info"]["description"] for s in te}
    assert test_desc and not train_desc & test_desc
    for label in {s["label"] for s in te}:  # no label's held-out description ever appears in training
        assert not ({s["query"] for s in te if s["label"] == label} & {s["query"] for s in tr})
    picked = select_test_samples(te, 13)
    assert len({s["label"] for s in picked}) == 13  # round-robin: every label scored

    # the benchmark's tokenizer learns its vocabulary from the training text only
    corpus = tokenizer_corpus(tr)
    text = "\n".join(corpus)
    assert all(s["query"] in text for s in tr) and all(s["target"] in text for s in tr)
    assert not any(d in text for d in test_desc)
    tok = AutoTokenizer.from_pretrained(build_model(tmp_path / "model", "tiny", corpus, vocab_size=2048))
    words = {w.lstrip("Ġ") for w in tok.get_vocab()}
    assert {"liver", "kidney", "bile", "describes"} <= words  # whole words of the training text are tokens
    unseen = [w for d in test_desc for w in re.findall(r"[a-z]{6,}", d.lower()) if w not in text.lower()]
    assert unseen and not any(w in words for w in unseen)  # a word only a test description has is not
    digits = tok.tokenize(" 1000")
    assert digits == ["Ġ", "1", "0", "0", "0"]  # digits stay single tokens, as in Qwen
    from medvolcore.models import tiny

    base = tiny.build_tokenizer()  # the special tokens keep their names and order
    assert [tok.convert_tokens_to_ids(t) - len(tok) for t in tiny.SPECIAL_TOKENS] == \
        [base.convert_tokens_to_ids(t) - len(base) for t in tiny.SPECIAL_TOKENS]


def _sample(label, key, boxes, gt=None):
    return {"label": label, "target_info": {"slice": key, "boxes_norm": boxes},
            "gt_boxes_norm": {str(key): gt if gt is not None else boxes}}


def test_label_prior_box_is_the_mean_training_box_scored_on_the_true_key_slice():
    train = [_sample("a", 0, [[0, 0, 100, 100]]), _sample("a", 3, [[0, 0, 300, 300]]),
             _sample("a", 1, [[0, 0, 10, 10], [500, 500, 600, 600]]),  # the rarer box count is left out
             _sample("b", 2, [[0, 0, 100, 100], [200, 200, 300, 300]]),
             _sample("b", 0, [[100, 100, 200, 200], [300, 300, 400, 400]])]
    # label a's prior is [0, 0, 200, 200]; label b's [[50, 50, 150, 150], [250, 250, 350, 350]]
    test = [_sample("a", 4, [[0, 0, 200, 200]]),  # IoU 1
            _sample("a", 2, [[0, 0, 100, 100]]),  # IoU 0.25
            _sample("b", 5, [[50, 50, 150, 150]]),  # one of two boxes matched: 1 / max(2, 1)
            _sample("c", 0, [[0, 0, 10, 10]])]  # never seen in training: 0
    assert label_prior_box(train, test) == pytest.approx((1.0 + 0.25 + 0.5 + 0.0) / 4)
    # scored on each test sample's own key slice, not on the slice the training samples used
    shifted = [{"label": "a", "target_info": {"slice": 7, "boxes_norm": [[0, 0, 200, 200]]},
                "gt_boxes_norm": {"7": [[0, 0, 200, 200]], "4": [[800, 800, 900, 900]]}}]
    assert label_prior_box(train, shifted) == pytest.approx(1.0)
    assert label_prior_box(train, []) == 0.0


def test_negative_thread_count_is_one_clear_line(tmp_path, capsys):
    assert main(["bench-learning", "--out", str(tmp_path / "B"), "--quick", "--threads", "-1"]) == 2
    err = capsys.readouterr().err
    assert "threads must be ≥ 0" in err and "internal error" not in err and "Traceback" not in err
