"""What building (:mod:`.build`) and predicting (:mod:`.model`, :mod:`.inputs`, :mod:`.decode`) share:
the heavy libraries, imported on first use with one clear error each, and a one-line excerpt of a
long text for error messages.

Importing this module does not import torch, transformers or xgrammar.
"""

from __future__ import annotations

from ..errors import DependencyError


def require_torch():
    """The ``torch`` module; a :class:`DependencyError` saying how to install it when it is missing."""
    try:
        import torch
    except ImportError:
        raise DependencyError("the grounder needs PyTorch; install it with `pip install torch`") from None
    return torch


def require_transformers():
    """``(AutoTokenizer, GenerationConfig, Qwen3VLForConditionalGeneration, Qwen2VLImageProcessorPil)``;
    a :class:`DependencyError` when transformers (≥ 5, with Qwen3-VL) is missing."""
    try:
        import transformers  # noqa: F401
        from transformers import AutoTokenizer, GenerationConfig, Qwen3VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError as e:
        raise DependencyError(f"the grounder needs transformers ≥ 5 with Qwen3-VL ({e}); "
                              "install it with `pip install 'transformers>=5'`") from None
    return AutoTokenizer, GenerationConfig, Qwen3VLForConditionalGeneration, Qwen2VLImageProcessorPil


def require_xgrammar():
    """The ``xgrammar`` module (constrained decoding); a :class:`DependencyError` when it is missing."""
    try:
        import xgrammar
    except ImportError:
        raise DependencyError("constrained decoding needs xgrammar (`pip install xgrammar`); "
                              "or pass constrain=False") from None
    return xgrammar


def one_line(text: str, limit: int = 600) -> str:
    """``text`` on one line (line breaks escaped), its middle left out beyond ``limit`` characters."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    if len(text) > limit:
        head = limit * 2 // 3
        text = f"{text[:head]} …[{len(text) - limit} characters left out]… {text[-(limit - head):]}"
    return text
