"""A job's outputs change as one set (:func:`medvolcore.fileio.output_set`): a failure at any one
output — injected at each in turn, as a full disk when that file's temporary is made — leaves the
previous run's files byte for byte and no new file (no temporary either); so does a failure while
the files are renamed into place, and an interrupt (Ctrl-C) in a several-target run."""

from __future__ import annotations

import errno
import tempfile

import pytest

from medvolcore.errors import OutputError
from medvolcore.fileio import write_text_atomic
from medvolcore.jobs import SegmentOutputs, SegmentRequest, run_segment_job

from core.test_jobs import BOX, calls, propagator  # noqa: F401  (fixtures)
from core.test_pipeline import QUERIES, canned, pipe, tiny_dir  # noqa: F401  (fixtures)

sitk = pytest.importorskip("SimpleITK")
pytest.importorskip("highdicom")

OTHER_BOX = [30, 30, 60, 50]


def _fail_at(monkeypatch, name: str, exc=None):
    """Make the temporary of output ``name`` impossible to create (a full disk at that file)."""
    real = tempfile.mkstemp

    def mkstemp(*args, prefix=None, **kw):
        if prefix and prefix.startswith(f".{name}."):
            raise exc or OSError(errno.ENOSPC, "No space left on device")
        return real(*args, prefix=prefix, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def series(tmp_path, small_ct, write_dicom_series):
    img = sitk.Cast(sitk.ReadImage(str(small_ct[0])), sitk.sitkInt16)
    folder = tmp_path / "series"
    write_dicom_series(sitk, img, folder)
    return folder


def _outputs(out, overwrite=False):
    return SegmentOutputs([out / "m.nii.gz", out / "m.seg.nrrd", out / "m.dcm"], anchor=out / "m.anchor.json",
                          qc=out / "m.png", stats=out / "m.stats.json", overwrite=overwrite)


ONE_TARGET_FILES = ["m.nii.gz", "m.seg.nrrd", "m.dcm", "m.anchor.json", "m.png", "m.stats.json"]


@pytest.mark.parametrize("failing", ONE_TARGET_FILES)
def test_a_failed_overwrite_run_leaves_the_previous_set_whole(tmp_path, series, calls,  # noqa: F811
                                                               monkeypatch, failing):
    out = tmp_path / "out"
    out.mkdir()
    run_segment_job(calls, series, SegmentRequest(key_slice=3, boxes=[BOX]), _outputs(out))
    before = _snapshot(out)
    assert sorted(before) == sorted(ONE_TARGET_FILES)
    _fail_at(monkeypatch, failing)
    with pytest.raises(OutputError, match=rf"{failing}.*no space left"):
        run_segment_job(calls, series, SegmentRequest(key_slice=4, boxes=[OTHER_BOX]), _outputs(out, overwrite=True))
    assert _snapshot(out) == before  # every file as the first run wrote it, no temporary left


def test_a_failed_first_run_leaves_no_file(tmp_path, series, calls, monkeypatch):  # noqa: F811
    failing = ONE_TARGET_FILES[-1]  # the last file: every other one was written
    out = tmp_path / "out"
    out.mkdir()
    _fail_at(monkeypatch, failing)
    with pytest.raises(OutputError):
        run_segment_job(calls, series, SegmentRequest(key_slice=3, boxes=[BOX]), _outputs(out))
    assert list(out.iterdir()) == []


def test_a_failure_while_renaming_puts_the_previous_files_back(tmp_path, series, calls, monkeypatch):  # noqa: F811
    import os

    out = tmp_path / "out"
    out.mkdir()
    run_segment_job(calls, series, SegmentRequest(key_slice=3, boxes=[BOX]), _outputs(out))
    before = _snapshot(out)
    real = os.replace
    done = []

    def replace(src, dst):
        if str(dst).endswith("/m.png") and "failed" not in done:  # the fifth file placed: four are in place
            done.append("failed")
            raise OSError(errno.EIO, "Input/output error")
        done.append(str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OutputError, match=r"m\.png.*input/output error"):
        run_segment_job(calls, series, SegmentRequest(key_slice=4, boxes=[OTHER_BOX]), _outputs(out, overwrite=True))
    assert any(str(d).endswith("m.nii.gz") for d in done)  # the set was partly placed, then put back
    assert _snapshot(out) == before


def test_a_set_written_twice_to_one_name_keeps_the_later(tmp_path):
    from medvolcore.fileio import output_set

    with output_set():
        write_text_atomic(tmp_path / "a.txt", "first")
        write_text_atomic(tmp_path / "a.txt", "second")
        assert list(tmp_path.iterdir()) != [] and not (tmp_path / "a.txt").exists()  # only temporaries so far
    assert _snapshot(tmp_path) == {"a.txt": b"second"}


SEVERAL = ["organs.nii.gz", "organs.labels.json", "organs.seg.nrrd", "organs.2.anchor.json", "qc.2.png",
           "stats.csv"]


@pytest.mark.parametrize("failing", SEVERAL)
def test_a_several_target_run_that_fails_leaves_nothing_that_looks_finished(pipe, small_ct, canned,  # noqa: F811
                                                                              tmp_path, monkeypatch, failing):
    out = tmp_path / "out"
    out.mkdir()
    outputs = SegmentOutputs([out / "organs.nii.gz", out / "organs.seg.nrrd"], anchor=out / "organs.anchor.json",
                             qc=out / "qc.png", stats=out / "stats.csv")
    _fail_at(monkeypatch, failing)
    with pytest.raises(OutputError, match=failing.replace(".", r"\.")):
        run_segment_job(pipe, small_ct[0], SegmentRequest(queries=QUERIES), outputs)
    assert list(out.iterdir()) == []  # no label map without its labels table, no anchor without its mask


def test_an_interrupted_several_target_run_leaves_no_file(pipe, small_ct, canned, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "out"
    out.mkdir()
    _fail_at(monkeypatch, "organs.labels.json", KeyboardInterrupt())  # Ctrl-C after the label map was written
    with pytest.raises(KeyboardInterrupt):
        run_segment_job(pipe, small_ct[0], SegmentRequest(queries=QUERIES),
                        SegmentOutputs(out / "organs.nii.gz", anchor=out / "organs.anchor.json"))
    assert list(out.iterdir()) == []
