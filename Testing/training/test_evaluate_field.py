"""``medvol-train evaluate --protocol cvpr25|rexgrounding|medvol-r1`` and ``predict-cvpr25`` on the
shipped CT converted to the challenge layout, with the tiny preset (its numbers are meaningless:
these tests check files, conventions, resume and refusals, never a score's level)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from ts_labels import KIDNEY_LEFT

from medvoltrain import challenge, fieldmetrics
from medvoltrain.cli import main

TINY = ["--preset", "tiny", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory, real_dir):
    from medvoltrain.absent_suite import write_absent_suite

    return write_absent_suite(real_dir, tmp_path_factory.mktemp("cvpr") / "DATA")


@pytest.fixture(scope="module")
def one_case(suite, tmp_path_factory):
    """The left-kidney-removed case alone, run once (model loading included)."""
    import shutil

    d = tmp_path_factory.mktemp("one") / "DATA"
    for sub in ("imgs", "gts"):
        (d / sub).mkdir(parents=True)
        shutil.copy(suite / sub / "ts_left_kidney_removed.npz", d / sub)
    out = d.parent / "OUT"
    assert main(["evaluate", "--protocol", "cvpr25", "--data", str(d), "--out", str(out), *TINY]) == 0
    return d, out


@pytest.mark.slow
def test_cvpr25_writes_the_challenge_outputs_and_scores_them_as_the_script(one_case):
    d, out = one_case
    image = challenge.read_image(d / "imgs" / "ts_left_kidney_removed.npz")
    with np.load(out / "segs" / "ts_left_kidney_removed.npz") as z:
        assert list(z.keys()) == ["segs"]
        segs = z["segs"]
    assert segs.shape == image.imgs.shape and segs.dtype == np.uint8
    assert set(np.unique(segs).tolist()) <= {0, *image.prompts}
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert list(rows[0]) == ["CaseName", "RunningTime", "DSC", "NSD", "F1", "DSC_TP"]
    assert rows[0]["CaseName"] == "ts_left_kidney_removed.npz" and float(rows[0]["RunningTime"]) > 0
    gts = np.load(d / "gts" / "ts_left_kidney_removed.npz")["gts"]
    expect = fieldmetrics.cvpr25_case(gts, segs, image.spacing, image.prompts, False)
    for k in ("DSC", "NSD"):
        assert float(rows[0][k] or "nan") == pytest.approx(expect[k], nan_ok=True)
    assert rows[0]["F1"] == "" and rows[0]["DSC_TP"] == ""  # NaN, written as the official script's pandas does
    report = (out / "report.md").read_text()
    assert "numbers are meaningless" in report and report.index("## cvpr25") < report.index("## rexgrounding")
    summary = json.loads((out / "report.json").read_text())
    assert summary["absent_targets"]["prompts"] == 1  # the removed left kidney
    prompts = list(csv.DictReader(open(out / "prompts.csv")))
    kidney = [r for r in prompts if int(r["class_id"]) == KIDNEY_LEFT][0]
    assert kidney["absent_target"] == "1" and kidney["answered_absent"] in ("0", "1")


def test_a_finished_case_is_not_run_again_and_other_protocols_rescore_it(suite, tmp_path, capsys, monkeypatch):
    import os
    import shutil

    from medvoltrain import evaluate_field

    data, out = tmp_path / "DATA", tmp_path / "OUT"
    shutil.copytree(suite, data)
    _no_model(monkeypatch)
    assert main(["evaluate", "--protocol", "cvpr25", "--data", str(data), "--out", str(out), *TINY]) == 0
    capsys.readouterr()
    monkeypatch.setattr(evaluate_field.FieldEngine, "load", lambda self: pytest.fail("a model was loaded"))
    for protocol in ("cvpr25", "rexgrounding", "medvol-r1"):
        assert main(["evaluate", "--protocol", protocol, "--data", str(data), "--out", str(out), *TINY]) == 0
        text = capsys.readouterr().out
        assert "0 case(s) segmented" in text and "2 already done" in text and f"{protocol}:" in text
        report = (out / "report.md").read_text()
        assert report.splitlines()[0].startswith(f"# Evaluation ({protocol})")
        assert "## Absent targets" in report and "numbers are meaningless" in report
    # an input changed since: that case runs again
    os.utime(data / "imgs" / "ts_slab.npz", ns=(1, 1))
    _no_model(monkeypatch)
    assert main(["evaluate", "--protocol", "cvpr25", "--data", str(data), "--out", str(out), *TINY]) == 0
    assert "1 case(s) segmented" in capsys.readouterr().out


def test_shards_split_the_cases(suite, tmp_path, monkeypatch):
    """Shard 2/2 takes the second case (positions p with p % 2 == 1) and leaves the first pending."""
    from medvoltrain import evaluate_field

    seen = []
    _no_model(monkeypatch, seen)
    s = evaluate_field.evaluate_field(suite, tmp_path / "OUT", "medvol-r1", preset="tiny", device="cpu",
                                      shard="2/2", progress=False)
    assert seen == ["ts_slab.npz"] and s["cases_pending"] == 1 and s["cases_scored"] == 1
    # nothing predicted: every absent target refused, Dice 1.0 in MedVol-R1's convention, unscored in CVPR's
    a = s["absent_targets"]
    assert (a["prompts"], a["refusal_rate"], a["dice_empty_is_one"], a["scored_under_nan"]) == (2, 1.0, 1.0, 0)
    assert s["cvpr25"]["DSC"] == 0.0 and s["medvol-r1"]["dice_mean_of_prompts"] == pytest.approx(0.4)


def _no_model(monkeypatch, seen=None):
    from medvoltrain import evaluate_field

    monkeypatch.setattr(evaluate_field.FieldEngine, "load", lambda self: self)
    monkeypatch.setattr(evaluate_field.FieldEngine, "segment",
                        lambda self, image, progress=None: (seen.append(image.name) if seen is not None else None) or (
                            np.zeros(image.imgs.shape, np.uint8), {},
                            {c: np.zeros(image.imgs.shape, bool) for c in image.prompts}))


def test_missing_ground_truth_is_one_line(suite, tmp_path, capsys):
    import shutil

    d = tmp_path / "DATA"
    shutil.copytree(suite, d)
    (d / "gts" / "ts_slab.npz").unlink()
    rc = main(["evaluate", "--protocol", "cvpr25", "--data", str(d), "--out", str(tmp_path / "OUT"), *TINY])
    err = capsys.readouterr().err
    assert rc != 0 and "lacks the ground truth of 1 case(s), e.g. ts_slab.npz" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "OUT").exists()


def test_a_broken_case_is_recorded_and_the_run_goes_on(suite, tmp_path, capsys, monkeypatch):
    import shutil

    d = tmp_path / "DATA"
    shutil.copytree(suite, d)
    (d / "imgs" / "ts_slab.npz").write_bytes(b"not a zip")
    _no_model(monkeypatch)
    rc = main(["evaluate", "--protocol", "cvpr25", "--data", str(d), "--out", str(tmp_path / "OUT"), *TINY])
    err = capsys.readouterr().err
    assert rc == 0 and "ts_slab.npz could not be segmented" in err and "not a readable challenge npz" in err
    rows = {r["CaseName"]: r for r in csv.DictReader(open(tmp_path / "OUT" / "metrics.csv"))}
    assert rows["ts_slab.npz"]["DSC"] == "" and rows["ts_left_kidney_removed.npz"]["DSC"] == "0.0"  # NaN: empty


def test_out_inside_the_data_and_other_settings_are_refused(suite, tmp_path, capsys, monkeypatch):
    _no_model(monkeypatch)
    base = ["evaluate", "--protocol", "cvpr25", "--data", str(suite)]
    assert main(base + ["--out", str(suite / "imgs" / "x"), *TINY]) == 2
    assert "inside the input folder" in capsys.readouterr().err
    out = tmp_path / "OUT"
    assert main(base + ["--out", str(out), *TINY]) == 0
    capsys.readouterr()
    assert main(base + ["--out", str(out), "--control", "blank", *TINY]) != 0
    assert "other settings" in capsys.readouterr().err


@pytest.mark.slow
def test_predict_cvpr25_writes_segs_and_nothing_else(one_case, tmp_path, capsys):
    d, _ = one_case
    out = tmp_path / "outputs"
    args = ["predict-cvpr25", str(d / "imgs"), str(out), "--preset", "tiny", "--device", "cpu"]
    assert main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["ts_left_kidney_removed.npz"]
    with np.load(out / "ts_left_kidney_removed.npz") as z:
        assert list(z.keys()) == ["segs"] and z["segs"].shape == (30, 101, 122)
    capsys.readouterr()
    assert main(args) != 0 and "--overwrite" in capsys.readouterr().err  # no silent clobbering
    assert main(["predict-cvpr25", str(d / "imgs"), str(d / "imgs"), "--preset", "tiny", "--device", "cpu"]) == 2


def test_the_blank_control_shows_the_model_no_image(suite):
    """``--control blank``: every prompt is asked of a constant volume of the image's grid; without it,
    of the image itself. (The pipeline here records what it is given; the run's models are not needed
    to check what reaches them.)"""
    from medvoltrain.evaluate_field import FieldEngine, FieldSettings

    class Recorder:
        def segment_queries(self, volume, queries, **kw):
            self.volume, self.queries = volume, queries
            return []

    image = challenge.read_image(suite / "imgs" / "ts_slab.npz")
    for control in ("none", "blank"):
        engine = FieldEngine(FieldSettings(data="x", preset="tiny", control=control), "cpu")
        engine.pipeline = Recorder()
        segs, answers, masks = engine.segment(image)
        seen = engine.pipeline.volume.array
        assert seen.shape == image.imgs.shape and engine.pipeline.queries == [image.prompts[c] for c in
                                                                              sorted(image.prompts)]
        if control == "blank":
            assert np.unique(seen).size == 1
        else:
            assert np.array_equal(seen, image.imgs.astype(np.float32))
        assert not segs.any() and answers == {} and masks == {}
