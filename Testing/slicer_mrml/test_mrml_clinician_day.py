"""The module in a clinician's working day, on real MRML (slicer-core): a scene closed while the
worker runs, Undo after an edit made in the segment, the input volume switched before
re-propagating, "Replace it" chosen and the query edited during the run, label maps and colour
volumes, the subject hierarchy, Segment Editor, Show 3D, the key slice in mm.

The worker is a :class:`ManualClient`: its jobs wait until the test answers them, with what the
real worker returns for the real label map (the anchor MedVolCore derives on its stack and the
mask on the exported file's grid), so the order of events (a scene closed *before* the answer
arrives) is the test's to choose."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - the real package, imported by conftest.py
import vtk  # noqa: E402
from test_mrml_logic import worker_result  # noqa: E402

KIDNEY_RIGHT, KIDNEY_LEFT, LIVER = 2, 3, 5  # TotalSegmentator v2 ids (class_map_total_v2.json)
SINGLE_FILE = 4


class ManualClient:
    """A worker client whose jobs stay queued until :meth:`answer` (or :meth:`fail`) is called.
    ``cancel`` is recorded and, like a worker that had already finished, does nothing."""

    running = True
    starts = 1

    def __init__(self, options=None):
        self.options = options
        self.jobs, self.cancelled, self.stopped = [], [], False

    def submit(self, op, **fields):
        from MedVolR1SlicerLib.client import Job

        job = Job(str(len(self.jobs) + 1), op, fields)
        self.jobs.append(job)
        if op == "load":
            job._finish({"preset": fields.get("preset")})
        return job

    def answer(self, job, result):
        job._finish(result)

    def poll(self, timeout=0.0):
        return 0

    def wait(self, job, timeout=None):
        return job

    def cancel(self, job):
        self.cancelled.append(job)

    def stop(self):
        self.stopped = True


@pytest.fixture
def client():
    return ManualClient()


@pytest.fixture
def manual(slicer_env, scene, client):
    """A module logic whose worker is ``client``."""
    from MedVolR1SlicerLib.session import Session

    lg = slicer_env.MedVolR1SlicerLogic(session=Session(client_factory=lambda options: client))
    yield lg
    lg.cleanup()


@pytest.fixture(scope="module")
def labels_ijk(seg_sm_path):
    import nibabel as nib

    return np.asarray(nib.load(str(seg_sm_path)).dataobj).astype(np.uint8)


@pytest.fixture
def tiny(slicer_env):
    from MedVolR1SlicerLib.session import Options

    return Options(preset="tiny", device="cpu")


def load_ct(path, name="CT"):
    node = slicer.modules.volumes.logic().AddArchetypeVolume(str(path), name, SINGLE_FILE)
    assert node is not None
    return node


_MASKS = itertools.count()


def answer_for(logic, volume_node, labels_ijk, label_ids, folder, query, name=None):
    """What the worker answers for ``label_ids`` of the real label map, on the exported file."""
    result, mask, _ = worker_result(logic, volume_node, labels_ijk, label_ids, folder,
                                    name=name or f"mask-{next(_MASKS)}.nii.gz", query=query)
    return result, mask


def kji(a):
    return np.ascontiguousarray(np.transpose(np.asarray(a), (2, 1, 0)))


def nodes_of(cls):
    return [slicer.mrmlScene.GetNthNodeByClass(i, cls) for i in range(slicer.mrmlScene.GetNumberOfNodesByClass(cls))]


def segment(manual, client, volume, query, labels_ijk, label_ids, folder, tiny, **kw):
    """Start a segment request for ``volume`` and answer it at once; returns the job."""
    p = manual.getParameterNode()
    p.inputVolume, p.query = volume, query
    job = manual.startSegment(p, tiny, **kw)
    result, _ = answer_for(manual, volume, labels_ijk, label_ids, folder, query)
    client.answer(job, result)
    assert job.state == "done", job.error
    return job


# ---- the scene closed while the worker runs ---------------------------------------------------

def test_a_result_that_arrives_after_the_scene_closed_never_reaches_the_next_patient(
        manual, client, ct_sm_path, labels_ijk, tmp_path, tiny):
    a = load_ct(ct_sm_path, "PatientA_CT")
    p = manual.getParameterNode()
    p.inputVolume, p.query = a, "the liver"
    finished = []
    job = manual.startSegment(p, tiny, onFinished=lambda j, notes: finished.append(j.state))
    result, _ = answer_for(manual, a, labels_ijk, [LIVER], tmp_path, "the liver")
    exported = job.request["volume"]

    slicer.mrmlScene.Clear(0)  # File > Close scene: the next patient
    assert client.cancelled == [job]  # the running request was cancelled
    assert not os.path.exists(exported)  # patient A's voxels are not left in the temporary folder
    b = load_ct(ct_sm_path, "PatientB_CT")
    assert b.GetID() == a.GetID()  # MRML gives the closed scene's IDs out again
    client.answer(job, result)  # the worker had finished before it saw the cancel

    assert finished == ["cancelled"] and "scene was closed" in job.error.message
    assert nodes_of("vtkMRMLSegmentationNode") == [] and nodes_of("vtkMRMLMarkupsROINode") == []
    p = manual.getParameterNode()
    assert (p.anchorJson, p.segmentId, p.keySlice, p.outputSegmentation) == ("", "", -1, None)
    assert not manual.canUndo


def test_a_result_whose_volume_was_removed_during_the_run_is_dropped(manual, client, ct_sm_path, labels_ijk,
                                                                    tmp_path, tiny):
    a = load_ct(ct_sm_path, "PatientA_CT")
    p = manual.getParameterNode()
    p.inputVolume, p.query = a, "the liver"
    job = manual.startSegment(p, tiny)
    result, _ = answer_for(manual, a, labels_ijk, [LIVER], tmp_path, "the liver")
    slicer.mrmlScene.RemoveNode(a)
    client.answer(job, result)
    assert job.state == "cancelled" and "volume was removed" in job.error.message
    assert nodes_of("vtkMRMLSegmentationNode") == []


# ---- Undo after an edit -----------------------------------------------------------------------

def test_undo_refuses_to_throw_away_an_edit_made_after_the_result(slicer_env, manual, client, ct_sm_path,
                                                                 labels_ijk, tmp_path, tiny):
    volume = load_ct(ct_sm_path)
    segment(manual, client, volume, "the liver", labels_ijk, [LIVER], tmp_path, tiny)
    p = manual.getParameterNode()
    seg, sid = p.outputSegmentation, p.segmentId
    assert manual.editedSinceResult() == 0
    painted = slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, volume).copy()
    painted[10:20, 10:30, 10:30] = 1  # the clinician paints in the Segment Editor
    added = int(painted.sum()) - int(slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, volume).sum())
    slicer.util.updateSegmentBinaryLabelmapFromArray(painted, seg, sid, volume)

    assert manual.editedSinceResult() == added > 0
    with pytest.raises(slicer_env.EditedSinceResult, match=f"{added} voxels changed"):
        manual.undoLastResult()
    np.testing.assert_array_equal(slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, volume), painted)  # kept
    assert manual.canUndo  # still possible, on purpose
    assert manual.undoLastResult(discardEdits=True)
    assert seg.GetSegmentation().GetSegment(sid) is None


def test_undo_of_a_replacement_restores_the_previous_mask_only_when_told_to_drop_later_edits(
        slicer_env, manual, client, ct_sm_path, labels_ijk, tmp_path, tiny):
    volume = load_ct(ct_sm_path)
    segment(manual, client, volume, "the liver", labels_ijk, [LIVER], tmp_path, tiny)
    p = manual.getParameterNode()
    seg, sid = p.outputSegmentation, p.segmentId
    liver = slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, volume).copy()
    segment(manual, client, volume, "the liver", labels_ijk, [KIDNEY_LEFT], tmp_path, tiny, replaceExisting=True)
    assert p.segmentId == sid and seg.GetSegmentation().GetNumberOfSegments() == 1
    assert manual.undoLastResult()  # nothing edited since: no question asked
    np.testing.assert_array_equal(slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, volume), liver)
    assert manual.canUndo and manual.undoLastResult()  # the first result too: Undo is as deep as the session
    assert seg.GetSegmentation().GetSegment(sid) is None and not manual.canUndo


# ---- the input volume switched ----------------------------------------------------------------

def test_boxes_stay_with_their_volume_when_the_input_volume_is_switched(slicer_env, manual, client, ct_sm_path,
                                                                       labels_ijk, tmp_path, tiny):
    a = load_ct(ct_sm_path, "PatientA_CT")
    b = load_ct(ct_sm_path, "PatientB_CT")
    segment(manual, client, a, "the liver", labels_ijk, [LIVER], tmp_path, tiny)
    p = manual.getParameterNode()
    seg, sid = p.outputSegmentation, p.segmentId
    before = slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, a).copy()
    p.boxes[0].SetSize(30, 30, 1)
    p.boxesEdited = True
    p.inputVolume = b
    assert "drawn on PatientA_CT" in manual.resultProblem(p)
    requests = len(client.jobs)
    with pytest.raises(ValueError, match="drawn on PatientA_CT, but the input volume is now PatientB_CT"):
        manual.startRepropagate(p, tiny)
    with pytest.raises(slicer_env.GeometryError, match="drawn on PatientA_CT"):
        manual.addBox(p)
    assert len(client.jobs) == requests  # nothing was sent to the worker
    np.testing.assert_array_equal(slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, a), before)

    # back on A, re-propagation goes to A's file and replaces A's segment
    p.inputVolume = a
    job, _ = manual.startRepropagate(p, tiny)
    assert job.request["volume"] == manual.exportVolume(a)
    result, _ = answer_for(manual, a, labels_ijk, [KIDNEY_RIGHT], tmp_path, "the liver")
    client.answer(job, result)
    assert job.state == "done" and p.segmentId == sid and seg.GetSegmentation().GetNumberOfSegments() == 1


def test_a_result_for_one_volume_never_goes_into_the_segmentation_of_another(manual, client, ct_sm_path, labels_ijk,
                                                                             tmp_path, tiny):
    a = load_ct(ct_sm_path, "PatientA_CT")
    b = load_ct(ct_sm_path, "PatientB_CT")
    segment(manual, client, a, "the liver", labels_ijk, [LIVER], tmp_path, tiny)
    p = manual.getParameterNode()
    seg_a = p.outputSegmentation
    notes = []
    p.inputVolume = b
    job = manual.startSegment(p, tiny, onFinished=lambda j, n: notes.extend(n))
    result, _ = answer_for(manual, b, labels_ijk, [LIVER], tmp_path, "the liver")
    client.answer(job, result)
    assert p.outputSegmentation is not seg_a and p.outputSegmentation.GetName() == "PatientB_CT MedVol"
    assert manual.referenceVolume(p.outputSegmentation) is b
    assert seg_a.GetSegmentation().GetNumberOfSegments() == 1
    assert any("belongs to PatientA_CT" in n for n in notes)


# ---- what was chosen at the start holds ------------------------------------------------------

def test_replace_chosen_at_the_start_holds_when_the_query_is_edited_during_the_run(manual, client, ct_sm_path,
                                                                                   labels_ijk, tmp_path, tiny):
    volume = load_ct(ct_sm_path)
    segment(manual, client, volume, "the liver", labels_ijk, [LIVER], tmp_path, tiny)
    p = manual.getParameterNode()
    seg, sid = p.outputSegmentation, p.segmentId
    assert manual.existingSegmentId(p) == sid  # "the liver" again: the panel asks Replace / Keep both
    job = manual.startSegment(p, tiny, replaceExisting=True)  # "Replace it"
    p.query = "the liver and the gallbladder"  # typed while the worker runs
    result, mask = answer_for(manual, volume, labels_ijk, [KIDNEY_LEFT], tmp_path, "the liver")
    client.answer(job, result)
    assert job.state == "done", job.error
    assert seg.GetSegmentation().GetNumberOfSegments() == 1 and p.segmentId == sid
    np.testing.assert_array_equal(slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, volume), kji(mask))


def test_the_output_chosen_at_the_start_holds_when_the_selector_changes_during_the_run(manual, client, ct_sm_path,
                                                                                      labels_ijk, tmp_path, tiny):
    volume = load_ct(ct_sm_path)
    chosen = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", "chosen")
    other = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", "other")
    p = manual.getParameterNode()
    p.inputVolume, p.query, p.outputSegmentation = volume, "the liver", chosen
    job = manual.startSegment(p, tiny)
    p.outputSegmentation = other
    result, _ = answer_for(manual, volume, labels_ijk, [LIVER], tmp_path, "the liver")
    client.answer(job, result)
    assert chosen.GetSegmentation().GetNumberOfSegments() == 1
    assert other.GetSegmentation().GetNumberOfSegments() == 0
    assert p.outputSegmentation is chosen


# ---- which volumes can be segmented ----------------------------------------------------------

def test_label_maps_and_colour_volumes_are_never_auto_selected_or_sent(slicer_env, manual, ct_sm_path, tiny):
    label = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLLabelMapVolumeNode", "labels")
    image = vtk.vtkImageData()
    image.SetDimensions(8, 8, 4)
    image.AllocateScalars(vtk.VTK_UNSIGNED_CHAR, 1)
    label.SetAndObserveImageData(image)
    colour = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLVectorVolumeNode", "photo")
    rgb = vtk.vtkImageData()
    rgb.SetDimensions(8, 8, 1)
    rgb.AllocateScalars(vtk.VTK_UNSIGNED_CHAR, 3)
    colour.SetAndObserveImageData(rgb)
    empty = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLScalarVolumeNode", "empty")
    assert manual.firstUsableVolume() is None  # the first scalar-class node is the label map
    assert "label map" in manual.volumeProblem(label)
    assert "several values per voxel" in manual.volumeProblem(colour)
    assert "no voxels" in manual.volumeProblem(empty)
    p = manual.getParameterNode()
    p.inputVolume, p.query = label, "the liver"
    with pytest.raises(ValueError, match="label map"):
        manual.startSegment(p, tiny)
    ct = load_ct(ct_sm_path, "CT")
    assert manual.firstUsableVolume() is ct and manual.volumeProblem(ct) == ""


# ---- the scene around the result -------------------------------------------------------------

def test_results_and_boxes_go_under_the_volumes_study(manual, client, ct_sm_path, labels_ijk, tmp_path, tiny):
    volume = load_ct(ct_sm_path, "CT")
    sh = slicer.vtkMRMLSubjectHierarchyNode.GetSubjectHierarchyNode(slicer.mrmlScene)
    patient = sh.CreateSubjectItem(sh.GetSceneItemID(), "Patient A")
    study = sh.CreateStudyItem(patient, "CT abdomen 2026-11-23")
    sh.CreateItem(study, volume)  # as Slicer's DICOM import files a series
    segment(manual, client, volume, "the kidneys", labels_ijk, [KIDNEY_RIGHT, KIDNEY_LEFT], tmp_path, tiny)
    p = manual.getParameterNode()
    assert sh.GetItemParent(sh.GetItemByDataNode(p.outputSegmentation)) == study
    assert len(p.boxes) == 2
    assert all(sh.GetItemParent(sh.GetItemByDataNode(b)) == study for b in p.boxes)
    added = manual.addBox(p)
    assert sh.GetItemParent(sh.GetItemByDataNode(added)) == study


def test_show_3d_edit_in_segment_editor_and_the_key_slice_in_mm(manual, client, ct_sm_path, labels_ijk, tmp_path,
                                                               tiny):
    volume = load_ct(ct_sm_path)
    p = manual.getParameterNode()
    with pytest.raises(ValueError, match="segment first"):
        manual.segmentEditorNode(p)
    assert manual.keySliceText(p) == "–"
    segment(manual, client, volume, "the liver", labels_ijk, [LIVER], tmp_path, tiny)
    seg = p.outputSegmentation

    assert manual.setShow3D(p, True)
    assert seg.GetSegmentation().ContainsRepresentation("Closed surface")
    assert not manual.setShow3D(p, False)
    assert not seg.GetSegmentation().ContainsRepresentation("Closed surface")

    editor = manual.segmentEditorNode(p)
    assert editor.GetSegmentationNode() is seg and editor.GetSelectedSegmentID() == p.segmentId
    assert editor.GetSourceVolumeNode() is volume
    assert slicer.mrmlScene.GetSingletonNode("SegmentEditor", "vtkMRMLSegmentEditorNode") is editor

    anchor = json.loads(p.anchorJson)
    s_mm = anchor["world"]["slice_center_ras"][2]
    geo = manual.geometry(volume)
    assert manual.keySliceText(p) == f"S {s_mm:.1f} mm (slice {anchor['slice'] + 1} of {geo.shape[geo.slice_axis]})"
    # Jump puts a slice view through that S
    slice_node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSliceNode")
    slice_node.SetLayoutName("Red")
    slice_node.SetOrientationToAxial()
    slice_node.JumpSliceByOffsetting(0, 0, s_mm + 50)
    assert manual.jumpToKeySlice(p)
    assert slicer.util.arrayFromVTKMatrix(slice_node.GetSliceToRAS())[2, 3] == pytest.approx(s_mm, abs=1e-3)


def test_a_deleted_box_is_left_out_of_the_next_re_propagation(manual, client, ct_sm_path, labels_ijk, tmp_path, tiny):
    volume = load_ct(ct_sm_path)
    segment(manual, client, volume, "the kidneys", labels_ijk, [KIDNEY_RIGHT, KIDNEY_LEFT], tmp_path, tiny)
    p = manual.getParameterNode()
    first, second = p.boxes
    slicer.mrmlScene.RemoveNode(first)
    assert p.boxes == [None, second]  # as Slicer's wrapper lists it once the node is gone
    anchor, _ = manual.anchorFromBoxes(p)
    assert len(anchor["world"]["boxes_ras"]) == 1
    added = manual.addBox(p)
    assert p.boxes == [second, added]
    slicer.mrmlScene.RemoveNode(second)
    slicer.mrmlScene.RemoveNode(added)
    with pytest.raises(ValueError, match="no box left"):
        manual.anchorFromBoxes(p)


def test_repropagate_blocking_replaces_the_segment_and_returns_the_users_anchor(manual, client, ct_sm_path,
                                                                                labels_ijk, tmp_path, tiny):
    volume = load_ct(ct_sm_path)
    segment(manual, client, volume, "the liver", labels_ijk, [LIVER], tmp_path, tiny)
    p = manual.getParameterNode()
    sid = p.segmentId
    result, mask = answer_for(manual, volume, labels_ijk, [KIDNEY_RIGHT], tmp_path, "the liver")
    client.wait = lambda job, timeout=None: (client.answer(job, dict(result, anchor=dict(
        result["anchor"], source="user"))), job)[1]
    seg, segment_id, boxes, anchor = manual.repropagateBlocking(tiny)
    assert segment_id == sid and seg.GetSegmentation().GetNumberOfSegments() == 1
    assert anchor["source"] == "user" and client.jobs[-1].op == "propagate"
    assert client.jobs[-1].request["anchor"]["source"] == "user"
    np.testing.assert_array_equal(slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, volume), kji(mask))


# ---- the self-test Slicer's build machines run -----------------------------------------------

def test_the_in_slicer_self_test_passes_with_its_stand_in_worker(slicer_env, scene, monkeypatch):
    test = slicer_env.MedVolR1SlicerTest()
    shown = []
    monkeypatch.setattr(test, "delayDisplay", lambda message, msec=None: shown.append(message), raising=False)
    test.setUp()
    test.test_module_with_selftest_worker()
    assert shown[-1] == "MedVol-R1 self-test (MRML side) passed"


def test_the_in_slicer_self_test_skips_the_worker_test_where_packages_are_missing(slicer_env, scene, monkeypatch):
    from MedVolR1SlicerLib import install

    class Needed:
        needed = True

    test = slicer_env.MedVolR1SlicerTest()
    shown, ran = [], []
    monkeypatch.setattr(test, "delayDisplay", lambda message, msec=None: shown.append(message), raising=False)
    monkeypatch.setattr(install, "current_plan", lambda *a, **k: Needed())
    monkeypatch.setattr(test, "test_segment_edit_repropagate", lambda: ran.append(1))
    test.runTest()
    assert ran == [] and any("Skipping the worker test" in m for m in shown)
    assert "MedVol-R1 self-test (MRML side) passed" in shown


def test_the_panel_hears_of_each_change_to_an_existing_segmentation_before_it_happens(
        manual, client, ct_sm_path, labels_ijk, tmp_path, tiny):
    """What lets Ctrl+Z in the Segment Editor take a result back: the panel saves the editor's
    undo state when told, and it is told *before* the segment changes (a new segmentation has no
    editor state to save)."""
    volume = load_ct(ct_sm_path)
    seen = []

    def before(seg):
        sid = manual.getParameterNode().segmentId
        present = seg.GetSegmentation().GetSegment(sid) is not None if sid else False
        seen.append((seg.GetName(), present and int(slicer.util.arrayFromSegmentBinaryLabelmap(seg, sid, volume).sum())))

    manual.beforeChange = before
    segment(manual, client, volume, "the liver", labels_ijk, [LIVER], tmp_path, tiny)
    assert seen == []  # a new segmentation: nothing to save
    p = manual.getParameterNode()
    liver = int(slicer.util.arrayFromSegmentBinaryLabelmap(p.outputSegmentation, p.segmentId, volume).sum())
    segment(manual, client, volume, "the liver", labels_ijk, [KIDNEY_LEFT], tmp_path, tiny, replaceExisting=True)
    assert seen == [("CT MedVol", liver)]  # told while the segment still held the liver
    manual.undoLastResult()
    assert len(seen) == 2 and seen[1][1] != liver  # and again before Undo restored it
