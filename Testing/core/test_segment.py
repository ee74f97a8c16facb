"""`medvol segment` / `medvol demo` and the Pipeline, end to end on the tiny preset (CPU)."""

from __future__ import annotations

import csv
import json

import nibabel as nib
import numpy as np
import pytest

from medvolcore.cli import main
from medvolcore.errors import GenerationError
from medvolcore.pipeline import Pipeline, as_stack
from medvolcore.resources import load_json, resource_path

SAMPLE = resource_path("samples", load_json("samples", "samples.json")["demo"]["file"])


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny():
    return Pipeline("tiny", device="cpu").load()


def test_sample_is_the_carried_upper_abdomen_ct(ct_sm_path):
    assert SAMPLE.read_bytes() == ct_sm_path.read_bytes()


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


def test_segment_cli_writes_mask_anchor_qc(capsys, tmp_path):
    import torch

    out, qc = tmp_path / "liver.nii.gz", tmp_path / "qc.png"
    before = torch.get_num_threads()
    try:
        code, stdout, err = run_cli(capsys, "segment", "--volume", SAMPLE, "--query", "the organ that secretes bile",
                                    "--out", out, "--qc", qc, "--preset", "tiny", "--device", "cpu", "--json",
                                    "--no-progress", "--threads", "1")
        assert code == 0, err
        assert torch.get_num_threads() == 1  # --threads reached torch
    finally:
        torch.set_num_threads(before)
    res = json.loads(stdout)
    assert (res["threads"], res["threads_rule"]) == (1, "1 CPU thread(s), as asked")
    assert res["grounder_dtype"] == "float32"  # auto: a smoke model stays fp32 on any CPU (test_cpu.py)
    src, m = nib.load(str(SAMPLE)), nib.load(str(out))
    assert m.shape == src.shape and np.array_equal(m.affine, src.affine)
    anchor = json.loads((tmp_path / "liver.anchor.json").read_text())
    assert anchor["query"] == "the organ that secretes bile" and anchor["source"] == "grounder"
    assert anchor["slice"] in as_stack(SAMPLE).sample_indices(64)
    assert any("smoke" in n for n in anchor["notes"]) and res["smoke"] is True
    from PIL import Image

    img = Image.open(qc)
    assert img.width > 512 and img.mode == "RGB"


def test_segment_cli_text_output_says_smoke(capsys, tmp_path):
    code, stdout, err = run_cli(capsys, "segment", "--volume", SAMPLE, "--query", "liver", "--out", tmp_path / "m.nii.gz",
                                "--preset", "tiny", "--device", "cpu", "--no-progress")
    assert code == 0, err
    assert stdout.startswith("NOTE:") and "smoke" in stdout.splitlines()[0]
    assert stdout.splitlines()[1] == "model: untrained tiny smoke model (random weights): results are meaningless"
    assert stdout.splitlines()[-1].startswith("compute: ") and "CPU thread(s)" in stdout.splitlines()[-1]


def test_demo_falls_back_to_tiny_with_notice(capsys, tmp_path):
    code, stdout, err = run_cli(capsys, "demo", "--out-dir", tmp_path, "--device", "cpu", "--no-progress")
    assert code == 0, err
    assert "tiny" in err and "medvol models download" in err
    assert (tmp_path / "demo_mask.nii.gz").exists() and (tmp_path / "demo.anchor.json").exists()
    assert (tmp_path / "demo_qc.png").exists()
    assert "preset 'tiny'" in stdout


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


def test_bar_text_has_the_stage_elapsed_time_left_and_message():
    from medvolcore.cli.volume import bar_line

    line = bar_line("propagate", 0.05, 3, "slice 3 (forward)", ncols=80)
    assert line.startswith("propagate   5%|") and line.endswith("| 00:03 < 00:57  slice 3 (forward)"), line
    assert "::" not in line and ", slice" not in line and len(line) == 80
    assert bar_line("ground", 0.0, 0, "rendering the slices").endswith("| 00:00 < ?  rendering the slices")


def test_progress_on_a_terminal_and_in_a_log(monkeypatch):
    import io

    from medvolcore.cli import volume as cli_volume

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream in (Terminal(), io.StringIO()):
        monkeypatch.setattr(cli_volume.sys, "stderr", stream)
        bar = cli_volume._bar("segment")
        progress = cli_volume._progress(bar)
        for i in range(3):
            progress("ground", i / 10, f"decoding {i}/256 tokens")
        progress("propagate", 0.5, "slice 3 (forward)")
        bar.close()
        text = stream.getvalue()
        if isinstance(stream, Terminal):  # the bar: stage, percent, the stage's clock, the message
            assert "ground     20%|" in text and "decoding 2/256 tokens" in text and "propagate  50%|" in text
            assert "::" not in text and ", decoding" not in text and " < " in text
        else:  # no terminal: one line per stage
            assert text.splitlines() == ["medvol ground: 0% decoding 0/256 tokens",
                                         "medvol propagate: 50% slice 3 (forward)"]


def test_demo_replaces_its_own_outputs_and_keeps_anything_else(capsys, tmp_path, monkeypatch):
    """What the demo may remove; the real run is test_demo_falls_back_to_tiny_with_notice."""
    from medvolcore.cli import volume as cli_volume

    runs = []

    def fake_run(volume, query, out, anchor_out, qc, args, preset, notice=""):
        runs.append(args.overwrite)
        absent = len(runs) == 2  # the second answer is "not present": no mask file
        for path in ([] if absent else [out]) + [anchor_out, qc]:
            path.write_text(f"run {len(runs)}")
        return {"out": None if absent else str(out), "anchor_out": str(anchor_out), "qc": str(qc)}

    monkeypatch.setattr(cli_volume, "_run_segment", fake_run)
    monkeypatch.setattr(cli_volume, "_segment_text", lambda res: "")
    out = tmp_path / "medvol-demo"
    assert run_cli(capsys, "demo", "--out-dir", out, "--no-progress")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["demo.anchor.json", "demo_mask.nii.gz", "demo_qc.png"]
    code, _, err = run_cli(capsys, "demo", "--out-dir", out, "--no-progress")  # again, no --overwrite
    assert code == 0 and "replaced the previous demo output" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["demo.anchor.json", "demo_qc.png"]  # no stale mask
    assert (out / "demo.anchor.json").read_text() == "run 2"
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "demo", "--out-dir", out, "--no-progress")
    _one_line(code, err, "notes.txt", "--overwrite")
    assert len(runs) == 2 and (out / "notes.txt").read_text() == "mine"
    assert run_cli(capsys, "demo", "--out-dir", out, "--no-progress", "--overwrite")[0] == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "demo_mask.nii.gz").read_text() == "run 3"
    assert runs == [True, True, True]


# ---- bad input -------------------------------------------------------------------------------

def _one_line(code, err, *needles, exit_code=2):
    assert code == exit_code, err
    lines = [l for l in err.splitlines() if "error" in l]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("query,needle", [("", "empty"), ("   \n ", "empty"), ("x" * 2001, "2000")])
def test_bad_queries(capsys, tmp_path, query, needle):
    code, _, err = run_cli(capsys, "segment", "--volume", SAMPLE, "--query", query, "--out", tmp_path / "m.nii.gz",
                           "--preset", "tiny", "--device", "cpu", "--no-progress")
    _one_line(code, err, needle)
    assert not (tmp_path / "m.nii.gz").exists()


def test_other_language_query_passes_through(tiny):
    seg = tiny.segment(SAMPLE, "el órgano que secreta la bilis")
    assert seg.anchor.slice in as_stack(SAMPLE).sample_indices(64)


def test_volume_too_small(capsys, tmp_path):
    p = tmp_path / "one.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((20, 20, 1), np.int16), np.eye(4)), str(p))
    code, _, err = run_cli(capsys, "segment", "--volume", p, "--query", "liver", "--out", tmp_path / "m.nii.gz",
                           "--preset", "tiny", "--device", "cpu", "--no-progress")
    _one_line(code, err, "too small")


def test_cuda_without_gpu(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run_cli(capsys, "segment", "--volume", SAMPLE, "--query", "liver", "--out", tmp_path / "m.nii.gz",
                           "--preset", "tiny", "--device", "cuda", "--no-progress")
    _one_line(code, err, "CUDA is not available")


def test_missing_weights_name_download_and_import(capsys, tmp_path):
    code, _, err = run_cli(capsys, "segment", "--volume", SAMPLE, "--query", "liver", "--out", tmp_path / "m.nii.gz",
                           "--preset", "qwen3-vl-4b", "--device", "cpu", "--no-progress")
    assert code != 0
    _one_line(code, err, "medvol models download", "medvol models import", exit_code=code)


def test_generation_that_never_parses_exits_3(capsys, tmp_path, monkeypatch):
    from medvolcore import grounder as g

    def never(self, *a, **k):
        raise GenerationError("the model never produced a valid answer after 3 attempts; last raw text: 'blah'")

    monkeypatch.setattr(g.QwenVLGrounder, "ground", never)
    code, _, err = run_cli(capsys, "segment", "--volume", SAMPLE, "--query", "liver", "--out", tmp_path / "m.nii.gz",
                           "--preset", "tiny", "--device", "cpu", "--no-progress", "--no-constrain")
    _one_line(code, err, "raw text", exit_code=3)
    assert not (tmp_path / "m.nii.gz").exists()


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


@pytest.fixture
def answers_absent(monkeypatch):
    from medvolcore.grounder import QwenVLGrounder

    monkeypatch.setattr(QwenVLGrounder, "_generate_text", lambda self, *a, **k: (ABSENT, {"new_tokens": 12}))


def test_segment_cli_absent_writes_no_mask_and_says_not_found(capsys, tmp_path, answers_absent):
    out, qc = tmp_path / "cyst.nii.gz", tmp_path / "qc.png"
    code, stdout, err = run_cli(capsys, "segment", "--volume", SAMPLE, "--query", "the kidney that contains the cyst",
                                "--out", out, "--qc", qc, "--preset", "tiny", "--device", "cpu", "--no-progress")
    assert code == 0, err
    assert "not found in this CT: the kidney that contains the cyst" in stdout.splitlines()
    assert "no mask written" in stdout and not out.exists() and qc.exists()
    anchor = json.loads((tmp_path / "cyst.anchor.json").read_text())
    assert anchor["absent"] is True and anchor["slice"] is None and anchor["schema"] == "medvol.anchor/3"


def test_segment_cli_absent_with_empty_mask_writes_zeros_on_the_grid(capsys, tmp_path, answers_absent):
    out = tmp_path / "cyst.nii.gz"
    code, stdout, err = run_cli(capsys, "segment", "--volume", SAMPLE, "--query", "the kidney cyst", "--out", out,
                                "--empty-mask-on-absent", "--preset", "tiny", "--device", "cpu", "--no-progress", "--json")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["absent"] is True and res["out"] == str(out) and res["mask_voxels"] == 0
    src, m = nib.load(str(SAMPLE)), nib.load(str(out))
    assert m.shape == src.shape and np.array_equal(m.affine, src.affine) and not np.asarray(m.dataobj).any()


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


def test_consensus_cli_writes_the_agreement_on_the_ct_grid(capsys, tmp_path, tiny, monkeypatch, ct4):
    import medvolcore.pipeline

    monkeypatch.setattr(medvolcore.pipeline, "Pipeline", lambda *a, **k: tiny)  # the module's loaded tiny models
    _canned_samples(monkeypatch, tiny.grounder, GREEDY, [GREEDY, ABSENT])
    out, agr = tmp_path / "m.nii.gz", tmp_path / "agreement.nii.gz"
    code, stdout, err = run_cli(capsys, "segment", "--volume", ct4, "--query", "the liver", "--out", out,
                                "--consensus", "3", "--agreement", agr, "--device", "cpu", "--json", "--no-progress")
    assert code == 0, err
    res = json.loads(stdout)
    src, m, a = nib.load(str(ct4)), nib.load(str(out)), nib.load(str(agr))
    assert a.shape == src.shape and np.array_equal(a.affine, src.affine)
    mask, counts = np.asarray(m.dataobj), np.asarray(a.dataobj)
    assert set(np.unique(counts)) == {0, 2} and mask.any()  # the greedy answer twice, "not present" once
    assert np.array_equal(counts > 0, mask > 0)  # the greedy answer's mask, inside agreement > 0
    assert res["confidence"] == pytest.approx(1 / 3, abs=1e-4)  # pairs: 1, 0, 0
    assert res["consensus"] == 3 and len(res["samples"]) == 3 and res["agreement_out"] == str(agr)
    anchor = json.loads((tmp_path / "m.anchor.json").read_text())
    assert anchor["confidence"] == pytest.approx(1 / 3, abs=1e-4) and anchor["samples"][2]["absent"] is True


def test_consensus_and_signal_lines_say_what_they_are_not():
    from medvolcore.cli.volume import _sureness_text

    res = {"confidence": 1 / 3, "consensus_mask": "greedy", "samples": [{"sample": 1}, {"sample": 2}, {"absent": True}]}
    text = _sureness_text(res)
    assert text.startswith("confidence 0.33: agreement of 3 samples") and "1 said not present" in text
    assert "not the chance that it is right" in text
    signal = _sureness_text({"confidence": None, "answer_mean_prob": 0.734})
    assert signal.startswith("answer signal 0.73") and "not the chance that it is right" in signal
    assert _sureness_text({}) == ""


@pytest.mark.parametrize("extra,needle", [
    (["--consensus", "9"], "1 to 8"), (["--consensus", "0"], "1 to 8"),
    (["--agreement", "AGR"], "add --consensus G"), (["--consensus", "2", "--agreement", "VOLUME"], "is the input"),
    (["--consensus", "2", "--agreement", "x.txt"], "unsupported agreement map type"),
    (["--consensus-mask", "majority"], "needs --consensus"), (["--consensus", "2", "--sample"], "do not go together")])
def test_consensus_option_errors_are_one_line(capsys, tmp_path, monkeypatch, extra, needle):
    import medvolcore.pipeline

    monkeypatch.setattr(medvolcore.pipeline, "Pipeline", lambda *a, **k: pytest.fail("a model was asked for"))
    names = {"AGR": str(tmp_path / "a.nii.gz"), "VOLUME": str(SAMPLE), "x.txt": str(tmp_path / "x.txt")}
    code, _, err = run_cli(capsys, "segment", "--volume", SAMPLE, "--query", "liver", "--out", tmp_path / "m.nii.gz",
                           "--device", "cpu", "--no-progress", *[names.get(e, e) for e in extra])
    _one_line(code, err, needle)
    assert not list(tmp_path.iterdir())


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


def test_batch_with_consensus_writes_agreement_and_a_confidence_column(tiny, monkeypatch, ct4, tmp_path):
    from medvolcore.batch import AGREEMENT, BatchOptions, completed_record, read_manifest, run_batch

    _canned_samples(monkeypatch, tiny.grounder, GREEDY, [GREEDY])
    manifest = tmp_path / "cases.csv"
    manifest.write_text(f"id,volume,query\ncase1,{ct4},the liver\n")
    out = tmp_path / "out"
    res = run_batch(manifest, out, BatchOptions(consensus=2, progress=False), pipeline=tiny)
    assert res.exit_code == 0 and res.info["confidence"] == {"cases": 1, "mean": 1.0, "min": 1.0}
    done = json.loads((out / "case1" / "done.json").read_text())
    assert done["confidence"] == 1.0 and AGREEMENT in done["outputs"] and (out / "case1" / AGREEMENT).is_file()
    with open(out / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["id"] == "case1" and rows[0]["confidence"] == "1.000"
    assert rows[-1]["id"] == "summary.median" and rows[-1]["confidence"] == "1.000"
    assert "confidence 1.000 (agreement of the model" in (out / "summary.html").read_text()
    # --resume keeps the case for the same consensus only; without its map it is not complete
    case = read_manifest(manifest)[0]
    assert completed_record(out / "case1", case, case.fingerprint("tiny", None, 2, "greedy")) is not None
    assert completed_record(out / "case1", case, case.fingerprint("tiny", None, 1)) is None
    assert completed_record(out / "case1", case, case.fingerprint("tiny", None, 2, "majority")) is None
    (out / "case1" / AGREEMENT).unlink()
    assert completed_record(out / "case1", case, case.fingerprint("tiny", None, 2, "greedy")) is None
