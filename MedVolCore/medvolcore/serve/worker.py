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

This module is the queue, its thread, the handshake and the lifecycle; the worker's work is in
two mixins of :class:`Worker`: :class:`.ops.VolumeOps` (models, reading a volume, the
segment/propagate job) and :class:`.paths.ClientPaths` (the paths and messages a client names and sees).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .. import RESEARCH_USE_NOTICE, __version__
from ..cpu import apply_threads, check_threads
from ..errors import CancelledError, ForbiddenError, MedVolError
from ..pacs import allowed_source, is_dicomweb
from .cache import DEFAULT_CACHE_SIZE, DEFAULT_FEATURE_CACHE_MB, DEFAULT_MAX_VOXELS, StackCache
from .lifecycle import make_tmp_dir, release_tmp_dir
from .ops import MASK_BYTES_KEY, VolumeOps  # noqa: F401 - MASK_BYTES_KEY: the transports import it from here
from .paths import MAX_PATH_CHARS, ClientPaths  # noqa: F401 - MAX_PATH_CHARS: importable from here, as before
from .protocol import (_MISSING, DEFAULT_MAX_REQUEST_MB, OPS, PROTOCOL, RequestError, error_reply, field, internal_reply,
                       ok_reply, parse_request, valid_id)

log = logging.getLogger("medvolcore.serve")

__all__ = ["Worker", "WorkerSettings", "Door", "SHUTDOWN_WAIT_S"]

SHUTDOWN_WAIT_S = 15.0


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


class Worker(ClientPaths, VolumeOps):
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
