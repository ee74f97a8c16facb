"""`medvol batch`: a manifest of real CTs run with the tiny preset on CPU.

Covers failures recorded while the run goes on (corrupt NIfTI, missing file), the exact summary
table with the targets' statistics and the aggregate rows, the HTML page, refusing to overwrite,
a SIGKILL midway followed by ``--resume``, shards that partition the manifest, manifest
validation (a ground truth's grid checked by geometry before any model loads), "not present"
cases and a consensus's agreement map.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.batch import (AGGREGATE_IDS, OUTPUTS, SUMMARY_COLUMNS, Case, aggregate, aggregate_csv_rows,
                              completed_record, parse_label, parse_shard, read_manifest, shard_cases, summary_names)
from medvolcore.cli_batch import main_batch
from medvolcore.errors import OutputError
from medvolcore.geometry import match_grids
from medvolcore.metrics import overlap

from ts_labels import LIVER
from core.test_geometry import AFFINE, _cli, _labels
from core.test_pipeline import GREEDY, _canned_samples, ct4, tiny  # noqa: F401  (fixtures)

QUERY = "the organ that secretes bile"
BASE = ["--preset", "tiny", "--device", "cpu", "--no-progress"]


def run_batch_cli(capsys, *argv):
    code = main_batch([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def read_summary(path: Path, aggregates: bool = False):
    """(header, the cases' rows) and, with ``aggregates``, the aggregate rows by kind ("mean",
    "median") as dicts; every summary ends with exactly those two rows."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    assert [r[0] for r in body[-2:]] == list(AGGREGATE_IDS) == ["summary.mean", "summary.median"]
    if not aggregates:
        return header, body[:-2]
    return header, body[:-2], {r[0].split(".")[1]: dict(zip(header, r)) for r in body[-2:]}


def write_manifest(path: Path, rows, fmt: str) -> Path:
    """rows: dicts with id, volume, query and optional gt, label (label as an int or a list)."""
    if fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["id", "volume", "query", "gt", "label"])
            for r in rows:
                lab = r.get("label")
                lab = ",".join(map(str, lab)) if isinstance(lab, list) else ("" if lab is None else str(lab))
                w.writerow([r["id"], r["volume"], r["query"], r.get("gt", ""), lab])
    else:
        with open(path, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n")
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, ct_sm_path, seg_sm_path):
    """The real CT and its labels copied beside the manifests (so relative paths are exercised),
    plus a file with a NIfTI name whose bytes are not NIfTI."""
    d = tmp_path_factory.mktemp("batch_data")
    shutil.copy(ct_sm_path, d / "ct.nii.gz")
    shutil.copy(seg_sm_path, d / "seg.nii.gz")
    (d / "corrupt.nii.gz").write_bytes(b"this is not a NIfTI file\x00\x01\x02" * 10)
    # a header that reads (so the check before the run passes) over voxels cut short: fails when the case runs
    (d / "truncated.nii.gz").write_bytes((d / "ct.nii.gz").read_bytes()[:4000])
    # 8 slices of the same CT (every voxel kept, affine shifted): cheaper cases for the multi-case runs
    ct, seg = nib.load(str(ct_sm_path)), nib.load(str(seg_sm_path))
    k0 = 11
    aff = ct.affine.copy()
    aff[:3, 3] = ct.affine[:3, :3] @ [0, 0, k0] + ct.affine[:3, 3]
    nib.save(nib.Nifti1Image(np.asarray(ct.dataobj)[:, :, k0:k0 + 8], aff, ct.header), str(d / "ct8.nii.gz"))
    nib.save(nib.Nifti1Image(np.asarray(seg.dataobj)[:, :, k0:k0 + 8], aff, seg.header), str(d / "seg8.nii.gz"))
    return d


def mixed_rows(label, ct="ct.nii.gz", seg="seg.nii.gz"):
    return [
        {"id": "good", "volume": ct, "query": QUERY, "gt": seg, "label": label},
        {"id": "corrupt", "volume": "truncated.nii.gz", "query": QUERY},
        {"id": "missing", "volume": "no_such_ct.nii.gz", "query": QUERY},
    ]


# ---- a run with a good case, a corrupt NIfTI and a missing file ----------------------------

@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_batch_records_failures_and_continues(capsys, tmp_path, data_dir, fmt):
    # CSV: the 30-slice CT itself; JSONL: its 8-slice crop (label as a list), to keep the suite quick
    rows = mixed_rows(LIVER) if fmt == "csv" else mixed_rows([LIVER], "ct8.nii.gz", "seg8.nii.gz")
    manifest = write_manifest(data_dir / f"mixed.{fmt}", rows, fmt)
    seg_file = data_dir / rows[0]["gt"]
    out = tmp_path / "out"
    # the missing file is found before the run: with --skip-invalid its row is recorded as invalid
    code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", out, *BASE, "--json",
                                      "--skip-invalid")
    assert code == 3, err
    assert "Traceback" not in err
    info = json.loads(stdout)
    assert (info["cases"], info["done"], info["failed"], info["invalid"], info["skipped"], info["ran"]) == (3, 1, 1, 1, 0, 2)
    assert info["smoke"] is True and [f["id"] for f in info["failures"]] == ["corrupt"]
    assert [f["id"] for f in info["invalid_cases"]] == ["missing"] and not (out / "missing").exists()

    # the good case: all three outputs, then done.json; metrics checked against the files themselves
    good = out / "good"
    assert sorted(p.name for p in good.iterdir()) == sorted(OUTPUTS + ("done.json",))
    done = json.loads((good / "done.json").read_text())
    assert done["status"] == "done" and done["id"] == "good" and done["case"]["label"] == LIVER  # [5] → 5
    mask = np.asarray(nib.load(str(good / "mask.nii.gz")).dataobj)
    gt = np.asarray(nib.load(str(seg_file)).dataobj) == LIVER
    m = overlap(mask, gt)
    assert done["metrics"]["dice"] == pytest.approx(m["dice"], abs=1e-6)
    assert done["metrics"]["iou"] == pytest.approx(m["iou"], abs=1e-6)
    anchor = json.loads((good / "anchor.json").read_text())
    assert anchor["schema"] == "medvol.anchor/1" and anchor["query"] == QUERY
    assert (good / "qc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the failures: error.json only, with a useful message
    errors = {}
    for cid, needle in (("corrupt", "truncated.nii.gz"),):
        assert [p.name for p in (out / cid).iterdir()] == ["error.json"]
        e = json.loads((out / cid / "error.json").read_text())
        assert e["status"] == "failed" and e["error"]["code"] == "bad_volume" and needle in e["error"]["message"]
        errors[cid] = e

    # the statistics in done.json, checked against the mask and the CT themselves
    st = done["stats"]
    ct_img = nib.load(str(data_dir / rows[0]["volume"]))
    hu, inside = ct_img.get_fdata(), mask > 0
    assert mask.any() and st["voxels"] == int(inside.sum())
    assert st["volume_ml"] == pytest.approx(inside.sum() * abs(np.linalg.det(ct_img.affine[:3, :3])) / 1000, abs=1e-3)
    assert (st["mean_hu"], st["min_hu"], st["max_hu"]) == pytest.approx(
        (hu[inside].mean(), hu[inside].min(), hu[inside].max()), abs=0.01)

    # summary.csv: exact header and rows, the statistics after the other columns, then the aggregates
    header, rows, agg = read_summary(out / "summary.csv", aggregates=True)
    assert tuple(header) == SUMMARY_COLUMNS == (
        "id", "status", "error", "slice", "boxes", "seconds", "dice", "iou", "confidence",
        "voxels", "volume_ml", "mean_hu", "std_hu", "min_hu", "max_hu", "key_slice_s_mm", "bbox_ras_min",
        "bbox_ras_max")
    expected = [["good", "done", "", str(anchor["slice"]), str(len(anchor["boxes"])), f"{done['seconds']:.2f}",
                 f"{m['dice']:.4f}", f"{m['iou']:.4f}", "",  # no --consensus: no confidence
                 str(st["voxels"]), str(st["volume_ml"]), str(st["mean_hu"]), str(st["std_hu"]), str(st["min_hu"]),
                 str(st["max_hu"]), str(st["key_slice_s_mm"]), " ".join(map(str, st["bbox_ras_min"])),
                 " ".join(map(str, st["bbox_ras_max"]))]]
    e = errors["corrupt"]
    expected.append(["corrupt", "failed", f"{e['error']['code']}: {e['error']['message']}", "", "", f"{e['seconds']:.2f}",
                     "", "", ""] + [""] * 9)
    missing = str(data_dir / "no_such_ct.nii.gz")
    expected.append(["missing", "invalid", f"{missing} does not exist", "", "", "", "", "", ""] + [""] * 9)
    assert rows == expected
    # one finished case: mean = median = its values; the failed case's seconds are not counted
    for kind in ("mean", "median"):
        assert agg[kind] == dict(zip(header, [f"summary.{kind}", f"{kind} of 1 finished", "", "", "",
                                              f"{done['seconds']:.2f}", f"{m['dice']:.4f}", f"{m['iou']:.4f}", "",
                                              f"{st['voxels']:.1f}", f"{st['volume_ml']:.3f}"] + [""] * 7))

    # summary.html: every id, a QC picture for the done case only, the errors, the smoke banner
    page = (out / "summary.html").read_text(encoding="utf-8")
    for cid in ("good", "corrupt", "missing"):
        assert cid in page
    assert '<img src="good/qc.png"' in page
    assert page.count("<img") == 1
    assert "does not exist" in page and QUERY in page and "smoke model" in page

    # a second run without --resume/--overwrite refuses to start and changes nothing
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", out, *BASE, "--skip-invalid")
    assert code == 2 and "--resume" in err and "--overwrite" in err and "Traceback" not in err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before

    if fmt == "jsonl":
        return
    # --resume keeps the finished case and retries only the failed ones
    code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", out, *BASE, "--resume", "--json",
                                      "--skip-invalid")
    assert code == 3, err
    info = json.loads(stdout)
    assert (info["skipped"], info["ran"], info["done"], info["failed"], info["invalid"]) == (1, 1, 1, 1, 1)
    assert (good / "done.json").stat().st_mtime_ns == before[good / "done.json"]
    assert read_summary(out / "summary.csv")[1][0] == expected[0]  # the skipped case and its stats, from done.json


# ---- killed midway, then resumed -----------------------------------------------------------

@pytest.mark.slow  # a batch run killed with SIGKILL, then resumed
def test_kill_midway_then_resume(capsys, tmp_path, data_dir):
    ids = [f"case{i}" for i in range(4)]
    manifest = write_manifest(data_dir / "four.csv",
                              [{"id": i, "volume": "ct8.nii.gz", "query": QUERY, "gt": "seg8.nii.gz", "label": LIVER}
                               for i in ids], "csv")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "medvolcore.cli_batch", "--manifest", str(manifest), "--out-dir", str(out), *BASE]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first_done = out / ids[0] / "done.json"
    try:
        deadline = time.monotonic() + 180
        while not first_done.exists():
            if proc.poll() is not None:
                pytest.fail(f"batch ended before being killed: {proc.returncode} {proc.stderr.read().decode()}")
            if time.monotonic() > deadline:
                pytest.fail("the first case never finished")
            time.sleep(0.02)
        time.sleep(0.2)  # let the second case get under way
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "summary.csv").exists()

    # nothing counts as done without all of its outputs
    cases = {c.id: c for c in read_manifest(manifest)}
    finished = []
    for cid in ids:
        cdir = out / cid
        if (cdir / "done.json").exists():
            assert all((cdir / n).is_file() for n in OUTPUTS), cid
            assert completed_record(cdir, cases[cid]) is not None
            finished.append(cid)
    assert finished and finished == ids[:len(finished)] and len(finished) < len(ids)
    mtimes = {cid: (out / cid / "done.json").stat().st_mtime_ns for cid in finished}

    code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", out, *BASE, "--resume", "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["skipped"] == len(finished) and info["ran"] == len(ids) - len(finished)
    assert info["done"] == len(ids) and info["failed"] == 0
    for cid in finished:  # not redone
        assert (out / cid / "done.json").stat().st_mtime_ns == mtimes[cid]
    for cid in ids:
        cdir = out / cid
        assert completed_record(cdir, cases[cid]) is not None
        assert not list(cdir.glob(".*part*")), "temporary files left behind"
    header, rows = read_summary(out / "summary.csv")
    assert [r[0] for r in rows] == ids and all(r[1] == "done" and r[6] and r[7] for r in rows)


# ---- shards --------------------------------------------------------------------------------

def test_shard_partition_is_exact():
    for n_cases in (0, 1, 2, 3, 7, 10, 31):
        cases = [Case(id=f"c{i}", volume=Path("v"), query="q", index=i) for i in range(n_cases)]
        for n in (1, 2, 3, 4, 5):
            parts = [shard_cases(cases, (i, n)) for i in range(1, n + 1)]
            ids = [c.id for p in parts for c in p]
            assert sorted(ids) == sorted(c.id for c in cases) and len(ids) == len(set(ids))
            for i, p in enumerate(parts, start=1):
                assert all(c.index % n == i - 1 for c in p)
                assert p == shard_cases(cases, (i, n))  # deterministic
    assert parse_shard("2/4") == (2, 4) and parse_shard(" 1 / 1 ") == (1, 1) and parse_shard(None) is None
    for bad in ("0/3", "4/3", "1/0", "a/b", "3", "-1/3", "1/3/4", ""):
        with pytest.raises(Exception) as ei:
            parse_shard(bad)
        assert "--shard" in str(ei.value)
    assert summary_names(None) == ("summary.csv", "summary.html")
    assert summary_names((1, 1)) == ("summary.csv", "summary.html")
    assert summary_names((2, 3)) == ("summary.shard-2-of-3.csv", "summary.shard-2-of-3.html")


def test_the_shard_rule_is_written_once():
    """``medvol batch`` and ``medvol-train evaluate`` parse ``--shard`` with one function
    (medvolcore.caseruns.parse_shard): its error message is in exactly one source file, and 0/N (the
    old 0-based evaluate) is refused with the 1-based rule."""
    repo = Path(__file__).resolve().parents[2]
    found = [p for folder in ("MedVolCore", "Training") for p in (repo / folder).rglob("*.py")
             if "--shard must be I/N" in p.read_text(encoding="utf-8")]
    assert [p.relative_to(repo).as_posix() for p in found] == ["MedVolCore/medvolcore/caseruns.py"]
    with pytest.raises(Exception, match=r"1 ≤ I ≤ N .*its old 0/3 is 1/3 now"):
        parse_shard("0/3")


def test_sharded_run_partitions_the_manifest(capsys, tmp_path, data_dir):
    # one real case (position 0 → shard 1) and five missing files, found before the run (invalid, not run)
    rows = [{"id": "real", "volume": "ct8.nii.gz", "query": QUERY}] + \
           [{"id": f"m{i}", "volume": f"absent{i}.nii.gz", "query": QUERY} for i in range(1, 6)]
    manifest = write_manifest(data_dir / "shards.jsonl", rows, "jsonl")
    out = tmp_path / "out"
    seen = []
    for i in (1, 2, 3):
        code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", out, *BASE,
                                          "--shard", f"{i}/3", "--json", "--skip-invalid")
        assert code == 3, err
        info = json.loads(stdout)
        assert info["shard"] == f"{i}/3" and info["manifest_cases"] == 6
        header, srows = read_summary(out / f"summary.shard-{i}-of-3.csv")
        got = [r[0] for r in srows]
        assert got == [r["id"] for p, r in enumerate(rows) if p % 3 == i - 1]
        assert (out / f"summary.shard-{i}-of-3.html").exists()
        seen += got
    assert sorted(seen) == sorted(r["id"] for r in rows) and len(seen) == len(set(seen))
    assert not (out / "summary.csv").exists()
    assert (out / "real" / "done.json").exists()


# ---- manifest reading and validation -------------------------------------------------------

def test_manifest_csv_and_jsonl_read_alike(tmp_path):
    (tmp_path / "sub").mkdir()
    rows = [{"id": "a", "volume": "ct.nii.gz", "query": " liver ", "gt": "seg.nii.gz", "label": [2, 3]},
            {"id": "b-2.x_y", "volume": "/abs/ct.nii.gz", "query": "spleen", "gt": "seg.nii.gz"},
            {"id": "c", "volume": "sub/ct.nii.gz", "query": "kidney", "gt": "seg.nii.gz", "label": 5}]
    for fmt in ("csv", "jsonl"):
        cases = read_manifest(write_manifest(tmp_path / f"m.{fmt}", rows, fmt))
        assert [c.id for c in cases] == ["a", "b-2.x_y", "c"] and [c.index for c in cases] == [0, 1, 2]
        assert cases[0].volume == tmp_path / "ct.nii.gz" and cases[0].gt == tmp_path / "seg.nii.gz"
        assert cases[1].volume == Path("/abs/ct.nii.gz") and cases[2].volume == tmp_path / "sub" / "ct.nii.gz"
        assert cases[0].query == "liver" and cases[0].label == [2, 3] and cases[1].label is None and cases[2].label == 5
    assert parse_label("2; 3") == [2, 3] and parse_label("") is None and parse_label(7) == 7


BAD_MANIFESTS = [
    ("csv", "id,volume\na,ct.nii.gz\n", "missing column(s) query"),
    ("csv", "id,volume,query\na,ct.nii.gz,liver\na,ct.nii.gz,spleen\n", "duplicate id 'a'"),
    ("csv", "id,volume,query\nA,ct.nii.gz,liver\na,ct.nii.gz,spleen\n", "letter case"),
    ("csv", "id,volume,query\n../evil,ct.nii.gz,liver\n", "not safe as a folder name"),
    ("csv", "id,volume,query\na/b,ct.nii.gz,liver\n", "not safe as a folder name"),
    ("csv", "id,volume,query\n.hidden,ct.nii.gz,liver\n", "not safe as a folder name"),
    ("csv", "id,volume,query\nsummary.csv,ct.nii.gz,liver\n", "summary"),
    ("csv", "id,volume,query\na,ct.nii.gz,\n", "missing query"),
    ("csv", "id,volume,query,gt,label\na,ct.nii.gz,liver,,5\n", "without 'gt'"),
    ("csv", "id,volume,query,gt,label\na,ct.nii.gz,liver,seg.nii.gz,liver\n", "not an integer label id"),
    ("csv", "id,volume,query,gt,label\na,ct.nii.gz,liver,seg.nii.gz,0\n", "must be positive"),
    ("csv", "id,volume,query\n", "lists no cases"),
    ("csv", "", "empty manifest"),
    ("jsonl", '{"id": "a", "volume": "ct.nii.gz", "query": "liver"}\n{not json}\n', "line 2: not valid JSON"),
    ("jsonl", '["a", "ct.nii.gz", "liver"]\n', "expected a JSON object"),
    ("jsonl", '{"id": "a", "volume": 3, "query": "liver"}\n', "must be text"),
    ("jsonl", '{"id": "a", "volume": "ct.nii.gz", "query": "x", "gt": "s.nii.gz", "label": [2, "x"]}\n', "label"),
    ("txt", "id,volume,query\na,ct.nii.gz,liver\n", "use .csv"),
]


@pytest.mark.parametrize("fmt,text,needle", BAD_MANIFESTS, ids=[f"{i}-{m[2][:20]}" for i, m in enumerate(BAD_MANIFESTS)])
def test_bad_manifest_is_one_clear_error(capsys, tmp_path, fmt, text, needle):
    manifest = tmp_path / f"cases.{fmt}"
    manifest.write_text(text, encoding="utf-8")
    _tiny_ct(tmp_path / "ct.nii.gz")  # the rows' files exist: the one problem is the manifest's
    out = tmp_path / "out"
    code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", out, *BASE)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("medvol batch: error:") and needle in lines[0], lines[0]
    assert not out.exists()


def test_all_manifest_problems_reported_at_once(capsys, tmp_path):
    manifest = tmp_path / "cases.csv"
    manifest.write_text("id,volume,query\na,ct.nii.gz,liver\na,ct.nii.gz,liver\nb c,ct.nii.gz,liver\n")
    _tiny_ct(tmp_path / "ct.nii.gz")
    code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", tmp_path / "out", *BASE)
    assert code == 2 and "2 problem(s)" in err and "line 3" in err and "line 4" in err


@pytest.mark.parametrize("spec", ["0/3", "4/3", "x", "1/0"])
def test_bad_shard_spec(capsys, tmp_path, spec):
    manifest = tmp_path / "cases.csv"
    manifest.write_text("id,volume,query\na,ct.nii.gz,liver\n")
    code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", tmp_path / "out", *BASE, "--shard", spec)
    assert code == 2 and "--shard" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_missing_manifest_and_resume_with_overwrite(capsys, tmp_path):
    code, stdout, err = run_batch_cli(capsys, "--manifest", tmp_path / "nope.csv", "--out-dir", tmp_path / "out", *BASE)
    assert code == 2 and "does not exist" in err
    with pytest.raises(SystemExit) as ei:
        main_batch(["--manifest", str(tmp_path / "nope.csv"), "--out-dir", str(tmp_path / "out"), "--resume", "--overwrite"])
    assert ei.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


# ---- second review: planning cost, --resume after a replaced CT, symlinked case folders -----------

class _StopAtLoad:
    """A pipeline stand-in: run_batch plans with it, and loading models (the first step after the
    plan, taken only when some case must run) raises :class:`_Loading`."""

    preset, smoke = "tiny", True

    def load(self):
        raise _Loading()


class _Loading(Exception):
    pass


def _tiny_ct(path: Path, depth: int = 4, value: int = 0) -> Path:
    nib.save(nib.Nifti1Image(np.full((6, 5, depth), value, dtype=np.int16), np.eye(4)), str(path))
    return path


@pytest.mark.probe("II.6", "planning a manifest: os.path.realpath calls for 50 and 200 rows")
def test_planning_is_linear_in_the_manifest(tmp_path, monkeypatch, record_property):
    """Before, every (case folder × input) pair was resolved: 200 rows cost 16× the calls of 50
    (10,000 rows never started). Planning reads headers only, each distinct file once."""
    from medvolcore.batch import BatchOptions, run_batch

    real = os.path.realpath
    calls = [0]

    def counting(p, *a, **k):
        calls[0] += 1
        return real(p, *a, **k)

    counts = {}
    for n in (50, 200):
        manifest = write_manifest(tmp_path / f"m{n}.csv", [{"id": f"c{i}", "volume": f"ct{i}.nii.gz", "query": QUERY,
                                                             "gt": f"seg{i}.nii.gz", "label": 5} for i in range(n)], "csv")
        for i in range(n):
            _tiny_ct(tmp_path / f"ct{i}.nii.gz", value=0)
            _tiny_ct(tmp_path / f"seg{i}.nii.gz", value=5)
        calls[0] = 0
        monkeypatch.setattr(os.path, "realpath", counting)
        t = time.perf_counter()
        with pytest.raises(_Loading):
            run_batch(manifest, tmp_path / f"out{n}", BatchOptions(progress=False), pipeline=_StopAtLoad())
        seconds = time.perf_counter() - t
        monkeypatch.setattr(os.path, "realpath", real)
        counts[n] = calls[0]
        record_property(f"realpath_calls_{n}_rows", calls[0])
        record_property(f"planning_s_{n}_rows", round(seconds, 3))
    assert counts[200] <= 4 * counts[50] + 10, counts  # linear (quadratic would be 16×)


def _complete_case(out: Path, case, preset="tiny") -> Path:
    """A finished case folder as a run leaves it (outputs, then done.json with the case's fingerprint)."""
    cdir = out / case.id
    cdir.mkdir(parents=True)
    for name in OUTPUTS:
        (cdir / name).write_bytes(b"x")
    (cdir / "done.json").write_text(json.dumps({
        "schema": "medvol.batch-case/1", "id": case.id, "status": "done", "seconds": 1.0,
        "case": case.fingerprint(preset, None), "metrics": None, "anchor": {"slice": 1, "n_boxes": 1},
        "reasoning": "", "smoke": True}))
    return cdir


@pytest.mark.probe("II.7", "--resume after the CT (or the gt) was replaced at the same path")
@pytest.mark.parametrize("replaced", ["volume", "gt"])
def test_resume_reruns_a_case_whose_input_was_replaced(tmp_path, replaced):
    from medvolcore.batch import BatchOptions, run_batch

    ct, seg = _tiny_ct(tmp_path / "ct.nii.gz"), _tiny_ct(tmp_path / "seg.nii.gz", value=1)  # gt: a label
    manifest = write_manifest(tmp_path / "m.csv", [{"id": "a", "volume": "ct.nii.gz", "query": QUERY,
                                                     "gt": "seg.nii.gz"}], "csv")
    out = tmp_path / "out"
    _complete_case(out, read_manifest(manifest)[0])
    opts = BatchOptions(resume=True, progress=False)
    res = run_batch(manifest, out, opts, pipeline=_StopAtLoad())  # unchanged: skipped, nothing loads
    assert (res.info["skipped"], res.info["ran"]) == (1, 0)
    _tiny_ct(ct if replaced == "volume" else seg, value=7)  # another scan under the same name (same grid)
    with pytest.raises(_Loading):  # the case runs again: models load
        run_batch(manifest, out, opts, pipeline=_StopAtLoad())


def test_input_state_follows_files_and_dicom_folders(tmp_path):
    from medvolcore.batch import input_state

    f = _tiny_ct(tmp_path / "ct.nii.gz")
    before = input_state(f)
    os.utime(f, ns=(1, 1))  # same bytes, another time: counts as replaced
    assert input_state(f) != before and input_state(tmp_path / "absent.nii.gz") is None
    d = tmp_path / "series"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.dcm").write_bytes(b"x" * (10 + i))
    state = input_state(d)
    assert state["files"] == 3 and input_state(d) == state
    (d / "1.dcm").write_bytes(b"y" * 11)
    os.utime(d / "1.dcm", ns=(5, 5))
    assert input_state(d) != state
    raw = tmp_path / "ct.raw"
    raw.write_bytes(b"\0" * 8)
    mhd = tmp_path / "ct.mhd"
    mhd.write_text("ObjectType = Image\nNDims = 3\nElementDataFile = ct.raw\n")
    state = input_state(mhd)
    raw.write_bytes(b"\1" * 9)  # a detached header's data file replaced
    assert state["data"] is not None and input_state(mhd) != state


@pytest.mark.probe("II.10", "case folder that is a symlink to another folder, with --overwrite")
def test_a_case_folder_that_is_a_symlink_is_refused(capsys, tmp_path):
    from medvolcore.batch import _clear_case

    _tiny_ct(tmp_path / "ct.nii.gz")
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("mask.nii.gz", "done.json", "anchor.json", "keep.txt"):
        (victim / name).write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").symlink_to(victim, target_is_directory=True)
    manifest = write_manifest(tmp_path / "m.csv", [{"id": "a", "volume": "ct.nii.gz", "query": QUERY}], "csv")
    code, _, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", out, *BASE, "--overwrite")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "symbolic link" in err, err
    with pytest.raises(OutputError, match="symbolic link"):  # swapped for a link after the plan: refused too
        _clear_case(out / "a")
    assert sorted(p.name for p in victim.iterdir()) == ["anchor.json", "done.json", "keep.txt", "mask.nii.gz"]
    assert all(p.read_text() == "precious" for p in victim.iterdir())


@pytest.mark.probe("II.10", "manifest naming a key (JSONL) or a column (CSV) twice")
@pytest.mark.parametrize("fmt,text,needle", [
    ("jsonl", '{"id": "a", "volume": "ct.nii.gz", "query": "liver", "volume": "other.nii.gz"}\n',
     "line 1: the key 'volume' appears more than once"),
    ("csv", "id,volume,query,volume\na,ct.nii.gz,liver,other.nii.gz\n", "the column 'volume' appears more than once"),
], ids=["jsonl", "csv"])
def test_manifest_with_a_repeated_key_is_refused(capsys, tmp_path, fmt, text, needle):
    manifest = tmp_path / f"cases.{fmt}"
    manifest.write_text(text, encoding="utf-8")
    code, _, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", tmp_path / "out", *BASE)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


# ---- cases the model answers "not present" --------------------------------------------------------

def test_absent_cases_finish_as_absent_count_apart_and_resume(capsys, tmp_path, data_dir, monkeypatch):
    from medvolcore.grounder import QwenVLGrounder

    monkeypatch.setattr(QwenVLGrounder, "_generate_text",
                        lambda self, *a, **k: ("<think>not in this CT</think><answer>[]</answer>", {"new_tokens": 9}))
    rows = [{"id": "cyst", "volume": "ct8.nii.gz", "query": "the kidney cyst", "gt": "seg8.nii.gz", "label": LIVER},
            {"id": "brain", "volume": "ct8.nii.gz", "query": "the brain"}]
    manifest = write_manifest(tmp_path / "absent.jsonl", [dict(r, volume=str(data_dir / r["volume"]),
                                                               **({"gt": str(data_dir / r["gt"])} if "gt" in r else {}))
                                                          for r in rows], "jsonl")
    out = tmp_path / "out"
    code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", out, *BASE, "--json")
    assert code == 0, err  # "not present" is an answer, not a failure
    info = json.loads(stdout)
    assert (info["done"], info["absent"], info["failed"]) == (0, 2, 0)
    for cid in ("cyst", "brain"):
        assert sorted(p.name for p in (out / cid).iterdir()) == ["anchor.json", "done.json", "qc.png"]  # no mask
        done = json.loads((out / cid / "done.json").read_text())
        assert done["status"] == "absent" and done["outputs"] == ["anchor.json", "qc.png"]
        assert json.loads((out / cid / "anchor.json").read_text())["absent"] is True
    cyst = json.loads((out / "cyst" / "done.json").read_text())
    assert cyst["metrics"]["dice"] == 0.0 and cyst["metrics"]["gt_voxels"] > 0  # a miss, scored as an empty mask
    header, table = read_summary(out / "summary.csv")
    assert [r[:5] for r in table] == [["cyst", "absent", "", "", "0"], ["brain", "absent", "", "", "0"]]
    # no mask: 0 voxels, 0 mL, no HU, no position
    assert [r[len(SUMMARY_COLUMNS) - 9:] for r in table] == [["0", "0.0"] + [""] * 7] * 2
    page = (out / "summary.html").read_text(encoding="utf-8")
    assert "2 not found" in page and page.count("not found in this CT") == 2 and page.count("<img") == 2
    code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", out, *BASE, "--resume", "--json")
    info = json.loads(stdout)
    assert code == 0 and (info["skipped"], info["ran"], info["absent"]) == (2, 0, 2)  # complete without a mask


# ---- statistics and aggregates -------------------------------------------------------------------

def _answer(z, box):
    return f'<think>here</think><answer>[{{"slice": {z}, "bbox_2d_list": [{json.dumps(box)}]}}]</answer>'


def test_summary_statistics_and_aggregates(capsys, tmp_path, data_dir, monkeypatch):
    """Two found targets and a miss scored against ground truth (three different Dice), a miss
    without ground truth, a failed and an invalid case: the aggregate rows are the mean and median
    of the finished cases only, the page shows them before the cases, and --resume reads the
    statistics back from done.json (an older done.json without them leaves empty cells)."""
    from medvolcore.grounder import QwenVLGrounder

    absent = "<think>not in this CT</think><answer>[]</answer>"
    texts = iter([_answer(3, [200, 200, 700, 700]), _answer(4, [100, 300, 500, 800]), absent, absent])
    monkeypatch.setattr(QwenVLGrounder, "_generate_text", lambda self, *a, **k: (next(texts), {"new_tokens": 9}))
    ct, seg = str(data_dir / "ct8.nii.gz"), str(data_dir / "seg8.nii.gz")
    manifest = write_manifest(tmp_path / "m.jsonl", [
        {"id": "liver", "volume": ct, "query": "the liver", "gt": seg, "label": LIVER},
        {"id": "spleen", "volume": ct, "query": "the spleen", "gt": seg, "label": 1},
        {"id": "cyst", "volume": ct, "query": "the kidney cyst", "gt": seg, "label": LIVER},
        {"id": "brain", "volume": ct, "query": "the brain"},
        {"id": "corrupt", "volume": str(data_dir / "truncated.nii.gz"), "query": QUERY,
         "gt": str(data_dir / "seg.nii.gz"), "label": LIVER},
        {"id": "missing", "volume": str(tmp_path / "no_such.nii.gz"), "query": QUERY}], "jsonl")
    out = tmp_path / "out"
    code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", out, *BASE, "--json",
                                      "--skip-invalid")
    assert code == 3, err
    info = json.loads(stdout)
    finished = ["liver", "spleen", "cyst", "brain"]
    done = {cid: json.loads((out / cid / "done.json").read_text()) for cid in finished}
    assert [done[c]["status"] for c in finished] == ["done", "done", "absent", "absent"]
    failed_seconds = json.loads((out / "corrupt" / "error.json").read_text())["seconds"]

    # computed here from done.json: Dice/IoU over the finished cases with gt, the rest over all finished
    values = {"dice": [done[c]["metrics"]["dice"] for c in finished[:3]],
              "iou": [done[c]["metrics"]["iou"] for c in finished[:3]],
              "seconds": [done[c]["seconds"] for c in finished],
              "voxels": [done[c]["stats"]["voxels"] for c in finished],
              "volume_ml": [done[c]["stats"]["volume_ml"] for c in finished]}
    assert len(set(values["dice"])) == 3 and values["dice"][2] == 0.0  # the miss scores 0: mean ≠ median ≠ any one
    assert values["voxels"][2:] == [0, 0] and values["voxels"][0] > 0
    digits = {"dice": 4, "iou": 4, "seconds": 2, "voxels": 1, "volume_ml": 3}
    header, rows, agg = read_summary(out / "summary.csv", aggregates=True)
    assert [r[0] for r in rows] == finished + ["corrupt", "missing"]
    for kind, f in (("mean", statistics.fmean), ("median", statistics.median)):
        assert agg[kind]["status"] == f"{kind} of 4 finished; dice, iou: 3 with gt"
        for col, vals in values.items():
            assert agg[kind][col] == f"{f(vals):.{digits[col]}f}", (kind, col)
        assert all(agg[kind][c] == "" for c in ("slice", "boxes", "confidence", "mean_hu", "bbox_ras_min"))
    a = info["aggregate"]
    counts = (a["cases"], a["done"], a["absent"], a["failed"], a["invalid"], a["finished"], a["scored"])
    assert counts == (6, 2, 2, 1, 1, 4, 3)
    assert a["dice_mean"] == pytest.approx(statistics.fmean(values["dice"]), abs=1e-6)
    assert a["dice_median"] == pytest.approx(statistics.median(values["dice"]), abs=1e-6)
    assert a["volume_ml_mean"] == pytest.approx(statistics.fmean(values["volume_ml"]), abs=1e-6)
    assert a["seconds_mean"] == pytest.approx(statistics.fmean(values["seconds"]), abs=1e-6)  # not the failed case's
    assert failed_seconds > 0 and a["counts"]["seconds"] == 4

    # the page: the aggregates before the cases; volume and HU in each found case's line
    page = (out / "summary.html").read_text(encoding="utf-8")
    assert page.index('<table class="aggregate">') < page.index('<table class="cases">') < page.index('id="case-liver"')
    table = page[page.index('<table class="aggregate">'):page.index('<table class="cases">')]
    assert f"<td>{statistics.fmean(values['dice']):.4f}</td><td>{statistics.median(values['dice']):.4f}</td>" in table
    liver = done["liver"]["stats"]
    assert (f"volume {liver['volume_ml']:.3f} mL ({liver['voxels']} voxels) · "
            f"HU in the mask: mean {liver['mean_hu']:.1f}") in page

    # --resume: the finished cases are read back; brain's done.json as an older version wrote it (no stats)
    old = dict(done["brain"])
    del old["stats"]
    (out / "brain" / "done.json").write_text(json.dumps(old))
    code, stdout, err = run_batch_cli(capsys, "--manifest", manifest, "--out-dir", out, *BASE, "--resume",
                                      "--skip-invalid")
    assert code == 3 and "Traceback" not in err, err
    header, again, agg2 = read_summary(out / "summary.csv", aggregates=True)
    assert again[:3] == rows[:3]  # statistics from done.json
    assert again[3] == rows[3][:len(SUMMARY_COLUMNS) - 9] + [""] * 9  # none recorded: empty, not zero
    assert agg2["mean"]["status"] == "mean of 4 finished; dice, iou: 3 with gt; voxels, volume_ml: 3 with statistics"
    assert agg2["mean"]["volume_ml"] == f"{statistics.fmean(values['volume_ml'][:3]):.3f}"
    assert (f"aggregate: Dice mean {statistics.fmean(values['dice']):.3f} / median "
            f"{statistics.median(values['dice']):.3f} over 3 case(s) with ground truth; volume mean "
            f"{statistics.fmean(values['volume_ml'][:3]):.1f} mL") in stdout


def test_aggregate_rule_without_a_model():
    """The rule by hand: finished (done, absent) cases with a value; failed and invalid never."""
    def row(cid, status, seconds=None, dice=None, stats=None, confidence=None):
        return {"id": cid, "status": status, "error": "", "slice": None, "boxes": None, "seconds": seconds,
                "dice": dice, "iou": None if dice is None else dice / 2, "confidence": confidence, "stats": stats}

    rows = [row("a", "done", 2.0, 0.9, {"voxels": 100, "volume_ml": 10.0}, 0.5),
            row("b", "done", 4.0, 0.5, {"voxels": 300, "volume_ml": 30.0}),
            row("c", "absent", 1.0, 0.0, {"voxels": 0, "volume_ml": 0.0}),
            row("d", "done", 3.0, None, None),  # no gt, an older done.json
            row("e", "failed", 9.0, 0.99, {"voxels": 999, "volume_ml": 99.0}, 0.9),  # never counted
            row("f", "invalid")]
    agg = aggregate(rows)
    assert (agg["finished"], agg["scored"], agg["failed"], agg["invalid"]) == (4, 3, 1, 1)
    assert agg["dice_mean"] == pytest.approx(1.4 / 3) and agg["dice_median"] == 0.5
    assert agg["iou_mean"] == pytest.approx(0.7 / 3) and agg["iou_median"] == 0.25
    assert (agg["seconds_mean"], agg["seconds_median"]) == (2.5, 2.5)
    assert agg["volume_ml_mean"] == pytest.approx(40 / 3) and agg["volume_ml_median"] == 10.0
    assert agg["voxels_median"] == 100.0 and (agg["confidence_mean"], agg["confidence_median"]) == (0.5, 0.5)
    mean, median = (dict(zip(SUMMARY_COLUMNS, r)) for r in aggregate_csv_rows(agg))
    assert mean["status"] == ("mean of 4 finished; dice, iou: 3 with gt; confidence: 1 with a value; "
                              "voxels, volume_ml: 3 with statistics")
    assert (mean["dice"], median["dice"], mean["volume_ml"], mean["voxels"]) == ("0.4667", "0.5000", "13.333", "133.3")
    nothing = dict(zip(SUMMARY_COLUMNS, aggregate_csv_rows(aggregate([row("e", "failed", 9.0, 0.99)]))[0]))
    assert nothing["status"] == "mean of 0 finished"
    assert all(v == "" for k, v in nothing.items() if k not in ("id", "status"))


# ---- consensus ---------------------------------------------------------------------------------

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


# ---- the ground truth's grid, checked by geometry before any model loads --------------------------

class _RecordingPipeline:
    """Stands in for a Pipeline: records whether anything tried to load a model."""

    preset, smoke, identity = "tiny", True, None

    def __init__(self):
        self.calls = []

    def load(self):
        self.calls.append("load")
        raise AssertionError("a model was loaded")


def _tiny(path: Path, array=None, affine=None) -> Path:
    nib.save(nib.Nifti1Image(_labels() if array is None else array, AFFINE if affine is None else affine), str(path))
    return path


def test_missing_file_in_row_500_stops_before_any_model(capsys, tmp_path):
    from medvolcore.batch import BatchOptions, ManifestError, run_batch

    _tiny(tmp_path / "ct.nii.gz")
    _tiny(tmp_path / "seg.nii.gz")
    _tiny(tmp_path / "seg_other.nii.gz", _labels()[:, :, :3].copy())
    lines = ["id,volume,query,gt,label"] + [f"c{i},ct.nii.gz,liver,seg.nii.gz,5" for i in range(1, 500)]
    lines.append("c500,no_such_ct.nii.gz,liver,,")
    lines[10] = "c10,ct.nii.gz,liver,seg_other.nii.gz,5"  # a ground truth of another extent
    manifest = tmp_path / "cases.csv"
    manifest.write_text("\n".join(lines) + "\n")
    pipe = _RecordingPipeline()
    with pytest.raises(ManifestError) as ei:
        run_batch(manifest, tmp_path / "out", BatchOptions(progress=False), pipeline=pipe)
    assert pipe.calls == [] and not (tmp_path / "out").exists()
    assert [d.split(":")[0] for d in ei.value.details] == ["line 11 (c10)", "line 501 (c500)"]
    code, out, err = _cli(capsys, "batch", "--manifest", manifest, "--out-dir", tmp_path / "out", "--preset", "tiny")
    got = err.strip().splitlines()
    assert code == 2 and len(got) == 3 and "Traceback" not in err
    assert "does not cover" not in got[0] and "do not cover the same space" in got[0] and "does not exist" in got[1]
    assert "2 problem(s)" in got[2] and "--skip-invalid" in got[2]
    # --dry-run with --skip-invalid: says what would run, loads and writes nothing
    res = run_batch(manifest, tmp_path / "out", BatchOptions(progress=False, dry_run=True, skip_invalid=True),
                    pipeline=pipe)
    assert pipe.calls == [] and not (tmp_path / "out").exists() and res.exit_code == 0
    assert len(res.info["would_run"]) == 498 and [c["id"] for c in res.info["invalid_cases"]] == ["c10", "c500"]


def test_batch_check_accepts_a_flipped_ground_truth_grid(tmp_path):
    from medvolcore.batch import Case, check_case_files

    a = _labels()
    flipped = AFFINE.copy()
    flipped[:3, 0] *= -1
    flipped[:3, 3] = AFFINE[:3, :3] @ [a.shape[0] - 1, 0, 0] + AFFINE[:3, 3]
    ct, gt = _tiny(tmp_path / "ct.nii.gz"), _tiny(tmp_path / "gt.nii.gz", np.ascontiguousarray(a[::-1]), flipped)
    case = Case(id="a", volume=ct, query="liver", gt=gt)
    check_case_files([case])
    assert case.problem is None
    m = match_grids(a.shape, AFFINE, a.shape, flipped)
    assert m.kind == "reoriented" and "flipped axes 0" in m.note


@pytest.mark.probe("43.5", "batch summary.csv with a case id, error and query that start with = @ + - or a tab")
def test_summary_csv_cells_are_never_formulas(tmp_path):
    import csv

    from medvolcore.batch.report import write_summary_csv

    row = {"id": "=HYPERLINK(\"http://x\")", "status": "failed", "error": "@SUM(A1:A9) is not a volume",
           "slice": 3, "boxes": 1, "seconds": 1.5, "dice": None, "iou": None, "confidence": None,
           "stats": {"query": "\t+1+cmd", "mean_hu": -12.5, "bbox_ras_min": [-1.0, 2.0, -3.0]}}
    got = list(csv.DictReader(open(write_summary_csv(tmp_path / "summary.csv", [row]), newline="")))[0]
    assert (got["id"], got["error"]) == ("'=HYPERLINK(\"http://x\")", "'@SUM(A1:A9) is not a volume")
    assert got["mean_hu"] == "-12.5" and got["bbox_ras_min"] == "-1.0 2.0 -3.0"
