#!/usr/bin/env python3
"""Volume uploads to ``medvol serve --http`` (issue 26, item 6): server memory and upload time.

1. **Peak RSS for a large body.** A fresh server per size gets a ``.nii`` body (int16,
   512×512×K) streamed from a file, whose request is then refused on arrival (``segment``
   without ``query``), so the figure is the transport's: the body is stored to the worker's
   private file, never read into memory. Printed: the server's VmHWM (peak RSS) before and after,
   for a small and a large body. ``--old-tree DIR`` runs the same against another checkout
   (e.g. the code before the change, with ``--max-request-mb`` raised so it accepts the body).
2. **Upload time on loopback** for a synthetic 512×512×300 int16 CT (157 MB: HU noise over a
   body-shaped ellipse, air outside, so gzip's ratio is a CT's, not a test pattern's): the
   ``.nii`` as it is vs. gzip level 1 and 6 (the compression time is counted), from the client's
   first byte to the server's reply (the body stored, then the request refused on arrival), and
   the server-side read of each file (``load_volume``: gzip costs decompression there).

    PYTHONPATH=MedVolCore .venv/bin/python Testing/benchmarks/uploads.py [--big-mb 500] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np

REPO = Path(__file__).resolve().parents[2]


def vm(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return float(line.split()[1]) / 1024
    return float("nan")


class Server:
    def __init__(self, tree: Path, *args):
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(tree / "MedVolCore"))
        self.proc = subprocess.Popen([sys.executable, "-m", "medvolcore.cli_serve", "--http", "--port", "0",
                                      "--threads", "1", *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env=env)
        self.port = None
        for _ in range(200):
            line = self.proc.stderr.readline().decode()
            m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        assert self.port, "no ready line"

    def post_file(self, path: Path) -> tuple:
        """(seconds from the first byte to the reply, status, reply) for ``path`` as the body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        n = path.stat().st_size
        t = time.perf_counter()
        with open(path, "rb") as f:
            conn.request("POST", "/rpc", body=f, headers={
                "Content-Type": "application/octet-stream", "Content-Length": str(n),
                "X-MedVol-Request": json.dumps({"id": "u", "op": "segment"})})  # no query: refused on arrival
            resp = conn.getresponse()
            data = resp.read()
        dt = time.perf_counter() - t
        conn.close()
        return dt, resp.status, json.loads(data.decode() if resp.getheader("Content-Type") == "application/json" else "{}")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def write_nii(path: Path, slices: int, ct_like: bool) -> Path:
    """A 512×512×``slices`` int16 NIfTI written slab by slab (the client never holds it whole)."""
    hdr = nib.Nifti1Header()
    hdr.set_data_shape((512, 512, slices))
    hdr.set_data_dtype(np.int16)
    hdr.set_zooms((0.8, 0.8, 1.5))
    hdr["vox_offset"] = 352
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:512, 0:512]
    with open(path, "wb") as f:
        f.write(hdr.binaryblock + b"\0" * 4)
        for k in range(slices):
            if ct_like:
                # a body-shaped ellipse whose size changes along z, soft tissue with noise, fat rim, a spine
                a, b = 200 + 30 * np.sin(k / slices * np.pi), 140 + 20 * np.sin(k / slices * np.pi)
                r = ((x - 256) / a) ** 2 + ((y - 270) / b) ** 2
                sl = np.full((512, 512), -1000.0)
                sl[r < 1] = 40
                sl[(r < 1) & (r > 0.85)] = -100  # subcutaneous fat
                sl[((x - 256) ** 2 + (y - 360) ** 2) < 18 ** 2] = 700  # vertebra
                sl += rng.normal(0, 15, sl.shape) * (r < 1) + rng.normal(0, 5, sl.shape) * (r >= 1)
                f.write(np.round(sl).astype("<i2").tobytes())  # i (x) fastest, as NIfTI stores it
            else:
                f.write(rng.integers(-1000, 1000, size=(512, 512), dtype="<i2").tobytes())
    return path


def gzip_file(src: Path, level: int) -> tuple:
    dst = src.with_name(src.name + f".l{level}.nii.gz")
    t = time.perf_counter()
    with open(src, "rb") as fin, open(dst, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=level, mtime=0) as gz:
            while True:
                chunk = fin.read(1 << 20)
                if not chunk:
                    break
                gz.write(chunk)
    return dst, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--big-mb", type=float, default=500)
    ap.add_argument("--old-tree", type=Path, default=None, help="also measure the peak RSS with this checkout")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory(prefix="medvol-upload-bench-") as d:
        d = Path(d)
        if not a.skip_rss:
            small = write_nii(d / "small.nii", 10, ct_like=False)
            big = write_nii(d / "big.nii", int(a.big_mb * (1 << 20) / (512 * 512 * 2)), ct_like=False)
            trees = [("this tree", REPO, [])]
            if a.old_tree:
                trees.append((f"{a.old_tree}", a.old_tree, ["--max-request-mb", str(int(a.big_mb * 2))]))
            rows = []
            for label, tree, extra in trees:
                for path in (small, big):
                    s = Server(tree, *extra)
                    try:
                        time.sleep(0.5)
                        before = vm(s.proc.pid, "VmHWM")
                        dt, status, reply = s.post_file(path)
                        after = vm(s.proc.pid, "VmHWM")
                        code = (reply.get("error") or {}).get("code")
                        rows.append({"tree": label, "body_mb": round(path.stat().st_size / 2 ** 20, 1),
                                     "peak_rss_before_mb": round(before, 1), "peak_rss_after_mb": round(after, 1),
                                     "seconds": round(dt, 2), "status": status, "reply": code})
                        print(f"{label}: body {rows[-1]['body_mb']:7.1f} MB -> HTTP {status} {code}; server peak RSS "
                              f"{before:6.1f} -> {after:6.1f} MB ({dt:.2f} s)", flush=True)
                    finally:
                        s.stop()
            out["peak_rss"] = rows
            small.unlink()
            big.unlink()
        if not a.skip_time:
            from medvolcore.volume import load_volume

            ct = write_nii(d / "ct.nii", 300, ct_like=True)
            s = Server(REPO)
            rows = []
            try:
                s.post_file(ct)  # warm-up
                for level in (None, 1, 6):
                    path, gz_s = (ct, 0.0) if level is None else gzip_file(ct, level)
                    send = min(s.post_file(path)[0] for _ in range(3))
                    t = time.perf_counter()
                    load_volume(path)
                    read_s = time.perf_counter() - t
                    rows.append({"body": "nii" if level is None else f"nii.gz level {level}",
                                 "mb": round(path.stat().st_size / 2 ** 20, 1), "gzip_s": round(gz_s, 2),
                                 "upload_s": round(send, 3), "client_total_s": round(gz_s + send, 2),
                                 "server_read_s": round(read_s, 2)})
                    r = rows[-1]
                    print(f"{r['body']:>16}: {r['mb']:6.1f} MB  gzip {r['gzip_s']:5.2f} s  upload {r['upload_s']:6.3f} s"
                          f"  (client total {r['client_total_s']:5.2f} s)  server read {r['server_read_s']:5.2f} s",
                          flush=True)
            finally:
                s.stop()
            out["upload_157mb_ct"] = rows
    if a.json_out:
        a.json_out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
