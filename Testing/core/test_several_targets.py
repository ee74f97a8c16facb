"""Several targets in one run: the grounder shares the slices' prompt between queries, the pipeline
shares MedSAM2's slice features between targets, and the job writes one label per query (label map
+ ``*.labels.json``, ``.seg.nrrd``, statistics, per-target anchors and QC pictures), resolving overlaps
by the documented rule."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from medvolcore.cli import main
from medvolcore.errors import InputError, OutputExistsError
from medvolcore.grounder import QwenVLGrounder
from medvolcore.jobs import (OVERLAP_RULE, SegmentOutputs, SegmentRequest, check_outputs, labels_path, numbered,
                             resolve_overlaps, run_segment_job)
from medvolcore.pipeline import Pipeline, as_stack
from medvolcore.propagation import MedSAM2Propagator

from core.test_grounder import grounder, small_stack, tiny_dir  # noqa: F401  (fixtures)

QUERIES = ["the liver", "the spleen"]


# ---- the grounder: one prompt prefill for all queries --------------------------------------------

def test_ground_queries_answers_each_query_as_ground_does_from_one_shared_prefill(grounder, small_stack):  # noqa: F811
    alone = [grounder.ground(small_stack, q, max_new_tokens=100) for q in QUERIES]
    shared = grounder.ground_queries(small_stack, QUERIES, max_new_tokens=100)
    sig = [r.anchor.signal["answer_mean_logprob"] for r in alone]
    assert abs(sig[0] - sig[1]) > 1e-5  # the query changes the model's scores: the comparison below can fail
    inputs, _ = grounder.build_inputs(small_stack, QUERIES[0])
    ids = inputs["input_ids"][0].tolist()
    vision_end = grounder._ids["<|vision_end|>"]
    prefix = max(i for i, t in enumerate(ids) if t == vision_end) + 1  # through the last slice
    for a, s in zip(alone, shared):
        g = s.greedy
        assert g.raw_text == a.raw_text and g.anchor.slice == a.anchor.slice and g.anchor.boxes == a.anchor.boxes
        # same scores: the cached slices sit at the right 3-D positions and the cache was cut back between queries
        assert g.anchor.signal["answer_mean_logprob"] == pytest.approx(a.anchor.signal["answer_mean_logprob"], abs=1e-5)
        assert g.anchor.query in QUERIES and g.timings["shared_prompt"] is True
        assert g.timings["shared_prompt_tokens"] == prefix
    assert shared[0].greedy.timings["shared_prefill_s"] > 0 and shared[1].greedy.timings["shared_prefill_s"] == 0.0


def test_ground_queries_with_a_consensus_draws_each_querys_samples_as_ground_samples(grounder, small_stack):  # noqa: F811
    shared = grounder.ground_queries(small_stack, QUERIES, 2, seed=5, max_new_tokens=100)
    # the second query's samples continue from the shared cache after the first query's samples used a copy
    alone = grounder.ground_samples(small_stack, QUERIES[1], 2, seed=5, max_new_tokens=100)
    assert [x.raw_text for x in shared[1].samples] == [x.raw_text for x in alone.samples]
    assert [x.anchor.signal["answer_mean_logprob"] for x in shared[1].samples] == \
        pytest.approx([x.anchor.signal["answer_mean_logprob"] for x in alone.samples], abs=1e-5)


def test_a_template_with_the_query_before_the_slices_shares_nothing_and_stays_right(grounder, small_stack,  # noqa: F811
                                                                                    monkeypatch):
    prompts = dict(grounder.prompts)
    prompts["user"] = "Query: {query}\n" + prompts["user"].replace("Query: {query}", "")
    monkeypatch.setattr(grounder, "prompts", prompts)
    shared = grounder.ground_queries(small_stack, QUERIES, max_new_tokens=100)
    for q, s in zip(QUERIES, shared):
        assert s.greedy.timings["shared_prompt"] is False
        assert s.greedy.raw_text == grounder.ground(small_stack, q, max_new_tokens=100).raw_text


# ---- overlaps ----------------------------------------------------------------------------------

def test_overlaps_go_to_the_query_asked_first_and_are_counted():
    a = np.zeros((6, 6, 2), bool)
    b = np.zeros_like(a)
    c = np.zeros_like(a)
    a[0:3, 0:3] = True  # 18 voxels
    b[2:5, 2:5] = True  # 18, of which [2,2,:] (2 voxels) also a's
    c[:, 4] = True  # 12, of which [2:5, 4, :] (6 voxels) also b's
    labels, overlaps = resolve_overlaps([a, b, c], a.shape)
    assert labels.dtype == np.uint8
    assert (labels == 1).sum() == 18 and (labels == 2).sum() == 16 and (labels == 3).sum() == 6
    assert overlaps == [{"labels": [1, 2], "voxels": 2}, {"labels": [2, 3], "voxels": 6}]
    assert np.array_equal(labels > 0, a | b | c)


# ---- the job ----------------------------------------------------------------------------------

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


def test_a_several_target_job_writes_one_label_per_query(pipe, small_ct, canned, tmp_path):
    queries = QUERIES + ["the kidney that contains the cyst"]
    outputs = SegmentOutputs([tmp_path / "organs.nii.gz", tmp_path / "organs.seg.nrrd"],
                             anchor=tmp_path / "organs.anchor.json", qc=tmp_path / "qc.png",
                             stats=tmp_path / "stats.json")
    events = []
    res = run_segment_job(pipe, small_ct[0], SegmentRequest(queries=queries), outputs,
                          progress=lambda *e: events.append(e))
    assert res["queries"] == queries and [t["label"] for t in res["targets"]] == [1, 2, 3]
    assert [t["absent"] for t in res["targets"]] == [False, False, True] and res["absent"] is False
    labels = np.asarray(nib.load(str(tmp_path / "organs.nii.gz")).dataobj)
    raw = [pipe.segment(as_stack(small_ct[0]), q).mask for q in QUERIES]
    expected, overlaps = resolve_overlaps(raw + [np.zeros_like(raw[0])], labels.shape)
    assert np.array_equal(labels, expected)  # label k = query k, the earlier query keeping shared voxels
    assert res["overlaps"] == [dict(o, queries=[queries[o["labels"][0] - 1], queries[o["labels"][1] - 1]],
                                    volume_ml=res["overlaps"][i]["volume_ml"]) for i, o in enumerate(overlaps)]
    assert res["overlap_rule"] == OVERLAP_RULE

    table = json.loads((tmp_path / "organs.labels.json").read_text())
    assert res["labels_out"] == [labels_path(tmp_path / "organs.nii.gz")]
    assert [(e["value"], e["query"], e["voxels"], e["absent"]) for e in table["labels"]] == \
        [(k, q, int((labels == k).sum()), k == 3) for k, q in enumerate(queries, start=1)]
    assert table["labels"][0]["name"] == "Liver" and table["labels"][1]["name"] == "Spleen"
    assert table["volume"] == "ct.nii.gz" and table["mask"] == "organs.nii.gz"  # names, never where files lie
    assert not (tmp_path / "organs.seg.labels.json").exists()  # a segmentation names its own segments

    sitk = pytest.importorskip("SimpleITK")
    meta = sitk.ReadImage(str(tmp_path / "organs.seg.nrrd"))
    assert [meta.GetMetaData(f"Segment{i}_Name") for i in range(3)] == queries
    assert [meta.GetMetaData(f"Segment{i}_LabelValue") for i in range(3)] == ["1", "2", "3"]
    assert np.array_equal(sitk.GetArrayFromImage(meta).transpose(2, 1, 0), labels)

    stats = json.loads((tmp_path / "stats.json").read_text())
    assert [r["query"] for r in stats] == queries and [r["voxels"] for r in stats] == \
        [int((labels == k).sum()) for k in (1, 2, 3)]
    for k, q in enumerate(queries, start=1):
        anchor = json.loads((tmp_path / f"organs.{k}.anchor.json").read_text())
        assert anchor["query"] == q and (tmp_path / f"qc.{k}.png").is_file()
    assert json.loads((tmp_path / "organs.2.anchor.json").read_text())["slice"] == 5  # the spleen's own answer
    assert any(m.startswith("query 2/3") for st, _, m in events if st == "ground")
    assert any(m.startswith("target 2/3") for st, _, m in events if st == "propagate")


def test_several_targets_outputs_are_checked_before_any_model_loads(tmp_path, small_ct):
    numbered_anchor = numbered(tmp_path / "m.anchor.json", 2)
    assert numbered_anchor == str(tmp_path / "m.2.anchor.json")
    (tmp_path / "m.2.anchor.json").write_text("{}")
    outputs = SegmentOutputs(tmp_path / "m.nii.gz", anchor=tmp_path / "m.anchor.json")
    check_outputs(outputs, [("--volume", small_ct[0])], targets=1)  # one target writes m.anchor.json only
    with pytest.raises(OutputExistsError, match=r"m\.2\.anchor\.json"):
        check_outputs(outputs, [("--volume", small_ct[0])], targets=2)
    made = []
    with pytest.raises(InputError, match="repeats query 1"):
        run_segment_job(lambda: made.append(1), small_ct[0], SegmentRequest(queries=["The liver", "the  liver"]),
                        SegmentOutputs(tmp_path / "x.nii.gz"))
    assert made == []


# ---- the command line ---------------------------------------------------------------------------

def test_cli_repeated_query_and_queries_file(tmp_path, small_ct, canned, capsys):
    qfile = tmp_path / "queries.txt"
    qfile.write_text("# organs\n\nthe spleen\n", encoding="utf-8")
    code = main(["segment", "--volume", str(small_ct[0]), "--preset", "tiny", "--query", "the liver", "--queries",
                 str(qfile), "--out", str(tmp_path / "o.nii.gz"), "--out", str(tmp_path / "o.seg.nrrd"),
                 "--no-progress", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["queries"] == QUERIES and out["outs"] == [str(tmp_path / "o.nii.gz"),
                                                                          str(tmp_path / "o.seg.nrrd")]
    assert [t["anchor_out"] for t in out["targets"]] == [str(tmp_path / "o.1.anchor.json"),
                                                         str(tmp_path / "o.2.anchor.json")]


@pytest.mark.parametrize("argv, message", [
    (["--query", "the liver", "--query", "THE liver"], "repeats query 1"),
    (["--queries", "missing.txt"], "--queries missing.txt: no such file"),
    ([], "give what to segment"),
    (["--queries", "."], "is not a text file"),
])
def test_cli_query_errors_are_one_line(tmp_path, small_ct, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Pipeline, "__init__", lambda *a, **k: pytest.fail("a model was set up"))
    code = main(["segment", "--volume", str(small_ct[0]), "--out", "o.nii.gz", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
