"""``medvol mcp`` (medvolcore/cli/mcp.py): its options refused in one line before anything starts,
and the command over stdio as an agent host runs it: a subprocess spoken to in raw JSON-RPC
(protocol 2025-06-18), whose stdout carries nothing but JSON-RPC even when libraries print."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from medvolcore.cli import main  # noqa: E402

from core.test_agents_server import SNAPSHOT  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, says", [
    ([], "--allow"),
    (["--allow", "{tmp}/missing"], "not a folder"),
    (["--allow", "{tmp}", "--out-dir", "{tmp}"], "overlaps the allowed folder"),
    (["--allow", "{tmp}", "--token-file", "{tmp}/t"], "apply to --http only"),
    (["--allow", "{tmp}", "--http", "0.0.0.0:0"], "without a token"),
    (["--allow", "{tmp}", "--http", "nonsense"], "HOST:PORT"),
    (["--allow", "{tmp}", "--allow-pacs", "orthanc"], "--pacs-config"),
    (["--allow", "{tmp}", "--preset", "medvol-r1"], "adapter"),
])
def test_bad_options_are_one_line_and_exit_2(tmp_path, capsys, argv, says):
    import logging

    engine_log = logging.getLogger("medvolcore")
    main(["mcp"])  # the command line's own handler, which any command installs
    capsys.readouterr()
    before = (list(engine_log.handlers), engine_log.level, engine_log.propagate)
    code = main(["mcp"] + [a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    # a refused command leaves the process as it found it: the server's stderr logging is set up only
    # once every option was checked (it made later commands in the same process print a second line)
    assert (list(engine_log.handlers), engine_log.level, engine_log.propagate) == before


# a library that prints while the models load and while they answer: none of it may reach stdout
NOISY = """
import os, sys
from medvolcore.grounder import QwenVLGrounder
from medvolcore.pipeline import Pipeline
real_generate, real_load = QwenVLGrounder._generate_text, Pipeline.load
def noisy_generate(self, *a, **k):
    print("noise from print()"); os.write(1, b"noise from fd 1\\n")
    return real_generate(self, *a, **k)
def noisy_load(self, *a, **k):
    print("noise while loading"); os.write(1, b"noise from fd 1 while loading\\n")
    return real_load(self, *a, **k)
QwenVLGrounder._generate_text, Pipeline.load = noisy_generate, noisy_load
from medvolcore.cli import main
sys.exit(main(sys.argv[1:]))
"""


class StdioHost:
    """An agent host's side of ``medvol mcp`` over stdio, in raw JSON-RPC lines."""

    def __init__(self, *args):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "MedVolCore"), str(REPO / "Testing"),
                                                            os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-c", NOISY, "mcp", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.lines = []  # every stdout line, parsed
        self.next = 1

    def send(self, obj):
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def read(self, timeout=240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1)
            if ready:
                raw = self.proc.stdout.readline()
                assert raw, "the server closed stdout: " + self.proc.stderr.read().decode()[-2000:]
                msg = json.loads(raw)  # any line that is not JSON fails here
                assert msg.get("jsonrpc") == "2.0", raw
                self.lines.append(msg)
                return msg
        raise AssertionError("no reply in time")

    def request(self, method, params=None, notes=None):
        rid, self.next = self.next, self.next + 1
        self.send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}})
        while True:
            msg = self.read()
            if msg.get("id") == rid and "method" not in msg:
                return msg
            if notes is not None:
                notes.append(msg)

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        rest = self.proc.stdout.read()
        return rest, self.proc.stderr.read().decode()


@pytest.mark.slow
def test_stdio_carries_only_jsonrpc_and_answers_a_2025_06_18_host(tmp_path, small_ct):
    root = tmp_path / "allowed"
    root.mkdir()
    shutil.copy(small_ct[0], root / "ct.nii.gz")
    host = StdioHost("--allow", str(root), "--preset", "tiny", "--device", "cpu", "--threads", "1")
    try:
        init = host.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                           "clientInfo": {"name": "raw-host", "version": "0"}})
        assert init["result"]["protocolVersion"] == "2025-06-18", init
        host.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        listed = host.request("tools/list")
        snapshot = json.loads(SNAPSHOT.read_text())
        assert {t["name"]: t["outputSchema"] for t in listed["result"]["tools"]} == \
               {n: t["outputSchema"] for n, t in snapshot.items()}
        notes = []
        reply = host.request("tools/call", {"name": "segment_from_query", "_meta": {"progressToken": "p1"},
                                            "arguments": {"volume": str(root / "ct.nii.gz"), "query": "the liver"}},
                             notes)
        refused = host.request("tools/call", {"name": "segment_from_query",
                                              "arguments": {"volume": "/etc/passwd", "query": "the liver"}})
    finally:
        rest, stderr = host.close()
    out = reply["result"]
    assert not out.get("isError"), out
    assert out["structuredContent"]["status"] == "segmented"
    assert out["structuredContent"]["targets"][0]["found"] is True
    assert any(c["type"] == "image" for c in out["content"])
    progress = [n["params"]["progress"] for n in notes if n.get("method") == "notifications/progress"]
    assert progress and progress == sorted(progress)
    assert refused["result"]["isError"] is True and "outside the folders" in refused["result"]["content"][0]["text"]
    assert rest == b""  # nothing after the last reply either
    assert "noise while loading" in stderr and "noise from print()" in stderr  # it went to stderr instead
