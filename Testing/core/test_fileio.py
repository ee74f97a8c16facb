"""Output files (:mod:`medvolcore.fileio`, checked for a job by :mod:`medvolcore.jobs`): checked before
any work (two outputs in one file, an output that is an input, a parent that is a file, a wrong
suffix, permission denied, a read-only folder), never half-written (disk full, SIGTERM during the
rename, a writer that wrote nothing, a killed writer's temporaries), with normal permissions.
Mostly probes (``@pytest.mark.probe``), as in ``test_serve_probes.py``."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from medvolcore.errors import OutputError

from core.probes import (ANCHOR, one_line,
                    run_cli)


# ---- command line: outputs --------------------------------------------------------------------------

@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a command gets as far as loading models (the checks must come first)."""
    from medvolcore import pipeline

    def refuse(*a, **k):
        raise AssertionError("models were loaded before the outputs were checked")

    monkeypatch.setattr(pipeline.Pipeline, "__init__", refuse)


@pytest.mark.probe("11", "segment --out m --anchor-out m / --qc m")
@pytest.mark.parametrize("other", ["--anchor-out", "--qc"])
def test_segment_refuses_two_outputs_in_one_file(capsys, tmp_path, ct_sm_path, no_model_load, other):
    m = tmp_path / "m.nii.gz"
    code, _, err = run_cli(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", m, other, m, "--overwrite")
    one_line(code, err, "same file")
    assert not m.exists()


@pytest.mark.probe("11", "segment --out = --volume (same path, symlink, ..)")
def test_segment_refuses_output_equal_to_input(capsys, tmp_path, ct_sm_path, no_model_load):
    ct = tmp_path / "ct.nii.gz"
    ct.write_bytes(ct_sm_path.read_bytes())
    link = tmp_path / "alias.nii.gz"
    link.symlink_to(ct)
    for out in (ct, link, tmp_path / "x" / ".." / "ct.nii.gz"):
        (tmp_path / "x").mkdir(exist_ok=True)
        code, _, err = run_cli(capsys, "segment", "--volume", ct, "--query", "liver", "--preset", "tiny",
                            "--out", out, "--overwrite")
        one_line(code, err, "is the input --volume")
    assert ct.read_bytes() == ct_sm_path.read_bytes()


@pytest.mark.probe("11", "propagate --anchor-out = --anchor")
def test_propagate_refuses_anchor_out_over_anchor(capsys, tmp_path, ct_sm_path):
    a = tmp_path / "a.anchor.json"
    a.write_text(json.dumps(ANCHOR))
    code, _, err = run_cli(capsys, "propagate", "--volume", ct_sm_path, "--anchor", a, "--random-weights", "0",
                        "--out", tmp_path / "m.nii.gz", "--anchor-out", a, "--overwrite")
    one_line(code, err, "is the input --anchor")
    assert json.loads(a.read_text()) == ANCHOR


@pytest.mark.probe("12", "parent is a file; .txt mask; .jpg QC")
def test_output_problems_found_before_the_work(capsys, tmp_path, ct_sm_path, no_model_load):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = run_cli(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", afile / "m.nii.gz")
    one_line(code, err, "cannot write", "is a file, not a folder")
    code, _, err = run_cli(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", tmp_path / "new" / "deeper" / "m.txt")
    one_line(code, err, "unsupported mask type")
    assert not (tmp_path / "new").exists()  # refused before any folder was made
    code, _, err = run_cli(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", tmp_path / "m.nii.gz", "--qc", tmp_path / "qc.jpg")
    one_line(code, err, "unsupported QC picture type")


@pytest.mark.probe("12", "permission denied (simulated EACCES)")
def test_permission_denied_is_one_clear_line(capsys, tmp_path, ct_sm_path, monkeypatch, no_model_load):
    import tempfile as tempfile_mod

    from medvolcore import fileio

    real = tempfile_mod.mkstemp

    def denied(*a, dir=None, **k):
        if dir is not None and Path(dir) == tmp_path / "ro":
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(*a, dir=dir, **k)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(fileio.tempfile, "mkstemp", denied)
    code, _, err = run_cli(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", tmp_path / "ro" / "m.nii.gz")
    one_line(code, err, f"cannot write {tmp_path / 'ro' / 'm.nii.gz'}: permission denied")


@pytest.fixture
def read_only_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:  # root ignores modes
        pytest.skip("cannot make a folder read-only for root here (no chattr +i)")
    yield d
    subprocess.run(["chattr", "-i", str(d)], capture_output=True)


@pytest.mark.probe("12", "read-only folder (chattr +i / chmod 555)")
def test_real_read_only_folder(capsys, read_only_dir, ct_sm_path, no_model_load):
    code, _, err = run_cli(capsys, "segment", "--volume", ct_sm_path, "--query", "liver", "--preset", "tiny",
                        "--out", read_only_dir / "m.nii.gz")
    one_line(code, err, "cannot write", "m.nii.gz")
    assert os.listdir(read_only_dir) == []


@pytest.mark.probe("12", "disk full while writing (simulated ENOSPC)")
def test_disk_full_leaves_no_partial_file(capsys, tmp_path, small_ct, monkeypatch):
    import nibabel

    def full(img, path):
        Path(path).write_bytes(b"\x1f\x8b partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nibabel, "save", full)
    code, _, err = run_cli(capsys, "propagate", "--volume", small_ct[0], "--slice", "3", "--box", "30", "30", "90", "80",
                        "--random-weights", "0", "--image-size", "64", "--out", tmp_path / "m.nii.gz", "--no-progress")
    one_line(code, err, f"cannot write {tmp_path / 'm.nii.gz'}: no space left on device")
    assert os.listdir(tmp_path) == []


@pytest.mark.probe("12", "SIGTERM during the atomic rename")
def test_sigterm_during_the_write_removes_the_temporary(tmp_path, seg_sm_path):
    """SIGTERM at the moment an output is renamed into place: no hidden .part file may stay behind."""
    script = f"""
import os, sys, time
from pathlib import Path
from medvolcore import fileio
def slow_replace(src, dst):
    Path({str(tmp_path / 'writing')!r}).write_text("x")
    time.sleep(60)
fileio.os.replace = slow_replace
from medvolcore.cli import main
sys.exit(main(sys.argv[1:]))
"""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", script, "anchor", "--mask", str(seg_sm_path), "--label", "5",
                             "--out", str(out / "liver.anchor.json")], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "writing").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert (tmp_path / "writing").exists(), proc.stderr.read() if proc.poll() is not None else "no write"
    assert any(p.name.startswith(".liver.anchor.json.") for p in out.iterdir())  # the temporary exists now
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 143
    assert "terminated" in proc.stderr.read()
    assert os.listdir(out) == []


@pytest.mark.probe("12", "output path that is a folder")
def test_output_error_type_for_folder_collisions(tmp_path):
    from medvolcore.fileio import check_output

    (tmp_path / "d.nii.gz").mkdir()
    with pytest.raises(OutputError, match="is a folder"):
        check_output(tmp_path / "d.nii.gz")


# ---- second review: writers that write nothing, kill -9 -----------------------------------------------


@pytest.mark.probe("II.5", "a mask writer that silently writes nothing (CLI)")
def test_a_writer_that_writes_nothing_is_an_error_not_a_success(capsys, tmp_path, small_ct, monkeypatch):
    import nibabel

    monkeypatch.setattr(nibabel, "save", lambda img, path: None)  # as the writers did with m.Nii
    code, _, err = run_cli(capsys, "propagate", "--volume", small_ct[0], "--slice", "3", "--box", "30", "30", "90", "80",
                           "--random-weights", "0", "--image-size", "32", "--out", tmp_path / "m.nii.gz", "--no-progress")
    one_line(code, err, f"cannot write {tmp_path / 'm.nii.gz'}: the writer wrote nothing (0 bytes)")
    assert os.listdir(tmp_path) == []


def test_written_files_are_checked_before_the_rename(tmp_path):
    from medvolcore.fileio import atomic_path, write_text_atomic

    for name, data, needle in [("m.nii.gz", b"\x1f\x8b not a nifti", "cannot be read back"),
                               ("m.nrrd", b"NRRD0004\nbroken", "cannot be read back"),
                               ("qc.png", b"GIF89a", "not a PNG")]:
        with pytest.raises(OutputError, match=needle), atomic_path(tmp_path / name) as tmp:
            tmp.write_bytes(data)
        assert os.listdir(tmp_path) == []
    write_text_atomic(tmp_path / "empty.txt", "")  # text is checked to be what was written: empty is fine
    assert (tmp_path / "empty.txt").read_text() == ""


@pytest.mark.probe("II.10", "kill -9 while an output is written, then the same output again")
def test_temporaries_of_a_killed_writer_are_removed_by_the_next_write(tmp_path, record_property):
    """The temporary carries its writer's pid; the next write of the same output removes those of
    dead writers on this machine, and keeps a live process's."""
    from medvolcore.fileio import atomic_path, write_text_atomic

    out = tmp_path / "m.anchor.json"
    script = ("import sys, time\nfrom medvolcore.fileio import atomic_path\n"
              f"with atomic_path({str(out)!r}) as tmp:\n"
              "    tmp.write_text('{}')\n    print(tmp.name, flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    left = proc.stdout.readline().strip()
    proc.kill()  # SIGKILL: no finally runs
    proc.wait(30)
    proc.stdout.close()
    assert left.startswith(f".m.anchor.json.{proc.pid}-") and (tmp_path / left).exists()
    before = len(os.listdir(tmp_path))
    with atomic_path(out, overwrite=True) as tmp:
        assert tmp.name.startswith(f".m.anchor.json.{os.getpid()}-")
        # another write of the same output meanwhile removes the killed writer's temporary and
        # keeps ours, a live process's
        write_text_atomic(out, "{}")
        assert (tmp_path / tmp.name).exists() and not (tmp_path / left).exists()
        tmp.write_text("{}")
    assert sorted(os.listdir(tmp_path)) == ["m.anchor.json"]
    record_property("hidden_files_after_kill_9", before)
    record_property("hidden_files_after_the_next_write", 0)


def test_outputs_get_normal_file_permissions(tmp_path):
    import os
    import stat

    from medvolcore.fileio import write_text_atomic

    p = write_text_atomic(tmp_path / "a.anchor.json", "{}")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask
