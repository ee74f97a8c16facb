"""``medvol mcp --http HOST:PORT``: the SDK's streamable HTTP application on the worker's HTTP stack.

The application is the SDK's own (``MCPServer.streamable_http_app``: sessions, its ``Host`` and
``Origin`` checks against DNS rebinding, its body limit, 413 past it). It is served by the same
uvicorn set-up as ``medvol serve --http`` (:class:`medvolcore.serve.http.HttpServer`: the
connection cap, header and body deadlines, strict framing of :mod:`medvolcore.serve.http_conn`),
behind one more rule: with ``--token-file`` (required on an address other than a loopback one)
every request carries ``Authorization: Bearer TOKEN`` or gets 401 before the application sees it.
The names ``Host`` may carry are the bound address's (and ``--allowed-host``), as for the worker.
"""

import hmac
import json
import threading
from typing import Optional

from ..errors import InputError
from ..serve.http import HttpServer, HttpSettings, allowed_names, listening_token
from ..serve.lifecycle import Stop, install_signals, say, stop_worker

__all__ = ["BearerToken", "transport_security", "serve_mcp_http", "MCP_PATH"]

MCP_PATH = "/mcp"


class BearerToken:
    """ASGI middleware: a request without ``Authorization: Bearer <token>`` gets 401 (JSON-RPC
    error body, ``WWW-Authenticate: Bearer``) before the application reads anything of it."""

    def __init__(self, app, token: Optional[str]):
        self.app = app
        self.expected = None if token is None else f"Bearer {token}".encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.expected is not None:
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = json.dumps({"jsonrpc": "2.0", "id": None, "error": {
                    "code": -32001, "message": "missing or wrong token: send 'Authorization: Bearer TOKEN' (the "
                                               "server's --token-file)"}}).encode("utf-8")
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode("ascii")),
                    (b"www-authenticate", b"Bearer"), (b"cache-control", b"no-store")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def transport_security(host: str, extra=()):
    """The SDK's DNS-rebinding settings for a server bound to ``host``: ``Host`` one of the
    address's names (any port) or an ``--allowed-host``, ``Origin`` the same names over http(s)."""
    from mcp.server.transport_security import TransportSecuritySettings

    names = allowed_names(host, extra)
    if names is None:
        raise InputError(f"--http {host}: a wildcard address needs --allowed-host NAME (the name clients use), so "
                         "that the Host check against DNS rebinding has names to accept")
    hosts, origins = [], []
    for name in sorted(names):
        shown = f"[{name}]" if ":" in name else name
        hosts += [shown, f"{shown}:*"]
        origins += [f"http://{shown}", f"http://{shown}:*", f"https://{shown}", f"https://{shown}:*"]
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts,
                                     allowed_origins=origins)


def build_app(agent, http: HttpSettings, token: Optional[str], max_body: int):
    """The ASGI application: the token check around the SDK's streamable HTTP app at ``/mcp``."""
    app = agent.mcp.streamable_http_app(streamable_http_path=MCP_PATH, max_request_body_size=int(max_body),
                                        transport_security=transport_security(http.host, http.allowed_hosts),
                                        host=http.host)
    return BearerToken(app, token)


def http_server(agent, http: HttpSettings, max_body: int) -> HttpServer:
    """The uvicorn server of ``medvol serve --http`` (bound at once) serving :func:`build_app`;
    its lifespan runs, since the SDK's session manager starts there."""
    token = listening_token(http)
    app = build_app(agent, http, token, max_body)
    try:
        server = HttpServer(http, agent.worker, token, app=lambda _server: app)
    except OSError as e:
        raise InputError(f"cannot listen on {http.host}:{http.port}: {e.strerror or e}") from None
    server.config.lifespan = "on"
    server.token_required = token is not None
    return server


def serve_mcp_http(agent, http: HttpSettings, max_body: int) -> int:
    """Serve until SIGINT or SIGTERM; returns the exit code."""
    server = http_server(agent, http, max_body)
    old = install_signals()
    how = "shutdown"
    serving = threading.Thread(target=server.serve_forever, name="medvol-mcp-http", daemon=True)
    try:
        serving.start()
        host, port = server.server_address[:2]
        shown = f"[{host}]" if ":" in host else host
        say(f"mcp: ready on {'https' if http.tls_cert else 'http'}://{shown}:{port}{MCP_PATH}"
            + (" (token required)" if server.token_required else ""))
        while serving.is_alive():
            serving.join(0.25)
    except Stop:
        how = "SIGTERM"
    except KeyboardInterrupt:
        how = "SIGINT"
    finally:
        stop_worker(agent.worker, how, old, before_close=server.server_close)
        agent.close(worker=False)
    return 0
