"""What the module asks the worker, and the processing state the panel shows.

:class:`Session` owns one worker client (local or remote) for the whole Slicer session. It
turns panel options into protocol-1 requests (a ``load`` first when the preset, adapter or
device changed), keeps the state ``idle`` → ``running`` → ``cancelling`` → ``idle`` that drives
the Segment/Cancel button, and restarts a worker that died on the next request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Union

from .client import Job, StdioWorker, WorkerError, python_for_worker, worker_command
from .remoteworker import RemoteWorker
from .presets import default_preset
from .signals import Signal

IDLE, RUNNING, CANCELLING = "idle", "running", "cancelling"


@dataclass
class Options:
    """Panel settings that reach the worker. ``preset``: by default the manifest's default
    (:func:`~MedVolR1SlicerLib.presets.default_preset`); ``window``: a preset name or
    ``[centre, width]``."""

    preset: str = field(default_factory=default_preset)
    adapter: str = ""
    device: str = "auto"
    window: Union[str, List[float]] = "soft_tissue"
    worker: str = "local"  # "local" or "remote"
    remote_url: str = ""
    remote_token: str = ""
    seed: Optional[int] = None
    extra_worker_args: List[str] = field(default_factory=list)
    consensus: int = 1  # answers per segment request (1: off); see MedVolR1SlicerLib.consensus

    def model_key(self) -> tuple:
        return (self.preset, self.adapter or None, self.device)

    def worker_key(self) -> tuple:
        return (self.worker, self.remote_url.strip(), self.remote_token, self.device if self.worker == "local" else None)


def check_query(query: str) -> str:
    q = " ".join(str(query or "").split())
    if not q:
        raise WorkerError("bad_input", "type a query first, e.g. “the organ that secretes bile”")
    if len(q) > 2000:
        raise WorkerError("bad_input", f"the query is {len(q)} characters long; keep it under 2000")
    return q


MAX_QUERIES = 64  # the worker's limit on ``queries``


def query_lines(text: str) -> List[str]:
    """The queries of the query box, one per line: each line's words, blank lines and a line
    repeated (in any case) left out, in the order typed. Raises WorkerError (``bad_input``)
    when there is none, more than :data:`MAX_QUERIES`, or a line is too long."""
    queries, seen = [], set()
    for line in str(text or "").splitlines():
        q = " ".join(line.split())
        if q and q.casefold() not in seen:
            seen.add(q.casefold())
            queries.append(check_query(q))
    if not queries:
        check_query("")  # raises: type a query first
    if len(queries) > MAX_QUERIES:
        raise WorkerError("bad_input", f"{len(queries)} queries (one per line); at most {MAX_QUERIES} go in one request")
    return queries


def segment_fields(volume_path: str, query: str, options: Options, agreement: str = "") -> dict:
    """A ``segment`` request; with a consensus (``options.consensus`` > 1) also ``consensus`` and,
    when given, ``agreement``: where the worker writes the agreement map. A query of several lines
    is several queries (:func:`query_lines`): one request with ``queries``, the slices encoded
    once (no agreement map: there would be one per query)."""
    queries = query_lines(query)
    fields = {"volume": str(volume_path), "preset": options.preset, "window": options.window, "seed": options.seed}
    if len(queries) > 1:
        fields["queries"] = queries
        agreement = ""
    else:
        fields["query"] = queries[0]
    if options.consensus > 1:
        fields["consensus"] = int(options.consensus)
        if agreement:
            fields["agreement"] = str(agreement)
    return fields


# /2: with correction prompts or a slice range; /4: with painted slices (mask prompts) too
ANCHOR_SCHEMAS = ("medvol.anchor/1", "medvol.anchor/2", "medvol.anchor/4")


def propagate_fields(volume_path: str, anchor: dict, options: Options) -> dict:
    if not isinstance(anchor, dict) or anchor.get("schema") not in ANCHOR_SCHEMAS:
        raise WorkerError("bad_anchor", "the boxes could not be turned into an anchor (schema medvol.anchor/1, /2 or /4)")
    return {"volume": str(volume_path), "anchor": anchor, "preset": options.preset, "window": options.window}


class Session:
    """One worker for the Slicer session, and the state of the request that is running.

    ``client_factory(options)`` builds the client; the default makes a :class:`StdioWorker`
    (``python -m medvolcore.cli_serve --stdio`` with Slicer's Python) or a :class:`RemoteWorker`.
    Signals: ``state_changed(state)``, ``progress(job)``, ``finished(job)``.
    """

    def __init__(self, client_factory: Optional[Callable[[Options], object]] = None, python: Optional[str] = None,
                 env: Optional[dict] = None):
        self._factory = client_factory or self._default_factory
        self.python = python
        self.env = env
        self.client = None
        self._client_key = None
        self._loaded_key = None
        self._loaded_generation = None
        self._load_job: Optional[Job] = None
        self.job: Optional[Job] = None
        self.state = IDLE
        self.state_changed = Signal("state_changed")
        self.progress = Signal("progress")
        self.finished = Signal("finished")

    def _default_factory(self, options: Options):
        if options.worker == "remote":
            return RemoteWorker(options.remote_url, options.remote_token or None)
        cmd = worker_command(self.python or python_for_worker(), options.device, extra=options.extra_worker_args)
        return StdioWorker(cmd, env=self.env)

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.state_changed.emit(state)

    def _client_for(self, options: Options):
        key = options.worker_key()
        if self.client is None or key != self._client_key:
            if self.client is not None:
                self.client.stop()
            self.client = self._factory(options)
            self._client_key = key
            self._loaded_key = None
        return self.client

    def _ensure_loaded(self, client, options: Options) -> Optional[Job]:
        """Queue a ``load`` when the models wanted differ from what this worker process has."""
        starts = getattr(client, "starts", 0)
        if getattr(client, "running", True) and self._loaded_key == options.model_key() and self._loaded_generation == starts:
            return None
        job = client.submit("load", preset=options.preset, adapter=options.adapter or None, device=options.device)
        self._loaded_key, self._loaded_generation = options.model_key(), getattr(client, "starts", 0)
        job.progress.connect(self.progress.emit)  # "loading preset …" shows on the bar too
        return job

    def _run(self, op: str, fields: dict, options: Options) -> Job:
        if self.state != IDLE:
            raise WorkerError("busy", "a request is already running; cancel it or wait for it to finish")
        client = self._client_for(options)
        self._load_job = self._ensure_loaded(client, options)
        job = client.submit(op, **fields)
        self.job = job
        job.progress.connect(self.progress.emit)
        job.finished.connect(self._on_finished)
        if not job.done:
            self._set_state(RUNNING)
        else:  # failed at once (e.g. the worker could not be started)
            self._on_finished(job)
        return job

    def _on_finished(self, job: Job) -> None:
        if job.error is not None and job.error.code != "cancelled":
            self._loaded_key = None  # whatever went wrong, ask for the models again next time
        if job is self.job:
            self.job = None
            self._set_state(IDLE)
        self.finished.emit(job)

    def identify(self, options: Options, timeout: float = 20.0) -> dict:
        """What the worker ``options`` name says it is: its ``hello`` reply (docs/protocol.md),
        asked and waited for now, before anything else is sent to it. Raises :class:`WorkerError`
        (``connection`` when it does not answer within ``timeout`` seconds)."""
        if self.state != IDLE:
            raise WorkerError("busy", "a request is already running; cancel it or wait for it to finish")
        client = self._client_for(options)
        job = client.submit("hello")
        try:
            client.wait(job, timeout)
        except TimeoutError:
            raise WorkerError("connection", f"the worker did not answer within {timeout:g} s") from None
        if job.error is not None:
            raise job.error
        return job.result or {}

    def segment(self, volume_path: str, query: str, options: Options, agreement: str = "") -> Job:
        return self._run("segment", segment_fields(volume_path, query, options, agreement), options)

    def propagate(self, volume_path: str, anchor: dict, options: Options) -> Job:
        return self._run("propagate", propagate_fields(volume_path, anchor, options), options)

    def cancel(self) -> None:
        if self.job is not None and not self.job.done:
            self._set_state(CANCELLING)
            if self._load_job is not None and not self._load_job.done:
                self.client.cancel(self._load_job)
                self._loaded_key = None
            self.client.cancel(self.job)

    def poll(self, timeout: float = 0.0) -> int:
        return self.client.poll(timeout) if self.client is not None else 0

    def wait(self, job: Job, timeout: Optional[float] = None) -> Job:
        return self.client.wait(job, timeout)

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.stop()
        self.client = None
        self._client_key = self._loaded_key = None
        self.job = None
        self._set_state(IDLE)
