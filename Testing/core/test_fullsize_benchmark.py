"""The full-size cost benchmark's planning (``Testing/benchmarks/fullsize.py``, its sizes and
memory needs in ``Testing/reference/qwen3_vl_sizes.py``), on a CPU.

Its dry run must count the published models' parameters (2.13 B and 4.44 B, the sizes Qwen
publishes) and compute the memory each run needs, and a run that does not fit must be skipped
with one line giving both numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reference import qwen3_vl_sizes

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # builds the 2B and 4B models on the meta device
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
    fs = qwen3_vl_sizes
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
