"""The bench models: small Qwen3-VL configurations with seeded random weights, built locally
(nothing is downloaded), and the helpers around them.

:data:`MODEL_SIZES` names the language-model and vision-tower sizes (``seeing``, the default of
both stages; ``tiny``, the tiny preset's own; ``bench``, wider and deeper); :func:`build_model`
writes one such model into a folder; :func:`tokenizer_corpus` is the text its tokenizer learns
from; :func:`sincos_positions` the vision position table of ``seeing``; :func:`count_parameters`
counts a saved model's parameters.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from medvolcore.errors import InputError

# Language-model / vision-tower sizes of the bench model (the tokenizer and vision geometry are tiny's).
MODEL_SIZES = {
    "tiny": {"text": {}, "vision": {}},  # the tiny preset's own sizes (medvolcore.models.tiny)
    "bench": {"text": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32,
                           rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                            "mrope_section": [8, 4, 4], "mrope_interleaved": True}),
              "vision": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128)},
    # The model of both stages: it learns from pixels in CPU minutes where "tiny" and "bench" did not.
    # Why each size differs from tiny's: docs/learning-benchmarks.md, "The model that sees". "pos_sincos": the
    # vision tower's position table starts as sincos_positions instead of N(0, 0.02).
    "seeing": {"text": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "mrope_section": [8, 4, 4], "mrope_interleaved": True}),
               "vision": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128),
               "pos_sincos": True},
}
BENCH_MODEL_SEED = 20240614
HEAD_STD = 2.0  # output head init: std HEAD_STD / sqrt(hidden) (see build_model)


def tokenizer_corpus(train_samples: Sequence[dict]) -> List[str]:
    """The text the benchmark's tokenizer learns its vocabulary from: the *training* samples'
    prompts (system and user text, queries) and targets — never a test query, so a held-out
    description reaches the model only through the words it shares with the training text."""
    texts: List[str] = []
    for s in train_samples:
        for m in s.get("messages", []):
            content = m.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(str(c.get("text")) for c in content if isinstance(c, dict) and c.get("text"))
        texts.append(str(s["query"]))
        texts.append(str(s["target"]))
    return list(dict.fromkeys(texts))


def build_model(folder, size: str, corpus: Optional[Sequence[str]] = None, vocab_size: int = 0,
                patch_size: int = 16) -> Path:
    """The benchmark's base model in ``folder``, returned: seeded random weights (``BENCH_MODEL_SEED``),
    built locally (no download).

    The tiny preset's tokenizer (or, with ``vocab_size`` and ``corpus``, the same kind of tokenizer
    with its merges learnt from ``corpus``), image processor and vision geometry (patch
    ``patch_size``), with the sizes of :data:`MODEL_SIZES` (``tiny``: the tiny preset's own sizes);
    the output head is drawn with std ``HEAD_STD/sqrt(hidden)`` instead of 0.02 (why: docs/learning-benchmarks.md,
    "Output head"). Writes the model, tokenizer and image processor, ``medvol_model.json`` and the
    build marker; a folder whose marker matches these arguments is returned as it is.
    """
    import hashlib

    from medvolcore.models import tiny

    folder = Path(folder)
    marker = f"medvol-bench-qwen3-vl/{size}/head{HEAD_STD:g}"
    if vocab_size:
        if not corpus:
            raise InputError("a benchmark tokenizer with its own vocabulary needs a training corpus")
        digest = hashlib.sha256("\n".join(corpus).encode("utf-8")).hexdigest()[:16]
        marker += f"/vocab{int(vocab_size)}-{digest}"
    marker += f"/patch{int(patch_size)}"
    if (folder / tiny.MARKER).is_file() and (folder / tiny.MARKER).read_text(encoding="utf-8").strip() == marker:
        return folder
    import torch
    from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tokenizer = tiny.build_tokenizer(corpus, vocab_size) if vocab_size else tiny.build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS}
    sizes = MODEL_SIZES[size]
    if sizes.get("pos_sincos"):
        marker += "/pos-sincos"
    config = Qwen3VLConfig(
        text_config=dict(tiny.TEXT_CONFIG, **sizes["text"], vocab_size=len(tokenizer), pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(tiny.VISION_CONFIG, **sizes["vision"], patch_size=int(patch_size)),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BENCH_MODEL_SEED)
        model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
        head = model.get_output_embeddings().weight
        with torch.no_grad():
            head.normal_(0.0, HEAD_STD / math.sqrt(head.shape[1]))
            if sizes.get("pos_sincos"):
                table = model.model.visual.pos_embed.weight
                table.copy_(torch.from_numpy(sincos_positions(*table.shape)).to(table.dtype))
    model.generation_config = GenerationConfig(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                                               pad_token_id=ids["<|endoftext|>"], do_sample=False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(**dict(tiny.IMAGE_PROCESSOR, patch_size=int(patch_size))).save_pretrained(folder)
    n_params = sum(p.numel() for p in model.parameters())
    (folder / "medvol_model.json").write_text(json.dumps({
        "smoke": True, "note": f"untrained {size} Qwen3-VL of the learning benchmark ({n_params} parameters): "
                               "its answers are meaningless", "build": marker, "seed": BENCH_MODEL_SEED,
        "parameters": n_params}, indent=2) + "\n", encoding="utf-8")
    (folder / tiny.MARKER).write_text(marker + "\n", encoding="utf-8")
    return folder


def sincos_positions(n: int, dim: int) -> np.ndarray:
    """A 2-D sine/cosine position code for a vision tower's learnt position table of ``n`` entries
    (a √n × √n grid, row-major, as Qwen3-VL interpolates it) and width ``dim``: a quarter of the
    channels each for sin(row·ω), cos(row·ω), sin(col·ω), cos(col·ω), with ω from 1 down to 0.01
    radians per grid step (any leftover channels zero). Unit-size entries, like the patch features."""
    side = int(round(math.sqrt(n)))
    if side * side != n:
        raise InputError(f"a position table of {n} entries is not a square grid")
    rows, cols = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    q = dim // 4
    omega = 1.0 / (100.0 ** (np.arange(q) / max(1, q - 1)))
    parts = []
    for c in (rows.reshape(-1), cols.reshape(-1)):
        a = c[:, None] * omega[None, :]
        parts += [np.sin(a), np.cos(a)]
    code = np.zeros((n, dim), np.float32)
    code[:, :4 * q] = np.concatenate(parts, axis=1)
    return code


def count_parameters(model_dir) -> int:
    from safetensors import safe_open

    n = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n += int(np.prod(st.get_slice(k).get_shape()))
    return n


__all__ = ["MODEL_SIZES", "BENCH_MODEL_SEED", "HEAD_STD", "build_model", "tokenizer_corpus", "sincos_positions",
           "count_parameters"]
