"""SFT targets on the real CT and query generation (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from medvolcore.anchor import box_to_norm, slice_areas
from medvolcore.answer import parse_answer
from medvolcore.stack import AxialStack
from medvolcore.volume import load_label_map, load_volume
from medvoltrain.queries import QueryBank, names_label, split_descriptions
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


def test_queries_are_deterministic_for_a_seed_and_vary_with_it():
    bank = QueryBank()
    a = [bank.draw(f"case{i}", "liver", "train", seed=3).text for i in range(12)]
    b = [QueryBank().draw(f"case{i}", "liver", "train", seed=3).text for i in reversed(range(12))][::-1]
    c = [bank.draw(f"case{i}", "liver", "train", seed=4).text for i in range(12)]
    assert a == b and a != c
    assert len(set(a)) > 3  # drawn, not constant


@pytest.mark.parametrize("label", ["liver", "kidneys", "kidney tumor", "kidney cyst", "spleen", "left kidney"])
def test_held_out_descriptions_never_reach_training_queries(label):
    bank = QueryBank(test_fraction=0.25)
    train, test = bank.descriptions(label, "train"), bank.descriptions(label, "test")
    assert train and test and not set(train) & set(test)
    train_used = {bank.draw(f"c{i}", label, "train", seed=s).description for i in range(30) for s in range(3)}
    test_used = {bank.draw(f"c{i}", label, "test", seed=s).description for i in range(30) for s in range(3)}
    assert train_used <= set(train) and test_used <= set(test) and not train_used & test_used
    # implicit queries never name their own label
    assert not any(names_label(d, label) for d in train_used | test_used)
    # the split does not depend on the seed or on the order of the descriptions
    pool = train + test
    assert set(split_descriptions(pool, 0.25)["test"]) == set(split_descriptions(pool[::-1], 0.25)["test"]) == set(test)


def test_description_filter():
    assert names_label("Left kidney is one of a pair of bean-shaped organs.", "left kidney")
    assert names_label("Stones form in the gall bladder.", "gallbladder")  # compound spellings
    assert names_label("Anomalous growth leading to a tumor in the kidney.", "kidney tumor")
    assert not names_label("Abnormal growth of cells in the kidney.", "kidney tumor")
    assert names_label("The livers of adults", "liver")
    assert not names_label("Produces bile, a fluid that aids digestion.", "liver")


def test_relational_queries_come_from_the_paraphrase_set():
    from medvoltrain import resources

    spec = resources.relational_queries()["datasets"]["0004"]
    q = QueryBank().draw_relational("kits_1", "0004", "kidney cyst", seed=0)
    assert q.kind == "relational" and q.description in spec["lesions"]["kidney cyst"]
    assert q.text == q.template.replace("{lesion}", q.description) and "kidney" in q.text
    assert q == QueryBank().draw_relational("kits_1", "0004", "kidney cyst", seed=0)


def test_unknown_term_falls_back_to_an_explicit_query_with_a_note():
    q = QueryBank().draw("c", "some organ nobody described", "train", seed=0)
    assert q.kind == "explicit" and "some organ nobody described" in q.text and q.notes
