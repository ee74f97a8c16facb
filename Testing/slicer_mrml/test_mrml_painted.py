"""A painted slice as a prompt, on real MRML (slicer-core): the clinician repaints the result's
segment on one slice in the Segment Editor and clicks Re-propagate; that slice's mask goes to the
worker as a mask prompt (``medvol.anchor/4``) on MedVolCore's canonical slice, for the chosen
object. Bad painted slices (erased empty, outside the range, too many, an unknown object, a slice
that has the object's box or point) are one message and nothing is sent.

The volume is the real CT stored with permuted axes and obliquely (``test_mrml_corrections``), so
the canonical slice is checked against MedVolCore's own stack of the exported file."""

from __future__ import annotations

import numpy as np
import pytest
from medvolcore.anchor import EvidenceAnchor
from medvolcore.maskprompt import runs_to_mask

pytest.importorskip("slicer_core", reason="slicer-core is not installed (bootstrap.py --no-slicer-core)")
import slicer  # noqa: E402 - the real package, imported by conftest.py
from test_mrml_clinician_day import client, manual  # noqa: E402,F401  (fixtures)
from test_mrml_corrections import oblique, segmented, stack_of, tiny, voxel_ras  # noqa: E402,F401

V4 = "medvol.anchor/4"


def _segment(p, volume):
    return slicer.util.arrayFromSegmentBinaryLabelmap(p.outputSegmentation, p.segmentId, volume).copy()


def _paint(p, volume, geo, k, change):
    """Edit slice ``k`` (along the slice axis) of the result's segment as the Segment Editor would:
    ``change(slice2d)`` returns the new slice."""
    arr = _segment(p, volume)
    view = np.moveaxis(arr, 2 - geo.slice_axis, 0)
    view[k] = change(view[k].copy())
    slicer.util.updateSegmentBinaryLabelmapFromArray(arr, p.outputSegmentation, p.segmentId, volume)
    return arr


def _fix_outline(s):
    """Erase the upper half of the slice's mask and paint a blob beside it: a new outline."""
    rows = np.nonzero(s.any(axis=1))[0]
    s[: (rows[0] + rows[-1]) // 2] = 0
    cols = np.nonzero(s.any(axis=0))[0]
    s[rows[-1] - 6: rows[-1], cols[0]: cols[0] + 5] = 1
    return s


def test_a_painted_slice_is_sent_as_a_mask_prompt_on_the_stack(manual, client, oblique, tmp_path, tiny):
    from MedVolR1SlicerScene import painted

    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    assert painted.painted_slices(p) == []  # right after the result nothing is painted
    k = p.keySliceIJK + 3
    edited = _paint(p, volume, geo, k, _fix_outline)
    assert painted.painted_slices(p) == [k]
    n_jobs = len(client.jobs)
    job, notes = manual.startRepropagate(p, tiny)
    assert len(client.jobs) == n_jobs + 1 and notes == []
    sent = job.request["anchor"]
    assert sent["schema"] == V4 and len(sent["prompts"]) == 1
    pr = sent["prompts"][0]
    assert pr["object"] == 1 and pr["box"] is None and pr["points"] == []
    # the slice's mask on MedVolCore's stack of the exported file, computed by MedVolCore
    stack = stack_of(manual, volume)
    want = stack.to_stack(np.transpose(edited, (2, 1, 0)) != 0)
    z = pr["slice"]
    assert np.array_equal(runs_to_mask(pr["mask"]["runs"], stack.width, stack.height), want[z])
    assert want[z].any() and not np.array_equal(want[z], stack.to_stack(oblique[1] == 5)[z])  # repainted
    assert [i for i in range(stack.depth) if want[i].any() != (stack.to_stack(np.transpose(_segment(p, volume), (2, 1, 0)) != 0)[i]).any()] == []
    # the engine reads it as sent: its world slice agrees with its pixel slice, and it plans a mask there
    back = EvidenceAnchor.from_dict(sent, stack)
    assert back.schema == V4 and back.prompts[0]["slice"] == z
    assert z in back.plan(stack.depth)[0].masks
    np.testing.assert_allclose(stack.ras_to_stack(np.asarray([pr["world"]["slice_center_ras"]]))[0, 0], z, atol=1e-4)


def _refused(manual, client, p, tiny, needle):
    n_jobs = len(client.jobs)
    with pytest.raises(ValueError, match=needle):
        manual.startRepropagate(p, tiny)
    assert len(client.jobs) == n_jobs  # nothing was sent


@pytest.mark.parametrize("case", ["erased", "outside-the-range", "too-many", "unknown-object", "has-a-point",
                                  "several-objects-none-chosen"])
def test_bad_painted_slices_are_one_message_and_nothing_is_sent(manual, client, oblique, tmp_path, tiny, case):
    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    k = p.keySliceIJK + 2
    if case == "erased":
        _paint(p, volume, geo, k, np.zeros_like)
        _refused(manual, client, p, tiny, "is empty on slice")
    elif case == "outside-the-range":
        p.rangeStart, p.rangeEnd = p.keySliceIJK - 1, p.keySliceIJK + 1
        _paint(p, volume, geo, k, _fix_outline)
        _refused(manual, client, p, tiny, "outside the slice range")
    elif case == "too-many":
        arr = _segment(p, volume)
        view = np.moveaxis(arr, 2 - geo.slice_axis, 0)
        view[:, :3, :3] = 1  # a 3-D brush stroke through every slice
        slicer.util.updateSegmentBinaryLabelmapFromArray(arr, p.outputSegmentation, p.segmentId, volume)
        _refused(manual, client, p, tiny, r"edited on \d+ slices.*at most 16")
    elif case == "unknown-object":
        p.correctionObject = 5
        _paint(p, volume, geo, k, _fix_outline)
        _refused(manual, client, p, tiny, "object 5 does not exist")
    elif case == "has-a-point":
        manual.addPoint(p, voxel_ras(geo, k, 40, 60), positive=True, objectNumber=1)
        _paint(p, volume, geo, k, _fix_outline)
        _refused(manual, client, p, tiny, "object 1 has a box or point on slice")
    else:
        manual.chooseObject(p, 0)  # a new object 2, started by a box on another slice
        manual.addBoxHere(p, ras=voxel_ras(geo, k - 4, 50, 50))
        p.correctionObject = 0
        _paint(p, volume, geo, k, _fix_outline)
        _refused(manual, client, p, tiny, "has 2 objects: choose the one")


def _repropagate_and_answer(manual, client, p, volume, mask, tmp_path, tiny):
    """Re-propagate, and answer as the worker would: the anchor sent, run, with ``mask`` (KJI) as the
    result. Returns the job, the anchor that ran and the mask file."""
    from medvolcore.volume import load_volume, save_mask

    job, _ = manual.startRepropagate(p, tiny)
    stack = stack_of(manual, volume)
    ran = EvidenceAnchor.from_dict(job.request["anchor"], stack).with_world(stack).to_dict()
    path = save_mask(np.transpose(mask, (2, 1, 0)).astype(np.uint8), load_volume(manual.exportVolume(volume)),
                     tmp_path / "ran.nii.gz")
    client.answer(job, {"anchor": ran, "mask_path": str(path), "notes": [], "smoke": False})
    assert job.state == "done", job.error
    return job, ran, path


def test_the_painted_result_comes_back_and_its_slice_stays_a_prompt(manual, client, oblique, tmp_path, tiny):
    """The worker's /4 answer is put into the scene (a mask prompt makes no node); the next
    Re-propagate sends the painted slice again, and painting it once more replaces its mask."""
    from MedVolR1SlicerScene import painted

    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    k = p.keySliceIJK + 3
    edited = _paint(p, volume, geo, k, _fix_outline)
    job, ran, path = _repropagate_and_answer(manual, client, p, volume, edited, tmp_path, tiny)
    assert painted.painted_slices(p) == [] and len(p.corrections) == 0  # the result is the new reference
    first = ran["prompts"][0]
    # a box moved: the painted slice is sent again, as it ran
    p.boxesEdited = True
    job2, _ = manual.startRepropagate(p, tiny)
    again = job2.request["anchor"]
    assert again["schema"] == V4 and [pr["mask"] for pr in again["prompts"]] == [first["mask"]]
    client.answer(job2, {"anchor": ran, "mask_path": str(path), "notes": [], "smoke": False})
    assert job2.state == "done", job2.error
    # painted once more: its new mask replaces the earlier one
    _paint(p, volume, geo, k, lambda s: np.pad(s[1:], ((0, 1), (0, 0))))
    job3, _ = manual.startRepropagate(p, tiny)
    masks = [pr for pr in job3.request["anchor"]["prompts"] if pr.get("mask")]
    assert len(masks) == 1 and masks[0]["slice"] == first["slice"] and masks[0]["mask"] != first["mask"]


def test_the_result_digests_survive_a_saved_segmentation(manual, client, oblique, tmp_path, tiny):
    """The digests are a segment tag, written with the segmentation (.seg.nrrd, as in an .mrb) and read
    back: a painted slice is found after the scene is reopened."""
    from MedVolR1SlicerScene import painted

    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    storage = slicer.vtkMRMLSegmentationStorageNode()
    storage.SetFileName(str(tmp_path / "liver.seg.nrrd"))
    assert storage.WriteData(p.outputSegmentation)
    read = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode")
    reader = slicer.vtkMRMLSegmentationStorageNode()
    reader.SetFileName(str(tmp_path / "liver.seg.nrrd"))
    assert reader.ReadData(read)
    assert painted.painted_slices(p, read, p.segmentId, volume) == []
    k = p.keySliceIJK - 1
    arr = _segment(p, volume)
    np.moveaxis(arr, 2 - geo.slice_axis, 0)[k] = _fix_outline(np.moveaxis(arr, 2 - geo.slice_axis, 0)[k].copy())
    slicer.util.updateSegmentBinaryLabelmapFromArray(arr, read, p.segmentId, volume)
    assert painted.painted_slices(p, read, p.segmentId, volume) == [k]


def test_painting_alone_enables_re_propagate(manual, client, oblique, tmp_path, tiny):
    """What the panel asks before it enables Re-propagate without a moved box: the segment was
    repainted since the result (and not before it was)."""
    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    assert not p.boxesEdited and manual.segmentPainted(p) is False
    _paint(p, volume, geo, p.keySliceIJK + 1, _fix_outline)
    assert manual.segmentPainted(p) is True


def test_undo_and_redo_keep_each_results_slices_as_the_reference(manual, client, oblique, tmp_path, tiny):
    """Undo puts the segment back as it was when Re-propagate was clicked (the two painted slices not
    yet sent) with the earlier result's slice digests, so those two slices are painted again and
    nothing else is; Redo puts the later result back with its own digests: nothing painted."""
    from MedVolR1SlicerScene import painted

    volume, geo = segmented(manual, client, oblique, tmp_path, tiny)
    p = manual.getParameterNode()
    k = p.keySliceIJK + 3
    edited = _paint(p, volume, geo, k, _fix_outline)
    edited = _paint(p, volume, geo, k + 1, lambda s: np.pad(s[2:], ((0, 2), (0, 0))))  # a result differing on two slices
    job, ran, path = _repropagate_and_answer(manual, client, p, volume, edited, tmp_path, tiny)
    assert painted.painted_slices(p) == []
    assert manual.undoLastResult(p=p)
    p = manual.getParameterNode()
    assert np.array_equal(_segment(p, volume) != 0, edited != 0)  # as it was when Re-propagate was clicked
    assert painted.painted_slices(p) == [k, k + 1] and manual.segmentPainted(p) is True
    assert manual.redoLastResult(p=p)
    p = manual.getParameterNode()
    assert np.array_equal(_segment(p, volume) != 0, edited != 0)
    assert painted.painted_slices(p) == [] and manual.segmentPainted(p) is False
