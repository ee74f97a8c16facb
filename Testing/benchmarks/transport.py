"""The HTTP transport of ``medvol serve --http``: requests/s, round-trip overhead, upload throughput
and the server's peak memory for a large body.

Starts ``medvol serve --http --device cpu --preset tiny`` as a child process of the Python that
runs this script (so ``PYTHONPATH=…/MedVolCore`` picks the code measured) and prints:

- ``status req/s``: ``GET /status`` on one kept-alive connection, one request at a time, once the
  preset has loaded (it loads in the worker's thread after the ready line, and a request answered
  meanwhile waits for that thread's turn at the interpreter);
- ``propagate overhead ms``: the median of (round trip − the worker's ``job_s``) of a small
  ``propagate`` (an 8-slice CT sent as the body, the mask back as ``application/gzip``), i.e. what
  the transport adds;
- ``upload MB/s``: a 157 MB uncompressed CT (512×512×300 int16) sent as the body of a request the
  worker refuses at once (``hello`` takes no volume), so the time is the transport's;
- ``peak MB for a 500 MB body``: the server's peak resident memory (VmHWM) after a 500 MB body
  (512×512×1000 int16, refused the same way), and its growth over the peak before it.

    PYTHONPATH=MedVolCore .venv/bin/python Testing/benchmarks/transport.py [--json-out FILE]
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
import time
from pathlib import Path

import nibabel as nib
import numpy as np

HERE = Path(__file__).resolve().parent
CT = HERE.parent / "data" / "totalsegmentator" / "example_ct_sm.nii.gz"
ANCHOR = {"schema": "medvol.anchor/1", "slice": 4, "boxes": [[30, 30, 90, 80]], "source": "user"}


def _vmhwm(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start(log_path: Path, args=("--device", "cpu")) -> tuple:
    """The server (``--preset tiny --threads 1`` and ``args``) as a child process, its log (one
    access line per request) going to a file; (process, port)."""
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "medvolcore.cli_serve", "--http", "--host", "127.0.0.1", "--port",
                             "0", "--preset", "tiny", "--threads", "1", *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    log.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        text = log_path.read_text(encoding="utf-8", errors="replace")
        if "ready (protocol 1) on http://127.0.0.1:" in text:
            return proc, int(text.split("http://127.0.0.1:")[1].split()[0].rstrip("/;"))
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start:\n" + log_path.read_text(encoding="utf-8", errors="replace"))


def volume_header(shape) -> bytes:
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(np.int16)
    hdr["vox_offset"] = 352
    return hdr.binaryblock + b"\0" * 4


def send_body(port: int, shape, chunk: int = 1 << 20) -> tuple:
    """Stream a zero-filled NIfTI body of ``shape`` (int16); (bytes sent, seconds, status)."""
    head = volume_header(shape)
    n = len(head) + int(np.prod(shape)) * 2
    zeros = b"\0" * chunk
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t = time.perf_counter()
    conn.putrequest("POST", "/rpc")
    conn.putheader("Content-Type", "application/octet-stream")
    conn.putheader("Content-Length", str(n))
    conn.putheader("X-MedVol-Request", json.dumps({"id": "up", "op": "hello"}))
    conn.endheaders()
    conn.send(head)
    left = n - len(head)
    while left > 0:
        conn.send(zeros[:min(chunk, left)])
        left -= min(chunk, left)
    resp = conn.getresponse()
    resp.read()
    seconds = time.perf_counter() - t
    conn.close()
    return n, seconds, resp.status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--status-requests", type=int, default=3000)
    ap.add_argument("--propagations", type=int, default=15)
    ap.add_argument("--json-out", metavar="FILE")
    args = ap.parse_args(argv)
    import medvolcore

    import tempfile

    log_path = Path(tempfile.mkdtemp(prefix="medvol-transport-bench-")) / "serve.log"
    proc, port = start(log_path)
    rows = {"code": str(Path(medvolcore.__file__).parent)}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        deadline = time.monotonic() + 300
        while True:  # the preset loads in the worker's thread after the ready line: not measured with it
            conn.request("GET", "/status")
            st = json.loads(conn.getresponse().read())["result"]
            if (st["preset"] and not st["busy"]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for _ in range(50):  # warm-up
            conn.request("GET", "/status")
            conn.getresponse().read()
        t = time.perf_counter()
        for _ in range(args.status_requests):
            conn.request("GET", "/status")
            conn.getresponse().read()
        rows["status req/s"] = round(args.status_requests / (time.perf_counter() - t), 1)

        img = nib.load(str(CT))
        small = nib.Nifti1Image(np.asarray(img.dataobj)[:, :, 11:19], img.affine)
        body = gzip.compress(small.to_bytes(), 1)
        req = json.dumps({"id": "p", "op": "propagate", "anchor": ANCHOR})
        over = []
        for i in range(args.propagations + 2):
            t = time.perf_counter()
            conn.request("POST", "/rpc", body=body, headers={"Content-Type": "application/octet-stream",
                                                             "X-MedVol-Request": req, "Accept": "application/gzip"})
            resp = conn.getresponse()
            resp.read()
            wall = time.perf_counter() - t
            reply = json.loads(resp.getheader("X-MedVol-Reply") or "{}")
            assert reply.get("ok"), reply
            if i >= 2:  # the first ones load the model
                over.append(wall - reply["result"]["timings"]["job_s"])
        rows["propagate overhead ms"] = round(statistics.median(over) * 1000, 2)
        conn.close()

        n, seconds, status = send_body(port, (512, 512, 300))
        rows["upload 157 MB status"] = status
        rows["upload MB/s"] = round(n / seconds / 1e6, 1)
        before = _vmhwm(proc.pid)
        n, seconds, status = send_body(port, (512, 512, 1000))
        rows["500 MB body status"] = status
        rows["peak MB before the 500 MB body"] = round(before, 1)
        rows["peak MB for a 500 MB body"] = round(_vmhwm(proc.pid), 1)
        rows["peak growth MB"] = round(rows["peak MB for a 500 MB body"] - before, 1)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    for k, v in rows.items():
        print(f"{k:32} {v}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
