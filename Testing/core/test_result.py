"""The segment result (:mod:`medvolcore.result`): its declaration (a result is the mapping of its
shape's fields, each door shows its part), and what clients read of it, key by key: the job's result
(``medvol batch`` and scripts read it), ``medvol segment --json`` and the worker's
``segment``/``propagate`` replies, for one target and for several. Written down as they are, so that
a change in how the result is declared or shaped cannot add, drop or rename a key unnoticed. The
tiny preset, on 8 real slices.
"""

from __future__ import annotations

import json
import queue

import pytest

from medvolcore.cli import main
from medvolcore.jobs import SegmentOutputs, SegmentRequest, run_segment_job
from medvolcore.pipeline import Pipeline
from medvolcore.result import ENTRY, ONE, SEVERAL, SegmentResult

TARGET = {"query", "absent", "terminology", "stats", "anchor", "reasoning", "raw_text", "notes", "mask_voxels",
          "propagation", "slices_encoded", "answer_mean_logprob", "answer_mean_prob", "consensus", "consensus_mask",
          "confidence", "samples", "timings"}
JOB_ONE = TARGET | {"mode", "volume", "preset", "smoke", "identity", "stats_out", "shape", "metrics", "out", "outs",
                    "anchor_out", "qc", "agreement_out"}
JOB_SEVERAL = {"mode", "volume", "queries", "preset", "smoke", "identity", "absent", "targets", "overlaps",
               "overlap_rule", "notes", "shape", "mask_voxels", "stats", "stats_out", "slices_encoded", "timings", "out",
               "outs", "labels_out"}
ENTRY_KEYS = TARGET | {"label", "overlap_voxels_lost", "anchor_out", "qc", "agreement_out"}
CLI_RUN = {"model_load_s", "threads", "threads_rule", "grounder_dtype", "peak_memory_mb"}
CLI_ONE = {"out", "anchor_out", "qc", "agreement_out", "volume", "outs", "preset", "smoke", "absent", "identity",
           "terminology", "stats", "stats_out", "anchor", "reasoning", "raw_text", "notes", "mask_voxels",
           "answer_mean_logprob", "answer_mean_prob", "consensus", "consensus_mask", "confidence", "samples",
           "timings"} | CLI_RUN
CLI_SEVERAL = {"out", "volume", "outs", "labels_out", "queries", "preset", "smoke", "absent", "identity", "targets",
               "overlaps", "overlap_rule", "stats", "stats_out", "notes", "mask_voxels", "timings"} | CLI_RUN
WIRE_ONE = {"anchor", "reasoning", "smoke", "absent", "notes", "preset", "terminology", "stats", "propagation",
            "identity", "model_label", "volume_sha256", "shape", "mask_voxels", "slices_encoded", "mask_path",
            "mask_temporary", "timings"}
WIRE_SEGMENT = {"answer_mean_logprob", "answer_mean_prob", "consensus", "consensus_mask", "confidence", "samples"}
WIRE_SEVERAL = {"queries", "targets", "overlaps", "overlap_rule", "smoke", "absent", "notes", "preset", "stats",
                "labels_path", "identity", "model_label", "volume_sha256", "shape", "mask_voxels", "slices_encoded",
                "mask_path", "mask_temporary", "timings"}
WIRE_TIMINGS = {"load_s", "models_reloaded", "volume_cached", "volume_read_s", "request_s", "write_s", "job_s"}


@pytest.fixture(scope="module")
def tiny():
    return Pipeline("tiny", device="cpu").load()


def test_the_job_result_keys(tiny, small_ct, tmp_path):
    one = run_segment_job(tiny, small_ct[0], SegmentRequest(query="the liver"), SegmentOutputs(tmp_path / "a.nii.gz"))
    assert set(one) == JOB_ONE and dict(one)["mode"] == "segment"
    several = run_segment_job(tiny, small_ct[0], SegmentRequest(queries=["the liver", "the spleen"]),
                              SegmentOutputs(tmp_path / "b.nii.gz"))
    assert set(several) == JOB_SEVERAL and [set(t) for t in several["targets"]] == [ENTRY_KEYS, ENTRY_KEYS]


@pytest.mark.parametrize("queries, keys", [(["the liver"], CLI_ONE), (["the liver", "the spleen"], CLI_SEVERAL)])
def test_the_segment_json_keys(tiny, small_ct, tmp_path, capsys, monkeypatch, queries, keys):
    import medvolcore.pipeline

    monkeypatch.setattr(medvolcore.pipeline, "Pipeline", lambda *a, **k: tiny)
    argv = ["segment", "--volume", str(small_ct[0]), "--out", str(tmp_path / "m.nii.gz"), "--json", "--no-progress"]
    for q in queries:
        argv += ["--query", q]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res) == keys
    assert all(set(t) == ENTRY_KEYS for t in res.get("targets", []))


def test_the_worker_reply_keys(tiny, small_ct, tmp_path):
    from medvolcore.serve import Worker

    w = Worker(transport="stdio", device="cpu")
    w.pipeline = tiny  # loaded: no model loads here
    replies: queue.Queue = queue.Queue()
    anchor = {"schema": "medvol.anchor/1", "slice": 3, "boxes": [[20, 20, 70, 60]], "source": "user"}
    base = {"volume": str(small_ct[0])}
    requests = {"one": dict(base, op="segment", query="the liver"),
                "several": dict(base, op="segment", queries=["the liver", "the spleen"], out=str(tmp_path / "s.nii.gz")),
                "propagate": dict(base, op="propagate", anchor=anchor)}
    try:
        for rid, req in requests.items():
            w.handle(dict(req, id=rid), reply=replies.put)
        got = {}
        while len(got) < len(requests):
            r = replies.get(timeout=120)
            if "event" not in r:
                got[r["id"]] = r
    finally:
        w.close(10)
    assert all(r["ok"] for r in got.values()), got
    one, several, prop = (got[k]["result"] for k in ("one", "several", "propagate"))
    assert set(one) == WIRE_ONE | WIRE_SEGMENT and set(prop) == WIRE_ONE
    assert set(several) == WIRE_SEVERAL and [set(t) for t in several["targets"]] == [ENTRY_KEYS, ENTRY_KEYS]
    for res in (one, several, prop):
        assert WIRE_TIMINGS <= set(res["timings"])
    assert one["model_label"] == (one["identity"] or {}).get("label")


# ---- the declaration: a result is the mapping of its shape's fields ------------------------------------

def test_a_result_is_the_mapping_of_its_shapes_fields_and_each_door_shows_its_part():
    entry = SegmentResult(label=1, query="the liver", absent=False, anchor={"slice": 3}, notes=[], mask_voxels=5,
                          timings={}, overlap_voxels_lost=0, consensus=1)
    several = SegmentResult(mode="segment", queries=["the liver"], targets=[entry], overlaps=[], volume="ct.nii.gz",
                            labels_out=[], timings={"ground_s": 1.0})
    one = SegmentResult(mode="propagate", anchor={"slice": 3}, query="", raw_text="", metrics=None, timings={},
                        consensus=1, shape=[4, 4, 4])
    assert (one.kind, several.kind, entry.kind) == (ONE, SEVERAL, ENTRY)
    assert "metrics" in one and "metrics" not in several and "label" in entry and "targets" not in one
    with pytest.raises(KeyError):
        several["anchor"]
    assert one.get("raw_text") == "" and dict(one)["shape"] == [4, 4, 4] and one == one.to_dict()
    assert several.to_wire("segment")["targets"] == [entry.to_dict()] and isinstance(several["targets"][0], SegmentResult)
    assert "raw_text" in one.to_json() and "raw_text" not in one.to_wire("segment")
    assert "consensus" in one.to_wire("segment") and "consensus" not in one.to_wire("propagate")
    assert "shape" in one.to_wire("propagate") and "shape" not in one.to_json()
    assert list(several.to_json())[:4] == ["out", "volume", "outs", "labels_out"]  # the order --json always had
