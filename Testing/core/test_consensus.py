"""The consensus's arithmetic with hand-made masks (no model): confidence, agreement map, majority
mask, the compact sample records, and the anchor fields that carry them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from medvolcore.anchor import EvidenceAnchor
from medvolcore.consensus import (ABSENT, agreement_map, check_mask_mode, confidence, majority_mask, pair_agreement,
                                  sample_record)
from medvolcore.errors import InputError


def _box(shape, lo, hi):
    m = np.zeros(shape, bool)
    m[tuple(slice(a, b) for a, b in zip(lo, hi))] = True
    return m


SHAPE = (12, 10, 10)
A = _box(SHAPE, (2, 2, 2), (4, 6, 6))  # 2·4·4 = 32 voxels
B = _box(SHAPE, (3, 2, 2), (5, 6, 6))  # 32 voxels, 16 shared with A: Dice 0.5
C = _box(SHAPE, (9, 7, 7), (11, 9, 9))  # 8 voxels far away: Dice 0 with A and B


def test_pair_agreement_by_hand():
    assert pair_agreement(A, B) == pytest.approx(0.5)
    assert pair_agreement(A, A.copy()) == 1.0
    assert pair_agreement(A, C) == 0.0
    assert pair_agreement(np.zeros(SHAPE, bool), np.zeros(SHAPE, bool)) == 1.0  # both found nothing
    assert pair_agreement(A, np.zeros(SHAPE, bool)) == 0.0
    assert pair_agreement(ABSENT, ABSENT) == 1.0  # both said "not present"
    assert pair_agreement(ABSENT, A) == pair_agreement(A, ABSENT) == 0.0
    assert pair_agreement(ABSENT, np.zeros(SHAPE, bool)) == 0.0  # an answer with a place vs "not present"
    assert pair_agreement(None, A) == pair_agreement(None, ABSENT) == pair_agreement(None, None) == 0.0


def test_confidence_is_the_mean_pairwise_agreement():
    # pairs: A-A' 1, A-B .5, A-absent 0, A'-B .5, A'-absent 0, B-absent 0 → 2/6
    assert confidence([A, A.copy(), B, ABSENT]) == pytest.approx(2 / 6)
    # A-B .5, A-C 0, B-C 0 → 0.5/3; the far mask C also checks the crop to the union's box
    assert confidence([A, B, C]) == pytest.approx(0.5 / 3)
    assert confidence([ABSENT, ABSENT, ABSENT]) == 1.0
    assert confidence([A, A.copy(), A.copy()]) == 1.0
    assert confidence([ABSENT, A]) == 0.0
    assert confidence([A, A.copy(), None]) == pytest.approx(1 / 3)  # an unusable answer agrees with nothing
    assert confidence([np.zeros(SHAPE, bool)] * 2 + [ABSENT]) == pytest.approx(1 / 3)
    assert confidence([A]) is None and confidence([]) is None
    with pytest.raises(InputError):
        confidence([A, "maybe"])


def test_agreement_map_counts_the_samples_per_voxel_and_majority_is_more_than_half():
    agr = agreement_map([A, A.copy(), B, ABSENT, None])
    assert agr.dtype == np.uint8 and agr.shape == SHAPE
    np.testing.assert_array_equal(agr, 2 * A.astype(np.uint8) + B)
    assert int(agr.max()) == 3 and set(np.unique(agr)) == {0, 1, 2, 3}
    # 5 samples: more than half is 3 or more → A ∩ B only
    np.testing.assert_array_equal(majority_mask(agr, 5), (A & B).astype(np.uint8))
    # 4 samples: 2 of 4 is not a majority
    np.testing.assert_array_equal(majority_mask(agreement_map([A, A.copy(), B, ABSENT]), 4), (A & B).astype(np.uint8))
    np.testing.assert_array_equal(majority_mask(agreement_map([A, B, ABSENT]), 3), (A & B).astype(np.uint8))
    assert not majority_mask(agreement_map([A, C, ABSENT, ABSENT]), 4).any()
    only_absent = agreement_map([ABSENT, None], shape=SHAPE)
    assert only_absent.shape == SHAPE and not only_absent.any()
    with pytest.raises(InputError, match="shape"):
        agreement_map([ABSENT, ABSENT])
    with pytest.raises(InputError):
        check_mask_mode("mean")


def test_sample_records_are_compact():
    present = EvidenceAnchor(3, [[10, 20, 29, 39]], [100, 200])
    absent = EvidenceAnchor.absent_for([100, 200])
    assert sample_record(1, present, signal={"answer_mean_prob": 0.81}, mask_voxels=77) == {
        "sample": 1, "slice": 3, "boxes_norm": [[100.0, 100.0, 300.0, 200.0]], "answer_mean_prob": 0.81,
        "mask_voxels": 77}
    assert sample_record(2, absent) == {"sample": 2, "absent": True}
    rec = sample_record(3, None, error="slice 9 is not one of\nthe shown slices")
    assert rec == {"sample": 3, "unusable": "slice 9 is not one of the shown slices"}


def test_anchor_writes_signal_confidence_samples_only_when_set_and_readers_ignore_them():
    plain = EvidenceAnchor(3, [[10, 20, 29, 39]], [100, 200], source="grounder")
    d = plain.to_dict()
    assert not {"confidence", "samples", "answer_mean_prob", "answer_mean_logprob"} & set(d)
    rich = EvidenceAnchor(3, [[10, 20, 29, 39]], [100, 200], source="grounder",
                          signal={"answer_mean_logprob": -0.2, "answer_mean_prob": 0.818731, "answer_scored_tokens": 7},
                          confidence=0.123456, samples=[{"sample": 1, "slice": 3}, {"sample": 2, "absent": True}])
    r = rich.to_dict()
    assert r["confidence"] == 0.1235 and r["samples"][1] == {"sample": 2, "absent": True}
    assert r["answer_mean_prob"] == 0.818731 and r["answer_scored_tokens"] == 7
    absent = EvidenceAnchor.absent_for([100, 200], source="grounder", confidence=1.0, samples=[{"sample": 1, "absent": True}])
    assert absent.to_dict()["confidence"] == 1.0 and absent.to_dict()["schema"] == "medvol.anchor/3"
    extra = {"confidence": 0.5, "samples": [{"sample": 1}], "answer_mean_prob": 0.7, "answer_mean_logprob": -0.35}
    v2 = dict(r, schema="medvol.anchor/2", z_range=[1, 5])
    for d in (dict(r), v2, dict(absent.to_dict(), **extra)):
        back = EvidenceAnchor.from_dict(json.loads(json.dumps(d)))
        # they describe how the model answered, not an input: read, never carried into a new file
        assert back.confidence is None and back.samples is None and back.signal is None
        assert not {"confidence", "samples", "answer_mean_prob"} & set(back.to_dict())


def test_the_slicer_panel_offers_the_engines_range():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "MedVolR1Slicer"))
    try:
        from MedVolR1SlicerLib.consensus import MAX_CONSENSUS
    finally:
        sys.path.pop(0)
    from medvolcore.grounder import MAX_SAMPLES

    assert MAX_CONSENSUS == MAX_SAMPLES == 8
