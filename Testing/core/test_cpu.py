"""medvolcore.cpu: the one rule for CPU threads, and bf16 on the CPU only where it is fast."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from medvolcore import cpu
from medvolcore.errors import InputError


def _topology(root, cores):
    """A fake /sys/devices/system/cpu: ``cores`` maps CPU id → (package, core)."""
    for c, (pkg, core) in cores.items():
        t = root / f"cpu{c}" / "topology"
        t.mkdir(parents=True)
        (t / "physical_package_id").write_text(f"{pkg}\n")
        (t / "core_id").write_text(f"{core}\n")
    return root


def test_physical_cores_count_hyper_threads_once(tmp_path):
    sysfs = _topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1), 4: (1, 0)})
    assert cpu.physical_cores([0, 1, 2, 3, 4], sysfs) == 3  # core 0 of package 1 is another core
    assert cpu.physical_cores([0, 2], sysfs) == 1  # two threads of one core
    assert cpu.physical_cores([0, 7], sysfs) == 2  # cpu7's topology is unreadable: count CPUs


def test_cgroup_quota_v2_and_v1(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu.cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu.cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu.cgroup_quota(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu.cgroup_quota(tmp_path) is None


def test_busy_between_counts_cpus_more_than_half_busy():
    before = {0: (1000, 900), 1: (1000, 100), 2: (1000, 500)}
    after = {0: (1100, 990), 1: (1100, 110), 2: (1100, 540)}  # busy 10 %, 90 %, 60 %
    assert cpu.busy_between(before, after, [0, 1, 2]) == 2
    assert cpu.busy_between(before, after, [0, 2]) == 1  # only the CPUs this process may use
    assert cpu.busy_between(before, after, [5]) == 0


def test_env_threads():
    assert cpu.env_threads({}) is None
    assert cpu.env_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert cpu.env_threads({"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "2"}) == 2
    assert cpu.env_threads({"OMP_NUM_THREADS": "zero", "MKL_NUM_THREADS": "0"}) is None


def test_the_rule(monkeypatch):
    monkeypatch.setattr(cpu, "allowed_cpus", lambda: [0, 1, 2, 3, 4, 5, 6, 7])
    monkeypatch.setattr(cpu, "physical_cores", lambda cpus: 4)  # 8 hyper-threads on 4 cores
    monkeypatch.setattr(cpu, "cgroup_quota", lambda: None)
    monkeypatch.setattr(cpu, "_recent_busy", lambda cpus: 1)
    plan = cpu.choose_threads(environ={})
    assert (plan.threads, plan.source, plan.usable, plan.physical, plan.busy) == (3, "auto", 8, 4, 1)
    assert "4 core(s) usable, 1 busy" in plan.describe()
    assert cpu.choose_threads(reserve=1, environ={}).threads == 2  # the worker leaves one to Slicer
    monkeypatch.setattr(cpu, "cgroup_quota", lambda: 1.5)  # a container allowed 1.5 CPUs
    assert cpu.choose_threads(environ={}).threads == 1  # min(8, ceil 1.5) = 2 usable, 1 busy
    monkeypatch.setattr(cpu, "_recent_busy", lambda cpus: 6)
    monkeypatch.setattr(cpu, "cgroup_quota", lambda: None)
    assert cpu.choose_threads(environ={}).threads == 1  # never fewer than one
    assert cpu.choose_threads(reserve=1, environ={}).reserve == 1
    monkeypatch.setattr(cpu, "physical_cores", lambda cpus: 2)
    assert cpu.choose_threads(reserve=1, environ={}).reserve == 0  # no reserve on two cores
    env = cpu.choose_threads(environ={"OMP_NUM_THREADS": "6"})
    assert (env.threads, env.source) == (6, "environment")
    asked = cpu.choose_threads(5, environ={"OMP_NUM_THREADS": "6"})
    assert (asked.threads, asked.source) == (5, "option")
    with pytest.raises(InputError, match="threads must be a whole number"):
        cpu.choose_threads(0)


def test_busy_is_measured_once_in_ten_seconds(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "_busy_memo", {})
    monkeypatch.setattr(cpu, "busy_cpus", lambda cpus: calls.append(cpus) or 1)
    assert cpu._recent_busy([0, 1]) == cpu._recent_busy([0, 1]) == 1 and len(calls) == 1
    cpu._recent_busy([0])  # other CPUs: measured again
    now = time.monotonic()
    monkeypatch.setattr(cpu.time, "monotonic", lambda: now + cpu.BUSY_MEMO_S + 1)
    cpu._recent_busy([0])
    assert len(calls) == 3


def test_busy_processes_beside_it_are_seen():
    """Real /proc/stat: with a spinning process on every usable CPU, the rule takes one thread."""
    cpus = cpu.allowed_cpus()
    if len(cpus) > 4:
        pytest.skip("spins one process per usable CPU: run on small machines only")
    code = "import time\nt = time.time()\nwhile time.time() - t < 20: pass\n"
    spinners = [subprocess.Popen([sys.executable, "-c", code]) for _ in cpus]
    try:
        time.sleep(0.3)
        cpu._busy_memo.clear()
        plan = cpu.choose_threads(environ={})
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert plan.busy == len(cpus) and plan.threads == 1


def test_threads_option_on_the_cli(capsys):
    from medvolcore.cli import main

    for bad in ("0", "two", "-3"):
        with pytest.raises(SystemExit) as e:
            main(["segment", "--volume", "x.nii.gz", "--query", "q", "--out", "m.nii.gz", "--threads", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--threads" in err[0]
    assert cpu.threads_arg("auto") is None and cpu.threads_arg("4") == 4


def test_bf16_on_the_cpu_only_with_bf16_arithmetic(monkeypatch):
    import torch

    assert cpu.grounder_dtype("fp32", "cuda") == "fp32" and cpu.grounder_dtype("bf16", "cpu") == "bf16"
    assert cpu.grounder_dtype(None, torch.device("cuda")) == "bf16"
    with pytest.raises(InputError, match="fp32, bf16 or auto"):
        cpu.grounder_dtype("fp16", "cpu")
    assert cpu.cpu_bf16_fast({"avx2", "fma"}) is False
    monkeypatch.setattr(cpu, "_mkldnn_bf16", lambda: True)
    assert cpu.cpu_bf16_fast({"avx2", "avx512f"}) is False  # AVX-512 without its bf16 instructions
    assert cpu.cpu_bf16_fast({"avx512f", "avx512_bf16"}) is True
    assert cpu.cpu_bf16_fast({"amx_bf16", "amx_tile"}) is True
    monkeypatch.setattr(cpu, "_mkldnn_bf16", lambda: False)  # PyTorch cannot use it: fp32
    assert cpu.cpu_bf16_fast({"avx512f", "avx512_bf16"}) is False
    monkeypatch.setattr(cpu, "cpu_bf16_fast", lambda flags=None: False)
    assert cpu.grounder_dtype(None, "cpu") == cpu.grounder_dtype("auto", "cpu") == "fp32"
    monkeypatch.setattr(cpu, "cpu_bf16_fast", lambda flags=None: True)
    assert cpu.grounder_dtype(None, "cpu") == "bf16"


def test_this_cpu_gets_what_its_flags_say():
    flags = cpu.cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    assert cpu.cpu_bf16_fast() == (cpu._mkldnn_bf16() and bool(flags & {"avx512_bf16", "amx_bf16"}))
    assert os.cpu_count() >= len(cpu.allowed_cpus()) >= 1


def test_auto_dtype_of_the_grounder(monkeypatch):
    """auto: what medvolcore.cpu says for a real model; a smoke model stays fp32 on any CPU."""
    import torch

    from medvolcore.grounder.build import _resolve_dtype

    cpu_dev, cuda_dev = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(cpu, "cpu_bf16_fast", lambda flags=None: True)  # as on a CPU with AVX-512 BF16
    assert _resolve_dtype(None, cpu_dev, torch) is torch.bfloat16
    assert _resolve_dtype("auto", cpu_dev, torch, smoke=True) is torch.float32
    assert _resolve_dtype(None, cuda_dev, torch, smoke=True) is torch.bfloat16
    assert _resolve_dtype("fp32", cpu_dev, torch) is torch.float32 and _resolve_dtype("bf16", cpu_dev, torch,
                                                                                      smoke=True) is torch.bfloat16
    monkeypatch.setattr(cpu, "cpu_bf16_fast", lambda flags=None: False)
    assert _resolve_dtype(None, cpu_dev, torch) is torch.float32
