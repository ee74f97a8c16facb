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
401/403/404/405/411/413/415/503 for transport-level refusals (the body is still an error envelope).

HTTP sessions. Every HTTP reply carries an ``X-MedVol-Session`` header: the session id the
server issued to this client (a new one when the request carried none, or one the server does
not know). A client sends it back on later requests; ``cancel`` and ``status`` only see the
requests of the caller's own session (a client cannot cancel, or see, another's work).
``hello`` also returns it as ``session``.

Trust boundary. Over stdio the worker serves its parent (Slicer) and takes server paths
(``volume``, ``out``). Over HTTP a client sends the volume in the request and gets the mask in
the reply; server paths are refused (code ``forbidden``) unless the operator started the server
with ``--data-dir DIR``, and then only paths that resolve (symbolic links followed) inside DIR,
relative paths being relative to DIR. Replies over HTTP carry no absolute server path. Every
input is bounded before work starts: request size (``--max-request-mb``), declared voxels
(``--max-voxels``, checked in the header before decompressing), boxes per anchor (8), files in
a DICOM folder; only regular files and folders are read; reading and propagation honour
cancel; an HTTP request whose client disconnected is cancelled.

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
    → ``{"protocol": 1, "medvolcore": VERSION, "ops": [...], "transport": "stdio"|"http"}``
    (plus ``"session"`` over HTTP).
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
    Cancels request ``target`` of the caller's session: a queued one is answered at once, a
    running one between slices (or between stages); either way it gets an error reply with
    code ``cancelled``. The cancel request's own reply is ``{"target", "found", "state":
    "running"|"queued"|"not_found"}`` (another session's request is ``not_found``).
``status``
    Answered at once, even while a request runs: ``{"protocol", "busy", "current": {id, op,
    stage, fraction, message, elapsed_s} | null, "queued": [ids], "queue_length", "preset",
    "device", "smoke", "uptime_s", "cached_volumes", "requests_done", "threads"}``; ``current``
    and ``queued`` show only the caller's own requests (``busy`` and ``queue_length`` count
    everyone's). Over stdio also ``"cache"`` (content hashes and shapes), ``"tmp_dir"`` and ``"pid"``.
``shutdown``
    Cancels the running and queued requests, replies ``{"stopping": true}`` and exits 0.

Requests other than ``hello``, ``status``, ``cancel`` and ``shutdown`` run one at a time in
arrival order on one worker thread; the reader keeps reading meanwhile.

Error codes: ``bad_json`` (not JSON), ``bad_request`` (not an object, missing or mistyped
field), ``unknown_op``, ``too_large`` (line or body over ``--max-request-mb``, volume over
``--max-voxels``, too many boxes or files), ``unauthorized``, ``forbidden`` (a server path over
HTTP, a foreign ``Origin`` or ``Host``), ``not_found`` (HTTP path), ``cancelled``,
``shutting_down``, the engine's codes (``bad_volume``, ``bad_anchor``, ``bad_input``,
``bad_output``, ``model_not_found``, ``output_exists``, ``generation_failed``, …) and
``internal`` for an unexpected failure: its reply says only ``internal error (ref R)``, the
details go to the worker's log under that reference, and the worker keeps serving.

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
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from . import __version__
from .errors import CancelledError, ForbiddenError, LimitError, MedVolError, VolumeError

log = logging.getLogger(__name__)

PROTOCOL = 1
OPS = ("hello", "load", "segment", "propagate", "cancel", "status", "shutdown")
IMMEDIATE_OPS = ("hello", "status", "cancel", "shutdown")
QUEUED_OPS = ("load", "segment", "propagate")
DEFAULT_MAX_REQUEST_MB = 64
DEFAULT_CACHE_SIZE = 4
DEFAULT_MAX_VOXELS = 1024 * 1024 * 2000  # a 1024×1024 CT of 2000 slices (8 GB as float32)
SHUTDOWN_WAIT_S = 15.0
MAX_ID_CHARS = 256
MAX_ID_INT = 2 ** 63  # request ids are echoed back: keep them small and printable


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


def _valid_unicode(obj: Any) -> Any:
    """``obj`` with every string made encodable (a lone surrogate becomes U+FFFD)."""
    if isinstance(obj, str):
        return obj.encode("utf-8", "replace").decode("utf-8")
    if isinstance(obj, dict):
        return {_valid_unicode(k): _valid_unicode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_valid_unicode(v) for v in obj]
    return obj


def encode_line(obj: dict) -> bytes:
    """One protocol line as UTF-8 bytes (with the newline); never fails on a lone surrogate."""
    try:
        return (dumps_line(obj) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (dumps_line(_valid_unicode(_jsonable(obj))) + "\n").encode("utf-8")


def error_reply(req_id, code: str, message: str) -> dict:
    return {"id": req_id, "ok": False, "error": {"code": code, "message": message}}


def ok_reply(req_id, result: dict) -> dict:
    return {"id": req_id, "ok": True, "result": result}


def _valid_id(value) -> bool:
    if value is None:
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -MAX_ID_INT < value < MAX_ID_INT
    return isinstance(value, str) and len(value) <= MAX_ID_CHARS and _is_unicode(value)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _describe_bad_id(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"'id' must be an integer of at most 63 bits or a string, got an integer of {len(str(abs(value)))} digits"
    if isinstance(value, str):
        return (f"'id' must be at most {MAX_ID_CHARS} characters, got {len(value)}" if len(value) > MAX_ID_CHARS
                else "'id' is not valid Unicode text (a lone surrogate)")
    return f"'id' must be a string or an integer, got {type(value).__name__}"


def parse_request(raw) -> dict:
    """bytes/str → request dict (``id`` checked); raises RequestError with the right code."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"request is not UTF-8 text: {e}", "bad_json") from None
    try:
        req = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, or an integer over Python's digit limit
        raise RequestError(f"request is not valid JSON: {str(e)[:200]}", "bad_json") from None
    if not isinstance(req, dict):
        raise RequestError(f"a request must be a JSON object {{\"id\": …, \"op\": …}}, got {type(req).__name__}")
    if not _valid_id(req.get("id")):
        raise RequestError(_describe_bad_id(req.get("id")))
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
    if isinstance(value, str) and not _is_unicode(value):
        raise RequestError(f"{req.get('op')}: field '{name}' is not valid Unicode text (a lone surrogate)", "bad_input")
    if isinstance(value, int) and not isinstance(value, bool) and not -MAX_ID_INT < value < MAX_ID_INT:
        raise RequestError(f"{req.get('op')}: field '{name}' is out of range")
    return value


# ---- volumes --------------------------------------------------------------------------------

def _hash_file(path: Path, h, cancel=None) -> None:
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"reading {path.name} was cancelled")
            h.update(chunk)


def file_sha256(path: Path, cancel=None) -> str:
    """sha256 of a regular file's bytes, or of a folder's own regular files (name + bytes, sorted).

    Only regular files are read (never a device or FIFO, which could block for ever); a folder
    is not walked recursively (a DICOM series is one folder) and holds at most
    ``volume.MAX_DICOM_FILES`` entries. ``cancel`` is checked between 1 MB chunks.
    """
    from .volume import MAX_DICOM_FILES

    h = hashlib.sha256()
    st = path.stat()
    if stat.S_ISDIR(st.st_mode):
        names = []
        with os.scandir(path) as it:
            for entry in it:
                names.append(entry.name)
                if len(names) > MAX_DICOM_FILES:
                    raise LimitError(f"{path.name} holds more than {MAX_DICOM_FILES} files; give the folder of one "
                                     "DICOM series")
        for name in sorted(names):
            f = path / name
            if f.is_file() and not f.is_symlink():
                h.update(name.encode("utf-8", "surrogateescape") + b"\0")
                _hash_file(f, h, cancel)
        return h.hexdigest()
    if not stat.S_ISREG(st.st_mode):
        raise VolumeError(f"{path} is not a regular file or folder (a device, FIFO or socket); give a CT file or "
                          "a DICOM folder")
    _hash_file(path, h, cancel)
    return h.hexdigest()


class StackCache:
    """A small LRU of AxialStacks keyed by the content sha256 of the volume file.

    ``get_path`` / ``get_bytes`` return a stack without keeping it; the caller adds it with
    :meth:`put` once its request succeeded, so a volume from a failed or cancelled request (say, a
    decompression bomb) is never held in memory.
    """

    def __init__(self, size: int = DEFAULT_CACHE_SIZE, max_voxels: Optional[int] = DEFAULT_MAX_VOXELS):
        self.size = max(0, int(size))
        self.max_voxels = max_voxels
        self._items: "collections.OrderedDict[str, Any]" = collections.OrderedDict()
        self._stat_hash: dict = {}  # (path, size, mtime_ns) -> sha256, so a known file is not hashed again
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _key_for_path(self, path: Path, cancel=None) -> str:
        try:
            st = path.stat()
        except OSError as e:
            raise VolumeError(f"{path} cannot be read: {e.strerror or e}") from None
        memo = (str(path.resolve()), st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None
        if memo is not None and memo in self._stat_hash:
            return self._stat_hash[memo]
        try:
            digest = file_sha256(path, cancel)
        except OSError as e:
            raise VolumeError(f"{path} cannot be read: {e.strerror or e}") from None
        if memo is not None:
            if len(self._stat_hash) > 256:
                self._stat_hash.clear()
            self._stat_hash[memo] = digest
        return digest

    def _cached(self, digest: str):
        with self._lock:
            if digest in self._items:
                self._items.move_to_end(digest)
                self.hits += 1
                return self._items[digest]
        return None

    def get_path(self, path, cancel=None) -> tuple:
        """``(stack, sha256, cached)`` for a volume path (not added to the cache: see :meth:`put`)."""
        from .stack import AxialStack
        from .volume import load_volume

        path = Path(path)
        digest = self._key_for_path(path, cancel)
        stack = self._cached(digest)
        if stack is not None:
            return stack, digest, True
        self.misses += 1
        return AxialStack(load_volume(path, max_voxels=self.max_voxels, cancel=cancel)), digest, False

    def get_bytes(self, data: bytes, tmp_dir: Path, cancel=None) -> tuple:
        """``(stack, sha256, cached)`` for uploaded NIfTI bytes (written to ``tmp_dir`` only to be read)."""
        from .stack import AxialStack
        from .volume import load_volume

        digest = hashlib.sha256(data).hexdigest()
        stack = self._cached(digest)
        if stack is not None:
            return stack, digest, True
        if len(data) < 348:
            raise VolumeError(f"uploaded volume is {len(data)} bytes: too short to be a NIfTI file")
        self.misses += 1
        suffix = ".nii.gz" if data[:2] == b"\x1f\x8b" else ".nii"
        fd, tmp = tempfile.mkstemp(prefix="upload-", suffix=suffix, dir=tmp_dir)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            stack = AxialStack(load_volume(tmp, max_voxels=self.max_voxels, cancel=cancel))
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return stack, digest, False

    def put(self, digest: str, stack) -> None:
        with self._lock:
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


def _release_memory() -> None:
    """Give freed memory back to the OS after a failed request (glibc keeps freed heap otherwise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# ---- the worker -----------------------------------------------------------------------------

class _Job:
    __slots__ = ("id", "op", "req", "reply", "cancel", "stage", "fraction", "message", "started", "transport", "body",
                 "session")

    def __init__(self, req: dict, reply: Callable[[dict], None], transport: str, body: Optional[bytes] = None,
                 session: Optional[str] = None):
        self.session = session
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
    is loaded and the request names none. ``data_dir``: the only folder whose files HTTP
    requests may name (None: no server path over HTTP). ``max_voxels``: the largest volume
    accepted, checked in its header before reading.
    """

    def __init__(self, emit: Optional[Callable[[dict], None]] = None, *, default_preset: Optional[str] = None,
                 device: str = "auto", cache_size: int = DEFAULT_CACHE_SIZE, transport: str = "stdio",
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_MB << 20, threads: Optional[int] = None,
                 data_dir=None, max_voxels: Optional[int] = DEFAULT_MAX_VOXELS):
        self.emit = emit or (lambda obj: None)
        self.default_preset = default_preset
        self.device = device
        self.transport = transport
        self.max_request_bytes = int(max_request_bytes)
        self.threads = threads
        self.data_dir = Path(os.path.realpath(data_dir)) if data_dir is not None else None
        self.max_voxels = max_voxels
        self.cache = StackCache(cache_size, max_voxels)
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
                    transport: Optional[str] = None, session: Optional[str] = None) -> Optional[_Job]:
        """Handle one raw request (bytes or str): parse, check, answer or queue it.

        Never raises: whatever the input, exactly one reply goes to ``reply``. Returns the
        queued job (so an HTTP handler can cancel it when its client goes away), else None.
        """
        reply = reply or self.emit
        try:
            req = parse_request(raw)
        except RequestError as e:
            reply(error_reply(None, e.code, str(e)))
            return None
        except Exception:  # noqa: BLE001 - nothing a client sends may stop the reader
            reply(self._internal_reply(None, "parsing a request"))
            return None
        return self.handle(req, reply, body=body, transport=transport, session=session)

    def handle(self, req: dict, reply: Optional[Callable[[dict], None]] = None, body: Optional[bytes] = None,
               transport: Optional[str] = None, session: Optional[str] = None) -> Optional[_Job]:
        reply = reply or self.emit
        transport = transport or self.transport
        rid = req.get("id")
        op = req.get("op")
        job = None
        try:
            if op is None:
                raise RequestError("missing field 'op' (one of " + ", ".join(OPS) + ")")
            if not isinstance(op, str):
                raise RequestError(f"field 'op' must be a string, got {type(op).__name__}")
            if op not in OPS:
                raise RequestError(f"unknown op {op!r}; known: {', '.join(OPS)}", "unknown_op")
            if op == "hello":
                hello = {"protocol": PROTOCOL, "medvolcore": __version__, "ops": list(OPS), "transport": transport}
                if session is not None:
                    hello["session"] = session
                reply(ok_reply(rid, hello))
            elif op == "status":
                reply(ok_reply(rid, self.status(session, transport)))
            elif op == "cancel":
                target = req.get("target", _MISSING)
                if target is _MISSING:
                    raise RequestError("cancel: missing field 'target' (the id of the request to cancel)")
                if target is None or not _valid_id(target):
                    raise RequestError(f"cancel: field 'target' must be a string or an integer, got {type(target).__name__}")
                reply(ok_reply(rid, self.cancel(target, session)))
            elif op == "shutdown":
                self.stop("shutdown requested")
                self.join(SHUTDOWN_WAIT_S)  # the running request ends at its next slice and is answered first
                reply(ok_reply(rid, {"stopping": True}))
                self.stopped.set()
            else:
                self._check_queued(req, body, transport)
                job = _Job(req, reply, transport, body, session)
                with self._cv:
                    if self._stopping:
                        raise RequestError("the worker is shutting down", "shutting_down")
                    self._queue.append(job)
                    self._cv.notify_all()
                return job
        except MedVolError as e:
            reply(error_reply(rid, e.code, self.public_message(str(e), transport)))
        except Exception:  # never let a bad request kill the reader
            reply(self._internal_reply(rid, f"a {op!r} request"))
        return None

    @staticmethod
    def _internal_reply(rid, what: str) -> dict:
        """The reply to an unexpected failure: a reference, no exception text (that goes to the log)."""
        ref = secrets.token_hex(4)
        log.error("internal error (ref %s) in %s:\n%s", ref, what, traceback.format_exc())
        return error_reply(rid, "internal", f"internal error (ref {ref}); the worker's log has the details")

    def public_message(self, text: str, transport: Optional[str] = None) -> str:
        """An error message fit for the client: over HTTP, no absolute server path.

        Paths inside ``--data-dir`` become relative to it, the upload temporary file becomes
        "the uploaded volume", and any other absolute path is cut to its last component.
        """
        if (transport or self.transport) != "http":
            return text
        tmp = re.escape(str(self.tmp_dir))
        text = re.sub(tmp + r"[^\s'\":,;()]*", "the uploaded volume", text)
        if self.data_dir is not None:
            root = str(self.data_dir)
            text = text.replace(root + os.sep, "").replace(root, ".")
        return re.sub(r"(?<![\w.~])/(?:[^\s'\":,;()/]+/)+([^\s'\":,;()/]+)", r"\1", text)

    def client_path(self, value: str, transport: str, what: str) -> Path:
        """A path named by a client. Over stdio: as given (``~`` expanded). Over HTTP: only
        with ``--data-dir``, resolved (symbolic links followed, relative to the data folder)
        and refused unless inside it. Refusals happen before anything is looked up, so they
        tell nothing about which server files exist."""
        if transport != "http":
            return Path(os.path.expanduser(value))
        if self.data_dir is None:
            raise ForbiddenError(f"'{what}' names a file on the server, which this server does not allow; send the "
                                 "volume in the request (volume_b64 or the request body) and take the mask from the "
                                 "reply (an operator can allow one folder with `medvol serve --data-dir DIR`)")
        if "\0" in value:
            raise ForbiddenError(f"'{what}' is not a usable path")
        full = os.path.realpath(os.path.join(self.data_dir, value))
        if os.path.commonpath([full, str(self.data_dir)]) != str(self.data_dir):
            raise ForbiddenError(f"'{what}' {value!r} is outside the server's data folder")
        return Path(full)

    def _check_queued(self, req: dict, body: Optional[bytes], transport: str) -> None:
        """Cheap field checks done at arrival, so a malformed request is answered at once."""
        op = req["op"]
        for name in ("preset", "adapter", "device", "out", "volume_b64"):
            field(req, name, str)
        if transport == "http" and field(req, "adapter", str) is not None:
            raise ForbiddenError("'adapter' names a folder on the server, which HTTP clients may not choose; "
                                 "start the server with --adapter")
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
        volume = field(req, "volume", str)
        if volume is None and not has_b64:
            raise RequestError(f"{op}: missing field 'volume' (a path to the CT"
                               + (", or 'volume_b64' / the request body with NIfTI bytes)" if transport == "http" else ")"))
        out = field(req, "out", str)
        vol_path = self.client_path(volume, transport, "volume") if volume is not None else None
        out_path = self.client_path(out, transport, "out") if out is not None else None
        if out_path is not None:
            from .fileio import MASK_SUFFIXES, check_distinct

            if not out_path.name.lower().endswith(MASK_SUFFIXES):
                raise RequestError(f"{op}: 'out' must end in {', '.join(MASK_SUFFIXES)}", "bad_output")
            check_distinct([("out", out_path)], [("volume", vol_path)])
        if op == "segment":
            field(req, "query", str, required=True)
            field(req, "seed", int)
            field(req, "constrain", bool)
            field(req, "sample", bool)
        elif op == "propagate":
            field(req, "anchor", dict, required=True, what=" (a medvol.anchor/1 object)")

    def cancel(self, target, session: Optional[str] = None) -> dict:
        """Cancel request ``target`` of ``session`` (another session's request is not found)."""
        with self._cv:
            cur = self._current
            if cur is not None and cur.id == target and cur.session == session and not cur.cancel.is_set():
                cur.cancel.set()
                return {"target": target, "found": True, "state": "running"}
            for job in list(self._queue):
                if job.id == target and job.session == session:
                    self._queue.remove(job)
                    break
            else:
                job = None
        if job is not None:
            job.reply(error_reply(job.id, "cancelled", f"request {target!r} was cancelled before it started"))
            return {"target": target, "found": True, "state": "queued"}
        return {"target": target, "found": False, "state": "not_found"}

    def abandon(self, job: _Job) -> None:
        """Cancel ``job`` because nobody waits for its reply (an HTTP client disconnected)."""
        with self._cv:
            if job in self._queue:
                self._queue.remove(job)
                return
            if self._current is job:
                job.cancel.set()

    def status(self, session: Optional[str] = None, transport: Optional[str] = None) -> dict:
        """The worker's state as ``session`` may see it (its own requests only)."""
        transport = transport or self.transport
        with self._cv:
            cur = self._current
            mine = cur is not None and cur.session == session
            current = None if not mine else {
                "id": cur.id, "op": cur.op, "stage": cur.stage, "fraction": round(float(cur.fraction), 4),
                "message": cur.message,
                "elapsed_s": round(time.monotonic() - cur.started, 3) if cur.started else 0.0,
                "cancelling": cur.cancel.is_set()}
            queued = [j.id for j in self._queue if j.session == session]
            queue_length = len(self._queue)
        pipe = self.pipeline
        st = {"protocol": PROTOCOL, "busy": cur is not None, "current": current, "queued": queued,
              "queue_length": queue_length, "preset": pipe.preset if pipe else None,
              "device": pipe.device if pipe else None, "smoke": bool(pipe.smoke) if pipe else None,
              "uptime_s": round(time.monotonic() - self.started, 3), "cached_volumes": len(self.cache),
              "requests_done": self.requests_done, "threads": self.threads}
        if transport != "http":  # the parent process may see the worker's internals
            st.update(cache=self.cache.describe(), tmp_dir=str(self.tmp_dir), pid=os.getpid())
        return st

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
            failed = True
            try:
                self._set_threads()
                result = self._execute(job)
                reply = ok_reply(job.id, result)
                failed = False
            except CancelledError as e:
                reply = error_reply(job.id, "cancelled", self.public_message(str(e) or "request cancelled", job.transport))
            except MedVolError as e:
                reply = error_reply(job.id, e.code, self.public_message(str(e), job.transport))
            except MemoryError:
                reply = error_reply(job.id, "out_of_memory", "the worker ran out of memory for this request")
            except Exception:
                reply = self._internal_reply(job.id, f"{job.op} request {job.id!r}")
            if failed:
                job.body = None
                _release_memory()  # what a failed or cancelled request read is not kept
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
            return self.cache.get_bytes(data, self.tmp_dir, job.cancel)
        if req.get("volume") is None and job.body is not None:
            progress("read", 0.0, f"reading the uploaded volume ({len(job.body)} bytes)")
            return self.cache.get_bytes(job.body, self.tmp_dir, job.cancel)
        path = self.client_path(req["volume"], job.transport, "volume")
        progress("read", 0.0, f"reading {path.name}")
        return self.cache.get_path(path, job.cancel)

    def _out_path(self, job: _Job) -> tuple:
        out = job.req.get("out")
        if out:
            return self.client_path(out, job.transport, "out"), bool(job.req.get("overwrite", False)), False
        self._counter += 1
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(job.id))[:40] if job.id is not None else "req"
        return self.tmp_dir / f"{job.op}-{self._counter:04d}-{safe}.nii.gz", False, True

    def _run_volume_job(self, job: _Job, progress) -> dict:
        from .volume import save_mask

        req = job.req
        t0 = time.perf_counter()
        # the inputs first (volume, anchor, output, window): a bad one is refused without loading models
        stack, digest, cached = self._stack_for(job, progress)
        read_s = time.perf_counter() - t0
        progress("read", 1.0, "volume from cache" if cached else "volume read")
        anchor = None
        if job.op == "propagate":
            from .anchor import EvidenceAnchor

            anchor = EvidenceAnchor.from_dict(req["anchor"], stack)
        out, overwrite, is_temp = self._out_path(job)
        if not is_temp:
            from .fileio import MASK_SUFFIXES, check_output

            # before the long work; over HTTP no folder is created for a client
            check_output(out, overwrite, suffixes=MASK_SUFFIXES, what="mask", create_folder=job.transport != "http")
        window = req.get("window")
        if isinstance(window, list):
            window = tuple(window)
        from .windowing import get_window

        get_window(window)
        t = time.perf_counter()
        reloaded = self._ensure_pipeline(req.get("preset"), None, None, progress)
        load_s = time.perf_counter() - t if reloaded else 0.0
        pipe = self.pipeline
        if job.op == "segment":
            seg = pipe.segment(stack, req["query"], constrain=req.get("constrain", True), seed=req.get("seed"),
                               do_sample=bool(req.get("sample", False)), hu_window=window, progress=progress,
                               cancel=job.cancel, stop_after_empty=req.get("stop_after_empty"))
        else:
            seg = pipe.repropagate(stack, anchor, hu_window=window, progress=progress, cancel=job.cancel,
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
        if not cached:
            self.cache.put(digest, stack)  # only now: a failed or cancelled request keeps nothing
        if job.transport == "http":
            result["mask_b64"] = base64.b64encode(out.read_bytes()).decode("ascii")
            if is_temp:
                out.unlink()
            else:
                result["mask_path"] = os.path.relpath(out, self.data_dir)  # as the client named it, never absolute
        else:
            result["mask_path"] = str(out)
        timings = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in seg.timings.items()}
        timings.update(load_s=round(load_s, 4), models_reloaded=reloaded, volume_cached=cached,
                       volume_read_s=round(read_s, 4), write_s=round(time.perf_counter() - t, 4),
                       request_s=round(time.perf_counter() - t0, 4))
        result["timings"] = timings
        progress("write", 1.0, "done")
        return result
