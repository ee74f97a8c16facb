"""The `medvol` command line (medvolcore.cli): outputs on real CT, `medvol segment` and `medvol demo` on
the tiny preset, and one clear error line for each bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

from medvolcore.cli import main
from medvolcore.errors import GenerationError
from medvolcore.pipeline import Pipeline, as_stack

from ts_labels import KIDNEY_LEFT, KIDNEY_RIGHT, LIVER
from core.probes import one_line
from core.test_pipeline import ABSENT, GREEDY, QUERIES, SAMPLE, _canned_samples, canned, ct4, tiny  # noqa: F401  (fixtures)

MEDVOL = [sys.executable, "-m", "medvolcore.cli"]


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *needles):
    assert code != 0
    lines = [l for l in err.splitlines() if "error" in l]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


# ---- medvol anchor ------------------------------------------------------------------------

def test_anchor_writes_file_with_world(capsys, tmp_path, seg_path):
    out = tmp_path / "kidneys.anchor.json"
    code, stdout, err = run_cli(capsys, "anchor", "--mask", seg_path, "--label", f"{KIDNEY_RIGHT},{KIDNEY_LEFT}",
                                "--out", out, "--json")
    assert code == 0, err
    d = json.loads(out.read_text())
    assert d["schema"] == "medvol.anchor/1" and d["source"] == "mask"
    assert len(d["boxes"]) == 2 and len(d["world"]["boxes_ras"]) == 2
    # patient right (RAS x > 0 here: the R coordinate is larger) comes first: image left.
    assert d["world"]["boxes_ras"][0][0][0] > d["world"]["boxes_ras"][1][0][0]
    assert json.loads(stdout)["anchor"]["slice"] == d["slice"]


def test_anchor_without_label_uses_all_nonzero(capsys, seg_sm_path):
    code, stdout, _ = run_cli(capsys, "anchor", "--mask", seg_sm_path)
    assert code == 0
    d = json.loads(stdout)
    nz = (np.asarray(nib.load(str(seg_sm_path)).dataobj) != 0).sum(axis=(0, 1))
    # the stack runs head to feet: stack z = K-1-k on this RAS file; ties go to the smaller z
    by_z = nz[::-1]
    assert d["slice"] == int(np.argmax(by_z))


def test_anchor_top_k_seeded(capsys, seg_path):
    a = run_cli(capsys, "anchor", "--mask", seg_path, "--label", LIVER, "--top-k", 5, "--seed", 3)[1]
    b = run_cli(capsys, "anchor", "--mask", seg_path, "--label", LIVER, "--top-k", 5, "--seed", 3)[1]
    assert json.loads(a)["slice"] == json.loads(b)["slice"]


# ---- bad input: one line, non-zero, no traceback ------------------------------------------

def test_missing_file(capsys, tmp_path):
    code, _, err = run_cli(capsys, "anchor", "--mask", tmp_path / "nope.nii.gz")
    assert_one_line_error(code, err, "does not exist")


def test_unreadable_file(capsys, tmp_path):
    bad = tmp_path / "bad.nii.gz"
    bad.write_bytes(b"this is not a nifti file")
    code, _, err = run_cli(capsys, "anchor", "--mask", bad)
    assert_one_line_error(code, err, "cannot read", "bad.nii.gz")


@pytest.mark.parametrize("shape", [(10, 12), (6, 7, 5, 3)])
def test_wrong_dimensionality(capsys, tmp_path, shape):
    p = tmp_path / "img.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros(shape, np.int16), np.eye(4)), str(p))
    code, _, err = run_cli(capsys, "propagate", "--volume", p, "--slice", 0, "--box", 0, 0, 1, 1,
                           "--out", tmp_path / "m.nii.gz", "--random-weights", 0)
    assert_one_line_error(code, err, "3-D")


def test_all_nan_volume(capsys, tmp_path):
    p = tmp_path / "nan.nii.gz"
    nib.save(nib.Nifti1Image(np.full((6, 7, 5), np.nan, np.float32), np.eye(4)), str(p))
    code, _, err = run_cli(capsys, "info", p)
    assert_one_line_error(code, err, "NaN")


def test_non_numeric_volume(capsys, tmp_path):
    p = tmp_path / "c.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((6, 7, 5), np.complex64), np.eye(4)), str(p))
    code, _, err = run_cli(capsys, "info", p)
    assert_one_line_error(code, err, "not numbers")


def test_label_absent(capsys, seg_path):
    code, _, err = run_cli(capsys, "anchor", "--mask", seg_path, "--label", 116)
    assert_one_line_error(code, err, "label 116 is absent", "labels present")


def test_bad_label_text(capsys, seg_path):
    code, _, err = run_cli(capsys, "anchor", "--mask", seg_path, "--label", "liver")
    assert_one_line_error(code, err, "integer label ids")


def test_slice_outside_stack(capsys, tmp_path, small_ct):
    ct, _ = small_ct
    code, _, err = run_cli(capsys, "propagate", "--volume", ct, "--slice", 8, "--box", 10, 10, 20, 20,
                           "--out", tmp_path / "m.nii.gz", "--random-weights", 0, "--image-size", 64)
    assert_one_line_error(code, err, "slice 8 is outside the stack (0..7)")
    assert not (tmp_path / "m.nii.gz").exists()


def test_inverted_box(capsys, tmp_path, small_ct):
    ct, _ = small_ct
    code, _, err = run_cli(capsys, "propagate", "--volume", ct, "--slice", 3, "--box", 30, 10, 20, 20,
                           "--out", tmp_path / "m.nii.gz", "--random-weights", 0, "--image-size", 64)
    assert_one_line_error(code, err, "inverted")


def test_box_entirely_outside(capsys, tmp_path, small_ct):
    ct, _ = small_ct
    code, _, err = run_cli(capsys, "propagate", "--volume", ct, "--slice", 3, "--box", 500, 10, 600, 20,
                           "--out", tmp_path / "m.nii.gz", "--random-weights", 0, "--image-size", 64)
    assert_one_line_error(code, err, "entirely outside")


def test_anchor_with_other_schema(capsys, tmp_path, small_ct):
    ct, _ = small_ct
    a = tmp_path / "x.anchor.json"
    a.write_text(json.dumps({"schema": "medvol.anchor/9", "slice": 1, "boxes": [[1, 1, 5, 5]], "image_size": [122, 101]}))
    code, _, err = run_cli(capsys, "propagate", "--volume", ct, "--anchor", a, "--out", tmp_path / "m.nii.gz",
                           "--random-weights", 0, "--image-size", 64)
    assert_one_line_error(code, err, "medvol.anchor/9", "medvol.anchor/1", "medvol.anchor/2")


def test_anchor_and_box_together_refused(capsys, tmp_path, small_ct):
    ct, _ = small_ct
    code, _, err = run_cli(capsys, "propagate", "--volume", ct, "--anchor", tmp_path / "a.json", "--slice", 1,
                           "--box", 1, 1, 2, 2, "--out", tmp_path / "m.nii.gz", "--random-weights", 0)
    assert_one_line_error(code, err, "either --anchor or --slice")


def test_no_weights_refused(capsys, tmp_path, small_ct):
    ct, _ = small_ct
    code, _, err = run_cli(capsys, "propagate", "--volume", ct, "--slice", 1, "--box", 1, 1, 2, 2,
                           "--out", tmp_path / "m.nii.gz")
    assert_one_line_error(code, err, "--sam-checkpoint")


def test_not_a_medsam2_checkpoint(capsys, tmp_path, small_ct):
    import torch

    ct, _ = small_ct
    ck = tmp_path / "other.pt"
    torch.save({"model": {"encoder.weight": torch.zeros(3)}}, str(ck))
    code, _, err = run_cli(capsys, "propagate", "--volume", ct, "--slice", 1, "--box", 1, 1, 2, 2,
                           "--out", tmp_path / "m.nii.gz", "--sam-checkpoint", ck)
    assert_one_line_error(code, err, "not a MedSAM2 checkpoint", "missing", "unexpected", "encoder.weight")


def test_output_exists_refused_then_overwritten(capsys, tmp_path, small_ct):
    ct, _ = small_ct
    out = tmp_path / "m.nii.gz"
    out.write_bytes(b"precious")
    args = ["propagate", "--volume", ct, "--slice", 3, "--box", 40, 40, 70, 70, "--out", out,
            "--random-weights", 0, "--image-size", 64, "--no-progress"]
    code, _, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, "already exists", "--overwrite")
    assert out.read_bytes() == b"precious"
    code, _, err = run_cli(capsys, *args, "--overwrite")
    assert code == 0, err
    assert nib.load(str(out)).shape == nib.load(str(ct)).shape
    assert not [p for p in tmp_path.iterdir() if ".part" in p.name]


# ---- medvol propagate end to end ----------------------------------------------------------

def test_propagate_writes_mask_on_source_grid(capsys, tmp_path, small_ct):
    ct, seg = small_ct
    out = tmp_path / "mask.nii.gz"
    anchor_out = tmp_path / "used.anchor.json"
    code, stdout, err = run_cli(capsys, "propagate", "--volume", ct, "--slice", 3, "--box", 20, 30, 200, 90,
                                "--out", out, "--random-weights", 0, "--image-size", 64, "--json",
                                "--anchor-out", anchor_out, "--no-progress")
    assert code == 0, err
    assert "random MedSAM2 weights" in err  # the smoke-model warning
    res = json.loads(stdout)
    src, m = nib.load(str(ct)), nib.load(str(out))
    assert m.shape == src.shape and np.array_equal(m.affine, src.affine)
    assert m.get_data_dtype() == np.uint8
    assert set(np.unique(np.asarray(m.dataobj)).tolist()) <= {0, 1}
    # the box reached outside the 122-wide slice: clamped with a warning
    assert "clamped" in err and res["anchor"]["boxes"] == [[20, 30, 121, 90]]
    assert res["slice_range"] == [0, 7] and res["slices_encoded"] == 8 and res["encoder_calls"] == 8
    assert res["peak_memory_mb"] > 0 and res["seconds_per_slice"] > 0
    assert json.loads(anchor_out.read_text())["world"]["boxes_ras"]


def test_propagate_from_anchor_file_matches_slice_and_box(capsys, tmp_path, small_ct):
    ct, seg = small_ct
    a = tmp_path / "liver.anchor.json"
    assert run_cli(capsys, "anchor", "--mask", seg, "--label", LIVER, "--out", a)[0] == 0
    d = json.loads(a.read_text())
    out1, out2 = tmp_path / "a.nii.gz", tmp_path / "b.nii.gz"
    common = ["--volume", ct, "--random-weights", 1, "--image-size", 64, "--no-progress", "--window", 2]
    assert run_cli(capsys, "propagate", "--anchor", a, "--out", out1, *common)[0] == 0
    box = d["boxes"][0]
    assert run_cli(capsys, "propagate", "--slice", d["slice"], "--box", *box, "--out", out2, *common)[0] == 0
    m1, m2 = (np.asarray(nib.load(str(p)).dataobj) for p in (out1, out2))
    assert np.array_equal(m1, m2)
    # --window 2 around the key slice: nothing outside [k-2, k+2] (stack z = K-1-k here)
    K = m1.shape[2]
    zs = {K - 1 - k for k in np.nonzero(m1.any(axis=(0, 1)))[0]}
    assert zs <= set(range(d["slice"] - 2, d["slice"] + 3))


def test_propagate_world_only_anchor(capsys, tmp_path, small_ct):
    ct, seg = small_ct
    a = tmp_path / "l.anchor.json"
    assert run_cli(capsys, "anchor", "--mask", seg, "--label", LIVER, "--out", a)[0] == 0
    d = json.loads(a.read_text())
    world_only = {k: v for k, v in d.items() if k not in ("boxes", "boxes_norm", "image_size", "slice")}
    w = tmp_path / "w.anchor.json"
    w.write_text(json.dumps(world_only))
    out = tmp_path / "m.nii.gz"
    code, stdout, err = run_cli(capsys, "propagate", "--volume", ct, "--anchor", w, "--out", out, "--json",
                                "--random-weights", 0, "--image-size", 64, "--window", 0, "--no-progress")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["anchor"]["slice"] == d["slice"] and res["anchor"]["boxes"] == d["boxes"]


# ---- medvol metrics -----------------------------------------------------------------------

def test_metrics_on_known_overlap(capsys, tmp_path, seg_path):
    seg = nib.load(str(seg_path))
    gt = np.asarray(seg.dataobj)
    pred = (gt == LIVER).astype(np.uint8)
    n = int(pred.sum())
    # remove the liver's first 1000 voxels (in C order) from the prediction: Dice = 2(n-1000)/(2n-1000)
    idx = np.flatnonzero(pred)[:1000]
    pred[np.unravel_index(idx, pred.shape)] = 0
    p = tmp_path / "pred.nii.gz"
    nib.save(nib.Nifti1Image(pred, seg.affine), str(p))
    code, stdout, _ = run_cli(capsys, "metrics", "--pred", p, "--gt", seg_path, "--label", LIVER, "--json")
    res = json.loads(stdout)
    assert code == 0
    assert res["dice"] == pytest.approx(2 * (n - 1000) / (2 * n - 1000))
    assert res["iou"] == pytest.approx((n - 1000) / n)


def test_metrics_per_label(capsys, seg_sm_path):
    code, stdout, _ = run_cli(capsys, "metrics", "--pred", seg_sm_path, "--gt", seg_sm_path, "--json")
    res = json.loads(stdout)
    assert code == 0 and res["mean_dice"] == 1.0 and str(LIVER) in res["per_label"]


def test_metrics_grid_mismatch(capsys, seg_path, seg_sm_path):
    code, _, err = run_cli(capsys, "metrics", "--pred", seg_sm_path, "--gt", seg_path)
    assert_one_line_error(code, err, "do not cover the same space")


# ---- as a real process ----------------------------------------------------------------------

def test_process_exit_code_and_single_line(tmp_path):
    r = subprocess.run(MEDVOL + ["anchor", "--mask", str(tmp_path / "missing.nii.gz")], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    r = subprocess.run(MEDVOL + ["propagate", "--volume"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("cmd", ["info", "anchor", "propagate", "metrics"])
def test_help(cmd):
    r = subprocess.run(MEDVOL + [cmd, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "usage: medvol " + cmd in r.stdout


def test_anchor_command_does_not_import_torch(tmp_path, seg_sm_path):
    code = ("import sys; from medvolcore.cli import main; main(['anchor', '--mask', %r, '--out', %r]); "
            "print(sorted(m for m in ('torch', 'sam2', 'transformers', 'SimpleITK') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code % (str(seg_sm_path), str(tmp_path / "a.anchor.json"))],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_missing_simpleitk_says_what_to_install(capsys, tmp_path, monkeypatch):
    p = tmp_path / "ct.nrrd"
    p.write_bytes(b"NRRD0004\n")
    monkeypatch.setitem(sys.modules, "SimpleITK", None)  # makes `import SimpleITK` fail
    code, _, err = run_cli(capsys, "info", p)
    assert_one_line_error(code, err, "SimpleITK", "pip install")


@pytest.mark.parametrize("module, usage", [
    ("medvolcore.cli", "usage: medvol [-h]"),
    ("medvolcore.cli_serve", "usage: medvol serve [-h]"),  # how Slicer starts the worker
    ("medvolcore.cli_batch", "usage: medvol batch [-h]"),
])
def test_python_dash_m_entry_points(module, usage):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(usage) and "Traceback" not in r.stderr


# ---- medvol segment and medvol demo (the tiny preset, end to end) ------------------------------

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


# ---- medvol segment: bad input ----------------------------------------------------------------

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


# ---- medvol segment: "not present" -------------------------------------------------------------

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


# ---- medvol segment --consensus ---------------------------------------------------------------

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


# ---- medvol segment with several queries --------------------------------------------------------

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


# ---- probes: terminal controls and huge numbers on the command line (second review, II.10) ------------

def _run_cli_or_exit(capsys, *argv):
    """:func:`run_cli`, with argparse's own refusals (SystemExit) turned into their exit code."""
    try:
        return run_cli(capsys, *argv)
    except SystemExit as e:
        out, err = capsys.readouterr()
        return e.code, out, err


@pytest.mark.probe("II.10", "ESC, CR, C1 and bidi controls in a path, a window and a case error printed by the CLI")
def test_the_cli_never_prints_terminal_controls(capsys, tmp_path):
    from medvolcore.cli.batch import _text
    from medvolcore.cli.common import emit

    evil = "\x1b[2J\x1b]0;owned\x07\rreal\x9b31m\u202eevil"
    code, out, err = run_cli(capsys, "info", tmp_path / f"{evil}.nii.gz")
    one_line(code, err, "\\x1b[2J", "\\x0d", "\\x9b", "\\u202e")
    code, out, err = _run_cli_or_exit(capsys, "propagate", "--volume", tmp_path / "v.nii.gz", "--slice", evil)  # argparse's
    assert code == 2 and "\\x1b" in err
    emit({}, False, f"query: {evil}\nnext line")
    info = {"cases": 1, "done": 0, "failed": 1, "skipped": 0, "seconds": 1.0, "summary_csv": "s.csv",
            "summary_html": "s.html", "failures": [{"id": "a", "error": f"bad_volume: {evil}.nii.gz\ndoes not exist"}]}
    text = _text(info)
    out = capsys.readouterr().out
    for printed in (err, out, text):
        assert not any(c in printed for c in "\x1b\x07\r\x9b\u202e"), repr(printed)
    assert out.count("\n") == 2 and "failed a: bad_volume: \\x1b[2J" in text and "\\x0adoes not exist" in text


@pytest.mark.probe("II.10", "--ct-window 1e308,1e308, --box with a 30-digit coordinate, --random-weights 10**30")
@pytest.mark.parametrize("args,needle", [
    (["--ct-window", "1e308,1e308"], "invalid window"),
    (["--ct-window", "nan,400"], "invalid window"),
    (["--box", "0", "0", "1" + "0" * 30, "5"], "out of range"),
    (["--add-box", "3", "1", "0", "0", "-" + "9" * 30, "5"], "out of range"),
    (["--random-weights", "9" * 30], "not a seed"),
])
def test_huge_numbers_on_the_command_line_are_one_line(capsys, tmp_path, small_ct, args, needle):
    base = ["propagate", "--volume", small_ct[0], "--slice", "3", "--out", tmp_path / "m.nii.gz", "--no-progress"]
    if "--box" not in args:
        base += ["--box", "30", "30", "90", "80"]
    if "--random-weights" not in args:
        base += ["--random-weights", "0", "--image-size", "32"]
    code, _, err = _run_cli_or_exit(capsys, *base, *args)
    one_line(code, err, needle)
    assert not (tmp_path / "m.nii.gz").exists()


# ---- medvol propagate --mask-prompt ---------------------------------------------------------

@pytest.fixture(scope="module")
def painted(small_ct, tmp_path_factory):
    """The liver of slice 5 of the small CT's canonical stack, written as .npy, .png and as a label map on
    the volume's grid (that slice only)."""
    from PIL import Image

    from medvolcore.stack import AxialStack
    from medvolcore.volume import load_volume

    ct, seg = small_ct
    stack = AxialStack(load_volume(ct))
    z = 5
    m = stack.to_stack(np.asarray(nib.load(str(seg)).dataobj)) == LIVER
    m[:z] = m[z + 1:] = False
    d = tmp_path_factory.mktemp("painted")
    np.save(d / "m.npy", m[z])
    Image.fromarray((m[z] * 255).astype(np.uint8)).save(d / "m.png")
    img = nib.load(str(ct))
    nib.save(nib.Nifti1Image(stack.to_source(m.astype(np.uint8)), img.affine), str(d / "m.nii.gz"))
    return z, m[z], d


def test_propagate_mask_prompt_from_npy_png_and_a_label_map(capsys, tmp_path, small_ct, painted):
    ct, _ = small_ct
    z, m, d = painted
    common = ["--volume", ct, "--slice", 3, "--box", 20, 30, 100, 90, "--random-weights", 0, "--image-size", 64,
              "--no-progress", "--json"]
    code, out, err = run_cli(capsys, "propagate", *common, "--out", tmp_path / "plain.nii.gz")
    assert code == 0, err
    plain = np.asarray(nib.load(str(tmp_path / "plain.nii.gz")).dataobj)
    masks = []
    for f in ("m.npy", "m.png", "m.nii.gz"):
        out_path = tmp_path / f"{f}.mask.nii.gz"
        code, out, err = run_cli(capsys, "propagate", *common, "--mask-prompt", z, 1, d / f, "--out", out_path,
                                 "--anchor-out", tmp_path / f"{f}.anchor.json")
        assert code == 0, err
        res = json.loads(out)
        assert res["anchor"]["schema"] == "medvol.anchor/4"
        from medvolcore.maskprompt import runs_to_mask

        p = res["anchor"]["prompts"][0]
        assert p["slice"] == z and p["object"] == 1 and np.array_equal(runs_to_mask(p["mask"]["runs"], 122, 101), m)
        masks.append(np.asarray(nib.load(str(out_path)).dataobj))
    assert np.array_equal(masks[0], masks[1]) and np.array_equal(masks[0], masks[2])
    assert not np.array_equal(masks[0], plain)
    # the written anchor propagates again to the same mask
    code, _, err = run_cli(capsys, "propagate", *common[:2], "--anchor", tmp_path / "m.npy.anchor.json",
                           *common[9:], "--out", tmp_path / "again.nii.gz")
    assert code == 0, err
    assert np.array_equal(np.asarray(nib.load(str(tmp_path / "again.nii.gz")).dataobj), masks[0])


@pytest.mark.parametrize("make, z, k, needle", [
    (lambda d, m: np.save(d / "x.npy", np.zeros_like(m)) or d / "x.npy", 5, 1, "is empty"),
    (lambda d, m: d / "m.npy", 8, 1, "slice 8 is outside the stack (0..7)"),
    (lambda d, m: np.save(d / "y.npy", m[:50]) or d / "y.npy", 5, 1, "is 122×50 pixels but the volume's axial slices are 122×101"),
    (lambda d, m: d / "m.npy", 5, 3, "object 3 does not exist"),
    (lambda d, m: d / "m.nii.gz", 4, 1, "not only on slice 4"),
    (lambda d, m: d / "none.npy", 5, 1, "does not exist"),
    (lambda d, m: (d / "m.txt").write_text("1") and d / "m.txt", 5, 1, "not .txt"),
], ids=["empty", "off-the-stack", "other-grid", "unknown-object", "label-map-on-another-slice", "missing", "suffix"])
def test_bad_mask_prompts_are_one_line_before_any_model_loads(capsys, tmp_path, small_ct, painted, monkeypatch,
                                                             make, z, k, needle):
    from medvolcore.propagation import MedSAM2Propagator

    def no_model(*a, **kw):
        raise AssertionError("a model was loaded for a bad mask prompt")

    monkeypatch.setattr(MedSAM2Propagator, "from_random", no_model)
    ct, _ = small_ct
    _, m, d = painted
    f = make(d, m)
    code, _, err = _run_cli_or_exit(capsys, "propagate", "--volume", ct, "--slice", 3, "--box", 20, 30, 100, 90,
                                    "--mask-prompt", z, k, f, "--out", tmp_path / "m.nii.gz", "--random-weights", 0,
                                    "--image-size", 64, "--no-progress")
    one_line(code, err, needle)
    assert not (tmp_path / "m.nii.gz").exists()


def test_a_label_map_on_another_grid_is_refused(capsys, tmp_path, small_ct, seg_sm_path):
    ct, _ = small_ct
    code, _, err = run_cli(capsys, "propagate", "--volume", ct, "--slice", 3, "--box", 20, 30, 100, 90,
                           "--mask-prompt", 5, 1, seg_sm_path, "--out", tmp_path / "m.nii.gz", "--random-weights", 0,
                           "--image-size", 64, "--no-progress")
    one_line(code, err, "--mask-prompt")
    assert not (tmp_path / "m.nii.gz").exists()
