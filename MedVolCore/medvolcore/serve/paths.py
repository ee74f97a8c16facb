"""What a client of the worker may name and see: input paths, output paths, reply files and messages.

:class:`ClientPaths` is the trust boundary of ``docs/protocol.md`` on the file side, mixed into
:class:`~medvolcore.serve.worker.Worker` (whose ``transport``, ``tmp_dir``, ``data_dir``, ``out_dir``
and request counter it uses): server paths only over stdio; over HTTP inputs inside ``--data-dir``,
outputs inside ``--out-dir``, and replies and error messages without an absolute server path.
"""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from typing import Optional

from ..errors import ForbiddenError, OutputError, VolumeError
from ..sources import client_parts
from .limits import limit

MAX_PATH_CHARS = int(limit("path_chars").default)


class ClientPaths:
    """The worker's paths and messages as a client names and sees them (a mixin of the worker)."""

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
        which follows no link at all (see :meth:`.ops.VolumeOps._stack_for`). ``data_dir``: a
        front door's allowed folder for this request, in place of ``--data-dir``."""
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

    def _out_path(self, job) -> tuple:
        out = job.req.get("out")
        if out:
            return self.output_path(out, job.transport), bool(job.req.get("overwrite", False)), False
        self._counter += 1
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(job.id))[:40] if job.id is not None else "req"
        return self.tmp_dir / f"{job.op}-{self._counter:04d}-{safe}.nii.gz", False, True

    def _reply_copy(self, job) -> Optional[Path]:
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
