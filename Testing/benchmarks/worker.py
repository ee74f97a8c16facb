#!/usr/bin/env python3
"""Benchmark of the persistent worker (``medvol serve --stdio``, protocol 1).

Starts one worker as a child process (as Slicer does) and measures, from the client's side:
the first ``segment`` (model loading, reading the volume and the job), the second ``segment``
on the same volume (models loaded, volume cached: only the job), and how long ``status``
takes to be answered while a ``segment`` runs (median and max of several).

    .venv/bin/python Testing/benchmarks/worker.py [--volume CT] [--query Q] [--preset tiny] [--device cpu]
                                                  [--threads N] [--status-probes 5] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CT = REPO / "Testing" / "data" / "totalsegmentator" / "example_ct_sm.nii.gz"


class Client:
    def __init__(self, device: str, threads=None):
        cmd = [sys.executable, "-m", "medvolcore.cli_serve", "--stdio", "--device", device]
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(cmd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.q: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.q.put((time.perf_counter(), json.loads(line)))
        self.q.put((time.perf_counter(), None))

    def send(self, obj) -> float:
        t = time.perf_counter()
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()
        return t

    def wait(self, rid, on_event=None):
        while True:
            t, msg = self.q.get(timeout=3600)
            if msg is None:
                raise SystemExit("the worker exited")
            if "event" in msg:
                if on_event:
                    on_event(msg)
                continue
            if msg.get("id") == rid:
                return t, msg

    def close(self):
        self.send({"id": "bye", "op": "shutdown"})
        self.proc.wait(60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--volume", default=str(DEFAULT_CT))
    ap.add_argument("--query", default="the organ that secretes bile")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, help="CPU threads of the worker (default: its own, all cores but one)")
    ap.add_argument("--status-probes", type=int, default=5)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)

    c = Client(args.device, args.threads)
    t = c.send({"id": "hello", "op": "hello"})
    t_hello, _ = c.wait("hello")
    rows, res = [], {"preset": args.preset, "device": args.device, "volume": args.volume,
                     "hello_s": t_hello - t}
    for i in (1, 2):
        req = {"id": f"seg{i}", "op": "segment", "volume": args.volume, "query": args.query, "preset": args.preset}
        t = c.send(req)
        t_end, msg = c.wait(req["id"])
        if not msg["ok"]:
            raise SystemExit(f"segment failed: {msg['error']}")
        tm = msg["result"]["timings"]
        rows.append({"request": f"segment #{i}", "wall_s": t_end - t, "load_s": tm["load_s"],
                     "volume_cached": tm["volume_cached"], "ground_s": tm.get("ground_s"),
                     "propagate_s": tm.get("propagate_s")})

    # status while a segment runs: probe once the job is under way
    probes = []
    c.send({"id": "seg3", "op": "segment", "volume": args.volume, "query": args.query})
    while True:  # wait for the first event of seg3
        _, msg = c.q.get(timeout=3600)
        if msg and msg.get("id") == "seg3" and "event" in msg:
            break
    for k in range(args.status_probes):
        rid = f"st{k}"
        t = c.send({"id": rid, "op": "status"})
        t_end, msg = c.wait(rid)
        probes.append({"s": t_end - t, "busy": msg["result"]["busy"]})
        time.sleep(0.2)
    c.wait("seg3")
    c.close()

    busy = [p["s"] for p in probes if p["busy"]]
    res.update(rows=rows, status_probes=probes,
               status_while_busy_median_s=statistics.median(busy) if busy else None,
               status_while_busy_max_s=max(busy) if busy else None)
    print(f"medvol serve --stdio, preset {args.preset}, device {args.device}, volume {Path(args.volume).name}")
    print(f"{'request':<22}{'wall s':>9}{'load s':>9}{'ground s':>10}{'prop s':>9}  volume cached")
    for r in rows:
        print(f"{r['request']:<22}{r['wall_s']:>9.2f}{r['load_s']:>9.2f}{(r['ground_s'] or 0):>10.2f}"
              f"{(r['propagate_s'] or 0):>9.2f}  {r['volume_cached']}")
    if busy:
        print(f"{'status while busy':<22}{statistics.median(busy) * 1000:>8.1f} ms median, "
              f"{max(busy) * 1000:.1f} ms max over {len(busy)} probes")
    else:
        print("status while busy: the segment ended before a probe; use a larger volume")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
