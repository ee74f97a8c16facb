"""The tiny smoke model (medvolcore.models.tiny): built locally with random weights, complete, loadable as
Qwen3-VL, reused, rebuilt when stale, deterministic. The grounder on it is test_grounder.py's."""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest
import torch

from medvolcore.models.tiny import BUILD_VERSION, MARKER, SMOKE_NOTE, build_tokenizer, ensure_tiny_model, is_complete

from core.test_grounder import tiny_dir  # noqa: F401  (a fixture: the tiny model, built once)

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def test_tiny_model_folder_is_complete_and_loads_back(tiny_dir):
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    assert is_complete(tiny_dir)
    assert (tiny_dir / MARKER).read_text().strip() == BUILD_VERSION
    meta = json.loads((tiny_dir / "medvol_model.json").read_text())
    assert meta["smoke"] is True and meta["note"] == SMOKE_NOTE
    assert (tiny_dir / "model.safetensors").is_file()

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.padding_side == "left"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    proc = Qwen2VLImageProcessorPil.from_pretrained(tiny_dir)
    px = proc(images=[np.zeros((256, 256, 3), np.uint8)], return_tensors="pt")
    assert px["image_grid_thw"].tolist() == [[1, 16, 16]]  # 256×256 is not resized
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_dir)
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 < n < 1_000_000
    cfg = model.config
    assert cfg.vision_config.patch_size == 16 and cfg.vision_config.spatial_merge_size == 2
    assert cfg.vision_config.temporal_patch_size == 2
    for attr, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        assert getattr(cfg, attr) == tok.convert_tokens_to_ids(token)
    assert cfg.text_config.vocab_size == len(tok)
    assert "torchvision" not in sys.modules


def test_tiny_model_is_reused_rebuilt_when_stale_and_deterministic(tiny_dir, tmp_path):
    marker_mtime = (tiny_dir / MARKER).stat().st_mtime_ns
    t = time.perf_counter()
    assert ensure_tiny_model(tiny_dir) == tiny_dir
    assert time.perf_counter() - t < 0.5 and (tiny_dir / MARKER).stat().st_mtime_ns == marker_mtime

    stale = tmp_path / "tiny"
    stale.mkdir()
    (stale / "config.json").write_text("{half a build")
    assert ensure_tiny_model(stale) == stale and is_complete(stale)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left behind
    for name in ("model.safetensors", "tokenizer.json", "config.json", "preprocessor_config.json"):
        assert (stale / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    assert build_tokenizer().backend_tokenizer.to_str() == build_tokenizer().backend_tokenizer.to_str()


def test_tiny_build_leaves_callers_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ensure_tiny_model(tmp_path / "t")
    assert torch.equal(torch.rand(3), expected)
