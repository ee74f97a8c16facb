"""The published Qwen3-VL sizes and what a run of each needs: the planning part of
``Testing/benchmarks/fullsize.py``, importable on its own (``reference.qwen3_vl_sizes``).

The configs' numbers are ``Resources/benchmarks/qwen3_vl_configs.json`` (with the source of each);
a model is built from them on the meta device to count its parameters (no memory, no download),
and the memory a run needs is parameters × bytes + the KV cache of a 4 800-token prompt + a fixed
workspace (+ 0.6 GB for MedSAM2 end to end).
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "Resources" / "benchmarks" / "qwen3_vl_configs.json"
GB = 1024 ** 3
BYTES = {"fp32": 4, "bf16": 2}
# beyond the weights: activations of one layer over the prompt, the vision tower's per-image
# attention, logits, allocator slack (measured peak minus weights was 1.0-1.6 GB for 2B bf16 here)
WORKSPACE_GB = 2.0
PROMPT_TOKENS = 4800  # 64 × 64 image tokens + the text of the prompt + 256 new tokens, rounded up


def size_names(sizes) -> list:
    return [s if s.startswith("qwen3-vl-") or s == "mini" else f"qwen3-vl-{s.lower()}" for s in sizes]


def published(name: str) -> dict:
    """Text and vision config of ``name`` (a model of the configs file, or ``mini``)."""
    table = json.loads(CONFIGS.read_text(encoding="utf-8"))
    if name == "mini":
        m = table["mini"]
        base = table["models"][m["base"]]
        return {"text_config": dict(base["text_config"], **m["text_config"]),
                "vision_config": dict(base["vision_config"], **m["vision_config"]), "source": m["_comment"]}
    if name not in table["models"]:
        raise SystemExit(f"fullsize: unknown size {name!r}; known: {', '.join(table['models'])}, mini")
    return table["models"][name]


def build_config(name: str, tokenizer):
    from transformers import Qwen3VLConfig

    from medvolcore.models.tiny import SPECIAL_TOKENS

    spec = published(name)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(spec["text_config"], pad_token_id=ids["<|endoftext|>"])
    return Qwen3VLConfig(text_config=text, vision_config=dict(spec["vision_config"]),
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                         tie_word_embeddings=bool(spec["text_config"].get("tie_word_embeddings", True)))


def count_parameters(name: str) -> dict:
    """Parameter counts of the model, built on the meta device (no memory)."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from medvolcore.models.tiny import build_tokenizer

    config = build_config(name, build_tokenizer())
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.model.visual.parameters())
    t = config.text_config
    return {"total": total, "vision": vision, "layers": t.num_hidden_layers, "kv_heads": t.num_key_value_heads,
            "head_dim": t.head_dim}


def need_gb(params: dict, dtype: str, with_medsam2: bool = False) -> float:
    weights = params["total"] * BYTES[dtype]
    kv = 2 * params["layers"] * params["kv_heads"] * params["head_dim"] * PROMPT_TOKENS * BYTES[dtype]
    extra = 0.6 if with_medsam2 else 0.0  # MedSAM2 weights and two slices' features at 512
    return (weights + kv) / GB + WORKSPACE_GB + extra


def available_gb(device: str) -> float:
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free / GB
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    return float("inf")


def skip_line(what: str, need: float, have: float, device: str):
    """The one line that says why ``what`` is skipped, or None when ``need`` GB fits in ``have``."""
    if have >= need:
        return None
    return (f"skipped {what}: needs ≈ {need:.1f} GB, {have:.1f} GB "
            f"{'free on the GPU' if device == 'cuda' else 'available (MemAvailable)'}")
