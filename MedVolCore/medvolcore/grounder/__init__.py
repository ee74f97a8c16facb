"""The grounder: Qwen3-VL looks at 64 axial slices and answers with an evidence anchor.

- :mod:`.prompt` — the prompt templates, query checks, the answer grammar and its token budget
  (pure text: no model, no torch);
- :mod:`.model` — :class:`QwenVLGrounder`: loading a checkpoint (and a LoRA adapter), building the
  model inputs, decoding (constrained by default) and turning the answer into an anchor;
- :mod:`._logits` — the logits processor and grammar guide (imported only when text is generated).

Importing this package does not import torch or transformers.
"""

from .model import (MAX_SAMPLES, GroundingResult, GroundingSample, QwenVLGrounder, SampledGrounding, check_samples,
                    clean_boxes)
from .prompt import (MAX_QUERY_CHARS, answer_grammar, answer_tokens, describe_window, load_prompts, plan_budget,
                     resolve_settings, validate_query)

__all__ = [
    "QwenVLGrounder", "GroundingResult", "answer_grammar", "answer_tokens", "plan_budget", "validate_query",
    "load_prompts", "resolve_settings", "describe_window", "clean_boxes", "MAX_QUERY_CHARS", "GroundingSample",
    "SampledGrounding", "MAX_SAMPLES", "check_samples",
]
