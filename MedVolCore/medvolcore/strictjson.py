"""JSON read strictly: an object that names a key twice is refused, never silently resolved.

Python's ``json`` keeps the last of two equal keys, other parsers the first, so
``{"volume": "a", "volume": "b"}`` can mean two things to two programs (a proxy and the worker, a
checker and a reader). Every JSON that MedVol reads from outside — worker requests, anchor files,
batch manifests, the model's answer — goes through :func:`unique_keys`; each caller words the
:class:`DuplicateKeyError` for its own users.
"""

from __future__ import annotations

__all__ = ["DuplicateKeyError", "unique_keys"]


class DuplicateKeyError(Exception):
    """A JSON object names ``key`` twice. Not a ``ValueError``, so it is never taken for bad JSON
    by a caller that catches ``json.JSONDecodeError``."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def unique_keys(pairs) -> dict:
    """``object_pairs_hook`` for :func:`json.loads`: the object as a dict, or
    :class:`DuplicateKeyError` when it names a key twice (at any depth: the hook sees every object)."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise DuplicateKeyError(key)
        obj[key] = value
    return obj
