"""The grounder: Qwen3-VL looks at 64 axial slices and answers with an evidence anchor.

Building apart from predicting:

- :mod:`.build` — loading a checkpoint folder (tokenizer, image processor, model, dtype, device) and
  a LoRA adapter (PEFT); imported only when :meth:`QwenVLGrounder.from_pretrained` runs;
- :mod:`.model` — :class:`QwenVLGrounder`: the requests (``ground``, ``ground_samples``,
  ``ground_queries``), composed of
- :mod:`.inputs` — the model inputs: rendered slices, the chat prompt, the image tokens;
- :mod:`.decode` — ``generate`` (constrained by default), the prompt's cache shared by retries,
  samples and queries, the answer signal;
- :mod:`.answers` — answer texts → anchors, and the result types;
- :mod:`.prompt` — the prompt templates, query checks, the answer grammar and its token budget
  (pure text: no model, no torch);
- :mod:`._logits` — the logits processor and grammar guide (imported only when text is generated);
- :mod:`.progress` — progress and cancel inside one grounding.

Importing this package does not import torch or transformers.
"""

from .answers import MAX_SAMPLES, GroundingResult, GroundingSample, SampledGrounding, check_samples, clean_boxes
from .model import QwenVLGrounder
from .prompt import (MAX_QUERY_CHARS, answer_grammar, answer_tokens, describe_window, load_prompts, plan_budget,
                     resolve_settings, validate_query)

__all__ = [
    "QwenVLGrounder", "GroundingResult", "answer_grammar", "answer_tokens", "plan_budget", "validate_query",
    "load_prompts", "resolve_settings", "describe_window", "clean_boxes", "MAX_QUERY_CHARS", "GroundingSample",
    "SampledGrounding", "MAX_SAMPLES", "check_samples",
]
