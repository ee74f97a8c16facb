"""The run loop ``medvol batch`` and ``medvol-train evaluate`` share (medvolcore.caseruns), with a
stand-in case keeper: shards, resume, failures recorded while the run goes on, models loaded once
and only when a case runs, the log lines of a run whose stderr is a file, and the mean/median rule."""

from __future__ import annotations

import math

import pytest

from medvolcore.caseruns import (RunProgress, column_stats, parse_shard, plan_run, read_record, run_cases, shard_of,
                                 write_record)
from medvolcore.errors import InputError


class Keeper:
    """Cases are names; ``done`` names count as finished before; ``bad`` names raise when run."""

    def __init__(self, done=(), bad=()):
        self.done, self.bad, self.ran, self.failures = set(done), set(bad), [], []

    def name(self, case):
        return case

    def previous(self, case):
        return {"status": "ok", "id": case} if case in self.done else None

    def run(self, case, progress):
        self.ran.append(case)
        if case in self.bad:
            raise RuntimeError(f"{case} is broken\nsecond line")
        return {"id": case, "status": "ok", "dsc": 0.5}

    def failed(self, case, error, seconds):
        self.failures.append((case, str(error), seconds))
        return {"id": case, "status": "error"}


def test_shards_count_from_1_and_partition_any_run():
    items = list("abcdefg")
    for n in (1, 2, 3, 7, 9):
        parts = [shard_of(items, parse_shard(f"{i}/{n}")) for i in range(1, n + 1)]
        assert sorted(x for p in parts for x in p) == items
    assert shard_of(items, (1, 3)) == ["a", "d", "g"] and shard_of(items, None) == items
    assert parse_shard((2, 3)) == (2, 3) and parse_shard(None) is None
    for bad in ("0/3", (0, 3), "4/3", "1/0", (True, 2), "2", ""):
        with pytest.raises(InputError, match="--shard must be I/N with 1 ≤ I ≤ N"):
            parse_shard(bad)


def test_a_failed_case_is_recorded_and_the_run_goes_on():
    keeper, loads, seen = Keeper(done={"a"}, bad={"c"}), [], []
    plan = plan_run(list("abcde"), keeper, runnable=lambda c: c != "e")
    assert (plan.to_run, sorted(plan.done_before)) == (["b", "c", "d"], ["a"])
    out = run_cases(plan.to_run, keeper, load=lambda: loads.append(1), on_case=seen.append)
    assert keeper.ran == ["b", "c", "d"] and loads == [1]  # loaded once, before the first case
    assert [r["status"] for r in out.rows] == ["ok", "error", "ok"] and seen == out.rows
    (case, message, seconds), = keeper.failures
    assert case == "c" and message.startswith("c is broken") and seconds >= 0


def test_nothing_to_run_loads_nothing():
    loads = []
    assert run_cases([], Keeper(), load=lambda: loads.append(1)).rows == [] and loads == []


def test_an_interruption_stops_the_run():
    class Interrupted(Keeper):
        def run(self, case, progress):
            raise KeyboardInterrupt

    keeper = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        run_cases(["a", "b"], keeper)
    assert keeper.failures == []  # not recorded as a failed case


def test_a_log_file_gets_one_line_per_case(capsys):
    keeper = Keeper(bad={"y"})
    display = RunProgress("demo 1/2", 3, ("ok", "error"), ["ok"], note=lambda r: f"DSC {r['dsc']}" if "dsc" in r else "")
    run_cases(["x", "y"], keeper, display=display)
    lines = capsys.readouterr().err.strip().splitlines()  # stderr is not a terminal here
    assert lines[0].startswith("demo 1/2: [2/3] x ok (") and "DSC 0.5); ok 2, error 0, about " in lines[0]
    assert lines[1].startswith("demo 1/2: [3/3] y error (") and lines[1].endswith("ok 2, error 1, about 0.0 min left")


def test_records_are_written_and_read_back(tmp_path):
    path = write_record(tmp_path / "a" / "done.json", {"status": "done", "x": [1, 2]})
    assert read_record(path) == {"status": "done", "x": [1, 2]}
    path.write_text("[1, 2]")
    assert read_record(path) is None and read_record(tmp_path / "missing.json") is None


def test_mean_and_median_over_finite_values_only():
    rows = [{"v": 1.0}, {"v": 2}, {"v": 10.0}, {"v": None}, {"v": math.nan}, {"v": True}, {"v": "3"}, {}]
    assert column_stats(rows, ["v", "w"]) == {"v": {"mean": 13 / 3, "median": 2.0, "n": 3},
                                              "w": {"mean": None, "median": None, "n": 0}}


@pytest.mark.probe("43.5", "--resume after an .nhdr's data files changed (LIST, numbered pattern, 'datafile:')")
@pytest.mark.parametrize("field", ["data file: LIST\nct0.raw\nct1.raw", "data file: ct%d.raw 0 1 1",
                                   "datafile: ct1.raw"])
def test_the_fingerprint_covers_every_data_file_of_a_detached_header(tmp_path, field):
    import os

    from medvolcore.caseruns import input_state

    for i in range(2):
        (tmp_path / f"ct{i}.raw").write_bytes(b"\0" * 8)
    nhdr = tmp_path / "ct.nhdr"
    nhdr.write_text("NRRD0004\ntype: short\ndimension: 3\nsizes: 2 2 1\nencoding: raw\nendian: little\n"
                    f"{field}\n")
    before = input_state(nhdr)
    (tmp_path / "ct1.raw").write_bytes(b"\1" * 8)  # same size, new content and time
    os.utime(tmp_path / "ct1.raw", ns=(7, 7))
    assert input_state(nhdr) != before
