"""The four MedVol-R1 rewards against values computed by hand, and the group consistency scorer
with random-weight MedSAM2 (encoder calls counted)."""

from __future__ import annotations

import numpy as np
import pytest

from medvolcore.answer import format_answer
from medvoltrain.rewards import (
    ConsistencyScorer,
    RewardError,
    axial_reward,
    box_reward,
    consistency_reward,
    format_reward,
    match_boxes,
    parsed,
    window_range,
)

GOOD = '<think>The liver is largest here.</think><answer>[{"slice": 12, "bbox_2d_list": [[10, 20, 300, 400]]}]</answer>'


@pytest.mark.parametrize("text,want", [
    (GOOD, 1.0),
    ('<think></think><answer>{"slice": 3, "bbox_2d_list": [1, 2, 3, 4]}</answer>', 1.0),  # tolerated forms
    ('<answer>[{"slice": 12, "bbox_2d_list": [[10, 20, 300, 400]]}]</answer>', 0.0),  # no think block
    ('<think>x</think>', 0.0),  # no answer block
    ('<think>x</think><answer>[{"slice": 12, "bbox_2d_list": []}]</answer>', 0.0),  # no box
    ('<think>x</think><answer>[{"slice": 12}]</answer>', 0.0),  # no box list
    ("<think>x</think><answer>[{'slice': 12, 'bbox_2d_list': [[1, 2, 3, 4]]}]</answer>", 0.0),  # not JSON
    ('<answer>[{"slice": 1, "bbox_2d_list": [[1, 2, 3, 4]]}]</answer><think>x</think>', 0.0),  # wrong order
    ('<think>x</think><answer>[{"slice": 1, "bbox_2d_list": [[1, 2, 3, 1400]]}]</answer>', 0.0),  # > 1000
    (None, 0.0),
])
def test_format_reward(text, want):
    assert format_reward(text) == want


def test_axial_reward():
    areas = [0, 10, 40, 20]
    assert axial_reward(2, areas) == 1.0
    assert axial_reward(1, areas) == 0.25
    assert axial_reward(3, areas) == 0.5
    assert axial_reward(0, areas) == 0.0
    assert axial_reward(4, areas) == 0.0  # out of range
    assert axial_reward(-1, areas) == 0.0
    assert axial_reward(True, areas) == 0.0
    assert axial_reward(1, [0, 0, 0]) == 0.0  # all-empty target
    with pytest.raises(RewardError):
        axial_reward(0, [])


def test_box_reward_single_extra_and_missing_boxes():
    a = [0, 0, 100, 100]
    assert box_reward([a], [a]) == 1.0
    # shifted by half its width: IoU = 50·100 / (2·10000 − 5000) = 1/3
    assert box_reward([[50, 0, 150, 100]], [a]) == pytest.approx(1 / 3)
    # an extra predicted box is divided in: (1 + 0) / 2
    assert box_reward([a, [500, 500, 600, 600]], [a]) == 0.5
    # a missing box likewise: 1 / 2
    assert box_reward([a], [a, [500, 500, 600, 600]]) == 0.5
    # corners in the wrong order count as the box they span
    assert box_reward([[100, 100, 0, 0]], [a]) == 1.0


def test_box_reward_empty_lists():
    assert box_reward([], []) == 1.0
    assert box_reward([], [[0, 0, 10, 10]]) == 0.0
    assert box_reward([[0, 0, 10, 10]], []) == 0.0
    with pytest.raises(RewardError):
        box_reward([[1, 2, 3]], [[0, 0, 10, 10]])


def test_box_reward_uses_the_optimal_matching_not_the_greedy_one():
    gt1, gt2 = [0, 0, 100, 100], [50, 0, 150, 100]
    p1, p2 = [20, 0, 120, 100], [0, 0, 50, 100]
    # IoU(p1, gt1) = 80/120 = 2/3 is the best single pair, but taking it leaves p2–gt2 = 0.
    # Optimal: p1–gt2 = 70/130 = 7/13 and p2–gt1 = 50/100 = 1/2  →  (7/13 + 1/2) / 2 = 27/52.
    assert box_reward([p1, p2], [gt1, gt2]) == pytest.approx(27 / 52)
    pairs = sorted(match_boxes([p1, p2], [gt1, gt2]))
    assert [(i, j) for i, j, _ in pairs] == [(0, 1), (1, 0)]


def test_consistency_reward_windows():
    d = 12
    gt = np.zeros((d, 4, 4), bool)
    pred = np.zeros_like(gt)
    gt[2:5, :2, :2] = True     # 3 slices × 4 px = 12 px
    pred[3:6, :2, :2] = True   # overlaps gt on slices 3, 4
    # window k=3, Δ=2 → slices 1..5: |gt| = 12, |pred| = 12, overlap 8 → Dice 16/24
    assert consistency_reward(pred, gt, 3, 2) == pytest.approx(2 / 3)
    # Δ=0 → slice 3 only: both 4 px, identical → 1
    assert consistency_reward(pred, gt, 3, 0) == 1.0
    # window clipped at the end: k=11, Δ=5 → slices 6..11, both empty there → 1
    assert window_range(11, d, 5) == (6, 11)
    assert consistency_reward(pred, gt, 11, 5) == 1.0
    # clipped at the start: k=0, Δ=2 → 0..2: gt 4 px on slice 2, pred nothing → 0
    assert window_range(0, d, 2) == (0, 2)
    assert consistency_reward(pred, gt, 0, 2) == 0.0
    # whole stack when no key slice: |gt| 12, |pred| 12, overlap 8
    assert consistency_reward(pred, gt) == pytest.approx(2 / 3)
    with pytest.raises(RewardError):
        consistency_reward(pred[:5], gt)


@pytest.fixture(scope="module")
def small_case(ct_sm_path, seg_sm_path):
    from medvolcore.anchor import boxes_from_slice_mask, box_to_norm
    from medvolcore.stack import AxialStack
    from medvolcore.volume import load_label_map, load_volume

    stack = AxialStack(load_volume(ct_sm_path))
    labels = AxialStack(load_label_map(seg_sm_path)).data
    hu = np.ascontiguousarray(stack.data[:, ::2, ::2], dtype=np.float32)  # 30 × 51 × 61
    gt = np.ascontiguousarray(labels[:, ::2, ::2] == 5)  # liver
    h, w = gt.shape[1:]
    by_slice = {str(z): [box_to_norm(b, w, h) for b in boxes_from_slice_mask(gt[z])]
                for z in range(gt.shape[0]) if gt[z].any()}
    return hu, gt, by_slice


@pytest.fixture(scope="module")
def scorer():
    from medvolcore.propagation import MedSAM2Propagator

    return ConsistencyScorer(MedSAM2Propagator.from_random(0, image_size=64), delta=2)


def test_group_consistency_encodes_each_window_slice_once(small_case, scorer):
    hu, gt, by_slice = small_case
    z_liver = max(by_slice, key=lambda z: gt[int(z)].sum())
    k = int(z_liver)
    box = by_slice[z_liver][0]
    answers = [parsed(format_answer(k, [box], "a")),
               parsed(format_answer(k + 1, [box], "b")),
               parsed(format_answer(k, [box, [0, 0, 30, 30]], "c")),  # an extra box: not matched, not propagated
               None]                                                  # unparsed: 0
    got = scorer.score_group(hu, gt, answers, by_slice)
    assert got[3] == 0.0
    union = set(range(k - 2, k + 4))  # windows [k-2, k+2] and [k-1, k+3]
    assert scorer.last_encoder_calls == len(union) == 6  # not 3 × 5 = 15
    # each score is the Dice of the rollout's own propagation over its window
    prop = scorer.propagator
    h, w = gt.shape[1:]
    from medvolcore.anchor import norm_to_box

    for ans, score in zip(answers[:3], got[:3]):
        # the answer text carries integer coordinates: propagate what it says
        single = prop.propagate(hu, ans.slice, [norm_to_box(ans.boxes_norm[0], w, h)], window=2).mask
        assert score == pytest.approx(consistency_reward(single, gt, ans.slice, 2))
    assert got[0] == got[2]  # the unmatched extra box changed nothing


def test_prediction_on_a_slice_without_target_scores_by_the_window(small_case, scorer):
    hu, gt, by_slice = small_case
    first = min(int(z) for z in by_slice) + 10
    gt = gt.copy()
    gt[:first] = False  # the target now starts at slice `first`
    by_slice = {z: b for z, b in by_slice.items() if int(z) >= first}
    box = [[100, 100, 400, 400]]
    answers = [parsed(format_answer(first - 6, box, "far")),   # window [first-8, first-4]: no target
               parsed(format_answer(first - 1, box, "near"))]  # window reaches the target, nothing propagated
    assert scorer.score_group(hu, gt, answers, by_slice) == [1.0, 0.0]
    assert scorer.last_encoder_calls == 0  # neither slice has ground-truth boxes to match: MedSAM2 not run


def test_consistency_with_early_stop_keeps_the_window_semantics(small_case):
    """K > 0: directions end early inside the window, the skipped slices count as predicted empty,
    and the Dice is still over the whole window, so a target that really ended scores the same."""
    from medvolcore.propagation import MedSAM2Propagator
    from reference.controlled_masks import controlled_masks
    hu, gt, by_slice = small_case
    k = int(max(by_slice, key=lambda z: gt[int(z)].sum()))
    follow = gt.copy()
    follow[k + 2:] = False  # MedSAM2's mask ends 1 slice after the key slice going forward
    prop = MedSAM2Propagator.from_random(0, image_size=64)
    full, early = (ConsistencyScorer(prop, delta=5, stop_after_empty=s) for s in (0, 1))
    answers = [parsed(format_answer(k, [by_slice[str(k)][0]], "a"))]
    with controlled_masks(prop.predictor, [follow]):
        want = full.score_group(hu, gt, answers, by_slice)
        got = early.score_group(hu, gt, answers, by_slice)
    lo, hi = max(0, k - 5), min(gt.shape[0] - 1, k + 5)
    assert full.last_encoder_calls == hi - lo + 1
    assert early.last_encoder_calls == (k + 2) - lo + 1  # forward stops at k+2, backward runs to the edge
    assert got == want and 0 < got[0] < 1  # the window still has target slices the mask missed
    with pytest.raises(RewardError, match="stop_after_empty"):
        ConsistencyScorer(prop, stop_after_empty=-1)


# ---- "not present": absent answers and absent targets ------------------------------------------

ABSENT = "<think>No shown slice holds it.</think><answer>[]</answer>"


def test_absent_terms_by_hand():
    """format as usual; axial and box: 1 when answer and target are both absent, 0 when exactly one is."""
    from medvoltrain.rewards import answer_box_reward, presence_agreement

    assert format_reward(ABSENT) == 1.0 and format_reward("<think>x</think><answer>[[]]</answer>") == 0.0
    assert (presence_agreement(True, True), presence_agreement(True, False), presence_agreement(False, True),
            presence_agreement(False, False)) == (1.0, 0.0, 0.0, None)
    empty, areas = [0, 0, 0, 0], [0, 10, 40, 20]
    assert axial_reward(None, empty) == 1.0      # [] on a negative
    assert axial_reward(None, areas) == 0.0      # [] on a positive (a false negative)
    assert axial_reward(2, empty) == 0.0         # a slice named on a negative (a false positive)
    assert axial_reward(1, areas) == 0.25        # the paper's term, unchanged
    gt = {"2": [[0, 0, 100, 100]], "3": [[0, 0, 50, 50]]}
    absent, boxed = parsed(ABSENT), parsed(format_answer(2, [[50, 0, 150, 100]], "x"))
    assert answer_box_reward(absent, {}) == 1.0
    assert answer_box_reward(absent, gt) == 0.0
    # the paper's rule would give 1 here ("both empty" on slice 2 of a target with no box): not for a negative
    assert box_reward([[50, 0, 150, 100]], []) == 0.0 and answer_box_reward(boxed, {}) == 0.0
    assert answer_box_reward(boxed, gt) == pytest.approx(1 / 3)  # positive: IoU 50·100 / 15000


def test_reward_functions_score_absent_answers_and_targets(small_case):
    """The TRL-facing class: a negative sample (all-zero areas, no boxes, no mask) and a positive one,
    each answered with [] and with a box; the consistency term never runs MedSAM2 for them."""
    import json

    from medvoltrain.rewards import RewardFunctions

    hu, gt, by_slice = small_case
    k = int(max(by_slice, key=lambda z: gt[int(z)].sum()))
    box = format_answer(k, [by_slice[str(k)][0]], "here")

    class NoPropagation:
        def propagate_many(self, *a, **kw):
            raise AssertionError("MedSAM2 ran for an absent answer or an absent target")

    scorer = ConsistencyScorer(NoPropagation(), delta=2)
    negative = {"id": "ct/brain", "absent": True, "stack_shape": list(gt.shape), "gt_boxes_norm": {}}
    fns = RewardFunctions(scorer=scorer, samples={"ct/brain": negative})
    fns._stack = lambda sample: (hu, None)  # the CT itself; the negative's mask comes from load_mask (zeros)
    completions = [ABSENT, box, "no answer", ABSENT]
    areas = [[0] * gt.shape[0]] * 3 + [[int(a) for a in gt.reshape(gt.shape[0], -1).sum(1)]]
    boxes = [json.dumps({})] * 3 + [json.dumps(by_slice)]
    assert fns.format(None, completions) == [1.0, 1.0, 0.0, 1.0]
    assert fns.axial(None, completions, slice_areas=areas) == [1.0, 0.0, 0.0, 0.0]
    assert fns.box(None, completions, gt_boxes_norm=boxes) == [1.0, 0.0, 0.0, 0.0]
    assert fns.consistency(None, completions[:3], sample_id=["ct/brain"] * 3) == [1.0, 0.0, 0.0]
    assert scorer.last_encoder_calls == 0 and not fns.failures


def test_consistency_scorer_does_not_propagate_an_absent_answer(small_case):
    """[] on a positive scores 0 and is not propagated; the box answer beside it is, as before."""
    hu, gt, by_slice = small_case
    k = int(max(by_slice, key=lambda z: gt[int(z)].sum()))
    seen = []

    class Recording:  # MedSAM2's seam: returns the ground truth as the propagated mask
        def propagate_many(self, stack, prompts, **kw):
            seen.extend(prompts)
            return [type("R", (), {"mask": gt, "encoder_calls": 5})() for _ in prompts]

    scorer = ConsistencyScorer(Recording(), delta=2)
    answers = [parsed(ABSENT), parsed(format_answer(k, [by_slice[str(k)][0]], "a"))]
    assert scorer.score_group(hu, gt, answers, by_slice) == [0.0, 1.0]
    assert [z for z, _ in seen] == [k]  # only the box answer was propagated
    seen.clear()
    assert scorer.score_group(hu, np.zeros_like(gt), answers, {}) == [1.0, 0.0]  # a negative sample
    assert seen == [] and scorer.last_encoder_calls == 0


# ---- one decode and one parse per completion per step ------------------------------------------

def test_each_completion_is_decoded_and_parsed_once_per_grpo_step(small_case, tmp_path, monkeypatch):
    """TRL calls the four term functions one after another with the same completions and token ids:
    each completion is decoded once and parsed once in that step, whichever terms read it, and the
    scores are those of each term computed on its own."""
    import collections
    import json

    import medvoltrain.rewards as rewards
    from medvoltrain.rewards import TERMS, RewardFunctions

    hu, gt, by_slice = small_case
    k = int(max(by_slice, key=lambda z: gt[int(z)].sum()))
    box = by_slice[str(k)][0]
    completions = [format_answer(k, [box], "a"), format_answer(k + 1, [box], "b"), ABSENT, "no answer"]
    decodes, parses = collections.Counter(), collections.Counter()

    class CharTokenizer:  # one token per character; counts what it decodes
        def decode(self, ids, skip_special_tokens=False):
            text = "".join(map(chr, ids))
            decodes[text] += 1
            return text

    real_parse = rewards.parse_answer
    monkeypatch.setattr(rewards, "parse_answer", lambda text: parses.update([text]) or real_parse(text))

    class Recording:  # MedSAM2's seam: the ground truth as the propagated mask
        def propagate_many(self, stack, prompts, **kw):
            return [type("R", (), {"mask": gt, "encoder_calls": 1})() for _ in prompts]

    np.savez(tmp_path / "mask.npz", mask=gt)
    sample = {"id": "ct/liver", "data_dir": str(tmp_path), "mask_file": "mask.npz", "gt_boxes_norm": by_slice}
    fns = RewardFunctions(tokenizer=CharTokenizer(), scorer=ConsistencyScorer(Recording(), delta=2),
                          samples={sample["id"]: sample})
    fns._stack = lambda sample: (hu, None)
    n = len(completions)
    columns = {"slice_areas": [[int(a) for a in gt.reshape(gt.shape[0], -1).sum(1)]] * n,
               "gt_boxes_norm": [json.dumps(by_slice)] * n, "sample_id": [sample["id"]] * n}

    def step(texts):  # as GRPOTrainer._calculate_rewards calls each reward function
        funcs, _ = fns.functions({t: 1.0 for t in TERMS})
        assert [f.__name__ for f in funcs] == list(TERMS)
        ids = [[ord(c) for c in t] for t in texts]
        return [f(prompts=[sample["id"]] * n, completions=texts, completion_ids=ids, trainer_state=None,
                  log_extra=None, log_metric=None, **columns) for f in funcs]

    scores = step(completions)
    assert decodes == {t: 1 for t in completions}
    assert parses == {t: 1 for t in completions}
    answers = [parsed(t) for t in completions]
    parses.clear()
    assert scores[0] == [format_reward(t) for t in completions] == [1.0, 1.0, 1.0, 0.0]
    assert scores[1] == [0.0 if a is None else axial_reward(a.slice, areas)
                         for a, areas in zip(answers, columns["slice_areas"])]
    assert scores[2] == [0.0 if a is None else rewards.answer_box_reward(a, by_slice) for a in answers]
    assert scores[3] == fns.scorer.score_group(hu, gt, answers, by_slice) and scores[3][0] == 1.0
    assert not fns.failures
    # the next step's completions are decoded and parsed anew, once each, never served the last step's
    decodes.clear()
    parses.clear()
    assert step(completions[::-1]) == [s[::-1] for s in scores]
    assert decodes == parses == {t: 1 for t in completions}


def test_the_reward_examples_in_the_docstrings_hold():
    """The doctests of :mod:`medvoltrain.rewards` (``format_reward``, ``RewardFunctions``) run here."""
    import doctest

    import medvoltrain.rewards as rewards

    result = doctest.testmod(rewards, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0
