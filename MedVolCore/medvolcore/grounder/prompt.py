"""The grounder's prompt and answer grammar: pure text, no model, no torch.

Prompt
------
Qwen's chat layout, written by us rather than by the checkpoint's chat template (a thinking
model's template would otherwise open ``<think>`` itself)::

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n

``system`` and ``user`` come from ``Resources/prompts/grounder.json`` (:func:`load_prompts`), with
decoding settings per preset (:func:`resolve_settings`). Inside the user turn the ``{slices}``
placeholder becomes, for every shown slice ``z``, ``<slice z><|vision_start|><|image_pad|>×N<|vision_end|>``
(see :mod:`medvolcore.grounder.inputs` for how ``N`` is counted). :func:`validate_query` checks a
query before anything else runs.

Answer grammar and token budget
-------------------------------
By default the answer is forced by a grammar built per request from the shown tags
(:func:`answer_grammar`)::

    <think>TEXT</think><answer>[{"slice": TAG, "bbox_2d_list": [[X, Y, X, Y], ...]}]</answer><stop>
    <think>TEXT</think><answer>[]</answer><stop>

the second being the absent answer (the target is not in this volume), allowed when the setting
``allow_absent`` is true (the real presets; the untrained tiny smoke model keeps to box answers so that
smoke runs exercise the whole pipeline). ``TAG`` is one of the shown tags, each coordinate an integer 0..1000 (no leading zeros), 1 to
``max_boxes`` boxes, with the exact separators of :func:`~medvolcore.answer.format_answer` (the
canonical text the SFT targets use). ``TEXT`` has no ``<`` and at most ``think_max_chars``
characters.

The answer after the reasoning costs at most one token per byte (byte-level BPE, the worst
case), i.e. ``answer_tokens(B) = 27 + len(longest tag) + 19 + 24·B + 2·(B−1) + 12 + 1`` tokens for
``B`` boxes. :func:`plan_budget` lowers ``B`` (from ``max_boxes``, 8) until ``max_new_tokens`` leaves
``7 + min_think_tokens + 3`` more tokens, and returns ``force_close_at``: the decoder's budget
guard forces ``</think>`` once only ``answer_tokens(B) + 3`` tokens remain (the 3 lets a multi-byte
character finish). So the whole answer always fits in ``max_new_tokens`` whatever the tokenizer or
the language of the reasoning, and a character cap (``think_max_chars``, per preset in
grounder.json: 2000 for real models, 24 for the tiny smoke model so smoke runs stay short)
still bounds the reasoning. With the preset defaults (256 new tokens, the MedVol-R1 paper's
limit; 48 reserved for reasoning) real models may give up to 5 boxes and the tiny model up to 6.
"""

from __future__ import annotations

import copy
import math
import re
import unicodedata
from typing import List, Optional, Sequence

from ..anchor import MAX_BOXES
from ..errors import InputError, MedVolError
from ..resources import load_json

__all__ = ["MAX_QUERY_CHARS", "THINK_OPEN", "THINK_CLOSE", "load_prompts", "resolve_settings", "validate_query",
           "describe_window", "answer_tokens", "plan_budget", "answer_grammar", "fill_template"]

PROMPTS_FILE = ("prompts", "grounder.json")
MAX_QUERY_CHARS = 2000
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_ANSWER_OPEN = "</think><answer>["
_ENTRY_HEAD = '{"slice": '
_ANSWER_HEAD = _ANSWER_OPEN + _ENTRY_HEAD
_ANSWER_MID = ', "bbox_2d_list": ['
_ENTRY_TAIL = "]}"
_ANSWER_CLOSE = "]</answer>"
_ANSWER_TAIL = _ENTRY_TAIL + _ANSWER_CLOSE
_BOX_WORST = "[1000, 1000, 1000, 1000]"
_BOX_SEP = ", "
_UTF8_SLACK = 3  # continuation bytes a multi-byte character may still need before "</think>" fits
_PLACEHOLDER = re.compile(r"\{(query|window|num_shown|depth)\}")
_SETTING_KEYS = ("max_new_tokens", "think_max_chars", "min_think_tokens", "max_boxes", "temperature", "top_p",
                 "top_k", "allow_absent", "consensus_sampling")



# ---- prompt resources and settings ---------------------------------------------------------

def load_prompts() -> dict:
    """``Resources/prompts/grounder.json`` (a private copy), checked."""
    try:
        cfg = copy.deepcopy(load_json(*PROMPTS_FILE))
    except (OSError, ValueError) as e:
        raise MedVolError(f"cannot read the grounder prompts (Resources/prompts/grounder.json): {e}") from None
    for key in ("system", "user", "slice_tag", "presets"):
        if key not in cfg:
            raise MedVolError(f"Resources/prompts/grounder.json has no {key!r}")
    for ph in ("{slices}", "{query}"):
        if cfg["user"].count(ph) != 1:
            raise MedVolError(f"the grounder's user template must contain {ph} exactly once")
    if "{z}" not in cfg["slice_tag"]:
        raise MedVolError("the grounder's slice_tag must contain {z}")
    return cfg


def resolve_settings(preset: str = "real", overrides: Optional[dict] = None) -> dict:
    """Decoding settings: a preset of grounder.json (``"real"`` or ``"tiny"``) with ``overrides``.

    ``overrides`` may name the preset as ``preset`` or ``think_budget`` (the key the model
    manifest, ``Resources/models.json``, uses); other keys override single settings.
    """
    presets = load_prompts()["presets"]
    overrides = dict(overrides or {})
    named = {overrides.pop(k) for k in ("preset", "think_budget") if k in overrides}
    if len(named) > 1:
        raise InputError(f"grounder settings name two presets: {', '.join(sorted(map(str, named)))}")
    preset = named.pop() if named else preset
    if preset not in presets:
        raise InputError(f"unknown grounder preset {preset!r}; choose one of {', '.join(sorted(presets))}")
    unknown = sorted(set(overrides) - set(_SETTING_KEYS))
    if unknown:
        raise InputError(f"unknown grounder setting(s) {', '.join(unknown)}; known: {', '.join(_SETTING_KEYS)}")
    out = dict(presets[preset], **overrides, preset=preset)
    for key in ("max_new_tokens", "think_max_chars", "min_think_tokens", "max_boxes"):
        v = out.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key in ("max_new_tokens", "max_boxes") else 0):
            raise InputError(f"grounder setting {key} must be a whole number ≥ 0 (≥ 1 for {key}), got {v!r}")
    out["max_boxes"] = min(out["max_boxes"], MAX_BOXES)
    out["allow_absent"] = out.get("allow_absent", True)
    if not isinstance(out["allow_absent"], bool):
        raise InputError(f"grounder setting allow_absent must be true or false, got {out['allow_absent']!r}")
    for key in ("temperature", "top_p", "top_k"):
        check_sampling(key, out.get(key))
    sampling = out.get("consensus_sampling", {})
    if not isinstance(sampling, dict) or set(sampling) != {"temperature", "top_p", "top_k"}:
        raise InputError("grounder setting consensus_sampling must be an object with temperature, top_p and top_k, "
                         f"got {sampling!r}")
    for key, v in sampling.items():
        check_sampling(key, v, "consensus_sampling.")
    out["consensus_sampling"] = dict(sampling)
    return out


def check_sampling(key: str, value, prefix: str = "") -> None:
    """One sampling setting, checked: ``temperature`` > 0, ``top_p`` in (0, 1], ``top_k`` a whole
    number ≥ 0 (0: no top-k cut-off); otherwise :class:`InputError`."""
    if key == "top_k":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        need = "a whole number ≥ 0"
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
            0 < value <= 1 if key == "top_p" else value > 0)
        need = "in (0, 1]" if key == "top_p" else "a number > 0"
    if not ok:
        raise InputError(f"grounder setting {prefix}{key} must be {need}, got {value!r}")


def validate_query(query) -> str:
    """The query, stripped. Empty or longer than 2000 characters → :class:`InputError`."""
    if not isinstance(query, str):
        raise InputError(f"the query must be text, got {type(query).__name__}")
    q = query.strip()
    if not q:
        raise InputError("the query is empty; describe what to find, e.g. 'the organ that secretes bile'")
    try:
        q.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError("the query is not valid Unicode text (it holds a lone surrogate such as \\ud800)") from None
    if len(q) > MAX_QUERY_CHARS:
        raise InputError(f"the query has {len(q)} characters; at most {MAX_QUERY_CHARS} are allowed")
    bad = next((c for c in q if c not in "\t\n\r" and unicodedata.category(c) == "Cc"), None)
    if bad is not None:  # a NUL cuts a file's text short; others reach segment names and DICOM text
        raise InputError(f"the query holds the control character U+{ord(bad):04X}; write it as plain text")
    return q


def describe_window(window) -> str:
    from ..windowing import get_window

    w = get_window(window)
    name = "custom" if w.name == "custom" else w.name.replace("_", " ")
    return f"{name} window (centre {w.center:g} HU, width {w.width:g} HU)"


# ---- grammar and budget -------------------------------------------------------------------

def _tag_texts(tags: Sequence[int]) -> List[str]:
    out = []
    for t in tags:
        if isinstance(t, bool) or not isinstance(t, int) and not hasattr(t, "__index__") or int(t) < 0:
            raise InputError(f"slice tags must be non-negative integers, got {t!r}")
        out.append(str(int(t)))
    if not out:
        raise InputError("no slice tags to choose from")
    return out


def answer_tokens(tags: Sequence[int], boxes: int) -> int:
    """Worst-case tokens from ``</think>`` through the stop token, one token per byte."""
    longest = max(len(t) for t in _tag_texts(tags))
    return (len(_ANSWER_HEAD) + longest + len(_ANSWER_MID) + boxes * len(_BOX_WORST)
            + (boxes - 1) * len(_BOX_SEP) + len(_ANSWER_TAIL) + 1)


def plan_budget(tags: Sequence[int], max_new_tokens: int, settings: dict) -> dict:
    """Grammar bounds for a request: ``think_chars``, ``max_boxes`` and ``force_close_at``.

    ``max_boxes`` is lowered from the setting until the worst-case answer leaves
    ``min_think_tokens`` for the reasoning (never below 1; too small a budget is an
    :class:`InputError`). ``think_chars`` is the setting's character cap; it is not derived from
    the token budget (a token may hold many characters): the budget guard enforces the fit —
    when ``force_close_at`` tokens or fewer remain and the reasoning is still open, it forces
    ``</think>``.
    """
    min_think = int(settings.get("min_think_tokens", 0))
    boxes = int(settings.get("max_boxes", MAX_BOXES))
    overhead = len(THINK_OPEN) + min_think + _UTF8_SLACK
    while boxes > 1 and answer_tokens(tags, boxes) + overhead > max_new_tokens:
        boxes -= 1
    need = answer_tokens(tags, 1) + len(THINK_OPEN) + _UTF8_SLACK
    if answer_tokens(tags, boxes) + len(THINK_OPEN) + _UTF8_SLACK > max_new_tokens:
        raise InputError(f"max_new_tokens={max_new_tokens} is too small for a constrained answer; "
                         f"give at least {need} (more leaves room for the reasoning)")
    return {"think_chars": max(0, int(settings.get("think_max_chars", 0))),
            "max_boxes": boxes,
            "force_close_at": answer_tokens(tags, boxes) + _UTF8_SLACK}


def _ebnf_literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def answer_grammar(tags: Sequence[int], think_chars: int, max_boxes: int, allow_absent: bool = True) -> str:
    """EBNF (xgrammar / GBNF dialect) of the answer format for the given shown tags; with
    ``allow_absent`` the absent answer (``[]``) too."""
    tag_texts = _tag_texts(tags)
    if not 1 <= max_boxes <= MAX_BOXES:
        raise InputError(f"max_boxes must be 1..{MAX_BOXES}, got {max_boxes}")
    think = f" think {_ebnf_literal(_ANSWER_OPEN)}" if think_chars > 0 else f" {_ebnf_literal(_ANSWER_OPEN)}"
    more = f" ({_ebnf_literal(_BOX_SEP)} box){{0,{max_boxes - 1}}}" if max_boxes > 1 else ""
    lines = [
        f"root ::= {_ebnf_literal(THINK_OPEN)}{think} entry{'?' if allow_absent else ''} {_ebnf_literal(_ANSWER_CLOSE)}",
        f"entry ::= {_ebnf_literal(_ENTRY_HEAD)} tag {_ebnf_literal(_ANSWER_MID)} box{more} {_ebnf_literal(_ENTRY_TAIL)}",
        "tag ::= " + " | ".join(_ebnf_literal(t) for t in dict.fromkeys(tag_texts)),
        'box ::= "[" num ", " num ", " num ", " num "]"',
        'num ::= "0" | [1-9] [0-9]{0,2} | "1000"',
    ]
    if think_chars > 0:
        lines.append(f"think ::= [^<]{{0,{think_chars}}}")
    return "\n".join(lines) + "\n"


def fill_template(template: str, values: dict) -> str:
    """Replace ``{query}``, ``{window}``, ``{num_shown}`` and ``{depth}`` in a prompt template (other
    braces stay as they are)."""
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)
