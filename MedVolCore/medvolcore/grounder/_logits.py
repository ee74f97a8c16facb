"""Logits processors of the grounder's decoding (imported only when text is generated).

:class:`StepProcessor` is a transformers ``LogitsProcessor`` defined at module level (this module
imports transformers, so :mod:`medvolcore.grounder.decode` imports it only inside the function that
generates). It times the first call — the end of the prefill — and applies an optional
:class:`GrammarGuide`: xgrammar matchers per row, the token bitmask, and the budget guard that
forces ``</think>`` when only the answer's worst case is left (see :func:`~medvolcore.grounder.prompt.plan_budget`).
It also records, per row and step, the log-probability of the token that was chosen under the
scores it returns (the grammar's mask applied, before any temperature or top-k/top-p) and how
many tokens those scores allowed: the grounder's answer signal (:func:`answer_signal`), taken
from the scores the decoder computes anyway — no second forward pass.
"""

from __future__ import annotations

import math
import time

from transformers import LogitsProcessor

from ..errors import GenerationError
from .prompt import THINK_CLOSE


class StepProcessor(LogitsProcessor):
    """Times the first call (``first_call``, a ``perf_counter`` value), applies an optional guide and
    records each chosen token's log-probability (see :meth:`token_logprobs`). ``on_step(done)``,
    when given, is called at each step with the number of tokens generated so far (progress and
    cancel: it may raise to stop ``generate``)."""

    def __init__(self, guide=None, on_step=None):
        self.guide = guide
        self.on_step = on_step
        self.first_call = None
        self._last = None  # log-softmax of the previous step's returned scores, (batch, vocab)
        self._logprobs: list = []  # per step: (batch,) log p of the token then chosen
        self._allowed: list = []  # per step: (batch,) how many tokens the returned scores allowed

    def __call__(self, input_ids, scores):
        import torch

        if self.first_call is None:
            if scores.is_cuda:  # the prefill is asynchronous on a GPU: wait for it
                torch.cuda.synchronize(scores.device)
            self.first_call = time.perf_counter()
        else:  # the previous step's token is the last input id now
            self._logprobs.append(self._last.gather(1, input_ids[:, -1:].to(self._last.device))[:, 0])
        if self.on_step is not None:
            self.on_step(len(self._allowed))
        out = scores if self.guide is None else self.guide(input_ids, scores)
        self._last = torch.log_softmax(out.float(), dim=-1)
        self._allowed.append(torch.isfinite(out).sum(dim=-1))
        return out

    def token_logprobs(self, new_tokens):
        """``(logprobs, allowed)``: per row, a list per generated token of the log-probability it had
        under the returned scores and how many tokens those scores allowed (1: the grammar forced
        it). ``new_tokens``: (batch, steps) the generated ids, as ``generate`` returned them."""
        import torch

        steps = len(self._allowed)
        if steps == 0:
            return [[] for _ in range(new_tokens.shape[0])], [[] for _ in range(new_tokens.shape[0])]
        last = self._last.gather(1, new_tokens[:, steps - 1:steps].to(self._last.device))[:, 0]
        lp = torch.stack(self._logprobs + [last], dim=1).cpu().tolist()
        allowed = torch.stack(self._allowed, dim=1).cpu().tolist()
        return lp, allowed


class GrammarGuide:
    """Per-generate grammar state: xgrammar matchers per row, token bitmask, and the budget guard."""

    def __init__(self, xgr, torch, compiled, batch_size: int, vocab_bytes, close_ids: dict, max_new_tokens: int,
                 force_close_at: int):
        self.xgr, self.torch = xgr, torch
        self.matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch_size)]
        self.bitmask = xgr.allocate_token_bitmask(batch_size, compiled.tokenizer_info.vocab_size)
        self.vocab_bytes = vocab_bytes
        self.close_ids = close_ids
        self.max_new_tokens = max_new_tokens
        self.force_close_at = force_close_at
        self.text = [bytearray() for _ in range(batch_size)]
        self.closed = [False] * batch_size
        self.step = 0
        self.forced = 0

    def _close_rest(self, i: int) -> bytes:
        close, buf = THINK_CLOSE.encode(), self.text[i]
        for k in range(len(close) - 1, 0, -1):
            if buf.endswith(close[:k]):
                return close[k:]
        return close

    def __call__(self, input_ids, scores):
        torch = self.torch
        if self.step > 0:
            for i, m in enumerate(self.matchers):
                if m.is_terminated():
                    continue
                tok = int(input_ids[i, -1])
                if not m.accept_token(tok):
                    raise GenerationError(f"internal error: the grammar rejected token {tok} that it allowed")
                if not self.closed[i]:
                    self.text[i] += self.vocab_bytes[tok] if tok < len(self.vocab_bytes) else b""
                    self.closed[i] = THINK_CLOSE.encode() in self.text[i]
        remaining = self.max_new_tokens - self.step
        self.step += 1
        for i, m in enumerate(self.matchers):
            if m.is_terminated():
                self.bitmask[i].fill_(-1)  # finished row: generate pads it anyway
            else:
                m.fill_next_token_bitmask(self.bitmask, i)
        device = scores.device
        work = scores if device.type in ("cpu", "cuda") else scores.to("cpu")
        self.xgr.apply_token_bitmask_inplace(work, self.bitmask.to(work.device))
        if remaining <= self.force_close_at:
            for i, m in enumerate(self.matchers):
                if self.closed[i] or m.is_terminated():
                    continue
                allowed = self.close_ids.get(self._close_rest(i))
                if allowed is None or allowed.numel() == 0:
                    continue
                allowed = allowed.to(work.device)
                keep = work[i, allowed]
                if torch.isfinite(keep).any():  # else: mid-character; the slack covers a few steps
                    row = torch.full_like(work[i], -math.inf)
                    row[allowed] = keep
                    work[i] = row
                    self.forced += 1
        return work if work is scores else work.to(device)
