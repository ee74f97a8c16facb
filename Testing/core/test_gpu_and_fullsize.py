"""The one-command GPU check (Testing/gpu/run.sh) and the full-size benchmark's planning, on CPU.

This machine has no GPU: the check must say so and exit 0 after checking its arguments; bad
arguments are one line and exit 2 everywhere. The full-size benchmark's dry run must count the
published models' parameters (2.13 B and 4.44 B, the sizes Qwen publishes) and compute the memory
each run needs, and a run that does not fit must be skipped with one line giving both numbers.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "Testing" / "gpu" / "run.sh"


def _sh(*args, env=None):
    return subprocess.run(["bash", str(RUN), *map(str, args)], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)


def _fullsize():
    spec = importlib.util.spec_from_file_location("fullsize", REPO / "Testing" / "benchmarks" / "fullsize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_fullsize_dry_run_counts_the_published_sizes():
    r = subprocess.run([sys.executable, str(REPO / "Testing/benchmarks/fullsize.py"), "--dry-run", "--sizes", "2b", "4b"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    plan = [ln for ln in r.stdout.splitlines() if "plan:" in ln]
    assert len(plan) == 6  # 2 sizes × (fp32, bf16 grounder + one e2e on 112 slices)
    assert all("2.13 B parameters" in ln for ln in plan if "qwen3-vl-2b" in ln)
    assert all("4.44 B parameters" in ln for ln in plan if "qwen3-vl-4b" in ln)
    need = {(ln.split()[2], ln.split()[3]): float(ln.split("≈")[1].split()[0]) for ln in plan}
    # parameters × bytes + KV cache (36 layers × 8 KV heads × 128 × 4 800 tokens × K and V) + workspace:
    # fp32 adds 2 bytes per parameter and per cached value over bf16
    extra_fp32 = (4.4378e9 + 2 * 36 * 8 * 128 * 4800) * 2 / 2**30
    assert need[("qwen3-vl-4b", "fp32")] - need[("qwen3-vl-4b", "bf16")] == pytest.approx(extra_fp32, abs=0.1)
    assert 17 < need[("qwen3-vl-4b", "fp32")] < 22 and 5 < need[("qwen3-vl-2b", "bf16")] < 8
    assert "dry run: nothing was built or run" in r.stdout


def test_fullsize_skip_line_and_published_configs():
    fs = _fullsize()
    assert fs.skip_line("ground qwen3-vl-4b fp32", 19.9, 12.3, "cpu") == (
        "skipped ground qwen3-vl-4b fp32: needs ≈ 19.9 GB, 12.3 GB available (MemAvailable)")
    assert fs.skip_line("x", 5.0, 5.0, "cpu") is None
    assert "free on the GPU" in fs.skip_line("x", 80.0, 70.0, "cuda")
    table = json.loads(fs.CONFIGS.read_text())
    for name in ("qwen3-vl-2b", "qwen3-vl-4b"):
        m = table["models"][name]
        assert m["source"].startswith("https://huggingface.co/Qwen/") and m["source"].endswith("/config.json")
        assert m["vision_config"]["out_hidden_size"] == m["text_config"]["hidden_size"]
    mini = fs.published("mini")
    assert mini["text_config"]["num_hidden_layers"] == 2 and mini["text_config"]["hidden_size"] == 2048
