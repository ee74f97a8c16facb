"""The grounder's decoding: ``generate`` (constrained by default), the prompt's cache shared by
retries, consensus samples and several queries, and the answer signal.

:class:`DecodingMixin` is the part of :class:`~medvolcore.grounder.QwenVLGrounder` that runs the
model; it uses the grounder's ``model``, ``tokenizer``, ``settings``, ``prompts``, ``device``,
``dtype``, ``_ids``, its caches ``_xgr_state`` and ``_compiled``, ``_reporter`` (a
:class:`~medvolcore.grounder.progress.GroundingProgress`, or None), while
:meth:`~medvolcore.grounder.QwenVLGrounder._ground` sets them ``_keep_prefix`` and ``_prefix_in``,
and, to share a prompt, the input building of :class:`~medvolcore.grounder.inputs.InputsMixin`.
``_generate_text`` and ``_generate_samples`` are the seams tests replace with canned texts.

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
top-k or top-p) and how many tokens those scores allowed. :meth:`DecodingMixin._answer_signal`
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

Importing this module does not import torch, transformers or xgrammar (:mod:`._logits`, which
imports transformers, is imported only inside the function that generates).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..errors import InputError
from ._common import require_torch, require_transformers, require_xgrammar
from .prompt import THINK_CLOSE, answer_grammar, plan_budget

__all__ = ["DecodingMixin"]


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


class DecodingMixin:
    """Running the model of :class:`~medvolcore.grounder.QwenVLGrounder` (see the module docstring)."""

    def _xgr(self):
        """TokenizerInfo, GrammarCompiler, token bytes and the ``</think>`` prefix sets (cached)."""
        if self._xgr_state is None:
            xgr, torch = require_xgrammar(), require_torch()
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

    def _generation_config(self, do_sample: bool, max_new_tokens: int, sampling: Optional[dict] = None):
        """Greedy, or sampled with ``sampling`` (``temperature``, ``top_p``, ``top_k``; default the
        preset's own, those of ``--sample``)."""
        _, GenerationConfig, _, _ = require_transformers()
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
        torch = require_torch()
        require_transformers()  # one clear DependencyError when transformers is missing
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
        torch = require_torch()
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

    def _share_prompt(self, stack, queries: Sequence[str], window) -> Optional["_SharedPrompt"]:
        """The prompt's part shared by ``queries`` (through the last slice's ``<|vision_end|>``), its
        slices rendered and encoded and its tokens prefilled in one forward pass; None when the
        queries' prompts differ before the last slice (a template with the query first)."""
        torch = require_torch()
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
