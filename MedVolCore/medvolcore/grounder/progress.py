"""Progress and cancel inside one grounding, as fractions of the pipeline's ``ground`` stage.

Pure Python (no torch, no transformers): :class:`GroundingProgress` turns what the grounder
observes — the prompt built, each vision-encoder block and each language-model layer of the
prefill finished (forward hooks, :func:`watch_prefill`: the one forward pass ``generate`` runs
anyway, observed, not repeated), each decoding step (the logits processor) — into
``progress("ground", fraction, message)`` calls, and checks ``cancel`` at each of them.

The stage is split by the typical cost of its steps on a CPU at full size (docs/benchmarks.md,
Qwen3-VL-2B: vision encoder ≈ 40 % of the prefill, the prefill about as long as a 256-token
decode): :data:`SPANS`. The decode step's fraction is tokens generated / the token budget
(``max_new_tokens``); an answer that ends before the budget jumps to the end of the span. With a
consensus (G > 1 answers) the decode span is halved: the greedy answer's decode, then the one
decode of the G − 1 samples. A retry of an unusable answer continues from the prompt's cache, so
only its decode runs again: its fraction starts over at the decode span and its messages say
``retry 2/3``. Fractions are therefore non-decreasing except at a retry.

Events are bounded: one per vision block, one per prefill layer, one per whole percent of the
decode budget (so every tenth of it, and each token when the budget is under 100). ETA and elapsed
time are the consumers' (the CLI bar, the worker's events), from these fractions.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..errors import CancelledError
from ..progress import cancel_checker

# (step, start, end) within the ground stage
SPANS = {"prompt": (0.0, 0.02), "vision": (0.02, 0.25), "prefill": (0.25, 0.55), "decode": (0.55, 1.0)}


class GroundingProgress:
    """Reports one :meth:`~medvolcore.grounder.QwenVLGrounder.ground` / ``ground_samples`` call.

    ``progress(stage, fraction, message)`` as the pipeline's (None: report nothing); ``cancel``
    as :func:`cancel_checker` takes it: checked at every observed step (each prefill layer, each
    decoding step), raising :class:`~medvolcore.errors.CancelledError`. ``consensus``: the call
    draws samples after the greedy answer (the decode span is halved). ``steps`` counts the
    decoding steps seen (all attempts)."""

    def __init__(self, progress=None, cancel=None, *, consensus: bool = False):
        self.progress = progress
        self.cancelled = cancel_checker(cancel)
        self.consensus = bool(consensus)
        self.steps = 0
        self.part = "greedy"  # or "samples"
        self.attempt, self.attempts = 1, 1
        self.sample_rows = 0
        self._last = None  # (phase, unit) of the last event: one event per unit (block, layer, percent)
        self._decoding = False

    # -- bookkeeping ---------------------------------------------------------------------------
    def _span(self, phase: str):
        lo, hi = SPANS[phase]
        if phase == "decode" and self.consensus:
            mid = (lo + hi) / 2
            return (lo, mid) if self.part == "greedy" else (mid, hi)
        return lo, hi

    def _prefix(self) -> str:
        if self.part == "samples":
            return f"samples 2–{self.sample_rows + 1}: " if self.sample_rows > 1 else "sample 2: "
        if self.attempt > 1:
            return f"retry {self.attempt}/{self.attempts}: "
        return ""

    def _emit(self, phase: str, within: float, message: str, unit=None) -> None:
        key = (self.part, self.attempt, phase, unit)
        if unit is not None and key == self._last:
            return
        self._last = key
        if self.progress is not None:
            lo, hi = self._span(phase)
            self.progress("ground", lo + (hi - lo) * min(max(float(within), 0.0), 1.0), self._prefix() + message)

    def check(self, during: str) -> None:
        if self.cancelled():
            raise CancelledError(f"grounding cancelled during {during}")

    # -- what the grounder calls ----------------------------------------------------------------
    def prompt_ready(self, slices: int, tokens: int) -> None:
        self.check("the prompt")
        self._emit("prompt", 1.0, f"{slices} slices rendered; prompt of {tokens} tokens")

    def attempt_started(self, attempt: int, attempts: int) -> None:
        """A new ``generate`` call of the greedy answer (``attempt`` 1-based of at most ``attempts``)."""
        self.part, self.attempt, self.attempts, self._decoding = "greedy", attempt, attempts, False
        self.check("the decoding")

    def samples_started(self, rows: int) -> None:
        self.part, self.attempt, self.sample_rows, self._decoding = "samples", 1, rows, False
        self.check("the decoding")

    def vision_block(self, done: int, total: int, slices: int) -> None:
        self.check("the encoding of the slices")
        self._emit("vision", done / max(total, 1), f"encoding the {slices} slices: vision layer {done}/{total}",
                   unit=done)

    def prefill_layer(self, done: int, total: int, tokens: int) -> None:
        if self._decoding:  # the same layers run at every decoding step: not the prefill
            return
        self.check("the prefill")
        self._emit("prefill", done / max(total, 1), f"reading the prompt ({tokens} tokens): layer {done}/{total}",
                   unit=done)

    def prefill_whole(self, tokens: int) -> None:
        """The prefill as one step, when its layers cannot be observed (another architecture)."""
        self.check("the prefill")
        self._emit("vision", 0.0, f"encoding the slices and reading the prompt ({tokens} tokens)")

    def decode_step(self, done: int, budget: int) -> None:
        """Called at each decoding step, before token ``done + 1`` is chosen."""
        self._decoding = True
        self.steps += 1
        self.check(f"the decoding ({done} of {budget} tokens)")
        self._emit("decode", done / max(budget, 1), f"decoding {done}/{budget} tokens",
                   unit=(100 * done) // max(budget, 1))

    def decode_done(self, tokens: int, budget: int, stopped: bool) -> None:
        end = "answer complete" if stopped else "token budget reached"
        self._emit("decode", 1.0, f"{end}: {tokens} of at most {budget} tokens")


def _blocks(model, *names):
    """The first ``model(.model).<name>`` path that exists, e.g. ``visual.blocks``; None when none does."""
    for root in (getattr(model, "model", None), model):
        for name in names:
            obj = root
            for part in name.split("."):
                obj = getattr(obj, part, None) if obj is not None else None
            if obj is not None and hasattr(obj, "__len__") and len(obj):
                return obj
    return None


class watch_prefill:
    """Forward hooks on the vision encoder's blocks and the language model's layers of ``model``
    (Qwen3-VL: ``model.visual.blocks``, ``model.language_model.layers``) reporting to ``reporter``
    while ``generate`` runs its first forward pass; removed on exit. Without those modules the
    prefill is reported as one step. ``slices``/``tokens`` name the prompt in the messages."""

    def __init__(self, model, reporter: Optional[GroundingProgress], slices: int, tokens: int, vision: bool = True):
        self.model, self.reporter, self.slices, self.tokens, self.vision = model, reporter, slices, tokens, vision
        self.handles = []

    def __enter__(self):
        r = self.reporter
        if r is None:
            return self
        blocks = _blocks(self.model, "visual.blocks") if self.vision else None
        layers = _blocks(self.model, "language_model.layers", "language_model.model.layers")
        if layers is None or (self.vision and blocks is None):
            r.prefill_whole(self.tokens)
            return self
        if blocks is not None:
            for i, b in enumerate(blocks):
                self.handles.append(b.register_forward_hook(
                    lambda *_a, _i=i, _n=len(blocks): r.vision_block(_i + 1, _n, self.slices)))
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_hook(
                lambda *_a, _i=i, _n=len(layers): r.prefill_layer(_i + 1, _n, self.tokens)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        return False
