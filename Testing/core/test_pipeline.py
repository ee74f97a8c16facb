"""The Pipeline (medvolcore.pipeline), end to end on the tiny preset (CPU): segment, repropagate, a
given propagator, "not present", a consensus's G answers and several targets sharing MedSAM2's slice
features.

The tiny pipeline, the carried sample and the canned answers here are also used by the command
line's, the job's, the worker's and batch's tests of the same features (``core.test_pipeline``)."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from medvolcore.grounder import QwenVLGrounder
from medvolcore.pipeline import Pipeline, as_stack
from medvolcore.propagation import MedSAM2Propagator
from medvolcore.resources import load_json, resource_path

from core.test_grounder import QUERIES, tiny_dir  # noqa: F401  (a fixture)

SAMPLE = resource_path("samples", load_json("samples", "samples.json")["demo"]["file"])


@pytest.fixture(scope="module")
def tiny():
    return Pipeline("tiny", device="cpu").load()


def test_segment_tiny_on_sample(tiny):
    stack = as_stack(SAMPLE)
    seg = tiny.segment(stack, "the organ that secretes bile")
    assert seg.mask.shape == stack.volume.shape and seg.mask.dtype == np.uint8
    assert np.array_equal(stack.to_stack(seg.mask), seg.mask_stack)
    assert seg.anchor.slice in stack.sample_indices(64)
    assert seg.smoke and any("smoke" in n for n in seg.notes)
    assert seg.anchor.world and seg.anchor.source == "grounder"
    assert {"ground_s", "propagate_s", "total_s"} <= set(seg.timings)


def test_second_call_reuses_loaded_models(tiny):
    g, p = tiny.grounder, tiny.propagator
    tiny.segment(SAMPLE, "the organ that secretes bile")
    assert tiny.grounder is g and tiny.propagator is p


def test_repropagate_user_anchor(tiny):
    stack = as_stack(SAMPLE)
    seg = tiny.segment(stack, "the liver")
    edited = seg.anchor.to_dict()
    edited["boxes"] = [[10, 10, 40, 40]]
    del edited["world"]
    edited["source"] = "user"
    again = tiny.repropagate(stack, edited)
    assert again.anchor.boxes == [[10, 10, 40, 40]] and again.anchor.slice == seg.anchor.slice
    assert again.mask.shape == stack.volume.shape


def test_pipeline_with_a_given_propagator(tiny):
    """Evaluation swaps in another MedSAM2 (a checkpoint or other random weights)."""
    from medvolcore.propagation import MedSAM2Propagator

    other = MedSAM2Propagator.from_random(7, image_size=64)
    pipe = Pipeline("tiny", device="cpu", propagator=other)
    assert pipe.propagator is other
    stack = as_stack(SAMPLE)
    anchor = tiny.segment(stack, "the liver").anchor
    mine = pipe.repropagate(stack, anchor.to_dict(), stop_after_empty=0)  # every slice (no early stop)
    theirs = tiny.repropagate(stack, anchor.to_dict(), stop_after_empty=0)
    assert mine.propagation.slices_encoded == stack.depth
    assert not np.array_equal(mine.mask, theirs.mask)  # other weights, other mask


def test_other_language_query_passes_through(tiny):
    seg = tiny.segment(SAMPLE, "el órgano que secreta la bilis")
    assert seg.anchor.slice in as_stack(SAMPLE).sample_indices(64)


# ---- "not present" ------------------------------------------------------------------------------

ABSENT = "<think>no kidney cyst on any shown slice</think><answer>[]</answer>"


def test_absent_answer_gives_an_empty_result_and_propagates_nothing(tiny, monkeypatch):
    stack = as_stack(SAMPLE)
    prop = tiny.propagator
    monkeypatch.setattr(tiny.grounder, "_generate_text", lambda *a, **k: (ABSENT, {"new_tokens": 12}))
    monkeypatch.setattr(prop, "propagate", lambda *a, **k: pytest.fail("an absent anchor was propagated"))
    seg = tiny.segment(stack, "the kidney that contains the cyst")
    assert seg.absent and seg.anchor.absent and seg.anchor.slice is None and seg.anchor.boxes == []
    assert seg.mask.shape == stack.volume.shape and seg.mask.dtype == np.uint8 and not seg.mask.any()
    assert seg.mask_stack.shape == stack.data.shape and not seg.mask_stack.any()
    assert "not found in this CT: the kidney that contains the cyst" in seg.notes
    assert seg.timings["slices_encoded"] == 0 and seg.summary()["absent"] is True
    assert seg.reasoning == "no kidney cyst on any shown slice"
    d = seg.anchor.to_dict()
    assert d["schema"] == "medvol.anchor/3" and d["absent"] is True and d["slice"] is None and d["boxes"] == []


def test_an_absent_anchor_cannot_be_repropagated(tiny):
    from medvolcore.anchor import EvidenceAnchor
    from medvolcore.errors import AnchorError

    stack = as_stack(SAMPLE)
    absent = EvidenceAnchor.absent_for([stack.width, stack.height], query="the brain", source="grounder")
    with pytest.raises(AnchorError, match="not in this volume: there is nothing to propagate"):
        tiny.repropagate(stack, absent.to_dict())


# ---- consensus: G answers, one encoding per slice, the agreement map and the confidence ---------------

@pytest.fixture(scope="module")
def ct4(tmp_path_factory, small_ct):
    """4 slices of the real CT (every voxel kept, affine shifted): each propagation stays cheap."""
    img = nib.load(str(small_ct[0]))
    aff = img.affine.copy()
    aff[:3, 3] = img.affine[:3, :3] @ [0, 0, 2] + img.affine[:3, 3]
    path = tmp_path_factory.mktemp("ct4") / "ct4.nii.gz"
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj)[:, :, 2:6], aff, img.header), str(path))
    return path


def _answer_text(z, box, think="here"):
    return f'<think>{think}</think><answer>[{{"slice": {z}, "bbox_2d_list": [{json.dumps(box)}]}}]</answer>'


def _canned_samples(monkeypatch, grounder, greedy: str, samples):
    """The greedy answer and samples 2..G as canned texts (the grounder's two generation seams)."""
    monkeypatch.setattr(grounder, "_generate_text", lambda *a, **k: (greedy, {"new_tokens": 9}))

    def fake(inputs, shown, n, **k):
        assert n == len(samples)
        return [(t, {"answer_signal": {"answer_mean_prob": 0.5}}) for t in samples], {"prefill_s": 0.0}

    monkeypatch.setattr(grounder, "_generate_samples", fake)


GREEDY = _answer_text(1, [200, 200, 600, 600])
OTHER = _answer_text(2, [300, 250, 700, 650])


def test_consensus_encodes_each_slice_once_and_maps_the_agreement(tiny, monkeypatch, ct4):
    stack = as_stack(ct4)
    _canned_samples(monkeypatch, tiny.grounder, GREEDY, [GREEDY, OTHER, ABSENT])
    seg = tiny.segment(stack, "the liver", stop_after_empty=0, consensus=4, consensus_mask="majority")
    assert sorted(seg.encoded_slices) == list(range(stack.depth))  # every slice encoded once for all 4 answers
    assert seg.timings["encoder_calls"] == stack.depth and seg.timings["propagations"] == 2  # sample 2 = greedy
    assert seg.propagation.key_slice == seg.anchor.slice == 1  # the anchor and its record are the greedy answer's
    g = stack.to_source(seg.propagation.mask).astype(bool)
    agr = seg.agreement
    assert agr.dtype == np.uint8 and agr.shape == stack.volume.shape
    np.testing.assert_array_equal(stack.to_stack(agr), seg.agreement_stack)
    other = agr.astype(int) - 2 * g  # samples 1 and 2 are the greedy answer, 3 another, 4 "not present"
    assert other.min() == 0 and other.max() == 1
    other = other.astype(bool)
    assert g.any() and other.any() and not np.array_equal(g, other)
    dice = 2 * (g & other).sum() / (g.sum() + other.sum())
    assert seg.confidence == pytest.approx((1 + 2 * dice + 0 + 0 + 0) / 6)
    # majority of 4: voxels that 3 or more samples include
    np.testing.assert_array_equal(seg.mask, (g & other).astype(np.uint8))
    assert seg.consensus_mask == "majority" and not seg.absent
    assert [s["sample"] for s in seg.samples] == [1, 2, 3, 4]
    assert seg.samples[3] == {"sample": 4, "absent": True, "answer_mean_prob": 0.5}
    assert seg.samples[2]["slice"] == 2 and seg.samples[2]["mask_voxels"] == other.sum()
    assert seg.samples[0]["mask_voxels"] == seg.samples[1]["mask_voxels"] == g.sum()
    d = seg.anchor.to_dict()
    assert d["confidence"] == round(seg.confidence, 4) and d["samples"] == seg.samples and d["slice"] == 1


# ---- several targets: MedSAM2's slice features shared between targets -------------------------------

def _answer(z: int, box) -> str:
    return f'<think>seen</think><answer>[{{"slice": {z}, "bbox_2d_list": [{list(box)}]}}]</answer>'


ANSWERS = {"the liver": _answer(3, [100, 150, 600, 700]), "the spleen": _answer(5, [450, 400, 900, 850]),
           "the kidney that contains the cyst": "<think>no cyst</think><answer>[]</answer>"}


@pytest.fixture(scope="module")
def pipe(tiny_dir):  # noqa: F811
    return Pipeline("tiny", propagator=MedSAM2Propagator.from_random(0, image_size=64), stop_after_empty=0).load()


@pytest.fixture
def canned(monkeypatch):
    """Each query's grounder answer from :data:`ANSWERS` (the query is read back from the prompt)."""
    seen = []

    def generate(self, inputs, shown, **kw):
        prompt = self.tokenizer.decode(inputs["input_ids"][0].tolist())
        query = next(q for q in ANSWERS if f"Query: {q}\n" in prompt)
        seen.append(query)
        return ANSWERS[query], {"new_tokens": 20}

    monkeypatch.setattr(QwenVLGrounder, "_generate_text", generate)
    return seen


def test_segment_queries_gives_each_target_its_own_mask_and_encodes_each_slice_once(pipe, small_ct, canned):
    stack = as_stack(small_ct[0])
    segs = pipe.segment_queries(stack, QUERIES)
    alone = [pipe.segment(stack, q) for q in QUERIES]
    assert canned == QUERIES + QUERIES
    for s, a in zip(segs, alone):
        assert s.anchor.slice == a.anchor.slice and s.anchor.boxes == a.anchor.boxes
        assert np.array_equal(s.mask, a.mask) and s.mask.any()
    assert not np.array_equal(segs[0].mask, segs[1].mask)
    encoded = [z for s in segs for z in s.encoded_slices]
    assert len(encoded) == len(set(encoded)) and len(set(encoded)) <= stack.depth  # one feature store for both
    assert sum(len(a.encoded_slices) for a in alone) > len(encoded)
