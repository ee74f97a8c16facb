"""``batch.py``'s files on real MRML (slicer-core), without a worker: an output that is an input
(``--input`` form, or one row writing the CT another reads) is refused with ``--overwrite`` too, exit
code 2, nothing written; two rows with outputs of one name keep one anchor each; a token file
that is a named pipe is refused at once instead of waited on; a file that appears at an output
while its case runs is left as it is. The rules themselves are tested in
``Testing/slicer_lib/test_batch_files.py``; here the script's exit codes and what it leaves on disk.

The stand-in logic segments the voxels above 0 HU and writes through the module's own writers
(``MedVolR1SlicerLogic.writeSegmentationFile`` / ``writeVolumeFile``), so a row that ran writes a
real ``.seg.nrrd`` or label map, as with a worker."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import sys
import threading

import nibabel as nib
import numpy as np
import pytest

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - the real package, imported by conftest.py


@pytest.fixture
def batch(slicer_env):
    import batch as batch_module

    return batch_module


class StandInLogic:
    """``segmentBlocking`` without a worker; the writers are the module logic's own."""

    def __init__(self, module):
        self.writeSegmentationFile = module.MedVolR1SlicerLogic.writeSegmentationFile
        self.writeVolumeFile = module.MedVolR1SlicerLogic.writeVolumeFile
        self.queries = []

    def segmentBlocking(self, volume, query, options=None):
        self.queries.append(query)
        seg = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode")
        seg.SetReferenceImageGeometryParameterFromVolumeNode(volume)
        segment_id = seg.GetSegmentation().AddEmptySegment(query)
        mask = (slicer.util.arrayFromVolume(volume) > 0).astype(np.uint8)
        slicer.util.updateSegmentBinaryLabelmapFromArray(mask, seg, segment_id, volume)
        return seg, segment_id, [], {"schema": "medvol.anchor/1", "query": query}


def _ct(path, seed=0):
    arr = np.random.default_rng(seed).integers(-1000, 1000, size=(6, 5, 4)).astype(np.int16)
    nib.save(nib.Nifti1Image(arr, np.diag([0.8, 0.8, 2.5, 1.0])), str(path))
    return path.read_bytes()


def _manifest(path, rows):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["input", "query", "output"])
    w.writerows(rows)
    path.write_text(buf.getvalue())
    return path


@pytest.mark.probe("II.8", "Slicer batch.py --overwrite: output = input; the row on line 3 writes the input of line 4")
def test_an_output_that_is_an_input_is_refused_with_overwrite_and_nothing_is_written(
        batch, scene, slicer_env, tmp_path, capsys, record_property):
    ct, other = tmp_path / "ct.nii.gz", tmp_path / "b.nii.gz"
    before = {ct: _ct(ct, 0), other: _ct(other, 1)}
    logic = StandInLogic(slicer_env)
    # the --input form: the output is the CT
    code = batch.main(["--input", str(ct), "--query", "the liver", "--output", str(ct), "--overwrite"], logic=logic)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--output {ct} is --input ({ct})" in err
    # a manifest: row 2 writes b.nii.gz, which row 3 reads (another CT)
    manifest = _manifest(tmp_path / "jobs.csv", [["ct.nii.gz", "the liver", "out/a.seg.nrrd"],
                                                  ["ct.nii.gz", "the liver", "b.nii.gz"],
                                                  ["b.nii.gz", "the spleen", "out/c.seg.nrrd"]])
    code = batch.main(["--manifest", str(manifest), "--overwrite", "--keep-going"], logic=logic)
    err = capsys.readouterr().err
    record_property("message", err.strip())
    assert code == 2 and err.count("\n") == 1, err
    assert "row 3's output" in err and "is row 4's input" in err
    # nothing ran, nothing was written, both CTs are as they were
    assert logic.queries == []
    assert sorted(os.listdir(tmp_path)) == ["b.nii.gz", "ct.nii.gz", "jobs.csv"]
    assert {p: p.read_bytes() for p in before} == before


@pytest.mark.probe("II.10", "Slicer batch.py --anchor-dir: two rows whose outputs have one name")
def test_rows_with_outputs_of_one_name_keep_one_anchor_each_and_none_is_replaced(
        batch, scene, slicer_env, tmp_path, capsys):
    _ct(tmp_path / "ct.nii.gz")
    manifest = _manifest(tmp_path / "jobs.csv", [["ct.nii.gz", "the liver", "one/liver.seg.nrrd"],
                                                  ["ct.nii.gz", "the spleen", "two/liver.nii.gz"]])
    anchors = tmp_path / "anchors"
    logic = StandInLogic(slicer_env)
    code = batch.main(["--manifest", str(manifest), "--anchor-dir", str(anchors)], logic=logic)
    out, err = capsys.readouterr()
    assert code == 0, out + err
    queries = {n: json.loads((anchors / n).read_text())["query"] for n in sorted(os.listdir(anchors))}
    assert queries == {"liver.row2.anchor.json": "the liver", "liver.row3.anchor.json": "the spleen"}
    assert (tmp_path / "one" / "liver.seg.nrrd").is_file() and (tmp_path / "two" / "liver.nii.gz").is_file()
    # run again without --overwrite: refused up front (the outputs and the anchors exist), nothing replaced
    (tmp_path / "one" / "liver.seg.nrrd").unlink()
    (tmp_path / "two" / "liver.nii.gz").unlink()
    (anchors / "liver.row3.anchor.json").write_text("mine")
    code = batch.main(["--manifest", str(manifest), "--anchor-dir", str(anchors)], logic=logic)
    err = capsys.readouterr().err
    assert code == 2 and "liver.row2.anchor.json exists (and 1 more); pass --overwrite" in err, err
    assert (anchors / "liver.row3.anchor.json").read_text() == "mine" and logic.queries == ["the liver", "the spleen"]


@pytest.mark.skipif(sys.platform == "win32", reason="named pipes as on POSIX")
@pytest.mark.probe("II.10", "Slicer batch.py --token-file naming a named pipe nobody writes to")
def test_a_token_file_that_is_a_named_pipe_is_refused_at_once(batch, scene, slicer_env, tmp_path, record_property):
    ct = tmp_path / "ct.nii.gz"
    _ct(ct)
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    result = {}

    def run():
        buf = io.StringIO()
        with contextlib.redirect_stderr(buf):
            result["code"] = batch.main(["--input", str(ct), "--query", "q", "--output", str(tmp_path / "o.seg.nrrd"),
                                         "--worker-url", "http://127.0.0.1:9", "--token-file", str(fifo)],
                                        logic=StandInLogic(slicer_env))
        result["err"] = buf.getvalue()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5)
    try:
        assert not thread.is_alive(), "batch.py waits for a writer on the named pipe"
    finally:
        if thread.is_alive():  # the old behaviour: let the blocked open() return, so the thread ends
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
            thread.join(30)
    assert result["code"] == 2 and result["err"].count("\n") == 1, result
    assert f"token file {fifo} is a named pipe, not a regular file" in result["err"]
    assert not (tmp_path / "o.seg.nrrd").exists()


def test_a_file_that_appears_while_a_case_runs_is_left_as_it_is(batch, scene, slicer_env, tmp_path, capsys):
    ct, out = tmp_path / "ct.nii.gz", tmp_path / "liver.seg.nrrd"
    _ct(ct)

    class Racing(StandInLogic):
        def segmentBlocking(self, volume, query, options=None):
            out.write_text("written by someone else meanwhile")
            return super().segmentBlocking(volume, query, options)

    code = batch.main(["--input", str(ct), "--query", "the liver", "--output", str(out)], logic=Racing(slicer_env))
    captured = capsys.readouterr()
    assert code == 1 and "appeared while this case ran" in captured.err, captured
    assert out.read_text() == "written by someone else meanwhile"
    assert sorted(os.listdir(tmp_path)) == ["ct.nii.gz", "liver.seg.nrrd"]  # no temporary file left


class AbsentForSomeLogic(StandInLogic):
    """Answers "not present" for queries that start with "no ", as the logic does for an absent result."""

    def segmentBlocking(self, volume, query, options=None):
        if query.startswith("no "):
            self.queries.append(query)
            return None, "", [], {"schema": "medvol.anchor/3", "absent": True, "slice": None, "boxes": [],
                                  "query": query, "reasoning": "not seen"}
        return super().segmentBlocking(volume, query, options)


def test_a_row_answered_not_present_writes_no_output_and_is_counted_apart(
        batch, scene, slicer_env, tmp_path, capsys):
    cts = [tmp_path / "a.nii.gz", tmp_path / "b.nii.gz"]
    for i, ct in enumerate(cts):
        _ct(ct, i)
    manifest = _manifest(tmp_path / "m.csv", [[str(cts[0]), "the liver", str(tmp_path / "a.seg.nrrd")],
                                              [str(cts[1]), "no such cyst", str(tmp_path / "b.seg.nrrd")]])
    anchors = tmp_path / "anchors"
    code = batch.main(["--manifest", str(manifest), "--anchor-dir", str(anchors)], logic=AbsentForSomeLogic(slicer_env))
    out = capsys.readouterr().out
    assert code == 0, out  # "not present" is an answer, not a failure
    assert (tmp_path / "a.seg.nrrd").is_file() and not (tmp_path / "b.seg.nrrd").exists()
    assert "not found in this CT: no such cyst (no output written)" in out
    assert "1 of 2 done, 1 not found in their CT (no output written)" in out
    written = {p.name: json.loads(p.read_text()) for p in anchors.iterdir()}
    assert len(written) == 2 and sum(bool(a.get("absent")) for a in written.values()) == 1


def test_consensus_and_threads_reach_the_worker_options(batch, scene, slicer_env, tmp_path, capsys):
    ct = tmp_path / "ct.nii.gz"
    _ct(ct)
    logic = StandInLogic(slicer_env)
    seen = []
    logic.segmentBlocking = lambda volume, query, options=None, _f=logic.segmentBlocking: (seen.append(options),
                                                                                         _f(volume, query))[1]
    code = batch.main(["--input", str(ct), "--query", "the liver", "--output", str(tmp_path / "o.seg.nrrd"),
                       "--consensus", "3", "--threads", "2"], logic=logic)
    assert code == 0, capsys.readouterr().err
    assert seen[0].consensus == 3 and seen[0].extra_worker_args == ["--threads", "2"]
    for argv, message in ((["--consensus", "9"], "--consensus takes 1 to 8"),
                          (["--threads", "0"], "--threads takes a whole number"),
                          (["--threads", "2", "--worker-url", "http://127.0.0.1:8765"], "a remote worker")):
        code = batch.main(["--input", str(ct), "--query", "q", "--output", str(tmp_path / "x.seg.nrrd"), *argv],
                          logic=logic)
        assert code == 2 and message in capsys.readouterr().err


@pytest.mark.probe("43.5", "headless Slicer batch: a query holding terminal escape sequences and a newline")
def test_queries_reach_the_terminal_escaped(batch, scene, slicer_env, tmp_path, capsys):
    ct = tmp_path / "ct.nii.gz"
    _ct(ct)
    query = "\x1b]0;owned\x07the liver\x1b[2J\r\nmedvol batch (Slicer): 9 of 9 done"
    code = batch.main(["--input", str(ct), "--query", query, "--output", str(tmp_path / "o.seg.nrrd")],
                      logic=StandInLogic(slicer_env))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not any(c in out + err for c in "\x1b\x07\r") and "9 of 9 done" not in out.splitlines()[-1]
    assert "\\x1b]0;owned\\x07the liver\\x1b[2J" in out
