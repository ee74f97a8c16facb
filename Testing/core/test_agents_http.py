"""``medvol mcp --http`` (medvolcore/agents/http.py): the SDK's streamable HTTP application on the
worker's uvicorn stack, on loopback: the token, the Host check, the body limit, and a raw JSON-RPC
client of protocol 2025-06-18 that gets what the SDK's client gets. No model loads here."""

from __future__ import annotations

import json
import secrets
import shutil
import threading

import anyio
import httpx
import pytest

pytest.importorskip("mcp")

from mcp import Client  # noqa: E402

from medvolcore.agents.http import http_server  # noqa: E402
from medvolcore.agents.server import AgentServer, AgentSettings  # noqa: E402
from medvolcore.errors import InputError  # noqa: E402
from medvolcore.serve.http import HttpSettings  # noqa: E402

from core.test_agents_server import SNAPSHOT  # noqa: E402

PROTOCOL = "2025-06-18"
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def served(tmp_path_factory, small_ct):
    base = tmp_path_factory.mktemp("mcphttp")
    root = base / "allowed"
    root.mkdir()
    shutil.copy(small_ct[0], root / "ct.nii.gz")
    token = secrets.token_urlsafe(24)
    (base / "token").write_text(token)
    (base / "token").chmod(0o600)
    agent = AgentServer(AgentSettings(roots=[root]))
    server = http_server(agent, HttpSettings(host="127.0.0.1", port=0, token_file=str(base / "token")), MAX_BODY)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/mcp"
    yield url, token, root, agent
    server.server_close()
    agent.close()


def _headers(token, **extra):
    h = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if token:
        h["Authorization"] = f"Bearer {token}"
    h.update(extra)
    return h


def _messages(response) -> list:
    """JSON-RPC messages of a reply: a JSON body, or the data lines of an event stream."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return [json.loads(line[5:]) for line in response.text.splitlines()
                if line.startswith("data:") and line[5:].strip()]
    return [response.json()]


class RawClient:
    """JSON-RPC by hand, as a host on protocol 2025-06-18 speaks it."""

    def __init__(self, url, token):
        self.url, self.token, self.session, self.next = url, token, None, 1
        self.http = httpx.Client(timeout=120)

    def post(self, body, **headers):
        h = _headers(self.token, **headers)
        if self.session:
            h.update({"Mcp-Session-Id": self.session, "MCP-Protocol-Version": PROTOCOL})
        return self.http.post(self.url, content=json.dumps(body), headers=h)

    def request(self, method, params=None):
        rid, self.next = self.next, self.next + 1
        r = self.post({"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}})
        assert r.status_code == 200, (r.status_code, r.text)
        msgs = _messages(r)
        (reply,) = [m for m in msgs if m.get("id") == rid]
        return reply, r

    def initialize(self):
        reply, r = self.request("initialize", {"protocolVersion": PROTOCOL, "capabilities": {},
                                               "clientInfo": {"name": "raw", "version": "0"}})
        self.session = r.headers.get("mcp-session-id")
        r = self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        assert r.status_code in (200, 202)
        return reply


def test_a_request_without_the_token_gets_401(served):
    url, token, _, _ = served
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    for auth in (None, "Bearer wrong-token-of-some-length", f"Basic {token}", f"Bearer {token}x"):
        h = _headers(None)
        if auth:
            h["Authorization"] = auth
        r = httpx.post(url, content=body, headers=h)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (auth, r.status_code)
        assert "token" in r.json()["error"]["message"]


def test_a_foreign_host_gets_421_and_a_foreign_origin_403(served):
    url, token, _, _ = served
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}})
    r = httpx.post(url, content=body, headers=_headers(token, Host="evil.example:80"))
    assert r.status_code == 421
    r = httpx.post(url, content=body, headers=_headers(token, Origin="http://evil.example"))
    assert r.status_code == 403


def _sized(n: int) -> str:
    """A tools/list request padded to exactly ``n`` bytes."""
    head = '{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_pad": "'
    return head + "a" * (n - len(head) - 3) + '"}}'


def test_a_body_at_and_past_the_limit(served):
    url, token, _, _ = served
    client = RawClient(url, token)
    client.initialize()
    at, past = _sized(MAX_BODY), _sized(MAX_BODY + 1)
    assert len(at.encode()) == MAX_BODY and json.loads(at)["method"] == "tools/list"
    r = client.post(json.loads(at))  # RawClient sends json.dumps(body): the same bytes
    assert r.status_code == 200, (r.status_code, r.text[:200])
    assert any(m.get("result", {}).get("tools") for m in _messages(r))
    r = httpx.post(url, content=past, headers=_headers(token))
    assert r.status_code == 413


def test_no_token_off_loopback_is_refused_before_listening(tmp_path):
    from medvolcore.serve.http import listening_token

    with pytest.raises(InputError, match="without a token"):
        listening_token(HttpSettings(host="0.0.0.0", port=0))
    from medvolcore.agents.http import transport_security

    with pytest.raises(InputError, match="--allowed-host"):
        transport_security("0.0.0.0")


def test_raw_jsonrpc_of_2025_06_18_gets_what_the_sdk_client_gets(served):
    url, token, root, _ = served
    raw = RawClient(url, token)
    init = raw.initialize()
    assert init["result"]["protocolVersion"] == PROTOCOL and "research" in init["result"]["instructions"].lower()
    listed, _ = raw.request("tools/list")
    tools = {t["name"]: t for t in listed["result"]["tools"]}
    snapshot = json.loads(SNAPSHOT.read_text())
    assert {n: (t["inputSchema"], t["outputSchema"]) for n, t in tools.items()} == \
           {n: (t["inputSchema"], t["outputSchema"]) for n, t in snapshot.items()}
    volume = str(root / "ct.nii.gz")
    got, _ = raw.request("tools/call", {"name": "describe_volume", "arguments": {"volume": volume}})
    refused, _ = raw.request("tools/call", {"name": "describe_volume", "arguments": {"volume": "/etc/passwd"}})

    async def sdk():
        async with _sdk_client(url, token) as c:
            return (await c.call_tool("describe_volume", {"volume": volume}),
                    await c.call_tool("describe_volume", {"volume": "/etc/passwd"}))
    ok, bad = anyio.run(sdk)
    assert got["result"]["structuredContent"] == ok.structured_content and ok.structured_content["axial_slices"] == 8
    assert refused["result"]["isError"] is True and bad.is_error
    assert refused["result"]["content"][0]["text"] == bad.content[0].text


def _sdk_client(url, token):
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120)
    return Client(streamable_http_client(url, http_client=http))


def test_models_not_installed_are_a_protocol_error_over_the_wire(served):
    url, token, root, _ = served  # the default preset, whose weights are not installed here
    raw = RawClient(url, token)
    raw.initialize()
    reply, _ = raw.request("tools/call", {"name": "segment_from_query",
                                          "arguments": {"volume": str(root / "ct.nii.gz"), "query": "the liver"}})
    assert "result" not in reply and reply["error"]["code"] == -32002, reply
    assert "medvol models download" in reply["error"]["message"]
