"""A long-lived worker that keeps the models loaded: ``medvol serve`` (protocol 1).

Slicer starts ``medvol serve --stdio`` as a child process; ``medvol serve --http`` serves the
same protocol to remote clients. Models load once and stay loaded; volumes already seen (same
content sha256) are not read again.

Protocol 1
----------

Transport. ``--stdio``: one JSON object per line on stdin, one per line on stdout (UTF-8, each
line flushed; stdout carries nothing but protocol lines, logs go to stderr). ``--http``: ``POST
/rpc`` with one JSON request as the body returns its final reply as the body (progress events
are not streamed; ``GET /status`` shows the running request's stage and fraction, ``GET
/hello`` the hello result). A segment request may also send the NIfTI bytes as the body (any
content type other than JSON) with the request object in the ``X-MedVol-Request`` header.
When the server has a token (``--token-file``) every HTTP request must carry ``Authorization:
Bearer TOKEN`` (else 401 with an error envelope). HTTP status is 200 for every reply envelope,
401/404/405/411/413 for transport-level refusals (the body is still an error envelope).

Request: ``{"id": ID, "op": OP, ...fields}``. ``ID`` is a string or integer chosen by the client
(optional, echoed back). Every request gets exactly one final reply::

    {"id": ID, "ok": true,  "result": {...}}
    {"id": ID, "ok": false, "error": {"code": CODE, "message": TEXT}}

``id`` is null when the request had none or could not be read. A long request may send events
before its reply (stdio only)::

    {"id": ID, "event": "progress", "stage": STAGE, "fraction": 0..1, "message": TEXT}

with ``stage`` one of ``load``, ``read``, ``ground``, ``propagate``, ``write``.

Ops:

``hello``
    → ``{"protocol": 1, "medvolcore": VERSION, "ops": [...], "transport": "stdio"|"http"}``.
``load`` ``{preset?, adapter?, device?}``
    Loads the preset's models and keeps them (a different preset, adapter or device replaces
    the loaded one). → ``{"preset", "device", "smoke", "reloaded", "load_s"}``.
``segment`` ``{volume | volume_b64, query, preset?, out?, overwrite?, seed?, constrain?, sample?, window?, stop_after_empty?}``
    ``volume``: a path readable by the worker; over HTTP also ``volume_b64`` (base64 NIfTI bytes)
    or the request body. ``out``: where to write the mask (default: a file in the worker's
    temporary folder, removed when the worker exits). ``window``: display window, a preset name
    (``soft_tissue``, ``lung``, …) or ``[centre, width]`` in HU. ``stop_after_empty``: early stop's
    K, an integer ≥ 0 (default: the command line's default; 0 = the whole volume, the paper's way).
``propagate`` ``{volume | volume_b64, anchor, preset?, out?, overwrite?, window?, stop_after_empty?}``
    Propagates a given (e.g. edited) anchor, schema ``medvol.anchor/1`` (``boxes`` or only
    ``world``); the language model is not used.
    Results of segment and propagate: ``{"anchor", "reasoning", "timings", "smoke", "notes",
    "preset", "shape", "mask_voxels", "propagation", "mask_path"}`` over stdio, or ``"mask_b64"`` (base64
    ``.nii.gz``) over HTTP (plus ``mask_path`` when ``out`` was given). ``timings`` include
    ``load_s`` (0 when the models were already loaded), ``models_reloaded``, ``volume_cached``
    and ``request_s``. ``propagation`` (also in ``anchor``) is K and where each direction stopped.
``cancel`` ``{target}``
    Cancels request ``target``: a queued one is answered at once, a running one between slices
    (or between stages); either way it gets an error reply with code ``cancelled``. The cancel
    request's own reply is ``{"target", "found", "state": "running"|"queued"|"not_found"}``.
``status``
    Answered at once, even while a request runs: ``{"protocol", "busy", "current": {id, op,
    stage, fraction, message, elapsed_s} | null, "queued": [ids], "preset", "device", "smoke",
    "uptime_s", "cached_volumes", "cache", "requests_done", "threads", "tmp_dir", "pid"}``.
``shutdown``
    Cancels the running and queued requests, replies ``{"stopping": true}`` and exits 0.

Requests other than ``hello``, ``status``, ``cancel`` and ``shutdown`` run one at a time in
arrival order on one worker thread; the reader keeps reading meanwhile.

Error codes: ``bad_json`` (not JSON), ``bad_request`` (not an object, missing or mistyped
field), ``unknown_op``, ``too_large`` (line or body over ``--max-request-mb``),
``unauthorized``, ``not_found`` (HTTP path), ``cancelled``, ``shutting_down``, the engine's
codes (``bad_volume``, ``bad_anchor``, ``bad_input``, ``model_not_found``, ``output_exists``,
``generation_failed``, …) and ``internal`` for an unexpected failure (the worker keeps serving).

The worker stops only on ``shutdown``, end of input (after finishing the queued requests) or
SIGINT/SIGTERM (cancelling them), and removes its temporary folder.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from . import __version__
from .errors import CancelledError, MedVolError

log = logging.getLogger(__name__)

PROTOCOL = 1
OPS = ("hello", "load", "segment", "propagate", "cancel", "status", "shutdown")
IMMEDIATE_OPS = ("hello", "status", "cancel", "shutdown")
QUEUED_OPS = ("load", "segment", "propagate")
DEFAULT_MAX_REQUEST_MB = 64
DEFAULT_CACHE_SIZE = 4
SHUTDOWN_WAIT_S = 15.0


class RequestError(MedVolError):
    """The request itself is malformed (missing or mistyped field, unknown op, …)."""

    code = "bad_request"

    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        if code:
            self.code = code


# ---- JSON helpers ------------------------------------------------------------------------

def _jsonable(obj: Any) -> Any:
    """Plain JSON types only: numpy scalars/arrays converted, non-finite floats → null."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "tolist"):  # numpy scalar or array
        return _jsonable(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def dumps_line(obj: dict) -> str:
    return json.dumps(_jsonable(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def error_reply(req_id, code: str, message: str) -> dict:
    return {"id": req_id, "ok": False, "error": {"code": code, "message": message}}


def ok_reply(req_id, result: dict) -> dict:
    return {"id": req_id, "ok": True, "result": result}


def _valid_id(value) -> bool:
    return value is None or (isinstance(value, (str, int)) and not isinstance(value, bool))


def parse_request(raw) -> dict:
    """bytes/str → request dict (``id`` checked); raises RequestError with the right code."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"request is not UTF-8 text: {e}", "bad_json") from None
    try:
        req = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        raise RequestError(f"request is not valid JSON: {e}", "bad_json") from None
    if not isinstance(req, dict):
        raise RequestError(f"a request must be a JSON object {{\"id\": …, \"op\": …}}, got {type(req).__name__}")
    if not _valid_id(req.get("id")):
        req = dict(req)
        bad = req.pop("id")
        raise RequestError(f"'id' must be a string or an integer, got {type(bad).__name__}")
    return req


_MISSING = object()


def field(req: dict, name: str, types, *, required: bool = False, default=None, what: str = ""):
    """A request field, type-checked (bool is never accepted as a number)."""
    value = req.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise RequestError(f"{req.get('op')}: missing field '{name}'{what}")
        return default
    types = types if isinstance(types, tuple) else (types,)
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        names = " or ".join({"str": "a string", "int": "an integer", "bool": "true/false", "dict": "an object",
                             "list": "a list", "float": "a number"}[t.__name__] for t in types)
        raise RequestError(f"{req.get('op')}: field '{name}' must be {names}, got {type(value).__name__}")
    return value


# ---- volumes --------------------------------------------------------------------------------

def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, or of a folder's files (relative name + bytes, sorted)."""
    h = hashlib.sha256()
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(str(f.relative_to(path)).encode("utf-8") + b"\0")
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        return h.hexdigest()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class StackCache:
    """A small LRU of AxialStacks keyed by the content sha256 of the volume file."""

    def __init__(self, size: int = DEFAULT_CACHE_SIZE):
        self.size = max(0, int(size))
        self._items: "collections.OrderedDict[str, Any]" = collections.OrderedDict()
        self._stat_hash: dict = {}  # (path, size, mtime_ns) -> sha256, so a known file is not hashed again
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _key_for_path(self, path: Path) -> str:
        try:
            st = path.stat()
        except OSError as e:
            from .errors import VolumeError

            raise VolumeError(f"{path} cannot be read: {e.strerror or e}") from None
        memo = (str(path.resolve()), st.st_size, st.st_mtime_ns) if path.is_file() else None
        if memo is not None and memo in self._stat_hash:
            return self._stat_hash[memo]
        try:
            digest = file_sha256(path)
        except OSError as e:
            from .errors import VolumeError

            raise VolumeError(f"{path} cannot be read: {e.strerror or e}") from None
        if memo is not None:
            if len(self._stat_hash) > 256:
                self._stat_hash.clear()
            self._stat_hash[memo] = digest
        return digest

    def get_path(self, path) -> tuple:
        """``(stack, sha256, cached)`` for a volume path."""
        from .pipeline import as_stack

        path = Path(path)
        digest = self._key_for_path(path)
        with self._lock:
            if digest in self._items:
                self._items.move_to_end(digest)
                self.hits += 1
                return self._items[digest], digest, True
        stack = as_stack(path)
        self._put(digest, stack)
        return stack, digest, False

    def get_bytes(self, data: bytes, tmp_dir: Path) -> tuple:
        """``(stack, sha256, cached)`` for uploaded NIfTI bytes (written to ``tmp_dir`` only to be read)."""
        from .errors import VolumeError
        from .pipeline import as_stack

        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            if digest in self._items:
                self._items.move_to_end(digest)
                self.hits += 1
                return self._items[digest], digest, True
        if len(data) < 348:
            raise VolumeError(f"uploaded volume is {len(data)} bytes: too short to be a NIfTI file")
        suffix = ".nii.gz" if data[:2] == b"\x1f\x8b" else ".nii"
        fd, tmp = tempfile.mkstemp(prefix="upload-", suffix=suffix, dir=tmp_dir)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            stack = as_stack(tmp)  # a memory map of the file stays valid after the unlink (POSIX)
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        self._put(digest, stack)
        return stack, digest, False

    def _put(self, digest: str, stack) -> None:
        with self._lock:
            self.misses += 1
            if self.size == 0:
                return
            self._items[digest] = stack
            self._items.move_to_end(digest)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def describe(self) -> list:
        with self._lock:
            return [{"sha256": k, "shape_zyx": list(v.shape)} for k, v in self._items.items()]

    def __len__(self) -> int:
        return len(self._items)


# ---- the worker -----------------------------------------------------------------------------

class _Job:
    __slots__ = ("id", "op", "req", "reply", "cancel", "stage", "fraction", "message", "started", "transport", "body")

    def __init__(self, req: dict, reply: Callable[[dict], None], transport: str, body: Optional[bytes] = None):
        self.id = req.get("id")
        self.op = req.get("op")
        self.req = req
        self.reply = reply
        self.cancel = threading.Event()
        self.stage, self.fraction, self.message = "queued", 0.0, ""
        self.started = None
        self.transport = transport
        self.body = body


class Worker:
    """The engine behind ``medvol serve``: a request queue served by one thread.

    ``emit(obj)`` sends a message (reply or event) for requests submitted without their own
    ``reply`` callback (stdio). ``default_preset`` is used by segment/propagate when no preset
    is loaded and the request names none.
    """

    def __init__(self, emit: Optional[Callable[[dict], None]] = None, *, default_preset: Optional[str] = None,
                 device: str = "auto", cache_size: int = DEFAULT_CACHE_SIZE, transport: str = "stdio",
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_MB << 20, threads: Optional[int] = None):
        self.emit = emit or (lambda obj: None)
        self.default_preset = default_preset
        self.device = device
        self.transport = transport
        self.max_request_bytes = int(max_request_bytes)
        self.threads = threads
        self.cache = StackCache(cache_size)
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="medvol-serve-"))
        self.started = time.monotonic()
        self.pipeline = None
        self._pipe_key = None
        self._queue: "collections.deque[_Job]" = collections.deque()
        self._cv = threading.Condition()
        self._current: Optional[_Job] = None
        self._stopping = False
        self._draining = False
        self.requests_done = 0
        self._counter = 0
        self.stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="medvol-worker", daemon=True)
        self._thread.start()

    # -- entry points ------------------------------------------------------------------------
    def handle_line(self, raw, reply: Optional[Callable[[dict], None]] = None, body: Optional[bytes] = None,
                    transport: Optional[str] = None) -> None:
        """Handle one raw request (bytes or str): parse, check, answer or queue it."""
        reply = reply or self.emit
        try:
            req = parse_request(raw)
        except RequestError as e:
            reply(error_reply(None, e.code, str(e)))
            return
        self.handle(req, reply, body=body, transport=transport)

    def handle(self, req: dict, reply: Optional[Callable[[dict], None]] = None, body: Optional[bytes] = None,
               transport: Optional[str] = None) -> None:
        reply = reply or self.emit
        rid = req.get("id")
        op = req.get("op")
        try:
            if op is None:
                raise RequestError("missing field 'op' (one of " + ", ".join(OPS) + ")")
            if not isinstance(op, str):
                raise RequestError(f"field 'op' must be a string, got {type(op).__name__}")
            if op not in OPS:
                raise RequestError(f"unknown op {op!r}; known: {', '.join(OPS)}", "unknown_op")
            if op == "hello":
                reply(ok_reply(rid, {"protocol": PROTOCOL, "medvolcore": __version__, "ops": list(OPS),
                                     "transport": transport or self.transport}))
            elif op == "status":
                reply(ok_reply(rid, self.status()))
            elif op == "cancel":
                target = req.get("target", _MISSING)
                if target is _MISSING:
                    raise RequestError("cancel: missing field 'target' (the id of the request to cancel)")
                if target is None or not _valid_id(target):
                    raise RequestError(f"cancel: field 'target' must be a string or an integer, got {type(target).__name__}")
                reply(ok_reply(rid, self.cancel(target)))
            elif op == "shutdown":
                self.stop("shutdown requested")
                self.join(SHUTDOWN_WAIT_S)  # the running request ends at its next slice and is answered first
                reply(ok_reply(rid, {"stopping": True}))
                self.stopped.set()
            else:
                self._check_queued(req, body)
                job = _Job(req, reply, transport or self.transport, body)
                with self._cv:
                    if self._stopping:
                        raise RequestError("the worker is shutting down", "shutting_down")
                    self._queue.append(job)
                    self._cv.notify_all()
        except MedVolError as e:
            reply(error_reply(rid, e.code, str(e)))
        except Exception as e:  # never let a bad request kill the reader
            log.error("internal error on %s request %r: %s", op, rid, traceback.format_exc())
            reply(error_reply(rid, "internal", f"{type(e).__name__}: {e}"))

    def _check_queued(self, req: dict, body: Optional[bytes] = None) -> None:
        """Cheap field checks done at arrival, so a malformed request is answered at once."""
        op = req["op"]
        for name in ("preset", "adapter", "device", "out"):
            field(req, name, str)
        if op == "load":
            dev = field(req, "device", str)
            if dev is not None and dev not in ("cpu", "cuda", "auto") and not dev.startswith("cuda:"):
                raise RequestError(f"load: device must be cpu, cuda, cuda:N or auto, got {dev!r}")
            return
        field(req, "overwrite", bool)
        w = field(req, "window", (str, list))
        if isinstance(w, list) and (len(w) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in w)):
            raise RequestError(f"{op}: field 'window' must be a preset name or [centre, width] in HU, got {w!r}")
        stop_k = field(req, "stop_after_empty", int)
        if stop_k is not None:
            from .propagation import check_stop_after_empty

            try:
                check_stop_after_empty(stop_k)
            except MedVolError as e:
                raise RequestError(f"{op}: field {e}") from None
        has_b64 = field(req, "volume_b64", str) is not None or body is not None
        if field(req, "volume", str) is None and not has_b64:
            raise RequestError(f"{op}: missing field 'volume' (a path to the CT"
                               + (", or 'volume_b64' / the request body with NIfTI bytes)" if self.transport == "http" else ")"))
        if op == "segment":
            field(req, "query", str, required=True)
            field(req, "seed", int)
            field(req, "constrain", bool)
            field(req, "sample", bool)
        elif op == "propagate":
            field(req, "anchor", dict, required=True, what=" (a medvol.anchor/1 object)")

    def cancel(self, target) -> dict:
        with self._cv:
            if self._current is not None and self._current.id == target and not self._current.cancel.is_set():
                self._current.cancel.set()
                return {"target": target, "found": True, "state": "running"}
            for job in list(self._queue):
                if job.id == target:
                    self._queue.remove(job)
                    break
            else:
                job = None
        if job is not None:
            job.reply(error_reply(job.id, "cancelled", f"request {target!r} was cancelled before it started"))
            return {"target": target, "found": True, "state": "queued"}
        return {"target": target, "found": False, "state": "not_found"}

    def status(self) -> dict:
        with self._cv:
            cur = self._current
            current = None if cur is None else {
                "id": cur.id, "op": cur.op, "stage": cur.stage, "fraction": round(float(cur.fraction), 4),
                "message": cur.message,
                "elapsed_s": round(time.monotonic() - cur.started, 3) if cur.started else 0.0,
                "cancelling": cur.cancel.is_set()}
            queued = [j.id for j in self._queue]
        pipe = self.pipeline
        return {"protocol": PROTOCOL, "busy": cur is not None, "current": current, "queued": queued,
                "preset": pipe.preset if pipe else None, "device": pipe.device if pipe else None,
                "smoke": bool(pipe.smoke) if pipe else None, "uptime_s": round(time.monotonic() - self.started, 3),
                "cached_volumes": len(self.cache), "cache": self.cache.describe(),
                "requests_done": self.requests_done, "threads": self.threads, "tmp_dir": str(self.tmp_dir), "pid": os.getpid()}

    def stop(self, reason: str = "the worker is stopping") -> None:
        """Cancel the running and queued requests; no new ones are accepted."""
        with self._cv:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            if self._current is not None:
                self._current.cancel.set()
            self._cv.notify_all()
        for job in pending:
            job.reply(error_reply(job.id, "cancelled", f"request cancelled: {reason}"))

    def drain(self) -> None:
        """Finish the queued requests, then stop the worker thread (end of input)."""
        with self._cv:
            self._draining = True
            self._cv.notify_all()

    def join(self, timeout: Optional[float] = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Stop, wait for the running request to end (up to ``timeout``), remove the temp folder."""
        self.stop()
        self.join(timeout)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def preload(self, preset: str, adapter=None) -> None:
        """Queue a model load with no reply (startup ``--preset``); failures are logged."""
        def _log_reply(obj):
            if not obj.get("ok") and "error" in obj and obj["error"]["code"] != "cancelled":
                log.warning("could not preload preset %r: %s", preset, obj["error"]["message"])

        req = {"id": None, "op": "load", "preset": preset}
        if adapter:
            req["adapter"] = adapter
        with self._cv:
            self._queue.append(_Job(req, _log_reply, "internal"))
            self._cv.notify_all()

    # -- the worker thread ---------------------------------------------------------------------
    def _set_threads(self) -> None:
        """Apply ``threads`` once, before the first job (torch is imported only when work arrives)."""
        if self.threads and not getattr(self, "_threads_set", False):
            self._threads_set = True
            try:
                import torch

                torch.set_num_threads(int(self.threads))
            except Exception as e:  # noqa: BLE001 - the worker still serves
                log.warning("could not set %d CPU threads: %s", self.threads, e)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping and not self._draining:
                    self._cv.wait()
                if self._stopping or (self._draining and not self._queue):
                    return
                job = self._queue.popleft()
                self._current = job
                job.started = time.monotonic()
            try:
                self._set_threads()
                result = self._execute(job)
                reply = ok_reply(job.id, result)
            except CancelledError as e:
                reply = error_reply(job.id, "cancelled", str(e) or "request cancelled")
            except MedVolError as e:
                reply = error_reply(job.id, e.code, str(e))
            except MemoryError:
                reply = error_reply(job.id, "out_of_memory", "the worker ran out of memory for this request")
            except Exception as e:
                log.error("internal error in %s request %r:\n%s", job.op, job.id, traceback.format_exc())
                reply = error_reply(job.id, "internal", f"{type(e).__name__}: {e}")
            with self._cv:
                self._current = None
                self.requests_done += 1
            try:
                job.reply(reply)
            except Exception:  # a client that went away (HTTP) must not stop the worker
                log.warning("could not deliver the reply to request %r", job.id)

    def _progress(self, job: _Job) -> Callable[[str, float, str], None]:
        def progress(stage: str, fraction: float, message: str = "") -> None:
            job.stage, job.fraction, job.message = stage, float(fraction), str(message)
            if job.cancel.is_set():
                raise CancelledError(f"request {job.id!r} cancelled during {stage}")
            if job.transport == "stdio":
                job.reply({"id": job.id, "event": "progress", "stage": stage, "fraction": round(float(fraction), 4),
                           "message": str(message)})

        return progress

    def _execute(self, job: _Job) -> dict:
        progress = self._progress(job)
        progress("load", 0.0, "starting")
        if job.op == "load":
            req = job.req
            t = time.perf_counter()
            reloaded = self._ensure_pipeline(req.get("preset"), req.get("adapter"), req.get("device"), progress,
                                             explicit=True)
            return {"preset": self.pipeline.preset, "device": self.pipeline.device, "smoke": bool(self.pipeline.smoke),
                    "reloaded": reloaded, "load_s": round(time.perf_counter() - t, 4),
                    "load_detail_s": dict(self.pipeline.load_seconds)}
        return self._run_volume_job(job, progress)

    def _ensure_pipeline(self, preset, adapter, device, progress, explicit=False) -> bool:
        """Make sure a pipeline is loaded for ``preset``; True when models were (re)loaded now."""
        from .pipeline import Pipeline

        if preset is None and not explicit and self.pipeline is not None:
            return False
        preset = preset or (self.pipeline.preset if self.pipeline is not None else None) or self.default_preset
        if preset is None:
            from .models import default_preset

            preset = default_preset()
        if not explicit and self.pipeline is not None and preset == self.pipeline.preset:
            return False
        key = (preset, str(adapter) if adapter else None, device or self.device)
        if self.pipeline is not None and key == self._pipe_key and self.pipeline.load_seconds.keys() >= {"grounder", "medsam2"}:
            return False
        progress("load", 0.0, f"loading preset {preset}")
        pipe = Pipeline(preset, adapter=adapter, device=device or self.device)
        old, self.pipeline = self.pipeline, None
        del old
        self._free_device_memory()
        pipe.load()
        self.pipeline, self._pipe_key = pipe, key
        progress("load", 1.0, f"preset {pipe.preset} loaded on {pipe.device}")
        return True

    @staticmethod
    def _free_device_memory() -> None:
        import gc
        import sys

        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _stack_for(self, job: _Job, progress) -> tuple:
        req = job.req
        b64 = req.get("volume_b64")
        if b64 is not None:
            try:
                data = base64.b64decode(b64, validate=True)
            except (ValueError, TypeError) as e:
                raise RequestError(f"{job.op}: 'volume_b64' is not valid base64: {e}") from None
            progress("read", 0.0, f"reading the uploaded volume ({len(data)} bytes)")
            return self.cache.get_bytes(data, self.tmp_dir)
        if req.get("volume") is None and job.body is not None:
            progress("read", 0.0, f"reading the uploaded volume ({len(job.body)} bytes)")
            return self.cache.get_bytes(job.body, self.tmp_dir)
        path = Path(os.path.expanduser(req["volume"]))
        progress("read", 0.0, f"reading {path.name}")
        return self.cache.get_path(path)

    def _out_path(self, job: _Job) -> tuple:
        out = job.req.get("out")
        if out:
            return Path(os.path.expanduser(out)), bool(job.req.get("overwrite", False)), False
        self._counter += 1
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(job.id))[:40] if job.id is not None else "req"
        return self.tmp_dir / f"{job.op}-{self._counter:04d}-{safe}.nii.gz", False, True

    def _run_volume_job(self, job: _Job, progress) -> dict:
        from .volume import save_mask

        req = job.req
        t0 = time.perf_counter()
        t = time.perf_counter()
        reloaded = self._ensure_pipeline(req.get("preset"), None, None, progress)
        load_s = time.perf_counter() - t if reloaded else 0.0
        t = time.perf_counter()
        stack, digest, cached = self._stack_for(job, progress)
        read_s = time.perf_counter() - t
        progress("read", 1.0, "volume from cache" if cached else "volume read")
        out, overwrite, is_temp = self._out_path(job)
        if not is_temp:
            from .fileio import check_output

            check_output(out, overwrite)  # before the long work
        window = req.get("window")
        if isinstance(window, list):
            window = tuple(window)
        pipe = self.pipeline
        if job.op == "segment":
            seg = pipe.segment(stack, req["query"], constrain=req.get("constrain", True), seed=req.get("seed"),
                               do_sample=bool(req.get("sample", False)), hu_window=window, progress=progress,
                               cancel=job.cancel, stop_after_empty=req.get("stop_after_empty"))
        else:
            seg = pipe.repropagate(stack, req["anchor"], hu_window=window, progress=progress, cancel=job.cancel,
                                   stop_after_empty=req.get("stop_after_empty"))
        if job.cancel.is_set():
            raise CancelledError(f"request {job.id!r} cancelled")
        progress("write", 0.0, "writing the mask")
        t = time.perf_counter()
        result = {"anchor": seg.anchor.to_dict(), "reasoning": seg.reasoning, "smoke": bool(seg.smoke),
                  "notes": list(seg.notes), "preset": seg.preset, "volume_sha256": digest,
                  "shape": list(stack.volume.shape), "mask_voxels": int(seg.mask.sum()),
                  "propagation": seg.anchor.propagation}
        save_mask(seg.mask, stack.volume, out, overwrite=overwrite)
        if job.transport == "http":
            result["mask_b64"] = base64.b64encode(out.read_bytes()).decode("ascii")
            if is_temp:
                out.unlink()
            else:
                result["mask_path"] = str(out)
        else:
            result["mask_path"] = str(out)
        timings = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in seg.timings.items()}
        timings.update(load_s=round(load_s, 4), models_reloaded=reloaded, volume_cached=cached,
                       volume_read_s=round(read_s, 4), write_s=round(time.perf_counter() - t, 4),
                       request_s=round(time.perf_counter() - t0, 4))
        result["timings"] = timings
        progress("write", 1.0, "done")
        return result
