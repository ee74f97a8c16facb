"""The one segment job (:func:`medvolcore.jobs.run_segment_job`): order of the checks, what it writes,
the result it returns, on the real 8-slice CT with seeded random MedSAM2 weights (64 px); several
targets (one label per query: label map + ``*.labels.json``, ``.seg.nrrd``, statistics, per-target
anchors and QC pictures, overlaps resolved by the documented rule); a cancel inside the grounding."""

from __future__ import annotations

import json
import threading

import nibabel as nib
import numpy as np
import pytest

from medvolcore.anchor import EvidenceAnchor
from medvolcore.errors import AnchorError, CancelledError, InputError, OutputExistsError, VolumeError
from medvolcore.jobs import (OVERLAP_RULE, SegmentOutputs, SegmentRequest, check_outputs, default_anchor_path,
                             labels_path, numbered, resolve_overlaps, run_segment_job)
from medvolcore.pipeline import Pipeline, as_stack
from medvolcore.propagation import MedSAM2Propagator
from medvolcore.stack import AxialStack
from medvolcore.volume import load_label_map, load_volume

from ts_labels import LIVER
from core.test_pipeline import QUERIES, SAMPLE, canned, pipe, tiny, tiny_dir  # noqa: F401  (fixtures)

BOX = [20, 20, 70, 60]


@pytest.fixture(scope="module")
def propagator():
    return MedSAM2Propagator.from_random(0, image_size=64)


@pytest.fixture
def calls(propagator):
    """A pipeline factory that records whether the job got as far as asking for the models."""
    made = []

    def pipeline():
        made.append(1)
        return Pipeline.with_propagator(propagator, stop_after_empty=0)

    pipeline.made = made
    return pipeline


def test_propagates_a_key_slice_and_boxes_and_writes_mask_and_anchor(tmp_path, small_ct, propagator, calls):
    ct, _ = small_ct
    out, anchor_out = tmp_path / "m.nii.gz", tmp_path / "m.anchor.json"
    res = run_segment_job(calls, ct, SegmentRequest(key_slice=3, boxes=[BOX]), SegmentOutputs(out, anchor=anchor_out))
    vol = load_volume(ct)
    stack = AxialStack(vol)
    direct = propagator.propagate(stack.data, 3, [BOX], stop_after_empty=0)
    assert res["mode"] == "propagate" and res["preset"] == "" and res["smoke"] is False
    mask = nib.load(str(out))
    assert np.array_equal(np.asarray(mask.dataobj), stack.to_source(direct.mask))
    assert np.allclose(mask.affine, vol.affine) and res["shape"] == list(vol.shape)
    assert res["mask_voxels"] == int(direct.mask.sum())
    written = json.loads(anchor_out.read_text())
    assert written == res["anchor"] and written["source"] == "user" and written["boxes"] == [BOX]
    assert written["propagation"] == res["propagation"] == direct.stop_summary()
    assert res["out"] == str(out) and res["anchor_out"] == str(anchor_out) and res["qc"] is None
    assert {"propagate_s", "encoder_calls", "write_s", "job_s"} <= set(res["timings"])
    assert res["timings"]["encoder_calls"] == direct.encoder_calls
    assert calls.made == [1]


def test_a_given_anchor_file_and_a_reference_mask(tmp_path, small_ct, calls):
    ct, seg = small_ct
    labels = load_label_map(seg)
    stack = AxialStack(labels)
    target = labels.array == LIVER
    anchor = EvidenceAnchor(4, [BOX], [stack.width, stack.height], source="user", query="the liver")
    anchor_file = anchor.save(tmp_path / "given.anchor.json")
    res = run_segment_job(calls, ct, SegmentRequest(anchor=anchor_file, reference=target),
                          SegmentOutputs(tmp_path / "m.nii", qc=tmp_path / "qc.png"))
    pred = np.asarray(nib.load(str(tmp_path / "m.nii")).dataobj) != 0
    inter = int((pred & target).sum())
    dice = 2 * inter / (int(pred.sum()) + int(target.sum()))
    assert res["metrics"]["dice"] == pytest.approx(dice, abs=1e-6)
    assert res["metrics"]["iou"] == pytest.approx(inter / int((pred | target).sum()), abs=1e-6)
    assert (res["metrics"]["pred_voxels"], res["metrics"]["gt_voxels"]) == (int(pred.sum()), int(target.sum()))
    assert res["query"] == "the liver" and res["anchor"]["slice"] == 4
    assert (tmp_path / "qc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    from medvolcore import RESEARCH_USE_NOTICE

    with Image.open(tmp_path / "qc.png") as im:  # a given anchor: no language model ran, and it says so
        assert im.text["Disclaimer"] == RESEARCH_USE_NOTICE and "no language model ran" in im.text["Source"]
        # the reference is drawn as the ground-truth contour (cyan, medvolcore.qc)
        assert np.all(np.asarray(im.convert("RGB")) == (0, 220, 255), axis=-1).sum() > 100
    assert res["identity"] is None and "Warning" not in im.text


def test_outputs_are_refused_before_the_volume_is_read(tmp_path, calls):
    missing = tmp_path / "no_such_ct.nii.gz"
    with pytest.raises(InputError, match="same file"):
        run_segment_job(calls, missing, SegmentRequest(key_slice=0, boxes=[BOX]),
                        SegmentOutputs(tmp_path / "m.nii.gz", anchor=tmp_path / "m.nii.gz"))
    (tmp_path / "taken.nii.gz").write_bytes(b"x")
    with pytest.raises(OutputExistsError):
        run_segment_job(calls, missing, SegmentRequest(key_slice=0, boxes=[BOX]), SegmentOutputs(tmp_path / "taken.nii.gz"))
    with pytest.raises(VolumeError):  # only now the volume itself
        run_segment_job(calls, missing, SegmentRequest(key_slice=0, boxes=[BOX]), SegmentOutputs(tmp_path / "m.nii.gz"))
    assert calls.made == [] and sorted(p.name for p in tmp_path.iterdir()) == ["taken.nii.gz"]


@pytest.mark.parametrize("request_, error", [
    (SegmentRequest(), "give a query"),
    (SegmentRequest(query="  "), "query is empty"),
    (SegmentRequest(anchor={"schema": "medvol.anchor/1", "slice": 1, "boxes": [BOX]}, key_slice=1, boxes=[BOX]),
     "not both"),
    (SegmentRequest(key_slice=1), "needs one or more boxes"),
    (SegmentRequest(key_slice=1, boxes=[BOX], stop_after_empty=-1), "stop_after_empty"),
    (SegmentRequest(key_slice=1, boxes=[BOX], hu_window="no-such-window"), "window"),
])
def test_bad_requests_load_nothing(tmp_path, small_ct, calls, request_, error):
    with pytest.raises(InputError, match=error):
        run_segment_job(calls, small_ct[0], request_, SegmentOutputs(tmp_path / "m.nii.gz"))
    assert calls.made == [] and list(tmp_path.iterdir()) == []


def test_an_anchor_for_another_volume_is_refused_before_the_models(tmp_path, small_ct, calls):
    other = {"schema": "medvol.anchor/1", "slice": 1, "boxes": [BOX], "image_size": [999, 999]}
    with pytest.raises(AnchorError):
        run_segment_job(calls, small_ct[0], SegmentRequest(anchor=other), SegmentOutputs(tmp_path / "m.nii.gz"))
    assert calls.made == [] and list(tmp_path.iterdir()) == []


def test_cancel_writes_nothing(tmp_path, small_ct, calls):
    cancel = threading.Event()

    def progress(stage, fraction, message):
        if stage == "propagate":
            cancel.set()

    with pytest.raises(CancelledError):
        run_segment_job(calls, small_ct[0], SegmentRequest(key_slice=3, boxes=[BOX]),
                        SegmentOutputs(tmp_path / "m.nii.gz", anchor=tmp_path / "a.json"), progress=progress,
                        cancel=cancel)
    assert list(tmp_path.iterdir()) == []


def test_default_anchor_path():
    assert default_anchor_path("out/kidney.nii.gz") == "out/kidney.anchor.json"
    assert default_anchor_path("kidney.nrrd") == "kidney.anchor.json"


def test_an_in_memory_volume_is_still_an_input(tmp_path, small_ct, calls):
    stack = AxialStack(load_volume(small_ct[0]))
    before = small_ct[0].read_bytes()
    with pytest.raises(InputError, match="is the input"):
        run_segment_job(calls, stack, SegmentRequest(key_slice=3, boxes=[BOX]),
                        SegmentOutputs(small_ct[0], overwrite=True))
    assert calls.made == [] and small_ct[0].read_bytes() == before


def test_a_seg_nrrd_names_its_segment_by_the_query_with_its_terminology(tmp_path, small_ct, calls):
    """The anchor's query names the segment of a ``.seg.nrrd``; the result says how the query was
    coded (the worker hands this to Slicer); without a query the segment is "Segment_1", generic."""
    ct, _ = small_ct
    first = run_segment_job(calls, ct, SegmentRequest(key_slice=3, boxes=[BOX]), SegmentOutputs(tmp_path / "a.seg.nrrd"))
    assert first["terminology"] is None
    assert b"Segment0_Name:=Segment_1\n" in (tmp_path / "a.seg.nrrd").read_bytes()[:4000]
    anchor = dict(first["anchor"], query="the right kidney")
    (tmp_path / "k.anchor.json").write_text(json.dumps(anchor))
    res = run_segment_job(calls, ct, SegmentRequest(anchor=str(tmp_path / "k.anchor.json")),
                          SegmentOutputs(tmp_path / "k.seg.nrrd", stats=tmp_path / "k.json"))
    assert res["terminology"]["structure"] == "kidney_right" and res["terminology"]["how"] == "name"
    written = json.loads((tmp_path / "k.json").read_text())
    assert written == [res["stats"]] and res["stats"]["voxels"] == res["mask_voxels"] > 0
    assert res["stats"]["key_slice"] == 3 and res["stats"]["key_slice_s_mm"] == round(anchor["world"]["slice_center_ras"][2], 2)
    header = (tmp_path / "k.seg.nrrd").read_bytes()[:4000].decode("latin1")
    assert "Segment0_Name:=the right kidney\n" in header and "SCT^24028007^Right" in header
    assert "Segment0_LabelValue:=1\n" in header and "Segment0_Color:=" in header


# ---- cancel inside the grounding (the tiny pipeline) ----------------------------------------------

def test_cancel_during_decoding_stops_the_job_and_writes_nothing(tiny, tmp_path, monkeypatch):
    """The worker's and Slicer's cancel (an Event) stops a grounding inside its decoding, at the
    step after it is set; no output file is written."""
    import threading

    from medvolcore.errors import CancelledError
    from medvolcore.grounder import _logits
    from medvolcore.jobs import SegmentOutputs, SegmentRequest, run_segment_job

    cancel, steps, original = threading.Event(), [0], _logits.StepProcessor.__call__

    def counting(self, input_ids, scores):
        steps[0] += 1
        if steps[0] == 3:
            cancel.set()  # as the worker's reader thread does on a cancel request
        return original(self, input_ids, scores)

    monkeypatch.setattr(_logits.StepProcessor, "__call__", counting)
    events = []
    outputs = SegmentOutputs(tmp_path / "m.nii.gz", anchor=tmp_path / "m.anchor.json", qc=tmp_path / "qc.png")
    with pytest.raises(CancelledError, match="decoding"):
        run_segment_job(lambda: tiny, SAMPLE, SegmentRequest(query="the liver"), outputs,
                        progress=lambda *e: events.append(e), cancel=cancel)
    assert steps[0] == 3 and list(tmp_path.iterdir()) == []
    assert [e[0] for e in events if e[0] != "ground"] == [] and events[-1][2].startswith("decoding")


# ---- several targets: one label per query, overlaps by the documented rule ------------------------

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


def test_label_maps_sharing_a_labels_table_are_named_with_the_fix(tmp_path):
    outputs = SegmentOutputs([tmp_path / "organs.nii.gz", tmp_path / "organs.nrrd"])
    with pytest.raises(InputError) as ei:
        check_outputs(outputs, targets=2)
    msg = str(ei.value)
    assert "organs.nii.gz and --out" in msg and "organs.nrrd would share one labels table" in msg
    assert "organs.labels.json" in msg and "different names before the suffix" in msg
    check_outputs(outputs, targets=1)  # one query: no table, no clash


def test_the_dicom_algorithm_name_ends_at_a_phrase():
    from types import SimpleNamespace

    from medvolcore.jobs import _algorithm

    smoke = SimpleNamespace(identity={"label": "untrained tiny smoke model (random weights): results are meaningless"})
    assert _algorithm(smoke) == "MedVol untrained tiny smoke model (random weights)"
    zero = SimpleNamespace(identity={"label": "Qwen/Qwen3-VL-4B-Instruct, zero-shot, not trained for this task"})
    assert _algorithm(zero) == "MedVol Qwen/Qwen3-VL-4B-Instruct, zero-shot"
    assert _algorithm(SimpleNamespace(identity=None)) == "MedVol propagation of a given anchor"
    for seg in (smoke, zero):
        assert len(_algorithm(seg)) <= 64
