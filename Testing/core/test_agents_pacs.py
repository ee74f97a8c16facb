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


def _reads(agent, *uris):
    async def go():
        async with Client(agent.mcp) as c:
            return [await c.read_resource(u) for u in uris]
    return anyio.run(go)


@pytest.mark.slow
def test_list_series_then_segment_one_by_its_url(agent, orthanc, source_series):  # noqa: F811
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
    assert {"mask", "seg_nrrd", "dicom_seg", "anchor", "qc"} <= {f["kind"] for f in out["files"]}
    # the DICOM-SEG of the retrieved series (read from the worker's private copy, gone since): its frames
    # are the mask's, and it is among the job's resources
    from core.test_dicom_generated import dciodvfy_errors, seg_equals_mask

    files = {f["kind"]: f for f in out["files"]}
    seg_equals_mask(files["dicom_seg"]["path"], source_series, files["mask"]["path"])
    assert dciodvfy_errors(files["dicom_seg"]["path"]) == []
    import base64

    (read,) = _reads(agent, files["dicom_seg"]["uri"])
    assert base64.b64decode(read.contents[0].blob) == open(files["dicom_seg"]["path"], "rb").read()
    assert missing.is_error and "\n" not in missing.content[0].text
