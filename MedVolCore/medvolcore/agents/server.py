"""``medvol mcp``: the engine as Model Context Protocol tools, on the official SDK's ``MCPServer``.

Every tool call that reads a volume is one request to the same :class:`~medvolcore.serve.worker.Worker`
that ``medvol serve`` runs (its queue, presets, volume and feature caches, limits, and
:func:`medvolcore.jobs.run_segment_job`), as an HTTP client's request: the volume is read from a
private copy made without following links, inside an allowed folder (:mod:`.places`), results are
written to a job folder of the output folder, and error messages carry no server path outside those.
The worker's progress events become MCP progress notifications; a call the client cancels cancels
its worker request. What an agent cannot fix (no model weights, an internal failure) is a protocol
error; what it can fix (a path outside the allowed folders, a bad box) is a tool error of one
sentence saying what to give instead.
"""

import asyncio
import base64
import collections
import contextlib
import logging
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, List, Optional, Union

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceNotFoundError, ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, ImageContent, TextContent, ToolAnnotations
from pydantic import BaseModel, Field

from .. import RESEARCH_USE_NOTICE, __version__
from ..errors import MedVolError
from ..serve.worker import Door, Worker, WorkerSettings
from .places import Places
from .results import (Box, JobState, KeySlice, OutputFile, SegmentOutcome, SeriesEntry, SeriesList, Target,
                      VolumeInfo)

log = logging.getLogger("medvolcore.agents")

__all__ = ["AgentSettings", "AgentServer", "INSTRUCTIONS", "NOT_READY", "Correction"]

# JSON-RPC server error (implementation-defined range): the models cannot serve; no argument fixes it
NOT_READY = -32002
# the worker's error codes an agent cannot fix by changing its arguments
_SERVER_CODES = {"model_not_found", "bad_checkpoint", "bad_model", "adapter_mismatch", "adapter_required",
                 "missing_dependency", "internal_error", "out_of_memory", "shutting_down"}
MAX_JOBS = 256  # job records kept (their files stay in the output folder)
# each stage's share of a call's progress (the worker reports a fraction per stage)
_STAGES = {"queued": (0.0, 0.0), "read": (0.0, 0.05), "load": (0.05, 0.15), "ground": (0.15, 0.7),
           "propagate": (0.7, 0.95), "write": (0.95, 1.0)}

INSTRUCTIONS = f"""\
MedVol segments structures in CT volumes from free-form clinical queries. {RESEARCH_USE_NOTICE}

How to use: describe_volume(volume) says what a CT is; segment_from_query(volume, query) asks a
vision-language model for evidence (one key axial slice and boxes on it) and a frozen MedSAM2
propagates it into a 3-D mask; repropagate(job, corrections) re-runs the propagation of an earlier
result with your boxes/points or a slice range (no model call, the encoded slices are reused);
list_series(server) finds CT series on an allowed DICOMweb server; job_status(job) tells where a
job stands. Volumes: only {{places}}.

What a result means: status "segmented" means the model placed evidence and a mask was made; it is
not a diagnosis and can be wrong (check the key slice, the boxes and the QC picture). "not_found"
means the model answered that the structure is not in this CT; it is an answer, not an error, and
it is only as good as the model. An empty or absent result from the smoke model (smoke: true) or
from a zero-shot model (a note says "zero-shot") is NOT evidence that the structure is absent.
confidence is how much the model's own samples agree (with consensus >= 2), not the probability
of being right. Read every note. Say to the user that this is research software, not a medical
device, whenever you report a result.
"""


@dataclass
class AgentSettings:
    """How ``medvol mcp`` runs: the worker's settings (preset, device, caches, limits, DICOMweb
    servers), the allowed folders (``roots``) and the output folder (``out_dir``; None: a private
    temporary folder removed at exit)."""

    worker: WorkerSettings = field(default_factory=WorkerSettings)
    roots: List[Path] = field(default_factory=list)
    out_dir: Optional[Path] = None


class Correction(BaseModel):
    """A correction prompt on one axial slice, in pixels of that slice (as the result's boxes)."""

    slice: int = Field(description="0-based axial slice index (the result's key_slice.index convention)")
    object: int = Field(1, description="which object: 1..N correct the result's boxes (N = number of boxes), N+1 "
                                       "adds a new object")
    box: Optional[List[int]] = Field(None, description="[x0, y0, x1, y1] inclusive pixel box on that slice")
    points: List[List[int]] = Field(default_factory=list, description="[[x, y, 1 inside | 0 outside], …]")


@dataclass
class _Job:
    id: str
    owner: str
    volume: str                      # as the agent gave it
    root: Optional[Path]             # the allowed folder it lies in (None: a series URL)
    wire_volume: str                 # the path inside root, or the series URL
    window: Optional[object]
    state: str = "queued"
    stage: Optional[str] = None
    fraction: Optional[float] = None
    message: str = ""
    result: Optional[SegmentOutcome] = None
    anchors: dict = field(default_factory=dict)  # target label -> its anchor (for repropagate)
    dicom_seg: bool = False          # also write a DICOM-SEG (mask.dcm) of the series


def _is_series(root: Optional[Path], wire_volume: str) -> bool:
    """Whether a placed volume is a DICOM series: a series URL (no root), or a folder (not
    followed through a link; the worker refuses one anyway)."""
    if root is None:
        return True
    try:
        return stat.S_ISDIR(os.lstat(os.path.join(str(root), wire_volume)).st_mode)
    except OSError:
        return False


class ToolRefusal(Exception):
    """A fixable input: becomes a tool error (``isError``) of one sentence."""


class AgentServer:
    """The MCP server over one worker. :attr:`mcp` is the SDK's ``MCPServer``; :meth:`close` stops
    the worker and removes a temporary output folder. ``preload``: start loading the preset at
    once; else when the first session starts (over stdio, once the SDK has sent file descriptor 1
    to stderr, so that nothing a library prints while loading reaches the JSON-RPC stream)."""

    def __init__(self, settings: AgentSettings, preload: bool = True):
        import tempfile

        self._own_out = settings.out_dir is None
        self.out_dir = Path(os.path.realpath(settings.out_dir if settings.out_dir is not None
                                             else tempfile.mkdtemp(prefix="medvol-mcp-")))
        ws = settings.worker
        self.worker = Worker.from_settings(
            WorkerSettings(**{**ws.__dict__, "data_dir": None, "out_dir": self.out_dir}), "http", preload=preload)
        self._preload = None if preload or not ws.preset else (ws.preset, ws.adapter)
        self.places = Places(settings.roots, ws.pacs_servers)
        self.jobs: "collections.OrderedDict[str, _Job]" = collections.OrderedDict()
        self.mcp = MCPServer("medvol", title="MedVol-R1", version=__version__, log_level="WARNING",
                             instructions=INSTRUCTIONS.replace("{places}", self.places.describe()),
                             lifespan=self._lifespan)
        self._register()

    @contextlib.asynccontextmanager
    async def _lifespan(self, _server):
        if self._preload is not None:
            preset, adapter = self._preload
            self._preload = None
            self.worker.preload(preset, adapter)
        yield None

    def close(self, worker: bool = True) -> None:
        """Stop the worker (unless a transport did already) and remove a temporary output folder."""
        import shutil

        if worker:
            self.worker.close()
        if self._own_out:
            shutil.rmtree(self.out_dir, ignore_errors=True)

    # -- the tools ---------------------------------------------------------------------------
    def _register(self) -> None:
        mcp = self.mcp

        def tool(**kw):  # an anticipated failure is one sentence for the model (a tool error)
            return lambda fn: mcp.tool(**kw)(_refusals(fn))

        read_only = ToolAnnotations(read_only_hint=True, open_world_hint=False)
        writes = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
                                 open_world_hint=False)

        @tool(annotations=writes)
        async def segment_from_query(
                volume: Annotated[str, Field(description="absolute path of a CT file (.nii.gz, .nii, .nrrd, .mha) "
                                                         "or DICOM series folder under an allowed folder, or a "
                                                         "series URL from list_series")],
                query: Annotated[Union[str, List[str]], Field(description="what to find, in clinical words (e.g. "
                                                                          "'the organ that secretes bile'); a "
                                                                          "list for several targets at once")],
                consensus: Annotated[Optional[int], Field(description="ask the model 2..8 times and report how "
                                                                      "much the answers agree (slower)")] = None,
                window: Annotated[Optional[str], Field(description="CT window: soft_tissue (default), abdomen, "
                                                                   "liver, mediastinum, lung, bone, brain, or "
                                                                   "'centre,width' in HU")] = None,
                dicom_seg: Annotated[Optional[bool], Field(description="also write a DICOM Segmentation (mask.dcm) "
                                                                       "referencing the series; default: when the "
                                                                       "volume is a DICOM series (a series URL or "
                                                                       "a DICOM folder)")] = None,
                ctx: Context = None) -> Annotated[CallToolResult, SegmentOutcome]:
            """Segment structures named in free text in a CT volume.

            Returns status "segmented" (a mask was made) or "not_found" (the model answered that the
            structure is not in this CT: an answer, not an error). Each target gives its key slice and
            boxes (the evidence), volume in mL, HU statistics, notes, and the files written (mask, 3D
            Slicer .seg.nrrd, DICOM-SEG of a DICOM series, anchor JSON, QC picture) as paths and resource
            URIs; the QC picture also comes as an image. Progress is reported while it runs; cancelling the call stops the job.
            Research use only: not a diagnosis."""
            queries = [query] if isinstance(query, str) else list(query)
            req = {"op": "segment", "query": queries[0]} if len(queries) == 1 else {"op": "segment",
                                                                                    "queries": queries}
            if consensus is not None:
                req["consensus"] = consensus
            if window is not None:
                req["window"] = window
            root, wire_volume = self._place(volume)
            job = self._new_job(ctx, volume, root, wire_volume, window)
            job.dicom_seg = _is_series(root, wire_volume) if dicom_seg is None else bool(dicom_seg)
            return await self._run(ctx, job, req)

        @tool(annotations=writes)
        async def repropagate(
                job: Annotated[str, Field(description="the job id of an earlier segment_from_query or repropagate "
                                                      "result")],
                corrections: Annotated[List[Correction], Field(description="boxes and inside/outside points on "
                                                                           "any slices")] = [],  # noqa: B006
                slice_range: Annotated[Optional[List[int]], Field(description="[first, last] axial slices the mask "
                                                                              "may reach")] = None,
                target: Annotated[int, Field(description="which target of that job (its label)")] = 1,
                ctx: Context = None) -> Annotated[CallToolResult, SegmentOutcome]:
            """Correct an earlier result: re-run MedSAM2's propagation from its evidence plus your boxes,
            inside/outside points and slice range. No model is asked again and the volume's encoded
            slices are reused (slices_encoded is 0). A target the model did not find cannot be
            corrected: ask segment_from_query again with other words."""
            prev = self._job(ctx, job)
            anchor = prev.anchors.get(target)
            if anchor is None:
                found = ", ".join(str(k) for k in sorted(prev.anchors))
                raise ToolRefusal(f"job {job!r} has no found target {target} to correct (targets found: "
                                  f"{found or 'none'}); ask segment_from_query again with other words"
                                  if prev.result is not None else
                                  f"job {job!r} has no result to correct yet (state {prev.state})")
            anchor = {k: v for k, v in anchor.items() if k not in ("propagation", "prompts", "z_range")}
            if corrections or slice_range is not None:
                anchor["schema"] = "medvol.anchor/2"
                anchor["world"] = {k: v for k, v in (anchor.get("world") or {}).items() if k != "z_range_ras"}
                if corrections:
                    anchor["prompts"] = [c.model_dump() for c in corrections]
                if slice_range is not None:
                    anchor["z_range"] = slice_range
            req = {"op": "propagate", "anchor": anchor}
            if prev.window is not None:
                req["window"] = prev.window
            new = self._new_job(ctx, prev.volume, prev.root, prev.wire_volume, prev.window)
            new.dicom_seg = prev.dicom_seg
            return await self._run(ctx, new, req)

        @tool(annotations=read_only)
        async def describe_volume(
                volume: Annotated[str, Field(description="absolute path of a CT file or DICOM folder under an "
                                                         "allowed folder")],
                ctx: Context = None) -> VolumeInfo:
            """Describe a CT volume: format, voxel grid, spacing, orientation, the axial slices a key slice
            index may take, the slice size in pixels, the intensity range, and whether it looks like CT."""
            import anyio

            root, wire_volume = self._place(volume)
            if root is None:
                raise ToolRefusal("describe_volume reads files under the allowed folders; a series URL is read by "
                                  "segment_from_query directly")
            return await anyio.to_thread.run_sync(self._describe, root, wire_volume, volume)

        @tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=True))
        async def list_series(
                server: Annotated[str, Field(description="the name of an allowed DICOMweb server")],
                modality: Annotated[Optional[str], Field(description="DICOM modality, e.g. CT")] = "CT",
                study_date: Annotated[Optional[str], Field(description="YYYYMMDD or a range YYYYMMDD-YYYYMMDD")] = None,
                limit: Annotated[int, Field(ge=1, le=200, description="at most this many series")] = 50,
                ctx: Context = None) -> SeriesList:
            """List series on an allowed DICOMweb server (a QIDO-RS search), at most `limit`; give a
            series' url to segment_from_query as its volume."""
            import anyio

            from ..pacs import find_series

            srv = self.places.server(server)
            found = await anyio.to_thread.run_sync(
                lambda: find_series(srv.base, modality=modality, study_date=study_date, limit=limit + 1,
                                    token=srv.token))
            entries = [SeriesEntry(url=str(u), study=u.study, series=u.series)
                       for u in found[:limit]]
            return SeriesList(server=server, series=entries, truncated=len(found) > limit)

        @tool(annotations=read_only)
        async def job_status(job: Annotated[str, Field(description="a job id from a result")],
                             ctx: Context = None) -> JobState:
            """Where a job of this session stands: queued, running (with its stage and fraction), done
            (with its result), failed or cancelled."""
            j = self._job(ctx, job)
            return JobState(job=j.id, state=j.state, stage=j.stage, fraction=j.fraction, message=j.message,
                            result=j.result)

        @mcp.resource("medvol://jobs/{job}/{name}", name="job file", description="a file a job wrote")
        async def job_file(job: str, name: str, ctx: Context) -> bytes:
            j = self.jobs.get(job)
            if j is None or j.owner != _owner(ctx) or j.result is None or \
                    name not in {Path(f.path).name for f in j.result.files}:
                raise ResourceNotFoundError(f"no file {name!r} of job {job!r} in this session")
            return (self.out_dir / job / name).read_bytes()

    # -- jobs ------------------------------------------------------------------------------------
    def _place(self, volume: str):
        try:
            return self.places.volume(volume)
        except MedVolError as e:
            raise ToolRefusal(str(e)) from None

    def _new_job(self, ctx, volume: str, root, wire_volume: str, window) -> _Job:
        job = _Job(secrets.token_hex(6), _owner(ctx), volume, root, wire_volume, window)
        self.jobs[job.id] = job
        while len(self.jobs) > MAX_JOBS:
            self.jobs.popitem(last=False)
        return job

    def _job(self, ctx, job_id: str) -> _Job:
        j = self.jobs.get(job_id)
        if j is None or j.owner != _owner(ctx):
            mine = [k for k, v in self.jobs.items() if v.owner == _owner(ctx)][-5:]
            raise ToolRefusal(f"no job {job_id!r} in this session; recent jobs: {', '.join(mine) or 'none'}")
        return j

    async def _run(self, ctx, job: _Job, req: dict):
        folder = self.out_dir / job.id
        folder.mkdir(mode=0o700)
        masks = (folder / "mask.seg.nrrd",) + ((folder / "mask.dcm",) if job.dicom_seg else ())
        door = Door(data_dir=job.root, masks=masks, anchor=folder / "mask.anchor.json",
                    qc=folder / "qc.png", events=True)
        req = dict(req, id=job.id, volume=job.wire_volume, out=f"{job.id}/mask.nii.gz")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def deliver(obj: dict) -> None:  # from the worker's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, obj)
            except RuntimeError:  # the call is over (cancelled, its loop closed): nobody waits for this
                pass

        wjob = self.worker.handle(req, deliver, transport="http", session=job.owner, mask_bytes=True, door=door)
        shown = 0.0
        try:
            # the job's id first, so that a client can ask job_status about the call it waits for
            await ctx.report_progress(0.0, 1.0, f"job {job.id}: queued")
            while True:
                msg = await queue.get()
                if msg.get("event") != "progress":
                    break
                job.state, job.stage, job.fraction = "running", msg["stage"], msg["fraction"]
                job.message = msg["message"]
                lo, hi = _STAGES.get(msg["stage"], (shown, shown))
                overall = lo + (hi - lo) * float(msg["fraction"])
                if overall > shown:  # progress only ever grows
                    shown = overall
                    await ctx.report_progress(round(shown, 4), 1.0, f"{msg['stage']}: {msg['message']}")
        except BaseException:  # the client cancelled the call, or went away
            if wjob is not None:
                self.worker.abandon(wjob)
            job.state = "cancelled"
            _remove_empty(folder)
            raise
        if not msg.get("ok"):
            _remove_empty(folder)  # a failed job wrote nothing (the job writes its outputs as one set)
            err = msg.get("error") or {}
            job.state = "cancelled" if err.get("code") == "cancelled" else "failed"
            job.message = err.get("message", "")
            if err.get("code") in _SERVER_CODES:
                raise MCPError(NOT_READY, f"the server cannot segment now: {err.get('message')}",
                               {"code": err.get("code")})
            raise ToolRefusal(self._refusal(err))
        res = msg["result"]
        res.pop("_mask_bytes", None)
        outcome, anchors = self._outcome(job, res)
        job.state, job.result, job.anchors, job.stage, job.fraction = "done", outcome, anchors, None, None
        return self._reply(outcome)

    def _refusal(self, err: dict) -> str:
        """The worker's error message as an agent reads it: its folders named as this server names
        them, and for a refused place what may be named instead."""
        text = (err.get("message") or "the request failed").replace("the server's data folder", "the allowed folders")
        if err.get("code") == "forbidden":
            text += f"; give {self.places.describe()}"
        return text

    # -- results ---------------------------------------------------------------------------------
    def _files(self, job: _Job) -> List[OutputFile]:
        kinds = {".nii.gz": "mask", ".seg.nrrd": "seg_nrrd", ".dcm": "dicom_seg", ".anchor.json": "anchor",
                 ".png": "qc", ".labels.json": "labels"}
        out = []
        for f in sorted((self.out_dir / job.id).iterdir()):
            kind = next((k for s, k in kinds.items() if f.name.endswith(s)), None)
            if kind is None:
                continue
            parts = f.name.split(".")
            target = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else None
            out.append(OutputFile(kind=kind, path=str(f), uri=f"medvol://jobs/{job.id}/{f.name}", target=target))
        return out

    def _outcome(self, job: _Job, res: dict):
        entries = res.get("targets") or [dict(res, label=1)]
        targets, anchors = [], {}
        for e in entries:
            anchor = e.get("anchor") or {}
            stats = e.get("stats") or {}
            term = e.get("terminology") or {}
            code = term.get("type")
            found = not e.get("absent")
            if found:
                anchors[int(e["label"])] = anchor
            boxes_ras = ((anchor.get("world") or {}).get("boxes_ras") or [])
            targets.append(Target(
                label=int(e["label"]), query=anchor.get("query") or stats.get("query") or "", found=found,
                structure=term.get("structure") or None, code=f"{code[0]}:{code[1]}" if code else None,
                code_meaning=code[2] if code and len(code) > 2 else None,
                key_slice=KeySlice(index=anchor["slice"], s_mm=stats.get("key_slice_s_mm")) if found else None,
                boxes=[Box(voxels=b, ras_mm=boxes_ras[i] if i < len(boxes_ras) else None)
                       for i, b in enumerate(anchor.get("boxes") or [])],
                volume_ml=stats.get("volume_ml"), voxels=stats.get("voxels"),
                hu={k: stats.get(f"{k}_hu") for k in ("mean", "std", "min", "max")} if found else None,
                bbox_ras_mm=[stats["bbox_ras_min"], stats["bbox_ras_max"]] if stats.get("bbox_ras_min") else None,
                confidence=e.get("confidence"), answer_mean_prob=e.get("answer_mean_prob"),
                reasoning=e.get("reasoning") or "", notes=list(e.get("notes") or [])))
        found = any(t.found for t in targets)
        timings = res.get("timings") or {}
        notes = list(res.get("notes") or []) if res.get("targets") else []
        identity = res.get("identity") or {}
        if not all(t.found for t in targets) and (res.get("smoke") or identity.get("zero_shot")
                                                  or not identity.get("trained_for_task", True)):
            notes.append("a structure reported as not found by " + ("the untrained smoke model" if res.get("smoke")
                         else "a model not trained for this task") + " is NOT evidence that it is absent")
        outcome = SegmentOutcome(
            job=job.id, status="segmented" if found else "not_found", volume=job.volume,
            model=res.get("model_label") or "", smoke=bool(res.get("smoke")), targets=targets,
            files=self._files(job), slices_encoded=int(res.get("slices_encoded") or 0),
            seconds=float(timings.get("request_s") or 0.0),
            notes=notes, research_use=RESEARCH_USE_NOTICE)
        return outcome, anchors

    def _reply(self, outcome: SegmentOutcome):
        lines = [f"{outcome.status} (job {outcome.job}; model: {outcome.model})"]
        for t in outcome.targets:
            if t.found:
                lines.append(f"- {t.query!r}: {t.code_meaning or t.structure or 'structure'} ({t.code}), key slice "
                             f"{t.key_slice.index}, {len(t.boxes)} box(es), {t.volume_ml} mL")
            else:
                lines.append(f"- {t.query!r}: not found in this CT (the model's answer)")
            lines += [f"  note: {n}" for n in t.notes[:6]]
        lines += [f"note: {n}" for n in outcome.notes]
        lines.append(RESEARCH_USE_NOTICE)
        content = [TextContent(type="text", text="\n".join(lines))]
        for f in outcome.files:
            if f.kind == "qc":
                data = base64.b64encode(Path(f.path).read_bytes()).decode("ascii")
                content.append(ImageContent(type="image", data=data, mime_type="image/png"))
        return CallToolResult(content=content, structured_content=outcome.model_dump(mode="json"))

    def _describe(self, root: Path, wire_volume: str, shown: str) -> VolumeInfo:
        from ..sources import COPY_SECONDS, private_copy
        from ..stack import AxialStack, axis_codes
        from ..volume import ct_plausibility, load_volume

        try:
            with private_copy(root, wire_volume, self.worker.tmp_dir, None, "volume",
                              max_bytes=self.worker.cache.max_bytes(), max_voxels=self.worker.max_voxels,
                              seconds=COPY_SECONDS) as copy:
                vol = load_volume(copy.path, max_voxels=self.worker.max_voxels)
            stack = AxialStack(vol)
            notes = ct_plausibility(vol.array, "the volume")
        except MedVolError as e:
            raise ToolRefusal(self._refusal({"code": e.code, "message": self.worker.public_message(str(e), "http")}))
        return VolumeInfo(volume=shown, format=vol.source_format, shape=list(vol.shape),
                          spacing_mm=[round(float(s), 4) for s in vol.spacing], orientation=axis_codes(stack),
                          axial_slices=stack.depth, slice_size=[stack.width, stack.height],
                          hu_range=[float(vol.array.min()), float(vol.array.max())], ct_like=not notes,
                          notes=list(notes) + list(getattr(vol, "notes", None) or []))


def _remove_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty (a cancelled job may still be writing) or gone
        pass


def _owner(ctx) -> str:
    """Whose jobs a call may see: its HTTP session's (``Mcp-Session-Id``), or the one stdio client's."""
    try:
        headers = ctx.headers if ctx is not None else None
    except Exception:  # noqa: BLE001 - no HTTP request behind this call
        headers = None
    return (headers or {}).get("mcp-session-id") or "local"


def _refusals(fn):
    """``fn`` with :class:`ToolRefusal` and the engine's input errors turned into the SDK's
    ``ToolError`` (a tool result with ``isError``, the message in one sentence)."""
    import functools

    @functools.wraps(fn)
    async def wrapped(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except ToolRefusal as e:
            raise ToolError(str(e)) from None
        except MedVolError as e:
            raise ToolError(str(e)) from None

    return wrapped
