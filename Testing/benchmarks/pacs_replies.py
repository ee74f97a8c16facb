#!/usr/bin/env python3
"""Benchmark: what an oversized DICOMweb search answer costs in memory.

A loopback server answers every QIDO-RS search with a JSON array of ``--mb`` megabytes (chunked,
so no Content-Length tells its size up front); ``medvol pacs find --limit 5`` runs against it in a
new process, and the process's peak resident memory (ru_maxrss) and the outcome are printed. Run
it with ``PYTHONPATH`` pointing at another checkout's ``MedVolCore`` to compare two versions.

    .venv/bin/python Testing/benchmarks/pacs_replies.py [--mb 36]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def _handler(body: bytes):
    class Big(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "application/dicom+json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for i in range(0, len(body), 1 << 20):
                    part = body[i:i + (1 << 20)]
                    self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Big


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=36.0, help="size of the search answer in MB")
    args = ap.parse_args()
    item = json.dumps({"0020000D": {"vr": "UI", "Value": ["1.2.3"]}, "0020000E": {"vr": "UI", "Value": ["1.2.3.4"]},
                       "00081030": {"vr": "LO", "Value": ["x" * 60]}})
    n = int(args.mb * 2**20 / (len(item) + 1))
    body = ("[" + ",".join([item] * n) + "]").encode()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(body))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    code = ("import resource, sys\nfrom medvolcore.cli import main\nrc = main(sys.argv[1:])\n"
            "print('peak_rss_mb', round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), 'rc', rc, "
            "file=sys.stderr)\n")
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-c", code, "pacs", "find", "--url",
                            f"dicomweb://127.0.0.1:{srv.server_address[1]}/dicom-web", "--limit", "5", "--query",
                            "liver", "--out", str(Path(tmp) / "m.csv")], capture_output=True, text=True)
    srv.shutdown()
    baseline = subprocess.run([sys.executable, "-c", "import resource, medvolcore.cli, medvolcore.pacs, dicomweb_client"
                               ".api; print(round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))"],
                              capture_output=True, text=True)
    print(f"answer {len(body) / 2**20:.1f} MB; process after imports: {baseline.stdout.strip()} MB")
    print("medvol pacs find --limit 5:", (r.stderr.strip().splitlines() or ["?"])[-1])
    print("its message:", (r.stderr.strip().splitlines() or [""])[0][:200])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
