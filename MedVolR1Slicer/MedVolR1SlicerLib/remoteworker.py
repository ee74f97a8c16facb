"""The client of a remote worker (``medvol serve --http``, protocol 1): :class:`RemoteWorker`,
with the interface of :mod:`.client`'s workers.

A request about a volume carries ``X-MedVol-Volume``, the sha256 of the volume bytes it sends
(its status polls and its cancel carry the same), so that a load balancer in front of several
workers sends every request about one volume to the worker that holds its encoded slices
(``docs/deploy.md``). Each volume key has its own session, opened by a ``hello`` that carries the
key, so the session is that worker's: a worker knows only the sessions it issued, and the job's
status polls must find the job in its session.
"""

from __future__ import annotations

import base64
import collections
import gzip
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from .client import MASK_TYPE, REPLY_HEADER, SESSION_HEADER, UPLOAD_GZIP_LEVEL, Job, WorkerError, _BaseWorker

VOLUME_HEADER = "X-MedVol-Volume"  # the affinity key: the sha256 of the volume bytes sent
KEY_SESSIONS = 32  # sessions kept, one per recent volume key (each from the worker holding that volume)


class RemoteWorker(_BaseWorker):
    """A worker on another machine: ``medvol serve --http`` at ``url`` (``http://host:port``).

    Segment and propagate requests send the local volume file as the request body, gzip-compressed
    (a ``.nii`` is compressed into this client's folder first; the worker checks the voxel limit
    from the header before decompressing the rest), and ask for the mask as the reply body
    (``Accept: application/gzip``); the mask is written to a local temporary file, so callers
    see ``mask_path`` as with a local worker. An older worker that answers with ``mask_b64`` in
    JSON is understood too.
    Progress comes from polling ``GET /status``. The server scopes ``status`` and ``cancel`` to
    a session: the first reply carries a session id (``X-MedVol-Session``), sent back on every
    later request, so this client sees and cancels its own requests only.
    """

    def __init__(self, url: str, token: Optional[str] = None, timeout_s: float = 3600.0,
                 status_interval_s: float = 1.0, cancel_grace_s: float = 10.0, tmp_dir: Optional[str] = None):
        super().__init__(cancel_grace_s)
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise WorkerError("bad_request", f"a remote worker address must start with http:// or https://, got {url!r}")
        self.url = url
        self.token = token or None
        self.timeout_s = timeout_s
        self.status_interval_s = status_interval_s
        # masks the server sends back land here; a folder this client made is removed by stop()
        # (they are patient data and must not pile up in the system's temp folder)
        self._owns_tmp = tmp_dir is None
        self.tmp_dir = Path(tmp_dir or tempfile.mkdtemp(prefix="medvol-remote-"))
        self.session: Optional[str] = None
        self._session_lock = threading.Lock()
        self._gzip_cache = None  # ((path, size, mtime_ns), the gzip bytes sent, their sha256, a copy made here)
        self._affinity: dict = {}  # job id -> the sha256 of the volume it sent (X-MedVol-Volume)
        self._key_sessions = collections.OrderedDict()  # volume key -> the session opened for it
        self._gzip_lock = threading.Lock()

    @property
    def running(self) -> bool:
        return True

    def _headers(self, content_type: str = "application/json", job: Optional[Job] = None) -> dict:
        """A request's headers; with ``job``'s volume key (``X-MedVol-Volume``) when it has one,
        and the session opened for that key."""
        h = {"Content-Type": content_type}
        key = self._affinity.get(job.id) if job is not None else None
        if key:
            h[VOLUME_HEADER] = key
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        sid = self._key_sessions.get(key) if key else self.session
        if sid:
            h[SESSION_HEADER] = sid
        return h

    def _ensure_session(self, key: Optional[str] = None) -> Optional[dict]:
        """Get a session id before the first request (status polls share it); the hello's reply,
        if sent now. With a volume ``key``, the session comes from a hello carrying that key:
        behind a load balancer it is issued by the worker that will hold the volume, so the job's
        status polls, its cancel and later rounds on the volume are that worker's session."""
        with self._session_lock:
            if key is not None and key not in self._key_sessions:
                headers = self._headers()
                headers[VOLUME_HEADER] = key
                headers.pop(SESSION_HEADER, None)
                return self._http("POST", "/rpc", json.dumps({"id": "session", "op": "hello"}).encode("utf-8"),
                                  headers, timeout=30)
            if key is None and self.session is None:
                return self._http("POST", "/rpc", json.dumps({"id": "session", "op": "hello"}).encode("utf-8"),
                                  timeout=30)
        return None

    def _keep_session(self, headers, sent: Optional[dict] = None) -> None:
        """Keep the session id of a reply: the session of the volume key the request carried, or
        the client's own."""
        sid = headers.get(SESSION_HEADER) if headers is not None else None
        if not sid:
            return
        key = (sent or {}).get(VOLUME_HEADER)
        if key:
            self._key_sessions[key] = sid
            self._key_sessions.move_to_end(key)
            while len(self._key_sessions) > KEY_SESSIONS:
                self._key_sessions.popitem(last=False)
        else:
            self.session = sid

    def _http(self, method: str, path: str, data=None, headers: Optional[dict] = None,
              timeout: Optional[float] = None, mask_to: Optional[Path] = None) -> dict:
        """One request; its reply envelope. ``data``: bytes or a binary file (sent with its
        ``Content-Length`` in the headers). ``mask_to``: where a mask sent as the reply body
        (``Content-Type: application/gzip``, the envelope in ``X-MedVol-Reply``) is written; its
        result then has ``mask_path``."""
        headers = headers or self._headers()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as r:
                self._keep_session(r.headers, headers)
                if mask_to is not None and (r.headers.get("Content-Type") or "").startswith(MASK_TYPE):
                    return self._mask_reply(r, mask_to)
                body = r.read()
        except urllib.error.HTTPError as e:
            body = e.read()
            self._keep_session(e.headers, headers)
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise WorkerError("connection", f"cannot reach the MedVol worker at {self.url}: {reason}") from None
        try:
            return json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise WorkerError("connection", f"{self.url} did not answer with MedVol JSON; is it a `medvol serve --http` "
                                            "worker?") from None

    def _mask_reply(self, r, mask_to: Path) -> dict:
        """A reply whose body is the mask: the body goes to ``mask_to`` in 1 MB chunks."""
        try:
            reply = json.loads(r.headers.get(REPLY_HEADER) or "")
        except json.JSONDecodeError:
            reply = None
        if not isinstance(reply, dict) or not isinstance(reply.get("result"), dict):
            raise WorkerError("connection", f"{self.url} sent a mask without a readable {REPLY_HEADER} header")
        part = mask_to.with_name(mask_to.name + ".part")
        with open(part, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        os.replace(part, mask_to)
        reply["result"]["mask_path"] = str(mask_to)
        return reply

    def _gzipped(self, volume: str) -> tuple:
        """``volume`` as the gzip bytes the request sends, and their sha256 (the affinity key):
        a ``.nii.gz`` (or any file that is gzip already) as it is, a ``.nii`` compressed into this
        client's folder (level :data:`UPLOAD_GZIP_LEVEL`, no file name or time in the gzip
        header). Either is reused while the file keeps its size and modification time; only the
        latest one is kept (it is patient data)."""
        src = Path(volume)
        with open(src, "rb") as f:
            is_gzip = f.read(2) == b"\x1f\x8b"
            st = os.fstat(f.fileno())
        key = (str(src.resolve()), st.st_size, st.st_mtime_ns)
        with self._gzip_lock:
            cached = self._gzip_cache
            if cached is not None and cached[0] == key and cached[1].is_file():
                return cached[1], cached[2]
            if cached is not None and cached[3]:  # a copy made here; never the user's own .nii.gz
                cached[1].unlink(missing_ok=True)
            self._gzip_cache = None
            if is_gzip:
                digest = hashlib.sha256()
                with open(src, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        digest.update(chunk)
                self._gzip_cache = (key, src, digest.hexdigest(), False)
                return src, digest.hexdigest()
            fd, name = tempfile.mkstemp(prefix="upload-", suffix=".nii.gz", dir=self.tmp_dir)
            try:
                with open(src, "rb") as fin, os.fdopen(fd, "wb") as raw:
                    hashed = _HashingWriter(raw)
                    with gzip.GzipFile(filename="", mode="wb", fileobj=hashed, compresslevel=UPLOAD_GZIP_LEVEL,
                                       mtime=0) as gz:
                        shutil.copyfileobj(fin, gz, 1 << 20)
            except BaseException:
                Path(name).unlink(missing_ok=True)
                raise
            self._gzip_cache = (key, Path(name), hashed.digest.hexdigest(), True)
            return Path(name), self._gzip_cache[2]

    def submit(self, op: str, **fields) -> Job:
        job = self._new_job(op, fields)
        threading.Thread(target=self._run, args=(job,), daemon=True, name=f"medvol-{job.id}").start()
        return job

    def _run(self, job: Job) -> None:
        stop = threading.Event()
        try:
            first = self._ensure_session()
            # a hello that opened the session is this request's answer: it is not sent twice
            reply = first if job.op == "hello" and first is not None else self._post(job, stop)
        except WorkerError as e:
            reply = {"id": job.id, "ok": False, "error": {"code": e.code, "message": e.message}}
        except OSError as e:
            reply = {"id": job.id, "ok": False, "error": {"code": "bad_input", "message": f"cannot read the volume: {e}"}}
        finally:
            stop.set()
        reply["id"] = job.id
        self._inbox.put(("msg", reply))
        self._affinity.pop(job.id, None)

    def _post(self, job: Job, stop: threading.Event) -> dict:
        """Send ``job`` (a CT as the body) and return the reply; ``/status`` is polled until ``stop``."""
        req, body, mask_to = dict(job.request), None, None
        try:
            volume = req.get("volume")
            if volume is not None and job.op in ("segment", "propagate"):
                del req["volume"]
                upload, digest = self._gzipped(volume)
                self._affinity[job.id] = digest
                self._ensure_session(digest)
                body = open(upload, "rb")
                headers = self._headers("application/octet-stream", job)
                headers["Content-Length"] = str(os.fstat(body.fileno()).st_size)  # streamed, never chunked
                headers["X-MedVol-Request"] = json.dumps(req).replace("%", "%25")  # ASCII, percent-decoded
                headers["Accept"] = MASK_TYPE + ", application/json"  # the mask as bytes, not base64
                data, mask_to = body, self.tmp_dir / f"{job.id}.mask.nii.gz"
            else:
                data, headers = json.dumps(req).encode("utf-8"), self._headers(job=job)
            if job.op in ("load", "segment", "propagate"):
                threading.Thread(target=self._watch_status, args=(job, stop), daemon=True).start()
            return self._http("POST", "/rpc", data, headers, mask_to=mask_to)
        finally:
            if body is not None:
                body.close()

    def _watch_status(self, job: Job, stop: threading.Event) -> None:
        while not stop.wait(self.status_interval_s):
            try:
                st = self._http("GET", "/status", headers=self._headers(job=job), timeout=10).get("result") or {}
            except WorkerError:
                continue
            cur = st.get("current") or {}
            if cur.get("id") == job.id and not stop.is_set():
                self._inbox.put(("msg", {"id": job.id, "event": "progress", "stage": cur.get("stage"),
                                         "fraction": cur.get("fraction") or 0.0, "message": cur.get("message")}))

    def _on_result(self, job: Job, result: dict) -> None:
        b64 = result.pop("mask_b64", None)
        if b64 is not None:
            out = self.tmp_dir / f"{job.id}.mask.nii.gz"
            out.write_bytes(base64.b64decode(b64))
            result["mask_path"] = str(out)
        job._finish(result=result)

    def cancel(self, job: Job) -> None:
        if job.done or job.cancel_requested_at is not None:
            return
        job.cancel_requested_at = time.monotonic()
        body = json.dumps({"id": f"{job.id}-cancel", "op": "cancel", "target": job.id}).encode("utf-8")
        headers = self._headers(job=job)  # to the worker that runs it, behind a load balancer
        threading.Thread(target=lambda: self._quiet_post(body, headers), daemon=True).start()

    def _quiet_post(self, body: bytes, headers: dict) -> None:
        try:
            self._http("POST", "/rpc", body, headers, timeout=30)
        except WorkerError:
            pass

    def _check_cancel_deadlines(self) -> None:
        now = time.monotonic()
        for j in self.pending:
            if j.cancel_requested_at is not None and now - j.cancel_requested_at > self.cancel_grace_s:
                # a remote process cannot be killed from here; stop waiting for it
                j._finish(error=WorkerError("cancelled", "cancelled; the remote worker may still be finishing it"))

    def stop(self, timeout: float = 10.0) -> None:
        for j in self.pending:
            j._finish(error=WorkerError("cancelled", "the connection was closed"))
        self._jobs.clear()
        if self._owns_tmp:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)


class _HashingWriter:
    """A binary file that hashes what is written to it (the gzip bytes, as they are written)."""

    def __init__(self, raw):
        self.raw = raw
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()
