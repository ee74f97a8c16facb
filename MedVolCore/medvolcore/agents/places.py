"""What an agent may name: volumes under the folders the operator allowed (``--allow DIR``), series
on the DICOMweb servers allowed (``--allow-pacs``), and the job folders of the output folder.

A path is matched to an allowed folder from its text alone (``..`` collapsed, nothing looked
up), so a refusal tells nothing about which files exist; the worker then opens it from that
folder one component at a time without following a symbolic link
(:func:`medvolcore.sources.private_copy`), as it does for ``medvol serve --data-dir``. Every
refusal is one sentence that says what the agent may name instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import ForbiddenError, InputError
from ..pacs import allowed_source, is_dicomweb
from ..sources import client_parts

__all__ = ["Places", "check_places"]


def check_places(roots: Sequence, out_dir: Optional[Path]) -> Tuple[List[Path], Optional[Path]]:
    """``--allow`` folders and the output folder, resolved: each must be a folder, and the output
    folder may not overlap any allowed one (an agent writing results could then never replace a
    volume). Raises :class:`InputError` (one line) otherwise."""
    resolved = []
    for value in roots:
        d = Path(os.path.expanduser(str(value)))
        if not d.is_dir():
            raise InputError(f"--allow {value}: not a folder")
        resolved.append(Path(os.path.realpath(d)))
    out = None
    if out_dir is not None:
        out = Path(os.path.expanduser(str(out_dir)))
        if not out.is_dir():
            raise InputError(f"--out-dir {out_dir}: not a folder")
        out = Path(os.path.realpath(out))
        for root in resolved:
            if os.path.commonpath([str(root), str(out)]) in (str(root), str(out)):
                raise InputError(f"--out-dir {out_dir} overlaps the allowed folder {root}; give the results a "
                                 "folder of their own, outside every --allow folder, so that no agent can replace a volume")
    return resolved, out


class Places:
    """The allowed folders (resolved) and DICOMweb servers (``{name: PacsServer}``)."""

    def __init__(self, roots: Sequence[Path], pacs_servers: Optional[Dict] = None):
        self.roots = [Path(r) for r in roots]
        self.pacs_servers = dict(pacs_servers or {})

    def describe(self) -> str:
        """What may be named, for a refusal's second half."""
        parts = []
        if self.roots:
            parts.append("a file or DICOM folder under " + ", ".join(str(r) for r in self.roots))
        if self.pacs_servers:
            parts.append("a series URL on " + ", ".join(f"{n} ({s.base})" for n, s in sorted(self.pacs_servers.items()))
                         + " (list_series finds them)")
        return " or ".join(parts) if parts else "nothing: the operator allowed no folder and no DICOMweb server"

    def volume(self, value: str) -> Tuple[Optional[Path], str]:
        """``(root, value)`` for a volume path (the allowed folder it lies in, and the path as the
        worker reads it in that folder), or ``(None, value)`` for a series URL on an allowed
        server. Raises :class:`ForbiddenError` naming what may be given instead."""
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            raise ForbiddenError(f"'volume' must name {self.describe()}")
        if is_dicomweb(value):
            try:
                allowed_source(value, self.pacs_servers)
            except (ForbiddenError, InputError):
                raise ForbiddenError(f"'volume' {value!r} is not a series on an allowed DICOMweb server; give "
                                     f"{self.describe()}") from None
            return None, value
        if "://" in value:
            raise ForbiddenError(f"'volume' {value!r} is a URL this server does not read; give {self.describe()}")
        text = os.path.expanduser(value)
        if not os.path.isabs(text):
            if len(self.roots) != 1:
                raise ForbiddenError(f"'volume' {value!r} is relative; give an absolute path: {self.describe()}")
            text = os.path.join(str(self.roots[0]), text)
        for root in self.roots:
            try:
                parts = client_parts(root, text, "volume")
            except ForbiddenError:
                continue
            if parts:
                return root, os.path.join(*parts)
        raise ForbiddenError(f"'volume' {value!r} is outside the folders this server may read; give {self.describe()}")

    def server(self, name: str):
        """The allowed DICOMweb server called ``name``."""
        server = self.pacs_servers.get(name)
        if server is None:
            known = ", ".join(sorted(self.pacs_servers)) or "none (the operator allowed no DICOMweb server)"
            raise ForbiddenError(f"'server' {name!r} is not a DICOMweb server this server may search; allowed: {known}")
        return server
