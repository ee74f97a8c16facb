"""The one-command GPU check (``Testing/gpu/run.sh``) on a machine without a GPU.

The check must say so and exit 0 after checking its arguments (writing nothing); bad arguments
are one line and exit 2; without the project's virtual environment it says how to make it.
"""

from __future__ import annotations

import json
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


# ---- the kit for a bare, offline GPU machine: Testing/gpu/device.sh and wheels.sh ----------------

DEVICE = REPO / "Testing" / "gpu" / "device.sh"
WHEELS = REPO / "Testing" / "gpu" / "wheels.sh"


def _bash(script, *args, env=None):
    import os
    import sys

    e = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    return subprocess.run(["bash", str(script), *map(str, args)], capture_output=True, text=True, cwd=REPO,
                          env=e, timeout=120)


def test_device_dry_run_lists_every_check_in_priority_order(tmp_path):
    r = _bash(DEVICE, "--dry-run", "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "device cuda, budget 420 s" in lines[0]
    assert [ln.split()[0] for ln in lines[1:]] == ["cuda", "query4b", "query2b", "compile", "train", "agreement"]
    assert "qwen3-vl-4b + MedSAM2 512, CT (512, 512, 300)" in r.stdout
    assert "qwen3-vl-2b with LoRA" in r.stdout and "torch.compile off and on" in r.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing and installs nothing


def test_device_report_goes_to_out_when_set_and_bad_budget_is_one_line(tmp_path):
    r = _bash(DEVICE, "--dry-run", "--small", "--device", "cpu", env={"OUT": str(tmp_path)})
    assert r.returncode == 0 and f"report {tmp_path}/report.json" in r.stdout
    assert "mini + MedSAM2 256, CT (128, 128, 40)" in r.stdout
    r = _bash(DEVICE, "--dry-run", "--budget", "0")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "device check: error: --budget must be positive, got 0 (see --help)"]


def test_wheels_check_passes_on_the_built_wheels():
    if not any((REPO / ".gpu-wheels").glob("*.whl")):
        pytest.skip(".gpu-wheels/ is not built here (bash Testing/gpu/wheels.sh; the wheels are not committed)")
    r = _bash(WHEELS, "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("0 problem(s)")


def _wheel(folder, name, version, requires):
    import zipfile

    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *(f"Requires-Dist: {q}" for q in requires)]) + "\n\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)


def test_wheels_check_finds_a_missing_dependency_and_a_version_clash(tmp_path):
    for name in ("sam2", "hydra-core", "omegaconf", "antlr4-python3-runtime", "iopath", "nibabel", "xgrammar",
                 "trl", "datasets", "medvolcore"):
        _wheel(tmp_path, name, "1.0", [])
    _wheel(tmp_path, "medvoltrain", "1.0", ["no-such-package>=1", "torch>=9; python_version >= '3.12'",
                                             "windows-only; sys_platform == 'win32'"])
    r = _bash(WHEELS, "--check", env={"WHEELS_DIR": str(tmp_path)})
    assert r.returncode == 1
    problems = [ln for ln in r.stdout.splitlines() if "needs" in ln]
    assert len(problems) == 2, r.stdout  # the Windows-only need is not the machine's
    assert "no-such-package>=1: neither a wheel nor on the machine" in problems[0]
    assert "torch>=9" in problems[1] and "the machine has 2.11.0" in problems[1]
    (tmp_path / "sam2-1.0-py3-none-any.whl").unlink()
    r = _bash(WHEELS, "--check", env={"WHEELS_DIR": str(tmp_path)})
    assert "sam2: imported by device.sh, neither a wheel nor on the machine" in r.stdout


@pytest.mark.probe("55.5", "the GPU check's child crashes after an earlier run left a PASS behind")
def test_a_crashed_check_is_fail_and_out_holds_only_this_run(tmp_path):
    """A check whose process dies is FAIL, even where an earlier run's result lies in a folder the
    check used before; ``$OUT`` holds only this run's report and log."""
    import os
    import sys

    for old in (Path("/tmp/medvol-device-check"), tmp_path / "out" / "work"):  # where earlier versions worked
        old.mkdir(parents=True, exist_ok=True)
        (old / "cuda.json").write_text('{"status": "PASS", "detail": "an earlier run"}')
    crash = tmp_path / "crash"
    crash.mkdir()
    (crash / "sitecustomize.py").write_text("import os, sys\nif '--child' in sys.argv:\n    os._exit(3)\n")
    out = tmp_path / "out"
    (out / "stale.log").write_text("")  # not the check's: left alone
    env = dict(os.environ, OUT=str(out), PYTHONPATH=f"{crash}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, str(REPO / "Testing" / "gpu" / "device.py"), "--only", "cuda", "--device",
                        "cpu", "--budget", "60"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    report = json.loads((out / "report.json").read_text())
    assert r.returncode == 1, r.stdout + r.stderr
    assert report["checks"]["cuda"]["status"] == "FAIL" and "exit 3" in report["checks"]["cuda"]["detail"]
    assert sorted(p.name for p in out.iterdir() if p.name != "work") == ["cuda.log", "report.json", "stale.log"]


def test_device_sh_makes_its_folder_with_mktemp():
    text = DEVICE.read_text()
    assert "mktemp -d" in text and "rm -rf \"$site\"" in text.replace("'", "\"")
    assert "/tmp/medvol-device-site\"" not in text  # no fixed, shared name
