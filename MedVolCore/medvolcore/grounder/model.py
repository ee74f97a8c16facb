"""The grounder model: Qwen3-VL looks at 64 axial slices and answers with an evidence anchor.

Public API
----------
``QwenVLGrounder.from_pretrained(model_dir, adapter=None, device="cpu", dtype=None, settings=None)``
    loads a Qwen3-VL checkpoint folder (tokenizer, the PIL image processor, the model; fp32 on
    CPU, bfloat16 on CUDA) and optionally a PEFT LoRA adapter.
``grounder.build_inputs(stack, query, window=None) -> (inputs, shown_slices)``
    the model inputs for one request (see "Image tokens" below).
``grounder.build_batch_inputs([(stack, query), ...], window=None) -> (inputs, [shown_slices, ...])``
    the same for several requests, left-padded.
``grounder.inputs_from_images(images, shown, depth, query, window=None) -> inputs``
    the same prompt from slices rendered beforehand (training data stores them).
``grounder.ground(stack, query, *, constrain=True, do_sample=False, seed=None, max_new_tokens=None,
retries=2, window=None) -> GroundingResult``
    one answer as an :class:`~medvolcore.anchor.EvidenceAnchor` (source ``"grounder"``).
``grounder.ground_samples(stack, query, G, *, seed=None, ...) -> SampledGrounding``
    G answers for a consensus: the greedy one (exactly ``ground``'s), then G − 1 sampled ones,
    all from one encoding of the slices (see "Several answers from one prefill" below).
``grounder.ground_queries(stack, [query, ...], samples=1, ...) -> [SampledGrounding, ...]``
    several queries on one volume: the slices' part of the prompt (everything before the query)
    rendered, encoded and prefilled once, each query continuing from that cache.
:mod:`medvolcore.grounder.prompt` (:func:`answer_grammar`, :func:`plan_budget`, :func:`validate_query`, …)
    the pure pieces, for training code and tests.

Image tokens (ours; no ``Qwen3VLProcessor``, no torchvision, no video processor)
------------------------------------------------------------------------------
The chat layout and the per-slice tag are :mod:`medvolcore.grounder.prompt`'s. The shown slices are
``stack.sample_indices(64)`` (all slices when the stack has fewer than 64); each is preceded by its
tag ``<slice z>`` and wrapped as ``<|vision_start|><|image_pad|>×N<|vision_end|>``.
Each slice is rendered 256×256 RGB with the request's window and goes through Qwen2-VL's
image processor (PIL backend). With patch 16 and merge 2 a 256×256 image is a 1×16×16 patch
grid, so ``N = t·h·w / merge² = 64`` tokens per image and 4096 image tokens for 64 slices (the
real Qwen3-VL's processor settings keep 256×256 unresized too); ``N`` is always taken from the
processor's ``image_grid_thw``. Text runs are tokenized with ``split_special_tokens=True``, so
a query that contains ``<|image_pad|>`` or ``<|im_end|>`` stays plain text and cannot shift the
image tokens. Besides ``input_ids`` and ``attention_mask`` the model gets ``pixel_values``,
``image_grid_thw`` and ``mm_token_type_ids`` (1 on image tokens, 0 elsewhere): transformers
5.x's Qwen3-VL needs the latter to build its 3-D (M-RoPE) positions.

Constrained decoding
--------------------
By default the answer is forced by the grammar of :func:`~medvolcore.grounder.prompt.answer_grammar`,
with the bounds of :func:`~medvolcore.grounder.prompt.plan_budget`, through the logits processor of
:mod:`medvolcore.grounder._logits`. When the grammar is complete only stop tokens (``<|im_end|>``)
are allowed, so generation stops there.

Why xgrammar: it compiles a context-free grammar (EBNF with bounded repetition, which the tag
alternatives and the think/box bounds need) against the tokenizer's vocabulary, precomputing
the masks of most tokens, so a step costs microseconds even with Qwen's 151k-token vocabulary;
its low-level bitmask API (the same one behind ``xgrammar.contrib.hf.LogitsProcessor``) lets our
budget guard sit in the same logits processor; and it is installed here. llguidance (Rust,
Lark-style grammars, also fast) would serve as well — one engine is enough. lm-format-enforcer
is pure Python, takes JSON Schema or regular expressions rather than grammars, and walks a
token prefix tree at every step, which is slower on a large vocabulary.

Unconstrained decoding (``constrain=False``) parses with :func:`~medvolcore.answer.parse_answer`;
an answer that does not parse, names a slice that was not shown, or has no usable box is
retried with sampling (seed ``seed + attempt``) up to ``retries`` times, then a
:class:`~medvolcore.errors.GenerationError` carries the raw text. In both modes boxes with
swapped corners are reordered and boxes of zero width or height dropped, each with a note.

Several answers from one prefill
--------------------------------
``generate`` with ``num_return_sequences=G`` (or a batch of G copies of the prompt) repeats the
inputs, images included, before the first forward: the vision encoder and the ~4 300-token prefill
would run G times. Instead the greedy ``generate`` call returns its cache (``return_dict_in_generate``);
it is cut back to the prompt's first ``L − 1`` tokens (``DynamicCache.crop``), repeated to G − 1 rows
(``batch_repeat_interleave``) and handed to one sampling ``generate`` call with the prompt's ids and
token kinds but no pixels: transformers then runs only the uncached last prompt token (G − 1 rows)
and the new tokens, and Qwen3-VL takes the 3-D positions of the rest from the ``rope_deltas`` of the
prefill. A retry of an unusable answer continues from the same cache. The greedy answer is decoded
alone (batch 1), so it is the answer ``ground`` gives, bit for bit; the samples cost one decode of
G − 1 rows. The grammar guide keeps one matcher per row.

The answer signal
-----------------
:class:`~medvolcore.grounder._logits.StepProcessor` keeps, per row and step, the log-probability
of the chosen token under the scores it returns (the grammar's mask applied, before temperature,
top-k or top-p) and how many tokens those scores allowed. :meth:`QwenVLGrounder._answer_signal`
averages it over the answer (the tokens after ``</think>``, without the stop token and without
the tokens the grammar forced): ``answer_mean_logprob`` and ``answer_mean_prob`` (its exp, a
geometric-mean probability). It says how peaked the model's choice was among what the grammar
allowed; it is not a probability that the answer is right (an untrained model can be confidently
wrong). No second forward pass: these are the scores the decoder computed anyway.

Timings are measured, not estimated: ``prefill_s`` is from the ``generate`` call to the first
call of our logits processor (vision encoder + prompt forward + first logits), ``decode_s`` from
there to the end of ``generate``; ``new_tokens`` counts the generated tokens (stop token
included) and ``stopped`` says whether a stop token ended them; ``prompt_s`` is rendering and
tokenization; ``total_s`` the whole ``ground`` call, retries included. Prefill, decode and
new_tokens describe the last attempt.

Importing this module does not import torch or transformers.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..anchor import MAX_BOXES, EvidenceAnchor
from ..answer import parse_answer
from ..devices import resolve_device
from ..errors import (AnchorError, AnswerFormatError, DependencyError, GenerationError, InputError, ModelError,
                      ModelNotFoundError)
from ..models import folder_listing
from ..progress import part_of
from .prompt import (THINK_CLOSE, answer_grammar, describe_window, fill_template, load_prompts, plan_budget,
                     resolve_settings, validate_query)

log = logging.getLogger("medvolcore.grounder")

__all__ = ["QwenVLGrounder", "GroundingResult", "GroundingSample", "SampledGrounding", "MAX_SAMPLES", "check_samples",
           "clean_boxes"]


# ---- answers → anchors --------------------------------------------------------------------

def _fmt(box) -> str:
    return "[" + ", ".join(f"{v:g}" for v in box) + "]"


def clean_boxes(boxes_norm) -> Tuple[List[List[float]], List[str]]:
    """Reorder swapped corners, drop zero-width/height boxes, keep at most 8; with notes."""
    kept, notes = [], []
    for i, box in enumerate(boxes_norm, start=1):
        x0, y0, x1, y1 = (float(v) for v in box)
        fixed = [min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)]
        if fixed != [x0, y0, x1, y1]:
            notes.append(f"box {i} {_fmt(box)} had swapped corners; reordered to {_fmt(fixed)}")
        if fixed[0] == fixed[2] or fixed[1] == fixed[3]:
            notes.append(f"box {i} {_fmt(box)} has zero width or height; dropped")
            continue
        kept.append(fixed)
    if len(kept) > MAX_BOXES:
        notes.append(f"the answer has {len(kept)} boxes; kept the first {MAX_BOXES}")
        kept = kept[:MAX_BOXES]
    return kept, notes


def _one_line(text: str, limit: int = 600) -> str:
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    if len(text) > limit:
        head = limit * 2 // 3
        text = f"{text[:head]} …[{len(text) - limit} characters left out]… {text[-(limit - head):]}"
    return text


class _Unusable(Exception):
    """An answer that parsed but cannot become an anchor (reason in the message)."""


@dataclass
class GroundingResult:
    """One grounding: the anchor plus what led to it."""

    anchor: EvidenceAnchor
    reasoning: str
    raw_text: str
    shown_slices: List[int]
    timings: Dict[str, float]
    notes: List[str] = field(default_factory=list)
    attempts: int = 1

    def to_dict(self) -> dict:
        return {"anchor": self.anchor.to_dict(), "reasoning": self.reasoning, "raw_text": self.raw_text,
                "shown_slices": list(self.shown_slices), "timings": dict(self.timings), "notes": list(self.notes),
                "attempts": self.attempts}


MAX_SAMPLES = 8


def check_samples(value, what: str = "the number of samples") -> int:
    """``value`` as the number of answers of a consensus, 1..:data:`MAX_SAMPLES` (1: the greedy answer alone)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SAMPLES:
        raise InputError(f"{what} must be a whole number from 1 to {MAX_SAMPLES} (1 = the greedy answer alone), "
                         f"got {value!r}")
    return value


@dataclass
class GroundingSample:
    """One answer of :meth:`QwenVLGrounder.ground_samples` (``index`` 1 is the greedy one).
    ``anchor`` is None when the answer was unusable; ``error`` then says why."""

    index: int
    raw_text: str
    reasoning: str = ""
    anchor: Optional[EvidenceAnchor] = None
    error: str = ""
    signal: Optional[dict] = None

    @property
    def usable(self) -> bool:
        return self.anchor is not None


@dataclass
class SampledGrounding:
    """What :meth:`QwenVLGrounder.ground_samples` returns: the greedy result (``greedy``, exactly
    :meth:`~QwenVLGrounder.ground`'s) and every sample, the greedy one first."""

    greedy: GroundingResult
    samples: List[GroundingSample]
    timings: Dict[str, float]
    seed: Optional[int] = None


@dataclass
class _SharedPrompt:
    """The part of one volume's prompt that every query shares (:meth:`QwenVLGrounder._share_prompt`):
    the processed slices and the cache of its ``length`` tokens. A query's generation extends the
    cache in place; :meth:`rewind` cuts it back to the shared tokens for the next query."""

    cache: object
    length: int
    pixels: dict
    tokens: List[int]
    shown: List[int]
    prefill_s: float
    prompt_s: float

    def rewind(self) -> None:
        surplus = self.cache.get_seq_length() - self.length
        if surplus > 0:
            self.cache.crop(-surplus)


# ---- lazy imports ---------------------------------------------------------------------------

def _torch():
    try:
        import torch
    except ImportError:
        raise DependencyError("the grounder needs PyTorch; install it with `pip install torch`") from None
    return torch


def _transformers():
    try:
        import transformers  # noqa: F401
        from transformers import AutoTokenizer, GenerationConfig, Qwen3VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError as e:
        raise DependencyError(f"the grounder needs transformers ≥ 5 with Qwen3-VL ({e}); "
                              "install it with `pip install 'transformers>=5'`") from None
    return AutoTokenizer, GenerationConfig, Qwen3VLForConditionalGeneration, Qwen2VLImageProcessorPil


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise DependencyError("constrained decoding needs xgrammar (`pip install xgrammar`); "
                              "or pass constrain=False") from None
    return xgrammar


# ---- the grounder ---------------------------------------------------------------------------

def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path}: {e}") from None


def _check_qwen3_vl_folder(model_dir: Path) -> dict:
    """The folder's config; one clear error when it is not a complete Qwen3-VL checkpoint."""
    from ..models import check_grounder_dir

    if not model_dir.exists():
        raise ModelNotFoundError(f"model folder {model_dir} does not exist; install the model or check the path")
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir} is not a folder; a Qwen3-VL checkpoint is a folder with config.json")
    return check_grounder_dir(model_dir)


def _resolve_dtype(dtype, dev, torch, smoke: bool = False):
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        from ..cpu import grounder_dtype  # bf16 on CUDA and on CPUs with bf16 arithmetic; fp32 otherwise

        # a smoke model (random weights: tests, benchmarks) stays fp32 on a CPU, so that its answers,
        # which hang on near-ties, are the same on every CPU
        dtype = "fp32" if smoke and dev.type == "cpu" else grounder_dtype(None, dev)
    if isinstance(dtype, str):
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16}
        if dtype.lower() not in names:
            raise InputError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
        return names[dtype.lower()]
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"dtype must be a torch dtype or its name, got {dtype!r}")
    return dtype


def _identity_names(model_dir: Optional[Path], meta: dict) -> set:
    names = set()
    if model_dir is not None:
        names.add(model_dir.name.lower())
    for key in ("id", "repo_id", "base_model", "name"):
        v = meta.get(key)
        if isinstance(v, str) and v:
            names.add(v.rstrip("/").split("/")[-1].lower())
    return names


def _normalise_adapter_key(key: str) -> str:
    parts = [p for p in key.split(".") if p not in ("default", "modules_to_save", "original_module")]
    return ".".join(parts)


class QwenVLGrounder:
    """Qwen3-VL (optionally with a LoRA adapter) answering clinical queries with an evidence anchor."""

    def __init__(self, model, tokenizer, image_processor, *, settings: Optional[dict] = None,
                 model_dir: Optional[Union[str, Path]] = None, adapter_dir: Optional[Union[str, Path]] = None,
                 meta: Optional[dict] = None, notes: Optional[List[str]] = None, peft_model=None):
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.adapter_dir = Path(adapter_dir) if adapter_dir is not None else None
        self.meta = dict(meta or {})
        self.peft_model = peft_model
        self.prompts = load_prompts()
        preset = "tiny" if self.is_smoke else "real"
        if isinstance(settings, str):
            settings = {"preset": settings}
        self.settings = resolve_settings(preset, settings)
        self.notes: List[str] = list(notes or [])
        if self.is_smoke:
            smoke = str(self.meta.get("note") or "untrained smoke model: its answers are meaningless")
            if smoke not in self.notes:
                self.notes.insert(0, smoke)
        self._ids = self._special_ids()
        self._xgr_state = None
        self._compiled: Dict[str, object] = {}
        self._keep_prefix = False  # set by _ground around its generate calls: hand back the prompt's cache
        self._prefix_in = None  # set by _ground for a retry: the prompt's cache to continue from
        self._reporter = None  # set by ground/ground_samples: a .progress.GroundingProgress, or None

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir, adapter=None, device="cpu", dtype=None, settings=None) -> "QwenVLGrounder":
        """Load a Qwen3-VL checkpoint folder, optionally with a PEFT LoRA adapter folder.

        ``dtype`` None or ``"auto"``: bfloat16 on CUDA and on a CPU with bf16 arithmetic in hardware,
        fp32 on other CPUs (:func:`medvolcore.cpu.grounder_dtype`) and for a smoke model on any CPU. ``settings`` is a preset
        name of grounder.json or a dict of overrides (it may name a ``preset``).
        """
        model_dir = Path(model_dir).expanduser()
        _check_qwen3_vl_folder(model_dir)
        torch = _torch()
        dev = resolve_device(device)
        AutoTokenizer, _, Qwen3VL, ImageProcessor = _transformers()
        meta_path = model_dir / "medvol_model.json"
        meta = _read_json(meta_path) if meta_path.is_file() else {}
        if not isinstance(meta, dict):
            raise ModelError(f"{meta_path} must hold a JSON object")
        dt = _resolve_dtype(dtype, dev, torch, smoke=bool(meta.get("smoke")))
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            image_processor = ImageProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ModelError(f"cannot load the tokenizer or image processor of {model_dir}: {e}") from None
        load_kw = {"dtype": dt}
        if dev.type == "cuda":
            load_kw["device_map"] = {"": str(dev)}  # straight onto the GPU, not via host memory
        from transformers.utils import logging as hf_logging

        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # its "Loading weights" bar is noise in a CLI or a worker
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model = Qwen3VL.from_pretrained(str(model_dir), **load_kw)
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise ModelError(f"cannot load the Qwen3-VL weights from {model_dir}: {e}") from None
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
        if dev.type != "cuda":
            model.to(dev)
        model.eval()
        notes, peft_model, adapter_dir = [], None, None
        if adapter is not None:
            adapter_dir = Path(adapter).expanduser()
            peft_model, adapter_notes = cls._load_adapter(model, model_dir, meta, adapter_dir)
            notes += adapter_notes
            model = peft_model.get_base_model()
            model.eval()
        return cls(model, tokenizer, image_processor, settings=settings, model_dir=model_dir, adapter_dir=adapter_dir,
                   meta=meta, notes=notes, peft_model=peft_model)

    @staticmethod
    def _load_adapter(model, model_dir: Path, meta: dict, adapter_dir: Path):
        if not adapter_dir.exists():
            raise ModelNotFoundError(f"adapter folder {adapter_dir} does not exist")
        cfg_path = adapter_dir / "adapter_config.json"
        if not cfg_path.is_file():
            raise ModelError(f"{adapter_dir} is not a PEFT adapter: it has no adapter_config.json "
                             f"(found {folder_listing(adapter_dir)})")
        acfg = _read_json(cfg_path)
        base = (acfg.get("base_model_name_or_path") if isinstance(acfg, dict) else None) or ""
        try:
            from peft import PeftModel
        except ImportError:
            raise DependencyError("loading an adapter needs peft (`pip install peft`)") from None
        made_for = repr(base) if base else "an unnamed base model (adapter_config.json has no base_model_name_or_path)"
        what = f"adapter {adapter_dir} was made for {made_for} and does not fit the model in {model_dir}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
            except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:
                detail = str(e).strip()
                first = next((ln.strip() for ln in detail.splitlines() if "size mismatch" in ln), None)
                detail = (first or detail.splitlines()[0]) if detail else type(e).__name__
                raise ModelError(f"{what}: {_one_line(detail, 300)}") from None
        missing = [str(w.message) for w in caught if "missing adapter keys" in str(w.message)]
        if missing:
            keys = re.findall(r"'([^']+)'", missing[0])
            example = f"{len(keys)} weight(s), e.g. {keys[0]}" if keys else _one_line(missing[0], 200)
            raise ModelError(f"{what}: the model has adapted layers the adapter has no weights for ({example})")
        unexpected = QwenVLGrounder._unexpected_adapter_keys(peft_model, adapter_dir)
        if unexpected:
            raise ModelError(f"{what}: {len(unexpected)} adapter weight(s) match no layer of the model "
                             f"(e.g. {unexpected[0]})")
        notes = []
        base_name = str(base).rstrip("/").split("/")[-1].lower()
        same_path = False
        if base:
            try:
                same_path = Path(base).expanduser().resolve() == model_dir.resolve()
            except (OSError, ValueError):
                pass
        if base and not same_path and base_name not in _identity_names(model_dir, meta):
            note = (f"adapter {adapter_dir.name} names base model {base!r} but was loaded onto {model_dir}; "
                    "its weights fit, check that this is the intended base")
            log.warning(note)
            notes.append(note)
        from ..models.identity import ADAPTER_METADATA, read_adapter_metadata

        if read_adapter_metadata(adapter_dir) is None:
            note = (f"adapter {adapter_dir.name} has no {ADAPTER_METADATA} (not made by medvol-train): the base model "
                    "it was trained on could not be checked against this one")
            log.warning(note)
            notes.append(note)
        notes.append(f"LoRA adapter: {adapter_dir}")
        return peft_model, notes

    @staticmethod
    def _unexpected_adapter_keys(peft_model, adapter_dir: Path) -> List[str]:
        weights = adapter_dir / "adapter_model.safetensors"
        if not weights.is_file():
            return []
        try:
            from safetensors import safe_open
            with safe_open(str(weights), framework="pt") as f:
                file_keys = list(f.keys())
        except Exception:  # unreadable here means peft already complained above
            return []
        model_keys = {_normalise_adapter_key(k) for k in peft_model.state_dict().keys()}
        return [k for k in file_keys if _normalise_adapter_key(k) not in model_keys]

    # -- properties ------------------------------------------------------------------------------
    @property
    def is_smoke(self) -> bool:
        return bool(self.meta.get("smoke"))

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype

    def _special_ids(self) -> dict:
        tok = self.tokenizer
        ids = {}
        for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>",
                     "<|image_pad|>"):
            i = tok.convert_tokens_to_ids(name)
            if i is None or (tok.unk_token_id is not None and i == tok.unk_token_id):
                raise ModelError(f"the tokenizer of {self.model_dir or 'the model'} has no {name} token; "
                                 "is it a Qwen3-VL tokenizer?")
            ids[name] = int(i)
        cfg = self.model.config
        for attr, name in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                           ("vision_end_token_id", "<|vision_end|>")):
            if getattr(cfg, attr, None) is not None and int(getattr(cfg, attr)) != ids[name]:
                raise ModelError(f"model config {attr}={getattr(cfg, attr)} but the tokenizer's {name} is "
                                 f"{ids[name]}: tokenizer and model in {self.model_dir} do not belong together")
        stops = {ids["<|im_end|>"], ids["<|endoftext|>"]}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            stops |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        if tok.eos_token_id is not None:
            stops.add(int(tok.eos_token_id))
        ids["stop"] = sorted(int(s) for s in stops)
        ids["pad"] = int(tok.pad_token_id) if tok.pad_token_id is not None else ids["<|endoftext|>"]
        return ids

    # -- prompt ---------------------------------------------------------------------------------
    def _fill(self, template: str, values: dict) -> str:
        return fill_template(template, values)

    def _encode_text(self, text: str) -> List[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def _prompt_ids(self, query: str, shown: Sequence[int], depth: int, window, image_tokens: Sequence[int]):
        """Token ids of the chat prompt and the (start, length) of each image's token run."""
        p, ids = self.prompts, self._ids
        values = {"query": query, "window": describe_window(window), "num_shown": len(shown), "depth": depth}
        before, after = p["user"].split("{slices}")
        pieces: list = [ids["<|im_start|>"], "system\n" + p["system"], ids["<|im_end|>"], "\n",
                        ids["<|im_start|>"], "user\n" + self._fill(before, values)]
        sep = p.get("slice_separator", "\n")
        for z, n in zip(shown, image_tokens):
            pieces += [p["slice_tag"].replace("{z}", str(int(z))), ids["<|vision_start|>"], ("image", int(n)),
                       ids["<|vision_end|>"], sep]
        pieces += [self._fill(after, values), ids["<|im_end|>"], "\n", ids["<|im_start|>"], "assistant\n"]
        out, spans, text = [], [], ""
        for piece in pieces:
            if isinstance(piece, str):
                text += piece
                continue
            out += self._encode_text(text)
            text = ""
            if isinstance(piece, tuple):
                spans.append((len(out), piece[1]))
                out += [ids["<|image_pad|>"]] * piece[1]
            else:
                out.append(piece)
        out += self._encode_text(text)
        return out, spans

    def _render(self, stack, window):
        """The shown slices of ``stack`` rendered for the prompt → ``(images, shown)``."""
        _torch()  # a clear DependencyError before any rendering when torch is missing
        if stack.depth < 2:
            raise InputError(f"volume too small: the stack has {stack.depth} axial slice(s); the grounder needs at "
                             "least 2")
        n = int(self.prompts.get("num_slices", 64))
        size = int(self.prompts.get("image_size", 256))
        shown = [int(z) for z in stack.sample_indices(n)]
        return [stack.render_slice(z, size, window) for z in shown], shown

    def _single_inputs(self, stack, query: str, window):
        images, shown = self._render(stack, window)
        return self.inputs_from_images(images, shown, stack.depth, query, window), shown

    def _pixels(self, images, shown: Sequence[int]):
        """The image processor's output for the rendered slices and each slice's image-token count."""
        if len(images) != len(shown):
            raise InputError(f"{len(images)} images for {len(shown)} shown slices")
        px = self.image_processor(images=list(images), return_tensors="pt")
        merge = int(getattr(self.image_processor, "merge_size", 2) or 2)
        return px, (px["image_grid_thw"].prod(-1) // (merge * merge)).tolist()

    def inputs_from_images(self, images, shown: Sequence[int], depth: int, query: str, window=None) -> dict:
        """Model inputs of one request from already rendered slices (for training code).

        ``images`` are the shown slices rendered as :meth:`build_inputs` renders them (RGB uint8,
        ``image_size`` square, the request's window), in the order of ``shown``; ``depth`` is the
        stack depth and ``window`` the window named in the prompt. The result is token for token
        what :meth:`build_inputs` gives for the same stack and query.
        """
        _torch()
        query = validate_query(query)
        px, tokens = self._pixels(images, shown)
        return self._inputs_from_pixels(px, tokens, shown, depth, query, window)

    def _inputs_from_pixels(self, px, tokens, shown: Sequence[int], depth: int, query: str, window) -> dict:
        torch = _torch()
        grid = px["image_grid_thw"]
        ids, spans = self._prompt_ids(query, [int(z) for z in shown], int(depth), window, tokens)
        input_ids = torch.tensor([ids], dtype=torch.long)
        mm = torch.zeros_like(input_ids, dtype=torch.int32)
        for start, length in spans:
            mm[0, start:start + length] = 1
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                "pixel_values": px["pixel_values"], "image_grid_thw": grid, "mm_token_type_ids": mm}

    def build_inputs(self, stack, query: str, window=None):
        """Model inputs for one request and the shown slice indices (in prompt order)."""
        return self._single_inputs(stack, validate_query(query), window)

    def build_batch_inputs(self, requests: Sequence[Tuple[object, str]], window=None):
        """Left-padded inputs for several ``(stack, query)`` requests and each one's shown slices."""
        torch = _torch()
        if not requests:
            raise InputError("no requests to batch")
        singles = [self._single_inputs(stack, validate_query(q), window) for stack, q in requests]
        width = max(s[0]["input_ids"].shape[1] for s in singles)
        rows_ids, rows_mask, rows_mm = [], [], []
        for inputs, _ in singles:
            pad = width - inputs["input_ids"].shape[1]
            rows_ids.append(torch.cat([torch.full((1, pad), self._ids["pad"], dtype=torch.long), inputs["input_ids"]], 1))
            rows_mask.append(torch.cat([torch.zeros((1, pad), dtype=torch.long), inputs["attention_mask"]], 1))
            rows_mm.append(torch.cat([torch.zeros((1, pad), dtype=torch.int32), inputs["mm_token_type_ids"]], 1))
        batch = {"input_ids": torch.cat(rows_ids), "attention_mask": torch.cat(rows_mask),
                 "pixel_values": torch.cat([s[0]["pixel_values"] for s in singles]),
                 "image_grid_thw": torch.cat([s[0]["image_grid_thw"] for s in singles]),
                 "mm_token_type_ids": torch.cat(rows_mm)}
        return batch, [s[1] for s in singles]

    # -- grammar --------------------------------------------------------------------------------
    def _xgr(self):
        """TokenizerInfo, GrammarCompiler, token bytes and the ``</think>`` prefix sets (cached)."""
        if self._xgr_state is None:
            xgr, torch = _xgrammar(), _torch()
            vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=self._ids["stop"])
            compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(8, torch.get_num_threads())))
            vocab = [bytes(b) for b in info.decoded_vocab]
            close = THINK_CLOSE.encode()
            pieces = [(i, b) for i, b in enumerate(vocab) if b and b in close]
            close_ids = {}
            for k in range(len(close)):
                rest = close[k:]
                close_ids[rest] = torch.tensor([i for i, b in pieces if rest.startswith(b)], dtype=torch.long)
            self._xgr_state = (xgr, info, compiler, vocab, close_ids)
        return self._xgr_state

    def _compile(self, ebnf: str):
        xgr, _, compiler, _, _ = self._xgr()
        compiled = self._compiled.get(ebnf)
        if compiled is None:
            compiled = compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
            if len(self._compiled) >= 16:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[ebnf] = compiled
        return compiled

    # -- generation -----------------------------------------------------------------------------
    def _generation_config(self, do_sample: bool, max_new_tokens: int, sampling: Optional[dict] = None):
        """Greedy, or sampled with ``sampling`` (``temperature``, ``top_p``, ``top_k``; default the
        preset's own, those of ``--sample``)."""
        _, GenerationConfig, _, _ = _transformers()
        s = self.settings if sampling is None else sampling
        kw = dict(max_new_tokens=int(max_new_tokens), min_new_tokens=0, do_sample=bool(do_sample), num_beams=1,
                  eos_token_id=self._ids["stop"], pad_token_id=self._ids["pad"], use_cache=True,
                  return_dict_in_generate=True)
        if do_sample:
            kw.update(temperature=float(s["temperature"]), top_p=float(s["top_p"]), top_k=int(s["top_k"]))
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        return GenerationConfig(**kw)

    def _generate_rows(self, inputs: dict, shown: Sequence[int], *, constrain: bool, do_sample: bool,
                       seed: Optional[int], max_new_tokens: int, rows: int = 1, prefix=None,
                       sampling: Optional[dict] = None):
        """One ``generate`` call over ``rows`` continuations of one prompt (sampled with ``sampling``
        when given, see :meth:`_generation_config`).

        ``prefix``: a transformers cache of the prompt's first ``L - 1`` tokens for one row (what
        :meth:`_prefix_cache` returns); it is repeated to ``rows`` rows, and ``generate`` then runs
        only the prompt's last token and the new ones: no image is encoded again. Without it the
        images and the prompt go through the model as usual (``rows`` must then be 1).
        Returns ``([(text, ids, signal)], timings, cache)`` (the cache as ``generate`` left it).
        """
        torch = _torch()
        _transformers()  # one clear DependencyError when transformers is missing
        from ._logits import GrammarGuide, StepProcessor  # imports transformers
        dev = self.device
        if prefix is None:
            if rows != 1:
                raise InputError("several rows need the prompt's prefix cache")
            model_inputs = {k: v.to(dev) for k, v in inputs.items()}
            model_inputs["pixel_values"] = model_inputs["pixel_values"].to(self.dtype)
        else:  # the images are in the cache: only ids (and their kinds, for the 3-D positions) go in
            ids = inputs["input_ids"].to(dev).repeat(rows, 1)
            model_inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                            "mm_token_type_ids": inputs["mm_token_type_ids"].to(dev).repeat(rows, 1)}
            if rows > 1:
                prefix.batch_repeat_interleave(rows)
        batch = model_inputs["input_ids"].shape[0]
        guide = None
        if constrain:
            xgr, _, _, vocab, close_ids = self._xgr()
            plan = plan_budget(shown, max_new_tokens, self.settings)
            compiled = self._compile(answer_grammar(shown, plan["think_chars"], plan["max_boxes"],
                                                    bool(self.settings.get("allow_absent", True))))
            guide = GrammarGuide(xgr, torch, compiled, batch, vocab, close_ids, max_new_tokens,
                                  plan["force_close_at"])
        from .progress import watch_prefill

        reporter = self._reporter
        step = StepProcessor(guide, None if reporter is None else
                             (lambda done: reporter.decode_step(done, int(max_new_tokens))))
        config = self._generation_config(do_sample, max_new_tokens, sampling)
        extra = {} if prefix is None else {"past_key_values": prefix}
        devices = [dev] if dev.type == "cuda" else []
        # generate() fills every unset field from model.generation_config (a checkpoint's may set
        # repetition_penalty, top_k, ...): swap ours in so that our settings alone define decoding.
        saved_config = self.model.generation_config
        t0 = time.perf_counter()
        try:
            self.model.generation_config = config
            with torch.random.fork_rng(devices=devices, enabled=seed is not None), torch.inference_mode():
                if seed is not None:
                    torch.manual_seed(int(seed))
                with watch_prefill(self.model, reporter if prefix is None else None, len(shown),
                                   int(model_inputs["input_ids"].shape[1])):
                    out = self.model.generate(**model_inputs, generation_config=config, logits_processor=[step],
                                              **extra)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
        finally:
            self.model.generation_config = saved_config
        t1 = time.perf_counter()
        new_all = out.sequences[:, model_inputs["input_ids"].shape[1]:]
        logprobs, allowed = step.token_logprobs(new_all)
        stops = set(self._ids["stop"])
        results, counts, stopped_all = [], [], True
        for r in range(batch):
            new = new_all[r].tolist()
            n_new, stopped = len(new), False
            for i, t in enumerate(new):  # tokens after the first stop are padding
                if t in stops:
                    n_new, stopped = i + 1, True
                    break
            text = self.tokenizer.decode(new[:n_new], skip_special_tokens=True)
            signal = self._answer_signal(new[:n_new], logprobs[r][:n_new], allowed[r][:n_new])
            results.append((text, new[:n_new], signal))
            counts.append(n_new)
            stopped_all = stopped_all and stopped
        if reporter is not None:
            reporter.decode_done(max(counts), int(max_new_tokens), stopped_all)
        first = step.first_call if step.first_call is not None else t1
        timings = {"prefill_s": first - t0, "decode_s": t1 - first,
                   "new_tokens": counts[0] if batch == 1 else sum(counts), "stopped": stopped_all}
        if guide is not None and guide.forced:
            timings["forced_close_steps"] = guide.forced
        return results, timings, getattr(out, "past_key_values", None)

    def _generate_text(self, inputs: dict, shown: Sequence[int], *, constrain: bool, do_sample: bool,
                       seed: Optional[int], max_new_tokens: int):
        """One ``generate`` call → ``(text, info)``; the seam tests replace with canned texts.

        ``info`` holds the timings (``prefill_s``, ``decode_s``, ``new_tokens``, ``stopped``) and
        ``answer_signal`` (:meth:`_answer_signal`); while :meth:`_ground` asks for it
        (``_keep_prefix``), also ``_prefix``, the prompt's cache for a retry or the samples to
        continue from, and it continues from ``_prefix_in`` when that is set (a retry).
        """
        results, timings, cache = self._generate_rows(inputs, shown, constrain=constrain, do_sample=do_sample,
                                                      seed=seed, max_new_tokens=max_new_tokens, prefix=self._prefix_in)
        text, _ids, signal = results[0]
        info = dict(timings, answer_signal=signal)
        if self._keep_prefix and cache is not None:
            keep = int(inputs["input_ids"].shape[1]) - 1
            surplus = cache.get_seq_length() - keep
            if surplus > 0:
                cache.crop(-surplus)  # back to the prompt's first L - 1 tokens
            info["_prefix"] = cache
        return text, info

    def _prefix_cache(self, inputs: dict):
        """The cache of the prompt's first ``L - 1`` tokens (images included) from one forward pass,
        and its seconds: for samples whose greedy answer gave none (a replaced generation seam)."""
        torch = _torch()
        dev = self.device
        head = {k: (v[:, :-1] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v).to(dev)
                for k, v in inputs.items()}
        head["pixel_values"] = head["pixel_values"].to(self.dtype)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(**head, use_cache=True, logits_to_keep=1)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return out.past_key_values, time.perf_counter() - t0

    def _generate_samples(self, inputs: dict, shown: Sequence[int], n: int, *, constrain: bool,
                          seed: Optional[int], max_new_tokens: int, prefix=None):
        """``n`` sampled continuations of one prompt in one ``generate`` call, all continuing from one
        prefill (``prefix``, or one made here) → ``([(text, info)], timings)``; the seam tests replace."""
        prefill_s = 0.0
        if prefix is None:
            prefix, prefill_s = self._prefix_cache(inputs)
        results, timings, _ = self._generate_rows(inputs, shown, constrain=constrain, do_sample=True, seed=seed,
                                                  max_new_tokens=max_new_tokens, rows=n, prefix=prefix,
                                                  sampling=self.settings["consensus_sampling"])
        timings = dict(timings, shared_prefill=prefill_s == 0.0, own_prefill_s=prefill_s)
        return [(text, {"answer_signal": signal, "new_tokens": len(ids)}) for text, ids, signal in results], timings

    def _answer_signal(self, ids: Sequence[int], logprobs: Sequence[float], allowed: Sequence[int]) -> Optional[dict]:
        """How peaked the decoder's choice was over the *answer* (the tokens after ``</think>``; the
        stop token and tokens the grammar forced, where one token alone was allowed, left out):
        ``answer_mean_logprob`` (mean natural-log probability of the chosen tokens under the
        scores the grammar allowed, before any temperature), ``answer_mean_prob`` (its exp: a
        geometric-mean probability) and ``answer_scored_tokens``. None when no token was scored.
        Not a probability that the answer is right: an untrained model can be confidently wrong."""
        n = len(ids)
        if n and ids[-1] in set(self._ids["stop"]):
            n -= 1
        start = 0
        if THINK_CLOSE in self.tokenizer.decode(list(ids[:n]), skip_special_tokens=True):
            for k in range(n):  # the answer starts after the token that completes "</think>"
                if THINK_CLOSE in self.tokenizer.decode(list(ids[:k + 1]), skip_special_tokens=True):
                    start = k + 1
                    break
        picked = [float(lp) for lp, a in zip(logprobs[start:n], allowed[start:n]) if a > 1]
        if not picked:
            return None
        mean = sum(picked) / len(picked)
        return {"answer_mean_logprob": round(mean, 6), "answer_mean_prob": round(math.exp(mean), 6),
                "answer_scored_tokens": len(picked)}

    # -- the request ------------------------------------------------------------------------------
    def _check_answer(self, text: str, shown: Sequence[int]):
        parsed = parse_answer(text)
        if parsed.absent:
            return parsed, [], []
        if parsed.slice not in set(shown):
            raise _Unusable(f"slice {parsed.slice} is not one of the shown slices")
        boxes, notes = clean_boxes(parsed.boxes_norm)
        if not boxes:
            raise _Unusable("no box with a non-zero width and height")
        return parsed, boxes, notes

    def _anchor_from_text(self, text: str, shown: Sequence[int], stack, query: str, notes: Sequence[str] = ()):
        """``(anchor, parsed)`` of one answer text; :class:`_Unusable` (or a parse error) when it cannot
        be one. ``notes`` go first in the anchor's notes, the box fix-ups after them."""
        parsed, boxes, box_notes = self._check_answer(text, shown)
        kw = dict(query=query, reasoning=parsed.reasoning, source="grounder", notes=list(notes) + box_notes)
        if parsed.absent:
            anchor = EvidenceAnchor.absent_for([stack.width, stack.height], **kw)
        else:
            anchor = EvidenceAnchor.from_norm(parsed.slice, boxes, [stack.width, stack.height], **kw)
        anchor.with_world(stack)
        return anchor, parsed

    def _check_request(self, query, retries, max_new_tokens, seed):
        query = validate_query(query)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise InputError(f"retries must be a whole number ≥ 0, got {retries!r}")
        if max_new_tokens is None:
            max_new_tokens = int(self.settings["max_new_tokens"])
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a whole number ≥ 1, got {max_new_tokens!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InputError(f"seed must be an integer, got {seed!r}")
        return query, max_new_tokens

    def ground(self, stack, query: str, *, constrain: bool = True, do_sample: bool = False, seed: Optional[int] = None,
               max_new_tokens: Optional[int] = None, retries: int = 2, window=None, progress=None,
               cancel=None) -> GroundingResult:
        """Answer ``query`` on ``stack`` with an evidence anchor (see the module docstring).

        Greedy by default; ``do_sample=True`` with ``seed`` samples reproducibly. Failed attempts
        are retried with sampling seeded ``seed + attempt`` (``0 + attempt`` without a seed).
        ``max_new_tokens`` defaults to the preset's (256, the paper's limit). The anchor carries
        the answer signal (:meth:`_answer_signal`) when the decoder's scores were seen.
        ``progress(stage, fraction, message)`` hears the encoding, the prefill and each decoding
        step as fractions of the ``ground`` stage, and ``cancel`` (an Event or a callable) is
        checked at each of them (:mod:`medvolcore.grounder.progress`).
        """
        with self._reporting(progress, cancel, consensus=False):
            return self._ground(stack, query, constrain=constrain, do_sample=do_sample, seed=seed,
                                max_new_tokens=max_new_tokens, retries=retries, window=window)[0]

    @contextlib.contextmanager
    def _reporting(self, progress, cancel, consensus: bool):
        """``self._reporter`` for one call (none when neither ``progress`` nor ``cancel`` is given)."""
        from .progress import GroundingProgress

        saved = self._reporter
        self._reporter = None if progress is None and cancel is None else GroundingProgress(
            progress, cancel, consensus=consensus)
        try:
            yield self._reporter
        finally:
            self._reporter = saved

    def _ground(self, stack, query, *, constrain, do_sample, seed, max_new_tokens, retries, window,
                want_prefix: bool = False, shared: Optional["_SharedPrompt"] = None):
        """:meth:`ground`, also returning ``(inputs, shown, prefix)``: the prompt and, with
        ``want_prefix``, the prompt's cache (its first ``L - 1`` tokens; None when the generation
        seam gave none). A retry continues from the first attempt's cache: the slices are encoded
        and the prompt prefilled once per call, however many attempts it takes. ``shared``: the
        volume's shared prompt (:meth:`_share_prompt`): its slices are not rendered or encoded
        again, and the first attempt continues from its cache (which this call extends in place:
        the caller crops it back)."""
        t_start = time.perf_counter()
        query, max_new_tokens = self._check_request(query, retries, max_new_tokens, seed)
        if shared is None:
            inputs, shown = self._single_inputs(stack, query, window)
        else:
            shown = shared.shown
            inputs = self._inputs_from_pixels(shared.pixels, shared.tokens, shown, stack.depth, query, window)
        if constrain:
            plan_budget(shown, max_new_tokens, self.settings)  # fail early on a too-small budget
        if self._reporter is not None:
            self._reporter.prompt_ready(len(shown), int(inputs["input_ids"].shape[1]))
        prompt_s = time.perf_counter() - t_start
        self._keep_prefix = want_prefix or retries > 0
        try:
            return self._attempts(stack, query, inputs, shown, constrain=constrain, do_sample=do_sample,
                                  seed=seed, max_new_tokens=max_new_tokens, retries=retries, prompt_s=prompt_s,
                                  t_start=t_start, want_prefix=want_prefix,
                                  prefix=None if shared is None else shared.cache)
        finally:
            self._keep_prefix, self._prefix_in = False, None

    def _attempts(self, stack, query, inputs, shown, *, constrain, do_sample, seed, max_new_tokens, retries,
                  prompt_s, t_start, want_prefix, prefix=None):
        """The attempts of :meth:`_ground` (its return value; :class:`GenerationError` when none is usable).
        ``prefix``: a cache of the prompt's first tokens for the first attempt to continue from."""
        failures: List[str] = []
        last_text = ""
        for attempt in range(retries + 1):
            sample = do_sample or attempt > 0
            s = seed if attempt == 0 else (seed or 0) + attempt
            self._prefix_in = prefix
            if self._reporter is not None:
                self._reporter.attempt_started(attempt + 1, retries + 1)
            text, timings = self._generate_text(inputs, shown, constrain=constrain, do_sample=sample,
                                                seed=s if sample else None, max_new_tokens=max_new_tokens)
            self._prefix_in = None
            timings = dict(timings)
            prefix = timings.pop("_prefix", None) or prefix
            signal = timings.pop("answer_signal", None)
            last_text = text
            notes = list(self.notes) + [f"attempt {i + 1} was unusable: {reason}" for i, reason in enumerate(failures)]
            try:
                anchor, parsed = self._anchor_from_text(text, shown, stack, query, notes)
            except (AnswerFormatError, _Unusable, InputError, AnchorError) as e:
                failures.append(str(e))
                log.info("grounder attempt %d unusable: %s", attempt + 1, e)
                continue
            anchor.signal = signal
            timings = dict(timings, prompt_s=prompt_s, total_s=time.perf_counter() - t_start)
            timings.setdefault("prefill_s", float("nan"))
            timings.setdefault("decode_s", float("nan"))
            timings.setdefault("new_tokens", 0)
            result = GroundingResult(anchor=anchor, reasoning=parsed.reasoning, raw_text=text, shown_slices=list(shown),
                                     timings=timings, notes=list(anchor.notes), attempts=attempt + 1)
            return result, inputs, shown, (prefix if want_prefix else None)
        reasons = "; ".join(f"attempt {i + 1}: {r}" for i, r in enumerate(failures))
        err = GenerationError(
            f"the model gave no usable answer in {retries + 1} attempt(s) ({reasons}); last answer: "
            f"«{_one_line(last_text)}»" + (" — this is the untrained smoke model" if self.is_smoke else ""))
        err.raw_text = last_text
        err.failures = failures
        raise err

    def ground_samples(self, stack, query: str, samples: int, *, constrain: bool = True, seed: Optional[int] = None,
                       max_new_tokens: Optional[int] = None, retries: int = 2, window=None, progress=None,
                       cancel=None) -> SampledGrounding:
        """``samples`` answers to one query: the greedy one, then ``samples - 1`` sampled ones.

        Sample 1 is exactly :meth:`ground`'s answer (greedy, with its retries). Samples 2..G are
        drawn with the preset's ``consensus_sampling`` (the GRPO rollouts' settings) in one
        ``generate`` call of G − 1 rows, seeded ``seed`` (0 when None), that continues from the
        greedy call's cache of the prompt: the slices are encoded and the prompt is prefilled
        once for all G (only the prompt's last token runs again, once per row). Each sample is
        parsed; one that is unusable keeps its raw text and the reason (it is not retried).
        ``progress`` and ``cancel`` as in :meth:`ground`, over the samples' decode too.
        """
        n = check_samples(samples)
        with self._reporting(progress, cancel, consensus=n > 1):
            return self._ground_samples(stack, query, n, constrain=constrain, seed=seed,
                                        max_new_tokens=max_new_tokens, retries=retries, window=window)

    def _ground_samples(self, stack, query, n, *, constrain, seed, max_new_tokens, retries, window, shared=None,
                        do_sample: bool = False):
        greedy_seed = seed if do_sample else None
        if seed is None:
            seed = 0
        greedy, inputs, shown, prefix = self._ground(stack, query, constrain=constrain, do_sample=do_sample,
                                                     seed=greedy_seed, max_new_tokens=max_new_tokens, retries=retries,
                                                     window=window, want_prefix=n > 1, shared=shared)
        if shared is not None and prefix is shared.cache:
            prefix = copy.deepcopy(prefix)  # the samples repeat their cache to G - 1 rows: keep the shared one whole
        query = greedy.anchor.query
        out = [GroundingSample(1, greedy.raw_text, greedy.reasoning, greedy.anchor, signal=greedy.anchor.signal)]
        timings = {}
        if n > 1:
            t1 = time.perf_counter()
            budget = int(self.settings["max_new_tokens"]) if max_new_tokens is None else max_new_tokens
            if self._reporter is not None:
                self._reporter.samples_started(n - 1)
            texts, st = self._generate_samples(inputs, shown, n - 1, constrain=constrain, seed=seed,
                                               max_new_tokens=budget, prefix=prefix)
            del prefix
            for i, (text, info) in enumerate(texts, start=2):
                try:
                    anchor, parsed = self._anchor_from_text(text, shown, stack, query)
                except (AnswerFormatError, _Unusable, InputError, AnchorError) as e:
                    log.info("grounder sample %d unusable: %s", i, e)
                    out.append(GroundingSample(i, text, error=str(e)))
                    continue
                anchor.signal = (info or {}).get("answer_signal")
                out.append(GroundingSample(i, text, parsed.reasoning, anchor, signal=anchor.signal))
            timings.update({f"samples_{k}": v for k, v in st.items()})
            timings["samples_s"] = time.perf_counter() - t1
        return SampledGrounding(greedy=greedy, samples=out, timings=timings, seed=seed)

    def ground_queries(self, stack, queries: Sequence[str], samples: int = 1, *, constrain: bool = True,
                       do_sample: bool = False, seed: Optional[int] = None, max_new_tokens: Optional[int] = None,
                       retries: int = 2, window=None, progress=None, cancel=None) -> List[SampledGrounding]:
        """Answer several queries on one volume: one :class:`SampledGrounding` per query, in order
        (``samples`` answers each, as :meth:`ground_samples`; with 1, its ``greedy`` is exactly what
        :meth:`ground` answers, up to floating-point rounding).

        The prompt's layout puts the slices before the query, so everything up to the last slice
        (the system text, ~4 100 tokens of slices and their tags at full size) is the same for every
        query: it is rendered, encoded and prefilled once (:meth:`_share_prompt`), and each query
        continues from that cache, running only its own ~200 tokens before decoding. A template
        whose query comes before the slices shares nothing: each query is then grounded on its own
        (``timings["shared_prompt"]`` says which). ``progress`` hears each query as an equal part
        of the ``ground`` stage, its messages prefixed ``query i/n``; ``cancel`` as in :meth:`ground`.
        """
        n = check_samples(samples)
        queries = [validate_query(q) for q in queries]
        if not queries:
            raise InputError("no query to ground")
        if n > 1 and do_sample:
            raise InputError("a consensus samples its own answers after the greedy one: do not ask for sampling too")
        budget = self._check_request(queries[0], retries, max_new_tokens, seed)[1]
        if constrain:  # a too-small budget fails before the slices are encoded
            plan_budget(stack.sample_indices(int(self.prompts.get("num_slices", 64))), budget, self.settings)
        out: List[SampledGrounding] = []
        shared = None
        for i, query in enumerate(queries):
            part = part_of(progress, i, len(queries), "query")
            with self._reporting(part, cancel, consensus=n > 1):
                if i == 0 and len(queries) > 1:
                    shared = self._share_prompt(stack, queries, window)
                try:
                    r = self._ground_samples(stack, query, n, constrain=constrain, seed=seed,
                                             max_new_tokens=max_new_tokens, retries=retries, window=window,
                                             shared=shared, do_sample=do_sample)
                except GenerationError as e:
                    e.args = (f"query {i + 1} of {len(queries)}: {e}",) + tuple(e.args[1:])
                    raise
                finally:
                    if shared is not None:
                        shared.rewind()
            extra = {"shared_prompt": shared is not None}
            if shared is not None:
                extra.update(shared_prompt_tokens=shared.length, shared_prefill_s=shared.prefill_s if i == 0 else 0.0)
            r.greedy.timings.update(extra)
            out.append(r)
        return out

    def _share_prompt(self, stack, queries: Sequence[str], window) -> Optional["_SharedPrompt"]:
        """The prompt's part shared by ``queries`` (through the last slice's ``<|vision_end|>``), its
        slices rendered and encoded and its tokens prefilled in one forward pass; None when the
        queries' prompts differ before the last slice (a template with the query first)."""
        torch = _torch()
        t0 = time.perf_counter()
        images, shown = self._render(stack, window)
        px, tokens = self._pixels(images, shown)
        rows = [self._prompt_ids(q, shown, stack.depth, window, tokens) for q in queries]
        ids, spans = rows[0]
        length = spans[-1][0] + spans[-1][1] + 1  # the last image's tokens and its <|vision_end|>
        if ids[length - 1] != self._ids["<|vision_end|>"] or any(
                len(other) <= length or other[:length] != ids[:length] for other, _ in rows[1:]):
            return None
        inputs = self._inputs_from_pixels(px, tokens, shown, stack.depth, queries[0], window)
        dev = self.device
        head = {k: (v[:, :length] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v).to(dev)
                for k, v in inputs.items()}
        head["pixel_values"] = head["pixel_values"].to(self.dtype)
        from .progress import watch_prefill

        if self._reporter is not None:
            self._reporter.prompt_ready(len(shown), length)
        t1 = time.perf_counter()
        with watch_prefill(self.model, self._reporter, len(shown), length), torch.inference_mode():
            cache = self.model(**head, use_cache=True, logits_to_keep=1).past_key_values
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        return _SharedPrompt(cache=cache, length=length, pixels=px, tokens=tokens, shown=shown,
                             prefill_s=t2 - t1, prompt_s=t1 - t0)

    def __repr__(self) -> str:
        extra = f", adapter={self.adapter_dir}" if self.adapter_dir else ""
        return f"QwenVLGrounder({self.model_dir}{extra}, smoke={self.is_smoke}, preset={self.settings['preset']})"
