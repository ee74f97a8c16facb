"""The worker behind ``medvol serve``: one queue of requests served in arrival order by one thread.

:class:`Worker` answers ``hello``, ``status``, ``cancel`` and ``shutdown`` at once and queues
``load``, ``segment`` and ``propagate``; a volume request runs
:func:`medvolcore.jobs.run_segment_job` with the worker's loaded pipeline and cached volumes.
It owns the trust boundary of ``docs/protocol.md``: server paths only over stdio, or over HTTP
inputs inside ``--data-dir`` and outputs inside ``--out-dir`` (two folders that never overlap, so
a client never replaces an input), replies over HTTP without server paths or exception text.
``hello`` is the capability handshake: versions, ops, the models served (sources and licences,
no server path) and the limits a client must respect. Transports
(:mod:`.stdio`, :mod:`.http`) hand it raw request lines and deliver its replies.
"""

from __future__ import annotations

import base64
import collections
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .. import RESEARCH_USE_NOTICE, __version__
from ..cpu import apply_threads, check_threads
from ..errors import CancelledError, ForbiddenError, MedVolError, OutputError, VolumeError
from ..pacs import allowed_source, is_dicomweb
from ..sources import COPY_SECONDS, client_parts, private_copy
from .upload import Upload
from .cache import (DEFAULT_CACHE_SIZE, DEFAULT_FEATURE_CACHE_MB, DEFAULT_MAX_VOXELS, StackCache,
                    check_request_memory, scoped)
from .lifecycle import make_tmp_dir, release_tmp_dir
from .limits import limit
from .protocol import (_MISSING, DEFAULT_MAX_REQUEST_MB, OPS, PROTOCOL, RequestError, error_reply, field, internal_reply,
                       ok_reply, parse_request, valid_id)

log = logging.getLogger("medvolcore.serve")

__all__ = ["Worker", "WorkerSettings", "Door", "SHUTDOWN_WAIT_S"]

SHUTDOWN_WAIT_S = 15.0
MAX_PATH_CHARS = int(limit("path_chars").default)
MASK_BYTES_KEY = "_mask_bytes"  # a result's mask as bytes, for a transport that sends them raw (never JSON)


@dataclass
class WorkerSettings:
    """How ``medvol serve`` runs its worker, whatever the transport.

    ``preset``/``adapter``: loaded at start and used when a request names none (None: the
    manifest's default preset, loaded on the first request). ``max_request_mb``: the largest
    request line or HTTP body. ``threads``: CPU threads for the models (None: medvolcore.cpu's rule,
    decided before the first job).
    ``max_voxels``: the largest volume, checked in its header before it is read. ``data_dir``:
    the one folder HTTP clients may name input files in (None: none). ``out_dir``: the one folder
    HTTP clients may write masks in (``out``; None: none, the mask comes back in the reply); it
    never overlaps ``data_dir``. ``feature_cache_mb``: memory for
    the encoded slices of recent volumes (MedSAM2's image features), so a re-propagation of a
    volume seen before encodes no slice again; 0 keeps none. ``pacs_servers``: the DICOMweb
    servers a request's ``volume`` may name a series on (``--allow-pacs``); no other URL is fetched.
    """

    preset: Optional[str] = None
    adapter: Optional[str] = None
    device: str = "auto"
    cache_size: int = DEFAULT_CACHE_SIZE
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB
    threads: Optional[int] = None
    max_voxels: int = DEFAULT_MAX_VOXELS
    data_dir: Optional[Path] = None
    out_dir: Optional[Path] = None
    debug: bool = False
    feature_cache_mb: float = DEFAULT_FEATURE_CACHE_MB
    pacs_servers: Optional[dict] = None  # {name: medvolcore.pacs.PacsServer} clients may name series on

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * (1 << 20))


@dataclass(frozen=True)
class Door:
    """What a front door in this process (``medvol mcp``) sets for one HTTP-like request beyond
    the wire's fields, after it has checked them itself: ``data_dir``, the allowed folder its
    ``volume`` path is read in (as ``--data-dir``: opened without following links, from a private
    copy); ``masks``, more mask files written with ``out`` (inside ``--out-dir``, chosen by the
    door); ``anchor`` and ``qc``, the anchor file and QC picture to write; ``events``, progress
    events to the request's ``reply`` as over stdio."""

    data_dir: Optional[Path] = None
    masks: tuple = ()
    anchor: Optional[Path] = None
    qc: Optional[Path] = None
    events: bool = False


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
                 "session", "mask_bytes", "eta", "request", "retrieved", "door")

    def __init__(self, req: dict, reply: Callable[[dict], None], transport: str, body=None,
                 session: Optional[str] = None, mask_bytes: bool = False, request=None, door: Optional[Door] = None):
        self.door = door or Door()
        self.request = request  # the SegmentRequest of a segment/propagate, built and checked on arrival
        self.session = session
        self.mask_bytes = mask_bytes
        self.id = req.get("id")
        self.op = req.get("op")
        self.req = req
        self.reply = reply
        self.cancel = threading.Event()
        self.stage, self.fraction, self.message = "queued", 0.0, ""
        self.eta = None  # seconds left in the stage (medvolcore.progress.StageClock), None until known
        self.started = None
        self.transport = transport
        self.body = body
        self.retrieved = None  # what a series URL's retrieval fetched (medvolcore.pacs)


class Worker:
    """The engine behind ``medvol serve``: a request queue served by one thread.

    ``emit(obj)`` sends a message (reply or event) for requests submitted without their own
    ``reply`` callback (stdio). ``default_preset`` is used by segment/propagate when no preset
    is loaded and the request names none (``default_adapter``: the adapter it starts with, shown
    by ``hello`` by its folder name only). ``data_dir``: the only folder whose files HTTP
    requests may name as inputs (None: no server path over HTTP); ``out_dir``: the only folder
    HTTP requests may write to (``out``; None: none). ``max_voxels``: the largest volume
    accepted, checked in its header before reading. ``feature_cache_mb``: the budget of the
    feature cache (the encoded slices of recent volumes, by content sha256, HU window and
    loaded MedSAM2; least recently used volumes go first).
    """

    def __init__(self, emit: Optional[Callable[[dict], None]] = None, *, default_preset: Optional[str] = None,
                 device: str = "auto", cache_size: int = DEFAULT_CACHE_SIZE, transport: str = "stdio",
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_MB << 20, threads: Optional[int] = None,
                 data_dir=None, max_voxels: Optional[int] = DEFAULT_MAX_VOXELS,
                 feature_cache_mb: float = DEFAULT_FEATURE_CACHE_MB, out_dir=None, default_adapter=None,
                 pacs_servers: Optional[dict] = None):
        from ..propagation import FeatureCache

        self.emit = emit or (lambda obj: None)
        self.default_preset = default_preset
        self.device = device
        self.transport = transport
        self.max_request_bytes = int(max_request_bytes)
        self.threads = check_threads(threads, "threads")
        self.data_dir = Path(os.path.realpath(data_dir)) if data_dir is not None else None
        self.out_dir = Path(os.path.realpath(out_dir)) if out_dir is not None else None
        self.default_adapter = default_adapter
        self.pacs_servers = dict(pacs_servers or {})
        self.hello_extra: dict = {}  # what the transport adds to ``hello`` (HTTP: session idle time)
        self.max_voxels = max_voxels
        self.cache = StackCache(cache_size, max_voxels)
        self.features = FeatureCache(int(max(0.0, float(feature_cache_mb)) * (1 << 20)))
        self._pipe_generation = 0  # features belong to one loaded MedSAM2
        self.tmp_dir, self._tmp_lock = make_tmp_dir()  # medvol-serve-<pid>-…; stale ones of dead workers go
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

    @classmethod
    def from_settings(cls, settings: WorkerSettings, transport: str, emit: Optional[Callable[[dict], None]] = None,
                      preload: bool = True) -> "Worker":
        """A worker for ``settings``; with ``preload`` its preset (if any) starts loading at once."""
        worker = cls(emit, default_preset=settings.preset, device=settings.device, cache_size=settings.cache_size,
                     transport=transport, max_request_bytes=settings.max_request_bytes, threads=settings.threads,
                     data_dir=settings.data_dir, max_voxels=settings.max_voxels,
                     feature_cache_mb=settings.feature_cache_mb, out_dir=settings.out_dir,
                     default_adapter=settings.adapter, pacs_servers=settings.pacs_servers)
        if preload and settings.preset:
            worker.preload(settings.preset, settings.adapter)
        return worker

    # -- entry points ------------------------------------------------------------------------
    def handle_line(self, raw, reply: Optional[Callable[[dict], None]] = None, body=None,
                    transport: Optional[str] = None, session: Optional[str] = None,
                    mask_bytes: bool = False) -> Optional[_Job]:
        """Handle one raw request (bytes or str): parse, check, answer or queue it.

        Never raises: whatever the input, exactly one reply goes to ``reply``. Returns the
        queued job (so an HTTP handler can cancel it when its client goes away), else None.
        ``body``: the volume sent beside the request over HTTP, NIfTI bytes or an
        :class:`.upload.Upload` (a private file). ``mask_bytes`` (HTTP): the result carries the
        mask's ``.nii.gz`` bytes under :data:`MASK_BYTES_KEY` for the transport to send as they
        are, instead of ``mask_b64``.
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
        return self.handle(req, reply, body=body, transport=transport, session=session, mask_bytes=mask_bytes)

    def handle(self, req: dict, reply: Optional[Callable[[dict], None]] = None, body=None,
               transport: Optional[str] = None, session: Optional[str] = None,
               mask_bytes: bool = False, door: Optional[Door] = None) -> Optional[_Job]:
        """Handle one parsed request as :meth:`handle_line` does; ``door``: what an in-process
        front door sets beyond the wire (:class:`Door`)."""
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
                reply(ok_reply(rid, self.hello(session, transport)))
            elif op == "status":
                reply(ok_reply(rid, self.status(session, transport)))
            elif op == "cancel":
                target = req.get("target", _MISSING)
                if target is _MISSING:
                    raise RequestError("cancel: missing field 'target' (the id of the request to cancel)")
                if target is None or not valid_id(target):
                    raise RequestError(f"cancel: field 'target' must be a string or an integer, got {type(target).__name__}")
                reply(ok_reply(rid, self.cancel(target, session)))
            elif op == "shutdown":
                self.stop("shutdown requested")
                self.join(SHUTDOWN_WAIT_S)  # the running request ends at its next slice and is answered first
                reply(ok_reply(rid, {"stopping": True}))
                self.stopped.set()
            else:
                request = self._check_queued(req, body, transport, door)
                job = _Job(req, reply, transport, body, session, mask_bytes=mask_bytes and transport == "http",
                           request=request, door=door)
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

    def hello(self, session: Optional[str] = None, transport: Optional[str] = None) -> dict:
        """The capability handshake: protocol, versions, ops, the models this worker serves (or
        will load) with their sources, licences and identity (``model_label``: e.g. zero-shot,
        not trained for this task), the research-use notice, and the limits a client must
        respect. It names no server path (an adapter by its folder name only)."""
        transport = transport or self.transport
        served = self._served_models()
        out = {"protocol": PROTOCOL, "medvolcore": __version__, "ops": list(OPS), "transport": transport,
               "models": served, "model_label": (served.get("identity") or {}).get("label"),
               "research_use": RESEARCH_USE_NOTICE, "limits": self._limits()}
        if transport == "http":
            out["server_paths"] = {"volume": self.data_dir is not None, "out": self.out_dir is not None}
        out.update(self.hello_extra)
        if session is not None:
            out["session"] = session
        return out

    def _served_models(self) -> dict:
        """The preset loaded, else the one the first request will load, as a client may see it."""
        from .. import models

        pipe = self.pipeline
        try:
            name = pipe.preset if pipe is not None else (self.default_preset or models.default_preset())
            info = {"preset": name, "loaded": pipe is not None, "device": pipe.device if pipe is not None else None}
            info.update(models.get_preset(name).public_info())
        except MedVolError as e:  # a broken manifest: hello still answers
            return {"preset": getattr(pipe, "preset", None) or self.default_preset, "loaded": pipe is not None,
                    "error": self.public_message(str(e), "http")}
        adapter = None
        if pipe is not None and getattr(pipe, "models", None) is not None and pipe.models.adapter_dir:
            adapter = Path(pipe.models.adapter_dir).name
        elif pipe is None and self.default_adapter:
            adapter = Path(str(self.default_adapter)).name
        info["adapter"] = adapter
        try:  # what the models are (zero-shot base model, MedVol-R1 adapter, smoke model)
            info["identity"] = (getattr(pipe, "identity", None) if pipe is not None
                                else models.preset_identity(name, self.default_adapter))
        except MedVolError as e:
            info["identity"], info["error"] = None, self.public_message(str(e), "http")
        return info

    def _limits(self) -> dict:
        from ..anchor import MAX_BOXES
        from ..prompts import MAX_MASK_PROMPTS, MAX_MASK_RUNS, MAX_OBJECTS, MAX_POINTS, MAX_PROMPTS

        from .upload import upload_ceiling

        ceiling = upload_ceiling(self.max_voxels)
        return {"max_request_mb": round(self.max_request_bytes / (1 << 20), 3), "max_voxels": self.max_voxels,
                "max_volume_body_mb": None if ceiling is None else round(ceiling / (1 << 20), 3),
                "max_boxes": MAX_BOXES, "max_objects": MAX_OBJECTS, "max_prompts": MAX_PROMPTS,
                "max_points": MAX_POINTS, "max_mask_prompts": MAX_MASK_PROMPTS, "max_mask_runs": MAX_MASK_RUNS}

    @staticmethod
    def _internal_reply(rid, what: str) -> dict:
        return internal_reply(rid, what)

    def public_message(self, text: str, transport: Optional[str] = None) -> str:
        """An error message fit for the client: over HTTP, no absolute server path.

        Paths inside ``--data-dir`` or ``--out-dir`` become relative to it, the upload temporary file becomes
        "the uploaded volume", and any other absolute path is cut to its last component.
        """
        if (transport or self.transport) != "http":
            return text
        tmp = re.escape(str(self.tmp_dir))
        text = re.sub(tmp + r"[^\s'\":,;()]*", "the uploaded volume", text)
        for folder in (self.data_dir, self.out_dir):
            if folder is not None:
                root = str(folder)
                text = text.replace(root + os.sep, "").replace(root, ".")
        return re.sub(r"(?<![\w.~])/(?:[^\s'\":,;()/]+/)+([^\s'\":,;()/]+)", r"\1", text)

    def client_path(self, value: str, transport: str, what: str, data_dir: Optional[Path] = None) -> Path:
        """A path named by a client. Over stdio: as given (``~`` expanded). Over HTTP: only
        with ``--data-dir``, relative to the data folder, and refused unless inside it: first
        from the text alone (``..`` and absolute paths, before anything is looked up, so the
        refusal tells nothing about which server files exist), then with symbolic links
        resolved. A volume is then read only through :func:`medvolcore.sources.private_copy`,
        which follows no link at all (see :meth:`_stack_for`). ``data_dir``: a front door's
        allowed folder for this request, in place of ``--data-dir``."""
        if transport != "http":
            return Path(os.path.expanduser(value))
        root = Path(data_dir) if data_dir is not None else self.data_dir
        if root is None:
            raise ForbiddenError(f"'{what}' names a file on the server, which this server does not allow; send the "
                                 "volume in the request (volume_b64 or the request body) and take the mask from the "
                                 "reply (an operator can allow one folder with `medvol serve --data-dir DIR`)")
        if len(value) > MAX_PATH_CHARS or any(len(os.fsencode(p)) > 255 for p in value.split("/")):
            # before the system would fail on it (ENAMETOOLONG)
            raise (VolumeError if what == "volume" else OutputError)(
                f"'{what}' is a path of {len(value):,} characters; a path is at most {MAX_PATH_CHARS:,} characters, "
                "255 bytes a name")
        client_parts(root, value, what)
        full = os.path.realpath(os.path.join(root, value))
        if os.path.commonpath([full, str(root)]) != str(root):
            raise ForbiddenError(f"'{what}' {value!r} is outside the server's data folder")
        return Path(full)

    def output_path(self, value: str, transport: str, what: str = "out") -> Path:
        """Where a client's ``out`` goes. Over stdio: as given (``~`` expanded). Over HTTP: only
        with ``--out-dir``, relative to it, and refused unless its folder resolves inside it (a
        symbolic link out of the folder is not followed) and its last component is not a
        symbolic link (an atomic rename would replace the link, but the existence check before
        it would look at the target). ``--out-dir`` never overlaps ``--data-dir``, so an
        output never replaces a volume the data folder serves. Refusals happen before anything
        is written and do not depend on which files exist, except the link check."""
        if transport != "http":
            return Path(os.path.expanduser(value))
        if self.out_dir is None:
            back = "the mask comes back in the reply ('mask_b64')" if what == "out" else "leave it out"
            raise ForbiddenError(f"'{what}' names a file on the server, which this server does not allow: {back}; an "
                                 "operator can allow one output folder with `medvol serve --out-dir DIR`")
        if not value or "\0" in value:
            raise ForbiddenError(f"'{what}' is not a usable path")
        root = str(self.out_dir)
        joined = os.path.normpath(os.path.join(root, value))
        parent = os.path.realpath(os.path.dirname(joined))
        if parent != root and os.path.commonpath([parent, root]) != root:
            raise ForbiddenError(f"'{what}' {value!r} is outside the server's output folder")
        full = os.path.join(parent, os.path.basename(joined))
        if os.path.islink(full):
            raise ForbiddenError(f"'{what}' {value!r} is a symbolic link; name a new file in the output folder")
        return Path(full)

    def _check_queued(self, req: dict, body: Optional[bytes], transport: str, door: Optional[Door] = None):
        """Cheap checks done at arrival, so a malformed request is answered at once: the worker's
        own fields (models, paths, outputs) here, the request's every field and rule by its
        declaration (:meth:`~medvolcore.request.SegmentRequest.from_wire`). Returns that request
        (None for ``load``)."""
        from ..request import SegmentRequest

        op = req["op"]
        for name in ("preset", "adapter", "device", "out", "volume_b64", "agreement"):
            field(req, name, str)
        if transport == "http" and field(req, "adapter", str) is not None:
            raise ForbiddenError("'adapter' names a folder on the server, which HTTP clients may not choose; "
                                 "start the server with --adapter")
        if op == "load":
            dev = field(req, "device", str)
            if dev is not None and dev not in ("cpu", "cuda", "auto") and not dev.startswith("cuda:"):
                raise RequestError(f"load: device must be cpu, cuda, cuda:N or auto, got {dev!r}")
            return None
        field(req, "overwrite", bool)
        if op == "segment":
            field(req, "empty_mask_on_absent", bool)
        request = SegmentRequest.from_wire(req)
        has_b64 = field(req, "volume_b64", str) is not None or body is not None
        volume = field(req, "volume", str)
        if volume is None and not has_b64:
            raise RequestError(f"{op}: missing field 'volume' (a path to the CT"
                               + (", or 'volume_b64' / the request body with NIfTI bytes)" if transport == "http" else ")"))
        out, agreement = field(req, "out", str), field(req, "agreement", str)
        if volume is not None and is_dicomweb(volume):  # only a series on a server the operator allowed
            allowed_source(volume, self.pacs_servers)
            volume = None
        vol_path = (self.client_path(volume, transport, "volume", door and door.data_dir) if volume is not None
                    else None)
        out_path = self.output_path(out, transport) if out is not None else None
        agr_path = self.output_path(agreement, transport, "agreement") if agreement is not None else None
        from ..fileio import MASK_SUFFIXES, check_distinct

        # 'out' may also be a DICOM-SEG (.dcm) of a DICOM series volume (checked by the job, before any model)
        for what, path, ok in (("out", out_path, MASK_SUFFIXES + (".dcm",)), ("agreement", agr_path, MASK_SUFFIXES)):
            if path is not None and not path.name.lower().endswith(ok):
                raise RequestError(f"{op}: '{what}' must end in {', '.join(ok)}", "bad_output")
        check_distinct([("out", out_path), ("agreement", agr_path)], [("volume", vol_path)])
        return request

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

    def session_busy(self, session: Optional[str]) -> bool:
        """True while a request of ``session`` is queued or running (its client still needs the
        session to see or cancel it)."""
        with self._cv:
            cur = self._current
            return (cur is not None and cur.session == session) or any(j.session == session for j in self._queue)

    def cancel_session(self, session: str, reason: str) -> int:
        """Cancel the queued requests of ``session`` (it expired); a running one is left to
        finish and its reply still goes to its client. Returns how many were cancelled."""
        with self._cv:
            mine = [job for job in self._queue if job.session == session]
            for job in mine:
                self._queue.remove(job)
        for job in mine:
            try:
                job.reply(error_reply(job.id, "cancelled", f"request cancelled: {reason}"))
            except Exception:  # noqa: BLE001 - a client that went away must not stop the caller
                log.warning("could not deliver the reply to request %r", job.id)
        return len(mine)

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
                "eta_s": None if cur.eta is None else round(float(cur.eta), 1),
                "cancelling": cur.cancel.is_set()}
            queued = [j.id for j in self._queue if j.session == session]
            queue_length = len(self._queue)
        pipe = self.pipeline
        st = {"protocol": PROTOCOL, "busy": cur is not None, "current": current, "queued": queued,
              "queue_length": queue_length, "preset": pipe.preset if pipe else None,
              "device": pipe.device if pipe else None, "smoke": bool(pipe.smoke) if pipe else None,
              "model_label": (getattr(pipe, "identity", None) or {}).get("label") if pipe else None,
              "uptime_s": round(time.monotonic() - self.started, 3), "cached_volumes": len(self.cache),
              "requests_done": self.requests_done, "threads": self.threads,
              "threads_rule": getattr(self, "threads_rule", None),
              "feature_cache": self.features.describe()}
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
        release_tmp_dir(self.tmp_dir, self._tmp_lock)
        self._tmp_lock = None

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
        """Decide and apply the thread count once, before the first job (torch is imported only when
        work arrives): ``threads`` when set, else medvolcore.cpu's rule, leaving one core to the
        application that drives the worker when there are more than two."""
        if not getattr(self, "_threads_set", False):
            self._threads_set = True
            try:
                plan = apply_threads(self.threads, reserve=1)
                self.threads, self.threads_rule = plan.threads, plan.describe()
            except Exception as e:  # noqa: BLE001 - the worker still serves
                log.warning("could not set the CPU threads (%s): %s", self.threads, e)

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
        from ..progress import StageClock

        clock = StageClock()

        def progress(stage: str, fraction: float, message: str = "") -> None:
            job.stage, job.fraction, job.message = stage, float(fraction), str(message)
            if job.cancel.is_set():
                raise CancelledError(f"request {job.id!r} cancelled during {stage}")
            elapsed, eta, _ = clock.update(stage, fraction)
            job.eta = eta
            if job.transport == "stdio" or job.door.events:
                job.reply({"id": job.id, "event": "progress", "stage": stage, "fraction": round(float(fraction), 4),
                           "message": str(message), "elapsed_s": round(elapsed, 2),
                           "eta_s": None if eta is None else round(eta, 1)})

        return progress

    def _execute(self, job: _Job) -> dict:
        progress = self._progress(job)
        progress("load", 0.0, "starting")
        if job.op == "load":
            req = job.req
            t = time.perf_counter()
            reloaded = self._ensure_pipeline(req.get("preset"), req.get("adapter"), req.get("device"), progress,
                                             explicit=True)
            ident = getattr(self.pipeline, "identity", None)
            return {"preset": self.pipeline.preset, "device": self.pipeline.device, "smoke": bool(self.pipeline.smoke),
                    "identity": ident, "model_label": (ident or {}).get("label"), "reloaded": reloaded,
                    "load_s": round(time.perf_counter() - t, 4),
                    "load_detail_s": dict(self.pipeline.load_seconds)}
        return self._run_volume_job(job, progress)

    def _ensure_pipeline(self, preset, adapter, device, progress, explicit=False) -> bool:
        """Make sure a pipeline is loaded for ``preset``; True when models were (re)loaded now."""
        from ..pipeline import Pipeline

        if preset is None and not explicit and self.pipeline is not None:
            return False
        preset = preset or (self.pipeline.preset if self.pipeline is not None else None) or self.default_preset
        if preset is None:
            from ..models import default_preset

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
        self.features.clear()  # features of the old MedSAM2 are of no use to the new one
        self._pipe_generation += 1
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
        """``(stack, sha256, cached)`` for the request's volume (see :class:`.cache.StackCache`).

        A cached volume that its file's header contradicted was read again; the encoded slices
        kept under its key were made from the wrong voxels, so they are dropped too."""
        mismatches = self.cache.mismatches
        stack, digest, cached = self._read_stack(job, progress)
        if self.cache.mismatches != mismatches:
            self.features.discard_prefix(scoped(self._scope(job), digest))
        return stack, digest, cached

    @staticmethod
    def _scope(job: _Job) -> str:
        """Whose cached volumes and encoded slices a request may use: over HTTP its session's
        only (a session is a client's identity: one address is every client behind a proxy, and
        the server's token is shared), so no reply tells a client that another one sent the same
        CT; over stdio the one client's ("")."""
        return f"session:{job.session or ''}" if job.transport == "http" else ""

    def _read_stack(self, job: _Job, progress) -> tuple:
        req = job.req
        b64 = req.get("volume_b64")
        if b64 is not None:
            try:
                data = base64.b64decode(b64, validate=True)
            except (ValueError, TypeError) as e:
                raise RequestError(f"{job.op}: 'volume_b64' is not valid base64: {e}") from None
            progress("read", 0.0, f"reading the uploaded volume ({len(data)} bytes)")
            return self.cache.get_bytes(data, self.tmp_dir, job.cancel, self._scope(job))
        if req.get("volume") is None and isinstance(job.body, Upload):  # streamed to a private file
            progress("read", 0.0, f"reading the uploaded volume ({job.body.size} bytes)")
            return self.cache.get_path(job.body.path, job.cancel, digest=job.body.sha256, scope=self._scope(job))
        if req.get("volume") is None and job.body is not None:
            progress("read", 0.0, f"reading the uploaded volume ({len(job.body)} bytes)")
            return self.cache.get_bytes(job.body, self.tmp_dir, job.cancel, self._scope(job))
        value = req["volume"]
        if is_dicomweb(value):
            return self._read_series_url(job, value, progress)
        path = self.client_path(value, job.transport, "volume", job.door.data_dir)
        progress("read", 0.0, f"reading {path.name}")
        if job.transport != "http":
            return self.cache.get_path(path, job.cancel, tmp_dir=self.tmp_dir)
        # Over HTTP the client's path is opened once, without following links, and copied into
        # the private temp folder while hashed; the reader reads only that copy, which is removed.
        with private_copy(job.door.data_dir or self.data_dir, value, self.tmp_dir, job.cancel, "volume",
                          max_bytes=self.cache.max_bytes(), max_voxels=self.cache.max_voxels,
                          seconds=COPY_SECONDS) as copy:
            try:
                return self.cache.get_path(copy.path, job.cancel, digest=copy.sha256, scope=self._scope(job),
                                           owned=True)
            except MedVolError as e:  # name the client's file, not the private copy
                text = str(e).replace(str(copy.path), repr(value))
                if copy.path.is_file():  # a folder's copy has the client's folder name already
                    text = text.replace(copy.path.name, os.path.basename(os.path.normpath(value)))
                raise type(e)(text) from None

    def _read_series_url(self, job: _Job, value: str, progress) -> tuple:
        """A series on an allowed DICOMweb server, retrieved into a private folder in the worker's
        temporary folder, read from there, and removed whatever the outcome."""
        import shutil
        import tempfile

        from ..pacs import retrieve_series

        server, url = allowed_source(value, self.pacs_servers)
        progress("read", 0.0, f"retrieving series {url.series} from {server.name}")
        folder = Path(tempfile.mkdtemp(prefix="dicomweb-", dir=self.tmp_dir))
        try:
            got = retrieve_series(url, folder / "series", server.token, server.limits)
            job.retrieved = {"pacs": server.name, "instances": got["instances"], "bytes": got["bytes"],
                             "seconds": got["seconds"]}
            return self.cache.get_path(folder / "series", job.cancel, tmp_dir=self.tmp_dir, scope=self._scope(job),
                                       owned=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _entry_files(self, entry: dict, transport: str) -> None:
        """A several-target entry's files as the client may see them: its agreement map (numbered,
        as :func:`medvolcore.jobs.numbered` wrote it) as ``agreement_path`` (and over HTTP its bytes
        as ``agreement_b64``); over HTTP every path relative to ``--out-dir``, never absolute."""
        written = entry.get("agreement_out")
        if written is not None:
            if transport == "http":
                entry["agreement_b64"] = base64.b64encode(Path(written).read_bytes()).decode("ascii")
            entry["agreement_path"] = written
        if transport == "http":
            for key in ("agreement_out", "agreement_path", "anchor_out", "qc"):
                if entry.get(key) is not None:
                    entry[key] = os.path.relpath(entry[key], self.out_dir)

    def _out_path(self, job: _Job) -> tuple:
        out = job.req.get("out")
        if out:
            return self.output_path(out, job.transport), bool(job.req.get("overwrite", False)), False
        self._counter += 1
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(job.id))[:40] if job.id is not None else "req"
        return self.tmp_dir / f"{job.op}-{self._counter:04d}-{safe}.nii.gz", False, True

    def _reply_copy(self, job: _Job) -> Optional[Path]:
        """Over HTTP with an ``out`` that is not ``.nii.gz`` (``.nrrd``, ``.mha``, ``.nii``,
        ``.seg.nrrd``, ``.dcm``): a private ``.nii.gz`` the job also writes, whose bytes the reply
        carries (``mask_b64`` and the ``application/gzip`` body are ``.nii.gz``, whatever ``out``
        is); None otherwise."""
        from ..fileio import full_suffix

        out = job.req.get("out")
        if job.transport != "http" or not out or full_suffix(str(out)).lower() == ".nii.gz":
            return None
        self._counter += 1
        return self.tmp_dir / f"{job.op}-{self._counter:04d}-reply.nii.gz"

    def _run_volume_job(self, job: _Job, progress) -> dict:
        """A ``segment`` or ``propagate`` request: :func:`~medvolcore.jobs.run_segment_job` on the
        cached volume, with the models loaded only once the inputs are known good."""
        from ..jobs import labels_path

        reply_copy = self._reply_copy(job)
        try:
            return self._volume_job(job, progress, reply_copy)
        finally:
            if reply_copy is not None:
                for f in (reply_copy, Path(labels_path(reply_copy))):
                    f.unlink(missing_ok=True)

    def _volume_job(self, job: _Job, progress, reply_copy: Optional[Path]) -> dict:
        from ..jobs import SegmentOutputs, run_segment_job
        from ..request import SegmentRequest

        req = job.req
        request = job.request or SegmentRequest.from_wire(req)
        t0 = time.perf_counter()
        stack, digest, cached = self._stack_for(job, progress)
        read_s = time.perf_counter() - t0
        progress("read", 1.0, "volume from cache" if cached else "volume read")
        check_request_memory(math.prod(stack.volume.shape), len(request.queries or ()) or 1,
                             int(request.consensus or 1), self.cache.max_voxels)
        out, overwrite, is_temp = self._out_path(job)
        agreement = req.get("agreement")
        agr_path = self.output_path(agreement, job.transport, "agreement") if agreement else None
        # over HTTP no folder is created for a client
        masks = [out, *job.door.masks] + ([reply_copy] if reply_copy else [])
        outputs = SegmentOutputs(masks if len(masks) > 1 else out, overwrite=overwrite,
                                 anchor=job.door.anchor, qc=job.door.qc,
                                 create_folders=job.transport != "http",
                                 names=("out", "anchor_out", "qc"),
                                 empty_mask_on_absent=bool(req.get("empty_mask_on_absent", False)),
                                 agreement=agr_path, agreement_name="agreement")
        load = {"reloaded": False, "load_s": 0.0}

        def pipeline():
            t = time.perf_counter()
            load["reloaded"] = self._ensure_pipeline(req.get("preset"), None, None, progress)
            load["load_s"] = time.perf_counter() - t if load["reloaded"] else 0.0
            return self.pipeline

        keys = []

        def features(pipe, window):
            # features depend on the volume's content, the HU window and the loaded MedSAM2
            keys.append((scoped(self._scope(job), digest), window.center, window.width, self._pipe_generation))
            return self.features.store(keys[-1])

        try:
            res = run_segment_job(pipeline, stack, request, outputs, progress=progress, cancel=job.cancel,
                                  features=features)
        except BaseException:
            if not cached:  # a volume from a failed request leaves nothing behind, features included
                for key in keys:
                    self.features.discard(key)
            raise
        if not cached:
            self.cache.put(digest, stack, self._scope(job))  # only now: a failed or cancelled request keeps nothing
        result = res.to_wire(job.op)  # the result's fields this op replies with; then what only the worker knows
        for labels_file in res.labels_out or ():  # several queries: the table is the reply's 'targets'
            if reply_copy is not None and Path(labels_file).parent == reply_copy.parent:
                continue  # the reply copy's table: removed with it
            if is_temp:
                Path(labels_file).unlink(missing_ok=True)
            else:
                result["labels_path"] = os.path.relpath(labels_file, self.out_dir) if job.transport == "http" \
                    else labels_file
        result.update(model_label=(res.identity or {}).get("label"), volume_sha256=digest)
        if job.retrieved is not None:
            result["retrieved"] = job.retrieved
        if res.targets is not None:  # several targets: each entry names its own files, as written
            for entry in result.get("targets") or ():
                self._entry_files(entry, job.transport)
            if agr_path is not None:
                result["agreement_path"] = None  # one map per target (numbered): in each entry of 'targets'
        elif agr_path is not None:
            if job.transport == "http":
                result["agreement_b64"] = base64.b64encode(agr_path.read_bytes()).decode("ascii")
                result["agreement_path"] = os.path.relpath(agr_path, self.out_dir)
            else:
                result["agreement_path"] = str(agr_path)
        if res.out is None:  # the model answered "not present" and no empty mask was asked for
            result["mask_b64" if job.transport == "http" else "mask_path"] = None
        elif job.transport == "http":
            sent = reply_copy or out  # always .nii.gz bytes, as the protocol says
            if job.mask_bytes:  # the transport sends them as the reply body
                result[MASK_BYTES_KEY] = sent.read_bytes()
            else:
                result["mask_b64"] = base64.b64encode(sent.read_bytes()).decode("ascii")
            if is_temp:
                out.unlink()
            else:
                result["mask_path"] = os.path.relpath(out, self.out_dir)  # relative to --out-dir, never absolute
        else:
            result["mask_path"] = str(out)
        if job.transport != "http":  # no 'out' given: the mask is in the worker's temporary folder, gone at exit
            result["mask_temporary"] = bool(is_temp and res.out is not None)
        timings = dict(res.timings)
        timings.update(load_s=round(load["load_s"], 4), models_reloaded=load["reloaded"], volume_cached=cached,
                       volume_read_s=round(read_s, 4), request_s=round(time.perf_counter() - t0, 4))
        result["timings"] = timings
        return result
