"""The shipped nginx configuration (``Resources/deploy/nginx/medvol.conf``) in front of two real
CPU workers: Debian's nginx runs that very file, with only its FILL-IN values replaced (loopback
ports, a self-signed certificate, test tokens, log paths in a private folder), so what is
tested is what operators install (``docs/deploy.md``).

Shown here: a correction round through nginx reaches the worker holding the volume and encodes
no slice; with that worker killed, the other one answers the same mask (encoding the slices
again); TLS at nginx; the Slicer client (``RemoteWorker``) through it unchanged; per-client
tokens (an unknown one gets nginx's 401 envelope and never reaches a worker); the workers' own
rules (repeated headers, ``Host``, ``Origin``, framing) through nginx; and what a client's
half-close does behind nginx. Skips where the ``nginx`` or ``openssl`` binary is missing
(``MedVolCore/bootstrap.py`` installs Debian's nginx).
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import json
import math
import os
import re
import shutil
import secrets
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from core.worker_clients import HttpServer, reap

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "Resources" / "deploy" / "nginx" / "medvol.conf"
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
OPENSSL = shutil.which("openssl")
# tokens made as the README says (43 characters): the shipped map must hold them
WORKER_TOKEN = secrets.token_urlsafe(32)
CLIENT_TOKEN = secrets.token_urlsafe(32)
PUBLIC_NAME = "medvol.example.org"
ANCHOR = {"schema": "medvol.anchor/1", "slice": 4, "boxes": [[30, 30, 90, 80]], "source": "user"}
EDITED = dict(ANCHOR, boxes=[[40, 30, 80, 70]])

pytestmark = [
    pytest.mark.slow,  # two worker processes and nginx; segments end to end (about 15 s on 2 cores)
    pytest.mark.skipif(NGINX is None, reason="no nginx binary (Debian's nginx: MedVolCore/bootstrap.py installs it)"),
    pytest.mark.skipif(OPENSSL is None, reason="no openssl binary to make the test certificate"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render(ports, listen_port: int, cert: Path, key: Path, logs: Path) -> str:
    """The shipped file with its FILL-IN values replaced; every one must be found, so a change to
    the shipped file that this test does not follow fails here rather than testing something else."""
    text = SHIPPED.read_text(encoding="utf-8")
    subs = [
        ("server 10.0.0.11:8765", f"server 127.0.0.1:{ports[0]}"),
        ("server 10.0.0.12:8765", f"server 127.0.0.1:{ports[1]}"),
        ("listen 443 ssl;", f"listen 127.0.0.1:{listen_port} ssl;"),
        ("listen [::]:443 ssl;", ""),
        ("/etc/ssl/certs/medvol.example.org.pem", str(cert)),
        ("/etc/ssl/private/medvol.example.org.key", str(key)),
        ("/var/log/nginx/medvol-access.log", str(logs / "access.log")),
        ("/var/log/nginx/medvol-error.log", str(logs / "error.log")),
        ("FILL-IN-alice-token-aaaaaaaaaaaaaaaaaaaa", CLIENT_TOKEN),
        ("FILL-IN-bob-token-bbbbbbbbbbbbbbbbbbbbbbbb", secrets.token_urlsafe(32)),
        ("FILL-IN-worker-token-wwwwwwwwwwwwwwwwwwww", WORKER_TOKEN),
    ]
    for old, new in subs:
        assert text.count(old) == 1, f"{SHIPPED.name} no longer holds {old!r} once"
        text = text.replace(old, new)
    directives = [ln.split("#", 1)[0] for ln in text.splitlines()]
    assert not any("FILL-IN" in d or "10.0.0." in d for d in directives)  # every value to fill in was filled
    return text


class Nginx:
    """Debian's nginx, unprivileged paths only: a private prefix, pid, temp folders and logs, so it
    never touches (or collides with) a system nginx on port 80/443."""

    def __init__(self, root: Path, snippet: str):
        self.root = root
        for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi", "logs"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "medvol.conf").write_text(snippet, encoding="utf-8")
        user = "user root;\n" if hasattr(os, "geteuid") and os.geteuid() == 0 else ""  # workers may read tmp_path
        (root / "nginx.conf").write_text(
            f"{user}worker_processes 1;\npid {root}/nginx.pid;\nerror_log {root}/logs/main-error.log info;\n"
            "events { worker_connections 256; }\n"
            f"http {{\n  client_body_temp_path {root}/body;\n  proxy_temp_path {root}/proxy;\n"
            f"  fastcgi_temp_path {root}/fastcgi;\n  uwsgi_temp_path {root}/uwsgi;\n  scgi_temp_path {root}/scgi;\n"
            f"  access_log off;\n  include {root}/medvol.conf;\n}}\n", encoding="utf-8")
        args = [NGINX, "-p", str(root), "-c", str(root / "nginx.conf"), "-e", str(root / "logs" / "main-error.log")]
        check = subprocess.run(args + ["-t"], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen(args + ["-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def access_log(self, *needles, at_least: int = 1, timeout: float = 10) -> list:
        """The access log's lines holding every one of ``needles``, once there are ``at_least`` of
        them (nginx writes a line just after its reply has gone) or ``timeout`` has passed."""
        p = self.root / "logs" / "access.log"
        deadline = time.monotonic() + timeout
        while True:
            lines = p.read_text(encoding="utf-8").splitlines() if p.exists() else []
            found = [ln for ln in lines if all(n in ln for n in needles)]
            if len(found) >= at_least or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            reap(self.proc)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, small_ct):
    root = tmp_path_factory.mktemp("nginx")
    (root / "token").write_text(WORKER_TOKEN)
    os.chmod(root / "token", 0o600)
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", f"subjectAltName=IP:127.0.0.1,DNS:{PUBLIC_NAME}", "-keyout", str(key),
                    "-out", str(cert)],
                   check=True, capture_output=True)
    workers = [HttpServer("--device", "cpu", "--preset", "tiny", "--threads", "1", "--token-file", str(root / "token"),
                          "--allowed-host", PUBLIC_NAME) for _ in range(2)]
    port = _free_port()
    try:
        nginx = Nginx(root / "prefix", render([w.port for w in workers], port, cert, key, root / "prefix" / "logs"))
    except BaseException:  # a config nginx refuses: the workers must not outlive the test
        for w in workers:
            w.stop()
        raise
    ctx = ssl.create_default_context(cafile=str(cert))
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert nginx.proc.poll() is None and time.monotonic() < deadline, nginx.proc.stderr.read().decode()
            time.sleep(0.1)
    s = type("Stack", (), dict(workers=workers, nginx=nginx, port=port, ctx=ctx, cert=cert,
                               volume=small_ct[0].read_bytes()))
    yield s
    nginx.stop()
    for w in workers:
        w.stop()


def call(stack, method, path, body=None, headers=None, token=CLIENT_TOKEN, timeout=120):
    """One request to nginx over TLS: ``(status, headers, body bytes)``."""
    conn = http.client.HTTPSConnection("127.0.0.1", stack.port, context=stack.ctx, timeout=timeout)
    h = {"Authorization": f"Bearer {token}"} if token else {}
    h.update(headers or {})
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, r.headers, data


def volume_rpc(stack, req, volume=None, session=None):
    """A segment/propagate with the volume as the body, as the Slicer client sends it; the reply's
    result, with the mask (sent as bytes) decoded under ``mask`` and the session id the worker
    issued under ``session``."""
    volume = stack.volume if volume is None else volume
    h = {"Content-Type": "application/octet-stream", "X-MedVol-Request": json.dumps(req),
         "X-MedVol-Volume": hashlib.sha256(volume).hexdigest(), "Accept": "application/gzip"}
    if session:
        h["X-MedVol-Session"] = session
    status, rh, data = call(stack, "POST", "/rpc", volume, h)
    assert status == 200, data[:300]
    assert rh["Content-Type"] == "application/gzip", data[:300]
    reply = json.loads(rh["X-MedVol-Reply"])
    assert reply["ok"] is True, reply
    img = nib.Nifti1Image.from_bytes(gzip.decompress(data))
    reply["result"]["mask"] = np.asanyarray(img.dataobj)
    reply["result"]["session"] = rh["X-MedVol-Session"]
    return reply["result"]


def worker_status(worker) -> dict:
    """A worker's own ``status``, asked directly (not through nginx)."""
    st, r = worker.request("GET", "/status", token=WORKER_TOKEN, session=False)
    assert st == 200, r
    return r["result"]


@pytest.fixture(scope="module")
def first_round(stack):
    """A segment, then a correction round (a propagate with an edited anchor) on the same volume, in
    the session the worker issued (a worker keeps a client's encoded slices for its session only)."""
    seg = volume_rpc(stack, {"id": "seg", "op": "segment", "query": "the liver", "stop_after_empty": 0})
    prop = volume_rpc(stack, {"id": "prop", "op": "propagate", "anchor": EDITED, "stop_after_empty": 0},
                      session=seg["session"])
    holders = [w for w in stack.workers if worker_status(w)["feature_cache"]["volumes"] > 0]
    return seg, prop, holders


def test_a_correction_round_through_nginx_encodes_no_slice(stack, first_round):
    seg, prop, holders = first_round
    depth = stack.volume and nib.Nifti1Image.from_bytes(gzip.decompress(stack.volume)).shape[2]
    assert seg["slices_encoded"] == depth
    assert prop["slices_encoded"] == 0 and prop["timings"]["encoder_calls"] == 0
    assert prop["anchor"]["boxes"] == EDITED["boxes"]
    assert len(holders) == 1  # one worker saw the volume: both requests went to it
    # the access log names the client (from its token) and the worker that answered each request
    rpc = stack.nginx.access_log('"POST /rpc', "status=200", at_least=2)
    assert rpc and all("client=alice" in ln for ln in rpc)
    assert len({re.search(r"upstream=(\S+)", ln).group(1) for ln in rpc}) == 1


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion:DeprecationWarning")
def test_tls_at_nginx(stack):
    raw = socket.create_connection(("127.0.0.1", stack.port), timeout=10)
    with stack.ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.load_verify_locations(str(stack.cert))
    old.maximum_version = ssl.TLSVersion.TLSv1_1
    old.minimum_version = ssl.TLSVersion.TLSv1
    old.set_ciphers("DEFAULT:@SECLEVEL=0")  # this client would speak TLS 1.0/1.1: nginx must refuse
    with pytest.raises(ssl.SSLError):
        old.wrap_socket(socket.create_connection(("127.0.0.1", stack.port), timeout=10), server_hostname="127.0.0.1")
    # a client that does not trust the certificate stops at the handshake
    with pytest.raises(ssl.SSLCertVerificationError):
        ssl.create_default_context(cafile=None).wrap_socket(
            socket.create_connection(("127.0.0.1", stack.port), timeout=10), server_hostname="127.0.0.1")


def test_tokens_per_client_and_the_workers_rules_through_nginx(stack):
    status, rh, data = call(stack, "GET", "/hello", token="mallory-" + "m" * 24)
    assert status == 401 and rh["Content-Type"] == "application/json"
    assert json.loads(data) == {"id": None, "ok": False, "error": {"code": "unauthorized", "message": json.loads(
        data)["error"]["message"]}} and "token" in json.loads(data)["error"]["message"]
    assert call(stack, "GET", "/hello", token=None)[0] == 401
    # the worker's own token is no client token: nginx replaces the client's, never passes it on
    assert call(stack, "GET", "/hello", token=WORKER_TOKEN)[0] == 401
    refused = stack.nginx.access_log("status=401", at_least=3)
    assert len(refused) == 3 and all("upstream=-" in ln and "client= " in ln for ln in refused)  # never reached one

    status, _, data = call(stack, "GET", "/hello")
    hello = json.loads(data)["result"]
    assert status == 200 and hello["protocol"] == 1
    # nginx takes bodies as large as a worker does (the default --max-voxels)
    shipped = re.search(r"client_max_body_size (\d+)m;", SHIPPED.read_text()).group(1)
    assert int(shipped) == math.ceil(hello["limits"]["max_volume_body_mb"])

    # a repeated protocol header reaches the worker, which refuses it as it does without nginx
    conn = http.client.HTTPSConnection("127.0.0.1", stack.port, context=stack.ctx, timeout=30)
    conn.putrequest("GET", "/hello")
    conn.putheader("Authorization", f"Bearer {CLIENT_TOKEN}")
    conn.putheader("X-MedVol-Volume", "a" * 64)
    conn.putheader("X-MedVol-Volume", "b" * 64)
    conn.endheaders()
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    assert r.status == 400 and body["error"]["code"] == "bad_request" and "X-MedVol-Volume" in body["error"]["message"]
    # Host: the public name is accepted (--allowed-host); another name gets the worker's 403
    assert call(stack, "GET", "/hello", headers={"Host": PUBLIC_NAME})[0] == 200
    status, _, data = call(stack, "GET", "/hello", headers={"Host": "evil.example"})
    assert status == 403 and "Host" in json.loads(data)["error"]["message"]
    status, _, data = call(stack, "GET", "/hello", headers={"Origin": "https://evil.example"})
    assert status == 403 and "Origin" in json.loads(data)["error"]["message"]
    # framing: Transfer-Encoding is refused at nginx as at a worker; other paths are not routed
    conn = http.client.HTTPSConnection("127.0.0.1", stack.port, context=stack.ctx, timeout=30)
    conn.request("POST", "/rpc", body=iter([b'{"id": 1, "op": "hello"}']), encode_chunked=True,
                 headers={"Authorization": f"Bearer {CLIENT_TOKEN}", "Content-Type": "application/json",
                          "Transfer-Encoding": "chunked"})
    r = conn.getresponse()
    assert r.status == 400 and json.loads(r.read())["error"]["code"] == "bad_request"
    conn.close()
    status, _, data = call(stack, "GET", "/admin")
    assert status == 404 and json.loads(data)["error"]["code"] == "not_found"
    # what nginx refuses itself is a protocol error envelope too; a POST without Content-Length
    # goes on to the worker, which answers its 411
    for head, code in ((b"GET /hello HTTP/1.1\r\nHost: a\r\nHost: b\r\n", 400),
                       (b"POST /rpc HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 2\r\n", 400),
                       (b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n", 411)):
        tls = stack.ctx.wrap_socket(socket.create_connection(("127.0.0.1", stack.port), timeout=30),
                                    server_hostname="127.0.0.1")
        tls.sendall(head + f"Authorization: Bearer {CLIENT_TOKEN}\r\nConnection: close\r\n\r\n".encode() + b"{}")
        got = b""
        while chunk := tls.recv(65536):
            got += chunk
        tls.close()
        status_line, _, rest = got.partition(b"\r\n")
        assert status_line.split()[1] == str(code).encode(), got[:300]
        assert json.loads(rest.partition(b"\r\n\r\n")[2])["ok"] is False, got[:300]


def test_the_slicer_client_through_nginx_unchanged(stack, tmp_path, monkeypatch, small_ct):
    slicer = str(REPO / "MedVolR1Slicer")
    monkeypatch.syspath_prepend(slicer)
    from MedVolR1SlicerLib.remoteworker import RemoteWorker

    monkeypatch.setenv("SSL_CERT_FILE", str(stack.cert))  # urllib's default context reads it
    vol = tmp_path / "ct.nii.gz"  # content of its own: no worker has encoded it yet
    img = nib.load(str(small_ct[0]))
    data = np.asarray(img.dataobj).copy()
    data[0, 0, 0] += 1
    nib.save(nib.Nifti1Image(data, img.affine, img.header), str(vol))
    w = RemoteWorker(f"https://127.0.0.1:{stack.port}", token=CLIENT_TOKEN)
    try:
        seg = w.call("segment", 300, volume=str(vol), query="the liver", stop_after_empty=0)
        assert seg["slices_encoded"] == data.shape[2] and Path(seg["mask_path"]).is_file()
        anchor = dict(ANCHOR, boxes=[[35, 35, 85, 75]])
        prop = w.call("propagate", 300, volume=str(vol), anchor=anchor, stop_after_empty=0)
        assert prop["slices_encoded"] == 0 and prop["anchor"]["boxes"] == anchor["boxes"]
    finally:
        w.stop()


def test_a_half_closed_client_is_a_gone_client_behind_nginx(stack, ct_sm_path):
    """nginx (proxy_ignore_client_abort off) takes a half-close for an abort: the client gets no
    reply, and nginx closes the worker's connection, which the worker sees within its probe
    interval (a second) and cancels the request."""
    img = nib.load(str(ct_sm_path))  # the example CT four times over (120 slices): its job runs for many seconds
    tall = np.concatenate([np.asarray(img.dataobj)] * 4, axis=2)
    volume = gzip.compress(nib.Nifti1Image(tall, img.affine).to_bytes(), compresslevel=1)
    req = json.dumps({"id": "half", "op": "propagate", "anchor": dict(ANCHOR, slice=20), "stop_after_empty": 0})
    head = (f"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {CLIENT_TOKEN}\r\n"
            f"Content-Type: application/octet-stream\r\nX-MedVol-Request: {req}\r\n"
            f"X-MedVol-Volume: {hashlib.sha256(volume).hexdigest()}\r\nContent-Length: {len(volume)}\r\n\r\n")
    raw = socket.create_connection(("127.0.0.1", stack.port), timeout=60)
    tls = stack.ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    tls.sendall(head.encode() + volume)
    time.sleep(0.5)
    raw_fd = socket.socket(fileno=os.dup(tls.fileno()))
    raw_fd.shutdown(socket.SHUT_WR)  # TCP FIN, no TLS close_notify: what a half-closing client does
    raw_fd.close()
    got = b""
    try:
        while chunk := tls.recv(65536):
            got += chunk
    except (ssl.SSLError, OSError):
        pass
    tls.close()
    assert b"HTTP/1.1 200" not in got
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any('id="half" -> client disconnected: cancelled' in ln
                                                  for w in stack.workers for ln in w.stderr):
        time.sleep(0.2)
    assert any('id="half" -> client disconnected: cancelled' in ln for w in stack.workers for ln in w.stderr)
    aborted = stack.nginx.access_log("status=499")
    assert len(aborted) == 1 and re.search(r"upstream=127\.0\.0\.1:\d+ ", aborted[0])  # it reached a worker


def test_a_client_alternating_between_volumes_keeps_their_encoded_slices(stack, tmp_path, monkeypatch, small_ct):
    """A worker keeps encoded slices per session, and a session is one worker's: the Slicer client
    opens a session per volume key (a hello carrying the key, so the worker that will hold the
    volume issues it), and a client going back and forth between volumes held by different
    workers encodes none of them again."""
    monkeypatch.syspath_prepend(str(REPO / "MedVolR1Slicer"))
    from MedVolR1SlicerLib.remoteworker import RemoteWorker

    monkeypatch.setenv("SSL_CERT_FILE", str(stack.cert))
    img = nib.load(str(small_ct[0]))
    vols = []
    for i in range(8):
        data = np.asarray(img.dataobj).copy()
        data[2, 2, 0] += 11 + i
        raw = gzip.compress(nib.Nifti1Image(data, img.affine, img.header).to_bytes(), mtime=0)
        key = hashlib.sha256(raw).hexdigest()
        v = tmp_path / f"v{i}.nii.gz"
        v.write_bytes(raw)
        vols.append((v, key))
    w = RemoteWorker(f"https://127.0.0.1:{stack.port}", token=CLIENT_TOKEN)
    try:
        sent, upstreams = [], set()
        for v, key in vols:  # until both workers hold one of them (the hash decides where each goes)
            w.call("propagate", 300, volume=str(v), anchor=ANCHOR, stop_after_empty=0)
            sent.append(v)
            upstreams |= {re.search(r"upstream=(\S+)", ln).group(1)
                          for ln in stack.nginx.access_log(f"volume={key}", '"POST /rpc')}
            if len(upstreams) == 2:
                break
        if len(upstreams) < 2:
            pytest.skip("all eight volumes hashed to one worker")
        again = [w.call("propagate", 300, volume=str(v), anchor=EDITED, stop_after_empty=0)["slices_encoded"]
                 for v in sent]
        assert again == [0] * len(sent)
    finally:
        w.stop()


@pytest.mark.probe("55.7", "through nginx: a volume body refused from its header")
def test_a_refused_body_goes_to_one_worker_only(stack):
    """A volume body whose header declares more voxels than a worker allows: that worker refuses
    it from its first bytes and closes the connection without reading the rest; nginx answers
    the refusal and never sends the body to the second worker."""
    import nibabel as nib

    hdr = nib.Nifti1Header()
    hdr.set_data_shape((2048, 2048, 1000))
    hdr.set_data_dtype(np.int16)
    hdr["vox_offset"] = 352
    body = hdr.binaryblock + b"\0" * 4 + b"\0" * (8 << 20)
    status, _, _ = call(stack, "POST", "/rpc", body=body,
                     headers={"Content-Type": "application/octet-stream", "X-MedVol-Volume": "refused-" + "r" * 20,
                              "X-MedVol-Request": json.dumps({"id": "big", "op": "propagate", "anchor": ANCHOR})})
    assert status in (413, 502), status
    lines = stack.nginx.access_log('"POST /rpc', "volume=refused-" + "r" * 20)
    assert len(lines) == 1 and re.search(r"upstream=127\.0\.0\.1:\d+ upstream_status=\d+ ", lines[0]), lines


def test_a_killed_worker_fails_over_to_the_other_with_the_same_mask(stack, first_round):
    """Last: it kills a worker. The holder gone, the correction round is answered by the other
    worker (which reads and encodes the volume again), with the mask the holder gave."""
    _, prop, holders = first_round
    holder = holders[0]
    other = next(w for w in stack.workers if w is not holder)
    holder.proc.kill()
    holder.proc.wait(30)
    again = volume_rpc(stack, {"id": "prop", "op": "propagate", "anchor": EDITED, "stop_after_empty": 0})
    assert again["slices_encoded"] == prop["mask"].shape[2] > 0
    assert np.array_equal(again["mask"], prop["mask"]) and int(again["mask"].sum()) > 0
    assert worker_status(other)["feature_cache"]["volumes"] >= 1
    failover = stack.nginx.access_log('"POST /rpc', "upstream_status=502, 200")  # refused by the holder, then 200
    assert len(failover) == 1, stack.nginx.access_log('"POST /rpc')[-2:]
    failover = failover[0]
    assert re.search(r"upstream=127\.0\.0\.1:\d+, 127\.0\.0\.1:\d+ upstream_status=502, 200 ", failover), failover
    assert any("upstream" in ln for ln in (stack.nginx.root / "logs" / "error.log").read_text().splitlines())

