"""Getting a preset's weights onto this machine: :func:`download` and :func:`import_weights`.

:func:`download` fetches through ``huggingface_hub`` (resumable, progress on stderr, every LFS file
checked against a pinned sha256 or the one the Hub reports for the downloaded commit);
:func:`import_weights` registers a folder copied by hand onto an offline machine (copied, or linked
in place). Both write the preset's registration (``medvol_weights.json``) last, so an interrupted or
rejected transfer leaves the preset missing. ``huggingface_hub`` is imported only by the functions
that need it, and nothing is downloaded unless :func:`download` is called.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Tuple

from .. import __version__
from ..errors import InputError, MedVolError, ModelError, ModelNotFoundError
from ..fileio import write_text_atomic
from .checks import _check_not_lfs_pointer, check_adapter_dir, check_grounder_dir
from .manifest import Preset, check_revision, get_preset
from .presets import path
from .registration import REGISTRATION, REGISTRATION_SCHEMA, _weights_folder, log

# ---- hashing -----------------------------------------------------------------------------

def sha256_file(path, progress: bool = False) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks (a progress bar on stderr if asked)."""
    path = Path(path)
    h = hashlib.sha256()
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"sha256 {path.name}",
                   file=sys.stderr, leave=False, disable=None)
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(8 << 20), b""):
                h.update(block)
                if bar is not None:
                    bar.update(len(block))
    finally:
        if bar is not None:
            bar.close()
    return h.hexdigest()


def _sha_mismatch(name: str, what: str, path: Path, expected: str, actual: str, against: str) -> ModelError:
    return ModelError(f"{what} {path} failed its sha256 check for preset {name!r} (expected {expected} from the "
                      f"{against}, got {actual}); the file was not registered — it is corrupt or not the right file")


# ---- registration ------------------------------------------------------------------------

def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _write_registration(folder: Path, name: str, method: str, entries: dict) -> Path:
    """Register ``entries`` in ``folder`` for preset ``name`` (which owns any adapter entry)."""
    reg = {"schema": REGISTRATION_SCHEMA, "preset": name, "method": method, "registered": _now(),
           "medvolcore_version": __version__, **entries}
    out = Path(folder) / REGISTRATION
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(reg, indent=2) + "\n", overwrite=True)
    return out


def _unregister(folder: Path) -> None:
    """Forget the registration first: a failed transfer must leave the preset missing, not stale."""
    try:
        (Path(folder) / REGISTRATION).unlink()
    except FileNotFoundError:
        pass


def _folder_stats(folder: Path) -> Tuple[int, int]:
    files = [f for f in folder.rglob("*") if f.is_file() and ".cache" not in f.relative_to(folder).parts]
    return len(files), sum(f.stat().st_size for f in files)


# ---- download ----------------------------------------------------------------------------

def _import_hub():
    try:
        import huggingface_hub
    except ImportError:
        from ..errors import DependencyError

        raise DependencyError("downloading models needs huggingface_hub: pip install 'huggingface_hub>=0.34'") from None
    return huggingface_hub


def _hub_error_types() -> dict:
    """The exception classes that mean 'cannot reach the Hub' / 'the Hub says no', across versions."""
    import importlib

    mods = []
    for m in ("huggingface_hub.errors", "huggingface_hub.utils"):  # errors: >=0.24; utils: older
        try:
            mods.append(importlib.import_module(m))
        except ImportError:
            pass

    def get(*names):
        found = []
        for n in names:
            c = next((getattr(m, n) for m in mods if isinstance(getattr(m, n, None), type)), None)
            if c is not None:
                found.append(c)
        return tuple(found)

    offline = get("OfflineModeIsEnabled", "LocalEntryNotFoundError") + (ConnectionError, TimeoutError)
    for mod in ("httpx2", "httpx"):
        try:
            offline += (__import__(mod).TransportError,)
        except (ImportError, AttributeError):
            pass
    try:
        import requests

        offline += (requests.exceptions.ConnectionError, requests.exceptions.Timeout)
    except ImportError:
        pass
    return {"offline": offline,
            "gated": get("GatedRepoError"),
            "not_found": get("RepositoryNotFoundError", "RevisionNotFoundError", "RemoteEntryNotFoundError",
                             "EntryNotFoundError"),
            "http": get("HfHubHTTPError")}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _cache_text() -> str:
    try:
        return str(hub_cache_dir())
    except Exception:  # only for a message
        return "$HF_HUB_CACHE"


def _translate_hub_error(e: BaseException, name: str, what: str, types: dict) -> Optional[MedVolError]:
    if isinstance(e, types["offline"]):
        return ModelNotFoundError(
            f"cannot reach the Hugging Face Hub to download the {what} of preset {name!r}, and the Hugging Face cache "
            f"({_cache_text()}) holds no complete copy of it ({_first_line(e)}); on a machine without internet, copy the weights into a folder and run `medvol models import {name} FOLDER`")
    if types["gated"] and isinstance(e, types["gated"]):
        return ModelNotFoundError(
            f"the Hugging Face Hub refused the {what} of preset {name!r}: the repository is gated; accept its terms on "
            f"the web page and log in (`hf auth login`), or use `medvol models import {name} FOLDER`")
    if types["not_found"] and isinstance(e, types["not_found"]):
        return ModelNotFoundError(
            f"the Hugging Face Hub has no {what} for preset {name!r} ({_first_line(e)}); check the repo id and "
            f"revision in the preset table, pass `--revision REV` (a commit id or branch of the Hub repo), or use "
            f"`medvol models import {name} FOLDER`")
    if types["http"] and isinstance(e, types["http"]):
        return ModelNotFoundError(
            f"the Hugging Face Hub answered with an error for the {what} of preset {name!r} ({_first_line(e)}); "
            f"try again later, or use `medvol models import {name} FOLDER`")
    return None


class _ProgressBars:
    """Turn huggingface_hub's progress bars off for the duration when ``progress`` is False."""

    def __init__(self, progress: bool):
        import importlib

        self.utils = importlib.import_module("huggingface_hub.utils")
        self.progress, self.turned_off = progress, False

    def __enter__(self):
        if not self.progress and not self.utils.are_progress_bars_disabled():
            self.utils.disable_progress_bars()
            self.turned_off = True
        return self

    def __exit__(self, *exc):
        if self.turned_off:
            self.utils.enable_progress_bars()


def _lfs_sha256(sibling) -> Optional[str]:
    """The sha256 the Hub reports for an LFS file (``RepoSibling.lfs``), or None for a non-LFS file.

    ``model_info(files_metadata=True)`` gives each sibling ``lfs`` = ``BlobLfsInfo`` (a dict
    subclass with ``.sha256``) for LFS files and None otherwise; ``blob_id`` is a git sha1, never
    the file's sha256.
    """
    lfs = getattr(sibling, "lfs", None)
    if not lfs:
        return None
    sha = getattr(lfs, "sha256", None) or (lfs.get("sha256") if isinstance(lfs, dict) else None)
    return sha.lower() if isinstance(sha, str) else None


def _matches(path: str, patterns) -> bool:
    if not patterns:
        return True
    pats = [patterns] if isinstance(patterns, str) else patterns
    return any(fnmatch.fnmatch(path, p + "*" if p.endswith("/") else p) for p in pats)


def _cache_blob_sha256(local: Path) -> Optional[str]:
    """The sha256 a Hugging Face cache file must have: an LFS file in the cache is a link to
    ``blobs/<sha256 of its content>`` (a non-LFS file's blob is named by a 40-hex git id: None)."""
    try:
        blob = Path(os.path.realpath(local)).name
    except OSError:
        return None
    return blob if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob) else None


def _check_file(name: str, what: str, local: Path, expected: Optional[str], against: str, progress: bool) -> str:
    """sha256 of ``local``; a mismatch with ``expected`` removes the file (and its cache blob) and raises."""
    actual = sha256_file(local, progress)
    if expected is not None and actual != expected:
        blob = Path(os.path.realpath(local))
        local.unlink()
        if blob != local and blob.is_file():
            blob.unlink()  # else huggingface_hub would link the same corrupt blob in again
        raise _sha_mismatch(name, what, local, expected, actual, against)
    return actual


def _cached_files(folder: Path, patterns) -> list:
    return sorted(f for f in folder.rglob("*") if f.is_file() and _matches(f.relative_to(folder).as_posix(), patterns))


def _download_repo(hf, info, name: str, spec: dict, revision: Optional[str], what: str,
                   model_type: Optional[str], progress: bool) -> dict:
    """snapshot_download a model folder into the Hugging Face cache (an existing cached copy is
    reused) at the commit ``info`` describes (``info`` None: the Hub cannot be reached, so the
    cached snapshot of ``revision``); check every LFS file's sha256 against the Hub's, or offline
    against the cache's own blob names."""
    commit = info.sha if info is not None else revision
    snapshot = Path(hf.snapshot_download(spec["repo_id"], revision=commit, allow_patterns=spec.get("allow_patterns"),
                                         local_files_only=info is None))
    checked = 0
    if info is not None:
        against = f"Hub ({spec['repo_id']}@{commit})"
        for s in info.siblings or []:
            expected = _lfs_sha256(s)
            if expected is None or not _matches(s.rfilename, spec.get("allow_patterns")):
                continue
            local = snapshot / s.rfilename
            if not local.is_file():
                raise ModelNotFoundError(f"the download of the {what} of preset {name!r} is incomplete: {local} is "
                                         f"missing; run `medvol models download {name}` again")
            _check_file(name, what, local, expected, against, progress)
            checked += 1
    else:
        for local in _cached_files(snapshot, spec.get("allow_patterns")):
            expected = _cache_blob_sha256(local)
            if expected is not None:
                _check_file(name, what, local, expected, "Hugging Face cache's blob name", progress)
                checked += 1
    if model_type:
        check_grounder_dir(snapshot, model_type)
    elif what == "adapter":
        check_adapter_dir(snapshot)
    n, size = _folder_stats(snapshot)
    return {"path": str(snapshot), "cache": "huggingface", "source": f"https://huggingface.co/{spec['repo_id']}",
            "repo_id": spec["repo_id"], "revision": snapshot.name, "requested_revision": revision, "files": n,
            "bytes": size, "sha256_checked_files": checked,
            "sha256_checked_against": "hub" if info is not None else "cache blob names (offline)"}


def _download_medsam2(hf, info, name: str, spec: dict, revision: Optional[str], progress: bool) -> dict:
    """hf_hub_download one checkpoint into the Hugging Face cache at the commit ``info`` describes
    (None: offline, the cached file of ``revision``); check the pinned, the Hub's or the cache's sha256."""
    commit = info.sha if info is not None else revision
    if info is not None:
        sibling = next((s for s in info.siblings or [] if s.rfilename == spec["filename"]), None)
        if sibling is None:
            raise ModelNotFoundError(f"{spec['repo_id']}@{commit} has no file {spec['filename']!r} "
                                     f"(MedSAM2 of preset {name!r}); check the preset table")
    local = Path(hf.hf_hub_download(spec["repo_id"], spec["filename"], revision=commit, local_files_only=info is None))
    if not local.is_file():
        raise ModelNotFoundError(f"the download of {spec['filename']} for preset {name!r} left no file at {local}; "
                                 f"run `medvol models download {name}` again")
    if spec.get("sha256"):
        expected, against, checked = spec["sha256"], "preset table", "preset"
    elif info is not None:
        expected, against, checked = _lfs_sha256(sibling), f"Hub ({spec['repo_id']}@{commit})", "hub"
    else:
        expected, against = _cache_blob_sha256(local), "Hugging Face cache's blob name"
        checked = "cache blob name (offline)"
    actual = _check_file(name, "MedSAM2 checkpoint", local, expected, against, progress)
    if expected is None:
        log.warning("no sha256 known for %s/%s (not an LFS file); recorded the local sha256 unchecked",
                    spec["repo_id"], spec["filename"])
    return {"path": str(local), "cache": "huggingface", "source": f"https://huggingface.co/{spec['repo_id']}",
            "repo_id": spec["repo_id"], "revision": local.parent.name if info is None else commit,
            "requested_revision": revision, "sha256": actual,
            "sha256_checked_against": checked if expected else None, "bytes": local.stat().st_size}


def hub_cache_dir() -> Path:
    """Where downloads go: huggingface_hub's cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``), as the library itself resolves it."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def download(name: str, progress: bool = True, revision: Optional[str] = None) -> dict:
    """Fetch a preset's weights from the Hugging Face Hub into the Hugging Face cache and register them.

    The files go where huggingface_hub keeps its cache (``$HF_HOME``/``$HF_HUB_CACHE``, see
    :func:`hub_cache_dir`), so a copy already there (downloaded by transformers, ``hf download``
    or another tool) is reused and not fetched again; the preset's registration
    (``medvol_weights.json`` in its weights folder) records the cached snapshot's path. Resumable
    (huggingface_hub keeps partial files and skips complete ones). Each repo is read at one commit:
    ``revision`` (the grounder's, for this run: a 40-hex commit id or a branch/tag name) or the
    preset's pinned one (None in the table: the main branch now). Every LFS file is checked by
    sha256 (the pinned one, else the Hub's; offline, the cache's blob name, which is the file's
    sha256); a mismatch deletes the file and raises :class:`ModelError`. The Hub cannot be reached
    (no network, ``HF_HUB_OFFLINE=1``): the cached copy of that revision is used when the cache
    has it, else :class:`ModelNotFoundError` naming ``medvol models import`` (an earlier
    registration is left as it was). A Hub error: :class:`ModelNotFoundError`. ``tiny`` is just
    built. A preset with ``same_weights_as`` registers into that preset's folder (``medvol-r1``
    fetches what ``qwen3-vl-4b`` needs; the adapter is yours to give); weights already in an older
    folder (``weights_also_in``) are registered there.
    Returns what :func:`path` returns plus ``registration`` (for a ``requires_adapter`` preset
    without one: its base weights).
    """
    p = get_preset(name)
    revision = check_revision(revision)
    if not p.needs_download:
        if revision is not None:
            raise InputError(f"model preset {name!r} downloads nothing, so --revision has no effect")
        if p.grounder_kind == "builder":
            return path(name)
        raise InputError(f"model preset {name!r} uses local files only; nothing to download")
    if revision is not None and p.grounder_kind != "hub":
        raise InputError(f"--revision is the grounder's Hub revision, and preset {name!r} has no Hub grounder")
    hf = _import_hub()
    types = _hub_error_types()
    home = _weights_folder(p)  # decided once: unregistering below must not move it
    parts = []  # (key, what, spec, revision)
    if p.grounder_kind == "hub":
        parts.append(("grounder", "grounder", p.grounder, revision or p.grounder.get("revision")))
    if p.adapter and p.adapter.get("repo_id"):
        parts.append(("adapter", "adapter", p.adapter, p.adapter.get("revision")))
    if p.medsam2_kind == "hub":
        parts.append(("medsam2", "MedSAM2 checkpoint", p.medsam2, p.medsam2.get("revision")))
    entries = {}
    what = parts[0][1]
    try:
        with _ProgressBars(progress):
            # Ask the Hub first (one commit per repo). Unreachable: the cached copy, if every part is
            # in the cache; else nothing on disk has changed.
            api = hf.HfApi()
            infos = {}
            for key, what, spec, rev in parts:
                try:
                    infos[key] = api.model_info(spec["repo_id"], revision=rev, files_metadata=True)
                except types["offline"]:
                    infos[key] = None
            offline = [k for k, v in infos.items() if v is None]
            for key, what, spec, rev in parts:
                if key in offline:  # only look: local_files_only never downloads
                    if key == "medsam2":
                        hf.hf_hub_download(spec["repo_id"], spec["filename"], revision=rev, local_files_only=True)
                    else:
                        hf.snapshot_download(spec["repo_id"], revision=rev, allow_patterns=spec.get("allow_patterns"),
                                             local_files_only=True)
            if offline:
                log.warning("the Hugging Face Hub cannot be reached: using the copy of %s in the Hugging Face cache "
                            "(%s)", ", ".join(k for k in offline), hub_cache_dir())
            home.mkdir(parents=True, exist_ok=True)
            _unregister(home)
            for key, what, spec, rev in parts:
                if key == "medsam2":
                    entries[key] = _download_medsam2(hf, infos[key], name, spec, rev, progress)
                else:
                    entries[key] = _download_repo(hf, infos[key], name, spec, rev, what,
                                                  spec.get("model_type") if key == "grounder" else None, progress)
    except MedVolError:
        raise
    except Exception as e:
        translated = _translate_hub_error(e, name, what, types)
        if translated is None:
            raise
        raise translated from None
    _write_registration(home, name, "download", entries)
    return path(name, require_adapter=False)


# ---- import ------------------------------------------------------------------------------

IMPORT_LAYOUT = ("FOLDER/grounder/ (or FOLDER/{repo}/, or FOLDER itself) holding the Qwen3-VL model folder "
                 "(config.json with model_type qwen3_vl, *.safetensors, tokenizer files, preprocessor_config.json); "
                 "FOLDER/{medsam2} (or FOLDER/medsam2/{medsam2} or FOLDER/checkpoints/{medsam2}); "
                 "optionally FOLDER/adapter/ holding a LoRA adapter (adapter_config.json)")


def import_layout(preset: Optional[Preset] = None) -> str:
    """The folder layout :func:`import_weights` accepts, with the preset's own names when given."""
    repo = "Qwen3-VL-4B-Instruct"
    sam = "MedSAM2_latest.pt"
    if preset is not None and preset.grounder_kind == "hub":
        repo = preset.grounder["repo_id"].rstrip("/").split("/")[-1]
    if preset is not None and preset.medsam2_filename:
        sam = preset.medsam2_filename
    return IMPORT_LAYOUT.format(repo=repo, medsam2=sam)


@dataclass
class ImportLayout:
    """What :func:`find_import_layout` found in a folder (None: not found / not needed)."""

    grounder: Optional[Path] = None
    medsam2: Optional[Path] = None
    adapter: Optional[Path] = None


def find_import_layout(preset: Preset, folder: Path) -> ImportLayout:
    """Locate the parts of ``preset`` inside ``folder`` (see :func:`import_layout`); check each one.

    Raises :class:`InputError` for a folder that does not exist and :class:`ModelError` for a
    folder whose content is wrong or incomplete.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise InputError(f"{folder} is not a folder; expected {import_layout(preset)}")
    layout = ImportLayout()
    if preset.grounder_kind == "hub":
        repo_name = preset.grounder["repo_id"].rstrip("/").split("/")[-1]
        candidates = [folder / "grounder", folder / repo_name, folder]
        found = next((c for c in candidates if (c / "config.json").is_file()), None)
        if found is None:
            raise ModelError(f"no grounder model in {folder} (no config.json in grounder/, {repo_name}/ or the "
                             f"folder itself); expected {import_layout(preset)}")
        check_grounder_dir(found, preset.grounder.get("model_type", "qwen3_vl"))
        layout.grounder = found
    if preset.medsam2_kind == "hub":
        fname = preset.medsam2["filename"]
        candidates = [folder / fname, folder / "medsam2" / fname, folder / "checkpoints" / fname]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise ModelError(f"no MedSAM2 checkpoint {fname} in {folder} (looked in the folder, medsam2/ and "
                             f"checkpoints/); expected {import_layout(preset)}")
        if found.stat().st_size == 0:
            raise ModelError(f"{found} is empty")
        _check_not_lfs_pointer(found)
        layout.medsam2 = found
    if (folder / "adapter").is_dir():
        layout.adapter = check_adapter_dir(folder / "adapter", preset)
    return layout


def _copy_tree(src: Path, dst: Path, progress: bool, skip=()) -> None:
    """Copy a folder into place through a temporary sibling (a killed copy leaves no half folder)."""
    import sys

    files = [f for f in sorted(src.rglob("*")) if f.is_file()
             and not (set(f.relative_to(src).parts) & {".cache"})
             and f.relative_to(src).parts[0] not in skip]
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
                   desc=f"copy {src.name}", file=sys.stderr, leave=False, disable=None)
    try:
        for f in files:
            out = tmp / f.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, out)
            if bar is not None:
                bar.update(f.stat().st_size)
        _remove(dst)
        os.replace(tmp, dst)
    finally:
        if bar is not None:
            bar.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".part", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copy2(src, tmp)
        _remove(dst)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def import_weights(name: str, folder, link: bool = False, progress: bool = True) -> dict:
    """Register weights copied by hand (offline machines). Layout: see :func:`import_layout`.

    Everything is checked before anything is touched: the grounder's config.json model_type,
    weights, tokenizer and processor; the MedSAM2 file (and its sha256 when the preset pins
    one: a mismatch is a :class:`ModelError` and nothing is registered); an optional adapter.
    ``link=False`` copies the files into its weights folder; ``link=True`` registers them
    where they are (absolute paths, no copy, no symlink — so it works on Windows too), and
    they must stay there. The weights go where :func:`~.presets.weights_dir` says (shared with
    the ``same_weights_as`` preset); an adapter registered with them belongs to ``name`` only.
    Returns what :func:`path` returns.
    """
    p = get_preset(name)
    if not p.needs_download:
        raise InputError(f"model preset {name!r} needs no weights from outside"
                         + (" (it is built locally)" if p.grounder_kind == "builder" else ""))
    folder = Path(folder).expanduser().absolute()
    layout = find_import_layout(p, folder)
    sam_entry = None
    if layout.medsam2 is not None:
        actual = sha256_file(layout.medsam2, progress)
        pinned = p.medsam2.get("sha256")
        if pinned and actual != pinned:
            raise _sha_mismatch(name, "MedSAM2 checkpoint", layout.medsam2, pinned, actual, "preset table")
        if not pinned:
            log.info("preset %s pins no MedSAM2 sha256: recorded %s unchecked", name, actual)
        sam_entry = {"source": str(layout.medsam2), "sha256": actual,
                     "sha256_checked_against": "preset" if pinned else None,
                     "bytes": layout.medsam2.stat().st_size}

    home = _weights_folder(p)  # decided once: unregistering below must not move it
    home.mkdir(parents=True, exist_ok=True)
    _unregister(home)
    entries = {}
    if layout.grounder is not None:
        n, size = _folder_stats(layout.grounder)
        entries["grounder"] = {"source": str(layout.grounder), "files": n, "bytes": size,
                               "model_type": p.grounder.get("model_type", "qwen3_vl")}
    if layout.adapter is not None:
        entries["adapter"] = {"source": str(layout.adapter)}
    if sam_entry is not None:
        entries["medsam2"] = sam_entry

    if link:
        for key, src in (("grounder", layout.grounder), ("adapter", layout.adapter), ("medsam2", layout.medsam2)):
            if src is not None:
                entries[key]["path"] = str(src)
    else:
        skip = {p.medsam2_filename, "adapter", "medsam2", "checkpoints", REGISTRATION} if layout.grounder == folder else ()
        parts = (("grounder", layout.grounder, home / "grounder"), ("adapter", layout.adapter, home / "adapter"),
                 ("medsam2", layout.medsam2, home / "medsam2" / (p.medsam2_filename or "")))
        for key, src, dst in parts:
            if src is None:
                continue
            if not _same(src, dst):
                if src.is_dir():
                    _copy_tree(src, dst, progress, skip=skip if key == "grounder" else ())
                else:
                    _copy_file(src, dst)
            entries[key]["path"] = str(dst.relative_to(home))
    _write_registration(home, name, "import (linked in place)" if link else "import (copied)", entries)
    return path(name, require_adapter=False)
