"""Training data files in ``Resources/training/`` (term dictionary, templates, label lists).

Read through :func:`medvolcore.resources.resource_path`, so ``$MEDVOL_RESOURCES`` and an
installed copy work as for the engine.
"""

from __future__ import annotations

import copy
import functools
import json

from medvolcore.resources import resource_path

from .errors import DataError

FOLDER = "training"


@functools.lru_cache(maxsize=None)
def _load(name: str):
    path = resource_path(FOLDER, name)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read training resource {path}: {e}") from None


def load(name: str):
    """A private copy of ``Resources/training/<name>`` (JSON)."""
    return copy.deepcopy(_load(name))


def term_dictionary() -> dict:
    return load("m3d_term_dictionary.json")


def prompt_templates() -> dict:
    return load("m3d_prompt_templates.json")


def dataset_info() -> dict:
    """M3D-Seg code → {"dataset": name, "labels": [...]}; channel c ↔ label id c + 1."""
    return load("m3d_seg_dataset_info.json")


def think_templates() -> dict:
    return load("think_templates.json")


def relational_queries() -> dict:
    return load("relational_queries.json")


def dataset_labels(code: str) -> dict:
    """Label id → name of an M3D-Seg dataset code (ids 1..C in the M3D channel order)."""
    info = dataset_info()
    code = str(code).strip()
    if code not in info:
        known = ", ".join(sorted(info))
        raise DataError(f"unknown M3D-Seg dataset code {code!r}; known codes: {known}")
    return {i + 1: name for i, name in enumerate(info[code]["labels"])}
