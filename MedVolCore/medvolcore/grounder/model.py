"""The grounder: Qwen3-VL looks at 64 axial slices and answers with an evidence anchor.

Public API
----------
``QwenVLGrounder.from_pretrained(model_dir, adapter=None, device="cpu", dtype=None, settings=None)``
    loads a Qwen3-VL checkpoint folder (tokenizer, the PIL image processor, the model; fp32 on
    CPU, bfloat16 on CUDA) and optionally a PEFT LoRA adapter.
``grounder.build_inputs(stack, query, window=None) -> (inputs, shown_slices)``
    the model inputs for one request (see "Image tokens" in :mod:`.inputs`).
``grounder.build_batch_inputs([(stack, query), ...], window=None) -> (inputs, [shown_slices, ...])``
    the same for several requests, left-padded.
``grounder.inputs_from_images(images, shown, depth, query, window=None) -> inputs``
    the same prompt from slices rendered beforehand (training data stores them).
``grounder.ground(stack, query, *, constrain=True, do_sample=False, seed=None, max_new_tokens=None,
retries=2, window=None) -> GroundingResult``
    one answer as an :class:`~medvolcore.anchor.EvidenceAnchor` (source ``"grounder"``).
``grounder.ground_samples(stack, query, G, *, seed=None, ...) -> SampledGrounding``
    G answers for a consensus: the greedy one (exactly ``ground``'s), then G − 1 sampled ones,
    all from one encoding of the slices (see "Several answers from one prefill" in :mod:`.decode`).
``grounder.ground_queries(stack, [query, ...], samples=1, ...) -> [SampledGrounding, ...]``
    several queries on one volume: the slices' part of the prompt (everything before the query)
    rendered, encoded and prefilled once, each query continuing from that cache.
:mod:`medvolcore.grounder.prompt` (:func:`answer_grammar`, :func:`plan_budget`, :func:`validate_query`, …)
    the pure pieces, for training code and tests.

Where each part lives
---------------------
Building is apart from predicting, as sam2's ``build_sam.py`` is apart from its predictor:
:mod:`.build` loads the checkpoint, the LoRA adapter, the dtype and the device
(:meth:`QwenVLGrounder.from_pretrained` imports it only when it runs). Predicting is
:class:`QwenVLGrounder`, composed here of :class:`~.inputs.InputsMixin` (rendering, the prompt, the
image tokens: :mod:`.inputs`) and :class:`~.decode.DecodingMixin` (``generate``, the grammar, the
prompt's cache, the answer signal: :mod:`.decode`); answers become anchors in :mod:`.answers`. This
module holds the requests: checks, attempts and retries, consensus samples, several queries, progress.

Unusable answers
----------------
Unconstrained decoding (``constrain=False``) parses with :func:`~medvolcore.answer.parse_answer`;
an answer that does not parse, names a slice that was not shown, or has no usable box is
retried with sampling (seed ``seed + attempt``) up to ``retries`` times, then a
:class:`~medvolcore.errors.GenerationError` carries the raw text. In both modes boxes with
swapped corners are reordered and boxes of zero width or height dropped, each with a note
(:func:`~medvolcore.grounder.answers.clean_boxes`).

Importing this module does not import torch or transformers.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from ..errors import AnchorError, AnswerFormatError, GenerationError, InputError
from ..progress import part_of
from ._common import one_line
from .answers import (MAX_SAMPLES, GroundingResult, GroundingSample, SampledGrounding, _Unusable, anchor_from_text,
                      check_samples, clean_boxes)
from .decode import DecodingMixin, _SharedPrompt
from .inputs import InputsMixin
from .prompt import load_prompts, plan_budget, resolve_settings, validate_query

log = logging.getLogger("medvolcore.grounder")

__all__ = ["QwenVLGrounder", "GroundingResult", "GroundingSample", "SampledGrounding", "MAX_SAMPLES", "check_samples",
           "clean_boxes"]


class QwenVLGrounder(InputsMixin, DecodingMixin):
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

    @classmethod
    def from_pretrained(cls, model_dir, adapter=None, device="cpu", dtype=None, settings=None) -> "QwenVLGrounder":
        """Load a Qwen3-VL checkpoint folder, optionally with a PEFT LoRA adapter folder
        (:func:`medvolcore.grounder.build.load_grounder_parts`).

        ``dtype`` None or ``"auto"``: bfloat16 on CUDA and on a CPU with bf16 arithmetic in hardware,
        fp32 on other CPUs (:func:`medvolcore.cpu.grounder_dtype`) and for a smoke model on any CPU. ``settings`` is a preset
        name of grounder.json or a dict of overrides (it may name a ``preset``).
        """
        from .build import load_grounder_parts

        p = load_grounder_parts(model_dir, adapter=adapter, device=device, dtype=dtype)
        return cls(p.model, p.tokenizer, p.image_processor, settings=settings, model_dir=p.model_dir,
                   adapter_dir=p.adapter_dir, meta=p.meta, notes=p.notes, peft_model=p.peft_model)

    @property
    def is_smoke(self) -> bool:
        return bool(self.meta.get("smoke"))

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype

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
                anchor, parsed = anchor_from_text(text, shown, stack, query, notes)
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
            f"«{one_line(last_text)}»" + (" — this is the untrained smoke model" if self.is_smoke else ""))
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
                    anchor, parsed = anchor_from_text(text, shown, stack, query)
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

    def __repr__(self) -> str:
        extra = f", adapter={self.adapter_dir}" if self.adapter_dir else ""
        return f"QwenVLGrounder({self.model_dir}{extra}, smoke={self.is_smoke}, preset={self.settings['preset']})"
