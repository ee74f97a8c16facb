"""MedSAM2 propagation (medvolcore.propagation) on CPU with small random-weight models.

Random weights make arbitrary masks, so the assertions do not judge segmentation quality:
they compare against the MedSAM2-script-style reference loop on the same weights
(Testing/reference/medsam2.py), against single-box runs (union semantics), and
check coverage, windows, caching, determinism, cancellation and errors.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import torch  # noqa: E402  (torch and sam2 are installed by the bootstrap: a missing one must fail, not skip)
import sam2  # noqa: F401,E402

from medvolcore.errors import CancelledError, CheckpointError, InputError  # noqa: E402
from medvolcore.propagation import (  # noqa: E402
    MedSAM2Frames,
    MedSAM2Propagator,
    PropagationResult,
    keep_largest_component,
    medsam2_frame,
)
from reference import medsam2 as reference  # noqa: E402  (Testing/reference: MedSAM2's own loop)
from reference.controlled_masks import controlled_masks  # noqa: E402

SIZE = 64  # model image size for tests
LIVER, SPLEEN, STOMACH = 5, 1, 6


def _canonical(path, dtype):
    """Canonical stack (z S→I, y A→P, x R→L) of an RAS NIfTI, by transposition and flips only."""
    import nibabel as nib

    img = nib.load(str(path))
    assert nib.aff2axcodes(img.affine) == ("R", "A", "S")
    a = np.asarray(img.dataobj, dtype=dtype)
    return a.transpose(2, 1, 0)[::-1, ::-1, ::-1]


def _bbox(m):
    ys, xs = np.nonzero(m)
    return [int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())]


@pytest.fixture(scope="module")
def case(ct_sm_path, seg_sm_path):
    """8 upper-abdomen slices of example_ct_sm, every 2nd row/column (8 × 51 × 61), with organ boxes."""
    ct = _canonical(ct_sm_path, np.float32)[4:12, ::2, ::2]
    seg = _canonical(seg_sm_path, np.int16)[4:12, ::2, ::2]
    k = 4
    boxes = [_bbox(seg[k] == lab) for lab in (LIVER, SPLEEN, STOMACH)]
    return np.ascontiguousarray(ct), k, boxes


@pytest.fixture(scope="module")
def prop():
    return MedSAM2Propagator.from_random(0, image_size=SIZE)


@pytest.fixture(scope="module")
def ref():
    return reference


@pytest.fixture(scope="module")
def baseline(prop, case):
    """One-box run on the whole stack, with every progress call recorded."""
    stack, k, boxes = case
    calls = []
    r = prop.propagate(stack, k, boxes[:1], progress=lambda d, t, m: calls.append((d, t, m)))
    return r, calls


# ---------------------------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------------------------


def test_import_is_cheap():
    code = (
        "import sys, medvolcore.propagation; "
        "print(sorted(m for m in ('torch', 'sam2', 'transformers', 'SimpleITK', 'hydra') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_model_configuration(prop):
    p = prop.predictor
    assert p.fill_hole_area == 0  # sam2's builder sets 8; CPU and GPU must agree
    assert p.image_size == SIZE and prop.image_size == SIZE
    # sam2's other postprocessing defaults are kept
    assert p.sam_mask_decoder.dynamic_multimask_via_stability
    assert p.binarize_mask_from_pts_for_mem_enc
    assert not p.training
    assert prop.device.type == "cpu"


@pytest.mark.parametrize("size", [48, 100, 0, -64, 4096, "64", 64.0, True])
def test_image_size_is_validated(size):
    with pytest.raises(InputError, match="image_size"):
        MedSAM2Propagator.from_random(0, image_size=size)


def test_seeded_random_weights(prop):
    torch.manual_seed(1234)
    expected_next = torch.rand(3)
    torch.manual_seed(1234)
    same = MedSAM2Propagator.from_random(0, image_size=SIZE)
    assert torch.equal(torch.rand(3), expected_next), "from_random disturbed the caller's torch RNG"
    other = MedSAM2Propagator.from_random(1, image_size=SIZE)
    a, b, c = (m.predictor.state_dict() for m in (prop, same, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_checkpoint_roundtrip_and_errors(prop, case, baseline, tmp_path):
    stack, k, boxes = case
    sd = prop.predictor.state_dict()
    good = tmp_path / "good.pt"
    torch.save({"model": sd}, good)
    loaded = MedSAM2Propagator.from_checkpoint(good, image_size=SIZE)
    assert np.array_equal(loaded.propagate(stack, k, boxes[:1]).mask, baseline[0].mask)

    bad_sd = dict(sd)
    missing = "image_encoder.trunk.pos_embed"
    del bad_sd[missing]
    bad_sd["extra.weight"] = torch.zeros(2)
    bad_sd["no_mem_embed"] = torch.zeros(1, 1, 7)
    bad = tmp_path / "bad.pt"
    torch.save({"model": bad_sd}, bad)
    with pytest.raises(CheckpointError) as ei:
        MedSAM2Propagator.from_checkpoint(bad, image_size=SIZE)
    msg = str(ei.value)
    assert "not a MedSAM2 checkpoint" in msg and "1 missing keys" in msg and missing in msg
    assert "extra.weight" in msg and "no_mem_embed" in msg and "wrong shape" in msg

    no_model = tmp_path / "nomodel.pt"
    torch.save({"state_dict": {}}, no_model)
    with pytest.raises(CheckpointError, match="'model'"):
        MedSAM2Propagator.from_checkpoint(no_model)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a loadable"):
        MedSAM2Propagator.from_checkpoint(garbage)
    with pytest.raises(CheckpointError, match="does not exist"):
        MedSAM2Propagator.from_checkpoint(tmp_path / "absent.pt")


# ---------------------------------------------------------------------------------------------
# frames and inference state
# ---------------------------------------------------------------------------------------------


def test_frames_are_lazy_and_match_medsam2_preprocessing(case, ref):
    stack, _, _ = case
    frames = MedSAM2Frames(stack, SIZE)
    assert len(frames) == stack.shape[0] and frames.loaded == []
    eager = ref.medsam2_style_frames(stack, SIZE)  # MedSAM2's script: float64, cast by sam2
    for z in (0, 3, len(frames) - 1):
        f = frames[z]
        assert f.dtype == torch.float32 and tuple(f.shape) == (3, SIZE, SIZE)
        assert torch.equal(f, eager[z].float())
    assert frames.loaded == [0, 3, len(frames) - 1]
    assert np.array_equal(medsam2_frame(stack[3], SIZE), frames[3].numpy())
    with pytest.raises(IndexError):
        frames[len(frames)]


def test_state_has_the_same_keys_as_sam2_init_state(prop, case, tmp_path):
    from PIL import Image

    for i in range(2):
        Image.fromarray(np.full((24, 32, 3), 40 * i, np.uint8)).save(tmp_path / f"{i:05d}.jpg")
    stock = prop.predictor.init_state(str(tmp_path))
    frames = MedSAM2Frames(case[0], SIZE)
    ours = prop.predictor.init_state_from_frames(frames, case[0].shape[1], case[0].shape[2])
    assert list(ours) == list(stock), "sam2's init_state keys changed; update init_state_from_frames"
    for key in stock:
        assert type(ours[key]) is type(stock[key]) or key == "images", key
    assert ours["cached_features"] == {} and frames.encoded == []  # no warm-up encode
    assert ours["num_frames"] == len(frames)
    assert (ours["video_height"], ours["video_width"]) == case[0].shape[1:]


# ---------------------------------------------------------------------------------------------
# propagation
# ---------------------------------------------------------------------------------------------


def test_result_shape_coverage_and_encoding(case, baseline):
    stack, k, _ = case
    r, calls = baseline
    d = stack.shape[0]
    assert isinstance(r, PropagationResult)
    assert r.mask.shape == stack.shape and r.mask.dtype == np.uint8
    assert set(np.unique(r.mask)) <= {0, 1}
    assert r.key_slice == k and r.slice_range == (0, d - 1) and r.num_objects == 1
    # progress: every slice exactly once, in order of completion: forward then backward
    assert [c[0] for c in calls] == list(range(1, d + 1)) and {c[1] for c in calls} == {d}
    seen = [int(re.match(r"slice (\d+)", c[2]).group(1)) for c in calls]
    assert seen == list(range(k, d)) + list(range(k - 1, -1, -1))
    # one encoder call per slice, the key slice first
    assert r.encoder_calls == r.slices_encoded == d
    assert sorted(r.encoded_slices) == list(range(d)) and r.encoded_slices[0] == k
    assert r.seconds > 0 and r.seconds_per_slice == pytest.approx(r.seconds / d)
    assert r.object_masks is None


def test_deterministic(prop, case, baseline):
    stack, k, boxes = case
    assert np.array_equal(prop.propagate(stack, k, boxes[:1]).mask, baseline[0].mask)


def test_one_box_equals_reference_loop(prop, case, baseline, ref):
    stack, k, boxes = case
    mask, calls = ref.reference_propagate(prop, stack, k, boxes[:1])
    assert calls == stack.shape[0] + 2  # warm-up of frame 0 + key slice re-encoded after reset
    assert np.array_equal(baseline[0].mask, mask)  # bit-identical: Dice 1.0


def test_three_boxes_union_and_single_encoding(prop, case, ref):
    stack, k, boxes = case
    d = stack.shape[0]
    r = prop.propagate(stack, k, boxes, return_object_masks=True)
    assert r.encoder_calls == r.slices_encoded == d  # not per object, not per direction
    assert r.object_masks.shape == (3,) + stack.shape and r.object_masks.dtype == bool
    assert np.array_equal(r.mask, r.object_masks.any(axis=0).astype(np.uint8))
    for i, box in enumerate(boxes):  # each object is what a single-box run gives
        assert np.array_equal(r.object_masks[i], prop.propagate(stack, k, [box]).mask.astype(bool))
    mask, calls = ref.reference_propagate(prop, stack, k, boxes)
    assert calls == 3 * (d + 2)
    assert np.array_equal(r.mask, mask)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_window_and_edge_key_slices(prop, case, baseline, where):
    stack, _, boxes = case
    d = stack.shape[0]
    k = {"first": 0, "middle": 4, "last": d - 1}[where]
    box = [_bbox(np.ones((4, 6)))]  # a small box in the top-left corner (valid on every slice)
    full = prop.propagate(stack, k, box)
    assert full.slice_range == (0, d - 1) and full.encoder_calls == d
    assert sorted(full.encoded_slices) == list(range(d))
    seen = []
    win = prop.propagate(stack, k, box, window=2, progress=lambda dn, t, m: seen.append(int(m.split()[1])))
    lo, hi = max(0, k - 2), min(d - 1, k + 2)
    assert win.slice_range == (lo, hi)
    assert sorted(seen) == list(range(lo, hi + 1))
    assert sorted(win.encoded_slices) == list(range(lo, hi + 1)) and win.encoder_calls == hi - lo + 1
    outside = np.ones(d, bool)
    outside[lo : hi + 1] = False
    assert not win.mask[outside].any()
    # sam2's tracking is causal: inside the window the result is the full run's
    assert np.array_equal(win.mask[lo : hi + 1], full.mask[lo : hi + 1])
    if where == "first":  # sam2 skips reverse tracking from frame 0; check against the reference
        assert np.array_equal(full.mask, reference.reference_propagate(prop, stack, k, box)[0])


def test_window_zero_is_the_key_slice_only(prop, case):
    stack, k, boxes = case
    r = prop.propagate(stack, k, boxes[:2], window=0)
    assert r.slice_range == (k, k) and r.encoded_slices == (k,) and r.encoder_calls == 1
    assert not np.delete(r.mask, k, axis=0).any()


def test_feature_cache_is_bounded_and_pins_the_key_slice(prop, case, monkeypatch):
    stack, k, boxes = case
    pred = prop.predictor
    original = pred._get_image_feature
    sizes = []

    def spy(state, frame_idx, batch_size):
        out = original(state, frame_idx, batch_size)
        sizes.append((len(state["cached_features"]), k in state["cached_features"]))
        return out

    monkeypatch.setattr(pred, "_get_image_feature", spy, raising=False)
    r = prop.propagate(stack, k, boxes)
    assert sizes and max(s for s, _ in sizes) <= 2 and all(pinned for _, pinned in sizes)
    assert r.encoder_calls == stack.shape[0]


def test_largest_component(prop, case):
    m = np.zeros((5, 9, 9), bool)
    m[0:3, 0:3, 0:3] = True  # 27 voxels
    m[4, 7:9, 7:9] = True  # 4 voxels, separate
    m[3, 3, 3] = True  # touches the big one diagonally (26-connectivity)
    kept = keep_largest_component(m)
    assert kept.sum() == 28 and not kept[4].any()
    assert not keep_largest_component(np.zeros((2, 2, 2), bool)).any()

    stack, k, boxes = case
    plain = prop.propagate(stack, k, boxes, return_object_masks=True)
    lcc = prop.propagate(stack, k, boxes, largest_component=True, return_object_masks=True)
    from scipy import ndimage

    counts = [ndimage.label(m, structure=np.ones((3, 3, 3)))[1] for m in plain.object_masks]
    assert max(counts) > 1, "test weights give single-component masks; pick another seed/case"
    for i in range(len(boxes)):
        _, n = ndimage.label(lcc.object_masks[i], structure=np.ones((3, 3, 3)))
        assert n <= 1
        assert not (lcc.object_masks[i] & ~plain.object_masks[i]).any()
        assert np.array_equal(lcc.object_masks[i], keep_largest_component(plain.object_masks[i]))
    assert np.array_equal(lcc.mask, lcc.object_masks.any(axis=0).astype(np.uint8))


def test_cancel_and_reuse(prop, case, baseline):
    stack, k, boxes = case
    d = stack.shape[0]
    ev = threading.Event()

    def progress(done, total, message):
        if done == 2:
            ev.set()

    with pytest.raises(CancelledError, match=f"after 2 of {d} slices"):
        prop.propagate(stack, k, boxes[:1], progress=progress, cancel=ev)
    with pytest.raises(CancelledError, match=f"after 0 of {d} slices"):
        prop.propagate(stack, k, boxes[:1], cancel=lambda: True)
    # still usable, same answer
    assert np.array_equal(prop.propagate(stack, k, boxes[:1], cancel=threading.Event()).mask, baseline[0].mask)


def test_sam2_progress_bar_is_silenced(prop, case, capfd):
    import sam2.sam2_video_predictor as vp
    from tqdm import tqdm

    stack, k, boxes = case
    prop.propagate(stack, k, boxes[:1], window=1)
    assert "propagate in video" not in capfd.readouterr().err
    assert vp.tqdm is tqdm  # restored afterwards


@pytest.mark.parametrize(
    "key, boxes, kwargs, match",
    [
        (-1, [[0, 0, 5, 5]], {}, "key slice -1 is outside"),
        (8, [[0, 0, 5, 5]], {}, "key slice 8 is outside"),
        (1.5, [[0, 0, 5, 5]], {}, "key_slice must be an integer"),
        (True, [[0, 0, 5, 5]], {}, "key_slice must be an integer"),
        (2, [], {}, "at least one box"),
        (2, None, {}, "at least one box"),
        (2, [0, 0, 5, 5], {}, "wrap a single box"),
        (2, [[0, 0, 61, 5]], {}, "box 0 .* not an inclusive pixel box"),
        (2, [[0, 0, 5, 51]], {}, "box 0"),
        (2, [[0, 0, 5, 5], [-1, 0, 5, 5]], {}, "box 1"),
        (2, [[6, 0, 5, 5]], {}, "box 0"),
        (2, [[0, 7, 5, 5]], {}, "box 0"),
        (2, [[0, 0, 5]], {}, r"box 0 must be \[x0, y0, x1, y1\]"),
        (2, [[0, 0, 5.5, 5]], {}, "integer pixel index"),
        (2, [[0, 0, 5, 5]], {"window": -1}, "window must be"),
        (2, [[0, 0, 5, 5]], {"window": 1.0}, "window must be"),
        (2, [[0, 0, 5, 5]], {"hu_window": "nonsense"}, "unknown window"),
        (2, [[0, 0, 5, 5]], {"cancel": 3}, "cancel must be"),
    ],
)
def test_invalid_inputs(prop, case, key, boxes, kwargs, match):
    stack = case[0]
    with pytest.raises(InputError, match=match):
        prop.propagate(stack, key, boxes, **kwargs)


def test_invalid_stacks(prop, case):
    with pytest.raises(InputError, match="3-D"):
        prop.propagate(case[0][0], 0, [[0, 0, 1, 1]])
    bad = case[0].copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(InputError, match="NaN"):
        prop.propagate(bad, 0, [[0, 0, 1, 1]])


def test_propagate_many_shares_features_and_matches_single_runs(prop, case):
    """Prompts on one volume (a GRPO group's rollouts): same masks as separate calls, but every
    slice of the union of their windows is encoded once."""
    stack, _, boxes = case
    prompts = [(2, boxes[:1]), (4, boxes[1:3]), (5, boxes[:1]), (2, boxes[2:3])]
    singles = [prop.propagate(stack, k, b, window=1) for k, b in prompts]
    counted = []
    hook = prop.predictor.image_encoder.register_forward_pre_hook(lambda m, i: counted.append(1))
    try:
        group = prop.propagate_many(stack, prompts, window=1)
    finally:
        hook.remove()
    assert [r.slice_range for r in group] == [r.slice_range for r in singles]
    for g, s in zip(group, singles):
        assert np.array_equal(g.mask, s.mask)
    union = {z for k, _ in prompts for z in range(max(0, k - 1), min(stack.shape[0] - 1, k + 1) + 1)}
    assert len(counted) == len(union) == 6  # windows [1,3], [3,5], [4,6], [1,3]: slices 1..6 once each
    assert sum(r.encoder_calls for r in group) == len(union)
    assert sum(r.encoder_calls for r in singles) == sum(r.slices_propagated for r in singles) == 12
    assert group[3].encoder_calls == 0  # the last prompt's window was already encoded


# ---------------------------------------------------------------------------------------------
# early stop (stop_after_empty) and objects tracked as one batch
# ---------------------------------------------------------------------------------------------

KIDNEY_RIGHT, KIDNEY_LEFT = 2, 3


@pytest.fixture(scope="module")
def kidneys(ct_path, seg_path):
    """The upper 50 slices of the 112-slice CT (every 2nd row/column), the kidney labels, key slice 30.

    Right kidney: slices 10..44, left kidney: 7..39 (so they end at different slices both ways)."""
    ct = np.ascontiguousarray(_canonical(ct_path, np.float32)[:50, ::2, ::2])
    seg = np.ascontiguousarray(_canonical(seg_path, np.int16)[:50, ::2, ::2])
    k = 30
    labels = np.stack([seg == KIDNEY_RIGHT, seg == KIDNEY_LEFT])
    boxes = [_bbox(labels[0, k]), _bbox(labels[1, k])]
    return ct, k, boxes, labels


@pytest.fixture(scope="module")
def kidneys_full(prop, kidneys):
    """Full propagation (K = 0) with the tracked masks made to follow the kidney labels."""
    ct, k, boxes, labels = kidneys
    with controlled_masks(prop.predictor, list(labels)) as steps:
        r = prop.propagate(ct, k, boxes, return_object_masks=True)
    return r, steps


def _expected_stop(nonempty: np.ndarray, k: int, step: int, edge: int, K: int) -> int:
    """The last slice an object visits in one direction: after K empty slices past the key slice."""
    run, z = 0, k
    while z != edge:
        z += step
        run = 0 if nonempty[z] else run + 1
        if run == K:
            return z
    return edge


def test_controlled_masks_follow_the_labels(kidneys, kidneys_full):
    ct, k, _, labels = kidneys
    r, _ = kidneys_full
    got = r.object_masks.any(axis=(2, 3))
    want = labels.any(axis=(2, 3))
    want[:, k] = got[:, k]  # the key slice is sam2's own answer to the box
    assert np.array_equal(got, want)
    assert r.slice_range == r.window_range == (0, ct.shape[0] - 1) and r.stop_after_empty == 0
    assert not r.stops["forward"]["stopped_early"] and not r.stops["backward"]["stopped_early"]


@pytest.mark.slow  # a full propagation of the 112-slice CT per K (and the fixture's K = 0 run)
@pytest.mark.parametrize("K, batch", [(1, True), (3, False)])
def test_early_stop_visits_target_plus_k_and_keeps_the_masks(prop, kidneys, kidneys_full, K, batch):
    ct, k, boxes, labels = kidneys
    full, _ = kidneys_full
    d = ct.shape[0]
    nonempty = full.object_masks.any(axis=(2, 3))
    ends = {"forward": [_expected_stop(nonempty[i], k, +1, d - 1, K) for i in range(2)],
            "backward": [_expected_stop(nonempty[i], k, -1, 0, K) for i in range(2)]}
    assert ends == {"forward": [44 + K, 39 + K], "backward": [10 - K, 7 - K]}  # label ends ± K
    calls = []
    with controlled_masks(prop.predictor, list(labels)) as steps:
        r = prop.propagate(ct, k, boxes, return_object_masks=True, stop_after_empty=K, batch_objects=batch,
                           progress=lambda dn, t, m: calls.append((dn, t, m)))
    lo, hi = min(ends["backward"]), max(ends["forward"])
    assert r.slice_range == (lo, hi) and r.window_range == (0, d - 1) and r.stop_after_empty == K
    assert r.stops["forward"] == {"last_slice": hi, "slices": hi - k, "stopped_early": True,
                                  "objects_stopped": sorted([[0, ends["forward"][0]], [1, ends["forward"][1]]])}
    assert r.stops["backward"] == {"last_slice": lo, "slices": k - lo, "stopped_early": True,
                                   "objects_stopped": sorted([[0, ends["backward"][0]], [1, ends["backward"][1]]])}
    # each object is tracked exactly up to its own end; the other one goes on without it
    for i in range(2):
        tracked = sorted(z for z, objs in steps if i in objs)
        assert tracked == [z for z in range(ends["backward"][i], ends["forward"][i] + 1) if z != k]
    if batch:  # two objects share a step while both are tracked, then one goes on alone
        assert {len(objs) for _, objs in steps} == {1, 2}
    else:
        assert {len(objs) for _, objs in steps} == {1}
    # visited slices are encoded once, the rest never
    assert sorted(r.encoded_slices) == list(range(lo, hi + 1)) and r.encoder_calls == hi - lo + 1
    # the masks are the full run's wherever this run went, and empty elsewhere
    for i in range(2):
        a, b = ends["backward"][i], ends["forward"][i]
        assert np.array_equal(r.object_masks[i, a:b + 1], full.object_masks[i, a:b + 1])
        assert not r.object_masks[i, :a].any() and not r.object_masks[i, b + 1:].any()
    assert np.array_equal(r.mask[lo:hi + 1], full.mask[lo:hi + 1])
    # the target did end there, so nothing was lost against the full run
    assert np.array_equal(r.mask, full.mask)
    # progress: one call per visited slice, one per skipped run, and it ends at the total
    assert [c[0] for c in calls] == sorted(c[0] for c in calls) and calls[-1][:2] == (d, d)
    assert sum("skipped" in c[2] for c in calls) == 2


@pytest.mark.slow
def test_early_stop_never_cuts_a_non_empty_run_or_the_key_slice(prop, kidneys):
    """A target with a gap of 2 empty slices: K=2 stops at the gap, K=3 follows it past the gap."""
    ct, k, boxes, labels = kidneys
    gappy = labels[:1].copy()
    gappy[0, 36:38] = False  # slices 36, 37 empty, 38..44 non-empty again
    key_empty = labels[:1].copy()
    key_empty[0, k:] = False  # nothing after the key slice, except that the key slice keeps its box
    with controlled_masks(prop.predictor, [gappy[0]]):
        r2 = prop.propagate(ct, k, boxes[:1], stop_after_empty=2, return_object_masks=True)
        r3 = prop.propagate(ct, k, boxes[:1], stop_after_empty=3, return_object_masks=True)
        r0 = prop.propagate(ct, k, boxes[:1], return_object_masks=True)
    assert r2.stops["forward"]["last_slice"] == 37 and not r2.mask[38:].any()
    assert r3.stops["forward"]["last_slice"] == 44 + 3
    assert np.array_equal(r3.mask, r0.mask) and r0.mask[38:45].any(axis=(1, 2)).all()
    with controlled_masks(prop.predictor, [key_empty[0]]):
        r = prop.propagate(ct, k, boxes[:1], stop_after_empty=1)
    assert r.mask[k].any()  # the key slice is sam2's answer to the box, never dropped
    assert r.stops["forward"]["last_slice"] == k + 1 and r.stops["forward"]["stopped_early"]


def test_early_stop_within_a_window(prop, kidneys):
    ct, k, boxes, labels = kidneys
    with controlled_masks(prop.predictor, list(labels)):
        r = prop.propagate(ct, k, boxes, window=5, stop_after_empty=1)
    assert r.window_range == (25, 35) and r.slice_range == (25, 35)  # the kidneys fill the window
    assert not r.stops["forward"]["stopped_early"] and r.stops["forward"]["objects_stopped"] == []


@pytest.mark.slow
def test_dropping_an_object_does_not_change_the_others(prop, kidneys):
    """Object 0 follows the label and ends; object 1 keeps sam2's own (random-weight) masks."""
    ct, k, boxes, labels = kidneys
    with controlled_masks(prop.predictor, [labels[0], None]):
        full = prop.propagate(ct, k, boxes, return_object_masks=True)
        early = prop.propagate(ct, k, boxes, return_object_masks=True, stop_after_empty=1)
        one_by_one = prop.propagate(ct, k, boxes, return_object_masks=True, stop_after_empty=1, batch_objects=False)
    assert early.slice_range == (0, ct.shape[0] - 1)  # object 1 never ends with random weights
    assert early.stops["forward"]["objects_stopped"] == [[0, 45]]
    assert np.array_equal(early.object_masks[1], full.object_masks[1])
    assert np.array_equal(early.object_masks[0, 9:46], full.object_masks[0, 9:46])
    assert np.array_equal(one_by_one.object_masks, early.object_masks)


def test_batched_tracking_gives_the_same_masks(prop, case):
    stack, k, boxes = case
    batched = prop.propagate(stack, k, boxes, return_object_masks=True)
    single = prop.propagate(stack, k, boxes, return_object_masks=True, batch_objects=False)
    assert batched.batched and not single.batched
    assert np.array_equal(batched.object_masks, single.object_masks)


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, None, 10**6])
def test_stop_after_empty_is_validated(prop, case, bad):
    stack, k, boxes = case
    with pytest.raises(InputError, match="stop_after_empty"):
        prop.propagate(stack, k, boxes[:1], stop_after_empty=bad)
