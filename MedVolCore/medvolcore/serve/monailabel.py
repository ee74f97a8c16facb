"""MONAI Label's REST contract on ``medvol serve --http --monailabel NAME``, for the viewers that
speak it (MONAI Label's OHIF plugin and 3D Slicer module, its Python client): one model that
segments series of the allowed DICOMweb server NAME, the viewer itself, and bounded DICOMweb
proxy routes for it.

========================================  ===========================================================
``GET /info/``                            the app: one model (named after the loaded preset) of type
                                          ``segmentation``, its labels (the terminology's structures,
                                          plus ``target`` for a query that names none), its config
                                          (``query``, ``consensus``), the research-use notice
``POST /infer/{model}?image=UID``         a multipart ``params`` JSON (``query``, or ``label``: a
                                          label's name as the query); the series is looked up on NAME
                                          (QIDO-RS) and segmented by the worker's one segment job;
                                          answers the label file (``output=image``), the JSON
                                          (``json``) or both as multipart (``all``, the default);
                                          ``dicom_seg``: a DICOM-SEG (BINARY) of the series
``GET /datastore/``                       a read-only, empty datastore's status (nothing is stored)
``GET /proxy/dicom/{qido,wado}/studies…`` QIDO-RS and WADO-RS of server NAME, GET only, bounded
``GET /ohif/…``                           the prebuilt OHIF viewer with MONAI Label's plugin (from the
                                          ``monailabel`` wheel, which ``bootstrap.py`` installs without
                                          its dependencies)
========================================  ===========================================================

Every request passes the transport's checks first (``Host``, ``Origin``, token); errors come back
as MONAI Label's do: an HTTP status and ``{"detail": "one line"}``. The label file is on the
series' own grid; its voxels hold the label's value of ``/info/`` (what the plugin maps to its
segments). The answer's anchor, reasoning, confidence and notes are the JSON part (and, for the
viewer, the ``X-MedVol-Result`` header, which the page's small MedVol-R1 panel shows).
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import gzip
import itertools
import json
import mimetypes
import os
import re
import shutil
import tempfile
import threading
import urllib.parse
from pathlib import Path
from typing import Optional

from starlette.responses import Response

from .. import RESEARCH_USE_NOTICE
from ..errors import ForbiddenError, MedVolError
from ..strictjson import DuplicateKeyError, unique_keys
from .limits import limit
from .worker import MASK_BYTES_KEY, Door, log

__all__ = ["MonaiLabelApp", "default_ohif_dir", "OHIF_ENV"]

OHIF_ENV = "MEDVOL_OHIF_DIR"
RESULT_HEADER = "X-MedVol-Result"
GENERIC_LABEL = "target"  # the label of a query that names no structure of the terminology
OUTPUTS = ("image", "json", "all", "dicom_seg")
LABEL_SUFFIXES = (".nii.gz", ".nii", ".nrrd")
# what MONAI Label's clients add to every request's params, and may be ignored here
_HOUSEKEEPING = {"client_id", "result_extension", "result_dtype", "result_compress", "restore_label_idx",
                 "label_info", "device", "label_prompt"}
_READ = {"query", "label", "consensus"}
_PROMPTS = {"foreground", "background", "points", "point_labels", "roi", "largest_cc"}
_PROXY_SEGMENT = re.compile(r"[A-Za-z0-9.,_-]{1,64}")
_MAX_PROXY_QUERY = int(limit("viewer_proxy_query").default)
_STATIC_TYPES = {".js": "application/javascript", ".wasm": "application/wasm", ".css": "text/css",
                 ".html": "text/html", ".json": "application/json", ".svg": "image/svg+xml", ".png": "image/png",
                 ".ico": "image/x-icon", ".txt": "text/plain", ".map": "application/json", ".woff2": "font/woff2"}
_STATUS = {"bad_request": 400, "bad_input": 400, "bad_volume": 400, "bad_output": 400, "unknown_op": 400,
           "forbidden": 403, "not_found": 404, "too_large": 413, "busy": 503, "shutting_down": 503,
           "pacs_error": 502, "cancelled": 499, "missing_dependency": 501}


def default_ohif_dir() -> Optional[Path]:
    """The prebuilt viewer: ``$MEDVOL_OHIF_DIR``, else the one inside the installed ``monailabel``
    wheel (``bootstrap.py`` installs it without its dependencies; nothing of it is imported)."""
    import importlib.util

    if os.environ.get(OHIF_ENV):
        d = Path(os.environ[OHIF_ENV])
    else:
        spec = importlib.util.find_spec("monailabel")
        if spec is None or not spec.submodule_search_locations:
            return None
        d = Path(list(spec.submodule_search_locations)[0]) / "endpoints" / "static" / "ohif"
    return d if (d / "index.html").is_file() else None


def labels() -> dict:
    """``{name: value}``: ``target`` is 1, then each structure of the terminology (its table's name
    with spaces) in the table's order."""
    from ..terminology import table

    out = {GENERIC_LABEL: 1}
    for n, name in enumerate(table(), start=2):
        out[name.replace("_", " ")] = n
    return out


def label_of(query: str, names: dict) -> tuple:
    """``(label name, value)`` for a query: the structure it names (by the terminology's rules),
    else ``target``."""
    from ..terminology import match

    term = match(query)
    name = term.structure.replace("_", " ") if term.structure else ""
    return (name, names[name]) if name in names else (GENERIC_LABEL, 1)


def _detail(status: int, message: str, headers: Optional[dict] = None) -> Response:
    body = json.dumps({"detail": message}).encode("utf-8")
    h = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}
    h.update(headers or {})
    return Response(body, status, h, media_type="application/json")


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class MonaiLabelApp:
    """The MONAI Label routes of one HTTP worker, answering for series of ``server`` (a
    :class:`medvolcore.pacs.PacsServer`); ``ohif_dir`` the viewer's folder (None: no viewer)."""

    prefixes = ("/info", "/infer/", "/datastore", "/proxy/dicom/", "/ohif", "/logs", "/train", "/activelearning",
                "/session", "/scoring", "/batch", "/model")

    def __init__(self, transport, server, ohif_dir: Optional[Path]):
        self.transport = transport
        self.worker = transport.worker
        self.server = server
        self.ohif_dir = Path(ohif_dir).resolve() if ohif_dir is not None else None
        self._ids = itertools.count(1)
        self._labels = None

    def handles(self, path: str) -> bool:
        return path == "/" or any(path == p.rstrip("/") or path.startswith(p) for p in self.prefixes)

    async def __call__(self, request) -> Response:
        path, method = request.scope["path"], request.method
        try:
            if path == "/" and method == "GET":
                return Response(b"", 307, {"Location": "/ohif/"})
            if path.rstrip("/") == "/info" and method == "GET":
                return self.info()
            if path.startswith("/infer/") and method == "POST":
                return await self.infer(request, urllib.parse.unquote(path[len("/infer/"):]))
            if path.rstrip("/") == "/datastore" and method == "GET":
                return self._json(self.datastore())
            if path.startswith("/proxy/dicom/") and method == "GET":
                return await self.proxy(request, path[len("/proxy/dicom/"):])
            if (path == "/ohif" or path.startswith("/ohif/")) and method == "GET":
                return self.ohif(path[len("/ohif/"):] if path.startswith("/ohif/") else "")
        except _Refused as e:
            return _detail(e.status, str(e))
        if path.startswith(("/datastore", "/proxy/dicom/")):
            return _detail(405, "this worker's datastore and DICOMweb proxy are read-only: GET only "
                                "(labels are not stored)")
        return _detail(404, "not served by MedVol-R1: it answers GET /info/, POST /infer/{model}, GET /datastore/ "
                            "and the viewer; training, active learning, sessions and scoring are not supported")

    # -- /info/ --
    def model_name(self) -> str:
        served = self.worker._served_models()
        return str(served.get("preset") or "medvol")

    def info(self) -> Response:
        served = self.worker._served_models()
        identity = served.get("identity") or {}
        if self._labels is None:
            self._labels = labels()
        name = self.model_name()
        shown = identity.get("label") or name
        model = {"type": "segmentation", "labels": self._labels, "dimension": 3,
                 "description": f"{shown}: a free-text query (Options › infer › query) segmented by a "
                                f"vision-language model's key-slice anchor propagated by MedSAM2. "
                                f"{RESEARCH_USE_NOTICE}",
                 "config": {"query": "", "consensus": 1}}
        body = {"name": f"MedVol-R1 ({shown})", "description": RESEARCH_USE_NOTICE, "version": served.get("preset"),
                "labels": list(self._labels), "models": {name: model}, "trainers": {}, "strategies": {},
                "scoring": {}, "train_stats": {}, "datastore": self.datastore(),
                "medvol": {"research_use": RESEARCH_USE_NOTICE, "identity": identity, "preset": served.get("preset"),
                           "pacs": self.server.name}}
        return self._json(body)

    @staticmethod
    def datastore() -> dict:
        return {"total": 0, "completed": 0, "label_tags": {}, "train": 0, "read_only": True}

    @staticmethod
    def _json(obj, status: int = 200, headers: Optional[dict] = None) -> Response:
        h = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}
        h.update(headers or {})
        return Response(json.dumps(obj, allow_nan=False).encode("utf-8"), status, h, media_type="application/json")

    # -- /infer/{model} --
    async def infer(self, request, model: str) -> Response:
        if model != self.model_name():
            raise _Refused(404, f"no model {model[:60]!r}; this server has {self.model_name()!r} (GET /info/)")
        q = request.query_params
        image, output = q.get("image", ""), q.get("output") or "all"
        if output not in OUTPUTS:
            raise _Refused(422, f"output must be one of {', '.join(OUTPUTS)}, got {output[:40]!r}")
        if q.get("session_id"):
            raise _Refused(422, "sessions are not supported; name the series with image=SeriesInstanceUID")
        params = self._params(await self._form(request))
        query, label = params.get("query"), params.get("label")
        if query is not None and label is not None:
            raise _Refused(422, "give 'query' (free text) or 'label' (a label's name), not both")
        if label is not None:
            if label not in (self._labels or labels()):
                raise _Refused(422, f"no label {str(label)[:60]!r} (GET /info/ lists them)")
            query = label
        if query is None or query == "":
            raise _Refused(422, "no query: set 'query' in params (the viewer: Options / Configurations › infer › "
                                "query)")
        if not image:
            raise _Refused(422, "image=SeriesInstanceUID is required")
        loop = asyncio.get_running_loop()
        volume = await loop.run_in_executor(None, self._series, image)
        req = {"id": f"monailabel-{next(self._ids)}", "op": "segment", "volume": volume, "query": query,
               "empty_mask_on_absent": True}
        if params.get("consensus") not in (None, 1):
            req["consensus"] = params["consensus"]
        # output=dicom_seg: the job also writes a DICOM-SEG of the retrieved series (its record, read from
        # the worker's private copy) to a private file, whose bytes are the answer
        seg = Path(tempfile.mkdtemp(prefix="monailabel-", dir=self.worker.tmp_dir)) / "label.dcm" \
            if output == "dicom_seg" else None
        try:
            reply = await self._run(request, req, seg)
            if not reply.get("ok"):
                err = reply.get("error") or {}
                raise _Refused(_STATUS.get(err.get("code"), 500), err.get("message") or "the request failed")
            if seg is not None:
                return await loop.run_in_executor(None, self._seg_answer, reply["result"], query, seg)
            return await loop.run_in_executor(None, self._answer, reply["result"], query, output, params)
        finally:
            if seg is not None:
                shutil.rmtree(seg.parent, ignore_errors=True)

    async def _form(self, request) -> dict:
        """The multipart (or url-encoded) form's fields, the body bounded by ``--max-request-mb``;
        a file part (a scribble label, an uploaded image) is refused."""
        ctype = request.headers.get("content-type") or ""
        length = request.headers.get("content-length")
        limit = self.worker.max_request_bytes
        if length is None:
            return {}
        n = int(length.strip(" \t"))
        if n > limit:
            if n <= 4 * limit + (16 << 20):  # read (and drop) a moderately oversized body after the reply
                request.state.drain = n
            raise _Refused(413, f"request body of {n} bytes is over --max-request-mb {limit / (1 << 20):g} MB")
        data = bytearray()
        async for chunk in self.transport._chunks(request, n):
            data += chunk
        kind = ctype.split(";")[0].strip().lower()
        if n == 0:
            return {}
        if kind == "application/x-www-form-urlencoded":
            return dict(urllib.parse.parse_qsl(bytes(data).decode("utf-8", "replace"), keep_blank_values=True))
        if kind != "multipart/form-data":
            raise _Refused(415, f"Content-Type must be multipart/form-data (a 'params' field), got {kind or 'none'!r}")
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + ctype.encode("latin-1") + b"\r\n\r\n" + bytes(data))
        if not msg.is_multipart():
            raise _Refused(400, "the multipart body could not be read")
        fields = {}
        for part in msg.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if part.get_filename() is not None or name in ("file", "label"):
                raise _Refused(422, f"a file part ({str(name)[:40]!r}) is not supported: the series is read from "
                                    "the DICOMweb server by its UID (no uploads, no scribbles)")
            if name:
                fields[name] = part.get_payload(decode=True).decode("utf-8", "replace")
        return fields

    def _params(self, form: dict) -> dict:
        raw = form.get("params") or "{}"
        try:
            params = json.loads(raw, object_pairs_hook=unique_keys)
        except DuplicateKeyError as e:
            raise _Refused(422, f"params names {e.key[:40]!r} twice") from None
        except (ValueError, RecursionError):
            raise _Refused(422, "params is not JSON") from None
        if not isinstance(params, dict):
            raise _Refused(422, "params must be a JSON object")
        prompts = sorted(set(params) & _PROMPTS)
        if prompts:
            raise _Refused(422, f"{', '.join(prompts)}: click and box prompts are not supported through this "
                                "contract; correct in MedVol-R1's 3D Slicer module")
        unknown = sorted(set(params) - _READ - _HOUSEKEEPING)
        if unknown:
            raise _Refused(422, f"unknown params {', '.join(k[:40] for k in unknown[:5])}; MedVol-R1 reads "
                                "query, label and consensus")
        for key in ("query", "label"):
            if params.get(key) is not None and not isinstance(params[key], str):
                raise _Refused(422, f"'{key}' must be text")
        c = params.get("consensus")
        if c is not None and (isinstance(c, bool) or not isinstance(c, int)):
            raise _Refused(422, "'consensus' must be an integer (1: none, 2..8: that many answers)")
        return params

    def _series(self, image: str) -> str:
        """The series URL on the allowed server for a client's ``image`` (a UID, or a series URL on
        that same server)."""
        from ..pacs import allowed_source, is_dicomweb, series_on

        try:
            if is_dicomweb(image) or "://" in image:
                _server, url = allowed_source(image, {self.server.name: self.server}, "image")
                return str(url)
            return str(series_on(self.server, image))
        except ForbiddenError as e:
            raise _Refused(403, str(e)) from None
        except MedVolError as e:
            raise _Refused(_STATUS.get(e.code, 400), str(e)) from None

    async def _run(self, request, req: dict, seg: Optional[Path] = None) -> dict:
        """The worker's final reply to ``req`` (its one segment job, queue and caches); a client
        that goes away has its request cancelled. ``seg``: a DICOM-SEG the job also writes."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def reply(obj):
            if "event" not in obj:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(obj))

        job = await loop.run_in_executor(None, lambda: self.worker.handle(
            req, reply=reply, transport="http", session=request.state.session, mask_bytes=True,
            door=Door(masks=(seg,)) if seg is not None else None))
        if not await self.transport._done_or_gone(request, done):
            if job is not None:
                self.worker.abandon(job)
            from .http_app import _Gone

            raise _Gone()
        self.transport.server.sessions.touch(request.state.session)
        return done.result()

    def _seg_answer(self, result: dict, query: str, seg: Path) -> Response:
        """``output=dicom_seg``: the DICOM-SEG file itself is the label, as MONAI Label answers it."""
        if not seg.is_file():  # dropped with a note (a series a SEG cannot reference): the reason, in one line
            why = next((n for n in result.get("notes") or () if str(seg) in n), "the DICOM-SEG could not be written")
            why = why.replace(f"out {seg} was not written: ", "").replace(str(seg), "label.dcm")
            raise _Refused(422, f"output=dicom_seg: {why.split('; the other outputs were')[0]}; ask output=image")
        shown = {"query": query[:300], "absent": bool(result.get("absent")), "model_label": result.get("model_label"),
                 "research_use": RESEARCH_USE_NOTICE}
        return Response(seg.read_bytes(), 200, {RESULT_HEADER: urllib.parse.quote(json.dumps(shown), safe=""),
                                                "Content-Disposition": 'attachment; filename="label.dcm"',
                                                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"},
                        media_type="application/dicom")

    def _answer(self, result: dict, query: str, output: str, params: dict) -> Response:
        data = result.pop(MASK_BYTES_KEY, None)
        name, value = label_of(query, self._labels or labels())
        absent = bool(result.get("absent"))
        summary = {"model": self.model_name(), "query": query, "label": name, "label_value": value, "absent": absent,
                   "message": f"not found in this CT: {query}" if absent else f"found: {query}",
                   "anchor": result.get("anchor"), "reasoning": result.get("reasoning"),
                   "confidence": result.get("confidence"), "answer_mean_prob": result.get("answer_mean_prob"),
                   "notes": result.get("notes") or [], "model_label": result.get("model_label"),
                   "terminology": result.get("terminology"), "mask_voxels": result.get("mask_voxels"),
                   "research_use": RESEARCH_USE_NOTICE}
        shown = {k: summary[k] for k in ("query", "label", "absent", "message", "reasoning", "confidence",
                                          "model_label", "research_use")}
        shown.update(query=query[:300], message=summary["message"][:400], reasoning=(summary["reasoning"] or "")[:500])
        head = {RESULT_HEADER: urllib.parse.quote(json.dumps(shown), safe="")}  # ASCII, a few kB at most
        if output == "json":
            return self._json(summary, headers=head)
        suffix = params.get("result_extension") or ".nii.gz"
        if suffix not in LABEL_SUFFIXES:
            raise _Refused(422, f"result_extension must be one of {', '.join(LABEL_SUFFIXES)}")
        label = _label_file(data, value, suffix, self.worker.tmp_dir)
        filename = f"label{suffix}"
        if output == "image":
            return Response(label, 200, {**head, "Content-Disposition": f'attachment; filename="{filename}"',
                                         "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"},
                            media_type="application/octet-stream")
        boundary = os.urandom(16).hex()
        parts = [(f'--{boundary}\r\nContent-Disposition: form-data; name="params"\r\n'
                  f'Content-Type: application/json\r\n\r\n').encode() + json.dumps(summary).encode("utf-8") + b"\r\n",
                 (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{filename}"\r\n'
                  f'Content-Type: application/octet-stream\r\n\r\n').encode() + label + b"\r\n",
                 f"--{boundary}--\r\n".encode()]
        return Response(b"".join(parts), 200, {**head, "X-Content-Type-Options": "nosniff",
                                                "Cache-Control": "no-store"},
                        media_type=f"multipart/form-data; boundary={boundary}")

    # -- the viewer's DICOMweb: GET only, to the one allowed server, bounded --
    async def proxy(self, request, rest: str) -> Response:
        op, _, path = rest.partition("/")
        segs = path.rstrip("/").split("/")
        if op not in ("qido", "wado") or segs[0] != "studies" or len(segs) > 10 or not all(
                _PROXY_SEGMENT.fullmatch(seg) and seg.strip(".") for seg in segs):
            raise _Refused(404, "the DICOMweb proxy answers GET …/qido/studies… and …/wado/studies… only")
        query = request.scope.get("query_string", b"").decode("latin-1")
        if len(query) > _MAX_PROXY_QUERY:
            raise _Refused(414, "the query string is too long")
        accept = request.headers.get("accept") or "application/dicom+json"
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._forward, path, query, accept[:512])

    def _forward(self, path: str, query: str, accept: str) -> Response:
        import requests

        server = self.server
        limit = server.limits.max_instance_bytes
        url = f"{server.base}/{path}" + (f"?{query}" if query else "")
        headers = {"Accept": accept}
        if server.token:
            headers["Authorization"] = server.token
        session = requests.Session()
        session.trust_env = False
        try:
            with session.get(url, headers=headers, stream=True, allow_redirects=False,
                             timeout=(10.0, server.limits.read_timeout_s)) as r:
                body = bytearray()
                for chunk in r.iter_content(1 << 16):
                    body += chunk
                    if len(body) > limit:
                        return _detail(502, f"the DICOMweb server {server.name} answered more than "
                                            f"{limit >> 20} MB for one request")
                ctype = r.headers.get("Content-Type", "application/octet-stream")
                status = r.status_code if r.status_code < 300 else (404 if r.status_code == 404 else 502)
        except requests.RequestException as e:
            return _detail(502, f"cannot reach the DICOMweb server {server.name} ({type(e).__name__})")
        finally:
            session.close()
        if "json" in ctype:  # the server's own URLs (bulk data) become this proxy's
            body = bytes(body).replace(f"{server.base}/".encode(), b"/proxy/dicom/wado/")
        return Response(bytes(body), status, {"Content-Type": ctype, "X-Content-Type-Options": "nosniff",
                                              "Cache-Control": "no-store"})

    # -- the viewer --
    def ohif(self, rel: str) -> Response:
        if self.ohif_dir is None:
            raise _Refused(404, "the OHIF viewer is not installed: run `python3 MedVolCore/bootstrap.py` (it takes "
                                "the prebuilt viewer from the monailabel wheel) or start with --ohif-dir DIR")
        if rel == "app-config.js":
            return Response(_app_config(), 200, {"Cache-Control": "no-store"}, media_type="application/javascript")
        if rel == "medvol-panel.js":
            from ..resources import resource_path

            return Response(resource_path("web", "medvol-panel.js").read_bytes(), 200, {"Cache-Control": "no-store"},
                            media_type="application/javascript")
        target = (self.ohif_dir / rel).resolve() if rel else self.ohif_dir / "index.html"
        if os.path.commonpath([str(self.ohif_dir), str(target)]) != str(self.ohif_dir):
            raise _Refused(404, "no such file of the viewer")
        if not target.is_file():
            if "." in rel.rsplit("/", 1)[-1]:  # a file that is not there
                raise _Refused(404, "no such file of the viewer")
            target = self.ohif_dir / "index.html"  # a route of the single-page app
        data = target.read_bytes()
        if target.name == "index.html":
            data = data.replace(b"</head>", b'<script src="/ohif/medvol-panel.js"></script></head>', 1)
        ctype = _STATIC_TYPES.get(target.suffix.lower()) or mimetypes.guess_type(target.name)[0] or \
            "application/octet-stream"
        return Response(data, 200, {"X-Content-Type-Options": "nosniff"}, media_type=ctype)


def _label_file(nii_gz: Optional[bytes], value: int, suffix: str, tmp_dir) -> bytes:
    """The worker's mask (``.nii.gz`` bytes, on the series grid) as a label file of ``suffix`` whose
    voxels hold ``value``, written by the project's one mask writer."""
    import nibabel as nib
    import numpy as np

    from ..volume import CTVolume, save_mask

    img = nib.Nifti1Image.from_bytes(gzip.decompress(nii_gz))
    mask = (np.asarray(img.dataobj) > 0).astype(np.uint8) * np.uint8(value)
    like = CTVolume(mask, img.affine, header=img.header)
    with tempfile.TemporaryDirectory(dir=tmp_dir) as d:
        out = Path(d) / f"label{suffix}"
        save_mask(mask, like, out)
        return out.read_bytes()


def _app_config() -> bytes:
    """The viewer's configuration: its DICOMweb through this worker's proxy routes."""
    config = {"routerBasename": "/ohif/", "showStudyList": True, "extensions": [], "modes": [],
              "showWarningMessageForCrossOrigin": False, "showCPUFallbackMessage": True,
              "showLoadingIndicator": True, "strictZSpacingForVolumeViewport": True,
              "defaultDataSourceName": "dicomweb", "useSharedArrayBuffer": "FALSE",
              "investigationalUseDialog": {"option": "never"},
              "dataSources": [{"namespace": "@ohif/extension-default.dataSourcesModule.dicomweb",
                               "sourceName": "dicomweb",
                               "configuration": {"friendlyName": "MedVol-R1 worker", "name": "medvol",
                                                 "wadoUriRoot": "/proxy/dicom/wado", "qidoRoot": "/proxy/dicom/qido",
                                                 "wadoRoot": "/proxy/dicom/wado", "qidoSupportsIncludeField": True,
                                                 "supportsReject": False, "imageRendering": "wadors",
                                                 "thumbnailRendering": "wadors", "enableStudyLazyLoad": False,
                                                 "supportsFuzzyMatching": False, "supportsWildcard": True,
                                                 "dicomUploadEnabled": False,
                                                 "bulkDataURI": {"enabled": True}}}]}
    return ("window.config = " + json.dumps(config, indent=1) + ";\n").encode("utf-8")
