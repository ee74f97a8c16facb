"""What the front of ``medvol serve --http --devices`` costs and what it saves.

Starts ``medvol serve --http --preset tiny`` once as a single worker (``--device cpu``) and once
as a front with two CPU workers (``--devices cpu,cpu``), one thread per worker, and prints for each:

- ``status req/s``: ``GET /status`` on one kept-alive connection, one request at a time (through
  the front this also asks each worker for its queue);
- ``propagate overhead ms``: the median of (round trip − the worker's ``job_s``) of a small
  ``propagate`` (an 8-slice CT as the body, the mask back as ``application/gzip``): the transport's
  share, and through the front also the copy to its private file and the hop to a worker;
- ``correction round s``: the round trip of a second ``propagate`` on the same volume with a moved
  box, from the same session (the worker that holds the volume encodes 0 slices);
- through the front only, ``after the holder is killed s``: the same request once the worker that
  holds the volume was killed with SIGKILL (another worker reads and encodes it again), and
  ``slices encoded`` by each.

    PYTHONPATH=MedVolCore .venv/bin/python Testing/benchmarks/devices.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np
from transport import start  # this folder: the server as a child process, its log to a file

HERE = Path(__file__).resolve().parent
CT = HERE.parent / "data" / "totalsegmentator" / "example_ct_sm.nii.gz"
ANCHOR = {"schema": "medvol.anchor/1", "slice": 4, "boxes": [[30, 30, 90, 80]], "source": "user"}
MOVED = dict(ANCHOR, boxes=[[35, 35, 95, 85]])


class Client:
    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        self.session = None

    def call(self, method, path, body=None, headers=None):
        h = dict(headers or {})
        if self.session:
            h["X-MedVol-Session"] = self.session
        self.conn.request(method, path, body=body, headers=h)
        resp = self.conn.getresponse()
        data = resp.read()
        self.session = resp.getheader("X-MedVol-Session") or self.session
        reply = json.loads(resp.getheader("X-MedVol-Reply") or data)
        return reply

    def propagate(self, body: bytes, anchor) -> tuple:
        t = time.perf_counter()
        r = self.call("POST", "/rpc", body, {"Content-Type": "application/octet-stream", "Accept": "application/gzip",
                                             "X-MedVol-Request": json.dumps({"id": "p", "op": "propagate",
                                                                             "anchor": anchor})})
        assert r.get("ok"), r
        return time.perf_counter() - t, r["result"]


def _done(c: Client, front: bool) -> list:
    """Each worker's ``requests_done`` (the front refreshes them once a second)."""
    if not front:
        return []
    time.sleep(1.1)
    return [w["requests_done"] for w in c.call("GET", "/status")["result"]["workers"]]


def measure(args, status_requests: int, propagations: int, front: bool) -> dict:
    log_path = Path(tempfile.mkdtemp(prefix="medvol-devices-bench-")) / "serve.log"
    proc, port = start(log_path, args)
    rows = {}
    try:
        c = Client(port)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # the presets load after the ready line: not measured with them
            st = c.call("GET", "/status")["result"]
            if st["preset"] and not any(w.get("busy", True) for w in st.get("workers", [st])):
                break
            time.sleep(0.2)
        for _ in range(30):
            c.call("GET", "/status")
        t = time.perf_counter()
        for _ in range(status_requests):
            c.call("GET", "/status")
        rows["status req/s"] = round(status_requests / (time.perf_counter() - t), 1)

        img = nib.load(str(CT))
        arr = np.asarray(img.dataobj)
        over = []
        for i in range(propagations + 2):  # a new volume each time: no cache helps
            body = gzip.compress(nib.Nifti1Image(arr[:, :, 11:19] + i, img.affine).to_bytes(), 1)
            wall, res = c.propagate(body, ANCHOR)
            if i >= 2:
                over.append(wall - res["timings"]["job_s"])
        rows["propagate overhead ms"] = round(statistics.median(over) * 1000, 2)
        body = gzip.compress(nib.Nifti1Image(arr[:, :, 5:37], img.affine).to_bytes(), 1)
        wall, first = c.propagate(body, ANCHOR)
        rows["first propagate s (32 slices)"] = round(wall, 3)
        done = _done(c, front)
        wall, res = c.propagate(body, MOVED)
        rows["correction round s"] = round(wall, 3)
        rows["correction round slices encoded"] = res["slices_encoded"]
        if front:
            import psutil

            holder = next(i for i, (a, b) in enumerate(zip(done, _done(c, front))) if b != a)  # it answered
            kids = sorted(psutil.Process(proc.pid).children(), key=lambda p: p.create_time())
            kids[holder].kill()
            wall, res = c.propagate(body, MOVED)
            rows["after the holder is killed s"] = round(wall, 3)
            rows["after the holder is killed slices encoded"] = res["slices_encoded"]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--status-requests", type=int, default=1000)
    ap.add_argument("--propagations", type=int, default=10)
    ap.add_argument("--json-out", metavar="FILE")
    args = ap.parse_args(argv)
    out = {"one worker (--device cpu)": measure(["--device", "cpu"], args.status_requests, args.propagations, False),
           "front (--devices cpu,cpu)": measure(["--devices", "cpu,cpu"], args.status_requests, args.propagations,
                                                True)}
    for name, rows in out.items():
        print(name)
        for k, v in rows.items():
            print(f"  {k:44} {v}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
