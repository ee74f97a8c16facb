"""A DICOM-SEG of a series the worker read from its own private copy (a ``--data-dir`` folder's
copy, a retrieved DICOMweb series): the record says it was read from a private copy the worker
owns (:attr:`medvolcore.dicomrecord.DicomRecord.private`), so the SEG is written after the copy
is gone; a volume served from the cache is served only when its record describes exactly the
instances of this request's bytes; a user's folder read on the CLI/stdio path keeps its check
that the files read are unchanged."""

from __future__ import annotations

import shutil

import numpy as np
import pydicom
import pytest

from core.probes import ANCHOR
from core.test_dicomrecord import UID, _seg, make_series
from core.worker_clients import HttpServer as ServeProcess
from medvolcore.errors import VolumeError
from medvolcore.serve.cache import StackCache

hd = pytest.importorskip("highdicom")


def _uids(path):
    seg = pydicom.dcmread(str(path))
    return seg.PatientName, {r.ReferencedSOPInstanceUID
                             for r in seg.ReferencedSeriesSequence[0].ReferencedInstanceSequence}


def test_a_private_copys_record_writes_its_seg_after_the_copy_is_gone(tmp_path):
    cache = StackCache()
    copy = make_series(tmp_path / "copy")
    stack, _, cached = cache.get_path(copy, digest="a" * 64, owned=True)
    assert not cached and stack.volume.dicom.private
    shutil.rmtree(copy)
    out = _seg(tmp_path, stack.volume)
    assert _uids(out) == ("Doe^Jane", {f"{UID}.1.{k}" for k in range(1, 6)})


def test_a_user_folder_keeps_its_unchanged_check(tmp_path):
    """Read without ``owned`` (the stdio worker's own hashed copy of a user's folder, or the CLI): not
    private; its record is never served to an owned read, nor an owned one to it."""
    cache = StackCache()
    user = make_series(tmp_path / "user")
    stack, digest, _ = cache.get_path(user, tmp_dir=tmp_path)
    assert stack.volume.dicom.private is False
    with pytest.raises(VolumeError, match="changed since it was read"):
        _seg(tmp_path, stack.volume)  # what it read was a copy, gone now: refused, as before
    cache.put(digest, stack)
    copy = make_series(tmp_path / "copy")
    again, _, cached = cache.get_path(copy, digest=digest, owned=True)
    assert not cached and again.volume.dicom.private


def test_a_cached_record_of_another_series_is_never_served(tmp_path):
    """Two patients' series with the same geometry: the cache entry of A under a key that B's request
    computes (a colliding or wrongly computed key) is not served: B is read again, and its SEG names B."""
    cache = StackCache()
    a = make_series(tmp_path / "a")
    b = make_series(tmp_path / "b", name="Roe^Richard", study=UID + ".9")
    stack_a, _, _ = cache.get_path(a, digest="k" * 64, owned=True)
    cache.put("k" * 64, stack_a)
    a2 = tmp_path / "a2"
    shutil.copytree(a, a2)  # the same bytes in another private copy: served from the cache
    assert cache.get_path(a2, digest="k" * 64, owned=True)[2] is True
    stack_b, _, cached = cache.get_path(b, digest="k" * 64, owned=True)
    assert not cached and cache.mismatches == 1
    for folder in (a, a2, b):
        shutil.rmtree(folder)
    assert _uids(_seg(tmp_path, stack_b.volume, "b.dcm")) == ("Roe^Richard", {f"{UID}.9.{k}" for k in range(1, 6)})


@pytest.mark.slow
def test_http_out_dcm_on_a_data_dir_series(tmp_path):
    """The worker's own job over HTTP, ``out: x.dcm`` on a ``--data-dir`` DICOM folder: the SEG
    references the series' instances and equals the mask; two patients' series, one after the
    other, each get their own."""
    from core.test_dicom_generated import dciodvfy_errors

    data, out = tmp_path / "data", tmp_path / "out"
    make_series(data / "a", n=8)
    make_series(data / "b", n=8, name="Roe^Richard", study=UID + ".9")
    out.mkdir()
    s = ServeProcess("--device", "cpu", "--preset", "tiny", "--data-dir", str(data), "--out-dir", str(out))
    try:
        for name, patient, study in (("a", "Doe^Jane", UID + ".1"), ("b", "Roe^Richard", UID + ".9")):
            _, r = s.request("POST", "/rpc", {"id": name, "op": "propagate", "volume": name,
                                              "anchor": dict(ANCHOR, slice=4, boxes=[[30, 30, 90, 80]]),
                                              "out": f"{name}.dcm"})
            assert r["ok"] is True, r
            assert r["result"]["mask_path"] == f"{name}.dcm"
            got = _uids(out / f"{name}.dcm")
            assert got == (patient, {f"{study}.{k}" for k in range(1, 9)})
            seg = hd.seg.segread(str(out / f"{name}.dcm"))
            uids = [pydicom.dcmread(str(f)).SOPInstanceUID for f in sorted((data / name).iterdir())]
            frames = seg.get_pixels_by_source_instance(source_sop_instance_uids=uids, segment_numbers=[1])[..., 0]
            assert int((frames > 0).sum()) == r["result"]["mask_voxels"] > 0
            assert dciodvfy_errors(out / f"{name}.dcm") == []
    finally:
        s.stop()
    assert np.all([f.is_file() for f in (data / "a").iterdir()])


@pytest.mark.slow
def test_mcp_writes_the_seg_of_an_allowed_dicom_folder(tmp_path):
    """``segment_from_query`` on a DICOM folder under an allowed folder: the DICOM-SEG is written by
    default, among the job's files; ``dicom_seg: false`` leaves it out."""
    anyio = pytest.importorskip("anyio")
    pytest.importorskip("mcp")
    from mcp import Client

    from medvolcore.agents.server import AgentServer, AgentSettings
    from medvolcore.serve.worker import WorkerSettings

    make_series(tmp_path / "allowed" / "series", n=8)
    server = AgentServer(AgentSettings(worker=WorkerSettings(preset="tiny", device="cpu", threads=1),
                                       roots=[tmp_path / "allowed"]))

    async def go():
        async with Client(server.mcp) as c:
            args = {"volume": str(tmp_path / "allowed" / "series"), "query": "the liver"}
            return [await c.call_tool("segment_from_query", args),
                    await c.call_tool("segment_from_query", dict(args, dicom_seg=False))]
    try:
        with_seg, without = anyio.run(go)
        assert not with_seg.is_error, with_seg.content
        files = {f["kind"]: f["path"] for f in with_seg.structured_content["files"]}
        assert "dicom_seg" in files
        assert _uids(files["dicom_seg"]) == ("Doe^Jane", {f"{UID}.1.{k}" for k in range(1, 9)})
        assert "dicom_seg" not in {f["kind"] for f in without.structured_content["files"]}
    finally:
        server.close()


def test_monailabel_says_why_a_seg_was_dropped(tmp_path):
    """A series no SEG can reference (its .dcm dropped with a note by the job): a 422 naming the
    reason, never a 500 or another file's bytes."""
    pytest.importorskip("starlette")
    from medvolcore.serve.monailabel import MonaiLabelApp, _Refused

    seg = tmp_path / "label.dcm"
    note = (f"out {seg} was not written: the source series is gantry-tilted (12.0°) and was resampled onto an "
            "orthogonal grid, so a DICOM Segmentation's frames cannot lie on its slices; the other outputs were")
    with pytest.raises(_Refused) as e:
        MonaiLabelApp._seg_answer(None, {"notes": [note]}, "liver", seg)
    assert e.value.status == 422 and "gantry-tilted" in str(e.value) and str(tmp_path) not in str(e.value)


def test_an_empty_mask_gives_a_seg(tmp_path):
    """MONAI Label asks an empty mask for a structure the model did not find: its SEG is written."""
    from medvolcore.dicomseg import save_dicom_seg
    from medvolcore.volume import load_volume

    ct = load_volume(make_series(tmp_path / "s"))
    out = save_dicom_seg(np.zeros(ct.shape, np.uint8), ct.affine, ct, tmp_path / "empty.dcm",
                         [{"name": "liver", "value": 1}], algorithm="MedVol test", version="0")
    assert pydicom.dcmread(str(out)).SegmentSequence[0].SegmentLabel == "liver"
