"""Worker protocol 1: the envelope, request parsing and field checks (no transport, no work).

The reference for clients is ``docs/protocol.md``: transports, requests, replies, progress
events, ops, error codes and the trust boundary. This module is its code: :func:`parse_request`
(bytes or text → a request dict, ``id`` checked), :func:`field` (a type-checked field:
:func:`medvolcore.request.wire_value`, which also reads a segment request's declared fields),
:func:`ok_reply` / :func:`error_reply` / :func:`internal_reply` (the two reply shapes), and
:func:`encode_line` (one JSON line that never fails, whatever the client sent). Importing it
imports nothing heavy.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import traceback
from pathlib import Path
from typing import Any, Optional

from ..errors import MedVolError
from ..request import MAX_WIRE_INT, is_unicode
from ..request import wire_value as field
from ..strictjson import DuplicateKeyError, unique_keys
from .limits import json_cost, limit

log = logging.getLogger("medvolcore.serve")

__all__ = ["PROTOCOL", "OPS", "IMMEDIATE_OPS", "QUEUED_OPS", "DEFAULT_MAX_REQUEST_MB", "MAX_ID_CHARS", "MAX_ID_INT",
           "RequestError", "dumps_line", "encode_line", "error_reply", "ok_reply", "internal_reply", "parse_request",
           "field", "valid_id", "is_unicode"]

PROTOCOL = 1
OPS = ("hello", "load", "segment", "propagate", "cancel", "status", "shutdown")
IMMEDIATE_OPS = ("hello", "status", "cancel", "shutdown")
QUEUED_OPS = ("load", "segment", "propagate")
DEFAULT_MAX_REQUEST_MB = int(limit("json_body").default) >> 20
MAX_ID_CHARS = 256
MAX_ID_INT = MAX_WIRE_INT  # request ids are echoed back: keep them small and printable


class RequestError(MedVolError):
    """The request itself is malformed (missing or mistyped field, unknown op, …)."""

    code = "bad_request"

    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        if code:
            self.code = code


# ---- JSON helpers ------------------------------------------------------------------------

def _jsonable(obj: Any) -> Any:
    """Plain JSON types only: numpy scalars/arrays converted, non-finite floats → null."""
    t = type(obj)
    if t is str or t is int or t is bool or obj is None:  # most of a reply: returned at once
        return obj
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "tolist"):  # numpy scalar or array
        return _jsonable(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def dumps_line(obj: dict) -> str:
    return json.dumps(_jsonable(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _valid_unicode(obj: Any) -> Any:
    """``obj`` with every string made encodable (a lone surrogate becomes U+FFFD)."""
    if isinstance(obj, str):
        return obj.encode("utf-8", "replace").decode("utf-8")
    if isinstance(obj, dict):
        return {_valid_unicode(k): _valid_unicode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_valid_unicode(v) for v in obj]
    return obj


def encode_line(obj: dict) -> bytes:
    """One protocol line as UTF-8 bytes (with the newline); never fails on a lone surrogate."""
    try:
        return (dumps_line(obj) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (dumps_line(_valid_unicode(_jsonable(obj))) + "\n").encode("utf-8")


def error_reply(req_id, code: str, message: str) -> dict:
    return {"id": req_id, "ok": False, "error": {"code": code, "message": message}}


def ok_reply(req_id, result: dict) -> dict:
    return {"id": req_id, "ok": True, "result": result}


def valid_id(value) -> bool:
    if value is None:
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -MAX_ID_INT < value < MAX_ID_INT
    return isinstance(value, str) and len(value) <= MAX_ID_CHARS and is_unicode(value)


def _describe_bad_id(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"'id' must be an integer of at most 63 bits or a string, got an integer of {len(str(abs(value)))} digits"
    if isinstance(value, str):
        return (f"'id' must be at most {MAX_ID_CHARS} characters, got {len(value)}" if len(value) > MAX_ID_CHARS
                else "'id' is not valid Unicode text (a lone surrogate)")
    return f"'id' must be a string or an integer, got {type(value).__name__}"


def parse_request(raw) -> dict:
    """bytes/str → request dict (``id`` checked); raises RequestError with the right code.

    An object that names a key twice, at any depth, is refused (``bad_request``, naming it). The
    parse's cost is bounded first: more keys or values than :mod:`.limits` allows is
    ``too_large``, counted without parsing; nesting deeper than ``json_depth`` is ``bad_request``.
    """
    if isinstance(raw, (bytes, bytearray)):
        if not isinstance(raw, CountedJSON):
            check_json_cost(raw)
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"request is not UTF-8 text: {e}", "bad_json") from None
    else:
        check_json_cost(str(raw).encode("utf-8", "surrogatepass"))
    try:
        req = json.loads(raw, object_pairs_hook=unique_keys)
    except DuplicateKeyError as e:
        key = str(e.key)
        shown = json.dumps(key[:100]) + ("…" if len(key) > 100 else "")
        raise RequestError(f"the request names the key {shown} twice; send each key once") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, or an integer over Python's digit limit
        raise RequestError(f"request is not valid JSON: {str(e)[:200]}", "bad_json") from None
    depth = json_depth(req, MAX_JSON_DEPTH)
    if depth > MAX_JSON_DEPTH:
        raise RequestError(f"the request nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")
    if not isinstance(req, dict):
        raise RequestError(f"a request must be a JSON object {{\"id\": …, \"op\": …}}, got {type(req).__name__}")
    if not valid_id(req.get("id")):
        raise RequestError(_describe_bad_id(req.get("id")))
    return req


MAX_JSON_KEYS = int(limit("json_keys").default)
MAX_JSON_VALUES = int(limit("json_values").default)
MAX_JSON_DEPTH = int(limit("json_depth").default)


class CountedJSON(bytes):
    """A request body whose JSON cost a transport already checked as it arrived
    (:func:`check_json_cost`): :func:`parse_request` does not count it again."""


def check_json_cost(data: bytes, keys: int = 0, values: int = 0) -> tuple:
    """Raise ``too_large`` when ``data`` (plus ``keys``/``values`` already counted before it)
    holds more JSON keys or values than allowed; returns the new counts. Counted without
    parsing, so a transport can call it on each chunk as a body arrives."""
    k, v = json_cost(data)
    keys, values = keys + k, values + v
    if keys > MAX_JSON_KEYS:
        raise RequestError(f"the request holds more than {MAX_JSON_KEYS:,} JSON keys and objects", "too_large")
    if values > MAX_JSON_VALUES:
        raise RequestError(f"the request holds more than {MAX_JSON_VALUES:,} JSON values", "too_large")
    return keys, values


def json_depth(obj, stop: int) -> int:
    """How deeply ``obj`` nests lists and dicts (a scalar: 0), counted up to ``stop + 1``."""
    depth, level = 0, [obj]
    while depth <= stop:
        containers = [o for o in level if isinstance(o, (list, dict))]
        if not containers:
            break
        depth += 1
        level = [v for o in containers for v in (o.values() if isinstance(o, dict) else o)]
    return depth


_MISSING = object()  # a key the request does not have (the worker's ``cancel`` tells it from null)


def internal_reply(rid, what: str) -> dict:
    """The reply to an unexpected failure: a reference, no exception text (that goes to the log)."""
    ref = secrets.token_hex(4)
    log.error("internal error (ref %s) in %s:\n%s", ref, what, traceback.format_exc())
    return error_reply(rid, "internal", f"internal error (ref {ref}); the worker's log has the details")
