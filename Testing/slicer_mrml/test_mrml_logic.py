"""The module's logic on real MRML (slicer-core), no worker: the worker session it builds or is
given, the volume the worker reads, the worker's mask into a segment, Undo, and evidence boxes as
ROI nodes, on the real CT stored RAS, LPS and obliquely with permuted axes (the same voxels, the
affine rewritten with nibabel)."""

from __future__ import annotations

import json
import os

import nibabel as nib
import numpy as np
import pytest
from medvolcore.anchor import EvidenceAnchor, anchor_from_mask
from medvolcore.stack import AxialStack
from medvolcore.volume import load_volume, save_mask

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - the real package, imported by conftest.py
import vtk  # noqa: E402

SPLEEN, KIDNEY_RIGHT, KIDNEY_LEFT, LIVER = 1, 2, 3, 5  # TotalSegmentator v2 ids (class_map_total_v2.json)
SINGLE_FILE = 4


def _rot(axis: int, deg: float) -> np.ndarray:
    t = np.deg2rad(deg)
    c, s = np.cos(t), np.sin(t)
    r = np.eye(3)
    i, j = [a for a in range(3) if a != axis]
    r[i, i], r[i, j], r[j, i], r[j, j] = c, -s, s, c
    return r


def variant(array: np.ndarray, affine: np.ndarray, name: str):
    """The same voxels stored another way: ``ras`` as is; ``lps`` with i and j reversed (as
    DICOM-derived files are); ``oblique_permuted`` with the slice axis first and the directions
    turned 20° about A and 10° about S."""
    if name == "ras":
        return array, affine
    if name == "lps":
        flip = np.diag([-1.0, -1.0, 1.0, 1.0])
        flip[0, 3], flip[1, 3] = array.shape[0] - 1, array.shape[1] - 1
        return array[::-1, ::-1, :], affine @ flip
    if name == "oblique_permuted":
        perm = np.zeros((4, 4))
        perm[3, 3] = 1
        perm[2, 0] = perm[0, 1] = perm[1, 2] = 1  # new index (k, i, j) -> old (i, j, k)
        aff = affine @ perm
        aff[:3, :3] = _rot(1, 20) @ _rot(2, 10) @ aff[:3, :3]
        return np.transpose(array, (2, 0, 1)), aff
    raise ValueError(name)


VARIANTS = ["ras", "lps", "oblique_permuted"]


@pytest.fixture(scope="module")
def real(ct_sm_path, seg_sm_path):
    ct = nib.load(str(ct_sm_path))
    seg = nib.load(str(seg_sm_path))
    return np.asarray(ct.dataobj).astype(np.int16), np.asarray(seg.dataobj).astype(np.uint8), ct.affine


@pytest.fixture(scope="module")
def variant_files(real, tmp_path_factory):
    """Per variant: the CT and its label map as NIfTI files (written by nibabel)."""
    ct, labels, affine = real
    folder = tmp_path_factory.mktemp("variants")
    out = {}
    for name in VARIANTS:
        arr, aff = variant(ct, affine, name)
        lab, _ = variant(labels, affine, name)
        ct_path, lab_path = folder / f"{name}_ct.nii.gz", folder / f"{name}_labels.nii.gz"
        nib.save(nib.Nifti1Image(np.ascontiguousarray(arr), aff), str(ct_path))
        nib.save(nib.Nifti1Image(np.ascontiguousarray(lab), aff), str(lab_path))
        out[name] = (ct_path, lab_path, aff, np.ascontiguousarray(lab))
    return out


def load_node(path):
    node = slicer.modules.volumes.logic().AddArchetypeVolume(str(path), "CT", SINGLE_FILE)
    assert node is not None, f"slicer-core could not read {path}"
    return node


def ijk_to_ras(node) -> np.ndarray:
    m = vtk.vtkMatrix4x4()
    node.GetIJKToRASMatrix(m)
    return slicer.util.arrayFromVTKMatrix(m)


def kji(a: np.ndarray) -> np.ndarray:
    """nibabel's (i, j, k) array in Slicer's (k, j, i) order."""
    return np.ascontiguousarray(np.transpose(a, (2, 1, 0)))


def worker_result(logic, volume_node, labels_ijk, label_ids, tmp_path, name="mask.nii.gz", query="the liver"):
    """What the worker returns for ``label_ids`` of the real label map: the anchor MedVolCore
    derives on its stack of the exported file, and the mask written on that file's grid."""
    ct = load_volume(logic.exportVolume(volume_node))
    stack = AxialStack(ct)
    mask = np.isin(labels_ijk, label_ids).astype(np.uint8)
    anchor = anchor_from_mask(stack.to_stack(mask), stack=stack)
    anchor.query, anchor.reasoning, anchor.source = query, "because", "grounder"
    path = save_mask(mask, ct, tmp_path / name)
    return {"anchor": anchor.to_dict(), "mask_path": str(path), "notes": [], "smoke": False}, mask, stack


def shown_segment(logic, p):
    """Select an empty segment of a new segmentation: the evidence written into ``p`` next is its
    (evidence is always a segment's)."""
    seg = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode")
    logic.selectSegment(p, seg, seg.GetSegmentation().AddEmptySegment("", "the target"))


def segment_array(p, volume_node):
    return slicer.util.arrayFromSegmentBinaryLabelmap(p.outputSegmentation, p.segmentId, volume_node)


# ---- the worker session ---------------------------------------------------------------------

class RecordingClient:
    """A worker client that records what it is asked and never answers (the jobs stay queued)."""

    def __init__(self, options):
        self.options = options
        self.requests = []
        self.stopped = False

    def submit(self, op, **fields):
        from MedVolR1SlicerLib.client import Job

        self.requests.append((op, fields))
        return Job(str(len(self.requests)), op, fields)

    def stop(self):
        self.stopped = True


def test_the_logic_builds_its_session_as_slicer_does_or_uses_the_one_given(slicer_env, scene, variant_files):
    from MedVolR1SlicerLib.client import python_for_worker
    from MedVolR1SlicerLib.session import RUNNING, Options, Session

    built = slicer_env.MedVolR1SlicerLogic()  # as the widget (and so getModuleLogic) builds it
    try:
        assert isinstance(built.session, Session) and built.session.client is None  # no worker started yet
        assert built.session.python == python_for_worker()
        assert built.session.env is None  # slicer-core has no slicer.app, hence no start-up environment
    finally:
        built.cleanup()

    clients = []

    def recording_client(options):
        clients.append(RecordingClient(options))
        return clients[-1]

    session = Session(client_factory=recording_client)
    logic = slicer_env.MedVolR1SlicerLogic(session=session)
    assert logic.session is session
    node = load_node(variant_files["ras"][0])
    p = logic.getParameterNode()
    p.inputVolume, p.query, p.outputSegmentation, p.segmentId = node, "the liver", None, ""
    job = logic.startSegment(p, Options(preset="tiny", device="cpu"))
    (client,) = clients
    assert [op for op, _ in client.requests] == ["load", "segment"]
    fields = client.requests[1][1]
    assert (fields["query"], fields["preset"], job.op) == ("the liver", "tiny", "segment")
    assert fields["volume"] == logic.exportVolume(node) and os.path.isfile(fields["volume"])
    assert session.state == RUNNING
    logic.cleanup()
    assert client.stopped and not os.path.exists(fields["volume"])


# ---- the volume the worker reads ------------------------------------------------------------

@pytest.mark.parametrize("name", VARIANTS)
def test_exported_volume_is_uncompressed_nifti_with_the_same_grid_and_voxels(logic, variant_files, real, name):
    ct_path, _, aff, _ = variant_files[name]
    node = load_node(ct_path)
    np.testing.assert_allclose(ijk_to_ras(node), aff, atol=1e-4)  # Slicer read the file as nibabel did

    path = logic.exportVolume(node)
    assert path.endswith(".nii") and os.path.dirname(path) == logic.tempDir()
    with open(path, "rb") as f:
        assert f.read(2) != b"\x1f\x8b"  # not gzip: written once, read once next door
    img = nib.load(path)
    np.testing.assert_allclose(img.affine, ijk_to_ras(node), atol=1e-4)
    np.testing.assert_array_equal(kji(np.asarray(img.dataobj)), slicer.util.arrayFromVolume(node))
    # what the worker reads (medvolcore) sees the same grid
    ct = load_volume(path)
    np.testing.assert_allclose(ct.affine, ijk_to_ras(node), atol=1e-4)
    np.testing.assert_array_equal(ct.array, variant(real[0], real[2], name)[0].astype(np.float32))


def test_export_is_cached_until_the_voxels_change_and_cleanup_removes_the_temp_folder(logic, variant_files):
    node = load_node(variant_files["ras"][0])
    path = logic.exportVolume(node)
    stamp = os.stat(path).st_mtime_ns
    assert logic.exportVolume(node) == path and os.stat(path).st_mtime_ns == stamp
    arr = slicer.util.arrayFromVolume(node)
    arr[0, 0, 0] = 1234
    slicer.util.arrayFromVolumeModified(node)
    assert logic.exportVolume(node) == path
    assert np.asarray(nib.load(path).dataobj)[0, 0, 0] == 1234  # written again
    folder = logic.tempDir()
    assert sorted(os.listdir(folder)) == [os.path.basename(path)]  # no leftover partial file
    logic.cleanup()
    assert not os.path.exists(folder)
    assert os.path.exists(logic.exportVolume(node))  # a new folder on next use


# ---- the worker's mask into a segment, Undo -------------------------------------------------

@pytest.mark.parametrize("name", VARIANTS)
def test_apply_result_puts_the_workers_mask_in_a_segment_bit_for_bit(logic, variant_files, tmp_path, name):
    ct_path, _, _, labels = variant_files[name]
    node = load_node(ct_path)
    p = logic.getParameterNode()
    p.inputVolume, p.query = node, "the liver"
    result, mask, stack = worker_result(logic, node, labels, [LIVER], tmp_path)
    from medvolcore.terminology import match

    result["terminology"] = match("the liver").to_dict()  # as the worker's segment reply carries it
    notes = logic.applyResult(p, node, result, replaceSegment=False)
    assert notes == []
    seg = p.outputSegmentation
    assert seg is not None and seg.GetSegmentation().GetNumberOfSegments() == 1
    segment = seg.GetSegmentation().GetSegment(p.segmentId)
    assert segment.GetName() == "the liver"
    assert np.allclose(segment.GetColor(), [c / 255 for c in match("liver").color], atol=1e-6)  # the coded colour
    assert "SCT^10200004^Liver" in segment.GetTerminology()
    got = segment_array(p, node)
    assert got.shape == kji(mask).shape
    np.testing.assert_array_equal(got, kji(mask))
    assert int(got.sum()) == int(mask.sum()) > 1000
    # the evidence: key slice, reasoning, one ROI per box on the key slice
    anchor = result["anchor"]
    assert p.keySlice == anchor["slice"] and p.reasoning == "because"
    assert len(p.boxes) == len(anchor["boxes"]) >= 1
    geo = logic.geometry(node)
    assert p.keySliceIJK == geo.slice_of(anchor["world"]["slice_center_ras"])
    for roi in p.boxes:
        c = [0.0, 0.0, 0.0]
        roi.GetCenter(c)
        assert geo.slice_of(c) == p.keySliceIJK


def test_replace_then_undo_restores_the_previous_mask_and_undo_of_an_added_segment_removes_it(
        logic, variant_files, tmp_path):
    ct_path, _, _, labels = variant_files["lps"]
    node = load_node(ct_path)
    p = logic.getParameterNode()
    p.inputVolume, p.query = node, "the liver"
    liver_result, liver, _ = worker_result(logic, node, labels, [LIVER], tmp_path, "liver.nii.gz")
    logic.applyResult(p, node, liver_result, replaceSegment=False)
    first_id = p.segmentId

    kidneys_result, kidneys, _ = worker_result(logic, node, labels, [KIDNEY_RIGHT, KIDNEY_LEFT], tmp_path, "kid.nii.gz")
    logic.applyResult(p, node, kidneys_result, replaceSegment=True)  # re-propagation replaces
    seg = p.outputSegmentation.GetSegmentation()
    assert p.segmentId == first_id and seg.GetNumberOfSegments() == 1
    np.testing.assert_array_equal(segment_array(p, node), kji(kidneys))  # no liver voxel left
    assert logic.canUndo and logic.undoLastResult()
    np.testing.assert_array_equal(segment_array(p, node), kji(liver))
    assert logic.undoDepth(p) == 1  # the liver's own result is next
    assert logic.canRedo and logic.redoLastResult() and logic.undoLastResult()  # Redo, and back

    # "keep both": a new segment with a numbered name; Undo removes it and leaves the other
    logic.applyResult(p, node, kidneys_result, replaceSegment=False)
    assert seg.GetNumberOfSegments() == 2
    assert seg.GetSegment(p.segmentId).GetName() == "the liver (2)"
    added = p.segmentId
    assert logic.undoLastResult()
    assert seg.GetNumberOfSegments() == 1 and seg.GetSegment(added) is None and seg.GetSegment(first_id) is not None


def test_a_mask_on_another_grid_is_refused_before_the_scene_changes(slicer_env, logic, variant_files, real, tmp_path):
    ct_path, _, _, labels = variant_files["ras"]
    node = load_node(ct_path)
    p = logic.getParameterNode()
    p.inputVolume, p.query = node, "the liver"
    result, _, _ = worker_result(logic, node, labels, [LIVER], tmp_path)
    # a mask one slice short, as if the volume had been cropped while the worker ran
    img = nib.load(result["mask_path"])
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj)[:, :, :-1], img.affine), str(tmp_path / "short.nii.gz"))
    result["mask_path"] = str(tmp_path / "short.nii.gz")
    nodes_before = slicer.mrmlScene.GetNumberOfNodes()
    with pytest.raises(slicer_env.GeometryError, match="voxels but the volume"):
        logic.applyResult(p, node, result, replaceSegment=False)
    # …and one shifted by half a voxel
    shifted = img.affine.copy()
    shifted[:3, 3] += 1.5
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj), shifted), str(tmp_path / "shifted.nii.gz"))
    result["mask_path"] = str(tmp_path / "shifted.nii.gz")
    with pytest.raises(slicer_env.GeometryError, match="grid"):
        logic.applyResult(p, node, result, replaceSegment=False)
    assert slicer.mrmlScene.GetNumberOfNodes() == nodes_before  # no segmentation, no ROI left behind
    assert p.outputSegmentation is None and not logic.canUndo


# ---- evidence boxes as ROI nodes ------------------------------------------------------------

@pytest.mark.parametrize("name", VARIANTS)
def test_roi_nodes_round_trip_to_the_same_anchor_on_medvolcores_stack(logic, variant_files, tmp_path, name):
    """anchor → ROI nodes (real vtkMRMLMarkupsROINode) → anchor gives the same slice and pixel
    boxes on MedVolCore's stack of the volume, for every storage of the same voxels."""
    ct_path, _, _, labels = variant_files[name]
    node = load_node(ct_path)
    p = logic.getParameterNode()
    p.inputVolume, p.query = node, "the kidneys"
    result, _, stack = worker_result(logic, node, labels, [KIDNEY_RIGHT, KIDNEY_LEFT], tmp_path, query="the kidneys")
    original = result["anchor"]
    assert len(original["boxes"]) == 2
    shown_segment(logic, p)
    rois = logic.placeBoxes(p, node, original)
    p.anchorJson = json.dumps(original)
    assert [r.GetName() for r in rois] == ["MedVol box 1", "MedVol box 2"]
    # the node keeps what was set: IJK-aligned axes and the box's voxel-edge size
    geo = logic.geometry(node)
    for roi_node in rois:
        got = logic._getRoi(roi_node)
        np.testing.assert_allclose(np.abs(got.axes.T @ geo._axes_frame()).max(axis=0), 1.0, atol=1e-9)
        ijk_size = np.abs(np.linalg.inv(geo._axes_frame()) @ (got.axes * got.size)).sum(axis=1) / geo.spacing
        assert np.allclose(ijk_size, np.round(ijk_size), atol=1e-6) and ijk_size[geo.slice_axis] == pytest.approx(1)

    edited, notes = logic.anchorFromBoxes(p)
    assert notes == [] and edited["source"] == "user" and "boxes" not in edited
    back = EvidenceAnchor.from_world(edited["world"], stack)
    assert back.slice == original["slice"]
    assert [list(b) for b in back.boxes] == original["boxes"]


@pytest.mark.parametrize("name", ["lps", "oblique_permuted"])
def test_a_box_dragged_off_the_slice_and_past_the_edge_is_clamped_and_put_back(logic, variant_files, tmp_path, name):
    ct_path, _, _, labels = variant_files[name]
    node = load_node(ct_path)
    p = logic.getParameterNode()
    p.inputVolume, p.query = node, "the liver"
    result, _, stack = worker_result(logic, node, labels, [LIVER], tmp_path)
    shown_segment(logic, p)
    (roi_node,) = logic.placeBoxes(p, node, result["anchor"])
    p.anchorJson = json.dumps(result["anchor"])
    geo = logic.geometry(node)
    k = p.keySliceIJK
    # drag: two slices up, and along the first in-plane axis until its centre is on the last
    # voxel, so that half of it reaches past the image's edge
    a0 = geo.inplane_axes[0]
    c = np.zeros(3)
    roi_node.GetCenter(c)
    step = np.zeros(3)
    step[geo.slice_axis], step[a0] = 2, (geo.shape[a0] - 1) - geo.to_ijk(c)[a0]
    roi_node.SetCenter(*(c + geo.to_ras(step) - geo.to_ras(np.zeros(3))))
    anchor, notes = logic.anchorFromBoxes(p)
    assert any("moved off the key slice" in n for n in notes)
    assert any("cut to the image" in n for n in notes)
    # the ROI node was put back on the key slice, inside the image
    roi = logic._getRoi(roi_node)
    assert geo.slice_of(roi.center) == k
    ijk = geo.to_ijk(roi.corners())
    assert ijk[:, a0].max() <= geo.shape[a0] - 0.5 + 1e-6
    # and MedVolCore places the clamped box on its stack without complaint
    placed = EvidenceAnchor.from_world(anchor["world"], stack)
    assert placed.slice == result["anchor"]["slice"]
    x0, y0, x1, y1 = placed.boxes[0]
    assert 0 <= x0 <= x1 < stack.width and 0 <= y0 <= y1 < stack.height


def test_show_key_slice_jumps_the_slice_views(logic, variant_files, tmp_path):
    """With a slice view in the scene (as Slicer has three), the key slice is shown in it."""
    ct_path, _, _, labels = variant_files["oblique_permuted"]
    node = load_node(ct_path)
    slice_node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSliceNode")
    slice_node.SetLayoutName("Red")
    slice_node.SetOrientationToAxial()
    composite = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSliceCompositeNode")
    composite.SetLayoutName("Red")
    p = logic.getParameterNode()
    p.inputVolume, p.query = node, "the liver"
    result, _, _ = worker_result(logic, node, labels, [LIVER], tmp_path)
    logic.applyResult(p, node, result, replaceSegment=False)
    assert composite.GetBackgroundVolumeID() == node.GetID()
    centre = np.array(result["anchor"]["world"]["slice_center_ras"])
    slice_to_ras = slicer.util.arrayFromVTKMatrix(slice_node.GetSliceToRAS())
    normal, origin = slice_to_ras[:3, 2], slice_to_ras[:3, 3]
    assert abs(float(np.dot(centre - origin, normal))) < 1e-3  # the key slice's centre lies in the view's plane


def test_slicer_util_export_node_reuses_its_default_properties(slicer_env, monkeypatch):
    """Why batch.py writes through storage nodes: Slicer's ``exportNode(node, path)`` (here the
    real ``slicer.util`` with a recording I/O manager) stores the first call's ``fileFormat``
    in its shared default dict, and every later call without properties reuses it."""
    calls = []

    class IOManager:
        def extractKnownExtension(self, filename, node):
            return ".seg.nrrd" if filename.endswith(".seg.nrrd") else ".nii.gz"

        def fileWriterExtensions(self, node):
            return ["Segmentation (.seg.nrrd)", "NIfTI (.nii.gz)"]

        def exportNodes(self, ids, names, props, harden, messages):
            calls.append((names[0], props.get("fileFormat")))
            return True

    io = IOManager()
    monkeypatch.setattr(slicer, "app", type("App", (), {"coreIOManager": lambda self: io})(), raising=False)
    defaults = slicer.util.exportNode.__defaults__[0]
    saved = dict(defaults)
    try:
        node = slicer.vtkMRMLScalarVolumeNode()
        slicer.util.exportNode(node, "a.seg.nrrd")
        slicer.util.exportNode(node, "b.nii.gz")
    finally:
        defaults.clear()
        defaults.update(saved)
    assert calls == [("a.seg.nrrd", "Segmentation (.seg.nrrd)"), ("b.nii.gz", "Segmentation (.seg.nrrd)")]


def _liver_on_lps(logic, variant_files, tmp_path):
    """The LPS variant loaded as the input volume, the query "the liver", and the worker's liver result
    for it: ``(p, node, labels, (result, mask, stack))``."""
    ct_path, _, _, labels = variant_files["lps"]
    node = load_node(ct_path)
    p = logic.getParameterNode()
    p.inputVolume, p.query = node, "the liver"
    return p, node, labels, worker_result(logic, node, labels, [LIVER], tmp_path)


def test_an_absent_answer_adds_nothing_and_keeps_the_last_result(logic, variant_files, tmp_path):
    p, node, _, (liver, _, stack) = _liver_on_lps(logic, variant_files, tmp_path)
    logic.applyResult(p, node, liver, replaceSegment=False)
    before = (p.outputSegmentation, p.segmentId, p.keySlice, p.anchorJson, p.reasoning, len(p.boxes))
    n_seg_nodes = len(slicer.util.getNodesByClass("vtkMRMLSegmentationNode"))
    absent = {"absent": True, "mask_path": None, "smoke": False,
              "notes": ["not found in this CT: the kidney cyst"],
              "anchor": {"schema": "medvol.anchor/3", "absent": True, "slice": None, "boxes": [], "boxes_norm": [],
                         "image_size": [stack.width, stack.height], "query": "the kidney cyst",
                         "reasoning": "no cyst on any slice", "source": "grounder"}}
    notes = logic.applyResult(p, node, absent, replaceSegment=False)
    assert notes[0].startswith("Not found in this CT: the kidney cyst.") and "no segment was added" in notes[0]
    assert "the model's reasoning: no cyst on any slice" in notes and len(notes) == 2  # the core's line not repeated
    assert (p.outputSegmentation, p.segmentId, p.keySlice, p.anchorJson, p.reasoning, len(p.boxes)) == before
    assert p.outputSegmentation.GetSegmentation().GetNumberOfSegments() == 1
    assert len(slicer.util.getNodesByClass("vtkMRMLSegmentationNode")) == n_seg_nodes


def test_blocking_calls_return_their_own_jobs_anchor_never_an_earlier_one(logic, variant_files, tmp_path):
    from types import SimpleNamespace

    p, node, _, (liver, _, _) = _liver_on_lps(logic, variant_files, tmp_path)
    logic.applyResult(p, node, liver, replaceSegment=False)  # p.anchorJson now holds the liver's anchor
    absent = {"schema": "medvol.anchor/3", "absent": True, "slice": None, "boxes": [], "query": "the brain"}
    assert logic._blockingResult(p, SimpleNamespace(result={"absent": True, "anchor": absent})) == (None, "", [], absent)
    seg, sid, rois, anchor = logic._blockingResult(p, SimpleNamespace(result=liver))
    assert anchor == liver["anchor"] and seg is p.outputSegmentation and sid == p.segmentId


# ---- consensus: the confidence and the agreement segment --------------------------------------

def test_a_consensus_result_adds_an_agreement_segment_and_its_confidence(logic, variant_files, tmp_path):
    p, node, labels, (result, liver, _) = _liver_on_lps(logic, variant_files, tmp_path)
    counts = (3 * liver + np.isin(labels, [SPLEEN])).astype(np.uint8)  # 3 of 4 answers: the liver; 1: the spleen
    ct = load_volume(logic.exportVolume(node))
    agr = str(save_mask(counts, ct, tmp_path / "agreement.nii.gz"))
    result = dict(result, consensus=4, confidence=0.5, agreement_path=agr,
                  samples=[{"sample": 1, "slice": 3}, {"sample": 2, "slice": 3}, {"sample": 3, "slice": 3},
                           {"sample": 4, "slice": 9}])
    logic.applyResult(p, node, result, replaceSegment=False)
    seg = p.outputSegmentation.GetSegmentation()
    assert seg.GetNumberOfSegments() == 2 and p.agreementSegmentId and p.agreementSegmentId != p.segmentId
    assert seg.GetSegment(p.agreementSegmentId).GetName() == "the liver agreement ≥ 3/4"
    got = slicer.util.arrayFromSegmentBinaryLabelmap(p.outputSegmentation, p.agreementSegmentId, node)
    np.testing.assert_array_equal(got, kji((counts >= 3).astype(np.uint8)))  # the spleen's 1 of 4 is left out
    np.testing.assert_array_equal(segment_array(p, node), kji(liver))  # the mask is the worker's, untouched
    assert p.confidence.startswith("0.50: agreement of 4 answers") and "not the chance" in p.confidence
    assert not os.path.exists(agr)  # the worker wrote it into the module's temporary folder: read, then removed
    # Undo takes the agreement segment back with the result
    assert logic.undoLastResult()
    assert seg.GetNumberOfSegments() == 0

    # a result without a consensus drops the last one's agreement segment and shows its answer signal
    save_mask(counts, ct, tmp_path / "agreement.nii.gz")
    logic.applyResult(p, node, result, replaceSegment=False)
    assert seg.GetNumberOfSegments() == 2
    plain, _, _ = worker_result(logic, node, labels, [LIVER], tmp_path, "liver2.nii.gz")
    logic.applyResult(p, node, dict(plain, answer_mean_prob=0.9), replaceSegment=True)
    assert seg.GetNumberOfSegments() == 1 and p.agreementSegmentId == ""
    assert p.confidence.startswith("answer signal 0.90")


def test_segment_with_a_consensus_asks_a_local_worker_for_the_agreement_map(slicer_env, variant_files):
    from MedVolR1SlicerLib.session import Options, Session

    clients = []
    session = Session(client_factory=lambda options: clients.append(RecordingClient(options)) or clients[-1])
    logic = slicer_env.MedVolR1SlicerLogic(session=session)
    try:
        node = load_node(variant_files["ras"][0])
        p = logic.getParameterNode()
        p.inputVolume, p.query, p.outputSegmentation, p.segmentId = node, "the liver", None, ""
        logic.startSegment(p, Options(preset="tiny", device="cpu", consensus=3))
        fields = clients[0].requests[-1][1]
        assert fields["consensus"] == 3 and os.path.dirname(fields["agreement"]) == logic.tempDir()
        assert fields["agreement"].endswith(".nii.gz") and not os.path.exists(fields["agreement"])
    finally:
        logic.cleanup()
