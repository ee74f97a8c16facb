"""The four MedVol-R1 rewards as the paper defines them, as plain functions, and our rule for "not present" (below).

* :func:`format_reward` — 1 when the completion has a ``<think>…</think>`` block and an
  ``<answer>…</answer>`` block whose content parses to the answer schema (one key slice and a
  list of boxes; :func:`medvolcore.answer.parse_answer`), else 0.
* :func:`axial_reward` — ``areas[k̂] / max(areas)`` with ``areas`` the ground-truth foreground
  area of every slice of the stack; 0 for a slice outside the stack or an all-empty target.
* :func:`box_reward` — Hungarian matching (``scipy.optimize.linear_sum_assignment``) of the
  predicted and ground-truth boxes (0–1000 coordinates) on cost ``1 − IoU``; the sum of the
  matched IoUs divided by ``max(N, N*)``; 0 when exactly one list is empty, 1 when both are.
  The ground-truth boxes are those of the *predicted* key slice.
* :func:`consistency_reward` — Dice between MedSAM2's propagation of the matched predicted
  boxes and the ground truth, over the slices ``[k̂ − Δ, k̂ + Δ]`` clipped to the stack; 1 when
  both are empty there. :class:`ConsistencyScorer` runs the (frozen) MedSAM2 on the window only
  and shares image features between the rollouts of one group (one volume), so a group of G
  encodes each window slice once instead of G times. Early stop (``stop_after_empty = K > 0``,
  off by default) keeps the paper's window semantics: the Dice is still taken over the whole
  window ``[k̂ − Δ, k̂ + Δ]``, and the window slices a direction skipped after its masks had been
  empty on K slices count as predicted empty (exactly what the full run gives there unless the
  target reappears after K empty slices). The default 0 is the paper's reward: with Δ = 5 the
  window is 11 slices, so early stop can save little here, and the reward is what GRPO learns from.

"Matched predicted boxes": the predicted boxes that the Hungarian assignment pairs with a
ground-truth box of the predicted slice (all of them when ``N ≤ N*``; the ``N − N*`` left over
otherwise). A prediction on a slice without ground truth has no matched box and an empty
propagation.

A completion whose answer does not parse gets 0 from every term (that is the format reward's job
to teach); a reward that *cannot be computed* (a missing mask file, a MedSAM2 failure) raises
:class:`RewardError` and is never turned into 0 silently.

"Not present" (our extension; the paper has no absent answers or targets)
--------------------------------------------------------------------------
The **absent answer** is ``<answer>[]</answer>`` (no slice, no boxes); an **absent target** is one
whose ground truth is empty — every slice area 0 (axial), no ground-truth box on any shown slice
(box), an all-zero mask (consistency): ``prepare``'s negative samples, and never a positive (a
target without foreground on a shown slice is not prepared). Each term beside the paper's:

====================  =======================================  ==========================================
term                  the paper (answer and target present)    absent answer and/or absent target
====================  =======================================  ==========================================
format                1 if it parses to one slice and boxes    1 if it parses; ``[]`` parses (as usual)
axial                 ``areas[k̂] / max(areas)``                1 both absent; 0 exactly one absent
box                   Hungarian Σ IoU / max(N, N*) on k̂        1 both absent; 0 exactly one absent
consistency           Dice over ``[k̂ − Δ, k̂ + Δ]``             1 both absent; 0 exactly one absent
====================  =======================================  ==========================================

:func:`presence_agreement` is that rule. "Exactly one absent" is a box answer on a negative sample
(a false positive: the paper's box and consistency rules would give it 1 for "both empty on that
slice / in that window") or ``[]`` on a positive (a false negative). Nothing is propagated for an
absent answer, nor for any answer on an absent target (its score is known without MedSAM2).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from medvolcore.anchor import box_iou, norm_to_box
from medvolcore.answer import parse_answer
from medvolcore.errors import AnswerFormatError, MedVolError
from medvolcore.metrics import dice

DEFAULT_DELTA = 5


class RewardError(MedVolError):
    """A reward could not be computed (not a bad completion: the ground truth or the model failed)."""

    code = "reward_failed"


def parsed(completion: str):
    """The parsed answer of a completion, or None when it does not follow the format."""
    try:
        return parse_answer(completion)
    except AnswerFormatError:
        return None


def format_reward(completion: str) -> float:
    """1.0 when ``completion`` is a ``<think>…</think>`` block then an ``<answer>…</answer>`` block
    that parses to the answer schema (the absent answer ``[]`` included), else 0.0.

    >>> format_reward('<think>liver here</think><answer>[{"slice": 12, "bbox_2d_list": [[10, 20, 300, 400]]}]</answer>')
    1.0
    >>> format_reward('<answer>[{"slice": 12, "bbox_2d_list": [[10, 20, 300, 400]]}]</answer>')  # no <think>
    0.0
    """
    return 1.0 if isinstance(completion, str) and parsed(completion) is not None else 0.0


def presence_agreement(answer_absent: bool, target_absent: bool) -> Optional[float]:
    """The axial, box and consistency terms when the answer or the target is absent: 1.0 when both
    are, 0.0 when exactly one is; None when neither is (the paper's definition applies)."""
    if not answer_absent and not target_absent:
        return None
    return 1.0 if (answer_absent and target_absent) else 0.0


def axial_reward(pred_slice: Optional[int], areas: Sequence[float]) -> float:
    """``areas[k̂] / max(areas)``; ``pred_slice`` None is the absent answer, an all-zero ``areas`` the
    absent target (:func:`presence_agreement`)."""
    a = np.asarray(areas, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise RewardError(f"areas must be a non-empty list of per-slice foreground areas, got shape {a.shape}")
    top = float(a.max())
    both = presence_agreement(pred_slice is None, top <= 0)
    if both is not None:
        return both
    if isinstance(pred_slice, bool) or not isinstance(pred_slice, (int, np.integer)):
        return 0.0
    if not 0 <= int(pred_slice) < a.size:
        return 0.0
    return float(a[int(pred_slice)] / top)


def _boxes(boxes) -> np.ndarray:
    b = np.asarray(boxes if boxes is not None else [], dtype=np.float64)
    if b.size == 0:
        return np.zeros((0, 4))
    if b.ndim != 2 or b.shape[1] != 4:
        raise RewardError(f"boxes must be a list of [x0, y0, x1, y1], got shape {b.shape}")
    # corners given in the wrong order count as the box they span (as the pipeline reads them)
    return np.concatenate([np.minimum(b[:, :2], b[:, 2:]), np.maximum(b[:, :2], b[:, 2:])], axis=1)


def match_boxes(pred_boxes, gt_boxes) -> List[Tuple[int, int, float]]:
    """Hungarian matching on cost ``1 − IoU``: ``(pred index, gt index, IoU)`` per matched pair."""
    from scipy.optimize import linear_sum_assignment

    p, g = _boxes(pred_boxes), _boxes(gt_boxes)
    if len(p) == 0 or len(g) == 0:
        return []
    iou = np.array([[box_iou(a, b) for b in g] for a in p])
    rows, cols = linear_sum_assignment(1.0 - iou)
    return [(int(r), int(c), float(iou[r, c])) for r, c in zip(rows, cols)]


def box_reward(pred_boxes, gt_boxes) -> float:
    p, g = _boxes(pred_boxes), _boxes(gt_boxes)
    if len(p) == 0 and len(g) == 0:
        return 1.0
    if len(p) == 0 or len(g) == 0:
        return 0.0
    return float(sum(iou for _, _, iou in match_boxes(p, g)) / max(len(p), len(g)))


def answer_box_reward(answer, gt_boxes_by_slice: dict) -> float:
    """The box term of a parsed answer: :func:`box_reward` against the ground-truth boxes of the
    answer's slice, or :func:`presence_agreement` when the answer is ``[]`` or the target has no
    ground-truth box on any shown slice (``gt_boxes_by_slice``: ``{"z": [[…]]}``)."""
    target_absent = not any(gt_boxes_by_slice.values())
    both = presence_agreement(bool(answer.absent), target_absent)
    if both is not None:
        return both
    return box_reward(answer.boxes_norm, gt_boxes_by_slice.get(str(int(answer.slice)), []))


def window_range(key_slice: int, depth: int, delta: int = DEFAULT_DELTA) -> Tuple[int, int]:
    """Inclusive ``[k̂ − Δ, k̂ + Δ]`` clipped to ``0..depth−1``."""
    return max(0, int(key_slice) - int(delta)), min(int(depth) - 1, int(key_slice) + int(delta))


def consistency_reward(pred_mask: np.ndarray, gt_mask: np.ndarray, key_slice: Optional[int] = None,
                       delta: int = DEFAULT_DELTA) -> float:
    """Dice of two ``(D, H, W)`` stack masks over ``[k̂ − Δ, k̂ + Δ]`` (the whole stack when
    ``key_slice`` is None); 1.0 when both are empty there."""
    p, g = np.asarray(pred_mask), np.asarray(gt_mask)
    if p.shape != g.shape or p.ndim != 3:
        raise RewardError(f"masks must be two (D, H, W) arrays of one shape, got {p.shape} and {g.shape}")
    if key_slice is None:
        return dice(p, g)
    if not 0 <= int(key_slice) < p.shape[0]:
        return 0.0 if g.any() else 1.0
    lo, hi = window_range(key_slice, p.shape[0], delta)
    return dice(p[lo:hi + 1], g[lo:hi + 1])


class ConsistencyScorer:
    """The consistency reward of a whole group: MedSAM2 (frozen) on the window of each rollout,
    with image features shared across the group.

    ``propagator``: a :class:`medvolcore.propagation.MedSAM2Propagator` (a checkpoint, or seeded
    random weights in tests and the CPU benchmark). ``stop_after_empty``: early stop's K inside
    the window (0, the default: every window slice; see the module docstring).
    """

    def __init__(self, propagator, delta: int = DEFAULT_DELTA, hu_window=None, stop_after_empty: int = 0):
        if isinstance(delta, bool) or not isinstance(delta, (int, np.integer)) or delta < 0:
            raise RewardError(f"delta must be an integer ≥ 0, got {delta!r}")
        if isinstance(stop_after_empty, bool) or not isinstance(stop_after_empty, (int, np.integer)) or stop_after_empty < 0:
            raise RewardError(f"stop_after_empty must be an integer ≥ 0, got {stop_after_empty!r}")
        self.propagator = propagator
        self.delta = int(delta)
        self.stop_after_empty = int(stop_after_empty)
        self.hu_window = hu_window
        self.last_encoder_calls = 0

    def prompts(self, answers, gt_boxes_by_slice: dict, image_size: Sequence[int]) -> List[Optional[Tuple[int, list]]]:
        """Per answer: ``(k̂, matched pixel boxes)``, or None when there is nothing to propagate
        (unparsed answer, slice without ground truth)."""
        w, h = int(image_size[0]), int(image_size[1])
        out = []
        for ans in answers:
            if ans is None or ans.absent:
                out.append(None)
                continue
            gt = gt_boxes_by_slice.get(str(int(ans.slice))) or []
            pairs = match_boxes(ans.boxes_norm, gt)
            ordered = _boxes(ans.boxes_norm)
            boxes = []
            for i, _, _ in pairs:
                try:
                    boxes.append(norm_to_box([float(v) for v in ordered[i]], w, h))
                except MedVolError:
                    continue  # a degenerate box draws nothing
            out.append((int(ans.slice), boxes) if boxes else None)
        return out

    def score_group(self, stack_hu: np.ndarray, gt_mask: np.ndarray, answers, gt_boxes_by_slice: dict,
                    hu_window=None) -> List[float]:
        """Consistency rewards of ``answers`` (parsed answers or None) on one volume.

        ``gt_boxes_by_slice``: normalised ground-truth boxes per stack slice (``{"z": [[…]]}``,
        as ``prepare`` stores them). ``stack_hu`` and ``gt_mask`` are ``(D, H, W)`` on the stack.
        An absent answer, or any answer when the mask is all zero (an absent target), scores
        :func:`presence_agreement` and is not propagated.
        """
        gt = np.asarray(gt_mask, dtype=bool)
        if np.shape(stack_hu) != gt.shape:
            raise RewardError(f"the CT stack {np.shape(stack_hu)} and the mask {gt.shape} differ in shape")
        depth, height, width = gt.shape
        target_absent = not gt.any()
        prompts = [None] * len(answers) if target_absent else self.prompts(answers, gt_boxes_by_slice, (width, height))
        todo = [(i, p) for i, p in enumerate(prompts) if p is not None and 0 <= p[0] < depth]
        try:
            win = hu_window if hu_window is not None else self.hu_window
            results = self.propagator.propagate_many(stack_hu, [p for _, p in todo], hu_window=win,
                                                     window=self.delta, stop_after_empty=self.stop_after_empty
                                                     ) if todo else []
        except MedVolError as e:
            raise RewardError(f"MedSAM2 failed on the consistency window: {e}") from None
        self.last_encoder_calls = sum(r.encoder_calls for r in results)
        masks = {i: r.mask for (i, _), r in zip(todo, results)}
        scores = []
        for i, ans in enumerate(answers):
            if ans is None:
                scores.append(0.0)
                continue
            both = presence_agreement(bool(ans.absent), target_absent)
            if both is not None:
                scores.append(both)
                continue
            k = int(ans.slice)
            pred = masks.get(i)
            if pred is None:
                pred = np.zeros_like(gt)
            scores.append(consistency_reward(pred, gt, k, self.delta))
        return scores


# ---- the terms as TRL reward functions -------------------------------------------------------

TERMS = ("format", "axial", "box", "consistency")


class RewardFunctions:
    """The four terms as TRL ``GRPOTrainer`` reward functions, one per term, so TRL logs each
    (``rewards/<term>/mean`` and ``/std``; the format term's mean is the fraction of well-formed
    answers) and each can be switched off (weight 0) for ablations.

    Each is called as ``f(prompts, completions, completion_ids=…, **columns)`` and returns one
    float per completion. Columns read: ``slice_areas`` (axial), ``gt_boxes_norm`` (box; JSON text
    or a dict ``{"z": [[…]]}``), ``sample_id`` (consistency: the sample's mask and CT, looked up in
    ``samples``). Completion text is decoded from ``completion_ids`` with ``tokenizer`` when given,
    keeping ``<think>``/``<answer>`` even where a tokenizer marks them special, and cut at the
    end-of-turn token. A reward that cannot be computed is logged, counted in ``failures`` and
    returned as None (TRL ignores it in the group statistics) — never as 0.

    TRL calls the terms one after another with the same completions in a step; each completion
    is decoded and parsed once for all of them (:meth:`answers`).

    >>> f = RewardFunctions()
    >>> f.format(prompts=["ct/1"] * 2, completions=["<think>not seen</think><answer>[]</answer>", "no answer"])
    [1.0, 0.0]
    """

    def __init__(self, tokenizer=None, scorer: Optional[ConsistencyScorer] = None, samples: Optional[dict] = None,
                 stop_tokens: Sequence[str] = ("<|im_end|>", "<|endoftext|>")):
        import collections

        self.tokenizer = tokenizer
        self.scorer = scorer
        self.samples = samples or {}
        self.stop_tokens = tuple(stop_tokens)
        self.failures = collections.Counter()
        self._stacks = collections.OrderedDict()
        self._step = (None, [])  # (the completions' key, their answers): the step being scored

    # -- plumbing --
    def texts(self, completions, completion_ids=None) -> List[str]:
        if completion_ids is not None and self.tokenizer is not None:
            out = []
            for ids in completion_ids:
                text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
                cut = min([i for i in (text.find(t) for t in self.stop_tokens) if i >= 0], default=len(text))
                out.append(text[:cut])
            return out
        return [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]

    def answers(self, completions, completion_ids=None) -> list:
        """Each completion's parsed answer (None where it does not follow the format), decoded and
        parsed once per step: the terms of one step share them. They are kept for the completions
        last seen, keyed by those completions themselves (their token ids, or their texts), so
        another step or an evaluation batch is decoded and parsed anew, never served stale answers."""
        if completion_ids is not None and self.tokenizer is not None:
            texts, key = None, ("ids", tuple(tuple(int(i) for i in ids) for ids in completion_ids))
        else:
            texts = self.texts(completions)
            key = ("text", tuple(texts))
        if key != self._step[0]:
            if texts is None:
                texts = self.texts(completions, completion_ids)
            by_text: dict = {}
            for t in texts:
                if t not in by_text:
                    by_text[t] = parsed(t)
            self._step = (key, [by_text[t] for t in texts])
        return self._step[1]

    def _guard(self, term: str, n: int, fn, log_metric=None) -> list:
        import logging

        try:
            out = fn()
        except (RewardError, MedVolError, OSError, ValueError, KeyError) as e:
            self.failures[term] += n
            logging.getLogger(__name__).error("the %s reward could not be computed for %d completion(s): %s", term, n, e)
            out = [None] * n
        if log_metric is not None:
            log_metric(f"reward_failures/{term}", float(self.failures[term]))
        return out

    @staticmethod
    def _boxes_by_slice(value) -> dict:
        import json

        return json.loads(value) if isinstance(value, str) else dict(value or {})

    # -- the four terms --
    def format(self, prompts, completions, completion_ids=None, log_metric=None, **kw) -> list:
        answers = self.answers(completions, completion_ids)
        # format_reward of each text, read from the step's one parse
        return self._guard("format", len(answers), lambda: [0.0 if a is None else 1.0 for a in answers], log_metric)

    def axial(self, prompts, completions, completion_ids=None, slice_areas=None, log_metric=None, **kw) -> list:
        answers = self.answers(completions, completion_ids)

        def run():
            return [0.0 if a is None else axial_reward(a.slice, areas) for a, areas in zip(answers, slice_areas)]

        return self._guard("axial", len(answers), run, log_metric)

    def box(self, prompts, completions, completion_ids=None, gt_boxes_norm=None, log_metric=None, **kw) -> list:
        answers = self.answers(completions, completion_ids)

        def run():
            return [0.0 if a is None else answer_box_reward(a, self._boxes_by_slice(gt))
                    for a, gt in zip(answers, gt_boxes_norm)]

        return self._guard("box", len(answers), run, log_metric)

    def _stack(self, sample: dict):
        from .prepare import load_stack

        key = sample["id"]
        if key not in self._stacks:
            stack, window = load_stack(sample)
            self._stacks[key] = (np.ascontiguousarray(stack.data, dtype=np.float32), window)
            while len(self._stacks) > 2:
                self._stacks.popitem(last=False)
        return self._stacks[key]

    def consistency(self, prompts, completions, completion_ids=None, sample_id=None, log_metric=None, **kw) -> list:
        from .prepare import load_mask

        answers = self.answers(completions, completion_ids)
        if self.scorer is None:
            raise RewardError("the consistency reward needs MedSAM2: give a checkpoint or random weights")
        scores: List[Optional[float]] = [None] * len(answers)
        groups = {}
        for i, sid in enumerate(sample_id):
            groups.setdefault(sid, []).append(i)
        for sid, rows in groups.items():
            def run(sid=sid, rows=rows):
                sample = self.samples.get(sid)
                if sample is None:
                    raise RewardError(f"no prepared sample {sid!r}")
                hu, window = self._stack(sample)
                return self.scorer.score_group(hu, load_mask(sample), [answers[i] for i in rows],
                                               self._boxes_by_slice(sample.get("gt_boxes_norm")), hu_window=window)

            for i, v in zip(rows, self._guard("consistency", len(rows), run, log_metric)):
                scores[i] = v
        return scores

    def functions(self, weights: dict) -> Tuple[list, List[float]]:
        """The reward functions with a weight > 0 and their weights, in :data:`TERMS` order."""
        funcs, ws = [], []
        for term in TERMS:
            w = float(weights.get(term, 0.0))
            if w > 0:
                funcs.append(getattr(self, term))
                ws.append(w)
        return funcs, ws
