"""``medvol mcp``'s tools (medvolcore/agents/server.py) through the MCP SDK's in-memory client, on
the worker of ``medvol serve`` with the tiny preset (CPU): the tools' schemas, a segmented and a
not_found result, a correction round that encodes no slice, progress and cancel, every refusal."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import anyio
import nibabel as nib
import numpy as np
import pytest

pytest.importorskip("mcp")

from mcp import Client  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402

from medvolcore import RESEARCH_USE_NOTICE  # noqa: E402
from medvolcore.agents.server import NOT_READY, AgentServer, AgentSettings  # noqa: E402
from medvolcore.grounder import QwenVLGrounder  # noqa: E402
from medvolcore.serve.worker import WorkerSettings  # noqa: E402

from core.test_pipeline import ABSENT  # noqa: E402

SNAPSHOT = Path(__file__).with_name("snapshots") / "mcp_tools.json"


@pytest.fixture(scope="module")
def place(tmp_path_factory, small_ct):
    """An allowed folder holding the 8-slice CT, a secret file beside it (outside), and a link
    inside pointing at the secret."""
    base = tmp_path_factory.mktemp("mcp")
    root, outside = base / "allowed", base / "outside"
    root.mkdir()
    outside.mkdir()
    shutil.copy(small_ct[0], root / "ct.nii.gz")
    shutil.copy(small_ct[0], outside / "secret.nii.gz")
    os.symlink(outside / "secret.nii.gz", root / "link.nii.gz")
    os.symlink(outside, root / "linkdir")
    return root, outside


@pytest.fixture(scope="module")
def agent(place):
    server = AgentServer(AgentSettings(worker=WorkerSettings(preset="tiny", device="cpu", threads=1),
                                       roots=[place[0]]))
    yield server
    server.close()


def call(agent, name, args, progress=None):
    async def go():
        async with Client(agent.mcp) as c:
            return await c.call_tool(name, args, progress_callback=progress)
    return anyio.run(go)


def refusal(agent, name, args) -> str:
    r = call(agent, name, args)
    assert r.is_error, r
    text = r.content[0].text
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.fixture(scope="module")
def segmented(agent, place):
    events = []

    async def progress(p, total, message):
        events.append((p, total, message))

    r = call(agent, "segment_from_query", {"volume": str(place[0] / "ct.nii.gz"), "query": "the liver"}, progress)
    return r, events


# ---- the tools' schemas ---------------------------------------------------------------------------

def _listing(agent):
    async def go():
        async with Client(agent.mcp) as c:
            return (await c.list_tools()).tools, c.instructions
    return anyio.run(go)


def test_tools_list_matches_the_snapshot(agent):
    tools, instructions = _listing(agent)
    got = {t.name: {"description": t.description, "inputSchema": t.input_schema, "outputSchema": t.output_schema,
                    "annotations": t.annotations.model_dump(mode="json", exclude_none=True) if t.annotations else None}
           for t in tools}
    if os.environ.get("MEDVOL_UPDATE_SNAPSHOTS"):
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(SNAPSHOT.read_text()), "the tools changed: review, then MEDVOL_UPDATE_SNAPSHOTS=1"
    assert set(got) == {"segment_from_query", "repropagate", "describe_volume", "list_series", "job_status"}
    assert all(t["outputSchema"] for t in got.values())  # structured output for every tool
    assert got["segment_from_query"]["outputSchema"]["properties"]["status"]["enum"] == ["segmented", "not_found"]
    assert RESEARCH_USE_NOTICE in instructions and "NOT evidence" in instructions
    assert str(agent.places.roots[0]) in instructions  # the agent is told what it may read


# ---- segmented, not found, corrected ---------------------------------------------------------------

def test_segmented_result_points_at_files_on_the_ct_grid(segmented, place, agent):
    r, _ = segmented
    assert not r.is_error, r.content
    out = r.structured_content
    assert out["status"] == "segmented" and out["smoke"] is True and out["research_use"] == RESEARCH_USE_NOTICE
    (t,) = out["targets"]
    assert t["found"] and t["structure"] == "liver" and t["code"] == "SCT:10200004" and t["code_meaning"] == "Liver"
    files = {f["kind"]: f for f in out["files"]}
    assert set(files) >= {"mask", "seg_nrrd", "anchor", "qc"}
    mask = nib.load(files["mask"]["path"])
    ct = nib.load(str(place[0] / "ct.nii.gz"))
    assert mask.shape == ct.shape and np.allclose(mask.affine, ct.affine)
    assert int(np.asarray(mask.dataobj).sum()) == t["voxels"] > 0
    anchor = json.loads(Path(files["anchor"]["path"]).read_text())
    assert anchor["slice"] == t["key_slice"]["index"] and anchor["boxes"] == [b["voxels"] for b in t["boxes"]]
    assert any("smoke" in n or "tiny" in n for n in t["notes"])
    images = [c for c in r.content if c.type == "image"]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert Path(files["qc"]["path"]).read_bytes().startswith(b"\x89PNG")


def test_a_result_file_is_a_resource_with_the_same_bytes(segmented, agent):
    out = segmented[0].structured_content
    f = next(f for f in out["files"] if f["kind"] == "anchor")

    async def go():
        async with Client(agent.mcp) as c:
            got = await c.read_resource(f["uri"])
            with pytest.raises(MCPError):  # a name the job did not write is no resource
                await c.read_resource(f"medvol://jobs/{out['job']}/..%2F..%2Fetc%2Fpasswd")
            return got
    got = anyio.run(go)
    import base64

    content = got.contents[0]
    data = base64.b64decode(content.blob) if getattr(content, "blob", None) else content.text.encode()
    assert data == Path(f["path"]).read_bytes()


def test_progress_grows_through_the_stages(segmented):
    _, events = segmented
    assert len(events) >= 5
    values = [p for p, _, _ in events]
    assert values == sorted(values) and len(set(values)) == len(values) and 0 < values[-1] <= 1.0
    stages = {m.split(":")[0] for _, _, m in events}
    assert {"ground", "propagate"} <= stages


def test_repropagate_with_corrections_encodes_no_slice(segmented, agent):
    out = segmented[0].structured_content
    t = out["targets"][0]
    z = t["key_slice"]["index"]
    other = (z + 2) % 8
    r = call(agent, "repropagate", {"job": out["job"], "corrections": [{"slice": other, "object": 1,
                                                                          "box": [20, 20, 60, 60]}],
                                    "slice_range": [0, 7]})
    assert not r.is_error, r.content
    fixed = r.structured_content
    assert fixed["slices_encoded"] == 0 and fixed["job"] != out["job"]
    anchor = json.loads(Path(next(f for f in fixed["files"] if f["kind"] == "anchor")["path"]).read_text())
    assert anchor["schema"] == "medvol.anchor/2" and anchor["prompts"][0]["slice"] == other
    assert anchor["prompts"][0]["box"] == [20, 20, 60, 60] and anchor["z_range"] == [0, 7]
    assert anchor["slice"] == z  # the model's evidence stays; only the propagation changed


def test_several_queries_are_several_targets_of_one_mask(agent, place):
    r = call(agent, "segment_from_query", {"volume": str(place[0] / "ct.nii.gz"), "query": ["the liver", "the spleen"]})
    assert not r.is_error, r.content
    out = r.structured_content
    assert [t["label"] for t in out["targets"]] == [1, 2]
    assert [t["structure"] for t in out["targets"]] == ["liver", "spleen"]
    per_target = {(f["kind"], f["target"]) for f in out["files"]}
    assert {("anchor", 1), ("anchor", 2), ("qc", 1), ("qc", 2), ("mask", None), ("labels", None)} <= per_target
    mask = np.asarray(nib.load(next(f["path"] for f in out["files"] if f["kind"] == "mask")).dataobj)
    assert set(np.unique(mask)) <= {0, 1, 2}
    assert len([c for c in r.content if c.type == "image"]) == 2


def test_not_found_is_an_answer(agent, place, monkeypatch):
    monkeypatch.setattr(QwenVLGrounder, "_generate_text", lambda self, *a, **k: (ABSENT, {"new_tokens": 12}))
    r = call(agent, "segment_from_query", {"volume": str(place[0] / "ct.nii.gz"), "query": "the kidney cyst"})
    assert not r.is_error, r.content
    out = r.structured_content
    assert out["status"] == "not_found" and out["targets"][0]["found"] is False
    assert out["targets"][0]["key_slice"] is None and out["targets"][0]["boxes"] == []
    assert "mask" not in {f["kind"] for f in out["files"]}  # nothing to segment, no mask written
    assert "not found" in r.content[0].text
    assert any("NOT evidence" in n for n in out["notes"])  # the smoke model's "absent" proves nothing
    text = refusal(agent, "repropagate", {"job": out["job"]})
    assert "segment_from_query again" in text


# ---- cancel ----------------------------------------------------------------------------------------

def test_cancelling_the_call_cancels_the_worker_job(agent, place):
    seen = {}

    async def go():
        started = anyio.Event()

        async def progress(p, total, message):
            seen.setdefault("first", message)
            if message.startswith("ground"):
                started.set()

        async with Client(agent.mcp) as c:
            async with anyio.create_task_group() as tg:
                async def run():
                    await c.call_tool("segment_from_query", {"volume": str(place[0] / "ct.nii.gz"),
                                                             "query": "the spleen"}, progress_callback=progress)
                tg.start_soon(run)
                with anyio.fail_after(120):
                    await started.wait()
                job = seen["first"].split()[1].rstrip(":")  # "job ID: queued": the call's job id
                seen["status"] = (await c.call_tool("job_status", {"job": job})).structured_content
                tg.cancel_scope.cancel()
    done = agent.worker.requests_done
    anyio.run(go)
    assert seen["status"]["state"] == "running" and seen["status"]["stage"] in ("ground", "propagate")
    import time

    deadline = time.monotonic() + 60
    while agent.worker.status()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not agent.worker.status()["busy"]
    job = list(agent.jobs.values())[-1]
    assert job.state == "cancelled" and job.result is None
    assert agent.worker.requests_done == done + 1


# ---- refusals ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("volume, says", [
    ("/etc/passwd", "outside the folders"),
    ("{root}/../outside/secret.nii.gz", "outside the folders"),
    ("{root}/link.nii.gz", "outside the allowed folders"),  # refused by where the link leads, before opening
    ("{root}/linkdir/secret.nii.gz", "outside the allowed folders"),
    ("{root}/missing.nii.gz", "does not exist"),
    ("https://example.org/dicom-web/studies/1.2/series/1.2.3", "not a series on an allowed DICOMweb server"),
    ("file:///etc/passwd", "URL this server does not read"),
    ("", "must name"),
])
def test_volumes_outside_what_the_operator_allowed_are_refused(agent, place, volume, says):
    text = refusal(agent, "segment_from_query", {"volume": volume.format(root=place[0]), "query": "the liver"})
    assert says in text, text
    assert "secret" not in text or "secret" in volume  # a link's target is never named
    if says != "does not exist":
        assert str(place[0]) in text  # says what may be given instead


def test_describe_volume_reads_the_header_and_refuses_links(agent, place):
    r = call(agent, "describe_volume", {"volume": str(place[0] / "ct.nii.gz")})
    assert not r.is_error, r.content
    info = r.structured_content
    ct = nib.load(str(place[0] / "ct.nii.gz"))
    assert info["shape"] == list(ct.shape) and info["axial_slices"] == 8 and info["ct_like"] is True
    assert "symbolic link" in refusal(agent, "describe_volume", {"volume": str(place[0] / "link.nii.gz")})
    assert "outside the folders" in refusal(agent, "describe_volume", {"volume": "/etc/passwd"})


@pytest.mark.parametrize("name, args, says", [
    ("segment_from_query", {"volume": "{root}/ct.nii.gz", "query": "the liver", "consensus": 99}, "consensus"),
    ("segment_from_query", {"volume": "{root}/ct.nii.gz", "query": "x" * 5000}, "query"),
    ("segment_from_query", {"volume": "{root}/ct.nii.gz", "query": "the liver", "window": "nope"}, "window"),
    ("repropagate", {"job": "nope"}, "no job 'nope'"),
    ("job_status", {"job": "nope"}, "no job 'nope'"),
    ("list_series", {"server": "orthanc"}, "allowed: none"),
])
def test_fixable_inputs_are_one_sentence_tool_errors(agent, place, name, args, says):
    args = {k: v.format(root=place[0]) if isinstance(v, str) and "{root}" in v else v for k, v in args.items()}
    text = refusal(agent, name, args)
    assert says in text, text
    assert all(any(d.iterdir()) for d in agent.out_dir.iterdir())  # a refused job leaves no folder behind


def test_a_bad_correction_box_is_a_tool_error(segmented, agent):
    job = segmented[0].structured_content["job"]
    text = refusal(agent, "repropagate", {"job": job, "corrections": [{"slice": 99, "box": [1, 1, 5, 5]}]})
    assert "slice" in text


def test_models_that_cannot_load_are_a_protocol_error(agent, place, monkeypatch):
    from medvolcore.errors import ModelNotFoundError

    def missing(*a, **k):
        raise ModelNotFoundError("the weights of preset 'x' are not installed; run `medvol models download x`")

    monkeypatch.setattr(agent.worker, "_ensure_pipeline", missing)

    async def go():
        async with Client(agent.mcp) as c:
            with pytest.raises(MCPError) as e:
                await c.call_tool("segment_from_query", {"volume": str(place[0] / "ct.nii.gz"), "query": "the liver"})
            return e.value
    err = anyio.run(go)
    assert err.code == NOT_READY and "medvol models download" in err.message
