"""The field's scores (``medvoltrain.fieldmetrics``) on analytic phantoms and on one fixed prediction
of the shipped CT, whose numbers pin each protocol's conventions (the CVPR 2025 values were checked
equal to the official ``CVPR25_text_eval.py`` on the same files)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medvoltrain import challenge, fieldmetrics as fm


def box(shape, lo, hi):
    m = np.zeros(shape, bool)
    m[tuple(slice(a, b) for a, b in zip(lo, hi))] = True
    return m


def ball(shape, centre, radius_mm, spacing):
    idx = np.indices(shape).astype(float)
    d2 = sum(((idx[a] - centre[a]) * spacing[a]) ** 2 for a in range(3))
    return d2 <= radius_mm ** 2


# ---- analytic phantoms -------------------------------------------------------------------------------

def test_box_dice_is_the_overlap_fraction():
    g = box((20, 20, 20), (2, 2, 2), (12, 12, 12))
    p = box((20, 20, 20), (4, 2, 2), (14, 12, 12))  # shifted by 2 of 10 along axis 0
    assert fm.dice_nan(g, p) == pytest.approx(0.8)
    assert fm.medvol_r1_prompt(g, p) == pytest.approx({"dice": 0.8, "iou": 800 / 1200})


def test_nsd_at_2mm_reads_the_spacing_per_array_axis():
    """A one-voxel shift is 1.5 mm along axis 0 (inside 2 mm: every surface element matches) or 3 mm
    along axis 2; a wrong axis order would swap the two results."""
    sp = (1.5, 1.0, 3.0)
    g = box((20, 20, 20), (5, 5, 5), (12, 12, 12))
    assert fm.nsd(g, np.roll(g, 1, axis=0), sp) == pytest.approx(1.0)
    assert fm.nsd(g, np.roll(g, 1, axis=2), sp) < 0.9
    assert fm.nsd(g, g, sp) == pytest.approx(1.0)


def test_nsd_of_concentric_balls_at_anisotropic_spacing():
    """Radii 15 and 14 mm on 2.5 × 0.8 × 0.8 mm voxels: every surface lies within 2 mm (NSD 1 up to
    the voxelisation) and Dice is the volume ratio 2·14³/(15³ + 14³); radii 15 and 11 mm: no surface
    within 2 mm (NSD 0) while Dice stays above 0.5."""
    sp, shape, c = (2.5, 0.8, 0.8), (24, 60, 60), (12, 30, 30)
    g = ball(shape, c, 15.0, sp)
    near, far = ball(shape, c, 14.0, sp), ball(shape, c, 11.0, sp)
    assert fm.nsd(g, near, sp) == pytest.approx(1.0, abs=0.02)
    assert fm.dice_nan(g, near) == pytest.approx(2 * 14 ** 3 / (15 ** 3 + 14 ** 3), abs=0.01)
    assert fm.nsd(g, far, sp) == 0.0
    assert fm.dice_nan(g, far) == pytest.approx(2 * 11 ** 3 / (15 ** 3 + 11 ** 3), abs=0.01)


def test_empty_masks_under_both_conventions():
    e, g = np.zeros((6, 6, 6), bool), box((6, 6, 6), (1, 1, 1), (4, 4, 4))
    assert math.isnan(fm.dice_nan(e, e)) and math.isnan(fm.nsd(e, e, (1, 1, 1)))
    assert fm.medvol_r1_prompt(e, e) == {"dice": 1.0, "iou": 1.0}
    assert fm.nsd(g, e, (1, 1, 1)) == 0.0 and fm.nsd(e, g, (1, 1, 1)) == 0.0


def test_cvpr25_averages_only_prompted_classes_present_in_the_ground_truth():
    shape = (10, 10, 10)
    gts = np.zeros(shape, np.uint8)
    gts[box(shape, (0, 0, 0), (5, 10, 10))] = 1
    segs = gts.copy()
    segs[box(shape, (6, 0, 0), (8, 10, 10))] = 2  # class 2 prompted but absent: not scored by the script
    segs[box(shape, (8, 0, 0), (10, 10, 10))] = 9  # never prompted: ignored
    r = fm.cvpr25_case(gts, segs, (1, 1, 1), [1, 2], instance=False)
    assert (r["DSC"], r["NSD"]) == (1.0, 1.0)
    assert r["DSC_all_prompts"] == 0.5  # textbook: the false positive on class 2 costs a 0
    none_present = fm.cvpr25_case(gts, segs, (1, 1, 1), [2, 3], instance=False)
    assert math.isnan(none_present["DSC"]) and math.isnan(none_present["NSD"])
    assert none_present["DSC_all_prompts"] == 0.5  # class 3: both empty, 1.0; class 2: 0


def test_cvpr25_instances_split_a_binary_prediction_into_components():
    shape = (12, 30, 30)
    gts = np.zeros(shape, np.uint8)
    gts[box(shape, (1, 2, 2), (5, 10, 10))] = 1
    gts[box(shape, (6, 15, 15), (10, 25, 25))] = 2
    segs = np.zeros(shape, np.uint8)
    segs[box(shape, (1, 2, 3), (5, 10, 10))] = 1  # IoU 7/8 with instance 1
    segs[box(shape, (6, 0, 25), (10, 5, 30))] = 1  # a false positive
    r = fm.cvpr25_case(gts, segs, (1, 1, 1), [1], instance=True)
    assert r["F1"] == pytest.approx(0.5) and r["DSC_TP"] == pytest.approx(round(2 * 7 / 15, 4))
    assert math.isnan(r["DSC"]) and math.isnan(r["NSD"])
    nothing = fm.cvpr25_case(gts, np.zeros(shape), (1, 1, 1), [1], instance=True)
    assert (nothing["F1"], nothing["DSC_TP"], nothing["F1_textbook"]) == (0.0, 0.0, 0.0)
    both_empty = fm.cvpr25_case(np.zeros(shape), np.zeros(shape), (1, 1, 1), [1], instance=True)
    assert both_empty["F1"] == 0.0 and math.isnan(both_empty["F1_textbook"])


def test_absent_prompt_counts_false_positive_millilitres():
    m = box((10, 10, 10), (0, 0, 0), (2, 5, 5))  # 50 voxels of 2 × 1 × 1 mm
    a = fm.absent_prompt(m, (2.0, 1.0, 1.0))
    assert a["refused"] == 0 and a["fp_voxels"] == 50 and a["fp_ml"] == pytest.approx(0.1)
    assert a["dice_empty_is_one"] == 0.0 and a["dice_empty_is_nan"] == 0.0
    r = fm.absent_prompt(0, (2.0, 1.0, 1.0))
    assert r["refused"] == 1 and r["dice_empty_is_one"] == 1.0 and math.isnan(r["dice_empty_is_nan"])
    s = fm.absent_summary([a, r])
    assert s["refusal_rate"] == 0.5 and s["fp_ml_total"] == pytest.approx(0.1)
    assert s["dice_empty_is_one"] == 0.5 and s["dice_empty_is_nan"] == 0.0 and s["scored_under_nan"] == 1


# ---- properties of the CVPR convention on random label maps --------------------------------------

@st.composite
def label_case(draw):
    shape = tuple(draw(st.integers(4, 10)) for _ in range(3))
    spacing = tuple(draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])) for _ in range(3))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    gts = (rng.integers(0, 4, shape) * (rng.random(shape) < 0.5)).astype(np.uint8)
    segs = np.where(rng.random(shape) < 0.7, gts, rng.integers(0, 4, shape)).astype(np.uint8)
    return gts, segs, spacing


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(label_case(), st.permutations([1, 2, 3]))
def test_cvpr25_scores_ignore_unprompted_labels_and_label_names(case, perm):
    gts, segs, spacing = case
    base = fm.cvpr25_case(gts, segs, spacing, [1, 2, 3], instance=False)
    # renaming the classes (in gts, segs and prompts alike) changes nothing
    lut = np.array([0] + [p + 10 for p in perm], np.uint8)
    renamed = fm.cvpr25_case(lut[gts], lut[segs], spacing, [p + 10 for p in perm], instance=False)
    for k in ("DSC", "NSD", "DSC_all_prompts"):
        assert base[k] == renamed[k] or (math.isnan(base[k]) and math.isnan(renamed[k])), k
    # predicted voxels of a class that was never prompted are not scored
    noisy = np.where(segs == 0, 7, segs).astype(np.uint8)
    assert fm.cvpr25_case(gts, noisy, spacing, [1, 2, 3], False)["DSC"] == pytest.approx(base["DSC"], nan_ok=True)
    if not np.isin([1, 2, 3], gts).any():
        assert math.isnan(base["DSC"])
    else:
        assert 0.0 <= base["DSC"] <= 1.0 and 0.0 <= base["NSD"] <= 1.0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=60))
def test_relabel_sequential_keeps_order_and_background(values):
    a = np.array(values).reshape(-1, 1, 1)
    out = fm.relabel_sequential(a)
    nonzero = sorted(set(values) - {0})
    assert out.max(initial=0) == len(nonzero)
    assert ((out == 0) == (a == 0)).all() if 0 in values else (out > 0).all()
    for v, w in zip(values, out.ravel()):
        if v:
            assert w == nonzero.index(v) + 1


# ---- one fixed prediction of the shipped CT: every protocol's numbers pinned ----------------------------

@pytest.fixture(scope="module")
def fixed_slab(tmp_path_factory, real_dir):
    """The upper-abdomen slab in the challenge layout, predicted as its ground truth shifted by
    (1, −1, 2) voxels with the liver dropped and a 3 × 20 × 20 block labelled urinary bladder, which
    is outside this field of view."""
    from medvoltrain.absent_suite import write_absent_suite

    d = write_absent_suite(real_dir, tmp_path_factory.mktemp("suite"))
    image = challenge.read_image(d / "imgs" / "ts_slab.npz")
    gts = np.load(d / "gts" / "ts_slab.npz")["gts"]
    segs = np.roll(gts, (1, -1, 2), axis=(0, 1, 2))
    segs[segs == 5] = 0
    segs[0:3, 10:30, 10:30] = 21
    return image, gts, segs


def test_each_protocol_on_one_fixed_prediction(fixed_slab):
    """The CVPR values equal what the official script printed for these files; a change of any
    convention (which classes count, empty masks, pooling, thresholds) moves one of these numbers."""
    from medvoltrain.evaluate_field import score_case

    image, gts, segs = fixed_slab
    s = score_case(image, gts, segs)
    assert {k: s["cvpr"][k] for k in ("DSC", "NSD", "DSC_all_prompts")} == {"DSC": 0.4945, "NSD": 0.186,
                                                                            "DSC_all_prompts": 0.4967}
    rex = fm.rexgrounding_summary(s["findings"])
    assert rex["findings"] == 3
    assert rex["global_dice"] == pytest.approx(0.494523, abs=1e-6)  # the mean of the findings' Dice
    assert rex["pooled_dice"] == pytest.approx(0.279284, abs=1e-6)
    assert rex["hit_rate"] == pytest.approx(2 / 3) and rex["instance_f1"] == pytest.approx(0.8)
    r1 = {p["class_id"]: round(p["r1_dice"], 4) for p in s["prompts"]}
    assert r1 == {1: 0.7919, 4: 0.6917, 5: 0.0, 21: 0.0, 75: 1.0}
    absent = fm.absent_summary(s["absent"])
    assert absent["prompts"] == 2 and absent["refusal_rate"] == 0.5
    assert absent["fp_ml_total"] == pytest.approx(1200 * 27 / 1000)


def test_an_absent_target_is_scored_by_its_own_mask(fixed_slab):
    """Where another prompt's label covers an absent target's voxels in segs (the smaller id keeps an
    overlapping voxel), its false positives still count: MedVol-R1, ReXGroundingCT and the suite score
    each prompt's own mask; the CVPR numbers stay those of segs."""
    from medvoltrain.evaluate_field import score_case

    image, gts, segs = fixed_slab
    spleen = gts == 1
    masks = {1: spleen, 21: spleen.copy(), 75: np.zeros_like(spleen)}  # the bladder prompt drew the spleen
    s = score_case(image, gts, segs, masks, {"21": {"slice": 3}, "75": {"slice": None}})
    rows = {r["class_id"]: r for r in s["prompts"]}
    assert rows[21]["fp_voxels"] == int(spleen.sum()) and rows[21]["r1_dice"] == 0.0
    assert rows[75]["answered_absent"] == 1 and rows[75]["r1_dice"] == 1.0 and rows[21]["answered_absent"] == 0
    assert rows[1]["r1_dice"] == 1.0 and rows[1]["cvpr_dice"] == pytest.approx(0.7919, abs=1e-4)
    assert s["cvpr"]["DSC"] == 0.4945  # segs unchanged
