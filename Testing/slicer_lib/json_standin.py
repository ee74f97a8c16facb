"""A stand-in HTTP worker's reply, for the client tests' ``BaseHTTPRequestHandler`` servers
(``from json_standin import send_json``): a JSON body with its length and a session id."""

from __future__ import annotations

import json


def send_json(handler, obj, session: str = "s1", status: int = 200) -> None:
    out = json.dumps(obj).encode()
    handler.send_response(status)
    for k, v in {"Content-Type": "application/json", "Content-Length": str(len(out)),
                 "X-MedVol-Session": session}.items():
        handler.send_header(k, v)
    handler.end_headers()
    handler.wfile.write(out)
