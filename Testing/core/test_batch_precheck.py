"""What ``medvol batch``'s check (and ``--dry-run``) catches before any model loads, from the headers
and one cheap read: a ground truth without the requested label, a folder with no DICOM file; a
ground truth's problem named as such (``bad_ground_truth``), at check time and at run time."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medvolcore.batch import BatchOptions, Case, check_case_files, run_batch
from medvolcore.errors import GroundTruthError

from core.test_batch import _RecordingPipeline
from core.test_geometry import AFFINE, _labels


def _save(path: Path, array=None) -> Path:
    nib.save(nib.Nifti1Image(_labels() if array is None else array, AFFINE), str(path))
    return path


def _ct(path: Path) -> Path:
    a = np.where(_labels() > 0, 40, -1000).astype(np.int16)
    return _save(path, a)


_NoModel = _RecordingPipeline  # records whether anything tried to load a model


def test_a_ground_truth_without_the_label_and_a_folder_without_dicom_are_caught(tmp_path):
    ct, gt = _ct(tmp_path / "ct.nii.gz"), _save(tmp_path / "gt.nii.gz")
    empty = tmp_path / "not_dicom"
    empty.mkdir()
    (empty / "notes.txt").write_text("no DICOM here\n")
    cases = [Case(id="ok", volume=ct, query="q", gt=gt, label=5),
             Case(id="no_label", volume=ct, query="q", gt=gt, label=3),
             Case(id="no_dicom", volume=empty, query="q")]
    check_case_files(cases)
    assert cases[0].problem is None
    assert cases[1].problem.startswith("bad_ground_truth: label 3 is absent from gt.nii.gz (labels present: 2, 5)")
    assert "holds no DICOM file" in cases[2].problem


def test_dry_run_lists_them_as_invalid_and_loads_nothing(tmp_path):
    _ct(tmp_path / "ct.nii.gz"), _save(tmp_path / "gt.nii.gz")
    (tmp_path / "series").mkdir()
    (tmp_path / "series" / "a.txt").write_text("x")
    manifest = tmp_path / "cases.csv"
    manifest.write_text("id,volume,query,gt,label\nok,ct.nii.gz,liver,gt.nii.gz,5\n"
                        "bad,ct.nii.gz,liver,gt.nii.gz,3\nfolder,series,liver,,\n")
    pipe = _NoModel()
    res = run_batch(manifest, tmp_path / "out", BatchOptions(progress=False, dry_run=True, skip_invalid=True),
                    pipeline=pipe)
    assert pipe.calls == [] and res.info["would_run"] == ["ok"]
    invalid = {c["id"]: c["error"] for c in res.info["invalid_cases"]}
    assert invalid["bad"].startswith("bad_ground_truth:") and "DICOM" in invalid["folder"]


def test_at_run_time_a_ground_truth_problem_is_bad_ground_truth(tmp_path):
    from medvolcore.batch.case import _segment_case

    ct, gt = _ct(tmp_path / "ct.nii.gz"), _save(tmp_path / "gt.nii.gz")
    case = Case(id="a", volume=ct, query="liver", gt=gt, label=3)  # say the file changed after the check
    with pytest.raises(GroundTruthError, match="the ground truth gt.nii.gz: label 3 is absent") as ei:
        _segment_case(case, tmp_path / "a", _NoModel(), BatchOptions(), None, None, {}, 0.0)
    assert ei.value.code == "bad_ground_truth"


def test_the_summary_table_scrolls_in_its_own_box():
    """summary.html's table of 18+ columns scrolls inside a box instead of running off the page."""
    import re

    from medvolcore.batch.report import render_summary_html

    page = render_summary_html([])
    assert '<div class="scroll"><table class="cases">' in page and "</table></div>" in page
    css = re.search(r"<style>(.*)</style>", page, re.S).group(1)
    assert re.search(r"\.scroll\{[^}]*overflow-x:auto", css)
