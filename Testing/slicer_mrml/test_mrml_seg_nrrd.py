"""`.seg.nrrd` written by medvolcore (no Slicer) is a segmentation that Slicer's own storage node
reads back: the query as the segment's name, the terminology's colour and entry, the voxels on
the CT's grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import slicer
from test_mrml_logic import load_node

REPO = Path(__file__).resolve().parents[2]
CT = REPO / "Testing" / "data" / "totalsegmentator" / "example_ct_sm.nii.gz"


def _read(path):
    node = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode")
    storage = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationStorageNode")
    storage.SetFileName(str(path))
    assert storage.ReadData(node) == 1
    return node


def test_slicer_reads_the_segmentation_medvol_writes(scene, tmp_path):
    from medvolcore.terminology import match
    from medvolcore.volume import load_volume, save_mask

    ct = load_volume(CT)
    mask = np.zeros(ct.shape, np.uint8)
    mask[30:60, 20:50, 5:15] = 1
    out = tmp_path / "kidney.seg.nrrd"
    query = "the right kidney: the one with the cyst"
    save_mask(mask, ct, out, segments=[{"name": query, "value": 1, "term": match("right kidney")}])

    node = _read(out)
    segmentation = node.GetSegmentation()
    assert segmentation.GetNumberOfSegments() == 1
    segment = segmentation.GetNthSegment(0)
    assert segment.GetName() == query
    assert np.allclose(segment.GetColor(), [c / 255 for c in match("right kidney").color], atol=1e-4)
    entry = segment.GetTerminology()
    assert "SCT^64033007^Kidney" in entry and "SCT^24028007^Right" in entry
    reference = load_node(CT)
    array = slicer.util.arrayFromSegmentBinaryLabelmap(node, segmentation.GetNthSegmentID(0), reference)
    assert array.shape == mask.shape[::-1]  # on the CT's grid (k, j, i)
    assert np.array_equal(array.transpose(2, 1, 0) > 0, mask > 0)  # every voxel where it was, none added


def test_a_generic_query_gets_a_generic_entry_and_a_palette_colour(scene, tmp_path):
    from medvolcore.volume import load_volume, save_mask

    ct = load_volume(CT)
    labels = np.zeros(ct.shape, np.uint8)
    labels[10:20, 10:20, 2:4] = 1
    out = tmp_path / "plain.seg.nrrd"
    save_mask(labels, ct, out, segments=[{"name": "the organ that secretes bile", "value": 1}])
    segment = _read(out).GetSegmentation().GetNthSegment(0)
    assert segment.GetName() == "the organ that secretes bile"
    assert "SCT^91723000^Anatomical structure" in segment.GetTerminology()


def test_several_targets_are_one_segment_each_in_slicer(scene, tmp_path):
    from medvolcore.terminology import match
    from medvolcore.volume import load_volume, save_mask

    ct = load_volume(CT)
    labels = np.zeros(ct.shape, np.uint8)
    labels[30:60, 20:50, 5:15] = 1
    labels[70:90, 60:80, 8:12] = 2
    queries = ["the liver", "the spleen", "the kidney that contains the cyst"]  # the third found nothing
    out = tmp_path / "organs.seg.nrrd"
    save_mask(labels, ct, out, segments=[{"name": q, "value": k, "term": match(q, k)}
                                         for k, q in enumerate(queries, start=1)])
    node = _read(out)
    segmentation = node.GetSegmentation()
    assert segmentation.GetNumberOfSegments() == 3
    assert [segmentation.GetNthSegment(i).GetName() for i in range(3)] == queries
    assert "SCT^78961009^Spleen" in segmentation.GetNthSegment(1).GetTerminology()
    reference = load_node(CT)
    for i, value in enumerate((1, 2, 3)):
        array = slicer.util.arrayFromSegmentBinaryLabelmap(node, segmentation.GetNthSegmentID(i), reference)
        assert np.array_equal(array.transpose(2, 1, 0) > 0, labels == value)
