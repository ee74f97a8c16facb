"""The ``tiny`` smoke model: an untrained Qwen3-VL built locally, seeded, with no network.

:func:`ensure_tiny_model` returns a folder that loads like a real Qwen3-VL checkpoint with
``AutoTokenizer.from_pretrained``, ``Qwen2VLImageProcessorPil.from_pretrained`` (the PIL
backend: no torchvision) and ``Qwen3VLForConditionalGeneration.from_pretrained``:

* ``config.json`` / ``model.safetensors``: a Qwen3-VL of about 275 thousand parameters
  (text: 2 layers, hidden 64, 4 query / 2 key-value heads of 16; vision: 2 blocks, hidden 32,
  2 heads, DeepStack on block 0) with the real model's vision geometry — patch 16, spatial
  merge 2, temporal patch 2 — so a 256×256 slice gives 16×16 patches and 64 LLM tokens, as
  with the real model. Weights are drawn from a fixed seed inside ``torch.random.fork_rng``,
  so the caller's random state is untouched and every build is bit-identical.
* ``tokenizer.json`` and friends: a byte-level BPE (Qwen2's pre-tokenizer regex, so digits are
  single tokens as in Qwen) trained with the ``tokenizers`` library on a small built-in text
  (the 256 byte symbols plus a few hundred merges), with Qwen's special tokens in Qwen's order
  (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, …, ``<|vision_start|>``,
  ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``, ``<|video_pad|>``) and Qwen3's
  ``<think>``/``</think>`` as ordinary added tokens; a Qwen-style chat template; eos
  ``<|im_end|>``, pad ``<|endoftext|>``, left padding. The config's ``image_token_id``,
  ``video_token_id``, ``vision_start_token_id`` and ``vision_end_token_id`` are this
  tokenizer's ids.
* ``preprocessor_config.json``: the Qwen2-VL image processor (what Qwen3-VL uses for still
  images) with patch 16, merge 2, temporal patch 2, mean/std 0.5 and min/max pixels
  65 536 / 16 777 216 as in the real Qwen3-VL, so a 256×256 image is not resized.
* ``medvol_model.json``: ``{"smoke": true, "note": …}`` — every output made with this model
  must say that it is meaningless.

The folder is complete when its marker file holds :data:`BUILD_VERSION`. A build is written
to a temporary folder beside the target and renamed into place, so a concurrent caller sees
either no folder, an old folder, or a complete one — never half a build. Building takes a few
seconds on a CPU.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Optional, Union

from ..errors import DependencyError, MedVolError

log = logging.getLogger(__name__)

__all__ = ["BUILD_VERSION", "MARKER", "SMOKE_NOTE", "ensure_tiny_model", "is_complete", "medvol_home",
           "default_tiny_dir", "build_tiny_model"]

BUILD_VERSION = "medvol-tiny-qwen3-vl/1"
MARKER = ".medvol-build"
SMOKE_NOTE = "untrained tiny Qwen3-VL smoke model: its answers are meaningless"
SEED = 20240613

# Qwen2's pre-tokenizer split (single digits, words with a leading non-letter, punctuation runs).
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2/Qwen3 special tokens, in Qwen's id order (their ids here are len(BPE vocab) + position).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
# Qwen3 has these as ordinary (non-special) added tokens.
ADDED_TOKENS = ("<think>", "</think>")
BPE_VOCAB_SIZE = 640

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TEXT_CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2],
                     "mrope_interleaved": True},
)
VISION_CONFIG = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=256,
    deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh",
)
IMAGE_PROCESSOR = dict(
    patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 65536, "longest_edge": 16777216},
)

# Training text for the BPE merges: the answer format, JSON punctuation, digits and some
# radiology wording. Fixed here (not read from the prompt templates) so the tokenizer does not
# change when the templates are edited.
_CORPUS = [
    '<think>The query asks for the liver. It is the large organ in the right upper abdomen, seen best on '
    'slice 40.</think><answer>[{"slice": 40, "bbox_2d_list": [[102, 215, 498, 730]]}]</answer>',
    '<think>Both kidneys lie beside the spine; the left kidney has a cyst.</think><answer>[{"slice": 57, '
    '"bbox_2d_list": [[120, 380, 310, 600], [640, 395, 845, 610]]}]</answer>',
    '<answer>[{"slice": 3, "bbox_2d_list": [[0, 0, 1000, 1000]]}]</answer>',
    "You are a radiology assistant. You are shown axial slices of one CT volume, ordered from head to feet. "
    "Each image is preceded by its tag <slice z>. Image left is the patient's right and image top is anterior.",
    "Query: the organ that secretes bile. Find the structure the query describes. First reason step by step "
    "inside <think></think>, then give the evidence anchor inside <answer></answer> as JSON.",
    "spleen kidney gallbladder liver stomach pancreas aorta bladder lung heart bone vertebra cyst tumor lesion "
    "mass nodule fluid the of and in on with is a an right left upper lower slice box boxes coordinates",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 [ ] { } , : \" < > / = ( ) . ; -",
]


def medvol_home() -> Path:
    """``$MEDVOL_HOME`` (default ``~/.medvol``)."""
    return Path(os.environ.get("MEDVOL_HOME") or Path.home() / ".medvol").expanduser()


def default_tiny_dir() -> Path:
    return medvol_home() / "models" / "tiny" / "grounder"


def is_complete(root: Union[str, Path]) -> bool:
    """Whether ``root`` holds a complete build of this version."""
    marker = Path(root) / MARKER
    try:
        return marker.is_file() and marker.read_text(encoding="utf-8").strip() == BUILD_VERSION
    except OSError:
        return False


def ensure_tiny_model(root: Optional[Union[str, Path]] = None) -> Path:
    """Return the tiny smoke model's folder, building it first if it is missing or stale.

    ``root`` defaults to ``$MEDVOL_HOME/models/tiny/grounder`` (where the ``tiny`` preset lives). Safe against concurrent
    callers: the build goes to a temporary folder beside ``root`` and is renamed into place.
    """
    root = Path(root).expanduser() if root is not None else default_tiny_dir()
    if is_complete(root):
        return root
    parent = root.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.build-", dir=parent))
    except OSError as e:
        raise MedVolError(f"cannot create the tiny model folder under {parent}: {e}; "
                          "set MEDVOL_HOME to a writable folder") from None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model folder is not secret
        build_tiny_model(tmp)
        _install(tmp, root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def _install(tmp: Path, root: Path) -> None:
    """Rename a finished build into place (replacing a stale folder, tolerating a racing builder)."""
    for _ in range(3):
        try:
            os.rename(tmp, root)
            log.info("built the tiny smoke model in %s", root)
            return
        except OSError:
            if is_complete(root):  # another process finished first: use its build
                return
            if root.exists():  # a stale or incomplete folder: move it aside, then retry
                trash = root.with_name(f".{root.name}.stale-{uuid.uuid4().hex[:8]}")
                try:
                    os.rename(root, trash)
                except OSError:
                    continue
                shutil.rmtree(trash, ignore_errors=True)
            else:
                continue
    if not is_complete(root):
        raise MedVolError(f"could not install the tiny model into {root}; remove that folder and try again")


def _imports():
    try:
        import torch
        import transformers  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise DependencyError(f"building the tiny model needs torch, transformers and tokenizers ({e}); "
                              "install them with pip") from None
    return torch


def build_tokenizer(corpus=None, vocab_size: int = BPE_VOCAB_SIZE):
    """The tiny byte-level BPE tokenizer as a ``PreTrainedTokenizerFast`` (deterministic).

    ``corpus`` (texts) and ``vocab_size`` replace the built-in training text and the 640 merges:
    the same pre-tokenizer, byte alphabet, special tokens and chat template, a larger vocabulary
    learnt from other text (the learning benchmark trains one on its training split).
    """
    _imports()
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(list(corpus) if corpus is not None else _CORPUS * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left",
        model_max_length=32768, clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


@contextlib.contextmanager
def _quiet_progress():
    """Hide transformers' progress bars (e.g. "Writing model shards") while saving."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_tiny_model(folder: Union[str, Path]) -> Path:
    """Write the tiny model into ``folder`` (which must exist); the marker file is written last."""
    torch = _imports()
    from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(folder)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config=dict(TEXT_CONFIG, vocab_size=len(tokenizer), pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(VISION_CONFIG),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    with _quiet_progress():
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(folder)
    (folder / "medvol_model.json").write_text(
        json.dumps({"smoke": True, "note": SMOKE_NOTE, "build": BUILD_VERSION, "seed": SEED}, indent=2) + "\n",
        encoding="utf-8")
    (folder / MARKER).write_text(BUILD_VERSION + "\n", encoding="utf-8")
    return folder
