"""The module's logic and its headless batch on real MRML (slicer-core) against a real
``medvol serve --stdio`` with the tiny preset (random weights, CPU): segment → move a box →
re-propagate → undo → save; a result that cannot be applied; ``batch.py`` with a mixed
manifest (.seg.nrrd, .nii.gz, .nrrd, .nii outputs, DICOM inputs) and its exit codes."""

from __future__ import annotations

import json
import os

import nibabel as nib
import numpy as np
import pytest

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - the real package, imported by conftest.py

TIMEOUT = 300
SINGLE_FILE = 4


@pytest.fixture(scope="module")
def tiny(slicer_env):
    from MedVolR1SlicerLib.session import Options

    return Options(preset="tiny", device="cpu")


@pytest.fixture(scope="module")
def worker_logic(slicer_env):
    """One module logic, and so one worker process, for the tests of this file that need it."""
    lg = slicer_env.MedVolR1SlicerLogic()
    yield lg
    lg.cleanup()


def kji(a):
    return np.ascontiguousarray(np.transpose(np.asarray(a), (2, 1, 0)))


def load_node(path):
    node = slicer.modules.volumes.logic().AddArchetypeVolume(str(path), "CT", SINGLE_FILE)
    assert node is not None
    return node


def run(logic, job):
    logic.session.wait(job, TIMEOUT)
    return job


def test_segment_move_a_box_repropagate_undo_and_save(slicer_env, scene, worker_logic, tiny, ct_sm_path, tmp_path):
    logic = worker_logic
    volume = load_node(ct_sm_path)
    p = logic.getParameterNode()
    p.inputVolume, p.query, p.outputSegmentation, p.segmentId = volume, "the organ that secretes bile", None, ""

    job = run(logic, logic.startSegment(p, tiny))
    assert job.state == "done", job.error
    first = kji(nib.load(job.result["mask_path"]).dataobj)  # the worker's mask, read by nibabel
    seg, segment_id = p.outputSegmentation, p.segmentId
    segmentation = seg.GetSegmentation()
    assert segmentation.GetNumberOfSegments() == 1
    assert segmentation.GetSegment(segment_id).GetName() == "the organ that secretes bile"
    got = slicer.util.arrayFromSegmentBinaryLabelmap(seg, segment_id, volume)
    np.testing.assert_array_equal(got, first)
    assert 0 < int(first.sum()) < first.size
    anchor = json.loads(p.anchorJson)
    assert anchor["source"] == "grounder" and len(p.boxes) == len(anchor["boxes"]) >= 1
    geo = logic.geometry(volume)

    # the user drags the first box 3 voxels along the volume's first axis (i: patient left here)
    box = p.boxes[0]
    c = np.zeros(3)
    box.GetCenter(c)
    box.SetCenter(*(c + geo.to_ras([3, 0, 0]) - geo.to_ras([0, 0, 0])))
    job2, notes = logic.startRepropagate(p, tiny)
    run(logic, job2)
    assert job2.state == "done", job2.error
    assert job2.request["anchor"]["source"] == "user" and "boxes" not in job2.request["anchor"]
    moved = job2.result["anchor"]
    assert moved["source"] == "user" and moved["slice"] == anchor["slice"]
    # the stack's x runs patient right → left, against i of this RAS-stored file: 3 px less
    x0, y0, x1, y1 = anchor["boxes"][0]
    assert moved["boxes"][0] == [x0 - 3, y0, x1 - 3, y1]
    assert moved["boxes"][1:] == anchor["boxes"][1:]
    second = kji(nib.load(job2.result["mask_path"]).dataobj)
    assert p.segmentId == segment_id and segmentation.GetNumberOfSegments() == 1  # replaced, not added
    np.testing.assert_array_equal(slicer.util.arrayFromSegmentBinaryLabelmap(seg, segment_id, volume), second)
    assert not np.array_equal(first, second)  # the moved box changed the mask
    assert p.boxesEdited is False and json.loads(p.anchorJson)["source"] == "user"

    assert logic.undoLastResult()
    np.testing.assert_array_equal(slicer.util.arrayFromSegmentBinaryLabelmap(seg, segment_id, volume), first)

    # save as .seg.nrrd and read it back with Slicer's segmentation storage node
    path = tmp_path / "bile.seg.nrrd"
    logic.writeSegmentationFile(seg, str(path))
    back = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode")
    storage = slicer.vtkMRMLSegmentationStorageNode()
    storage.SetFileName(str(path))
    assert storage.ReadData(back)
    (back_id,) = [back.GetSegmentation().GetNthSegmentID(i) for i in range(back.GetSegmentation().GetNumberOfSegments())]
    assert back.GetSegmentation().GetSegment(back_id).GetName() == "the organ that secretes bile"
    np.testing.assert_array_equal(slicer.util.arrayFromSegmentBinaryLabelmap(back, back_id, volume), first)


def test_a_result_that_cannot_be_applied_fails_the_job_and_reaches_the_caller(
        slicer_env, scene, worker_logic, tiny, ct_sm_path):
    """The volume is cropped while the worker runs: the mask no longer fits. The job fails
    with the reason (the panel shows it), ``segmentBlocking`` raises it, and nothing is added."""
    logic = worker_logic
    volume = load_node(ct_sm_path)
    p = logic.getParameterNode()
    p.inputVolume, p.query, p.outputSegmentation, p.segmentId = volume, "the liver", None, ""
    seen = []
    job = logic.startSegment(p, tiny, onFinished=lambda j, notes: seen.append((j.state, j.error)))
    cropped = np.ascontiguousarray(slicer.util.arrayFromVolume(volume)[:-1])
    slicer.util.updateVolumeFromArray(volume, cropped)
    run(logic, job)
    assert job.state == "failed" and job.error.code == "apply_failed"
    assert "could not be put in the scene" in job.error.message and "voxels but the volume" in job.error.message
    assert seen == [("failed", job.error)]  # the panel's callback is told, with the reason
    assert p.outputSegmentation is None and slicer.mrmlScene.GetNodesByClass("vtkMRMLMarkupsROINode").GetNumberOfItems() == 0
    assert logic.session.state == "idle"

    # the blocking form raises instead of returning the previous result's values
    original = slicer_env.MedVolR1SlicerLogic.applyResult

    def broken(self, *a, **k):
        raise KeyError("a bug while applying")

    slicer_env.MedVolR1SlicerLogic.applyResult = broken
    try:
        with pytest.raises(slicer_env.WorkerError, match="KeyError"):
            logic.segmentBlocking(volume, "the liver", tiny, timeout=TIMEOUT)
    finally:
        slicer_env.MedVolR1SlicerLogic.applyResult = original


# ---- the headless batch ---------------------------------------------------------------------

@pytest.fixture
def batch(slicer_env):
    import batch as batch_module

    return batch_module


def _dicom_folder(ct_path, folder):
    """Three slices of the real CT as DICOM files (SimpleITK/GDCM writes them)."""
    import SimpleITK as sitk

    folder.mkdir()
    image = sitk.ReadImage(str(ct_path))
    for z in range(3):
        sitk.WriteImage(sitk.Cast(image[:, :, z], sitk.sitkInt16), str(folder / f"IM{z:04d}.dcm"))
    return folder


def test_batch_mixed_manifest_writes_each_format_and_reports_each_failure(batch, scene, worker_logic, ct_sm_path,
                                                                         tmp_path, capsys, slicer_env):
    dicom = _dicom_folder(ct_sm_path, tmp_path / "dicom_series")
    rows = [
        {"input": str(ct_sm_path), "query": "the organ that secretes bile", "output": "out/a.seg.nrrd"},
        {"input": str(ct_sm_path), "query": "the organ that secretes bile", "output": "out/b.nii.gz"},
        {"input": str(dicom), "query": "the liver", "output": "out/c.seg.nrrd"},
        {"input": str(dicom / "IM0001.dcm"), "query": "the liver", "output": "out/d.seg.nrrd"},
        {"input": str(ct_sm_path), "query": "the organ that secretes bile", "output": "out/e.nrrd"},
        {"input": str(ct_sm_path), "query": "the spleen (apply fails)", "output": "out/f.nii.gz"},
        {"input": str(ct_sm_path), "query": "the organ that secretes bile", "output": "out/g.nii"},
    ]
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    original = slicer_env.MedVolR1SlicerLogic.applyResult

    def apply_or_fail(self, p, volume, result, replaceSegment=False, target=None):
        if result["anchor"]["query"].endswith("(apply fails)"):
            return {}["a bug while applying"]  # an unexpected exception type, as a bug would raise
        return original(self, p, volume, result, replaceSegment, target=target)

    slicer_env.MedVolR1SlicerLogic.applyResult = apply_or_fail
    try:
        code = batch.main(["--manifest", str(manifest), "--preset", "tiny", "--device", "cpu", "--keep-going",
                           "--anchor-dir", str(tmp_path / "anchors")], logic=worker_logic)
    finally:
        slicer_env.MedVolR1SlicerLogic.applyResult = original
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "4 of 7 done" in out
    assert "(row 3)" in out and "needs Slicer's DICOM module" in out  # refused, with the reason
    assert "(row 4)" in out and "single DICOM file; give the folder" in out
    assert "(row 6)" in out and "could not be put in the scene: KeyError" in out
    out_dir = tmp_path / "out"
    assert sorted(os.listdir(out_dir)) == ["a.seg.nrrd", "b.nii.gz", "e.nrrd", "g.nii"]  # no partial files
    assert sorted(os.listdir(tmp_path / "anchors")) == ["a.row1.anchor.json", "b.row2.anchor.json", "e.row5.anchor.json",
                                                       "g.row7.anchor.json"]  # one name per row

    # each file is in the format its name asks for…
    head = {n: (out_dir / n).read_bytes()[:400] for n in os.listdir(out_dir)}
    assert head["b.nii.gz"][:2] == b"\x1f\x8b"
    assert head["e.nrrd"].startswith(b"NRRD") and b"Segment0_" not in head["e.nrrd"]
    assert head["a.seg.nrrd"].startswith(b"NRRD") and b"Segment0_" in (out_dir / "a.seg.nrrd").read_bytes()[:8000]
    assert head["g.nii"][344:348] == b"n+1\x00"  # an uncompressed NIfTI-1 file
    # …on the CT's grid, and all four hold the same mask (same query, same volume, greedy tiny model)
    ct = nib.load(str(ct_sm_path))
    masks = {}
    for name in ("b.nii.gz", "g.nii"):
        img = nib.load(str(out_dir / name))
        np.testing.assert_allclose(img.affine, ct.affine, atol=1e-4)
        masks[name] = kji(img.dataobj)
    volume = load_node(ct_sm_path)
    label = slicer.vtkMRMLLabelMapVolumeNode()
    storage = slicer.vtkMRMLVolumeArchetypeStorageNode()
    storage.SetFileName(str(out_dir / "e.nrrd"))
    assert storage.ReadData(label)
    masks["e.nrrd"] = slicer.util.arrayFromVolume(label).copy()
    seg = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode")
    seg_storage = slicer.vtkMRMLSegmentationStorageNode()
    seg_storage.SetFileName(str(out_dir / "a.seg.nrrd"))
    assert seg_storage.ReadData(seg)
    masks["a.seg.nrrd"] = slicer.util.arrayFromSegmentBinaryLabelmap(seg, seg.GetSegmentation().GetNthSegmentID(0), volume)
    ref = masks["a.seg.nrrd"]
    assert ref.shape == (30, 101, 122) and 0 < int(ref.sum()) < ref.size
    for name, m in masks.items():
        np.testing.assert_array_equal(m > 0, ref > 0, err_msg=name)
    # the batch left nothing behind in the scene but what this test added
    assert slicer.mrmlScene.GetNodesByClass("vtkMRMLMarkupsROINode").GetNumberOfItems() == 0


def test_batch_exits_with_its_code_whatever_happens(batch, scene, tmp_path, monkeypatch, capsys):
    exits = []
    monkeypatch.setattr(slicer.util, "exit", exits.append)
    assert batch.run_script(["--input", str(tmp_path / "missing.nii.gz"), "--query", "q",
                             "--output", str(tmp_path / "o.seg.nrrd")]) == 2
    assert "missing.nii.gz does not exist" in capsys.readouterr().err
    assert batch.run_script(["--input", "x"]) == 2  # argparse's own error
    monkeypatch.setattr(batch, "main", lambda argv: (_ for _ in ()).throw(MemoryError("out of memory")))
    assert batch.run_script([]) == 1
    assert "MemoryError: out of memory" in capsys.readouterr().err
    assert exits == [2, 2, 1]  # slicer.util.exit ran every time, so a headless Slicer always ends


def test_the_remote_worker_over_http_segments_into_mrml_and_closing_the_scene_drops_its_answer(
        slicer_env, scene, ct_sm_path, tmp_path):
    """A real ``medvol serve --http`` (tiny preset, token): the module's logic sends the volume,
    the reply's mask lands in a segment bit for bit; a second request whose scene is closed
    before the answer leaves the new scene empty."""
    import re
    import subprocess
    import sys
    import time

    from MedVolR1SlicerLib.session import Options

    token = "r" * 24
    (tmp_path / "token").write_text(token)
    proc = subprocess.Popen([sys.executable, "-m", "medvolcore.cli_serve", "--http", "--port", "0", "--threads", "1",
                             "--token-file", str(tmp_path / "token"), "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8")
    logic = slicer_env.MedVolR1SlicerLogic()
    try:
        port, deadline = None, time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            m = re.search(r"127\.0\.0\.1:(\d+)", proc.stdout.readline())
            port = int(m.group(1)) if m else None
        assert port, "the HTTP worker did not say where it listens"
        remote = Options(preset="tiny", device="cpu", worker="remote", remote_url=f"http://127.0.0.1:{port}",
                         remote_token=token)
        volume = load_node(ct_sm_path)
        p = logic.getParameterNode()
        p.inputVolume, p.query = volume, "the liver"
        job = logic.session.wait(logic.startSegment(p, remote), TIMEOUT)
        assert job.state == "done", job.error
        assert type(logic.session.client).__name__ == "RemoteWorker"
        reply = kji(nib.load(job.result["mask_path"]).dataobj)  # written locally from the reply
        got = slicer.util.arrayFromSegmentBinaryLabelmap(p.outputSegmentation, p.segmentId, volume)
        np.testing.assert_array_equal(got, reply)
        assert 0 < int(got.sum()) < got.size
        anchor = json.loads(p.anchorJson)
        assert len(p.boxes) == len(anchor["boxes"]) >= 1 and anchor["source"] == "grounder"

        p = logic.getParameterNode()
        p.inputVolume, p.query = volume, "the kidneys"
        job = logic.startSegment(p, remote)
        slicer.mrmlScene.Clear(0)
        load_node(ct_sm_path)
        logic.session.wait(job, TIMEOUT)
        assert job.state in ("cancelled", "failed") and job.state != "done"
        assert slicer.mrmlScene.GetNodesByClass("vtkMRMLSegmentationNode").GetNumberOfItems() == 0
        assert slicer.mrmlScene.GetNodesByClass("vtkMRMLMarkupsROINode").GetNumberOfItems() == 0
    finally:
        logic.cleanup()
        proc.terminate()
        proc.wait(30)


def test_corrections_on_several_slices_round_trip_through_the_real_worker(slicer_env, scene, worker_logic, tiny,
                                                                           ct_sm_path):
    """Add box here, points of both signs and a range, sent as ``medvol.anchor/2`` to the real worker:
    it parses the world-only prompts on its own stack, propagates them without encoding any slice
    again, and its answer lands in the segmentation with the prompts it ran placed back as nodes."""
    from test_mrml_corrections import red_view_on, voxel_ras

    logic = worker_logic
    volume = load_node(ct_sm_path)
    p = logic.getParameterNode()
    p.inputVolume, p.query, p.outputSegmentation, p.segmentId = volume, "the liver", None, ""
    job = run(logic, logic.startSegment(p, tiny))
    assert job.state == "done", job.error
    geo = logic.geometry(volume)
    k, n = p.keySliceIJK, len(p.boxes)
    if not 4 <= k < geo.depth - 4:
        pytest.skip(f"the tiny model's key slice {k} is too close to an edge for this test's corrections")
    # object 1 corrected three slices up (Add box here on the Red view, a + and a - point), a new
    # object from a box and a + point two slices down, and a range of the 9 slices around the key slice
    red_view_on(logic, voxel_ras(geo, k + 3, 40, 60))
    logic.addBoxHere(p)
    new = logic.chooseObject(p, 0)
    assert new == n + 1
    logic.addBoxHere(p, ras=voxel_ras(geo, k - 2, 50, 50))
    logic.addPoint(p, voxel_ras(geo, k + 3, 44, 62), positive=True, objectNumber=1)
    logic.addPoint(p, voxel_ras(geo, k + 3, 30, 70), positive=False, objectNumber=1)
    logic.addPoint(p, voxel_ras(geo, k - 2, 52, 49), positive=True, objectNumber=new)
    logic.setRangeEnd(p, "start", ras=geo.slice_center_ras(k - 4))
    logic.setRangeEnd(p, "end", ras=geo.slice_center_ras(k + 4))
    job2, notes = logic.startRepropagate(p, tiny)
    run(logic, job2)
    assert job2.state == "done", job2.error
    sent, ran = job2.request["anchor"], job2.result["anchor"]
    assert sent["schema"] == ran["schema"] == "medvol.anchor/2"
    assert [(q["object"], q["box"] is not None, [pt[2] for pt in q["points"]]) for q in ran["prompts"]] == [
        (1, True, [1, 0]), (new, True, [1])]
    assert all(q["world"]["box_ras"] for q in ran["prompts"])
    assert ran["z_range"][1] - ran["z_range"][0] == 8
    # every slice it visited had been encoded by the segment request: a correction round costs no encoding
    assert job2.result["slices_encoded"] == 0
    mask = kji(nib.load(job2.result["mask_path"]).dataobj)
    np.testing.assert_array_equal(
        slicer.util.arrayFromSegmentBinaryLabelmap(p.outputSegmentation, p.segmentId, volume), mask)
    outside = np.ones(geo.depth, bool)
    outside[ran["z_range"][0]:ran["z_range"][1] + 1] = False  # ct_sm is stored RAS: slice index k ↔ z = D-1-k
    assert not mask[outside[::-1]].any()
    assert len(p.corrections) == 2 and p.points.GetNumberOfControlPoints() == 3
