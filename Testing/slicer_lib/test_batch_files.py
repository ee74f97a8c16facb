"""The files of the headless Slicer batch (``MedVolR1SlicerLib.batchjobs``): no output is a file
the batch reads or another row's file, even with ``--overwrite``; each row's anchor has its own
name and never replaces a file without ``--overwrite``; the manifest and the token file are read
only when they are regular files; a manifest is read and checked in time linear in its rows.
What ``batch.py`` itself does with these (exit code, nothing written) is in
``Testing/slicer_mrml/test_mrml_batch_files.py``."""

from __future__ import annotations

import os
import pathlib
import sys
import time

import pytest
from MedVolR1SlicerLib.batchjobs import (
    BatchError,
    anchor_path,
    check_outputs,
    jobs_from_args,
    parse_args,
    read_manifest,
)

posix_only = pytest.mark.skipif(sys.platform == "win32", reason="named pipes and hard links as on POSIX")


def _jobs(*argv):
    return jobs_from_args(parse_args(list(argv)))


def _refused(jobs, *words, anchor_dir=None, reads=()):
    """check_outputs refuses ``jobs`` even with --overwrite, in one line naming ``words``."""
    more = {k: v for k, v in (("anchor_dir", anchor_dir), ("reads", reads)) if v}
    with pytest.raises(BatchError) as e:
        check_outputs(jobs, True, **more)
    text = str(e.value)
    assert "\n" not in text and all(w in text for w in words), text
    return text


@posix_only
@pytest.mark.probe("II.8", "Slicer batch: an output that is an input (same path, '..', symlink, hard link, "
                           "another row's input or output) with --overwrite")
def test_no_output_is_a_file_the_batch_reads_or_another_rows_output_even_with_overwrite(tmp_path, record_property):
    ct = tmp_path / "ct.nii.gz"
    ct.write_bytes(b"CT")
    (tmp_path / "sub").mkdir()
    # the --input form: the output is the CT itself, by its name, through '..', a symbolic link, a hard link
    os.symlink(ct, tmp_path / "link.nii.gz")
    os.link(ct, tmp_path / "hard.nii.gz")
    for out in (ct, tmp_path / "sub" / ".." / "ct.nii.gz", tmp_path / "link.nii.gz", tmp_path / "hard.nii.gz"):
        _refused(_jobs("--input", str(ct), "--query", "q", "--output", str(out), "--overwrite"), "--output", "--input")
    # 'link/..' is the folder above the link's target, not the folder holding the link
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "ct.nii.gz").write_bytes(b"CT a")
    os.symlink(tmp_path / "a" / "b", tmp_path / "lnk")
    _refused(_jobs("--input", str(tmp_path / "a" / "ct.nii.gz"), "--query", "q", "--output",
                   str(tmp_path / "lnk" / ".." / "ct.nii.gz"), "--overwrite"), "--output", "--input")
    check_outputs(_jobs("--input", str(ct), "--query", "q", "--output", str(tmp_path / "lnk" / ".." / "ct.nii.gz")),
                  True)  # that is a/ct.nii.gz, another file than the input ct.nii.gz
    # a manifest: row 3 writes what row 2 reads (a copy of a CT); the message names both rows
    (tmp_path / "b.nii.gz").write_bytes(b"another CT")
    manifest = tmp_path / "jobs.csv"
    manifest.write_text("input,query,output\nct.nii.gz,q,a.seg.nrrd\nb.nii.gz,q,c.seg.nrrd\nct.nii.gz,q,b.nii.gz\n")
    with pytest.raises(BatchError, match=r"^row 4's output \S+b\.nii\.gz is row 3's input \(\S+b\.nii\.gz\); "
                                         r"write it elsewhere \(nothing was run\)$"):
        _jobs("--manifest", str(manifest), "--overwrite")
    # two rows writing one file through a hard link (resolved paths differ; the inode is the same)
    os.link(tmp_path / "b.nii.gz", tmp_path / "b2.nii.gz")
    manifest.write_text("input,query,output\nct.nii.gz,q,x/../b.nii.gz\nct.nii.gz,q,sub/../b2.nii.gz\n")
    (tmp_path / "x").mkdir()
    with pytest.raises(BatchError, match=r"^row 2's output and row 3's output are the same file"):
        read_manifest(manifest)
    # the token file and the manifest are read too: no output may be either
    token = tmp_path / "token.nii"
    token.write_text("secret")
    jobs = _jobs("--input", str(ct), "--query", "q", "--output", str(token))
    text = _refused(jobs, "--output", "the token file", reads=[("the token file", str(token))])
    record_property("message", text)
    # an anchor is written too: one that is an input (a symbolic link in the anchor folder) is refused
    anchors = tmp_path / "anchors"
    anchors.mkdir()
    os.symlink(ct, anchors / "a.anchor.json")
    _refused(_jobs("--input", str(ct), "--query", "q", "--output", str(tmp_path / "a.seg.nrrd")),
             "the anchor", "--input", anchor_dir=anchors)
    # distinct files pass
    check_outputs(_jobs("--input", str(ct), "--query", "q", "--output", str(tmp_path / "new.seg.nrrd")), True)


@pytest.mark.probe("II.10", "Slicer batch --anchor-dir: two rows with the same output name; an existing anchor")
def test_each_row_has_its_own_anchor_and_none_replaces_a_file_without_overwrite(tmp_path):
    (tmp_path / "ct.nii.gz").write_bytes(b"CT")
    manifest = tmp_path / "jobs.csv"
    manifest.write_text("input,query,output\nct.nii.gz,q,one/liver.seg.nrrd\nct.nii.gz,q,two/liver.seg.nrrd\n"
                        "ct.nii.gz,q,one/liver.nii.gz\nct.nii.gz,q,\n")
    jobs = read_manifest(manifest, tmp_path / "out")
    anchors = tmp_path / "anchors"
    names = [anchor_path(anchors, j).name for j in jobs]
    assert names == ["liver.row2.anchor.json", "liver.row3.anchor.json", "liver.row4.anchor.json",
                     "ct.row5.anchor.json"]  # a default output (ct.row5.seg.nrrd) gets the row once
    check_outputs(jobs, False, anchors)  # no collision, nothing exists yet
    # --input: the output's name, as before
    (single,) = _jobs("--input", "ct.nii.gz", "--query", "q", "--output", str(tmp_path / "a.seg.nrrd"))
    assert anchor_path(anchors, single).name == "a.anchor.json"
    # an existing anchor is refused without --overwrite (and replaced with it)
    anchors.mkdir()
    (anchors / "liver.row3.anchor.json").write_text("{}")
    with pytest.raises(BatchError, match=r"liver\.row3\.anchor\.json exists; pass --overwrite"):
        check_outputs(jobs, False, anchors)
    check_outputs(jobs, True, anchors)
    # an anchor folder that is a file
    with pytest.raises(BatchError, match="--anchor-dir .* is not a folder"):
        check_outputs(jobs, True, manifest)


@posix_only
@pytest.mark.probe("II.10", "Slicer batch: a named pipe, a device or a folder as --token-file or --manifest")
def test_the_token_file_and_the_manifest_must_be_regular_files(tmp_path, record_property):
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)  # nobody writes to it: a blocking open would wait for ever
    t0 = time.perf_counter()
    with pytest.raises(BatchError, match=r"^manifest \S+fifo\.csv is a named pipe, not a regular file$"):
        read_manifest(fifo)
    from MedVolR1SlicerLib.batchjobs import read_regular_file, read_token_file

    with pytest.raises(BatchError, match=r"^token file \S+fifo\.csv is a named pipe, not a regular file$"):
        read_token_file(fifo)
    record_property("seconds_to_refuse", round(time.perf_counter() - t0, 4))
    if os.path.exists("/dev/zero"):
        with pytest.raises(BatchError, match="is a device, not a regular file"):
            read_token_file("/dev/zero")
    with pytest.raises(BatchError, match="is a folder, not a regular file"):
        read_manifest(tmp_path)
    with pytest.raises(BatchError, match="does not exist"):
        read_token_file(tmp_path / "missing")
    token = tmp_path / "token"
    token.write_text("\n")
    with pytest.raises(BatchError, match="is empty"):
        read_token_file(token)
    token.write_text(" s3cret \n")
    assert read_token_file(token) == "s3cret"
    token.write_bytes(b"x" * 100)
    with pytest.raises(BatchError, match="larger than 0 KiB"):
        read_regular_file(token, "token file", 99)
    token.write_bytes(b"\xff\xfe")
    with pytest.raises(BatchError, match="not UTF-8 text"):
        read_regular_file(token, "token file", 99)


def _manifest(folder, n):
    (folder / "ct.nii.gz").write_bytes(b"CT")
    path = folder / "jobs.csv"
    path.write_text("input,query,output\n" + "".join(f"ct.nii.gz,the liver,out/case{i}.seg.nrrd\n" for i in range(n)))
    return path


@pytest.mark.probe("II.6", "Slicer batch: a manifest of many rows (path comparisons counted)")
def test_reading_a_manifest_compares_paths_a_number_of_times_linear_in_its_rows(tmp_path, monkeypatch,
                                                                               record_property):
    path = _manifest(tmp_path, 300)
    calls = [0]
    eq = pathlib.PurePath.__eq__

    def counted(self, other):
        calls[0] += 1
        return eq(self, other)

    monkeypatch.setattr(pathlib.PurePath, "__eq__", counted)
    jobs = read_manifest(path)
    record_property("path_comparisons_read_300_rows", calls[0])
    assert len(jobs) == 300 and calls[0] <= 300  # comparing every output with every other makes ~90,000
    calls[0] = 0
    check_outputs(jobs, False, tmp_path / "anchors", reads=[("the manifest", path)])
    record_property("path_comparisons_check_300_rows", calls[0])
    assert calls[0] <= 300
