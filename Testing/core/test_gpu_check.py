"""The one-command GPU check (``Testing/gpu/run.sh``) on a machine without a GPU.

The check must say so and exit 0 after checking its arguments (writing nothing); bad arguments
are one line and exit 2; without the project's virtual environment it says how to make it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "Testing" / "gpu" / "run.sh"


def _sh(*args, env=None):
    return subprocess.run(["bash", str(RUN), *map(str, args)], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)


def test_gpu_check_on_a_cpu_machine_says_so_and_exits_0(tmp_path):
    r = _sh("--out", tmp_path / "out", "--sizes", "2b", "--skip", "zero2")
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU here" in r.stdout and "nothing was run" in r.stdout
    assert "checks: fullsize, decoding, agreement, sft, grpo" in r.stdout  # zero2 skipped, order kept
    assert "300 slices end to end < 10 s" in r.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@pytest.mark.parametrize("args, needle", [
    (["--sizes", "7b"], "unknown size(s) 7b"),
    (["--only", "fullsize", "bogus"], "unknown check(s) bogus"),
    (["--skip", "fullsize"], "decoding check reads the fullsize"),
    (["--only", "grpo"], "grpo check starts from the sft"),
    (["--min-dice", "1.5"], "--min-dice must be between 0 and 1"),
    (["--only", "sft", "--skip", "sft"], "no check left"),
    (["--frobnicate"], "unrecognized arguments"),
])
def test_gpu_check_bad_arguments_are_one_line(args, needle):
    r = _sh(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_gpu_check_without_the_venv_says_how_to_make_it(tmp_path):
    r = _sh(env={"MEDVOL_PYTHON": str(tmp_path / "no-python"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "bootstrap.py" in r.stderr
