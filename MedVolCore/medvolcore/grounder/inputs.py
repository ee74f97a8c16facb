"""The grounder's model inputs: the slices rendered, the chat prompt tokenized, the image tokens placed.

:class:`InputsMixin` is the part of :class:`~medvolcore.grounder.QwenVLGrounder` that builds inputs
(``build_inputs``, ``build_batch_inputs``, ``inputs_from_images``); it uses the grounder's
``tokenizer``, ``image_processor``, ``model`` (its config), ``model_dir``, ``prompts`` and ``_ids``
(which :meth:`InputsMixin._special_ids` makes when the grounder is constructed).

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

Importing this module does not import torch or transformers.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from ..errors import InputError, ModelError
from ._common import require_torch
from .prompt import describe_window, fill_template, validate_query

__all__ = ["InputsMixin"]

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")


class InputsMixin:
    """Building the model inputs of :class:`~medvolcore.grounder.QwenVLGrounder` (see the module docstring)."""

    def _special_ids(self) -> dict:
        """The chat and vision tokens' ids, ``stop`` (every id that ends an answer) and ``pad``; a
        :class:`ModelError` when the tokenizer is not Qwen3-VL's or does not belong to the model."""
        tok = self.tokenizer
        ids = {}
        for name in SPECIAL_TOKENS:
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
        require_torch()  # a clear DependencyError before any rendering when torch is missing
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
        require_torch()
        query = validate_query(query)
        px, tokens = self._pixels(images, shown)
        return self._inputs_from_pixels(px, tokens, shown, depth, query, window)

    def _inputs_from_pixels(self, px, tokens, shown: Sequence[int], depth: int, query: str, window) -> dict:
        torch = require_torch()
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
        torch = require_torch()
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
