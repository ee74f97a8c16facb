"""Correcting a result anywhere in the volume, on real MRML (slicer-core): Add box here on slices
the Red view shows, positive and negative points, a slice range, and what Re-propagate sends
(``medvol.anchor/2`` in world form, or exactly the ``/1`` anchor when there is nothing to
correct); the limits refused before anything is sent; the prompts that ran put back as nodes;
correction nodes removed by a new result and by closing the scene; labels and attributes kept
through a saved scene.

The volume is the real CT with its slice axis first, turned 20° about A and 10° about S (an
oblique, permuted grid), so every RAS value is checked against a non-trivial IJK→RAS. The
worker is :class:`ManualClient`; its answer to a ``/2`` propagate is the anchor it ran, as the
real worker returns it: the pixel form on MedVolCore's stack and the world form of each prompt."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
from medvolcore.anchor import EvidenceAnchor
from medvolcore.stack import AxialStack
from medvolcore.volume import load_volume

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - the real package, imported by conftest.py
from test_mrml_clinician_day import LIVER, client, manual, nodes_of  # noqa: E402,F401  (fixtures)
from test_mrml_logic import load_node, variant, worker_result  # noqa: E402

V2 = "medvol.anchor/2"


@pytest.fixture(scope="module")
def oblique(ct_sm_path, seg_sm_path, tmp_path_factory):
    """The real CT and its labels stored with permuted axes and obliquely (files, labels in IJK)."""
    ct, seg = nib.load(str(ct_sm_path)), nib.load(str(seg_sm_path))
    arr, aff = variant(np.asarray(ct.dataobj).astype(np.int16), ct.affine, "oblique_permuted")
    lab, _ = variant(np.asarray(seg.dataobj).astype(np.uint8), ct.affine, "oblique_permuted")
    folder = tmp_path_factory.mktemp("oblique")
    path = folder / "ct.nii.gz"
    nib.save(nib.Nifti1Image(np.ascontiguousarray(arr), aff), str(path))
    return path, np.ascontiguousarray(lab)


@pytest.fixture
def tiny(slicer_env):
    from MedVolR1SlicerLib.session import Options

    return Options(preset="tiny", device="cpu")


def segmented(manual, client, oblique, tmp_path, tiny):
    """The oblique CT loaded and segmented (the liver); returns the volume and its geometry."""
    path, labels = oblique
    volume = load_node(path)
    p = manual.getParameterNode()
    p.inputVolume, p.query = volume, "the liver"
    job = manual.startSegment(p, tiny)
    result, _, _ = worker_result(manual, volume, labels, [LIVER], tmp_path, name="seg.nii.gz")
    client.answer(job, result)
    assert job.state == "done", job.error
    return volume, manual.geometry(volume)


def red_view_on(manual, ras):
    """The Red (axial) slice view centred on ``ras``, as scrolling and panning there would."""
    node = manual.redSliceNode()
    if node is None:
        node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSliceNode")
        node.SetLayoutName("Red")
        node.SetOrientationToAxial()
    node.JumpSliceByCentering(*[float(v) for v in ras])
    return node


def voxel_ras(geo, k, a0, a1):
    """RAS of the voxel on slice k at in-plane IJK indices (a0, a1), plus an offset under half a voxel."""
    v = np.zeros(3)
    v[geo.slice_axis] = k
    v[geo.inplane_axes[0]], v[geo.inplane_axes[1]] = a0, a1
    return geo.to_ras(v + np.array([0.3, -0.35, 0.2]))


def stack_of(manual, volume):
    return AxialStack(load_volume(manual.exportVolume(volume)))


def to_stack(stack, ras):
    """The stack voxel (z, y, x) of a RAS point that must be a voxel centre."""
    zyx = stack.ras_to_stack(np.asarray(ras, dtype=float))
    np.testing.assert_allclose(zyx, np.rint(zyx), atol=1e-4)
    return [int(v) for v in np.rint(zyx)]


def ran_anchor(stack, sent):
    """What the worker returns for an anchor it propagated: ``/1`` fields on its stack, and for a
    ``/2`` anchor each prompt in pixel and world form and ``z_range`` with its world form."""
    a = EvidenceAnchor.from_world(sent["world"], stack, query=sent.get("query", ""), reasoning="ran",
                                  source="user").to_dict()
    if sent["schema"] != V2:
        return a
    a["schema"] = V2
    prompts = []
    for pr in sent.get("prompts", []):
        w = pr["world"]
        out = {"object": pr["object"], "box": None, "points": []}
        zs = []
        if w["box_ras"] is not None:
            (z0, y0, x0), (z1, y1, x1) = (to_stack(stack, c) for c in w["box_ras"])
            out["box"] = [x0, y0, x1, y1]
            zs.append(z0)
        for r, aa, s, label in w["points_ras"]:
            z, y, x = to_stack(stack, [r, aa, s])
            out["points"].append([x, y, label])
            zs.append(z)
        assert len(set(zs)) == 1
        z = out["slice"] = zs[0]
        b = out["box"]
        out["world"] = {
            "box_ras": None if b is None else [[float(v) for v in stack.stack_to_ras([z, b[1], b[0]])],
                                               [float(v) for v in stack.stack_to_ras([z, b[3], b[2]])]],
            "points_ras": [[float(v) for v in stack.stack_to_ras([z, y, x])] + [lab] for x, y, lab in out["points"]]}
        prompts.append(out)
    if prompts:
        a["prompts"] = prompts
    if "z_range_ras" in sent["world"]:
        zr = sorted(to_stack(stack, e)[0] for e in sent["world"]["z_range_ras"])
        a["z_range"] = zr
        a["world"]["z_range_ras"] = [[float(v) for v in stack.stack_to_ras([z, 10, 10])] for z in zr]
    return a


def correct(manual, geo, k):
    """A clinician's corrections: a box for object 1 three slices above the key slice (Red view),
    a new object with a box two slices below, a + and a - point of object 1 on the first of
    these slices, a + point of the new object on its slice, a - point of object 1 on the key
    slice, and a range from two slices below the new box to four above the key slice."""
    p = manual.getParameterNode()
    up, down = k + 3, k - 2
    assert p.correctionObject == 1  # after a result the first object is chosen
    red_view_on(manual, voxel_ras(geo, up, 40, 60))
    box1 = manual.addBoxHere(p)
    assert manual.chooseObject(p, 0) == 2  # "New object": numbered now
    box2 = manual.addBoxHere(p, ras=voxel_ras(geo, down, 50, 50))
    manual.addPoint(p, voxel_ras(geo, up, 44, 62), positive=True, objectNumber=1)
    manual.setNegativePoints(p, True)
    manual.addPoint(p, voxel_ras(geo, up, 30, 70), objectNumber=1)  # the panel's sign: negative
    manual.setNegativePoints(p, False)
    manual.addPoint(p, voxel_ras(geo, down, 52, 49), objectNumber=2)
    manual.addPoint(p, voxel_ras(geo, k, 35, 35), positive=False, objectNumber=1)
    red_view_on(manual, geo.slice_center_ras(down - 2))
    manual.setRangeEnd(p, "start")
    manual.setRangeEnd(p, "end", ras=geo.slice_center_ras(up + 1))
    return box1, box2


# ---- what Re-propagate sends -----------------------------------------------------------------

def test_corrections_on_several_slices_are_sent_as_a_v2_world_anchor(manual, client, oblique, tmp_path, tiny):
    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    k = p.keySliceIJK
    assert geo.slice_axis == 0 and 3 <= k < geo.depth - 5  # the permuted grid: slices along i
    box1, box2 = correct(manual, geo, k)
    assert p.corrections == [box1, box2] and len(p.boxes) == 1 and p.boxesEdited
    assert (box1.GetAttribute("MedVolR1.object"), box1.GetAttribute("MedVolR1.slice")) == ("1", str(k + 3))
    assert (box2.GetAttribute("MedVolR1.object"), box2.GetAttribute("MedVolR1.slice")) == ("2", str(k - 2))
    points = p.points
    assert points.GetName() == "MedVol points"
    labels = [points.GetNthControlPointLabel(i) for i in range(points.GetNumberOfControlPoints())]
    assert labels == ["+1", "-1", "+2", "-1"]
    assert manual.sliceRange(p) == (k - 4, k + 4)
    assert manual.rangeText(p).startswith("slices ") and " mm)" in manual.rangeText(p)
    assert [n for _, n in manual.objectChoices(p)] == [1, 2, 0]

    job, notes = manual.startRepropagate(p, tiny)
    sent = job.request["anchor"]
    assert job.op == "propagate" and sent["schema"] == V2 and sent["source"] == "user"
    assert "boxes" not in sent and "slice" not in sent  # world form only
    stack = stack_of(manual, volume)
    z = geo.stack_z
    # the key-slice box is the /1 part, unchanged
    v1 = json.loads(p.anchorJson)
    np.testing.assert_allclose(sent["world"]["boxes_ras"], v1["world"]["boxes_ras"], atol=1e-4)
    # prompts: one per object and slice, in the worker's pixel form on its own stack
    ran = ran_anchor(stack, sent)
    got = [(q["object"], q["slice"], q["box"] is not None, [pt[2] for pt in q["points"]]) for q in ran["prompts"]]
    assert got == [(1, z(k + 3), True, [1, 0]), (1, z(k), False, [0]), (2, z(k - 2), True, [1])]
    for q, kk, (c0, c1) in ((ran["prompts"][0], k + 3, (40, 60)), (ran["prompts"][2], k - 2, (50, 50))):
        x0, y0, x1, y1 = q["box"]
        ijk = stack.stack_to_source_index([[q["slice"], y0, x0], [q["slice"], y1, x1]])
        lo, hi = geo.box_around(kk, voxel_ras(geo, kk, c0, c1))
        np.testing.assert_array_equal(ijk.min(axis=0), lo)
        np.testing.assert_array_equal(ijk.max(axis=0), hi)
    # points: the voxel each was placed in, at its centre (RAS checked against IJK→RAS)
    sent_points = [pt for q in sent["prompts"] for pt in q["world"]["points_ras"]]
    for (r, a, s, label), (kk, c0, c1) in zip(sent_points, [(k + 3, 44, 62), (k + 3, 30, 70), (k, 35, 35),
                                                           (k - 2, 52, 49)]):
        want = np.zeros(3)
        want[geo.slice_axis], want[geo.inplane_axes[0]], want[geo.inplane_axes[1]] = kk, c0, c1
        np.testing.assert_allclose([r, a, s], geo.to_ras(want), atol=1e-6)
        np.testing.assert_allclose([r, a, s], nib.affines.apply_affine(nib.load(str(oblique[0])).affine, want),
                                   atol=1e-3)
    # the nodes were snapped where they will be used: the points sit on their voxel centres
    placed = [points.GetNthControlPointPositionWorld(i) for i in range(points.GetNumberOfControlPoints())]
    np.testing.assert_allclose(sorted(map(tuple, placed)), sorted(tuple(pt[:3]) for pt in sent_points), atol=1e-6)
    # the range: both end slices, the smaller stack z first
    assert ran["z_range"] == sorted([z(k - 4), z(k + 4)])
    assert [to_stack(stack, e)[0] for e in sent["world"]["z_range_ras"]] == ran["z_range"]
    assert notes == []


def test_without_corrections_re_propagate_sends_exactly_the_v1_anchor(manual, client, oblique, tmp_path, tiny):
    from MedVolR1SlicerLib.geometry import anchor_from_rois

    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    c = [0.0, 0.0, 0.0]
    p.boxes[0].GetCenter(c)
    p.boxes[0].SetCenter(*(np.array(c) + geo.to_ras([0, 2, 1]) - geo.to_ras([0, 0, 0])))
    want, _ = anchor_from_rois(geo, [manual._getRoi(n) for n in p.boxes], p.keySliceIJK, query="the liver",
                               reasoning="because")
    job, _ = manual.startRepropagate(p, tiny)
    assert job.request["anchor"] == want and want["schema"] == "medvol.anchor/1"
    assert set(want) == {"schema", "world", "query", "reasoning", "source"}

    # corrections made, then cleared: /1 again
    correct(manual, geo, p.keySliceIJK)
    assert manual.anchorFromBoxes(p)[0]["schema"] == V2
    assert manual.clearCorrections(p)
    assert nodes_of("vtkMRMLMarkupsFiducialNode") == [] and len(nodes_of("vtkMRMLMarkupsROINode")) == 1
    assert (p.corrections, p.points, p.rangeStart, p.rangeEnd) == ([], None, -1, -1)
    assert manual.anchorFromBoxes(p)[0] == want


def test_the_limits_are_refused_before_anything_is_sent(manual, client, oblique, tmp_path, tiny):
    from MedVolR1SlicerLib.corrections import MAX_OBJECTS, MAX_PROMPTS
    from MedVolR1SlicerLib.geometry import GeometryError

    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    k = p.keySliceIJK
    sent = len(client.jobs)
    for n in range(2, MAX_OBJECTS + 1):  # 7 new objects: 8 in all
        assert manual.chooseObject(p, 0) == n
        manual.addBoxHere(p, ras=geo.slice_center_ras(k + 1))
    with pytest.raises(GeometryError, match=f"{MAX_OBJECTS} objects already"):
        manual.chooseObject(p, 0)
    manual.startRepropagate(p, tiny)  # 8 objects go
    assert len(client.jobs) == sent + 1
    # a ninth object made anyway (a point labelled by hand): refused with a message, nothing sent
    manual.pointsNode(p).AddControlPoint(*geo.slice_center_ras(k + 2), "+9")
    with pytest.raises(ValueError, match=f"9 objects: at most {MAX_OBJECTS}"):
        manual.startRepropagate(p, tiny)
    assert len(client.jobs) == sent + 1
    manual.clearCorrections(p)
    # more than 64 prompts: one point per object and slice
    for kk in range(geo.depth):
        for obj in (1, 2, 3):
            if kk != k:
                manual.addPoint(p, geo.slice_center_ras(kk), positive=True, objectNumber=obj)
    assert 3 * (geo.depth - 1) > MAX_PROMPTS
    with pytest.raises(ValueError, match=f"corrections \\(one per object and slice\\): at most {MAX_PROMPTS}"):
        manual.startRepropagate(p, tiny)
    manual.clearCorrections(p)
    # a range with one end, and one that leaves out the key slice
    manual.setRangeEnd(p, "start", ras=geo.slice_center_ras(k + 1))
    assert manual.rangeText(p).startswith("start: slice ")
    with pytest.raises(ValueError, match="no end slice"):
        manual.startRepropagate(p, tiny)
    manual.setRangeEnd(p, "end", ras=geo.slice_center_ras(k + 3))
    with pytest.raises(ValueError, match="the key slice, slice .* lies outside the slice range"):
        manual.startRepropagate(p, tiny)
    # a point renamed by hand
    manual.clearRange(p)
    manual.pointsNode(p).AddControlPoint(*geo.slice_center_ras(k), "liver")
    with pytest.raises(ValueError, match="labelled 'liver'"):
        manual.startRepropagate(p, tiny)
    assert len(client.jobs) == sent + 1


def test_add_box_here_rules_and_a_switched_volume(manual, client, oblique, tmp_path, tiny, monkeypatch):
    from MedVolR1SlicerLib.geometry import GeometryError

    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    k = p.keySliceIJK
    with monkeypatch.context() as m:
        m.setattr(manual, "redSliceNode", lambda: None)  # a layout without the Red view
        with pytest.raises(GeometryError, match="no Red"):
            manual.addBoxHere(p)
    red_view_on(manual, geo.slice_center_ras(k))
    with pytest.raises(GeometryError, match="object 1 already has its box on the key slice"):
        manual.addBoxHere(p)
    manual.chooseObject(p, 0)
    key2 = manual.addBoxHere(p)  # a new object on the key slice: a key-slice box, as Add box made
    assert p.boxes[-1] is key2 and p.corrections == [] and key2.GetAttribute("MedVolR1.object") == "2"
    red_view_on(manual, geo.slice_center_ras(k + 2))
    manual.addBoxHere(p)
    with pytest.raises(GeometryError, match="object 2 already has a box on slice"):
        manual.addBoxHere(p)
    manual.chooseObject(p, 1)
    manual.addBoxHere(p)  # another object may have a box there
    assert [manual.nodeObject(n) for n in p.corrections] == [2, 1]
    red_view_on(manual, np.array(geo.slice_center_ras(geo.depth - 1)) + 500 * np.array([0.0, 0.0, 1.0]))
    with pytest.raises(GeometryError, match="shows no slice of"):
        manual.setRangeEnd(p, "start")
    # a correction box dragged off its slice goes back onto the slice it was made on
    moved = p.corrections[0]
    c = [0.0, 0.0, 0.0]
    moved.GetCenter(c)
    moved.SetCenter(*(np.array(c) + geo.to_ras([2, 0, 0]) - geo.to_ras([0, 0, 0])))
    _, notes = manual.anchorFromBoxes(p)
    assert any("object 2" in n and "moved off its slice" in n for n in notes)
    moved.GetCenter(c)
    assert geo.slice_of(c) == k + 2
    # another volume selected: the corrections stay with theirs, nothing can be added
    other = load_node(oblique[0])
    p.inputVolume = other
    for act in (lambda: manual.addBoxHere(p, ras=geo.slice_center_ras(k)),
                lambda: manual.addPoint(p, geo.slice_center_ras(k)),
                lambda: manual.setRangeEnd(p, "end", ras=geo.slice_center_ras(k)),
                lambda: manual.startPlacingPoints(p)):
        with pytest.raises(GeometryError, match="drawn on CT, but the input volume is now CT"):
            act()


def test_the_prompts_that_ran_come_back_as_nodes_and_a_new_result_removes_them(manual, client, oblique, tmp_path,
                                                                              tiny):
    path, labels = oblique
    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    sh = slicer.vtkMRMLSubjectHierarchyNode.GetSubjectHierarchyNode(slicer.mrmlScene)
    study = sh.CreateStudyItem(sh.CreateSubjectItem(sh.GetSceneItemID(), "Patient"), "Study")
    sh.CreateItem(study, volume)  # as Slicer's DICOM import files a series
    p = manual.getParameterNode()
    k = p.keySliceIJK
    old = correct(manual, geo, k)
    old_points = p.points
    job, _ = manual.startRepropagate(p, tiny)
    sent = job.request["anchor"]
    result, _, _ = worker_result(manual, volume, labels, [LIVER], tmp_path, name="ran.nii.gz")
    result["anchor"] = ran_anchor(stack_of(manual, volume), sent)
    client.answer(job, result)
    assert job.state == "done", job.error

    # what ran is what the panel shows: new nodes from the returned prompts' world form
    assert all(n.GetScene() is None for n in old) and old_points.GetScene() is None
    assert len(p.corrections) == 2 and not p.boxesEdited
    for node, q in zip(p.corrections, [q for q in sent["prompts"] if q["world"]["box_ras"]]):
        corners, _ = geo.box_from_roi(manual._getRoi(node), manual.nodeSlice(node))
        np.testing.assert_allclose(corners, q["world"]["box_ras"], atol=1e-4)
        assert sh.GetItemParent(sh.GetItemByDataNode(node)) == study
    assert [manual.nodeObject(n) for n in p.corrections] == [1, 2]
    pts = p.points
    assert sh.GetItemParent(sh.GetItemByDataNode(pts)) == study
    got = [(pts.GetNthControlPointLabel(i), pts.GetNthControlPointPositionWorld(i))
           for i in range(pts.GetNumberOfControlPoints())]
    want = [(("+" if pt[3] else "-") + str(q["object"]), pt[:3]) for q in sent["prompts"] for pt in q["world"]["points_ras"]]
    assert [g[0] for g in got] == [w[0] for w in want]
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], atol=1e-4)
    assert manual.sliceRange(p) == (k - 4, k + 4)
    # sent again unchanged, it is the same anchor
    again, notes = manual.anchorFromBoxes(p)
    assert notes == [] and [q["object"] for q in again["prompts"]] == [q["object"] for q in sent["prompts"]]
    for a, b in zip(again["prompts"], sent["prompts"]):
        assert (a["world"]["box_ras"] is None) == (b["world"]["box_ras"] is None)
        np.testing.assert_allclose(a["world"]["box_ras"] or [], b["world"]["box_ras"] or [], atol=1e-4)
        np.testing.assert_allclose(a["world"]["points_ras"], b["world"]["points_ras"], atol=1e-4)
    np.testing.assert_allclose(again["world"]["z_range_ras"], sent["world"]["z_range_ras"], atol=1e-4)

    # Segment again: a /1 result; the corrections go
    p.query = "the liver"
    job = manual.startSegment(p, tiny, replaceExisting=True)
    result, _, _ = worker_result(manual, volume, labels, [LIVER], tmp_path, name="again.nii.gz")
    client.answer(job, result)
    assert job.state == "done", job.error
    assert (p.corrections, p.points, p.rangeStart, p.rangeEnd) == ([], None, -1, -1)
    assert nodes_of("vtkMRMLMarkupsFiducialNode") == [] and len(nodes_of("vtkMRMLMarkupsROINode")) == 1
    assert manual.rangeText(p) == "whole volume"


def test_closing_the_scene_removes_the_correction_nodes(manual, client, oblique, tmp_path, tiny):
    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    correct(manual, geo, p.keySliceIJK)
    assert len(nodes_of("vtkMRMLMarkupsROINode")) == 3 and len(nodes_of("vtkMRMLMarkupsFiducialNode")) == 1
    slicer.mrmlScene.Clear(0)
    assert nodes_of("vtkMRMLMarkupsROINode") == [] and nodes_of("vtkMRMLMarkupsFiducialNode") == []
    p = manual.getParameterNode()
    assert (p.boxes, p.corrections, p.points, p.rangeStart, p.rangeEnd, p.correctionObject) == (
        [], [], None, -1, -1, 0)
    assert not manual.hasCorrections(p)


def test_signs_objects_and_slices_survive_a_saved_scene(manual, client, oblique, tmp_path, tiny):
    """The points' object and sign are their labels (in the markups file); a box's object and
    slice are node attributes (in the scene file)."""
    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    box1, box2 = correct(manual, geo, p.keySliceIJK)
    storage = slicer.vtkMRMLMarkupsJsonStorageNode()
    storage.SetFileName(str(tmp_path / "points.mrk.json"))
    assert storage.WriteData(p.points)
    read = slicer.vtkMRMLMarkupsFiducialNode()
    slicer.mrmlScene.AddNode(read)
    storage.ReadData(read)
    assert [read.GetNthControlPointLabel(i) for i in range(read.GetNumberOfControlPoints())] == ["+1", "-1", "+2", "-1"]
    assert read.GetControlPointLabelFormat() == p.points.GetControlPointLabelFormat()

    scene_file = tmp_path / "scene.mrml"
    slicer.mrmlScene.SetURL(str(scene_file))
    assert slicer.mrmlScene.Commit()
    other = slicer.vtkMRMLScene()
    for cls in ("vtkMRMLMarkupsROINode", "vtkMRMLMarkupsFiducialNode"):
        other.RegisterNodeClass(getattr(slicer, cls)())
    other.SetURL(str(scene_file))
    other.Import()
    by_name = {other.GetNthNodeByClass(i, "vtkMRMLMarkupsROINode").GetName():
               other.GetNthNodeByClass(i, "vtkMRMLMarkupsROINode")
               for i in range(other.GetNumberOfNodesByClass("vtkMRMLMarkupsROINode"))}
    for node in (box1, box2):
        back = by_name[node.GetName()]
        assert back.GetAttribute("MedVolR1.object") == node.GetAttribute("MedVolR1.object")
        assert back.GetAttribute("MedVolR1.slice") == node.GetAttribute("MedVolR1.slice")
