"""Runs over many cases, resumable and shardable: the one loop ``medvol batch`` and ``medvol-train
evaluate`` both run (not to be confused with :mod:`medvoltrain.runs`, a training run's folder).

A run takes a list of cases in a fixed order (a manifest's rows, a split's samples) and

- keeps its **shard**: ``--shard I/N`` (:func:`parse_shard`; ``I`` counts from 1, ``1 ≤ I ≤ N``)
  takes the cases at 0-based positions ``p`` with ``p % N == I − 1`` (:func:`shard_of`): every case
  in exactly one shard, for any N, suited to a cluster job array (``--shard $((TASK_ID+1))/N``);
- **resumes**: a case whose record says it finished with the same inputs (its fingerprint: the
  settings, and for a batch what its files are now, :func:`input_state`) is skipped and its record
  read back (:func:`plan_run`);
- runs the others one by one (:func:`run_cases`): the models load once, before the first case and
  only when there is one; each case writes its outputs, then its **record** last
  (:func:`write_record`), so a run killed at any moment leaves no case that counts as finished
  without its outputs; a case that raises is **recorded as failed and the run goes on**;
- shows **progress** on stderr (:class:`RunProgress`): a bar over the shard's cases with the counts
  by status and the running case's stage and time left, or one line per case in a log file;
- hands the cases' rows to the caller's **summaries**, which aggregate columns by one rule
  (:func:`column_stats`: the mean and median of the finite values) and count statuses
  (:func:`status_counts`).

What one case is — where its record lives, what it holds, how it runs and how it fails — is the
caller's :class:`CaseKeeper` (:mod:`medvolcore.batch.case`, :mod:`medvoltrain.evaluate`). Nothing
here imports a model, numpy or a front door.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import stat
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

from .errors import InputError
from .fileio import write_text_atomic
from .progress import Progress, StageClock, clock_text

log = logging.getLogger(__name__)

Shard = Tuple[int, int]
SHARD_HELP = "run only shard I of N: the cases at 0-based positions p with p %% N == I-1 (I counts from 1), e.g. 2/4"
_SHARD_RULE = "--shard must be I/N with 1 ≤ I ≤ N (shards count from 1: 1/4 is the first of 4)"


# ---- shards --------------------------------------------------------------------------------------

def parse_shard(spec) -> Optional[Shard]:
    """``"2/4"`` (or ``(2, 4)``) → ``(2, 4)``; None → None (the whole run). ``I`` counts from 1,
    ``1 ≤ I ≤ N``; anything else is one :class:`InputError` line, and ``0/N`` says that the old
    0-based ``medvol-train evaluate --shard`` is now ``1/N``."""
    if spec is None:
        return None
    i = n = None
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in spec):
            i, n = spec
    else:
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(spec))
        if m:
            i, n = int(m.group(1)), int(m.group(2))
    text = f"{i}/{n}" if i is not None else repr(spec)
    if i == 0 and n is not None and n >= 1:
        raise InputError(f"{_SHARD_RULE}, got {text} (medvol-train evaluate used to count from 0: its old 0/{n} "
                         f"is 1/{n} now, and each old I/N is (I+1)/N)")
    if i is None or n < 1 or not 1 <= i <= n:
        raise InputError(f"{_SHARD_RULE}, got {text}")
    return i, n


def shard_text(shard: Optional[Shard]) -> Optional[str]:
    """``"I/N"``, or None without a shard."""
    return None if shard is None else f"{shard[0]}/{shard[1]}"


def in_shard(position: int, shard: Optional[Shard]) -> bool:
    """Whether the case at 0-based ``position`` belongs to shard ``(I, N)``: ``position % N == I - 1``."""
    return shard is None or position % shard[1] == shard[0] - 1


def shard_of(items: Sequence, shard: Optional[Shard], position: Optional[Callable[[object], int]] = None) -> list:
    """The items of shard ``(I, N)``, in order; ``position(item)`` is its 0-based position in the
    whole run (default: its index in ``items``)."""
    if position is None:
        return [x for p, x in enumerate(items) if in_shard(p, shard)]
    return [x for x in items if in_shard(position(x), shard)]


# ---- inputs and records ---------------------------------------------------------------------------



def _data_files_state(header: Path) -> Optional[list]:
    """Size and ``mtime_ns`` of every data file a detached header names, as its reader finds them
    (:func:`medvolcore.sources.declared_data_files`: one name, ``LIST``, a numbered pattern, the
    NRRD ``data file``/``datafile`` and MetaImage ``ElementDataFile`` fields); None for a file
    holding its voxels; a data file missing now has no size (the case then fails when it runs)."""
    from .errors import MedVolError
    from .sources import declared_data_files

    try:
        _, names = declared_data_files(header)
    except (OSError, MedVolError):
        return None
    if names is None:
        return None
    out = []
    for name in names:
        f = Path(name) if os.path.isabs(name) else header.parent / name
        try:
            fst = os.stat(f)
            out.append([name, fst.st_size, fst.st_mtime_ns])
        except OSError:
            out.append([name, None, None])
    return out


def input_state(path: Optional[Path]) -> Optional[dict]:
    """What an input file or DICOM folder is now, cheaply (no pixel is read), for a case's
    fingerprint: a file's size and ``mtime_ns`` (symbolic links followed; every data file a
    detached header names, ``.mhd``/``.nhdr``, as well); a folder's file count and a sha256 over its files' names,
    sizes and ``mtime_ns``. None when the path does not exist (the case then fails when it runs)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        h = hashlib.sha256()
        n = 0
        try:
            with os.scandir(path) as it:
                entries = sorted((e.name, e.stat()) for e in it if e.is_file())
        except OSError:
            return None
        for name, est in entries:
            n += 1
            h.update(f"{name}\0{est.st_size}\0{est.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
        return {"files": n, "sha256": h.hexdigest()}
    state = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if str(path).lower().endswith((".mhd", ".nhdr")):
        state["data"] = _data_files_state(Path(path))
    return state


def read_record(path: Path) -> Optional[dict]:
    """A case's record (a JSON object), or None when it is missing, unreadable or not an object."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def write_record(path: Path, record: dict, indent: int = 2, default: Optional[Callable] = None) -> Path:
    """Write a case's record atomically (its folder made first); a case writes it after its outputs."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(record, indent=indent, default=default) + "\n", overwrite=True)


def one_line(text) -> str:
    """``text`` with every run of white space (newlines included) as one space."""
    return " ".join(str(text).split())


# ---- the run --------------------------------------------------------------------------------------

class CaseKeeper(Protocol):
    """What one kind of case is to a run. A row is a dict with at least ``status``."""

    def name(self, case) -> str:
        """The case's name in the progress display and the log."""

    def previous(self, case) -> Optional[dict]:
        """The record of this case when it finished with the same fingerprint (it is then skipped),
        else None (also when the run redoes every case)."""

    def run(self, case, progress: Optional[Progress]) -> dict:
        """Run the case (its leftovers removed first), write its outputs and then its record; its row."""

    def failed(self, case, error: Exception, seconds: float) -> dict:
        """Record a case whose :meth:`run` raised ``error`` after ``seconds``; its row."""


@dataclass
class RunPlan:
    """This shard's cases (``mine``, in order), those finished before (``done_before``: name → record)
    and those to run, in order."""

    mine: list
    done_before: Dict[str, dict] = field(default_factory=dict)
    to_run: list = field(default_factory=list)


def plan_run(mine: Sequence, keeper: CaseKeeper, runnable: Callable[[object], bool] = lambda case: True) -> RunPlan:
    """Split this shard's cases into those finished before (:meth:`CaseKeeper.previous`) and those
    to run; a case that is not ``runnable`` (refused by a check before the run) is in neither."""
    plan = RunPlan(mine=list(mine))
    for case in plan.mine:
        if not runnable(case):
            continue
        rec = keeper.previous(case)
        if rec is not None:
            plan.done_before[keeper.name(case)] = rec
        else:
            plan.to_run.append(case)
    return plan


@dataclass
class RunOutcome:
    rows: List[dict]  # the cases run, in order
    load_s: float = 0.0  # seconds spent loading the models


def run_cases(cases: Sequence, keeper: CaseKeeper, *, load: Optional[Callable[[], object]] = None,
              display: Optional["RunProgress"] = None, on_case: Optional[Callable[[dict], None]] = None) -> RunOutcome:
    """Run ``cases`` in order through ``keeper``. ``load`` is called once, before the first case and
    only when there is one: a model that cannot load stops the run there, before any case is
    recorded. A case that raises an :class:`Exception` is handed to :meth:`CaseKeeper.failed` and the
    run goes on; an interruption (Ctrl-C, SIGTERM turned into an exception) stops it, leaving the
    cases finished so far recorded. ``on_case`` is called with each row."""
    load_s = 0.0
    if cases and load is not None:
        t = time.perf_counter()
        load()
        load_s = time.perf_counter() - t
    rows: List[dict] = []
    if display is not None:
        display.start(len(cases))
    try:
        for case in cases:
            name = keeper.name(case)
            progress = display.case(name) if display is not None else None
            t0 = time.perf_counter()
            try:
                row = keeper.run(case, progress)
            except Exception as e:  # noqa: BLE001 - one case's failure must not stop the run
                log.debug("case %s failed", name, exc_info=True)
                row = keeper.failed(case, e, round(time.perf_counter() - t0, 3))
            rows.append(row)
            if display is not None:
                display.finished(name, row["status"], time.perf_counter() - t0, row)
            if on_case is not None:
                on_case(row)
    finally:
        if display is not None:
            display.close()
    return RunOutcome(rows=rows, load_s=load_s)


class RunProgress:
    """What a run shows on stderr: a bar over this shard's cases (those finished before counted
    in), the counts by status (``statuses``, in that order) and the running case's stage with its
    time left (:class:`~medvolcore.progress.StageClock`, from the segment job's progress events);
    when stderr is not a terminal (a cluster job's log) one line per finished case instead, with
    the run's time left at the pace so far. ``note(row)``: a few words on a finished case (e.g. its
    Dice). ``enabled=False`` shows nothing."""

    def __init__(self, name: str, total: int, statuses: Sequence[str], before: Iterable[str] = (), *,
                 enabled: bool = True, note: Optional[Callable[[dict], str]] = None):
        self.name, self.total, self.statuses, self.enabled, self.note = name, total, tuple(statuses), enabled, note
        self.counts = Counter({s: 0 for s in self.statuses})
        self.counts.update(before)
        self.bar = None
        self.lines = False
        self.todo = self.ran = 0
        self.t_start = 0.0
        self.last_note = ""

    def start(self, todo: int) -> None:
        self.todo, self.ran, self.t_start = todo, 0, time.perf_counter()
        if not self.enabled:
            return
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, initial=sum(self.counts.values()), desc=self.name, unit="case",
                        file=sys.stderr, dynamic_ncols=True, smoothing=0.1, disable=None,  # None: no bar off a terminal
                        bar_format="{desc}: {n_fmt}/{total_fmt}|{bar}| {elapsed}<{remaining}{postfix}")
        if self.bar.disable:  # a log file: one line per case instead
            self.bar = None
            self.lines = True
        self._show()

    def counts_text(self) -> str:
        return ", ".join(f"{s} {self.counts[s]}" for s in self.statuses)

    def _show(self, case_name: str = "", stage: str = "") -> None:
        if self.bar is None:
            return
        text = self.counts_text() + (f" | {self.last_note}" if self.last_note and not case_name else "")
        if case_name:
            text += f" | {case_name} {stage}"
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.refresh()

    def case(self, case_name: str) -> Optional[Progress]:
        """The progress callback of the case about to run (None when nothing shows it)."""
        if self.bar is None:
            return None
        self._show(case_name, "starting")
        clock, last = StageClock(), [0.0]

        def progress(stage: str, fraction: float, message: str = "") -> None:
            _, eta, _ = clock.update(stage, fraction)
            now = time.monotonic()
            if now - last[0] > 0.5:
                last[0] = now
                self._show(case_name, f"{stage} {int(100 * fraction)}%" + (f", {clock_text(eta)} left" if eta else ""))

        return progress

    def finished(self, case_name: str, status: str, seconds: float, row: Optional[dict] = None) -> None:
        self.ran += 1
        self.counts[status] += 1
        note = self.note(row) if self.note is not None and row is not None else ""
        if self.bar is not None:
            self.last_note = note
            self.bar.update(1)
            self._show()
        elif self.lines:
            left = (time.perf_counter() - self.t_start) / self.ran * (self.todo - self.ran)
            sys.stderr.write(f"{self.name}: [{sum(self.counts.values())}/{self.total}] {case_name} {status} "
                             f"({seconds:.1f} s{', ' + note if note else ''}); {self.counts_text()}, "
                             f"about {left / 60:.1f} min left\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# ---- summaries ------------------------------------------------------------------------------------

def finite(v) -> Optional[float]:
    """A finite number as a float, or None (missing, text, a bool, NaN: nothing to aggregate)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def mean_median(values: Iterable) -> Tuple[Optional[float], Optional[float], int]:
    """``(mean, median, n)`` of the finite numbers among ``values`` (:func:`finite`; the others are
    left out); mean and median None when there is none. Unrounded."""
    v = [x for x in (finite(x) for x in values) if x is not None]
    if not v:
        return None, None, 0
    return statistics.fmean(v), float(statistics.median(v)), len(v)


def column_stats(rows: Iterable[dict], columns: Sequence[str],
                 value: Callable[[dict, str], object] = lambda row, column: row.get(column)) -> Dict[str, dict]:
    """Per column, ``{"mean", "median", "n"}`` of ``value(row, column)`` over the rows
    (:func:`mean_median`: the rows without a finite number there are left out)."""
    rows = list(rows)
    out = {}
    for column in columns:
        mean, median, n = mean_median(value(r, column) for r in rows)
        out[column] = {"mean": mean, "median": median, "n": n}
    return out


def status_counts(rows: Iterable[dict], statuses: Sequence[str]) -> Dict[str, int]:
    """How many rows have each of ``statuses`` (in that order)."""
    c = Counter(r["status"] for r in rows)
    return {s: c[s] for s in statuses}


__all__ = ["Shard", "SHARD_HELP", "parse_shard", "shard_text", "in_shard", "shard_of", "input_state", "read_record",
           "write_record", "one_line", "Progress", "CaseKeeper", "RunPlan", "plan_run", "RunOutcome", "run_cases",
           "RunProgress", "finite", "mean_median", "column_stats", "status_counts"]
