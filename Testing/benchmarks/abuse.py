"""Replay every hostile-input probe and print probe → outcome, with the figures.

    .venv/bin/python Testing/benchmarks/abuse.py [--quick] [--json-out FILE] [-- PYTEST ARGS]

Runs every test of ``Testing/core`` (and of the ``Testing/training`` files holding one) marked ``@pytest.mark.probe(item, text)`` (each is one probe,
tagged with its hardening item: "1" … "13" for the first review's, "II.1" … "II.11" for the
second's, "43.1" … "43.6" for the third's, "55.1" … "55.10" for the fourth's (headers, refused
bodies, random requests, sessions behind the front, the GPU check, prepare, nginx, paths, SIGTERM); ``test_serve_probes.py``, ``test_volume_probes.py``, ``test_dicom.py``, ``test_fileio.py``, …)
including the heavy probes the test suite skips (200 slow
clients; a decompression bomb under the default ``--max-voxels``, cancelled), and prints one row
per probe: item, what was sent, outcome (refused/handled as required = PASS), seconds of the
probe itself, and the figures it recorded (memory, connections held, seconds to refuse). Every
server it starts listens on 127.0.0.1 only. ``--quick`` leaves the heavy probes out. Exit code 0
when every probe passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "core"


class ProbeTable:
    """A pytest plugin that keeps, per probe test, its item, text, outcome, duration and figures."""

    def __init__(self):
        self.rows = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        mark = item.get_closest_marker("probe")
        if mark is None:
            return
        row = self.rows.setdefault(item.nodeid, {
            "item": mark.args[0], "probe": mark.args[1], "test": item.name, "outcome": "?", "seconds": 0.0,
            "figures": {}})
        if report.when == "call":
            row["seconds"] = round(report.duration, 2)
            row["outcome"] = "PASS" if report.passed else "FAIL"
            row["figures"].update({k: v for k, v in report.user_properties})
            if report.failed:
                row["detail"] = str(report.longrepr).strip().splitlines()[-1][:160]
        elif report.skipped and row["outcome"] == "?":
            row["outcome"] = "skip"
        elif report.failed:  # setup or teardown
            row["outcome"] = "ERROR"
            row["detail"] = str(report.longrepr).strip().splitlines()[-1][:160]


def _item_key(row):
    """Sort the first review's items ("1" … "13") before the second's ("II.1" … "II.11"), then
    issue items ("26.6": issue 26, item 6)."""
    item = str(row["item"])
    if item.startswith("II."):
        return (2, int(item[3:]), row["test"])
    if "." in item:
        return (3, tuple(int(v) for v in item.split(".")), row["test"])
    return (1, int(item), row["test"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="leave out the heavy probes (200 clients, 1 GB bomb)")
    ap.add_argument("--json-out", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    if not args.quick:
        os.environ["MEDVOL_HEAVY_PROBES"] = "1"
    table = ProbeTable()
    # training probes (e.g. 43.2) live in Testing/training: only its files that hold one are run
    training = [str(p) for p in sorted((HERE.parent / "training").glob("test_*.py"))
                if "mark.probe" in p.read_text(encoding="utf-8")]
    code = pytest.main([str(TESTS), *training, "-m", "probe", "-q", "-p", "no:cacheprovider",
                        "-c", str(HERE.parent / "pytest.ini"), *args.pytest_args], plugins=[table])
    rows = sorted(table.rows.values(), key=_item_key)
    print()
    print(f"{'item':>5}  {'outcome':7} {'s':>6}  probe / figures")
    for r in rows:
        figs = "; ".join(f"{k} {v}" for k, v in r["figures"].items())
        name = r["probe"] + (f" [{r['test'].split('[', 1)[1]}" if "[" in r["test"] else "")
        print(f"{r['item']:>5}  {r['outcome']:7} {r['seconds']:6.2f}  {name}")
        if figs:
            print(f"{'':22}{figs}")
        if r.get("detail"):
            print(f"{'':22}{r['detail']}")
    n_pass = sum(r["outcome"] == "PASS" for r in rows)
    print(f"\n{n_pass} of {len(rows)} probes passed" + (" (heavy probes left out)" if args.quick else ""))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0 if code == 0 and n_pass == len([r for r in rows if r["outcome"] != "skip"]) else 1


if __name__ == "__main__":
    sys.exit(main())
