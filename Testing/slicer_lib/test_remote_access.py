"""What the panel keeps about remote workers for one session (``MedVolR1SlicerLib.remote``), what
it shows of a worker's ``hello``, and the order of the developer Reload
(``MedVolR1SlicerLib.reloading``). The panel's use of them is tested in real Qt
(``Testing/slicer_qt/test_qt_worker_settings.py``) and on real MRML (``Testing/slicer_mrml``)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from json_standin import send_json
from MedVolR1SlicerLib import remote
from MedVolR1SlicerLib.remoteworker import RemoteWorker
from MedVolR1SlicerLib.reloading import reload_order
from MedVolR1SlicerLib.session import Options, Session


def test_a_token_belongs_to_the_address_it_was_typed_for():
    access = remote.RemoteAccess()
    access.set_token("http://gpu-a:8765/ ", " secret ")
    assert access.token_for("http://gpu-a:8765") == "secret"
    assert access.token_for("http://gpu-b:8765") == "" and access.token_for("http://gpu-a:8766") == ""
    access.set_token("http://gpu-a:8765", "")
    assert access.token_for("http://gpu-a:8765") == ""


def test_confirmations_are_per_address_and_forgotten_with_the_session():
    access = remote.RemoteAccess()
    assert not access.confirmed("http://gpu-a:8765")
    access.confirm("http://gpu-a:8765/", "MedVolCore 0.4")
    assert access.confirmed("http://gpu-a:8765") and not access.confirmed("http://gpu-b:8765")
    access.forget()
    assert not access.confirmed("http://gpu-a:8765")


def test_what_a_worker_says_it_is_is_shown_as_sent_but_printable_and_short():
    hello = {"protocol": 1, "medvolcore": "0.4.0", "transport": "http",
             "model_label": "Qwen3-VL-4B-Instruct, zero-shot, not trained for this task",
             "models": {"preset": "qwen3-vl-4b", "identity": {"label": "ignored: model_label comes first"}}}
    assert remote.identity_text(hello) == ("MedVolCore 0.4.0; protocol 1; model: Qwen3-VL-4B-Instruct, zero-shot, "
                                           "not trained for this task; preset qwen3-vl-4b; transport http")
    assert "model: from identity" in remote.identity_text({"models": {"identity": {"label": "from identity"}}})
    hostile = remote.identity_text({"medvolcore": "1.0\x1b[2J\r\nyes, send it", "model_label": "x" * 500})
    assert "\x1b" not in hostile and "\n" not in hostile and len(hostile) < 200
    assert remote.identity_text({}).startswith("it did not say what it is")
    assert remote.identity_text(None).startswith("it did not say what it is")


def test_a_remote_workers_identity_is_asked_with_one_hello_and_its_token():
    """``Session.identify``: the hello that opens the remote session is the answer (not sent twice),
    with the token of the address."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):  # noqa: N802
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((req["op"], self.headers.get("Authorization")))
            send_json(self, {"id": req["id"], "ok": True, "result": {"protocol": 1, "medvolcore": "9.9"}})

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    session = Session()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        hello = session.identify(Options(worker="remote", remote_url=url, remote_token="tok"), timeout=30)
        assert hello["medvolcore"] == "9.9" and seen == [("hello", "Bearer tok")]
        assert isinstance(session.client, RemoteWorker) and session.client.session == "s1"
    finally:
        session.shutdown()
        server.shutdown()


def test_the_reload_order_puts_every_module_after_what_it_imports(tmp_path):
    pkg = tmp_path / "Pkg"
    pkg.mkdir()
    files = {"__init__.py": "from .b import B\n", "a.py": "X = 1\n", "b.py": "from .a import X\nB = X\n",
             "c.py": "def f():\n    from Pkg import b\n", "d.py": "from . import e\n", "e.py": "from . import d\n"}
    for name, text in files.items():
        (pkg / name).write_text(text)
    order = reload_order(tmp_path, ["Pkg"])
    assert sorted(order) == ["Pkg", "Pkg.a", "Pkg.b", "Pkg.c", "Pkg.d", "Pkg.e"]
    assert order.index("Pkg.a") < order.index("Pkg.b") < order.index("Pkg") and order.index("Pkg.b") < order.index("Pkg.c")
    assert order.index("Pkg.d") < order.index("Pkg.e")  # a circle is broken by name, the same way every time
    assert reload_order(tmp_path, ["Pkg"]) == order
    assert reload_order()[-1] in ("MedVolR1SlicerPanel.panel", "MedVolR1SlicerPanel.selftest")
