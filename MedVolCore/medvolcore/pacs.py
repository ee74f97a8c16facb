"""A DICOMweb server (a PACS such as Orthanc or dcm4chee) as the source of a series and the
destination of the DICOM-SEG, through ``dicomweb-client``.

A series is named by URL: ``dicomweb://HOST[:PORT]/PATH/studies/STUDY/series/SERIES`` (plain HTTP),
or the same with ``http://`` or ``https://``; ``PATH`` is the server's DICOMweb root (Orthanc:
``/dicom-web``). :func:`retrieve_series` lists the series' instances (QIDO-RS), refuses a series over
the instance limit before anything is downloaded, then fetches each instance (WADO-RS) into a folder
of the caller's, each file written under a temporary name and renamed once whole, so a folder that
is retrieved again resumes: instances already there are not fetched again. Every response is
bounded while it is read: bytes per instance, bytes in all, and a deadline for the whole series; a
search's answer (QIDO-RS) and a store's (STOW-RS) are bounded by bytes as they stream, before
they are parsed (:func:`search_bytes`, :data:`STORE_REPLY_BYTES`). No redirect is followed: a
server answering with one is refused, so it cannot send the client, or its token, elsewhere.
Each retrieved instance must be the one asked for, of the URL's series and study.
The folder is then read as any local series folder is (:mod:`medvolcore.dicom`: the same checks and
the same provenance record).

:func:`store_seg` sends a DICOM-SEG written and checked locally to ``…/studies/STUDY`` (STOW-RS)
after checking that it belongs to that study; it is sent whole or not at all, and the server's
answer is checked for the instance.

Credentials: a token file holds either a bearer token or a whole ``Authorization`` value (``Basic
…``/``Bearer …``); they are never sent in plain HTTP to a host other than this machine's loopback,
and never appear in a message. Every failure is a :class:`PacsError`: one line naming the server,
never the token.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

from .errors import DependencyError, InputError, LimitError, MedVolError

SCHEMES = {"dicomweb": "http", "http": "http", "https": "https"}
_UID = re.compile(r"^[0-9]+(\.[0-9]+)*$")
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}
MAX_TOKEN_BYTES = 16 << 10


class PacsError(MedVolError):
    """A DICOMweb server could not be reached, refused a request, or answered something unusable."""

    code = "pacs_error"


class SeriesNotFound(PacsError):
    """The server has no series of that UID (a client named one by its UID alone)."""

    code = "not_found"


@dataclass(frozen=True)
class DicomWebURL:
    """A DICOMweb location: ``base`` (the service root, ``http(s)://host:port/path``), ``study``
    and ``series`` (None for a study, the destination of a store)."""

    base: str
    study: str
    series: Optional[str] = None

    @property
    def host(self) -> str:
        return urlsplit(self.base).netloc

    def __str__(self) -> str:
        tail = f"/studies/{self.study}" + (f"/series/{self.series}" if self.series else "")
        return self.base + tail


def is_dicomweb(text) -> bool:
    """Whether ``text`` names a DICOMweb location (a local path never starts with a scheme)."""
    return isinstance(text, str) and text.split("://", 1)[0].lower() in SCHEMES and "://" in text


def _check_uid(value: str, what: str, text: str) -> str:
    if not _UID.match(value) or len(value) > 64:
        raise InputError(f"{what} {text}: {value!r} is not a DICOM UID (digits and dots, at most 64 characters)")
    return value


def parse_url(text: str, what: str = "--volume", series: bool = True) -> DicomWebURL:
    """``…/studies/STUDY/series/SERIES`` (``series`` True) or ``…/studies/STUDY`` (False)."""
    parts = urlsplit(text)
    scheme = SCHEMES.get(parts.scheme.lower())
    if scheme is None or not parts.hostname:
        raise InputError(f"{what} {text}: not a DICOMweb URL (dicomweb://HOST[:PORT]/PATH/studies/UID…, or http(s)://…)")
    if parts.username or parts.password:
        raise InputError(f"{what}: put no credentials in the URL; give them in --dicomweb-token-file")
    if parts.query or parts.fragment:
        raise InputError(f"{what} {text}: a DICOMweb URL has no query (?…) or fragment (#…) here")
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise InputError(f"{what} {text}: the port is not a number from 1 to 65535") from None
    segs = [s for s in parts.path.split("/") if s]
    want = ["series", "studies"] if series else ["studies"]
    shape = "…/studies/STUDY/series/SERIES" if series else "…/studies/STUDY"
    n = 4 if series else 2
    if len(segs) < n or [segs[-n + 2 * i] for i in range(n // 2)] != want[::-1]:
        raise InputError(f"{what} {text}: expected a URL ending in {shape}")
    study = _check_uid(segs[-n + 1], what, text)
    series_uid = _check_uid(segs[-1], what, text) if series else None
    root = "/" + "/".join(segs[:-n]) if len(segs) > n else ""
    return DicomWebURL(f"{scheme}://{parts.netloc}{root}", study, series_uid)


def read_token(path) -> str:
    """The ``Authorization`` value from a token file: a bearer token, or ``Basic …``/``Bearer …``."""
    p = Path(path)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"--dicomweb-token-file {path}: not a file")
        if st.st_size > MAX_TOKEN_BYTES:
            raise InputError(f"--dicomweb-token-file {path}: over {MAX_TOKEN_BYTES >> 10} KB, not a token")
        text = p.read_text(encoding="ascii").strip()
    except UnicodeDecodeError:
        raise InputError(f"--dicomweb-token-file {path}: a token is ASCII text") from None
    except OSError as e:
        raise InputError(f"--dicomweb-token-file {path}: {e.strerror or e}") from None
    if not text or "\n" in text or "\r" in text:
        raise InputError(f"--dicomweb-token-file {path}: give the token on one line")
    return text if text.split(" ", 1)[0] in ("Basic", "Bearer") else f"Bearer {text}"


@dataclass
class Limits:
    """Bounds of one retrieval: instances in the series, bytes of one instance, bytes in all,
    seconds for the whole series (each response is also cut off after ``read_timeout_s`` of silence)."""

    max_instances: int = 2000
    max_instance_bytes: int = 512 << 20
    max_bytes: int = 8 << 30
    timeout_s: float = 900.0
    read_timeout_s: float = 30.0


SEARCH_BYTES_BASE = 64 << 10     # a QIDO-RS answer may hold this many bytes, plus
SEARCH_BYTES_PER_ITEM = 8 << 10  # this many per result asked for (a result is a few hundred bytes of JSON)
STORE_REPLY_BYTES = 1 << 20      # a STOW-RS answer (one instance's status)


def search_bytes(limit: int) -> int:
    """The bytes a QIDO-RS answer of at most ``limit`` results may hold, counted as it streams,
    before it is parsed (parsed JSON costs about 20 times its bytes)."""
    return SEARCH_BYTES_BASE + SEARCH_BYTES_PER_ITEM * max(int(limit), 1)


@dataclass
class _Budget:
    """What the replies of one client may hold: ``what`` the request under way (``"instance"``: a
    WADO-RS instance, counted into the series' ``total``; otherwise a reply of at most ``cap`` bytes)."""

    limits: Limits
    deadline: float
    total: int = 0
    what: str = ""
    cap: int = SEARCH_BYTES_BASE
    seen: dict = field(default_factory=dict)

    def check_time(self, url) -> None:
        if time.monotonic() > self.deadline:
            raise PacsError(f"{url.host}: retrieval took over {self.limits.timeout_s:g} s (--dicomweb-timeout); "
                            "nothing was kept")


def _client(url: DicomWebURL, token: Optional[str], budget: Optional[_Budget]):
    try:
        import requests
        from dicomweb_client.api import DICOMwebClient
    except ImportError:
        raise DependencyError("reading from or storing to a DICOMweb server needs dicomweb-client: "
                              "pip install 'medvolcore[pacs]'") from None
    host = urlsplit(url.base).hostname or ""
    if token and url.base.startswith("http://") and host not in _LOOPBACK:
        raise InputError(f"{url.host}: credentials are sent over HTTPS only (plain HTTP is allowed to this machine's "
                         "loopback only); use https://")
    session = requests.Session()
    session.trust_env = False  # no proxy or .netrc credentials from the environment
    session.max_redirects = 0  # and no redirect: the hook below refuses one before it could be followed
    timeouts = _timeouts(budget.limits) if budget else (10.0, 60.0)
    budget = budget or _Budget(Limits(), float("inf"))
    session.hooks["response"].append(lambda r, *a, **k: _bounded(r, url, budget))
    client = DICOMwebClient(url.base, session=session, headers={"Authorization": token} if token else None,
                            timeout=timeouts)
    client.medvol_budget = budget  # what each call may read (_Budget.cap)
    client.set_http_retry_params(retry=False)
    return client


def _timeouts(limits: Limits) -> tuple:
    """(connect, read) seconds for one request: never past the whole retrieval's deadline."""
    return (min(10.0, limits.timeout_s), min(limits.read_timeout_s, limits.timeout_s))


def _refuse_redirect(response, url: DicomWebURL) -> None:
    """A server that answers with a redirect would send the client (and its token) where the
    server chooses: refused, naming only the host it pointed to."""
    if not (300 <= response.status_code < 400 and response.status_code != 304):
        return
    target = urlsplit(response.headers.get("Location") or "")
    where = f" to {target.netloc}" if target.netloc else ""
    response.close()
    raise PacsError(f"the DICOMweb server {url.host} answered with a redirect{where} (HTTP {response.status_code}); "
                    "MedVol follows no redirect: give the server's own DICOMweb URL")


def _bounded(response, url: DicomWebURL, budget: _Budget):
    """Refuse a redirect; count the bytes of ``response`` as it is read (before ``requests`` reads
    it, so before any parsing): over a bound, or past the deadline, the read stops with an error."""
    _refuse_redirect(response, url)
    limits = budget.limits
    instance = budget.what == "instance"
    declared = response.headers.get("Content-Length")
    if declared and declared.isdigit() and instance and int(declared) > limits.max_instance_bytes + 4096:
        response.close()
        raise LimitError(f"{url.host}: an instance of {int(declared) / 2**20:.1f} MB is over the limit of "
                         f"{limits.max_instance_bytes / 2**20:.3g} MB (--dicomweb-max-instance-mb); nothing was kept")
    cap = budget.cap
    if declared and declared.isdigit() and not instance and int(declared) > cap:
        response.close()
        raise LimitError(f"{url.host}: an answer of {int(declared) / 2**20:.2f} MB is over the {cap / 2**20:.2g} MB "
                         f"this request may return; nothing was read")
    original = response.iter_content

    def counted(chunk_size=1, decode_unicode=False):
        got = 0
        for chunk in original(chunk_size, decode_unicode):
            got += len(chunk)
            if not instance:
                if got > cap:
                    raise LimitError(f"{url.host}: an answer over the {cap / 2**20:.2g} MB this request may return "
                                     "was cut off before it was parsed; nothing was read")
                budget.check_time(url)
                yield chunk
                continue
            budget.total += len(chunk)
            if got > limits.max_instance_bytes + 4096:
                raise LimitError(f"{url.host}: an instance is over the limit of {limits.max_instance_bytes / 2**20:.3g} MB "
                                 "(--dicomweb-max-instance-mb); nothing was kept")
            if budget.total > limits.max_bytes:
                raise LimitError(f"{url.host}: the series is over the limit of {limits.max_bytes / 2**20:.3g} MB "
                                 "(--dicomweb-max-mb); nothing was kept")
            budget.check_time(url)
            yield chunk

    response.iter_content = counted
    return response


def _failure(exc: Exception, url: DicomWebURL, doing: str) -> MedVolError:
    """One line for what went wrong while ``doing`` something with the server at ``url``."""
    import requests

    if isinstance(exc, MedVolError):
        return exc
    where = f"the DICOMweb server {url.host}"
    if isinstance(exc, requests.HTTPError) and exc.response is not None:
        code = exc.response.status_code
        reason = {401: "refused the credentials (give or check --dicomweb-token-file)",
                  403: "refused access (the credentials do not allow this)",
                  404: "has no such resource (check the study and series UIDs and the service path)"}.get(
            code, "failed on its side" if code >= 500 else "refused the request")
        return PacsError(f"{where} {reason} while {doing}: HTTP {code}")
    if isinstance(exc, requests.Timeout):
        return PacsError(f"{where} did not answer in time while {doing}")
    if isinstance(exc, requests.exceptions.ChunkedEncodingError) or "IncompleteRead" in str(exc):
        return PacsError(f"{where} sent a truncated answer while {doing}")
    if isinstance(exc, requests.ConnectionError):
        return PacsError(f"cannot reach {where} while {doing} (is it running, and is the URL right?)")
    if isinstance(exc, requests.RequestException):
        return PacsError(f"{where}: request failed while {doing}: {type(exc).__name__}")
    return PacsError(f"{where} sent an answer that is not valid DICOMweb while {doing} ({type(exc).__name__})")


def retrieve_series(url: DicomWebURL, folder: Path, token: Optional[str] = None, limits: Optional[Limits] = None,
                    progress: Optional[Callable] = None) -> dict:
    """Fetch the series at ``url`` into ``folder`` (created, private); returns ``{"instances",
    "fetched", "bytes", "seconds"}``. Instances already whole in ``folder`` are kept (a resumed
    retrieval). Raises :class:`PacsError` or :class:`~medvolcore.errors.LimitError`."""
    import pydicom

    limits = limits or Limits()
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    t0 = time.monotonic()
    budget = _Budget(limits, t0 + limits.timeout_s)
    client = _client(url, token, budget)
    doing = f"listing series {url.series}"
    budget.cap = search_bytes(limits.max_instances + 1)
    try:
        found = client.search_for_instances(url.study, url.series, fields=["00080018"],
                                            limit=limits.max_instances + 1)
    except Exception as e:  # noqa: BLE001  (each failure becomes one line)
        raise _failure(e, url, doing) from None
    uids = []
    for item in found if isinstance(found, list) else []:
        value = (item.get("00080018", {}) if isinstance(item, dict) else {}).get("Value") or [None]
        if not isinstance(value[0], str) or not _UID.match(value[0]) or len(value[0]) > 64:
            raise PacsError(f"the DICOMweb server {url.host} listed an instance without a valid SOP Instance UID")
        uids.append(value[0])
    if not uids:
        raise PacsError(f"the DICOMweb server {url.host} has no instance in series {url.series} of study {url.study}")
    if len(uids) > limits.max_instances:
        raise LimitError(f"series {url.series} has over {limits.max_instances} instances (--dicomweb-max-instances); "
                         "nothing was downloaded")
    fetched, size = 0, 0
    for n, uid in enumerate(dict.fromkeys(uids)):
        path = folder / f"{uid}.dcm"
        if path.is_file():
            size += path.stat().st_size
            continue
        budget.check_time(url)
        budget.what = "instance"
        doing = f"retrieving instance {n + 1} of {len(uids)}"
        try:
            ds = client.retrieve_instance(url.study, url.series, uid)
        except Exception as e:  # noqa: BLE001
            raise _failure(e, url, doing) from None
        finally:
            budget.what = ""
        got = tuple(str(getattr(ds, k, "") or "").strip() for k in ("SOPInstanceUID", "SeriesInstanceUID",
                                                                      "StudyInstanceUID"))
        for have, want, what in zip(got, (uid, url.series, url.study), ("instance", "series", "study")):
            if have != want:
                raise PacsError(f"the DICOMweb server {url.host} answered instance {uid} of series {url.series} with "
                                f"an instance of another {what} ({what} UID {have or 'empty'}); nothing was read")
        if "PixelData" not in ds and "FloatPixelData" not in ds:
            raise PacsError(f"the DICOMweb server {url.host} sent instance {uid} without pixel data")
        tmp = folder / f".{uid}.part"
        try:
            pydicom.dcmwrite(tmp, ds, enforce_file_format=True)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001
            tmp.unlink(missing_ok=True)
            raise PacsError(f"could not write instance {uid} of the retrieved series: {type(e).__name__}: {e}") from None
        fetched += 1
        size += path.stat().st_size
        if progress is not None:
            progress("retrieve", (n + 1) / len(uids), f"instance {n + 1}/{len(uids)}")
    return {"url": str(url), "instances": len(uids), "fetched": fetched, "bytes": size,
            "seconds": round(time.monotonic() - t0, 3)}


def check_seg_for(path: Path, url: DicomWebURL):
    """The DICOM-SEG at ``path``, read back and checked before it is stored into ``url``'s study."""
    import pydicom

    try:
        ds = pydicom.dcmread(str(path))
    except Exception as e:  # noqa: BLE001
        raise PacsError(f"the DICOM-SEG {path} could not be read back before storing: {type(e).__name__}") from None
    if getattr(ds, "SOPClassUID", None) != "1.2.840.10008.5.1.4.1.1.66.4":
        raise PacsError(f"{path} is not a DICOM Segmentation; nothing was stored")
    if ds.StudyInstanceUID != url.study:
        raise InputError(f"--out {url}: the segmented series belongs to study {ds.StudyInstanceUID}, not {url.study}; "
                         "a DICOM-SEG is stored into its source's study (nothing was stored)")
    return ds


def store_seg(path: Path, url: DicomWebURL, token: Optional[str] = None, timeout_s: float = 120.0) -> dict:
    """Store the DICOM-SEG at ``path`` into the study at ``url`` (STOW-RS); returns ``{"url",
    "sop_instance_uid", "seconds"}``."""
    ds = check_seg_for(path, url)
    t0 = time.monotonic()
    client = _client(url, token, None)
    client._timeout = (10.0, timeout_s)
    client.medvol_budget.cap = STORE_REPLY_BYTES
    try:
        answer = client.store_instances([ds], study_instance_uid=url.study)
    except Exception as e:  # noqa: BLE001
        raise _failure(e, url, "storing the DICOM-SEG") from None
    failed = getattr(answer, "FailedSOPSequence", None) if answer is not None else None
    stored = {getattr(item, "ReferencedSOPInstanceUID", None)
              for item in (getattr(answer, "ReferencedSOPSequence", None) or [])} if answer is not None else set()
    if failed or ds.SOPInstanceUID not in stored:
        raise PacsError(f"the DICOMweb server {url.host} did not accept the DICOM-SEG into study {url.study}")
    return {"url": str(url), "sop_instance_uid": ds.SOPInstanceUID, "series_instance_uid": ds.SeriesInstanceUID,
            "seconds": round(time.monotonic() - t0, 3)}


# ---- servers an operator allows (medvol serve --pacs-config FILE --allow-pacs NAME) ----------------------------

@dataclass(frozen=True)
class PacsServer:
    """A DICOMweb server a worker may read from: its ``name`` in the config file, its service
    root ``base``, the ``Authorization`` value read from its token file (or None) and its limits."""

    name: str
    base: str
    token: Optional[str]
    limits: Limits


def load_servers(path, names) -> dict:
    """``{name: PacsServer}`` for each of ``names`` in the servers file ``path``: JSON
    ``{"servers": {"NAME": {"url": "https://host/dicom-web", "token_file": "…", "max_instances": N,
    "max_instance_mb": MB, "max_mb": MB, "timeout_s": S}}}`` (only ``url`` is required)."""
    import json

    where = f"--pacs-config {path}"
    try:
        if Path(path).stat().st_size > 1 << 20:
            raise InputError(f"{where}: over 1 MB, not a servers file")
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{where}: cannot be read as JSON ({type(e).__name__}: {e})") from None
    table = doc.get("servers") if isinstance(doc, dict) else None
    if not isinstance(table, dict):
        raise InputError(f"{where}: expected {{\"servers\": {{\"NAME\": {{\"url\": …}}}}}}")
    out = {}
    for name in names:
        entry = table.get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise InputError(f"--allow-pacs {name}: no server of that name (with a \"url\") in {path}")
        unknown = set(entry) - {"url", "token_file", "max_instances", "max_instance_mb", "max_mb", "timeout_s"}
        if unknown:
            raise InputError(f"{where}: server {name!r} has unknown keys {sorted(unknown)}")
        base = _base(entry["url"], f"{where}: server {name!r}")
        token = read_token(entry["token_file"]) if entry.get("token_file") else None
        d = Limits()
        try:
            limits = Limits(max_instances=int(entry.get("max_instances", d.max_instances)),
                            max_instance_bytes=int(float(entry.get("max_instance_mb", d.max_instance_bytes / 2**20))
                                                   * 2**20),
                            max_bytes=int(float(entry.get("max_mb", d.max_bytes / 2**20)) * 2**20),
                            timeout_s=float(entry.get("timeout_s", d.timeout_s)))
        except (TypeError, ValueError):
            raise InputError(f"{where}: server {name!r}: limits must be numbers") from None
        if min(limits.max_instances, limits.max_instance_bytes, limits.max_bytes, limits.timeout_s) <= 0:
            raise InputError(f"{where}: server {name!r}: limits must be positive")
        out[name] = PacsServer(name, base, token, limits)
    return out


def _base(text: str, what: str) -> str:
    """The normalised service root of a server's URL (``dicomweb://`` read as ``http://``)."""
    parts = urlsplit(text)
    scheme = SCHEMES.get(parts.scheme.lower())
    if scheme is None or not parts.hostname or parts.username or parts.password or parts.query or parts.fragment:
        raise InputError(f"{what}: {text!r} is not a DICOMweb service URL (http(s)://HOST[:PORT]/PATH)")
    path = "/".join(s for s in parts.path.split("/") if s)
    return f"{scheme}://{parts.netloc.lower()}" + (f"/{path}" if path else "")


def allowed_source(text: str, servers: dict, what: str = "volume"):
    """``(PacsServer, DicomWebURL)`` for a client's series URL, only on a server the operator
    allowed (same scheme, host, port and service path); anything else is refused before any
    connection is made."""
    from .errors import ForbiddenError

    url = parse_url(text, f"'{what}'")
    base = _base(url.base, f"'{what}'")
    for server in (servers or {}).values():
        if server.base == base:
            return server, url
    raise ForbiddenError(f"'{what}' names a DICOMweb server this worker does not read from; an operator allows one "
                         "with `medvol serve --pacs-config FILE --allow-pacs NAME`")


# ---- many series: a batch manifest's URLs, and a QIDO-RS search writing one -------------------------------

@dataclass
class SeriesAccess:
    """How a run reads the series its manifest names by URL: ``servers`` (``--pacs-config`` and
    ``--allow-pacs``: only those servers, each with its own token and limits) or else one ``token``
    (sent to one server only) and the run's ``limits``; ``keep`` a folder keeping the downloads."""

    token: Optional[str] = None
    limits: Limits = field(default_factory=Limits)
    servers: Optional[dict] = None
    keep: Optional[Path] = None

    def source(self, text: str) -> tuple:
        """``(DicomWebURL, token, limits)`` for a manifest's series URL, or an :class:`InputError`
        saying why that server is not read from (nothing is contacted)."""
        url = parse_url(text, "volume")
        if self.servers is None:
            return url, self.token, self.limits
        base = _base(url.base, "volume")
        for server in self.servers.values():
            if server.base == base:
                return url, server.token, server.limits
        raise InputError(f"volume {text}: a server not allowed by --allow-pacs (give it in --pacs-config and allow it)")


def check_sources(texts, access: SeriesAccess) -> dict:
    """``{url: problem}`` for the series URLs of a manifest that ``access`` refuses: a server not
    allowed, or with one ``--dicomweb-token-file``, a server other than the first URL's (a token
    goes to one server)."""
    problems, first = {}, None
    for text in texts:
        try:
            url, _token, _limits = access.source(text)
        except InputError as e:
            problems[text] = str(e)
            continue
        if access.servers is None and access.token:
            first = first or url.base
            if url.base != first:
                problems[text] = (f"volume {text}: --dicomweb-token-file is sent to one server ({first}); give the "
                                  "servers in --pacs-config, each with its token_file")
    return problems


_DATE = re.compile(r"^(\d{8})?(-(\d{8})?)?$")
_MODALITY = re.compile(r"^[A-Z0-9_]{1,16}$")


def find_series(base: str, modality: Optional[str] = None, study_date: Optional[str] = None, limit: int = 1000,
                token: Optional[str] = None, timeout_s: float = 60.0) -> list:
    """The series on the DICOMweb server at ``base`` (its service root) matching ``modality`` and
    ``study_date`` (``YYYYMMDD``, ``YYYYMMDD-YYYYMMDD``, ``-YYYYMMDD`` or ``YYYYMMDD-``), at most
    ``limit`` (QIDO-RS): a list of :class:`DicomWebURL`, in the server's order."""
    root = DicomWebURL(_base(base, "--url"), "0")
    filters = {}
    if modality:
        if not _MODALITY.match(modality):
            raise InputError(f"--modality {modality!r}: a DICOM modality is upper-case letters and digits (CT, MR, …)")
        filters["Modality"] = modality
    if study_date:
        if not _DATE.match(study_date) or study_date == "-":
            raise InputError(f"--study-date {study_date!r}: expected YYYYMMDD, YYYYMMDD-YYYYMMDD, -YYYYMMDD or YYYYMMDD-")
        filters["StudyDate"] = study_date
    if limit <= 0:
        raise InputError("--limit must be positive")
    client = _client(root, token, None)
    client._timeout = (min(10.0, timeout_s), timeout_s)
    client.medvol_budget.cap = search_bytes(limit)  # bounded as it streams, before the JSON is parsed
    try:
        found = client.search_for_series(search_filters=filters, fields=["0020000D", "0020000E"], limit=limit)
    except Exception as e:  # noqa: BLE001
        raise _failure(e, root, "searching for series") from None
    out = []
    for item in found if isinstance(found, list) else []:
        uids = [((item.get(tag) or {}).get("Value") or [None])[0] if isinstance(item, dict) else None
                for tag in ("0020000D", "0020000E")]
        if not all(isinstance(u, str) and _UID.match(u) and len(u) <= 64 for u in uids):
            raise PacsError(f"the DICOMweb server {root.host} listed a series without valid study and series UIDs")
        out.append(DicomWebURL(root.base, uids[0], uids[1]))
    return out[:limit]


def series_on(server: PacsServer, series_uid: str, timeout_s: float = 30.0) -> DicomWebURL:
    """The URL of series ``series_uid`` on ``server`` (QIDO-RS: its study is looked up), for a
    client that names a series by its UID alone (MONAI Label's ``image``). Raises
    :class:`InputError` for a malformed UID, :class:`PacsError` when the server has no such series
    (or lists it in several studies)."""
    if not isinstance(series_uid, str) or len(series_uid) > 64 or not _UID.match(series_uid):
        raise InputError("'image' must be a Series Instance UID (digits and dots, at most 64 characters) or a "
                         "series URL")
    root = DicomWebURL(server.base, "0")
    client = _client(root, server.token, None)
    client._timeout = (min(10.0, timeout_s), timeout_s)
    client.medvol_budget.cap = search_bytes(2)  # bounded as it streams, before the JSON is parsed
    try:
        found = client.search_for_series(search_filters={"SeriesInstanceUID": series_uid},
                                         fields=["0020000D", "0020000E"], limit=2)
    except Exception as e:  # noqa: BLE001
        raise _failure(e, root, f"looking up series {series_uid}") from None
    studies = set()
    for item in found if isinstance(found, list) else []:
        uids = [((item.get(tag) or {}).get("Value") or [None])[0] if isinstance(item, dict) else None
                for tag in ("0020000D", "0020000E")]
        if uids[1] == series_uid and isinstance(uids[0], str) and _UID.match(uids[0]) and len(uids[0]) <= 64:
            studies.add(uids[0])
    if len(studies) != 1:
        raise SeriesNotFound(f"series {series_uid} is not on the DICOMweb server {server.name}" if not studies
                             else f"series {series_uid} is listed in {len(studies)} studies on {server.name}")
    return DicomWebURL(server.base, studies.pop(), series_uid)
