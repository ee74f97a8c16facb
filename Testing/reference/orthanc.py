"""A real Orthanc (Debian's ``orthanc`` and ``orthanc-dicomweb``) on a free loopback port, with a
private storage folder and its DICOMweb plugin at ``/dicom-web``; :func:`start_orthanc` returns
it once it answers, :meth:`Orthanc.stop` ends it. Tests skip, saying why, when it is not installed
(``python3 MedVolCore/bootstrap.py`` installs it where apt-get runs as root)."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

PLUGIN_DIRS = (Path("/usr/share/orthanc/plugins"), Path("/usr/lib/orthanc"))


def dicomweb_plugin() -> Optional[Path]:
    for d in PLUGIN_DIRS:
        for name in ("libOrthancDicomWeb.so",):
            if (d / name).exists():
                return d / name
    hits = sorted(p for d in PLUGIN_DIRS if d.is_dir() for p in d.glob("libOrthancDicomWeb.so*"))
    return hits[0] if hits else None


def why_not_available() -> Optional[str]:
    if shutil.which("Orthanc") is None:
        return "Orthanc is not installed (apt-get install orthanc orthanc-dicomweb, or MedVolCore/bootstrap.py as root)"
    if dicomweb_plugin() is None:
        return "Orthanc's DICOMweb plugin is not installed (apt-get install orthanc-dicomweb)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Orthanc:
    def __init__(self, folder: Path, user: Optional[tuple] = None):
        self.folder = folder
        self.port = free_port()
        self.user = user
        storage = folder / "storage"
        storage.mkdir(parents=True)
        config = {
            "Name": "MedVolTest", "StorageDirectory": str(storage), "IndexDirectory": str(storage),
            "HttpPort": self.port, "DicomServerEnabled": False, "RemoteAccessAllowed": False,
            "AuthenticationEnabled": bool(user), "RegisteredUsers": {user[0]: user[1]} if user else {},
            "HttpCompressionEnabled": False, "Plugins": [str(dicomweb_plugin())],
            "DicomWeb": {"Enable": True, "Root": "/dicom-web/", "EnableWado": False},
        }
        (folder / "orthanc.json").write_text(json.dumps(config))
        self.log = open(folder / "orthanc.log", "wb")
        self.proc = subprocess.Popen(["Orthanc", str(folder / "orthanc.json")], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.rest("GET", "/system")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("Orthanc did not start: " + (folder / "orthanc.log").read_text()[-2000:])
                time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def dicomweb(self) -> str:
        return f"dicomweb://127.0.0.1:{self.port}/dicom-web"

    def rest(self, method: str, path: str, body: Optional[bytes] = None):
        req = urllib.request.Request(self.url + path, data=body, method=method)
        if self.user:
            req.add_header("Authorization", "Basic " + base64.b64encode(":".join(self.user).encode()).decode())
        if body is not None:
            req.add_header("Content-Type", "application/dicom")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    def upload(self, folder: Path) -> int:
        n = 0
        for f in sorted(Path(folder).iterdir()):
            self.rest("POST", "/instances", f.read_bytes())
            n += 1
        return n

    def instances(self) -> list:
        return self.rest("GET", "/instances")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
