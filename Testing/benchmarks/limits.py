"""The serving path's limits under load: memory per header byte, and another client's ``GET /hello``
while a large JSON body arrives, for a worker and for the ``--devices`` front, side by side.

For each tree given (``--tree DIR``, a checkout whose ``MedVolCore`` is put on the children's
``PYTHONPATH``; default: this one) it starts ``medvol serve --http --device cpu`` and ``medvol serve
--http --devices cpu`` (one worker behind the front), no preset (nothing here loads a model), and
prints, per server:

- ``header MB held``: the server's peak resident memory growth (VmHWM, the front and its worker
  together) while 4 clients at once each send one never-ending header value of 32 MB without a
  token, and ``bytes held / byte sent``;
- ``/hello ms during a body``: the median and the largest latency of ``GET /hello`` asked every
  20 ms by another client while a 42 MB JSON body of small keys (``{"k0":0,"k1":0,…}``) is sent at
  full speed, and while a 15 MB JSON body holding one long string (what ``volume_b64`` is) is sent
  and parsed, with ``--max-request-mb 64`` (so neither is refused for its size alone).

    PYTHONPATH=MedVolCore .venv/bin/python Testing/benchmarks/limits.py [--tree DIR ...] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _start(tree: Path, *args) -> tuple:
    env = dict(os.environ, PYTHONPATH=str(tree / "MedVolCore"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "medvolcore.cli_serve", "--http", "--host", "127.0.0.1", "--port",
                             "0", "--max-request-mb", "64", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline().decode("utf-8", "replace")
        if "ready (protocol 1) on http://127.0.0.1:" in line:
            port = int(line.split("http://127.0.0.1:")[1].split()[0].rstrip("/;"))
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            if "--devices" in args:  # wait for its worker
                while time.monotonic() < deadline and _get(port, "/status")[1].count(b'"up": true') < 1:
                    time.sleep(0.3)
            return proc, port
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"no ready line from {tree}")


def _family(pid: int) -> list:
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [int(k) for k in kids]


def _hwm_mb(pids) -> float:
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(float(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024
        except (OSError, StopIteration):
            pass
    return total


def _get(port: int, path: str) -> tuple:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    got = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    s.close()
    return int(got.split()[1]), got


def _endless_header(port: int, n: int, sent: list) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    total = 0
    try:
        s.sendall(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: ")
        chunk = b"x" * (1 << 16)
        while total < n:
            s.sendall(chunk)
            total += len(chunk)
    except OSError:
        pass
    finally:
        sent.append(total)
        s.close()


def header_memory(proc, port: int, clients: int = 4, n: int = 32 << 20) -> dict:
    pids = _family(proc.pid)
    before = _hwm_mb(pids)
    sent: list = []
    threads = [threading.Thread(target=_endless_header, args=(port, n, sent)) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grown = max(0.0, _hwm_mb(pids) - before)
    total = sum(sent)
    return {"header_bytes_sent": total, "header_mb_held": round(grown, 1),
            "held_per_byte_sent": round(grown * (1 << 20) / max(1, total), 4)}


def _post(port: int, body: bytes) -> int:
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        s.sendall((f"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    except OSError:
        pass
    got = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except OSError:
        pass
    s.close()
    return int(got.split()[1]) if got.startswith(b"HTTP/") else 0


def hello_during(port: int, body: bytes) -> dict:
    lat, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            t = time.perf_counter()
            _get(port, "/hello")
            lat.append((time.perf_counter() - t) * 1000)
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.3)
    t = time.perf_counter()
    status = _post(port, body)
    took = time.perf_counter() - t
    time.sleep(0.3)
    stop.set()
    poller.join()
    return {"status": status, "body_s": round(took, 2), "hello_ms_median": round(statistics.median(lat), 1),
            "hello_ms_max": round(max(lat), 1), "hellos": len(lat)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", type=Path, help="a checkout to measure (repeatable; default: this one)")
    ap.add_argument("--json-out", help="also write the figures as JSON")
    a = ap.parse_args(argv)
    keys = b'{"id":1,"op":"hello","x":{' + b",".join(b'"k%d":0' % i for i in range(3_300_000)) + b"}}"
    keys = keys[:42 << 20].rsplit(b",", 1)[0] + b"}}"
    string = b'{"id":1,"op":"hello","x":"' + b"A" * (15 << 20) + b'"}'
    rows = []
    for tree in a.tree or [REPO]:
        for name, args in (("worker", ("--device", "cpu")), ("front", ("--devices", "cpu", "--threads", "1"))):
            proc, port = _start(tree.resolve(), *args)
            try:
                row = {"tree": str(tree), "server": name, **header_memory(proc, port)}
                row["keys_42mb"] = hello_during(port, keys)
                row["string_15mb"] = hello_during(port, string)
                rows.append(row)
            finally:
                proc.terminate()
                proc.wait(60)
            print(json.dumps(row), flush=True)
    print(f"\n{'tree':<28} {'server':<7} {'header MB held':>14} {'per byte':>9} {'42 MB keys: status, /hello ms med/max':>40}"
          f" {'15 MB string: status, /hello ms med/max':>42}")
    for r in rows:
        k, s = r["keys_42mb"], r["string_15mb"]
        print(f"{r['tree'][-28:]:<28} {r['server']:<7} {r['header_mb_held']:>14} {r['held_per_byte_sent']:>9} "
              f"{k['status']:>18}, {k['hello_ms_median']:>7} / {k['hello_ms_max']:<8} "
              f"{s['status']:>20}, {s['hello_ms_median']:>7} / {s['hello_ms_max']:<8}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
