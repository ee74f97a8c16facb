"""`medvol segment` / `medvol demo` and the Pipeline, end to end on the tiny preset (CPU)."""

from __future__ import annotations

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
    out, qc = tmp_path / "liver.nii.gz", tmp_path / "qc.png"
    code, stdout, err = run_cli(capsys, "segment", "--volume", SAMPLE, "--query", "the organ that secretes bile",
                                "--out", out, "--qc", qc, "--preset", "tiny", "--device", "cpu", "--json", "--no-progress")
    assert code == 0, err
    res = json.loads(stdout)
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


def test_demo_falls_back_to_tiny_with_notice(capsys, tmp_path):
    code, stdout, err = run_cli(capsys, "demo", "--out-dir", tmp_path, "--device", "cpu", "--no-progress")
    assert code == 0, err
    assert "tiny" in err and "medvol models download" in err
    assert (tmp_path / "demo_mask.nii.gz").exists() and (tmp_path / "demo.anchor.json").exists()
    assert (tmp_path / "demo_qc.png").exists()
    assert "preset 'tiny'" in stdout


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
