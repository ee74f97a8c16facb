"""The CPU decisions, made in one place: how many threads the models use, and whether the grounder
runs in bfloat16 on this CPU.

**Threads** (:func:`choose_threads`, applied by :func:`apply_threads`). In order:

1. ``--threads N`` (or a worker's ``threads`` setting) when given;
2. else ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` when set (the smaller if both are);
3. else the CPUs this process may use — its CPU affinity (``os.sched_getaffinity``), capped by the
   cgroup CPU quota (``cpu.max`` of cgroup v2, ``cpu.cfs_quota_us`` of v1) and by the physical cores
   among those CPUs (two hyper-threads of one core count once) — less the CPUs that other work is
   keeping busy right now (measured over 0.1 s from ``/proc/stat``, on the usable CPUs only; a CPU
   counts when it is more than half busy on average), less ``reserve`` (the worker leaves one to the
   application that drives it when it has more than two), and never fewer than one.

Why: PyTorch's default is one thread per logical CPU, and its OpenMP threads spin while they wait
for each other. On a CPU shared with other work (Slicer, a browser, another job) that default
collapses: a demo run took 11 times longer beside two busy processes on a 2-core machine than with
one thread. The decision is made once, when a command starts; a long-running worker keeps it.

**bf16 on the CPU** (:func:`cpu_bf16_fast`): the grounder runs in bfloat16 on a CPU only when
PyTorch's oneDNN reports bf16 support (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) *and* the
CPU has bf16 arithmetic in hardware (AVX-512 BF16 or AMX-BF16, from the CPU's flags); otherwise fp32.
Without those instructions bf16 matrix products are emulated and slower than fp32 (ten times slower
on an AVX2-only CPU here).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

from .errors import InputError

log = logging.getLogger(__name__)

ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
BUSY_SAMPLE_S = 0.1
MAX_THREADS = 512


@dataclass(frozen=True)
class ThreadPlan:
    """What :func:`choose_threads` decided, and from what."""

    threads: int
    source: str  # "option", "environment" or "auto"
    usable: int  # CPUs this process may use (affinity, cgroup quota)
    physical: int  # physical cores among them
    busy: int  # of them, kept busy by other work when decided
    reserve: int = 0

    def describe(self) -> str:
        if self.source == "option":
            return f"{self.threads} CPU thread(s), as asked"
        if self.source == "environment":
            return f"{self.threads} CPU thread(s), from {'/'.join(ENV_VARS)}"
        extra = f", {self.reserve} left to the application" if self.reserve else ""
        return (f"{self.threads} CPU thread(s): {self.physical} core(s) usable, {self.busy} busy with other "
                f"work{extra}")

    def to_dict(self) -> dict:
        return asdict(self)


def threads_arg(text: str):
    """argparse type of ``--threads``: a whole number ≥ 1, or ``auto`` (→ None)."""
    import argparse

    if str(text).strip().lower() == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number ≥ 1 or 'auto', got {text!r}") from None
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be 1..{MAX_THREADS} or 'auto', got {n}")
    return n


def check_threads(value, what: str = "threads") -> Optional[int]:
    """``value`` as a thread count (None: decide automatically); anything else → :class:`InputError`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise InputError(f"{what} must be a whole number 1..{MAX_THREADS} (or null: automatic), got {value!r}")
    return value


# ---- what the machine offers -----------------------------------------------------------------

def allowed_cpus() -> list:
    """The CPU ids this process may run on (its affinity; all CPUs where that is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> Optional[float]:
    """CPUs the cgroup quota allows (e.g. 1.5), or None when there is no quota or it is unknown."""
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        if text:
            return None
    except (OSError, ValueError, IndexError, ZeroDivisionError):
        pass
    try:  # cgroup v1
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError, ZeroDivisionError):
        return None


def physical_cores(cpus: Iterable[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """How many physical cores ``cpus`` are on (hyper-threads of one core counted once); the number
    of CPUs where the topology cannot be read."""
    cpus = list(cpus)
    cores = set()
    for c in cpus:
        topo = sysfs / f"cpu{c}" / "topology"
        try:
            cores.add((topo / "physical_package_id").read_text().strip() + ":" + (topo / "core_id").read_text().strip())
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def _cpu_times(stat: Path):
    out = {}
    for line in stat.read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *vals = line.split()
            v = [int(x) for x in vals]
            idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
            out[int(name[3:])] = (sum(v[:8]), idle)
    return out


def busy_cpus(cpus: Iterable[int], interval: float = BUSY_SAMPLE_S, stat: Path = Path("/proc/stat")) -> int:
    """How many of ``cpus`` other work keeps busy: the CPUs more than half busy over ``interval``
    seconds (this process sleeps meanwhile, so its own work is not counted); 0 where unknown."""
    try:
        a = _cpu_times(stat)
        time.sleep(interval)
        b = _cpu_times(stat)
    except (OSError, ValueError):
        return 0
    return busy_between(a, b, cpus)


_busy_memo: dict = {}
BUSY_MEMO_S = 10.0


def _recent_busy(cpus: list) -> int:
    """:func:`busy_cpus`, measured at most once per ``BUSY_MEMO_S`` seconds for the same CPUs (one
    process that starts several jobs in a row samples once)."""
    key = tuple(cpus)
    now = time.monotonic()
    hit = _busy_memo.get(key)
    if hit is not None and now - hit[0] < BUSY_MEMO_S:
        return hit[1]
    busy = busy_cpus(cpus) if len(cpus) <= 256 else 0
    _busy_memo.clear()
    _busy_memo[key] = (time.monotonic(), busy)
    return busy


def busy_between(before: dict, after: dict, cpus: Iterable[int]) -> int:
    """Of ``cpus``, those more than half busy between two readings of ``/proc/stat`` (per CPU:
    ``(total jiffies, idle jiffies)``)."""
    busy = 0
    for c in cpus:
        if c in before and c in after:
            total = after[c][0] - before[c][0]
            if total > 0 and 1.0 - (after[c][1] - before[c][1]) / total > 0.5:
                busy += 1
    return busy


def env_threads(environ=None) -> Optional[int]:
    """The thread count ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` ask for (the smaller when both are
    set); None when neither holds a whole number ≥ 1."""
    environ = os.environ if environ is None else environ
    found = []
    for var in ENV_VARS:
        text = str(environ.get(var, "")).strip()
        if text.isdigit() and int(text) >= 1:
            found.append(int(text))
    return min(found) if found else None


# ---- the decision ------------------------------------------------------------------------------

def choose_threads(requested: Optional[int] = None, reserve: int = 0, environ=None) -> ThreadPlan:
    """The thread count by the rule of this module's docstring (nothing is applied)."""
    requested = check_threads(requested)
    cpus = allowed_cpus()
    usable = len(cpus)
    quota = cgroup_quota()
    if quota is not None:
        usable = max(1, min(usable, math.ceil(quota)))
    physical = max(1, min(usable, physical_cores(cpus)))
    if requested is not None:
        return ThreadPlan(requested, "option", usable, physical, 0)
    env = env_threads(environ)
    if env is not None:
        return ThreadPlan(env, "environment", usable, physical, 0)
    reserve = reserve if physical > 2 else 0
    busy = _recent_busy(cpus)
    return ThreadPlan(max(1, physical - busy - reserve), "auto", usable, physical, busy, reserve)


def apply_threads(requested: Optional[int] = None, reserve: int = 0) -> ThreadPlan:
    """Decide (:func:`choose_threads`) and set torch's thread count; returns the plan."""
    plan = choose_threads(requested, reserve)
    import torch

    torch.set_num_threads(plan.threads)
    log.info("using %s", plan.describe())
    return plan


# ---- bf16 ----------------------------------------------------------------------------------------

def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> Optional[set]:
    """The CPU's feature flags (Linux), or None where they cannot be read."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _mkldnn_bf16() -> bool:
    """PyTorch's own answer: can its oneDNN kernels run bf16 on this CPU?"""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_bf16_fast(flags: Optional[set] = None) -> bool:
    """True when this CPU computes bf16 in hardware and PyTorch can use it (see the module docstring)."""
    if not _mkldnn_bf16():
        return False
    import torch

    flags = cpu_flags() if flags is None else flags
    if flags is None:  # not Linux: trust PyTorch's answer alone only where it names AMX or AVX-512
        return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def grounder_dtype(requested: Optional[str], device) -> str:
    """The grounder's dtype name: ``requested`` (``fp32``/``bf16``) when given, else bf16 on CUDA,
    bf16 on a CPU where :func:`cpu_bf16_fast`, fp32 otherwise."""
    if requested not in (None, "auto"):
        if requested not in ("fp32", "bf16"):
            raise InputError(f"grounder dtype must be fp32, bf16 or auto, got {requested!r}")
        return requested
    kind = getattr(device, "type", str(device))
    if kind == "cuda":
        return "bf16"
    return "bf16" if cpu_bf16_fast() else "fp32"


__all__ = ["ThreadPlan", "choose_threads", "apply_threads", "threads_arg", "check_threads", "allowed_cpus",
           "cgroup_quota", "physical_cores", "busy_cpus", "busy_between", "env_threads", "cpu_flags", "cpu_bf16_fast",
           "grounder_dtype"]
