"""``medvol serve --stdio`` (medvolcore.serve.stdio): request lines bounded by the request limit, and
stdout kept for protocol lines only. The worker behind it is test_serve_worker.py's."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

from medvolcore.serve.stdio import _read_lines

# A worker over stdio whose every request first prints to stdout, from Python and straight to file
# descriptor 1 (as a C library would); the protocol channel must carry none of it.
NOISY_WORKER = """
import os, sys
from medvolcore.serve import worker as w
from medvolcore.serve.stdio import serve_stdio
from medvolcore.serve.worker import WorkerSettings

handle_line = w.Worker.handle_line

def noisy(self, raw, *a, **k):
    print("a stray print from a library")
    sys.stdout.flush()
    os.write(1, b"a stray write to file descriptor 1\\n")
    return handle_line(self, raw, *a, **k)

w.Worker.handle_line = noisy
sys.exit(serve_stdio(WorkerSettings(max_request_mb=float(sys.argv[1]), device="cpu")))
"""


def _serve(lines, max_request_mb=0.001):
    r = subprocess.run([sys.executable, "-c", NOISY_WORKER, str(max_request_mb)], input="".join(lines).encode(),
                       capture_output=True, timeout=120)
    return r.returncode, r.stdout.decode(), r.stderr.decode()


def test_lines_over_the_limit_are_skipped_whole_and_the_next_ones_read():
    limit = 10
    stream = io.BytesIO(b'{"a": 1}\n' + b"x" * 50 + b"\n" + b'{"b": 2}\n' + b"y" * 10 + b"\n" + b"z" * 11 + b"\n"
                        + b"w" * (3 << 20) + b"\n" + b"last")
    assert list(_read_lines(stream, limit)) == [b'{"a": 1}\n', None, b'{"b": 2}\n', b"y" * 10 + b"\n", None, None,
                                                 b"last"]
    assert list(_read_lines(io.BytesIO(b""), limit)) == []


def test_stdout_carries_protocol_lines_only_and_a_long_line_gets_one_reply():
    huge = json.dumps({"id": 0, "op": "hello", "pad": "x" * 3000})  # over 0.001 MB (1048 bytes)
    code, out, err = _serve([huge + "\n", '{"id": 1, "op": "hello"}\n', "\n", '{"id": 2, "op": "nope"}\n'])
    assert code == 0, err
    replies = [json.loads(line) for line in out.splitlines()]  # every stdout line is a protocol line
    assert [(r["id"], r["ok"]) for r in replies] == [(None, False), (1, True), (2, False)]
    assert replies[0]["error"]["code"] == "too_large" and "--max-request-mb 0.001" in replies[0]["error"]["message"]
    assert replies[1]["result"]["transport"] == "stdio" and replies[2]["error"]["code"] == "unknown_op"
    assert err.count("a stray print from a library") == 2 and err.count("a stray write to file descriptor 1") == 2
    assert "stray" not in out and err.rstrip().endswith("stopped (end of input)")
    tmp = re.search(r"temp dir (\S+)", err).group(1)
    assert not Path(tmp).exists()  # removed when the worker stopped


def test_shutdown_stops_reading_the_lines_after_it():
    code, out, err = _serve(['{"id": 1, "op": "shutdown"}\n', '{"id": 9, "op": "hello"}\n'])
    assert code == 0, err
    assert [json.loads(line) for line in out.splitlines()] == [{"id": 1, "ok": True, "result": {"stopping": True}}]
    assert err.rstrip().endswith("stopped (shutdown)")
