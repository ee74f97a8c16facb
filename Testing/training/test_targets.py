"""SFT targets and the rewards' ground truth on the real CT (medvoltrain.targets; no model needed).
Query generation is test_queries.py's."""

from __future__ import annotations

import numpy as np
import pytest

from medvolcore.anchor import box_to_norm, slice_areas
from medvolcore.answer import parse_answer
from medvolcore.stack import AxialStack
from medvolcore.volume import load_label_map, load_volume
from medvoltrain.targets import reward_ground_truth, sft_target

SPLEEN, KIDNEY_RIGHT, KIDNEY_LEFT, LIVER = 1, 2, 3, 5


@pytest.fixture(scope="module")
def real(ct_path, seg_path):
    stack = AxialStack(load_volume(ct_path))
    labels = stack.to_stack(load_label_map(seg_path).array)
    return stack, np.asarray(labels), stack.sample_indices(64)


def test_liver_target_is_one_box_on_the_largest_shown_slice(real):
    stack, labels, shown = real
    mask = labels == LIVER
    t = sft_target(mask, shown, "liver", top_k=1)
    areas = slice_areas(mask)
    best = max(shown, key=lambda z: (areas[z], -z))
    assert t.slice == best and t.slice in shown
    assert len(t.boxes) == 1
    x0, y0, x1, y1 = t.boxes[0]
    ys, xs = np.nonzero(mask[t.slice])
    assert [x0, y0, x1, y1] == [xs.min(), ys.min(), xs.max(), ys.max()]  # the bounding box of the liver there
    parsed = parse_answer(t.text)
    assert parsed.slice == t.slice and "liver" in parsed.reasoning and str(t.slice) in parsed.reasoning
    assert parsed.boxes_norm == [[round(v) for v in box_to_norm(t.boxes[0], stack.width, stack.height)]]
    assert t.text.startswith("<think>") and t.text.endswith("</answer>")


def test_kidney_target_has_two_boxes_right_kidney_first(real):
    stack, labels, shown = real
    t = sft_target(np.isin(labels, [KIDNEY_RIGHT, KIDNEY_LEFT]), shown, "kidneys", top_k=1)
    assert len(t.boxes) == 2
    key = labels[t.slice]
    left_box, right_box = t.boxes  # ordered by x0: image left = the patient's right
    assert (key[left_box[1]:left_box[3] + 1, left_box[0]:left_box[2] + 1] == KIDNEY_RIGHT).sum() > 100
    assert (key[right_box[1]:right_box[3] + 1, right_box[0]:right_box[2] + 1] == KIDNEY_LEFT).sum() > 100
    assert "two regions" in t.think


def test_top_k_stays_within_the_k_largest_shown_slices_and_is_seeded(real):
    _, labels, shown = real
    mask = labels == LIVER
    areas = slice_areas(mask)
    k = 4
    top = sorted(shown, key=lambda z: (-int(areas[z]), z))[:k]
    picks = {sft_target(mask, shown, "liver", top_k=k, rng=np.random.default_rng(s)).slice for s in range(40)}
    assert picks <= set(top) and len(picks) > 1  # sampled, and never outside the shown top K
    a = sft_target(mask, shown, "liver", top_k=k, rng=np.random.default_rng(7))
    b = sft_target(mask, shown, "liver", top_k=k, rng=np.random.default_rng(7))
    assert a.text == b.text
    # restricted to the shown slices: a mask living only on an unshown slice has no target
    unshown = next(z for z in range(labels.shape[0]) if z not in set(shown) and areas[z] > 0)
    only = np.zeros_like(mask)
    only[unshown] = mask[unshown]
    with pytest.raises(Exception, match="empty on the candidate slices"):
        sft_target(only, shown, "liver")


def test_reward_ground_truth_covers_the_whole_stack(real):
    stack, labels, shown = real
    mask = np.isin(labels, [KIDNEY_RIGHT, KIDNEY_LEFT])
    gt = reward_ground_truth(mask, shown)
    assert len(gt["slice_areas"]) == stack.depth
    assert gt["slice_areas"] == [int(v) for v in mask.reshape(stack.depth, -1).sum(1)]
    with_fg = [z for z in shown if mask[z].any()]
    assert sorted(int(z) for z in gt["boxes_norm"]) == with_fg
    z = with_fg[len(with_fg) // 2]
    assert all(0 <= v <= 1000 for b in gt["boxes_norm"][str(z)] for v in b)
    assert len(gt["boxes"][str(z)]) == len(gt["boxes_norm"][str(z)])
