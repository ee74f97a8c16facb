"""``medvol serve``: the long-lived worker that keeps the models loaded (protocol 1).

- :mod:`.protocol` — the envelope: request parsing, field checks, the two reply shapes
  (the reference for clients is ``docs/protocol.md``);
- :mod:`.cache` — volumes kept by content sha256;
- :mod:`.worker` — :class:`Worker`: the request queue, one worker thread, the trust boundary;
- :mod:`.stdio` and :mod:`.http` — the two transports; :mod:`.lifecycle` — what they share
  (stderr log, signals, stopping).

Importing this package imports neither torch nor the models: the worker loads them on the first
request that needs them.
"""

from .cache import DEFAULT_CACHE_SIZE, DEFAULT_MAX_VOXELS, StackCache, file_sha256
from .protocol import (DEFAULT_MAX_REQUEST_MB, OPS, PROTOCOL, RequestError, encode_line, error_reply, ok_reply,
                       parse_request)
from .worker import Door, Worker, WorkerSettings

__all__ = [
    "DEFAULT_CACHE_SIZE", "DEFAULT_MAX_REQUEST_MB", "DEFAULT_MAX_VOXELS", "Door", "OPS", "PROTOCOL", "RequestError",
    "StackCache", "Worker", "WorkerSettings", "encode_line", "error_reply", "file_sha256", "ok_reply", "parse_request",
]
