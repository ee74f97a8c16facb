"""``medvol serve`` (protocol 1) driven by a real client: a subprocess over stdio and over HTTP.

Uses the ``tiny`` preset on CPU and the shared real CTs. The stdio worker and the HTTP
worker are each started once per module, so the models load once (which is also what is
tested: the second segment must not reload them).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.pipeline import as_stack
from medvolcore.stack import sample_slice_indices

from core.test_pipeline import ABSENT, GREEDY, _answer_text, _canned_samples, ct4, tiny  # noqa: F401  (fixtures)
from core.worker_clients import SERVE, TIMEOUT, HttpServer, StdioClient


@pytest.fixture(scope="module")
def worker():
    c = StdioClient("--device", "cpu", "--max-request-mb", "1")
    yield c
    c.close()


@pytest.fixture(scope="module")
def first_segment(worker, ct_sm_path):
    t = time.perf_counter()
    events = []
    r = worker.call({"id": "seg-1", "op": "segment", "volume": str(ct_sm_path), "query": "the liver", "preset": "tiny"},
                    events=events)
    return r, time.perf_counter() - t, events


def _ct_shape(path):
    return tuple(nib.load(str(path)).shape)


# ---- stdio ------------------------------------------------------------------------------------

def test_hello(worker):
    r = worker.call({"id": 1, "op": "hello"})
    assert r["ok"] is True and r["result"]["protocol"] == 1
    assert set(r["result"]["ops"]) >= {"hello", "load", "segment", "propagate", "cancel", "status", "shutdown"}
    assert r["result"]["limits"]["max_mask_prompts"] == 16 and r["result"]["limits"]["max_mask_runs"] == 32768
    assert r["result"]["medvolcore"]


def test_segment_writes_mask_on_the_ct_grid(first_segment, ct_sm_path):
    r, _, events = first_segment
    assert r["ok"] is True, r
    res = r["result"]
    mask_path = Path(res["mask_path"])
    assert mask_path.is_file()
    img = nib.load(str(mask_path))
    assert tuple(img.shape) == _ct_shape(ct_sm_path)
    assert int(np.asarray(img.dataobj).sum()) == res["mask_voxels"]
    a = res["anchor"]
    assert a["schema"] == "medvol.anchor/1" and a["boxes"] and "world" in a
    assert a["slice"] in sample_slice_indices(as_stack(ct_sm_path).depth)
    assert res["smoke"] is True and any("tiny" in n for n in res["notes"])
    assert res["timings"]["models_reloaded"] is True and res["timings"]["volume_cached"] is False
    assert res["terminology"]["structure"] == "liver" and res["terminology"]["slicer_terminology"].count("~") == 6
    assert res["stats"]["voxels"] == res["mask_voxels"] and res["stats"]["query"] == "the liver"
    stages = [e["stage"] for e in events]
    assert "ground" in stages and "propagate" in stages
    assert all(0.0 <= e["fraction"] <= 1.0 for e in events)


def test_segment_events_move_through_the_grounding(first_segment):
    """The grounding (vision encoding, prefill, each whole percent of the decode budget) reaches the
    client before propagation starts, with the stage's elapsed time and estimate of the time left."""
    _, _, events = first_segment
    first_propagate = next(i for i, e in enumerate(events) if e["stage"] == "propagate")
    ground = [e for e in events[:first_propagate] if e["stage"] == "ground"]
    assert len({e["fraction"] for e in ground}) >= 10, [e["fraction"] for e in ground]
    assert ground[-1]["fraction"] == 1.0 and ground[-1]["message"].startswith("answer complete")
    assert any(e["message"].startswith("decoding ") for e in ground)
    assert all(e["elapsed_s"] >= 0 and (e["eta_s"] is None or e["eta_s"] >= 0) for e in events)
    assert any(e["eta_s"] is not None for e in ground)


def test_second_segment_reuses_models_and_volume(worker, first_segment, ct_sm_path):
    _, first_s, _ = first_segment
    t = time.perf_counter()
    r = worker.call({"id": "seg-2", "op": "segment", "volume": str(ct_sm_path), "query": "the liver"})
    second_s = time.perf_counter() - t
    assert r["ok"] is True, r
    tm = r["result"]["timings"]
    assert tm["models_reloaded"] is False and tm["load_s"] == 0.0
    assert tm["volume_cached"] is True
    assert second_s < first_s
    assert r["result"]["mask_path"] != first_segment[0]["result"]["mask_path"]


def test_several_queries_give_one_label_each_in_one_mask(worker, first_segment, small_ct):
    r = worker.call({"id": "multi-1", "op": "segment", "volume": str(small_ct[0]),
                     "queries": ["the liver", "the spleen"], "stop_after_empty": 0})
    assert r["ok"] is True, r
    res = r["result"]
    assert res["queries"] == ["the liver", "the spleen"] and [t["label"] for t in res["targets"]] == [1, 2]
    assert [t["terminology"]["label"] for t in res["targets"]] == ["Liver", "Spleen"]
    labels = np.asarray(nib.load(res["mask_path"]).dataobj)
    assert set(np.unique(labels)) <= {0, 1, 2}
    assert [int((labels == k).sum()) for k in (1, 2)] == [t["mask_voxels"] for t in res["targets"]]
    assert res["mask_voxels"] == int((labels > 0).sum())
    assert sum(o["voxels"] for o in res["overlaps"]) == res["targets"][1]["overlap_voxels_lost"]
    assert res["slices_encoded"] <= labels.shape[2]  # each slice encoded once for both targets
    assert not list(Path(res["mask_path"]).parent.glob("*.labels.json"))  # the table is the reply's 'targets'


@pytest.mark.parametrize("extra, message", [
    ({"query": "the liver", "queries": ["the spleen"]}, "not both"),
    ({"queries": "the liver"}, "must be a list"),
    ({"queries": ["the liver", 3]}, "non-empty list of strings"),
    ({"queries": ["the liver", "The liver"]}, "repeats query 1"),
])
def test_bad_queries_get_one_error_reply(worker, small_ct, extra, message):
    r = worker.call({"id": "multi-bad", "op": "segment", "volume": str(small_ct[0]), **extra})
    assert r["ok"] is False and message in r["error"]["message"], r


def test_propagate_edited_anchor(worker, first_segment, ct_sm_path):
    anchor = dict(first_segment[0]["result"]["anchor"])
    edited = [[40, 30, 80, 70]]
    anchor.update(boxes=edited, source="user")
    for k in ("boxes_norm", "world"):
        anchor.pop(k, None)
    r = worker.call({"id": "prop-1", "op": "propagate", "volume": str(ct_sm_path), "anchor": anchor})
    assert r["ok"] is True, r
    res = r["result"]
    assert res["anchor"]["boxes"] == edited and res["anchor"]["slice"] == anchor["slice"]
    assert res["timings"]["models_reloaded"] is False and res["timings"]["volume_cached"] is True
    assert tuple(nib.load(res["mask_path"]).shape) == _ct_shape(ct_sm_path)

    # Slicer writes back only 'world' after an edit: the same boxes must come out
    world_only = {"schema": "medvol.anchor/1", "world": res["anchor"]["world"], "source": "user"}
    r2 = worker.call({"id": "prop-2", "op": "propagate", "volume": str(ct_sm_path), "anchor": world_only})
    assert r2["ok"] is True, r2
    assert r2["result"]["anchor"]["boxes"] == edited


def test_a_correction_round_encodes_no_slice_again(worker, ct_sm_path, tmp_path):
    """The worker keeps a volume's encoded slices: a re-propagation with corrections on a volume it
    has seen encodes nothing, while another volume (one voxel differs) or another window does."""
    img = nib.load(str(ct_sm_path))
    data = np.asarray(img.dataobj).copy()
    data[-1, -1, -1] -= 1  # content no other test has sent: nothing of it is cached yet
    vol = tmp_path / "ct.nii.gz"
    nib.save(nib.Nifti1Image(data, img.affine), str(vol))
    depth = data.shape[2]
    k, box = depth // 2, [40, 30, 80, 70]
    v1 = {"schema": "medvol.anchor/1", "slice": k, "boxes": [box], "source": "user"}

    def propagate(rid, anchor, volume=vol, **kw):
        r = worker.call({"id": rid, "op": "propagate", "volume": str(volume), "anchor": anchor, "stop_after_empty": 0, "preset": "tiny",
                         **kw})
        assert r["ok"] is True, r
        return r["result"]

    first = propagate("enc-1", v1)
    assert first["slices_encoded"] == depth == first["timings"]["slices_encoded"]
    v2 = dict(v1, schema="medvol.anchor/2",
              prompts=[{"slice": k + 4, "object": 1, "box": [30, 20, 70, 60], "points": [[35, 25, 0]]},
                       {"slice": k - 3, "object": 2, "box": None, "points": [[60, 50, 1]]}])
    again = propagate("enc-2", v2)
    assert again["slices_encoded"] == 0 and again["timings"]["encoder_calls"] == 0
    assert again["anchor"]["schema"] == "medvol.anchor/2" and len(again["anchor"]["prompts"]) == 2
    assert all(p["world"]["box_ras"] or p["world"]["points_ras"] for p in again["anchor"]["prompts"])
    # the corrections changed the mask, so the cached features were really used for a new answer
    m1, m2 = (np.asarray(nib.load(r["mask_path"]).dataobj) for r in (first, again))
    assert not np.array_equal(m1, m2)
    # another window is another image: encoded again, and so is another volume
    assert propagate("enc-3", v1, window="lung")["slices_encoded"] == depth
    data[0, 0, 0] += 1
    other = tmp_path / "other.nii.gz"
    nib.save(nib.Nifti1Image(data, img.affine), str(other))
    assert propagate("enc-4", v1, volume=other)["slices_encoded"] == depth
    st = worker.call({"id": "st-fc", "op": "status"})["result"]["feature_cache"]
    assert st["volumes"] >= 3 and 0 < st["bytes"] <= st["budget_bytes"]


def test_cancel_during_propagation(worker, ct_path):
    anchor = {"schema": "medvol.anchor/1", "slice": 56, "boxes": [[30, 30, 90, 80]], "source": "user"}
    worker.send({"id": "long", "op": "propagate", "volume": str(ct_path), "anchor": anchor})
    t = time.perf_counter()
    while True:
        msg = worker.next()
        assert msg.get("id") == "long", msg
        assert "event" in msg, f"the propagation finished before it could be cancelled: {msg}"
        if msg["stage"] == "propagate":
            break
    worker.send({"id": "stop-it", "op": "cancel", "target": "long"})
    got = {}
    while len(got) < 2:
        msg = worker.next()
        if "event" not in msg:
            got[msg["id"]] = msg
    assert got["stop-it"]["ok"] is True and got["stop-it"]["result"]["state"] == "running"
    assert got["long"]["ok"] is False and got["long"]["error"]["code"] == "cancelled"
    assert "propagat" in got["long"]["error"]["message"]
    assert time.perf_counter() - t < 30
    r = worker.call({"id": "after-cancel", "op": "status"})
    assert r["ok"] is True and r["result"]["busy"] is False
    # cancelling something that is not there is not an error
    r = worker.call({"id": "c2", "op": "cancel", "target": "nothing"})
    assert r["ok"] is True and r["result"]["found"] is False


def test_status_answers_while_a_request_runs(worker, ct_sm_path):
    anchor = {"schema": "medvol.anchor/1", "slice": 12, "boxes": [[30, 30, 90, 80]], "source": "user"}
    worker.send({"id": "busy", "op": "propagate", "volume": str(ct_sm_path), "anchor": anchor})
    worker.send({"id": "st", "op": "status"})
    order = []
    status = None
    while "busy" not in order:
        msg = worker.next()
        if "event" in msg:
            continue
        order.append(msg["id"])
        if msg["id"] == "st":
            status = msg
    assert order == ["st", "busy"]
    res = status["result"]
    assert res["preset"] == "tiny" and res["cached_volumes"] >= 1 and res["uptime_s"] > 0
    assert res["busy"] is True and res["current"]["id"] == "busy" or res["queued"] == ["busy"]


def test_twenty_malformed_inputs_then_a_valid_request(worker, ct_sm_path, tmp_path):
    ct = str(ct_sm_path)
    corrupt = tmp_path / "corrupt.nii.gz"
    corrupt.write_bytes(b"\x1f\x8b this is not a gzip stream" * 20)
    good_anchor = {"schema": "medvol.anchor/1", "slice": 12, "boxes": [[30, 30, 90, 80]], "source": "user"}
    cases = [  # (raw line, expected id, expected code)
        (b"this is not json", None, "bad_json"),
        (b'{"id": 2, "op": "hello"', None, "bad_json"),
        (b"[1, 2, 3]", None, "bad_request"),
        (b'"a string"', None, "bad_request"),
        (b"42", None, "bad_request"),
        (b"\xff\xfe\x00 not utf-8", None, "bad_json"),
        (b'{"id": {"nested": 1}, "op": "hello"}', None, "bad_request"),
        (b'{"id": 8}', 8, "bad_request"),
        (b'{"id": 9, "op": 5}', 9, "bad_request"),
        (b'{"id": 10, "op": "explode"}', 10, "unknown_op"),
        (json.dumps({"id": 11, "op": "segment", "query": "liver"}), 11, "bad_request"),
        (json.dumps({"id": 12, "op": "segment", "volume": ct}), 12, "bad_request"),
        (json.dumps({"id": 13, "op": "segment", "volume": 13, "query": "x"}), 13, "bad_request"),
        (json.dumps({"id": 14, "op": "segment", "volume": ct, "query": "x", "seed": "abc"}), 14, "bad_request"),
        (json.dumps({"id": 15, "op": "propagate", "volume": ct, "anchor": "not an object"}), 15, "bad_request"),
        (json.dumps({"id": 16, "op": "cancel"}), 16, "bad_request"),
        (b'{"id": 17, "op": "hello", "pad": "' + b"x" * (1 << 20) + b'"}', None, "too_large"),
        (json.dumps({"id": 18, "op": "segment", "volume": str(tmp_path / "missing.nii.gz"), "query": "x"}), 18, "bad_volume"),
        (json.dumps({"id": 19, "op": "segment", "volume": str(corrupt), "query": "x"}), 19, "bad_volume"),
        (json.dumps({"id": 20, "op": "propagate", "volume": ct, "anchor": dict(good_anchor, slice=999)}), 20, "bad_anchor"),
        (json.dumps({"id": 21, "op": "propagate", "volume": ct, "anchor": good_anchor, "window": "no-such-window"}), 21, None),
        (json.dumps({"id": 22, "op": "load", "preset": "no-such-preset"}), 22, None),
        (json.dumps({"id": 23, "op": "segment", "volume": ct, "query": "   "}), 23, "bad_input"),
        (json.dumps({"id": 24, "op": "segment", "volume": ct, "query": "x", "window": [1, 2, 3]}), 24, "bad_request"),
        (json.dumps({"id": 25, "op": "propagate", "volume": ct, "anchor": good_anchor, "stop_after_empty": -1}), 25,
         "bad_request"),
        (json.dumps({"id": 26, "op": "segment", "volume": ct, "query": "x", "stop_after_empty": "3"}), 26, "bad_request"),
    ]
    assert len(cases) >= 20
    for raw, rid, code in cases:
        worker.send_raw(raw.encode() if isinstance(raw, str) else raw)
        msg = worker.reply(rid)
        assert msg["ok"] is False, (raw[:80], msg)
        assert msg["id"] == rid
        assert isinstance(msg["error"]["message"], str) and msg["error"]["message"]
        if code:
            assert msg["error"]["code"] == code, (raw[:80], msg)
        assert "Traceback" not in msg["error"]["message"]
    r = worker.call({"id": "valid", "op": "propagate", "volume": ct, "anchor": good_anchor, "stop_after_empty": 0})
    assert r["ok"] is True, r
    assert r["result"]["propagation"]["stop_after_empty"] == 0  # the field reaches the propagator
    assert r["result"]["anchor"]["propagation"]["slice_range"] == [0, 29]
    assert r["result"]["timings"]["models_reloaded"] is False  # the failed load kept the tiny models
    assert worker.proc.poll() is None
    assert not any("Traceback" in line for line in worker.stderr)


def _temp_dir_of(client):
    r = client.call({"id": "s", "op": "status"})
    return Path(r["result"]["tmp_dir"])


def test_shutdown_exits_cleanly_and_removes_temp_dir():
    c = StdioClient("--device", "cpu")
    try:
        tmp = _temp_dir_of(c)
        assert tmp.is_dir()
        r = c.call({"id": "bye", "op": "shutdown"})
        assert r["ok"] is True
        assert c.proc.wait(30) == 0
        assert not tmp.exists()
        assert c.lines.get(timeout=5) is None  # nothing after the shutdown reply
    finally:
        c.close()


@pytest.mark.parametrize("how", ["eof", "sigterm"])
def test_end_of_input_and_signal_stop_cleanly(how):
    c = StdioClient("--device", "cpu")
    try:
        tmp = _temp_dir_of(c)
        if how == "eof":
            c.proc.stdin.close()
        else:
            c.proc.send_signal(signal.SIGTERM)
        assert c.proc.wait(30) == 0
        assert not tmp.exists()
    finally:
        c.close()


# ---- HTTP -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http_server():
    s = HttpServer("--device", "cpu", "--preset", "tiny")
    yield s
    s.stop()


@pytest.mark.slow  # a worker process over HTTP, a segment end to end
def test_http_hello_status_segment(http_server, ct_sm_path, tmp_path):
    status, r = http_server.request("POST", "/rpc", {"id": "h", "op": "hello"})
    assert status == 200 and r["ok"] and r["result"]["protocol"] == 1 and r["result"]["transport"] == "http"

    body = {"id": "seg", "op": "segment", "query": "the liver",
            "volume_b64": base64.b64encode(ct_sm_path.read_bytes()).decode()}
    out = {}
    th = threading.Thread(target=lambda: out.update(r=http_server.request("POST", "/rpc", body)))
    th.start()
    busy = None
    deadline = time.monotonic() + 60
    while th.is_alive() and time.monotonic() < deadline:
        st, s = http_server.request("GET", "/status", timeout=10)
        assert st == 200 and s["ok"]
        if s["result"]["busy"] and (s["result"]["current"] or {}).get("id") == "seg":
            busy = s["result"]
            break
        time.sleep(0.05)
    th.join(TIMEOUT)
    assert busy is not None, "GET /status never showed the running segment"
    assert 0.0 <= busy["current"]["fraction"] <= 1.0 and busy["current"]["stage"]
    status, r = out["r"]
    assert status == 200 and r["ok"] is True, r
    res = r["result"]
    assert "mask_path" not in res
    mask_file = tmp_path / "mask.nii.gz"
    mask_file.write_bytes(base64.b64decode(res["mask_b64"]))
    assert tuple(nib.load(str(mask_file)).shape) == _ct_shape(ct_sm_path)
    assert res["anchor"]["schema"] == "medvol.anchor/1"
    assert res["timings"]["models_reloaded"] is False  # --preset tiny loaded them at start

    status, r = http_server.request("POST", "/rpc", {"id": "bad", "op": "segment", "query": "x"})
    assert status == 200 and r["ok"] is False and r["error"]["code"] == "bad_request" and r["id"] == "bad"
    status, r = http_server.request("GET", "/nowhere")
    assert status == 404 and r["ok"] is False


def test_http_refuses_non_loopback_bind_without_token():
    p = subprocess.run(SERVE + ["--http", "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "token" in lines[0] and "0.0.0.0" in lines[0]
    assert p.stdout == ""


def test_http_token_required(tmp_path):
    token = "s3cret-token-for-the-test-0123456789"
    tf = tmp_path / "token"
    tf.write_text(token + "\n")
    s = HttpServer("--device", "cpu", "--token-file", str(tf))
    try:
        status, r = s.request("POST", "/rpc", {"id": 1, "op": "hello"})
        assert status == 401 and r["ok"] is False and r["error"]["code"] == "unauthorized"
        status, r = s.request("GET", "/status", token="wrong-token-wrong-token")
        assert status == 401
        status, r = s.request("POST", "/rpc", {"id": 1, "op": "hello"}, token=token)
        assert status == 200 and r["ok"] is True and r["id"] == 1
        status, r = s.request("POST", "/rpc", {"id": 2, "op": "shutdown"}, token=token)
        assert status == 200 and r["ok"] is True
        assert s.proc.wait(30) == 0
    finally:
        s.stop()


# ---- "not present" ------------------------------------------------------------------------------

def test_absent_answer_replies_absent_and_writes_no_mask_unless_asked(ct_sm_path, tmp_path, monkeypatch):
    """An in-process worker whose grounder answers "[]": the reply says absent, names no mask, and
    an all-zero mask is written only with empty_mask_on_absent."""
    from medvolcore.grounder import QwenVLGrounder
    from medvolcore.serve import Worker

    monkeypatch.setattr(QwenVLGrounder, "_generate_text",
                        lambda self, *a, **k: ("<think>no cyst</think><answer>[]</answer>", {"new_tokens": 9}))
    w = Worker(transport="stdio", device="cpu")
    try:
        def call(req):
            done = threading.Event()
            got = []
            w.handle(req, reply=lambda r: (got.append(r), done.set()) if "event" not in r else None)
            assert done.wait(TIMEOUT)
            return got[0]

        base = {"op": "segment", "volume": str(ct_sm_path), "query": "the kidney cyst", "preset": "tiny"}
        r = call(dict(base, id=1, out=str(tmp_path / "no.nii.gz")))
        assert r["ok"] is True, r
        res = r["result"]
        assert res["absent"] is True and res["mask_path"] is None and res["mask_voxels"] == 0
        assert res["anchor"]["absent"] is True and res["anchor"]["slice"] is None
        assert "not found in this CT: the kidney cyst" in res["notes"] and not (tmp_path / "no.nii.gz").exists()
        r = call(dict(base, id=2, out=str(tmp_path / "zero.nii.gz"), empty_mask_on_absent=True))
        assert r["ok"] is True and r["result"]["mask_path"] == str(tmp_path / "zero.nii.gz")
        m = nib.load(str(tmp_path / "zero.nii.gz"))
        assert m.shape == _ct_shape(ct_sm_path) and not np.asarray(m.dataobj).any()
        r = call(dict(base, id=3, empty_mask_on_absent="yes"))
        assert r["ok"] is False and r["error"]["code"] == "bad_request" and "empty_mask_on_absent" in r["error"]["message"]
    finally:
        w.close(5)


# ---- consensus ---------------------------------------------------------------------------------

def test_worker_segment_with_consensus_replies_confidence_and_writes_agreement(tiny, monkeypatch, ct4, tmp_path):
    import queue

    from medvolcore.serve import Worker

    unusable = _answer_text(77, [100, 100, 300, 300])  # slice 77 was not shown: recorded, not retried
    _canned_samples(monkeypatch, tiny.grounder, GREEDY, [ABSENT, unusable])
    w = Worker(transport="stdio", device="cpu")
    w.pipeline = tiny  # loaded: no model loads in this test
    replies: queue.Queue = queue.Queue()
    vol, agr = str(ct4), str(tmp_path / "agr.nii.gz")
    base = {"op": "segment", "volume": vol, "query": "the liver"}
    probes = [({"consensus": 9}, "bad_request"), ({"agreement": agr}, "bad_request"),
              ({"consensus": 2, "agreement": vol}, "bad_input"), ({"consensus": 2, "consensus_mask": "mean"}, "bad_request"),
              ({"op": "propagate", "anchor": {}, "consensus": 2}, "bad_request")]
    try:
        for i, (fields, _code) in enumerate(probes):
            w.handle_line(json.dumps(dict(base, id=i, **fields)), reply=replies.put)
        w.handle_line(json.dumps(dict(base, id="ok", consensus=3, agreement=agr, out=str(tmp_path / "m.nii.gz"))),
                      reply=replies.put)
        got = {}
        while len(got) < len(probes) + 1:
            r = replies.get(timeout=120)
            if "event" not in r:
                got[r["id"]] = r
    finally:
        w.close(10)
    for i, (_fields, code) in enumerate(probes):
        assert got[i]["ok"] is False and got[i]["error"]["code"] == code, got[i]
    res = got["ok"]["result"]
    assert res["confidence"] == 0.0 and res["consensus"] == 3 and res["samples"][1] == {"sample": 2, "absent": True,
                                                                                       "answer_mean_prob": 0.5}
    assert res["samples"][2] == {"sample": 3, "unusable": "slice 77 is not one of the shown slices"}
    assert "1 of 3 samples gave an unusable answer (counted as disagreeing)" in res["notes"]
    assert res["agreement_path"] == agr and res["anchor"]["confidence"] == 0.0
    counts = np.asarray(nib.load(agr).dataobj)
    assert np.array_equal(counts, np.asarray(nib.load(res["mask_path"]).dataobj))  # one present answer: 0/1
    http = Worker(transport="http")
    try:
        from medvolcore.errors import ForbiddenError

        with pytest.raises(ForbiddenError, match="'agreement' names a file on the server"):
            http._check_queued(dict(base, id=1, volume=None, volume_b64="AAAA", consensus=2, agreement="a.nii.gz"),
                               None, "http")
    finally:
        http.close(5)


# ---- a painted slice as a prompt (medvol.anchor/4) ---------------------------------------------

def test_a_mask_prompt_round_encodes_no_slice_again(worker, ct_sm_path, seg_sm_path, tmp_path):
    """A re-propagation whose anchor carries a painted slice (a mask prompt) on a volume the worker has
    seen encodes nothing; the answer is /4, with the mask's slice located in world coordinates."""
    from medvolcore.maskprompt import mask_prompt, runs_to_mask

    img = nib.load(str(ct_sm_path))
    data = np.asarray(img.dataobj).copy()
    data[0, -1, -1] -= 1  # content no other test has sent
    vol = tmp_path / "ct.nii.gz"
    nib.save(nib.Nifti1Image(data, img.affine), str(vol))
    stack = as_stack(str(vol))
    seg = stack.to_stack(np.asarray(nib.load(str(seg_sm_path)).dataobj))
    k = stack.depth // 2
    v1 = {"schema": "medvol.anchor/1", "slice": k, "boxes": [[40, 30, 80, 70]], "source": "user"}

    def propagate(rid, anchor):
        r = worker.call({"id": rid, "op": "propagate", "volume": str(vol), "anchor": anchor, "stop_after_empty": 0,
                         "preset": "tiny"})
        assert r["ok"] is True, r
        return r["result"]

    first = propagate("mask-1", v1)
    assert first["slices_encoded"] == stack.depth
    painted = seg[k + 3] == 5  # the liver on another slice, as the clinician painted it
    v4 = dict(v1, schema="medvol.anchor/4", prompts=[mask_prompt(k + 3, 1, painted)])
    again = propagate("mask-2", v4)
    assert again["slices_encoded"] == 0 and again["timings"]["encoder_calls"] == 0
    p = again["anchor"]["prompts"][0]
    assert again["anchor"]["schema"] == "medvol.anchor/4" and p["slice"] == k + 3
    assert np.array_equal(runs_to_mask(p["mask"]["runs"], stack.width, stack.height), painted)
    assert np.allclose(stack.ras_to_stack(np.asarray([p["world"]["slice_center_ras"]]))[0, 0], k + 3)
    m1, m2 = (np.asarray(nib.load(r["mask_path"]).dataobj) for r in (first, again))
    assert not np.array_equal(m1, m2)


def test_bad_mask_prompts_are_json_errors_before_any_model(tmp_path):
    import queue

    from medvolcore.serve import Worker

    ct = tmp_path / "ct.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((20, 16, 10), dtype=np.int16), np.diag([2.0, 2.0, 2.0, 1.0])), str(ct))
    base = {"schema": "medvol.anchor/4", "slice": 4, "boxes": [[2, 3, 6, 8]], "source": "user"}
    probes = [[{"slice": 5, "object": 1, "mask": {"runs": []}}],           # empty
              [{"slice": 12, "object": 1, "mask": {"runs": [0, 4]}}],      # off the stack (10 slices)
              [{"slice": 5, "object": 1, "mask": {"runs": [300, 30]}}],    # beyond a 20×16 slice: another grid
              [{"slice": 5, "object": 4, "mask": {"runs": [0, 4]}}]]       # unknown object
    needles = ["empty", "outside the stack", "outside the 20×16 slice", "object 4 does not exist"]
    replies: queue.Queue = queue.Queue()
    w = Worker(transport="stdio", device="cpu")
    try:
        for i, prompts in enumerate(probes):
            w.handle_line(json.dumps({"id": i, "op": "propagate", "volume": str(ct), "anchor": dict(base, prompts=prompts)}),
                          reply=replies.put)
        got = {}
        while len(got) < len(probes):
            r = replies.get(timeout=60)
            if "event" not in r:
                got[r["id"]] = r
        for i, needle in enumerate(needles):
            assert got[i]["ok"] is False and got[i]["error"]["code"] == "bad_anchor", got[i]
            assert needle in got[i]["error"]["message"] and "\n" not in got[i]["error"]["message"]
        assert w.pipeline is None  # refused before any model was asked for
    finally:
        w.close(10)


@pytest.mark.probe("43.5", "several queries + consensus + agreement: stdio names the files written, HTTP replies ok")
@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_several_targets_name_their_agreement_maps_as_written(tiny, monkeypatch, ct4, tmp_path, transport):
    import queue

    from medvolcore.serve import Worker

    _canned_samples(monkeypatch, tiny.grounder, GREEDY, [ABSENT])
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    w = Worker(transport=transport, device="cpu", out_dir=out_dir if transport == "http" else None)
    w.pipeline = tiny  # loaded: no model loads in this test
    where = (lambda name: name) if transport == "http" else (lambda name: str(out_dir / name))
    req = {"id": "several", "op": "segment", "queries": ["the liver", "the spleen"], "consensus": 2,
           "agreement": where("agr.nii.gz"), "out": where("m.nii.gz"), "stop_after_empty": 0}
    if transport == "http":
        req["volume_b64"] = base64.b64encode(Path(ct4).read_bytes()).decode("ascii")
    else:
        req["volume"] = str(ct4)
    replies: queue.Queue = queue.Queue()
    try:
        w.handle(req, reply=replies.put)
        r = replies.get(timeout=120)
        while "event" in r:
            r = replies.get(timeout=120)
    finally:
        w.close(10)
    assert r["ok"] is True, r
    res = r["result"]
    assert res["agreement_path"] is None  # one map per target, named in its entry
    for k, entry in enumerate(res["targets"], start=1):
        path = entry["agreement_path"]
        written = out_dir / path if transport == "http" else Path(path)
        assert written.is_file() and written.name == f"agr.{k}.nii.gz", path
        assert np.asarray(nib.load(str(written)).dataobj).max() <= 2
        if transport == "http":
            assert not os.path.isabs(path) and not os.path.isabs(entry["agreement_out"])
            assert base64.b64decode(entry["agreement_b64"]) == written.read_bytes()


@pytest.mark.probe("43.5", "HTTP out .nrrd/.mha/.nii/.seg.nrrd: mask_b64 and the application/gzip body are .nii.gz")
@pytest.mark.parametrize("suffix", [".nrrd", ".mha", ".nii", ".seg.nrrd"])
def test_http_mask_bytes_are_nifti_gz_whatever_out_is(tiny, ct4, tmp_path, suffix):
    import gzip
    import io
    import queue

    from medvolcore.serve import Worker
    from medvolcore.serve.worker import MASK_BYTES_KEY

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    w = Worker(transport="http", device="cpu", out_dir=out_dir)
    w.pipeline = tiny
    anchor = {"schema": "medvol.anchor/1", "slice": 1, "boxes": [[10, 10, 40, 40]], "source": "user"}
    got = {}
    try:
        for as_body in (False, True):
            replies: queue.Queue = queue.Queue()
            w.handle({"id": "m", "op": "propagate", "anchor": anchor, "out": f"m{int(as_body)}{suffix}",
                      "volume_b64": base64.b64encode(Path(ct4).read_bytes()).decode("ascii"), "stop_after_empty": 0},
                     reply=replies.put, mask_bytes=as_body)
            r = replies.get(timeout=120)
            while "event" in r:
                r = replies.get(timeout=120)
            assert r["ok"] is True, r
            got[as_body] = r["result"].pop(MASK_BYTES_KEY) if as_body else base64.b64decode(r["result"]["mask_b64"])
            assert r["result"]["mask_path"] == f"m{int(as_body)}{suffix}"
            assert list(w.tmp_dir.glob("*reply*")) == []  # the reply's copy is gone
    finally:
        w.close(10)
    for data in got.values():
        assert data[:2] == b"\x1f\x8b"
        img = nib.Nifti1Image.from_bytes(gzip.decompress(data))
        assert tuple(img.shape) == tuple(nib.load(str(ct4)).shape) and np.asarray(img.dataobj).sum() > 0
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(f"m{i}{suffix}" for i in (0, 1))


@pytest.mark.probe("43.5", "HTTP: client B sends the CT client A sent: volume_cached / slices_encoded tell B nothing")
def test_a_cached_volume_is_reported_only_to_the_client_that_sent_it(tiny, ct4):
    import queue

    from medvolcore.serve import Worker

    w = Worker(transport="http", device="cpu")
    w.pipeline = tiny
    anchor = {"schema": "medvol.anchor/1", "slice": 1, "boxes": [[10, 10, 40, 40]], "source": "user"}
    data = base64.b64encode(Path(ct4).read_bytes()).decode("ascii")

    def timings(session):
        replies: queue.Queue = queue.Queue()
        w.handle({"id": "p", "op": "propagate", "anchor": anchor, "volume_b64": data, "stop_after_empty": 0},
                 reply=replies.put, session=session)
        r = replies.get(timeout=120)
        while "event" in r:
            r = replies.get(timeout=120)
        assert r["ok"] is True, r
        return r["result"]["timings"]["volume_cached"], r["result"]["slices_encoded"]

    try:
        first = timings("alice")
        assert first[0] is False and first[1] > 0
        assert timings("alice") == (True, 0)  # her own volume: cached, nothing encoded again
        assert timings("bob") == first  # bob learns nothing of alice's request
        assert timings("bob") == (True, 0)
    finally:
        w.close(10)


@pytest.mark.probe("43.4", "HTTP upload: a gzip NIfTI of zeros, the mask covering it: memory per voxel of the request")
def test_a_request_holds_at_most_12_bytes_a_voxel(tiny, tmp_path, record_property):
    """The numpy memory a whole propagate request holds at its peak (tracemalloc: the arrays the
    engine makes; the models' tensors are a fixed cost, apart), per voxel of the volume."""
    import gzip
    import queue
    import tracemalloc

    from medvolcore.serve import Worker
    from medvolcore.serve.cache import DEFAULT_MAX_VOXELS, REQUEST_BYTES_PER_VOXEL

    shape = (512, 512, 40)
    raw = nib.Nifti1Image(np.zeros(shape, np.int16), np.diag([0.8, 0.8, 2.0, 1.0])).to_bytes()
    data = gzip.compress(raw)
    w = Worker(transport="http", device="cpu", feature_cache_mb=0)
    w.pipeline = tiny
    anchor = {"schema": "medvol.anchor/1", "slice": 20, "boxes": [[5, 5, 506, 506]], "source": "user"}
    replies: queue.Queue = queue.Queue()
    tracemalloc.start()
    try:
        w.handle({"id": "z", "op": "propagate", "anchor": anchor, "stop_after_empty": 0}, reply=replies.put,
                 body=data)
        r = replies.get(timeout=300)
        while "event" in r:
            r = replies.get(timeout=300)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        w.close(10)
    assert r["ok"] is True, r
    voxels = int(np.prod(shape))
    record_property("upload bytes", len(data))
    record_property("peak bytes/voxel", round(peak / voxels, 2))
    assert r["result"]["mask_voxels"] > voxels // 4  # a mask over much of the volume: the statistics' worst case
    assert peak / voxels <= 12
    # the default limit's worst case fits in 8 GiB at the measured cost per voxel
    assert REQUEST_BYTES_PER_VOXEL * DEFAULT_MAX_VOXELS <= 8 << 30


@pytest.mark.probe("43.4", "64 queries (or a consensus of 8) on a volume the voxel limit admits for one target")
def test_several_targets_get_a_smaller_volume_not_more_memory(ct4):
    import queue

    from medvolcore.serve import Worker

    shape = nib.load(str(ct4)).shape
    voxels = int(np.prod(shape))
    w = Worker(transport="stdio", max_voxels=voxels)  # ct4 is as large as a volume may be

    def refuse(*a, **k):
        raise AssertionError("the models were reached")

    w._ensure_pipeline = refuse
    try:
        for fields in ({"queries": [f"organ {i}" for i in range(64)]}, {"query": "the liver", "consensus": 8}):
            got: queue.Queue = queue.Queue()
            w.handle(dict({"id": "many", "op": "segment", "volume": str(ct4)}, **fields), reply=got.put)
            r = got.get(timeout=60)
            while "event" in r:
                r = got.get(timeout=60)
            assert r["ok"] is False and r["error"]["code"] == "too_large", r
            assert "send fewer queries, a smaller consensus or a smaller volume" in r["error"]["message"]
    finally:
        w.close(5)


def test_a_stdio_mask_in_the_workers_temporary_folder_is_said_to_be_temporary(worker, ct_sm_path, tmp_path):
    """With no 'out' the stdio worker writes the mask into its own temporary folder, which goes when the
    worker exits: the reply says so (mask_temporary), and says the opposite for an 'out' asked for."""
    anchor = {"schema": "medvol.anchor/1", "slice": 15, "boxes": [[40, 30, 80, 70]], "source": "user"}
    base = {"op": "propagate", "volume": str(ct_sm_path), "anchor": anchor, "stop_after_empty": 0, "preset": "tiny"}
    r = worker.call({"id": "tmp-1", **base})
    assert r["ok"] is True, r
    assert r["result"]["mask_temporary"] is True and Path(r["result"]["mask_path"]).exists()
    out = tmp_path / "kept.nii.gz"
    r = worker.call({"id": "tmp-2", **base, "out": str(out)})
    assert r["ok"] is True, r
    assert r["result"]["mask_temporary"] is False and r["result"]["mask_path"] == str(out) and out.exists()
