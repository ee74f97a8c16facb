"""``medvol mcp`` and a DICOMweb server (medvolcore/agents/server.py with medvolcore/pacs.py): a real
Orthanc on loopback, allowed by name: list_series finds its series, segment_from_query reads one
by URL; a series the server lacks, or a server not allowed, is a
tool error."""

from __future__ import annotations

import anyio
import pytest

pytest.importorskip("mcp")

from mcp import Client  # noqa: E402

from medvolcore import pacs  # noqa: E402
from medvolcore.agents.server import AgentServer, AgentSettings  # noqa: E402
from medvolcore.serve.worker import WorkerSettings  # noqa: E402

from core.test_pacs import SERIES, STUDY, _servers_file, orthanc, source_series  # noqa: E402,F401  (fixtures)


@pytest.fixture(scope="module")
def agent(orthanc, tmp_path_factory):
    servers = pacs.load_servers(_servers_file(tmp_path_factory.mktemp("cfg"), orthanc.dicomweb), ["orthanc"])
    server = AgentServer(AgentSettings(worker=WorkerSettings(preset="tiny", device="cpu", threads=1,
                                                             pacs_servers=servers)))
    yield server
    server.close()


def _calls(agent, *calls):
    async def go():
        async with Client(agent.mcp) as c:
            return [await c.call_tool(name, args) for name, args in calls]
    return anyio.run(go)


@pytest.mark.slow
def test_list_series_then_segment_one_by_its_url(agent, orthanc):
    listed, too_early, bad_date = _calls(agent, ("list_series", {"server": "orthanc"}),
                                         ("list_series", {"server": "orthanc", "study_date": "-19000101"}),
                                         ("list_series", {"server": "orthanc", "study_date": "yesterday"}))
    found = listed.structured_content
    assert [(s["study"], s["series"]) for s in found["series"]] == [(STUDY, SERIES)] and not found["truncated"]
    assert too_early.structured_content["series"] == []
    assert bad_date.is_error and "YYYYMMDD" in bad_date.content[0].text
    url = found["series"][0]["url"]
    seg, missing = _calls(agent, ("segment_from_query", {"volume": url, "query": "the liver"}),
                          ("segment_from_query", {"volume": url.replace(SERIES, SERIES + ".9"), "query": "liver"}))
    assert not seg.is_error, seg.content
    out = seg.structured_content
    assert out["status"] == "segmented" and out["volume"] == url
    assert {"mask", "seg_nrrd", "anchor", "qc"} <= {f["kind"] for f in out["files"]}
    assert missing.is_error and "\n" not in missing.content[0].text
