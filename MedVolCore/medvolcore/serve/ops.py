"""The worker's volume work: its models, reading a request's volume, and a ``segment``/``propagate`` job.

:class:`VolumeOps` is mixed into :class:`~medvolcore.serve.worker.Worker` and runs on its one
thread: loading a pipeline (``load``, or on the first volume request), reading the request's
volume through the worker's :class:`.cache.StackCache` (an upload, a file the client may name,
or a series on an allowed DICOMweb server, always read from a private copy over HTTP), and
:func:`medvolcore.jobs.run_segment_job` with the worker's cached volumes and encoded slices,
whose result becomes the reply (its files as :class:`.paths.ClientPaths` lets the client see them).
"""

from __future__ import annotations

import base64
import math
import os
import time
from pathlib import Path
from typing import Optional

from ..errors import MedVolError
from ..pacs import allowed_source, is_dicomweb
from ..sources import COPY_SECONDS, private_copy
from .cache import check_request_memory, scoped
from .protocol import RequestError
from .upload import Upload

MASK_BYTES_KEY = "_mask_bytes"  # a result's mask as bytes, for a transport that sends them raw (never JSON)


class VolumeOps:
    """Models, volumes and volume jobs of the worker (a mixin of the worker, on its thread)."""

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

    def _stack_for(self, job, progress) -> tuple:
        """``(stack, sha256, cached)`` for the request's volume (see :class:`.cache.StackCache`).

        A cached volume that its file's header contradicted was read again; the encoded slices
        kept under its key were made from the wrong voxels, so they are dropped too."""
        mismatches = self.cache.mismatches
        stack, digest, cached = self._read_stack(job, progress)
        if self.cache.mismatches != mismatches:
            self.features.discard_prefix(scoped(self._scope(job), digest))
        return stack, digest, cached

    @staticmethod
    def _scope(job) -> str:
        """Whose cached volumes and encoded slices a request may use: over HTTP its session's
        only (a session is a client's identity: one address is every client behind a proxy, and
        the server's token is shared), so no reply tells a client that another one sent the same
        CT; over stdio the one client's ("")."""
        return f"session:{job.session or ''}" if job.transport == "http" else ""

    def _read_stack(self, job, progress) -> tuple:
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

    def _read_series_url(self, job, value: str, progress) -> tuple:
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

    def _run_volume_job(self, job, progress) -> dict:
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

    def _volume_job(self, job, progress, reply_copy: Optional[Path]) -> dict:
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
