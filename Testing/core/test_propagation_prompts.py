"""Correction prompts and ``z_range`` (``medvol.anchor/2``) in the propagator, against a reference.

The reference (``reference_propagate_prompts`` in Testing/reference/medsam2.py) is the
spec's semantics written directly on sam2's stock ``SAM2VideoPredictor`` methods: per object and
direction a fresh state, one ``add_new_points_or_box`` call per (object, slice), then
``propagate_in_video`` from the object's start slice, limited to ``z_range``. The product
(``MedSAM2Propagator.propagate(..., prompts=..., z_range=...)``) must give the same mask on the
same seeded random weights (image size 64) on real CT: bit for bit, since the same sam2 ops run.

Random weights make arbitrary (mostly very large) masks, so these tests judge equality with the
reference, not segmentation quality; ``test_prompts_change_the_result`` makes sure the prompts
used here do change the masks, so that the comparisons cannot pass vacuously.
"""

from __future__ import annotations

import numpy as np
import pytest

import torch  # noqa: F401  (installed by the bootstrap: a missing one must fail, not skip)
import sam2  # noqa: F401

from core.test_propagation import _bbox, _canonical, case, prop  # noqa: E402,F401  (the same stack, boxes and weights)
from reference import medsam2 as reference  # noqa: E402  (Testing/reference: MedSAM2's own loop)
from reference.controlled_masks import controlled_masks  # noqa: E402

LIVER, SPLEEN, STOMACH = 5, 1, 6
KEY = 8  # key slice of the tall stack


def _centre(m):
    ys, xs = np.nonzero(m)
    i = len(xs) // 2
    return [int(xs[i]), int(ys[i])]


def _dice(a, b):
    a, b = a.astype(bool), b.astype(bool)
    s = a.sum() + b.sum()
    return 1.0 if s == 0 else 2.0 * (a & b).sum() / s


@pytest.fixture(scope="module")
def ref():
    return reference


@pytest.fixture(scope="module")
def tall(ct_sm_path, seg_sm_path):
    """20 slices of the same CT (20 × 51 × 61): liver, spleen and stomach on every slice; key slice 8
    with the liver (object 1) and spleen (object 2) boxes."""
    ct = np.ascontiguousarray(_canonical(ct_sm_path, np.float32)[4:24, ::2, ::2])
    seg = np.ascontiguousarray(_canonical(seg_sm_path, np.int16)[4:24, ::2, ::2])
    for lab in (LIVER, SPLEEN, STOMACH):
        assert (seg == lab).any(axis=(1, 2)).all()
    boxes = [_bbox(seg[KEY] == LIVER), _bbox(seg[KEY] == SPLEEN)]
    return ct, seg, boxes


@pytest.fixture(scope="module")
def liver_plain(ref, prop, tall):
    """The reference's mask of object 1 (the liver box) alone, without prompts."""
    ct, _, boxes = tall
    mask, _ = ref.reference_propagate(prop, ct, KEY, boxes[:1])
    return mask


def _prompt(z, obj, box=None, points=()):
    return {"slice": z, "object": obj, "box": box, "points": [list(p) for p in points]}


def _same_as_reference(prop, ref, stack, k, boxes, prompts, z_range=None):
    """Product and reference masks for one request; the product's are checked against the reference,
    its encoding (each slice at most once, none outside ``z_range``) and its zeros outside ``z_range``."""
    r = prop.propagate(stack, k, boxes, prompts=prompts, z_range=z_range, return_object_masks=True)
    mask, _ = ref.reference_propagate_prompts(prop, stack, k, boxes, prompts, z_range=z_range)
    d = stack.shape[0]
    assert r.mask.shape == stack.shape and r.mask.dtype == np.uint8
    n_objects = len(boxes) + len({p["object"] for p in prompts if p["object"] > len(boxes)})
    assert r.object_masks.shape == (n_objects,) + stack.shape
    assert np.array_equal(r.mask, r.object_masks.any(axis=0).astype(np.uint8))
    assert np.array_equal(r.mask, mask), (
        f"Dice {_dice(r.mask, mask):.6f}; slices that differ: "
        f"{sorted(set(np.nonzero(r.mask != mask)[0].tolist()))}")
    assert len(set(r.encoded_slices)) == len(r.encoded_slices)  # every slice encoded at most once
    z0, z1 = (0, d - 1) if z_range is None else z_range
    assert all(z0 <= z <= z1 for z in r.encoded_slices)
    assert not r.mask[:z0].any() and not r.mask[z1 + 1:].any()
    return r, mask


# ---------------------------------------------------------------------------------------------
# the reference itself
# ---------------------------------------------------------------------------------------------


def test_reference_without_prompts_is_reference_propagate(ref, prop, case):
    stack, k, boxes = case
    plain, calls = ref.reference_propagate(prop, stack, k, boxes[:2])
    again, calls2 = ref.reference_propagate_prompts(prop, stack, k, boxes[:2])
    assert np.array_equal(again, plain) and calls2 == calls
    whole, _ = ref.reference_propagate_prompts(prop, stack, k, boxes[:2], prompts=[], z_range=(0, stack.shape[0] - 1))
    assert np.array_equal(whole, plain)


def test_reference_negative_point_changes_the_mask(ref, prop, tall, liver_plain):
    ct, seg, boxes = tall
    neg = [_prompt(KEY, 1, points=[_centre(seg[KEY] == STOMACH) + [0]])]
    mask, _ = ref.reference_propagate_prompts(prop, ct, KEY, boxes[:1], neg)
    assert mask.any() and not np.array_equal(mask, liver_plain)


def test_reference_rejects_gaps_in_object_numbers(ref, prop, tall):
    ct, seg, boxes = tall
    with pytest.raises(ValueError, match="object 3"):
        ref.reference_propagate_prompts(prop, ct, KEY, boxes[:1], [_prompt(KEY, 3, box=boxes[1])])


# ---------------------------------------------------------------------------------------------
# the product against the reference
# ---------------------------------------------------------------------------------------------


def test_prompts_change_the_result(prop, tall, liver_plain):
    """The product without prompts is the plain reference; a correction box changes its mask."""
    ct, seg, boxes = tall
    plain = prop.propagate(ct, KEY, boxes[:1])
    assert np.array_equal(plain.mask, liver_plain)
    corrected = prop.propagate(ct, KEY, boxes[:1], prompts=[_prompt(KEY + 5, 1, box=_bbox(seg[KEY + 5] == LIVER))])
    assert not np.array_equal(corrected.mask, plain.mask)


def test_correction_box_on_another_slice(prop, ref, tall, liver_plain):
    ct, seg, boxes = tall
    prompts = [_prompt(KEY + 5, 1, box=_bbox(seg[KEY + 5] == LIVER))]
    r, mask = _same_as_reference(prop, ref, ct, KEY, boxes[:1], prompts)
    assert not np.array_equal(mask, liver_plain)
    assert sorted(r.encoded_slices) == list(range(ct.shape[0]))


def test_negative_points_on_the_key_slice_and_another(prop, ref, tall, liver_plain):
    ct, seg, boxes = tall
    prompts = [_prompt(KEY, 1, points=[_centre(seg[KEY] == STOMACH) + [0]]),
               _prompt(KEY - 4, 1, points=[_centre(seg[KEY - 4] == SPLEEN) + [0], _centre(seg[KEY - 4] == LIVER) + [1]])]
    _, mask = _same_as_reference(prop, ref, ct, KEY, boxes[:1], prompts)
    assert not np.array_equal(mask, liver_plain)


@pytest.mark.parametrize("seed", ["box", "positive point"])
def test_new_object_on_another_slice(prop, ref, tall, liver_plain, seed):
    """Object 2 is new, seeded on slice KEY + 6 (its start slice), then corrected on KEY + 2."""
    ct, seg, boxes = tall
    z = KEY + 6
    first = (_prompt(z, 2, box=_bbox(seg[z] == SPLEEN)) if seed == "box"
             else _prompt(z, 2, points=[_centre(seg[z] == SPLEEN) + [1]]))
    prompts = [first, _prompt(KEY + 2, 2, points=[_centre(seg[KEY + 2] == LIVER) + [0]])]
    r, _ = _same_as_reference(prop, ref, ct, KEY, boxes[:1], prompts)
    assert np.array_equal(r.object_masks[0], liver_plain.astype(bool))  # object 1 is untouched
    assert r.object_masks[1].any()


@pytest.mark.parametrize(
    "z_range, with_prompts",
    [((3, 15), False), ((3, 15), True), ((KEY, 12), False), ((0, KEY + 3), True)],
    ids=["range", "range+prompts", "starts-at-key", "from-0+new-object-at-0"],
)
def test_z_range(prop, ref, tall, liver_plain, z_range, with_prompts):
    ct, seg, boxes = tall
    z0, z1 = z_range
    prompts = []
    if with_prompts:
        prompts = [_prompt(z1, 1, box=_bbox(seg[z1] == LIVER)),
                   _prompt(z0, 2, box=_bbox(seg[z0] == STOMACH))]  # a new object; from 0: no reverse run
    r, mask = _same_as_reference(prop, ref, ct, KEY, boxes[:1], prompts, z_range=z_range)
    assert sorted(r.encoded_slices) == list(range(z0, z1 + 1))
    assert mask[z0:z1 + 1].any(axis=(1, 2)).all()  # random weights: something on every slice in range
    if not with_prompts:  # sam2's tracking is causal: inside the range the result is the whole run's
        assert np.array_equal(mask[z0:z1 + 1], liver_plain[z0:z1 + 1])


def test_two_key_boxes_one_corrected(prop, ref, tall, liver_plain):
    ct, seg, boxes = tall
    prompts = [_prompt(KEY + 5, 2, box=_bbox(seg[KEY + 5] == SPLEEN)),
               _prompt(KEY, 2, points=[_centre(seg[KEY] == LIVER) + [0]]),
               _prompt(KEY - 5, 2, points=[_centre(seg[KEY - 5] == SPLEEN) + [1]])]
    r, _ = _same_as_reference(prop, ref, ct, KEY, boxes, prompts)
    assert np.array_equal(r.object_masks[0], liver_plain.astype(bool))  # object 1 is untouched
    assert sorted(r.encoded_slices) == list(range(ct.shape[0]))


# ---------------------------------------------------------------------------------------------
# early stop with prompts
# ---------------------------------------------------------------------------------------------


def _expected_stop(nonempty, start, step, edge, K, prompted):
    """The last slice one object visits in one direction: K empty slices in a row after the start
    slice, never counting a prompted slice as empty and never before its last prompted slice."""
    ahead = [z for z in prompted if (z - start) * step > 0]
    last_prompt = max(ahead, key=lambda z: z * step) if ahead else start
    run, z = 0, start
    while z != edge:
        z += step
        run = 0 if (nonempty[z] or z in prompted) else run + 1
        if run >= K and (z - last_prompt) * step > 0:
            return z
    return edge


@pytest.mark.parametrize("K", [1, 2])
def test_early_stop_reaches_prompted_slices(prop, tall, K):
    """The target is empty on slices KEY+3..KEY+6, but a correction box on KEY+8 lies past that gap:
    tracking must go on through the gap to it, then stop K empty slices later."""
    ct, seg, boxes = tall
    controlled = controlled_masks
    d = ct.shape[0]
    target = np.zeros(ct.shape, bool)
    target[:, 10:30, 10:30] = True
    target[:4] = False  # empty before slice 4
    z = KEY + 8
    target[KEY + 3:KEY + 7] = False  # the gap
    target[z + 1:] = False  # empty after the prompted slice
    prompts = [_prompt(z, 1, box=_bbox(seg[z] == LIVER))]
    with controlled(prop.predictor, [target]):
        full = prop.propagate(ct, KEY, boxes[:1], prompts=prompts, return_object_masks=True)
        early = prop.propagate(ct, KEY, boxes[:1], prompts=prompts, return_object_masks=True, stop_after_empty=K)
    nonempty = target.any(axis=(1, 2))
    lo = _expected_stop(nonempty, KEY, -1, 0, K, {KEY, z})
    hi = _expected_stop(nonempty, KEY, +1, d - 1, K, {KEY, z})
    assert (lo, hi) == (4 - K, z + K)
    assert full.mask[z].any() and not full.mask[KEY + 3:KEY + 7].any()  # the gap is there
    assert early.stops["forward"]["last_slice"] == hi and early.stops["backward"]["last_slice"] == lo
    assert np.array_equal(early.mask[lo:hi + 1], full.mask[lo:hi + 1])  # visited slices: the full run's
    assert not early.mask[:lo].any() and not early.mask[hi + 1:].any()
    assert np.array_equal(early.mask[z], full.mask[z]) and early.mask[z].any()  # the prompted slice was reached
    assert len(set(early.encoded_slices)) == len(early.encoded_slices)
    assert set(early.encoded_slices) <= set(range(lo, hi + 1))


# ---------------------------------------------------------------------------------------------
# mask prompts (medvol.anchor/4): a painted slice, sam2's add_new_mask
# ---------------------------------------------------------------------------------------------


def _painted(seg, z, label):
    """A clinician's outline of ``label`` on slice ``z``: the reference label, one pixel eroded at its
    top row (so it is not the label itself, as a hand-drawn outline is not)."""
    m = seg[z] == label
    top = np.nonzero(m.any(axis=1))[0][0]
    m = m.copy()
    m[top] = False
    return m


def _both_forms(z, obj, m):
    """The mask prompt as the product takes it (runs) and as the reference takes it (the array)."""
    from medvolcore.maskprompt import mask_prompt

    return mask_prompt(z, obj, m), {"slice": z, "object": obj, "mask": m}


@pytest.mark.parametrize("case_name", ["correction", "on-the-key-slice", "new-object+point", "range"])
def test_mask_prompt_is_sam2s_add_new_mask_bit_for_bit(prop, ref, tall, liver_plain, case_name):
    """Product (runs in the prompt) and reference (sam2's own ``add_new_mask`` with the array) give
    the same mask bit for bit; the mask changes the result and is what the object is on its slice."""
    ct, seg, boxes = tall
    z_range = None
    if case_name == "correction":
        z, obj = KEY + 5, 1
        mine, theirs = _both_forms(z, obj, _painted(seg, z, LIVER))
        extra = []
    elif case_name == "on-the-key-slice":  # the painted mask replaces the key box of object 1
        z, obj = KEY, 1
        mine, theirs = _both_forms(z, obj, _painted(seg, z, LIVER))
        extra = []
    elif case_name == "new-object+point":  # a new object seeded by a mask, corrected by a point elsewhere
        z, obj = KEY - 4, 2
        mine, theirs = _both_forms(z, obj, _painted(seg, z, SPLEEN))
        extra = [_prompt(KEY + 3, 2, points=[_centre(seg[KEY + 3] == LIVER) + [0]])]
    else:
        z, obj = 12, 1
        mine, theirs = _both_forms(z, obj, _painted(seg, z, LIVER))
        extra, z_range = [], (3, 15)
    r = prop.propagate(ct, KEY, boxes[:1], prompts=[mine] + extra, z_range=z_range, return_object_masks=True)
    mask, calls = ref.reference_propagate_prompts(prop, ct, KEY, boxes[:1], [theirs] + extra, z_range=z_range)
    assert np.array_equal(r.mask, mask), (
        f"Dice {_dice(r.mask, mask):.6f}; slices that differ: {sorted(set(np.nonzero(r.mask != mask)[0].tolist()))}")
    assert not np.array_equal(mask, liver_plain)
    assert _dice(r.object_masks[obj - 1][z], theirs["mask"]) > 0.8  # on its slice the object is the painted mask
    assert len(set(r.encoded_slices)) == len(r.encoded_slices) and r.encoder_calls < calls
    if z_range is not None:
        assert not r.mask[:z_range[0]].any() and not r.mask[z_range[1] + 1:].any()


def test_reference_mask_prompt_is_not_a_box(ref, prop, tall, liver_plain):
    """The reference's mask path is sam2's mask input, not the mask's box: the two masks differ."""
    ct, seg, boxes = tall
    m = _painted(seg, KEY, LIVER)
    as_mask, _ = ref.reference_propagate_prompts(prop, ct, KEY, boxes[:1], [{"slice": KEY, "object": 1, "mask": m}])
    assert not np.array_equal(as_mask, liver_plain)


def test_mask_prompt_on_a_cached_volume_encodes_nothing(prop, tall):
    """A volume's features kept in a FeatureStore: a re-propagation with a painted slice encodes 0
    slices (counted on the image encoder), and its mask is a new answer."""
    from medvolcore.maskprompt import mask_prompt
    from medvolcore.propagation import FeatureStore

    ct, seg, boxes = tall
    store = FeatureStore()
    first = prop.propagate(ct, KEY, boxes[:1], features=store)
    assert first.encoder_calls == first.slices_encoded == ct.shape[0] == len(store)
    z = KEY + 5
    again = prop.propagate(ct, KEY, boxes[:1], prompts=[mask_prompt(z, 1, _painted(seg, z, LIVER))], features=store)
    assert again.encoder_calls == 0 and again.slices_encoded == 0 and again.encoded_slices == ()
    assert not np.array_equal(again.mask, first.mask)


@pytest.mark.parametrize("prompts, match", [
    ([{"slice": KEY + 2, "object": 1, "mask": {"runs": []}}], "empty"),
    ([{"slice": KEY + 2, "object": 1, "mask": {"runs": [3000, 200]}}], "outside the 61×51 slice"),
    ([{"slice": 25, "object": 1, "mask": {"runs": [0, 5]}}], "outside the stack"),
    ([{"slice": KEY + 2, "object": 3, "mask": {"runs": [0, 5]}}], "object 3 does not exist"),
    ([{"slice": KEY + 2, "object": 1, "mask": {"runs": [0, 5]}, "box": [0, 0, 4, 4]}], "no box or points"),
    ([{"slice": KEY + 2, "object": 1, "points": [[3, 3, 1]]},
      {"slice": KEY + 2, "object": 1, "mask": {"runs": [0, 5]}}], "only input on its slice"),
], ids=["empty", "other-grid", "off-the-stack", "unknown-object", "with-a-box", "shares-a-slice"])
def test_bad_mask_prompts_are_refused(prop, tall, prompts, match):
    from medvolcore.errors import InputError

    ct, _, boxes = tall
    with pytest.raises(InputError, match=match):
        prop.propagate(ct, KEY, boxes[:1], prompts=prompts)
