"""Locate the project's data files (``Resources/``): window presets, MedSAM2 overrides, templates.

Search order: ``$MEDVOL_RESOURCES``; the copy bundled into an installed wheel
(``medvolcore/_resources``); the ``Resources/`` folder of the source checkout.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from .errors import MedVolError

_PACKAGE_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def resources_dir() -> Path:
    candidates = []
    if os.environ.get("MEDVOL_RESOURCES"):
        candidates.append(Path(os.environ["MEDVOL_RESOURCES"]))
    candidates += [_PACKAGE_DIR / "_resources", _PACKAGE_DIR.parent.parent / "Resources"]
    for c in candidates:
        if (c / "windows.json").is_file():
            return c
    raise MedVolError(
        "cannot find the MedVol Resources folder (looked in "
        + ", ".join(str(c) for c in candidates)
        + "); set MEDVOL_RESOURCES to the repository's Resources/ folder"
    )


def resource_path(*parts: str) -> Path:
    return resources_dir().joinpath(*parts)


@functools.lru_cache(maxsize=None)
def load_json(*parts: str):
    with open(resource_path(*parts), encoding="utf-8") as f:
        return json.load(f)
