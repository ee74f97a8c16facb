"""``medvol-train evaluate`` on the shared real CT: oracle anchor + random MedSAM2, the tiny grounder,
resume, shards, failure accounting and one-line errors (CPU, tiny preset, nothing downloads).

Two prepared sets: ``sm_data`` (the 30-slice CT, one test sample: the liver) and ``crop_data`` (ten
slices of the same CT cut with nibabel, two test samples: liver and spleen), so that the runs that
need several cases stay cheap.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from medvoltrain.cli import main

from training_data import write_jsonl
from ts_labels import LIVER, SPLEEN

ORACLE = ["--oracle", "--random-weights", "0", "--preset", "tiny", "--device", "cpu", "--no-progress"]
PAPER_HEAD = ["Method", "custom DSC", "custom IoU", "Average DSC", "Average IoU", "Hit rate (%)", "Box IoU (%)",
              "Cases", "Failed", "Errors"]
EXISTENCE_HEAD = ["Existence acc. (%)", "FP rate, negatives (%)", "FN rate, positives (%)"]
TABLE_HEAD = PAPER_HEAD + EXISTENCE_HEAD  # the paper's columns first, exactly as before, then the extra ones


def read_csv(path: Path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def run_cli(args, capsys):
    try:
        rc = main(["evaluate", *map(str, args)])
    except SystemExit as e:  # argparse's own errors (one line too, see cli._Parser)
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def count_propagations(monkeypatch):
    """Counts MedSAM2 propagations (the expensive call) while still running them."""
    from medvolcore.propagation import MedSAM2Propagator

    calls = []
    original = MedSAM2Propagator.propagate

    def counted(self, *a, **kw):
        calls.append(a[1] if len(a) > 1 else kw.get("key_slice"))
        return original(self, *a, **kw)

    monkeypatch.setattr(MedSAM2Propagator, "propagate", counted)
    return calls


@pytest.fixture(scope="module")
def crop_data(tmp_path_factory, ct_sm_path, seg_sm_path):
    import nibabel as nib

    root = tmp_path_factory.mktemp("crop_data")
    for src, name in ((ct_sm_path, "ct.nii.gz"), (seg_sm_path, "seg.nii.gz")):
        img = nib.load(str(src))
        nib.save(img.slicer[:, :, 16:26], str(root / name))  # ten axial slices with liver and spleen
    manifest = write_jsonl(root / "cases.jsonl", [
        {"id": "crop", "volume": "ct.nii.gz", "labels": "seg.nii.gz", "split": "test",
         "targets": {"liver": LIVER, "spleen": SPLEEN}},
        {"id": "crop_train", "volume": "ct.nii.gz", "labels": "seg.nii.gz", "split": "train",
         "targets": {"liver": LIVER}},
    ])
    from medvoltrain.prepare import PrepareSettings, prepare

    prepare(manifest, root / "DATA", PrepareSettings(seed=0, top_k=2), workers=1, progress=False)
    return root / "DATA"


@pytest.fixture(scope="module")
def oracle_sm(tmp_path_factory, sm_data):
    out = tmp_path_factory.mktemp("eval_sm") / "EVAL"
    assert main(["evaluate", "--data", str(sm_data), "--split", "test", "--out", str(out), *ORACLE]) == 0
    return out


@pytest.fixture(scope="module")
def oracle_crop(tmp_path_factory, crop_data):
    out = tmp_path_factory.mktemp("eval_crop") / "EVAL"
    assert main(["evaluate", "--data", str(crop_data), "--out", str(out), *ORACLE]) == 0
    return out


def test_oracle_on_real_ct_writes_table_1(oracle_sm, sm_data):
    from medvoltrain.prepare import load_mask, load_samples

    from medvolcore.metrics import dice, iou

    (sample,) = load_samples(sm_data, "test")
    gt = load_mask(sample)
    md = (oracle_sm / "table.md").read_text(encoding="utf-8")
    assert "numbers are meaningless" in md and "Oracle anchor" in md
    assert "| " + " | ".join(TABLE_HEAD) + " |" in md
    (row,) = read_csv(oracle_sm / "table.csv")
    assert list(row) == TABLE_HEAD
    (case,) = read_csv(oracle_sm / "cases.csv")
    assert case["id"] == "sm_b/liver" and case["status"] == "ok" and case["dataset_name"] == "custom"

    # the oracle's key slice is the largest-area slice of the whole stack (ties to the smaller z)
    areas = gt.reshape(gt.shape[0], -1).sum(axis=1)
    assert int(case["pred_slice"]) == int(case["gt_slice"]) == int(np.argmax(areas))
    assert (float(case["hit"]), float(case["axial_score"]), float(case["box_iou"])) == (1.0, 1.0, 1.0)
    assert row["Hit rate (%)"] == "100.00" and row["Box IoU (%)"] == "100.00" and row["Cases"] == "1/1"

    # DSC / IoU are those of the saved mask (canonical stack) against the prepared ground truth
    with np.load(next((oracle_sm / "masks").glob("*.npz"))) as z:
        pred = z["mask"]
    assert pred.shape == gt.shape and pred.any()
    assert float(case["dsc_pct"]) == pytest.approx(100 * dice(pred, gt), abs=1e-4)
    assert float(case["iou_pct"]) == pytest.approx(100 * iou(pred, gt), abs=1e-4)
    assert float(row["custom DSC"]) == pytest.approx(100 * dice(pred, gt), abs=0.006)
    assert float(row["Average IoU"]) == pytest.approx(100 * iou(pred, gt), abs=0.006)
    summary = json.loads((oracle_sm / "summary.json").read_text(encoding="utf-8"))
    assert summary["smoke"] and summary["cases_ok"] == 1 and summary["cases_pending"] == 0


def test_oracle_mask_is_the_repropagated_ground_truth_anchor(oracle_crop, crop_data):
    """An independent recomputation: Pipeline.repropagate of anchor_from_mask gives the saved mask."""
    from medvolcore.anchor import anchor_from_mask
    from medvolcore.metrics import dice
    from medvolcore.pipeline import Pipeline
    from medvolcore.propagation import MedSAM2Propagator
    from medvoltrain.evaluate import case_key
    from medvoltrain.prepare import load_stack
    from medvoltrain.prepare import load_mask, load_samples

    sample = load_samples(crop_data, "test")[1]
    assert sample["label"] == "spleen"
    stack, gt = load_stack(sample)[0], load_mask(sample)
    pipe = Pipeline("tiny", device="cpu", propagator=MedSAM2Propagator.from_random(0, image_size=64))
    seg = pipe.repropagate(stack, anchor_from_mask(gt, top_k=1, stack=stack))
    with np.load(oracle_crop / "masks" / f"{case_key(sample['id'])}.npz") as z:
        assert np.array_equal(z["mask"], seg.mask_stack.astype(bool))
    rows = {r["label"]: r for r in read_csv(oracle_crop / "cases.csv")}
    assert float(rows["spleen"]["dsc_pct"]) == pytest.approx(100 * dice(seg.mask_stack, gt), abs=1e-4)
    # two cases, one dataset: the table's mean is the mean of the two rows
    (row,) = read_csv(oracle_crop / "table.csv")
    assert float(row["custom DSC"]) == pytest.approx(np.mean([float(r["dsc_pct"]) for r in rows.values()]), abs=0.006)


def test_resume_skips_finished_cases(oracle_crop, tmp_path, capsys, count_propagations):
    out = tmp_path / "EVAL"
    shutil.copytree(oracle_crop, out)
    before = (out / "table.csv").read_text(encoding="utf-8")
    data = json.loads((out / "settings.json").read_text(encoding="utf-8"))["settings"]["data"]
    rc, stdout, _ = run_cli(["--data", data, "--out", out, *ORACLE], capsys)
    assert rc == 0 and count_propagations == [] and "2 already done" in stdout
    next((out / "cases").glob("crop_spleen-*.json")).unlink()
    rc, stdout, _ = run_cli(["--data", data, "--out", out, *ORACLE], capsys)
    assert rc == 0 and len(count_propagations) == 1 and "1 already done" in stdout
    assert (out / "table.csv").read_text(encoding="utf-8") == before


def test_shards_into_one_folder_give_the_single_run_table(oracle_crop, crop_data, tmp_path, capsys):
    out = tmp_path / "SHARDS"
    rc, stdout, _ = run_cli(["--data", crop_data, "--out", out, "--shard", "2/2", *ORACLE], capsys)
    assert rc == 0 and "partial: 1 of 2" in stdout
    assert "Partial" in (out / "table.md").read_text(encoding="utf-8")
    rc, _, _ = run_cli(["--data", crop_data, "--out", out, "--shard", "1/2", *ORACLE], capsys)
    assert rc == 0
    assert (out / "table.csv").read_text(encoding="utf-8") == (oracle_crop / "table.csv").read_text(encoding="utf-8")

    def no_time(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    assert no_time(read_csv(out / "cases.csv")) == no_time(read_csv(oracle_crop / "cases.csv"))
    (out / "table.csv").unlink()
    rc, _, _ = run_cli(["--out", out, "--aggregate-only"], capsys)
    assert rc == 0 and (out / "table.csv").read_text(encoding="utf-8") == (oracle_crop / "table.csv").read_text(encoding="utf-8")


def test_shard_1_of_n_is_the_first_shard_as_in_medvol_batch(crop_data, tmp_path, capsys):
    """``--shard I/N`` counts from 1, as ``medvol batch`` does: 1/2 is the split's positions 0, 2, …
    (here its first sample); it used to be the second shard (0-based I)."""
    from medvoltrain.prepare import load_samples

    first, second = [s["id"] for s in load_samples(crop_data, "test")]
    out = tmp_path / "FIRST"
    rc, stdout, _ = run_cli(["--data", crop_data, "--out", out, "--shard", "1/2", *ORACLE], capsys)
    assert rc == 0 and stdout.startswith("shard 1/2: 1 case(s) evaluated")
    assert [r["id"] for r in read_csv(out / "cases.csv")] == [first]
    rc, _, _ = run_cli(["--data", crop_data, "--out", out, "--shard", "2/2", *ORACLE], capsys)
    assert rc == 0 and [r["id"] for r in read_csv(out / "cases.csv")] == [first, second]


def test_grounder_mode_records_rows_and_counts_failures(crop_data, tmp_path, monkeypatch):
    """The tiny grounder (constrained, the product path) on case 1; case 2's model 'never parses'.

    The untrained tiny model may answer [] now that the grammar allows it, so after its real
    constrained generation (which must parse) its text is replaced by a box answer on slice 6."""
    from medvolcore.errors import GenerationError
    from medvolcore.grounder import QwenVLGrounder
    from medvolcore.pipeline import Pipeline
    from medvoltrain.evaluate import evaluate
    from medvoltrain.rewards import parsed as parse

    generate = QwenVLGrounder._generate_text
    canned = '<think>here</think><answer>[{"slice": 6, "bbox_2d_list": [[250, 300, 600, 700]]}]</answer>'

    def generate_then_replace(self, *a, **kw):
        text, timings = generate(self, *a, **kw)
        assert parse(text) is not None, text
        return canned, timings

    monkeypatch.setattr(QwenVLGrounder, "_generate_text", generate_then_replace)
    original = Pipeline.segment
    calls = []

    def segment(self, stack, query, **kw):
        assert kw["constrain"] is True  # the product path: constrained decoding by default
        calls.append(query)
        if len(calls) == 2:
            raise GenerationError("the model gave no usable answer in 3 attempt(s)")
        return original(self, stack, query, **kw)

    monkeypatch.setattr(Pipeline, "segment", segment)
    out = tmp_path / "G"
    s = evaluate(crop_data, out, preset="tiny", random_weights=0, device="cpu", progress=False)
    rows = read_csv(out / "cases.csv")
    assert [r["status"] for r in rows] == ["ok", "failed"] and len(calls) == 2
    ok, failed = rows
    assert 0 <= int(ok["pred_slice"]) < 10 and int(ok["n_boxes"]) >= 1 and ok["hit"] in ("0", "1")
    assert failed["error"].startswith("GenerationError") and failed["dsc_pct"] == ""
    # hit and box IoU are judged on the *predicted* slice, against the boxes the model wrote
    from medvoltrain.evaluate import case_key
    from medvoltrain.prepare import load_samples
    from medvoltrain.rewards import box_reward, parsed

    sample = load_samples(crop_data, "test")[0]
    k = int(ok["pred_slice"])
    assert int(ok["hit"]) == int(sample["slice_areas"][k] > 0)
    details = json.loads(next((out / "cases").glob(f"{case_key(sample['id'])}.json")).read_text(encoding="utf-8"))["details"]
    answer = parsed(details["raw_text"])
    assert answer is not None and answer.slice == k
    gt_boxes = sample["gt_boxes_norm"].get(str(k), [])
    assert float(ok["box_iou"]) == pytest.approx(box_reward(answer.boxes_norm, gt_boxes), abs=1e-4)
    # the failed case enters the mean as 0, and the table says so
    assert s["per_dataset"]["custom"]["dsc_pct"] == pytest.approx(float(ok["dsc_pct"]) / 2, abs=1e-3)
    assert s["cases_failed"] == 1 and s["hit_rate_pct"] == pytest.approx(50.0 * float(ok["hit"]))
    md = (out / "table.md").read_text(encoding="utf-8")
    assert "tiny → MedSAM2" in md and "numbers are meaningless" in md and "count as DSC = IoU = 0" in md
    (row,) = read_csv(out / "table.csv")
    assert row["Failed"] == "1" and row["Cases"] == "2/2"
    # a failed case is kept on a re-run; --retry-failed redoes it
    calls.clear()
    evaluate(crop_data, out, preset="tiny", random_weights=0, device="cpu", progress=False)
    assert calls == []
    monkeypatch.setattr(Pipeline, "segment", lambda self, *a, **kw: (_ for _ in ()).throw(GenerationError("x")))
    s = evaluate(crop_data, out, preset="tiny", random_weights=0, device="cpu", progress=False, retry_failed=True)
    assert s["run"]["evaluated"] == 1 and s["cases_failed"] == 1


def test_case_errors_are_excluded_and_retried(crop_data, tmp_path, monkeypatch):
    """A case that cannot be evaluated is recorded, left out of the means and redone by the next run."""
    from medvolcore.propagation import MedSAM2Propagator
    from medvoltrain import evaluate as ev

    class FakePropagator:
        calls = 0

        def propagate(self, stack_hu, key_slice, boxes, **kw):
            FakePropagator.calls += 1
            if FakePropagator.calls == 2:
                raise RuntimeError("CUDA out of memory (simulated)")
            return type("R", (), {"mask": self.gt, "slices_encoded": 0, "stop_summary": lambda r: {}})()

    fake = FakePropagator()
    fake.gt = ev.load_mask(ev.load_samples(crop_data, "test")[0])  # the liver: DSC 100 for case 1
    monkeypatch.setattr(MedSAM2Propagator, "from_random", classmethod(lambda cls, *a, **kw: fake))
    out = tmp_path / "E"
    s = ev.evaluate(crop_data, out, oracle=True, random_weights=0, preset="tiny", device="cpu", progress=False)
    assert [r["status"] for r in read_csv(out / "cases.csv")] == ["ok", "error"]
    assert s["cases_error"] == 1 and s["average"]["dsc_pct"] == pytest.approx(100.0)
    (row,) = read_csv(out / "table.csv")
    assert row["Errors"] == "1" and row["Average DSC"] == "100.00"
    s = ev.evaluate(crop_data, out, oracle=True, random_weights=0, preset="tiny", device="cpu", progress=False)
    assert s["run"]["evaluated"] == 1 and s["cases_error"] == 0 and FakePropagator.calls == 3


@pytest.mark.parametrize("args, words", [
    (["--split", "val"], "unknown split"),
    (["--split", "train", "--shard", "3/2"], "--shard must be I/N"),
    (["--shard", "x"], "--shard must be I/N"),
    (["--shard", "0/2"], "its old 0/2 is 1/2 now"),
    (["--limit", "0"], "--limit"),
    (["--sam-checkpoint", "m.pt"], "not allowed with argument"),
    (["--adapter", "."], "--adapter has no effect with --oracle"),
    (["--random-weights", "1"], "other settings"),
], ids=["split", "shard-range", "shard-form", "shard-0-based", "limit", "two-weights", "adapter-oracle",
        "other-settings"])
def test_bad_arguments_are_one_line_errors(args, words, oracle_sm, sm_data, capsys, count_propagations):
    base = ["--data", sm_data, "--out", oracle_sm, "--oracle", "--preset", "tiny", "--random-weights", "0",
            "--no-progress"]
    before = (oracle_sm / "settings.json").read_text(encoding="utf-8")
    rc, out, err = run_cli(base + args, capsys)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("medvol-train: error:") and words in err
    assert count_propagations == [] and (oracle_sm / "settings.json").read_text(encoding="utf-8") == before


def test_a_split_without_samples_is_refused(sm_data, tmp_path, capsys):
    data = tmp_path / "TRAIN_ONLY"
    data.mkdir()
    lines = (sm_data / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    (data / "samples.jsonl").write_text("\n".join(l for l in lines if json.loads(l)["split"] == "train") + "\n", encoding="utf-8")
    rc, _, err = run_cli(["--data", data, "--out", tmp_path / "E", *ORACLE], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "has no test samples (4 train, 0 test)" in err  # sm_data: 3 positives, 1 negative
    assert not (tmp_path / "E").exists()


def test_table_columns_follow_the_paper_and_average_datasets_equally(tmp_path):
    """Aggregation alone, on hand-made case rows: CT-ORG, AbdomenCT-1K, KiTS23 first, then the rest;
    Average = mean of the per-dataset means; failed = 0; errors left out; pending cases counted."""
    from medvoltrain.evaluate import EvalSettings, aggregate, case_key

    settings = EvalSettings(data=str(tmp_path), oracle=True, preset=None, sam="random:0:64")
    fp = settings.fingerprint()
    rows = [("k1", "0004", "ok", 80.0), ("k2", "0004", "failed", None), ("c1", "0012", "ok", 60.0),
            ("a1", "0003", "error", None), ("a2", "0003", "ok", 90.0), ("x1", None, "ok", 30.0)]
    for sid, code, status, dsc in rows:
        row = {"id": sid, "dataset": code, "status": status, "dsc_pct": dsc, "iou_pct": dsc and dsc / 2,
               "hit": 1, "box_iou": 0.5, "axial_score": 1.0, "seconds": 1.0}
        (tmp_path / "cases").mkdir(exist_ok=True)
        (tmp_path / "cases" / f"{case_key(sid)}.json").write_text(json.dumps({"fingerprint": fp, "row": row}), encoding="utf-8")
    samples = [{"id": r[0]} for r in rows] + [{"id": "pending"}]
    s = aggregate(samples, tmp_path, settings, fp)
    (table,) = read_csv(tmp_path / "table.csv")
    assert list(table)[1:9] == ["CT-ORG DSC", "CT-ORG IoU", "AbdomenCT-1K DSC", "AbdomenCT-1K IoU", "KiTS23 DSC",
                                "KiTS23 IoU", "custom DSC", "custom IoU"]
    assert [table[f"{n} DSC"] for n in ("CT-ORG", "AbdomenCT-1K", "KiTS23", "custom")] == [
        "60.00", "90.00", "40.00", "30.00"]  # KiTS23: (80 + 0) / 2; AbdomenCT-1K: the error is left out
    assert table["Average DSC"] == "55.00" and s["average"]["dsc_pct"] == pytest.approx((60 + 90 + 40 + 30) / 4)
    assert table["Hit rate (%)"] == "80.00" and table["Box IoU (%)"] == "40.00"  # 4 ok of 5 scored
    assert (table["Cases"], table["Failed"], table["Errors"]) == ("6/7", "1", "1")
    assert s["cases_pending"] == 1 and "Partial" in (tmp_path / "table.md").read_text(encoding="utf-8")
    assert "numbers are meaningless" in (tmp_path / "table.md").read_text(encoding="utf-8")


def test_a_ct_that_no_longer_matches_the_prepared_set_is_refused(sm_data, tmp_path):
    """The CT is read again from ``source``: a mirrored picture (another orientation) is caught."""
    from medvoltrain.errors import DataError
    from medvoltrain.prepare import load_stack
    from medvoltrain.prepare import load_samples

    (sample,) = load_samples(sm_data, "test")
    assert load_stack(sample)[0].shape == tuple(sample["stack_shape"])
    data = tmp_path / "DATA"
    shutil.copytree(sm_data, data)
    path = data / sample["slices_file"]
    with np.load(path) as z:
        images, shown = z["images"], z["shown"]
    np.savez_compressed(path, images=images[:, :, ::-1], shown=shown)
    (sample,) = load_samples(data, "test")
    with pytest.raises(DataError, match="no longer looks like the prepared picture"):
        load_stack(sample)


def test_stop_after_empty_is_a_setting(oracle_crop, crop_data, tmp_path, capsys):
    """The default is the product's early stop (in the settings, the label and each case); 0 is the
    paper's whole-volume protocol, whose fingerprint is the one evaluations had before the option."""
    from dataclasses import asdict

    from medvolcore.propagation import DEFAULT_STOP_AFTER_EMPTY
    from medvoltrain.evaluate import EvalSettings

    settings = json.loads((oracle_crop / "settings.json").read_text(encoding="utf-8"))
    assert settings["settings"]["stop_after_empty"] == DEFAULT_STOP_AFTER_EMPTY
    assert f"early stop K={DEFAULT_STOP_AFTER_EMPTY}" in settings["method"]
    case = json.loads(next((oracle_crop / "cases").glob("*.json")).read_text(encoding="utf-8"))
    assert case["details"]["propagation"]["stop_after_empty"] == DEFAULT_STOP_AFTER_EMPTY

    summary = json.loads((oracle_crop / "summary.json").read_text(encoding="utf-8"))
    assert summary["protocol"] == "product"
    assert "Protocol: not the paper's: early stop" in (oracle_crop / "table.md").read_text(encoding="utf-8")

    out = tmp_path / "EVAL0"  # --protocol paper: the paper's Table 1 = K 0 (the whole volume) on the test split
    rc, _, err = run_cli(["--data", crop_data, "--out", out, *ORACLE, "--protocol", "paper"], capsys)
    assert rc == 0, err
    s0 = json.loads((out / "settings.json").read_text(encoding="utf-8"))
    assert s0["settings"]["stop_after_empty"] == 0 and "early stop" not in s0["method"]
    assert json.loads((out / "summary.json").read_text(encoding="utf-8"))["protocol"] == "paper"
    assert "Protocol: the paper's (Table 1)" in (out / "table.md").read_text(encoding="utf-8")
    case = json.loads(next((out / "cases").glob("*.json")).read_text(encoding="utf-8"))
    assert case["details"]["propagation"]["stop_after_empty"] == 0
    for extra, word in ((["--stop-after-empty", 2], "--stop-after-empty 2"), (["--split", "train"], "test split")):
        rc, _, err = run_cli(["--data", crop_data, "--out", tmp_path / "bad", *ORACLE, "--protocol", "paper", *extra],
                             capsys)
        assert rc == 2 and word in err and len(err.strip().splitlines()) == 1
    old = {k: v for k, v in s0["settings"].items() if k != "stop_after_empty"}  # a settings.json from before
    assert EvalSettings(**old).fingerprint() == s0["fingerprint"]
    import hashlib

    assert s0["fingerprint"] == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert asdict(EvalSettings(**old))["stop_after_empty"] == 0
    rc, _, err = run_cli(["--data", crop_data, "--out", tmp_path / "bad", *ORACLE, "--stop-after-empty", -1], capsys)
    assert rc != 0 and "--stop-after-empty" in err and len(err.strip().splitlines()) == 1


# ---- "not present": negative cases and absent answers --------------------------------------------

def _write_rows(folder: Path, fp: str, rows):
    from medvoltrain.evaluate import case_key

    (folder / "cases").mkdir(parents=True, exist_ok=True)
    for row in rows:
        (folder / "cases" / f"{case_key(row['id'])}.json").write_text(json.dumps({"fingerprint": fp, "row": row}),
                                                                       encoding="utf-8")


def test_negative_cases_leave_the_paper_columns_as_they_were(tmp_path):
    """Aggregation on hand-made rows: adding negative cases changes only the extra columns; the paper's
    columns (names, order and values) are those of the positives alone."""
    from medvoltrain.evaluate import EvalSettings, aggregate

    settings = EvalSettings(data=str(tmp_path), oracle=True, preset=None, sam="random:0:64")
    fp = settings.fingerprint()

    def row(sid, code, status, dsc, answer_absent=0, target_absent=0):
        return {"id": sid, "dataset": code, "status": status, "dsc_pct": dsc, "iou_pct": dsc and dsc / 2, "hit": 1,
                "box_iou": 0.5, "axial_score": 1.0, "seconds": 1.0, "answer_absent": answer_absent,
                "target_absent": target_absent}

    positives = [row("k1", "0004", "ok", 80.0), row("k2", "0004", "failed", None), row("c1", "0012", "ok", 60.0),
                 row("c2", "0012", "ok", 0.0, answer_absent=1)]  # [] on a positive: DSC 0, a false negative
    positives[3].update(hit=0, box_iou=0.0, axial_score=0.0, iou_pct=0.0)
    negatives = [dict(row("n1", "0012", "ok", None, answer_absent=1, target_absent=1), hit=None, box_iou=None),
                 dict(row("n2", "0012", "ok", None, answer_absent=0, target_absent=1), hit=None, box_iou=None),
                 dict(row("n3", "0004", "ok", None, answer_absent=1, target_absent=1), hit=None, box_iou=None),
                 dict(row("n4", "0004", "failed", None, target_absent=1), hit=None, box_iou=None)]
    _write_rows(tmp_path / "P", fp, positives)
    _write_rows(tmp_path / "PN", fp, positives + negatives)
    only = aggregate([{"id": r["id"]} for r in positives], tmp_path / "P", settings, fp)
    both = aggregate([{"id": r["id"]} for r in positives + negatives], tmp_path / "PN", settings, fp)
    (t_only,), (t_both,) = read_csv(tmp_path / "P" / "table.csv"), read_csv(tmp_path / "PN" / "table.csv")
    paper = ["Method", "CT-ORG DSC", "CT-ORG IoU", "KiTS23 DSC", "KiTS23 IoU", "Average DSC", "Average IoU",
             "Hit rate (%)", "Box IoU (%)", "Cases", "Failed", "Errors"]
    assert list(t_both) == paper + EXISTENCE_HEAD and list(t_only) == paper + EXISTENCE_HEAD
    same = [k for k in paper if k not in ("Cases", "Failed")]
    assert [t_both[k] for k in same] == [t_only[k] for k in same]
    assert t_both["CT-ORG DSC"] == "30.00" and t_both["KiTS23 DSC"] == "40.00"  # (60 + 0) / 2, (80 + 0) / 2
    assert t_both["Hit rate (%)"] == "50.00"  # 2 hits of 4 positives: c2 ([]) and k2 (failed) miss
    assert (t_both["Cases"], t_both["Failed"]) == ("8/8", "2")
    # existence: right = k1, c1, n1, n3 → 4 of 8; FP = n2 → 1 of 4 negatives; FN = c2 → 1 of 4 positives
    assert [t_both[k] for k in EXISTENCE_HEAD] == ["50.00", "25.00", "25.00"]
    assert [t_only[k] for k in EXISTENCE_HEAD] == ["50.00", "—", "25.00"]
    ex = both["existence"]
    assert (ex["negatives"], ex["false_positives"], ex["false_negatives"], ex["true_negatives"]) == (4, 1, 1, 2)
    assert both["per_dataset"]["CT-ORG"]["cases"] == 2 and both["per_dataset"]["CT-ORG"]["negatives"] == 2
    assert "Extra columns (not in the paper)" in (tmp_path / "PN" / "table.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def crop_negative_data(tmp_path_factory, crop_data):
    """The ten-slice crop again, its test row saying the brain is not in this CT: liver, spleen and one
    negative sample (the brain)."""
    from medvoltrain.prepare import PrepareSettings, prepare

    root = crop_data.parent
    manifest = write_jsonl(tmp_path_factory.mktemp("crop_neg") / "cases.jsonl", [
        {"id": "crop", "volume": str(root / "ct.nii.gz"), "labels": str(root / "seg.nii.gz"), "split": "test",
         "targets": {"liver": LIVER, "spleen": SPLEEN}, "absent": ["brain"]}])
    out = manifest.parent / "DATA"
    summary = prepare(manifest, out, PrepareSettings(seed=0, top_k=2, negative_fraction=0.5), progress=False)
    assert summary["negatives_by_split"]["test"] == 1
    return out


def test_grounder_mode_scores_absent_answers_and_negative_cases(crop_negative_data, tmp_path, monkeypatch):
    """The product path with canned model texts: [] on the liver and the spleen (false negatives: DSC 0,
    no mask), a slice and a box on the brain (a false positive: propagated as the product would, but
    not scored for DSC)."""
    from medvolcore.grounder import QwenVLGrounder
    from medvoltrain.evaluate import evaluate

    box = '<think>there</think><answer>[{"slice": 5, "bbox_2d_list": [[300, 300, 600, 600]]}]</answer>'
    absent = "<think>not seen</think><answer>[]</answer>"
    texts = iter([absent, absent, box])
    monkeypatch.setattr(QwenVLGrounder, "_generate_text", lambda self, *a, **k: (next(texts), {"new_tokens": 9}))
    out = tmp_path / "G"
    s = evaluate(crop_negative_data, out, preset="tiny", random_weights=0, device="cpu", progress=False)
    rows = {r["label"]: r for r in read_csv(out / "cases.csv")}
    assert [rows[k]["status"] for k in ("liver", "spleen", "brain")] == ["ok"] * 3
    for organ in ("liver", "spleen"):
        r = rows[organ]
        assert (r["target_absent"], r["answer_absent"], r["dsc_pct"], r["iou_pct"], r["hit"], r["box_iou"],
                r["pred_slice"]) == ("0", "1", "0.0000", "0.0000", "0", "0.0000", ""), organ
    brain = rows["brain"]
    assert (brain["target_absent"], brain["answer_absent"], brain["dsc_pct"], brain["hit"], brain["pred_slice"]) == \
        ("1", "0", "", "", "5")
    assert int(brain["pred_voxels"]) > 0  # the user would have been given a mask where there is no target
    assert [p.name.split("-")[0] for p in (out / "masks").glob("*.npz")] == ["crop_brain"]  # none for []
    assert s["per_dataset"]["custom"]["cases"] == 2 and s["per_dataset"]["custom"]["dsc_pct"] == 0.0
    (row,) = read_csv(out / "table.csv")
    assert list(row) == TABLE_HEAD and row["Hit rate (%)"] == "0.00" and row["Cases"] == "3/3"
    assert [row[k] for k in EXISTENCE_HEAD] == ["0.00", "100.00", "100.00"]  # all three wrong: FP brain, FN both
