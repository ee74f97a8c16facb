"""medvolcore.terminology: what a query is coded as, and how it was matched (never guessed)."""

from __future__ import annotations

import pytest

from medvolcore.terminology import match, normalise, table

from core.test_jobs import BOX, calls, propagator  # noqa: F401  (fixtures)


@pytest.mark.parametrize("query,how,structure,label", [
    ("liver", "name", "liver", "Liver"),
    ("The Right Kidney.", "name", "kidney_right", "Kidney, Right"),
    ("kidney_left", "name", "kidney_left", "Kidney, Left"),
    ("gall bladder", "name", "gallbladder", "Gallbladder"),  # a synonym
    ("IVC", "name", "inferior_vena_cava", "Inferior vena cava"),
    ("left kidney cyst", "name", "kidney_cyst_left", "Cyst (Kidney, Left)"),  # with its anatomic region
    ("the kidney that contains the cyst", "mentioned", "kidney", "Kidney"),  # no side: none invented
    ("segment the left kidney please", "mentioned", "kidney_left", "Kidney, Left"),  # the longer phrase wins
    ("the organ that secretes bile", "generic", "", "Anatomical structure"),  # implicit: not guessed
    ("the liver and the spleen", "generic", "", "Anatomical structure"),  # two structures: not one code
    ("delivery", "generic", "", "Anatomical structure"),  # 'liver' inside a word is not the liver
])
def test_match(query, how, structure, label):
    t = match(query)
    assert (t.how, t.structure, t.label) == (how, structure, label)
    assert t.category[0] == t.type[0] == "SCT" and len(t.color) == 3
    if how == "generic":
        assert t.type == ("SCT", "91723000", "Anatomical structure") and t.note
    if how == "mentioned":
        assert t.matched in normalise(query) and "the query mentions" in t.note


def test_codes_and_slicer_entry():
    t = match("right kidney")
    assert t.type == ("SCT", "64033007", "Kidney") and t.modifier == ("SCT", "24028007", "Right")
    assert t.color == (34, 102, 136)  # the table's DICOM RGB colour
    entry = t.slicer_terminology().split("~")
    assert len(entry) == 7 and entry[1] == "SCT^123037004^Anatomical Structure" and entry[3] == "SCT^24028007^Right"
    assert match("x", index=2).color != match("y", index=3).color  # generic segments told apart by number
    assert len(table()) > 170  # every structure, plus those without laterality


def test_a_given_target_name_codes_an_implicit_query_and_says_so():
    t = match("the organ that secretes bile", target="liver")
    assert (t.how, t.structure, t.label) == ("target", "liver", "Liver") and "target name 'liver'" in t.note
    left = match("the organ that filters blood on the left", target="kidney_left")
    assert (left.structure, left.label) == ("kidney_left", "Kidney, Left")
    # the data's name wins over the words: the segment is what the dataset labelled
    assert match("the right kidney", target="kidney_left").structure == "kidney_left"
    unknown = match("the right kidney", target="flux capacitor")
    assert unknown.how == "name" and unknown.structure == "kidney_right"
    assert "'flux capacitor' is not a known structure" in unknown.note


def test_target_name_reaches_the_result_and_the_segment(tmp_path, small_ct, calls):
    from medvolcore.errors import InputError
    from medvolcore.jobs import SegmentOutputs, SegmentRequest, run_segment_job

    sitk = pytest.importorskip("SimpleITK")
    res = run_segment_job(calls, small_ct[0], SegmentRequest(key_slice=3, boxes=[BOX], target_name="spleen"),
                          SegmentOutputs(tmp_path / "m.seg.nrrd"))
    assert res["terminology"]["how"] == "target" and res["terminology"]["label"] == "Spleen"
    assert "SCT^78961009^Spleen" in sitk.ReadImage(str(tmp_path / "m.seg.nrrd")).GetMetaData("Segment0_Tags")
    with pytest.raises(InputError, match="names one target"):
        run_segment_job(calls, small_ct[0], SegmentRequest(queries=["a", "b"], target_name="liver"),
                        SegmentOutputs(tmp_path / "x.nii.gz"))
