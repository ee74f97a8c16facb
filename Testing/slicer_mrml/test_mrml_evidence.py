"""Each segment keeps its own evidence, Undo as deep as the session, several queries in one
click: the scripted second day on real MRML (slicer-core). The worker is the
:class:`ManualClient` of ``test_mrml_clinician_day.py``, answering with what the real worker
returns for the real label map.

- "the liver", a correction box on another slice and a − point, then "the spleen": the liver
  keeps its boxes, correction box and point, and can still be re-propagated with them;
- the evidence finds its segment again after the scene is saved and reopened;
- Undo three results deep across queries and Redo, each step with the segment and its evidence;
- a scene imported beside a current result: Undo never reaches the other patient's segmentation;
- several queries, one of them not present: one request, one segment each, "not found" for that one;
- the panel's segment selector and the Segment Editor's selection choose whose evidence is shown.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from medvolcore.volume import load_volume, save_mask

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - the real package, imported by conftest.py
from test_mrml_clinician_day import (KIDNEY_LEFT, KIDNEY_RIGHT, LIVER, answer_for, client, kji,  # noqa: E402,F401
                                     labels_ijk, load_ct, manual, nodes_of, segment, tiny)
from test_mrml_second_day import make_panel, panel_module  # noqa: E402,F401  (fixture)

SPLEEN = 1  # TotalSegmentator v2


def save_bundle(folder):
    """Save the scene with its data as a ``.mrb`` holds it (the folder Slicer zips); returns the
    scene file."""
    folder.mkdir(parents=True, exist_ok=True)
    assert slicer.modules.volumes.logic().GetApplicationLogic().SaveSceneToSlicerDataBundleDirectory(str(folder), None)
    (mrml,) = folder.glob("*.mrml")
    return mrml


def import_scene(mrml, clear=True):
    """File > Load scene (``clear``), or a scene added beside the one open (what Add Data does with
    a ``.mrb`` once unzipped)."""
    if clear:
        slicer.mrmlScene.Clear(0)
    slicer.mrmlScene.SetURL(str(mrml))
    assert slicer.mrmlScene.Import()


def mask_of(p, volume):
    return slicer.util.arrayFromSegmentBinaryLabelmap(p.outputSegmentation, p.segmentId, volume).copy()


def liver_with_corrections(manual, client, volume, labels_ijk, tmp_path, tiny):
    """"the liver", then a correction box two slices above the key slice and a − point on it
    (not sent). Returns ``(segmentId, correction box, point position)``."""
    segment(manual, client, volume, "the liver", labels_ijk, [LIVER], tmp_path, tiny)
    p = manual.getParameterNode()
    geo, k = manual.geometry(volume), p.keySliceIJK
    box = manual.addBoxHere(p, objectNumber=1, sliceIndex=k + 2, ras=list(geo.slice_center_ras(k + 2)))
    where = [float(v) for v in geo.slice_center_ras(k + 2)]
    manual.addPoint(p, where, positive=False, objectNumber=1)
    assert p.boxesEdited
    return p.segmentId, box, where


def test_a_new_query_keeps_the_other_segments_evidence_and_it_can_still_be_repropagated(
        manual, client, ct_sm_path, labels_ijk, tmp_path, tiny):
    volume = load_ct(ct_sm_path)
    liver_id, box, where = liver_with_corrections(manual, client, volume, labels_ijk, tmp_path, tiny)
    p = manual.getParameterNode()
    seg = p.outputSegmentation
    liver_boxes = list(p.boxes)
    liver_anchor = json.loads(p.anchorJson)

    segment(manual, client, volume, "the spleen", labels_ijk, [SPLEEN], tmp_path, tiny)
    spleen_id = p.segmentId
    assert spleen_id != liver_id and json.loads(p.anchorJson)["query"] == "the spleen"
    assert p.corrections == [] and p.points is None  # the spleen has none of the liver's
    assert manual._inScene(box) and all(manual._inScene(b) for b in liver_boxes)  # nothing removed
    assert not box.GetDisplayNode().GetVisibility()  # another segment's evidence is not shown

    assert manual.selectSegment(p, seg, liver_id)  # the clinician selects the liver again
    assert p.segmentId == liver_id and p.boxes == liver_boxes and p.corrections == [box]
    assert json.loads(p.anchorJson) == liver_anchor and p.boxesEdited and box.GetDisplayNode().GetVisibility()
    assert p.points is not None and p.points.GetNthControlPointLabel(0) == "-1"
    assert not manual.resultProblem(p)

    job, _ = manual.startRepropagate(p, tiny)  # Re-propagate acts on the liver, with its corrections
    sent = job.request["anchor"]
    assert sent["query"] == "the liver" and sent["schema"] == "medvol.anchor/2"
    prompt = sent["prompts"][0]
    assert prompt["object"] == 1 and prompt["world"]["box_ras"]
    assert [pt[3] for pt in prompt["world"]["points_ras"]] == [0]  # the − point (label 0)
    result, mask = answer_for(manual, volume, labels_ijk, [LIVER, KIDNEY_RIGHT], tmp_path, "the liver")
    client.answer(job, result)
    assert job.state == "done", job.error
    assert p.segmentId == liver_id and seg.GetSegmentation().GetNumberOfSegments() == 2
    np.testing.assert_array_equal(mask_of(p, volume), kji(mask))
    assert manual.selectSegment(p, seg, spleen_id) and json.loads(p.anchorJson)["query"] == "the spleen"


def test_each_segments_evidence_survives_saving_and_reopening_the_scene(manual, client, ct_sm_path, labels_ijk,
                                                                      tmp_path, tiny):
    volume = load_ct(ct_sm_path)
    liver_id, box, _ = liver_with_corrections(manual, client, volume, labels_ijk, tmp_path, tiny)
    segment(manual, client, volume, "the spleen", labels_ijk, [SPLEEN], tmp_path, tiny)
    p = manual.getParameterNode()
    spleen_anchor = p.anchorJson
    corner = manual._getRoi(box).center.copy()
    import_scene(save_bundle(tmp_path / "day2"))
    p = manual.getParameterNode()
    seg = p.outputSegmentation
    assert seg is not None and p.anchorJson == spleen_anchor  # what the panel showed, shown again
    assert manual.selectSegment(p, seg, liver_id)
    assert json.loads(p.anchorJson)["query"] == "the liver" and p.boxesEdited
    (reopened,) = p.corrections
    np.testing.assert_allclose(manual._getRoi(reopened).center, corner, atol=1e-6)
    assert p.points.GetNthControlPointLabel(0) == "-1" and p.resultVolume is not None
    anchor, _ = manual.anchorFromBoxes(p)  # ready to re-propagate
    assert anchor["prompts"][0]["object"] == 1


def test_undo_is_as_deep_as_the_session_and_redo_puts_each_step_back_with_its_evidence(
        slicer_env, manual, client, ct_sm_path, labels_ijk, tmp_path, tiny):
    volume = load_ct(ct_sm_path)
    liver_id, box, _ = liver_with_corrections(manual, client, volume, labels_ijk, tmp_path, tiny)
    p = manual.getParameterNode()
    seg = p.outputSegmentation
    liver_first = mask_of(p, volume)
    # 2: re-propagate the liver with its corrections; 3: the spleen
    job, _ = manual.startRepropagate(p, tiny)
    result, _ = answer_for(manual, volume, labels_ijk, [LIVER, KIDNEY_RIGHT], tmp_path, "the liver")
    client.answer(job, result)
    liver_second = mask_of(p, volume)
    segment(manual, client, volume, "the spleen", labels_ijk, [SPLEEN], tmp_path, tiny)
    spleen_id = p.segmentId
    assert manual.undoDepth(p) == 3 and not manual.canRedo

    assert manual.undoLastResult()  # the spleen goes, with its evidence: nothing of it is shown
    assert seg.GetSegmentation().GetSegment(spleen_id) is None
    assert p.segmentId != spleen_id and "the spleen" not in p.anchorJson
    assert all("spleen" not in n.GetName() for n in nodes_of("vtkMRMLScriptedModuleNode"))

    assert manual.undoLastResult()  # the re-propagation: the first liver and the corrections as they were
    assert p.segmentId == liver_id
    np.testing.assert_array_equal(mask_of(p, volume), liver_first)
    assert len(p.corrections) == 1 and p.points.GetNthControlPointLabel(0) == "-1" and p.boxesEdited

    assert manual.undoLastResult()  # the liver itself: no segment, no evidence, nothing to re-propagate
    assert seg.GetSegmentation().GetNumberOfSegments() == 0
    assert p.anchorJson == "" and p.boxes == [] and p.corrections == [] and p.points is None
    assert "segment first" in manual.resultProblem(p)
    with pytest.raises(ValueError, match="segment first"):
        manual.startRepropagate(p, tiny)  # an undone segment cannot come back this way
    assert nodes_of("vtkMRMLMarkupsROINode") == [] and nodes_of("vtkMRMLMarkupsFiducialNode") == []
    assert not manual.canUndo and manual.undoDepth(p, undo=False) == 3

    assert manual.redoLastResult() and manual.redoLastResult()
    np.testing.assert_array_equal(mask_of(p, volume), liver_second)
    assert p.segmentId == liver_id and not p.boxesEdited  # the evidence that ran
    painted = mask_of(p, volume)
    painted[:3] = 1  # an edit in the Segment Editor after the Redo
    slicer.util.updateSegmentBinaryLabelmapFromArray(painted, seg, liver_id, volume)
    with pytest.raises(slicer_env.EditedSinceResult, match="voxels changed"):
        manual.undoLastResult()
    assert manual.redoLastResult()  # the spleen; Redo of another segment does not touch the edit
    assert manual.undoDepth(p) == 3 and json.loads(p.anchorJson)["query"] == "the spleen"
    segment(manual, client, volume, "the kidneys", labels_ijk, [KIDNEY_LEFT], tmp_path, tiny)
    assert not manual.canRedo and manual.undoDepth(p) == 4  # a new result ends what could be redone


def test_undo_never_reaches_another_patients_segmentation_an_imported_scene_included(
        manual, client, ct_sm_path, labels_ijk, tmp_path, tiny):
    a = load_ct(ct_sm_path, "PatientA_CT")
    segment(manual, client, a, "the liver", labels_ijk, [LIVER], tmp_path, tiny)
    bundle = save_bundle(tmp_path / "patientA")
    slicer.mrmlScene.Clear(0)

    b = load_ct(ct_sm_path, "PatientB_CT")
    segment(manual, client, b, "the spleen", labels_ijk, [SPLEEN], tmp_path, tiny)
    p = manual.getParameterNode()
    seg_b, spleen_id = p.outputSegmentation, p.segmentId
    unsent = manual.addBoxHere(p, objectNumber=1, sliceIndex=p.keySliceIJK + 1)  # not sent yet
    assert manual.canUndo
    import_scene(bundle, clear=False)  # patient A's scene added beside patient B's result
    p = manual.getParameterNode()
    assert p.outputSegmentation is not seg_b and "the liver" in p.anchorJson  # the panel shows patient A's
    assert not manual.canUndo  # no result of this session went into A's segmentation
    assert not manual.undoLastResult()
    assert seg_b.GetSegmentation().GetSegment(spleen_id) is not None  # B's result untouched
    assert manual.selectSegment(p, seg_b, spleen_id) and manual.canUndo  # back on B: B's own Undo
    assert p.corrections == [unsent] and p.boxesEdited  # and its correction, kept through the import
    assert manual.undoLastResult() and seg_b.GetSegmentation().GetSegment(spleen_id) is None


def several_answer(manual, volume, labels_ijk, tmp_path, queries, found):
    """A ``queries`` reply: ``found`` maps a query to its label ids; the others are absent."""
    ct = load_volume(manual.exportVolume(volume))
    labels = np.zeros(labels_ijk.shape, np.uint8)
    targets = []
    for k, query in enumerate(queries, start=1):
        if query not in found:
            targets.append({"label": k, "query": query, "absent": True, "mask_voxels": 0,
                            "anchor": {"schema": "medvol.anchor/3", "absent": True, "query": query,
                                       "reasoning": "no such organ in the field of view"}})
            continue
        single, mask = answer_for(manual, volume, labels_ijk, found[query], tmp_path, query)
        labels[(mask > 0) & (labels == 0)] = k
        targets.append({"label": k, "query": query, "absent": False, "anchor": single["anchor"],
                        "reasoning": "because", "mask_voxels": int(mask.sum()), "terminology": None})
    path = save_mask(labels, ct, tmp_path / "several.nii.gz")
    return {"queries": list(queries), "targets": targets, "mask_path": str(path), "absent": False, "notes": [],
            "smoke": False}, labels


def test_several_queries_one_request_one_segment_each_and_not_present_per_line(
        manual, client, ct_sm_path, labels_ijk, tmp_path, tiny):
    volume = load_ct(ct_sm_path)
    p = manual.getParameterNode()
    p.inputVolume = volume
    p.query = "the liver\n\n  the appendix \nthe spleen\nThe liver"  # a blank line and a repeat left out
    assert manual.existingSegmentId(p) == ""  # several queries: each adds its own segment
    notes = []
    job = manual.startSegment(p, tiny, onFinished=lambda j, n: notes.extend(n))
    queries = ["the liver", "the appendix", "the spleen"]
    assert len(client.jobs) == 2 and job.request["queries"] == queries and "query" not in job.request
    result, labels = several_answer(manual, volume, labels_ijk, tmp_path, queries,
                                    {"the liver": [LIVER], "the spleen": [SPLEEN]})
    client.answer(job, result)
    assert job.state == "done", job.error

    seg = p.outputSegmentation
    segmentation = seg.GetSegmentation()
    names = [segmentation.GetNthSegment(i).GetName() for i in range(segmentation.GetNumberOfSegments())]
    assert names == ["the liver", "the spleen"]
    assert any(n.startswith("Not found in this CT: the appendix") and "field of view" in n for n in notes)
    assert not any("the liver." in n or "the spleen." in n for n in notes if n.startswith("Not found"))
    assert p.segmentId == segmentation.GetSegmentIdBySegmentName("the liver")  # the first is shown
    for name, k in (("the liver", 1), ("the spleen", 3)):
        sid = segmentation.GetSegmentIdBySegmentName(name)
        assert manual.selectSegment(p, seg, sid) and json.loads(p.anchorJson)["query"] == name
        np.testing.assert_array_equal(mask_of(p, volume), kji(labels == k))
        assert len(p.boxes) >= 1
    assert manual.undoDepth(p) == 1 and manual.undoLastResult()  # one click, one step
    assert segmentation.GetNumberOfSegments() == 0 and p.anchorJson == ""


def test_the_panel_and_the_segment_editor_select_whose_evidence_is_shown(
        slicer_env, scene, panel_module, client, ct_sm_path, labels_ijk, tmp_path, tiny):
    from MedVolR1SlicerLib.session import Session

    widget = make_panel(panel_module, slicer_env.MedVolR1SlicerLogic(session=Session(client_factory=lambda o: client)))
    try:
        logic, ui = widget.logic, widget.ui
        volume = load_ct(ct_sm_path)
        liver_id, box, _ = liver_with_corrections(logic, client, volume, labels_ijk, tmp_path, tiny)
        segment(logic, client, volume, "the spleen", labels_ijk, [SPLEEN], tmp_path, tiny)
        p = logic.getParameterNode()
        seg, spleen_id = p.outputSegmentation, p.segmentId
        assert ui.segmentComboBox.items == [("the liver", liver_id), ("the spleen", spleen_id)]
        assert ui.segmentComboBox.currentIndex == 1 and not ui.repropagateButton.enabled

        # the clinician selects the liver in the Segment Editor (its module node, as its widget sets it)
        editor = slicer.vtkMRMLSegmentEditorNode()
        editor.SetSingletonTag("SegmentEditor")
        editor = slicer.mrmlScene.AddNode(editor)
        editor.SetAndObserveSegmentationNode(seg)
        editor.SetSelectedSegmentID(liver_id)
        assert p.segmentId == liver_id and ui.segmentComboBox.currentIndex == 0
        assert "the liver" in p.anchorJson and p.corrections == [box]
        assert ui.repropagateButton.enabled and ui.rangeLabel.text == "whole volume"  # its unsent corrections
        assert ui.reasoningEdit.toPlainText() == "because" and ui.keySliceLabel.text.startswith("S ")
        editor.SetMaskMode(editor.GetMaskMode())
        editor.Modified()  # another change of the editor is not a selection
        widget.onSegmentChosen(1)  # the panel's selector: the spleen again
        assert p.segmentId == spleen_id and not ui.repropagateButton.enabled
        editor.Modified()
        assert p.segmentId == spleen_id

        widget.onUndoButton()  # the spleen goes: nothing of it stays on screen
        assert seg.GetSegmentation().GetSegment(spleen_id) is None
        assert ui.keySliceLabel.text == "–" and ui.reasoningEdit.toPlainText() == ""
        assert not ui.repropagateButton.enabled and not ui.addBoxButton.enabled
        assert ui.segmentComboBox.items == [("the liver", liver_id)] and ui.segmentComboBox.currentIndex == -1
        assert ui.undoButton.enabled and ui.redoButton.enabled
        assert widget.ui.statusLabel.text == "Taken back: the spleen."
    finally:
        widget.cleanup()
