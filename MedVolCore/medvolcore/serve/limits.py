"""Every limit of the serving path, declared once: its default, the option that changes it, and
how a request over it is refused (HTTP status and protocol error code).

The transports read their values from here (``limit("header_bytes").default``), the table of
``docs/security.md`` ("Limits") is generated from :data:`LIMITS` (``python -m
medvolcore.serve.limits --write docs/security.md``; a test fails when the two differ), and each
limit names the tests that probe it at its bound and one past it. Routes added beside the
protocol's (another API on the same server) take their bounds from here too.

This module imports nothing of the server, so any route or transport can import it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

__all__ = ["Limit", "LIMITS", "limit", "markdown_table", "json_cost", "TABLE_BEGIN", "TABLE_END"]


@dataclass(frozen=True)
class Limit:
    """One bound. ``default`` is in ``unit``; ``option`` is the command-line option that sets it
    (None: fixed); ``status``/``code``: the refusal (``status`` None where the connection is
    closed without a reply); ``tests``: the tests at the bound and past it (``file::name``,
    under ``Testing/``)."""

    name: str
    what: str
    default: float
    unit: str
    option: Optional[str]
    status: Optional[int]
    code: str
    refusal: str
    tests: Tuple[str, ...]

    @property
    def value(self) -> float:
        return self.default


_KB = 1 << 10
_MB = 1 << 20

LIMITS: Tuple[Limit, ...] = (
    Limit("request_line", "request target (path and query)", 16 * _KB, "bytes", None, 414, "too_large",
          "reply, connection closed; before any header is read",
          ("core/test_serve_limits.py::test_request_line_at_and_past_the_bound",)),
    Limit("header_line", "one header line (name and value)", 64 * _KB, "bytes", None, 431, "too_large",
          "reply, connection closed; before the token is read",
          ("core/test_serve_limits.py::test_one_header_line_at_and_past_the_bound",)),
    Limit("header_bytes", "request line and headers together", 256 * _KB, "bytes", None, 431, "too_large",
          "reply, connection closed; before the token is read",
          ("core/test_serve_limits.py::test_header_bytes_at_and_past_the_bound",
           "core/test_serve_limits.py::test_a_never_ending_header_costs_no_memory")),
    Limit("header_count", "headers in one request", 100, "headers", None, 431, "too_large",
          "reply, connection closed; before the token is read",
          ("core/test_serve_limits.py::test_header_count_at_and_past_the_bound",)),
    Limit("json_body", "JSON body (and stdio request line)", 16 * _MB, "bytes", "--max-request-mb", 413,
          "too_large", "reply before the body is read",
          ("core/test_serve_limits.py::test_json_body_at_and_past_the_bound",)),
    Limit("json_keys", "JSON keys and objects in one request", 20_000, "keys", None, 413, "too_large",
          "reply as soon as the count is passed, before the body is parsed",
          ("core/test_serve_limits.py::test_json_keys_at_and_past_the_bound",)),
    Limit("json_values", "JSON values (commas, keys, arrays and objects) in one request", 300_000, "values", None,
          413, "too_large", "reply as soon as the count is passed, before the body is parsed",
          ("core/test_serve_limits.py::test_json_values_at_and_past_the_bound",)),
    Limit("json_depth", "nesting of arrays and objects", 64, "levels", None, 400, "bad_request",
          "reply after parsing (the parse is bounded by the counts above)",
          ("core/test_serve_limits.py::test_json_depth_at_and_past_the_bound",)),
    Limit("voxels", "voxels of one volume (every dimension and component)", 1024 * 1024 * 1000, "voxels",
          "--max-voxels", 413, "too_large", "a volume body: from its header, before the rest is read",
          ("core/test_serve_upload.py::test_volume_over_the_voxel_limit_is_refused_from_its_first_bytes",)),
    Limit("volume_body", "volume body (application/octet-stream)", 1024 * 1024 * 1000 * 8 + 9 * _MB + 544, "bytes",
          "--max-voxels", 413, "too_large", "from Content-Length, before anything is read (voxels × 8 + 9 MB)",
          ("core/test_serve_limits.py::test_volume_body_at_and_past_the_ceiling",)),
    Limit("body_rate", "minimum body rate, after --client-timeout of grace", 256 * _KB, "bytes/s", None, 408,
          "bad_request", "reply, connection closed",
          ("core/test_serve_http_conn.py::test_a_slow_drip_body_is_cut",)),
    Limit("client_timeout", "seconds to send a request line and headers (and between requests)", 20, "s",
          "--client-timeout", None, "-", "connection closed",
          ("core/test_serve_limits.py::test_headers_within_and_past_the_client_timeout",)),
    Limit("refused_body_drain", "bytes of a refused body read (and dropped) so its client sees the reply",
          16 * _MB, "bytes", None, None, "-",
          "after the reply, only when the rest is at most this; at the minimum body rate and within 5 s; then "
          "the connection is closed",
          ("core/test_serve_limits.py::test_a_refused_body_does_not_keep_its_slot",)),
    Limit("connections", "connections served at once", 32, "connections", "--max-connections", 503, "busy",
          "reply at once, connection closed, nothing read",
          ("core/test_serve_limits.py::test_connections_at_and_past_the_bound",)),
    Limit("sessions_per_client", "new sessions (and as many known ones) per client", 64, "sessions", None, 429,
          "busy", "only when every one has a request in flight; else the least recently used idle one is forgotten",
          ("core/test_serve_limits.py::test_sessions_per_client_at_and_past_the_bound",
           "core/test_serve_devices.py::test_front_keeps_sessions_per_client")),
    Limit("sessions", "sessions of all clients together", 1 << 16, "sessions", None, None, "-",
          "the least recently used idle session is forgotten",
          ("core/test_serve_limits.py::test_session_table_total_at_and_past_the_bound",)),
    Limit("session_idle", "seconds a session is kept without a request", 3600, "s", "--session-idle-s", None, "-",
          "the session is forgotten, its queued requests cancelled",
          ("core/test_serve_http.py::test_idle_sessions_are_reaped",)),
    Limit("path_chars", "characters of a --data-dir path in a request (255 bytes a name)", 1024, "characters", None, 200, "bad_volume",
          "reply before any file is looked up",
          ("core/test_serve_limits.py::test_path_chars_at_and_past_the_bound",)),
    Limit("pacs_instance", "bytes of one DICOMweb instance", 512 * _MB, "bytes", "--dicomweb-max-instance-mb", 200,
          "too_large", "retrieval stopped, nothing kept",
          ("core/test_pacs.py::test_an_instance_over_the_limit_is_refused",)),
    Limit("mcp_body", "request body of `medvol mcp --http` (one JSON-RPC message)", 1 * _MB, "bytes", "--max-body-kb",
          413, "-", "reply before the body is parsed (the MCP SDK's own refusal)",
          ("core/test_agents_http.py::test_a_body_at_and_past_the_limit",)),
    Limit("viewer_proxy_query", "query string of the web viewer's DICOMweb proxy (`--monailabel`)", 2048,
          "characters", None, 414, "-", "reply before the DICOMweb server is asked",
          ("core/test_serve_monailabel.py::test_the_proxy_query_at_and_past_its_bound",)),
    Limit("tmp_free", "free space left on the temporary folder's disk after an upload", 64 * _MB, "bytes", None, 413,
          "too_large", "before the body is stored",
          ("core/test_serve_limits.py::test_an_upload_leaving_too_little_disk_is_refused",)),
)

_BY_NAME = {lim.name: lim for lim in LIMITS}


def limit(name: str) -> Limit:
    """The declared limit ``name`` (KeyError for an unknown one)."""
    return _BY_NAME[name]


_NOT_MARKS = bytes(b for b in range(256) if b not in b":{,[")


def json_cost(data: bytes) -> Tuple[int, int]:
    """``(keys, values)`` of a JSON text, counted from its structural bytes without parsing it
    (an upper bound: a comma or colon inside a string counts too): keys are ``:`` and ``{``,
    values are those plus ``,`` and ``[``. One pass over the bytes (a few ms a MB); the parse of a text within
    :data:`LIMITS`' ``json_keys`` and ``json_values`` is then bounded (about 50 ms)."""
    marks = data.translate(None, _NOT_MARKS)  # one pass; short for any JSON a client means
    return marks.count(b":") + marks.count(b"{"), len(marks)


def _shown(lim: Limit) -> str:
    v = lim.default
    if lim.unit == "bytes":
        for size, name in ((1 << 30, "GB"), (_MB, "MB"), (_KB, "kB")):
            if v >= size and v % size == 0:
                return f"{int(v // size):,} {name}"
        return f"{int(v):,} bytes"
    if lim.unit == "bytes/s":
        return f"{int(v // _KB):,} kB/s"
    return f"{v:,g} {lim.unit}" if lim.unit != "s" else f"{v:g} s"


TABLE_BEGIN = "<!-- limits table: generated by `python -m medvolcore.serve.limits`; do not edit by hand -->"
TABLE_END = "<!-- end of the limits table -->"


def markdown_table() -> str:
    """The limits as the Markdown table of ``docs/security.md``, between its two markers."""
    rows = [TABLE_BEGIN, "| limit | default | option | refused with | when |", "|---|---|---|---|---|"]
    for lim in LIMITS:
        refusal = (f"{lim.status} `{lim.code}`" if lim.status is not None
                   else ("`" + lim.code + "`" if lim.code != "-" else "—"))
        option = f"`{lim.option}`" if lim.option else "fixed"
        rows.append(f"| {lim.what} | {_shown(lim)} | {option} | {refusal} | {lim.refusal} |")
    rows.append(TABLE_END)
    return "\n".join(rows) + "\n"


def with_table(text: str) -> str:
    """``text`` (``docs/security.md``) with the part between the markers replaced by the table."""
    head, sep, rest = text.partition(TABLE_BEGIN)
    if not sep:
        raise ValueError("no limits table marker in the document")
    _, sep2, tail = rest.partition(TABLE_END)
    if not sep2:
        raise ValueError("no end marker of the limits table in the document")
    return head + markdown_table().rstrip("\n") + tail


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write"] and len(argv) == 2:
        p = Path(argv[1])
        p.write_text(with_table(p.read_text(encoding="utf-8")), encoding="utf-8")
        return 0
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
