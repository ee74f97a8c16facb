"""Anchor schema ``medvol.anchor/2``: correction prompts and a slice range, read, written and checked.

The world forms are checked by hand against the affine (a prompt point's RAS is the affine applied
to its source voxel), on the real CT and on an oblique, permuted grid, so a wrong axis order or
flip fails here; every rule of the schema has a case that must be refused with one clear message.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from medvolcore.anchor import SCHEMA, SCHEMA_V2, EvidenceAnchor
from medvolcore.errors import AnchorError
from medvolcore.prompts import MAX_OBJECTS, MAX_PROMPTS, plan_objects
from medvolcore.stack import AxialStack
from medvolcore.volume import CTVolume, load_volume

W, H, D = 122, 101, 112  # example_ct's canonical stack


@pytest.fixture(scope="module")
def stack(ct_path):
    return AxialStack(load_volume(ct_path))


def _oblique_stack():
    t = np.deg2rad(12)
    rot = np.array([[np.cos(t), 0, np.sin(t), 0], [0, 1, 0, 0], [-np.sin(t), 0, np.cos(t), 0], [0, 0, 0, 1.0]])
    base = np.array([[0, 0, -0.9, 40], [0.7, 0, 0, -20], [0, -2.5, 0, 60], [0, 0, 0, 1.0]])  # A I L axes
    return AxialStack(CTVolume(np.zeros((37, 23, 51), np.float32), rot @ base))


def _anchor(**kw):
    base = dict(slice=50, boxes=[[30, 30, 60, 60], [70, 30, 90, 50]], image_size=[W, H], source="user")
    base.update(kw)
    return EvidenceAnchor(**base)


PROMPTS = [
    {"slice": 62, "object": 1, "box": [28, 32, 58, 66], "points": []},
    {"slice": 62, "object": 1, "box": None, "points": [[40, 40, 0], [45, 50, 1]]},
    {"slice": 50, "object": 2, "box": None, "points": [[80, 40, 0]]},      # points only on the key slice
    {"slice": 30, "object": 3, "box": None, "points": [[60, 70, 1]]},      # a new object from a positive point
    {"slice": 35, "object": 3, "box": [50, 60, 70, 80], "points": []},
]


# ---- writing ------------------------------------------------------------------------------------

def test_without_corrections_the_file_is_v1_exactly(stack):
    a = _anchor().with_world(stack)
    d = a.to_dict()
    assert d["schema"] == SCHEMA == "medvol.anchor/1"
    assert "prompts" not in d and "z_range" not in d and "z_range_ras" not in d["world"]


def test_with_corrections_the_file_is_v2_and_reads_back(stack):
    a = _anchor(prompts=PROMPTS, z_range=[20, 80]).with_world(stack)
    d = json.loads(a.to_json())
    assert d["schema"] == SCHEMA_V2 and d["z_range"] == [20, 80]
    assert [p["object"] for p in d["prompts"]] == [1, 1, 2, 3, 3]
    assert a.num_objects == 3
    back = EvidenceAnchor.from_dict(d, stack)
    assert back.pixel_prompts() == a.pixel_prompts() and back.z_range == [20, 80]
    # only the z_range given in pixels, no volume: still read
    d_px = {k: v for k, v in d.items() if k != "world"}
    d_px["prompts"] = [{k: v for k, v in p.items() if k != "world"} for p in d["prompts"]]
    assert EvidenceAnchor.from_dict(d_px).pixel_prompts() == a.pixel_prompts()


@pytest.mark.parametrize("which", ["real", "oblique"])
def test_prompt_world_form_by_hand_and_world_only_round_trip(which, stack):
    st = stack if which == "real" else _oblique_stack()
    k, z = 10, 14
    prompts = [{"slice": z, "object": 1, "box": [3, 4, 12, 15], "points": [[5, 6, 0], [8, 9, 1]]}]
    a = EvidenceAnchor(k, [[2, 2, 10, 12]], [st.width, st.height], source="user", prompts=prompts, z_range=[k - 3, z + 2])
    a.with_world(st)
    w = a.prompts[0]["world"]
    src = np.linalg.inv(st.volume.affine)
    for (x, y, label), ras in zip(prompts[0]["points"], w["points_ras"]):
        assert ras[3] == label
        ijk = (src @ np.r_[ras[:3], 1.0])[:3]
        # the source voxel of stack (z, y, x), found without the stack's own mapping
        assert np.allclose(st.ras_to_stack(np.asarray([ras[:3]]))[0], [z, y, x], atol=1e-6)
        assert np.allclose(ijk, np.rint(ijk), atol=1e-6)
    # first/last voxel of the box, as boxes_ras
    assert np.allclose(st.ras_to_stack(np.asarray(w["box_ras"])), [[z, 4, 3], [z, 15, 12]], atol=1e-6)
    assert np.allclose(st.ras_to_stack(np.asarray(a.world["z_range_ras"]))[:, 0], [k - 3, z + 2], atol=1e-6)
    # what Slicer writes: world forms only, prompts without a slice
    world_only = {"schema": SCHEMA_V2, "source": "user", "world": a.world,
                  "prompts": [{"object": 1, "world": w}]}
    back = EvidenceAnchor.from_dict(world_only, st)
    assert back.slice == k and back.z_range == [k - 3, z + 2]
    assert back.pixel_prompts() == a.pixel_prompts()


def test_world_and_pixel_forms_that_disagree_are_refused(stack):
    d = _anchor(prompts=PROMPTS[:1]).with_world(stack).to_dict()
    d["prompts"][0]["box"] = [29, 32, 58, 66]
    with pytest.raises(AnchorError, match="prompt 1.*disagree"):
        EvidenceAnchor.from_dict(d, stack)
    d = _anchor(z_range=[20, 80]).with_world(stack).to_dict()
    d["z_range"] = [21, 80]
    with pytest.raises(AnchorError, match="z_range.*disagree"):
        EvidenceAnchor.from_dict(d, stack)


def test_world_points_on_two_slices_are_refused(stack):
    d = _anchor(prompts=PROMPTS[1:2]).with_world(stack).to_dict()
    w = d["prompts"][0]["world"]
    w["points_ras"][1][2] += 3 * abs(stack.stack_to_ras([1, 0, 0])[2] - stack.stack_to_ras([0, 0, 0])[2])
    with pytest.raises(AnchorError, match="different axial slices"):
        EvidenceAnchor.from_dict({"schema": SCHEMA_V2, "world": d["world"], "prompts": [{"object": 1, "world": w}]}, stack)


# ---- every rule, one clear error ----------------------------------------------------------------

BAD = [
    ({"prompts": [{"slice": 60, "object": 1, "box": None, "points": [[W, 10, 1]]}]}, "point 1 .* outside the 122×101 slice"),
    ({"prompts": [{"slice": 60, "object": 1, "box": [200, 200, 220, 220], "points": []}]}, "entirely outside"),
    ({"prompts": [{"slice": 90, "object": 1, "box": [1, 1, 5, 5], "points": []}], "z_range": [20, 80]},
     "slice 90 lies outside z_range"),
    ({"z_range": [60, 80]}, "key slice 50 lies outside z_range"),
    ({"z_range": [80, 60]}, "not a slice range"),
    ({"prompts": [{"slice": 60, "object": 3, "box": None, "points": [[5, 5, 0]]}]}, "new object 3 needs a box or an inside"),
    ({"prompts": [{"slice": 60, "object": 4, "box": [1, 1, 5, 5], "points": []}]}, "object 4 does not exist.*number 3"),
    ({"prompts": [{"slice": 50, "object": 1, "box": [1, 1, 5, 5], "points": []}]}, "already has a box on the key slice"),
    ({"prompts": [{"slice": 60, "object": 1, "box": [1, 1, 5, 5], "points": []},
                  {"slice": 60, "object": 1, "box": [2, 2, 6, 6], "points": []}]}, "already has a box on slice 60"),
    ({"prompts": [{"slice": 60, "object": 1, "box": None, "points": []}]}, "neither a box nor a point"),
    ({"prompts": [{"slice": 60, "object": 1, "box": None, "points": [[5, 5, 2]]}]}, "label 2"),
    ({"prompts": [{"slice": 60, "object": 0, "box": [1, 1, 5, 5], "points": []}]}, "not an object number"),
    ({"prompts": [{"slice": 60.5, "object": 1, "box": [1, 1, 5, 5], "points": []}]}, "slice must be an integer"),
    ({"prompts": [{"object": 1, "box": [1, 1, 5, 5], "points": []}]}, "neither 'slice'"),
    ({"prompts": [{"slice": 60 + i, "object": 3 + i, "box": [1, 1, 5, 5], "points": []} for i in range(MAX_OBJECTS - 1)]},
     f"more than {MAX_OBJECTS} objects"),
    ({"prompts": [{"slice": i, "object": 1, "box": None, "points": [[5, 5, 1]]} for i in range(MAX_PROMPTS + 1)]},
     f"at most {MAX_PROMPTS} are allowed"),
    ({"prompts": {"slice": 1}}, "'prompts' must be a list"),
]


@pytest.mark.parametrize("change, match", BAD, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_corrections_are_one_clear_error(stack, change, match):
    with pytest.raises(AnchorError, match=match) as e:
        d = _anchor().to_dict()
        d.update(change, schema=SCHEMA_V2)
        EvidenceAnchor.from_dict(d, stack)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


def test_a_prompt_beyond_the_stack_needs_the_volume_to_be_caught(stack):
    d = _anchor(prompts=[{"slice": D + 5, "object": 1, "box": [1, 1, 5, 5], "points": []}]).to_dict()
    assert EvidenceAnchor.from_dict(d).prompts  # no volume: the depth is unknown
    with pytest.raises(AnchorError, match=f"slice {D + 5} is outside the stack"):
        EvidenceAnchor.from_dict(d, stack)


def test_v1_files_keep_working_and_may_not_carry_corrections(stack):
    d = _anchor().with_world(stack).to_dict()
    assert EvidenceAnchor.from_dict(d, stack).boxes == _anchor().boxes
    d["prompts"] = PROMPTS[:1]
    with pytest.raises(AnchorError, match="need schema 'medvol.anchor/2'"):
        EvidenceAnchor.from_dict(d, stack)


def test_plan_groups_prompts_per_object_and_slice():
    objs = plan_objects(50, [[30, 30, 60, 60], [70, 30, 90, 50]], PROMPTS, width=W, height=H, depth=D)
    assert [(o.number, o.start, o.slices) for o in objs] == [(1, 50, [50, 62]), (2, 50, [50]), (3, 30, [30, 35])]
    assert objs[0].frames[62] == ((28, 32, 58, 66), [(40, 40, 0), (45, 50, 1)])
    assert objs[1].frames[50] == ((70, 30, 90, 50), [(80, 40, 0)])
    assert objs[2].frames[30] == (None, [(60, 70, 1)]) and not objs[2].seeded_by_key


def test_a_huge_prompt_list_is_refused_before_it_is_read(stack):
    """A remote client's anchor of 100 000 prompts is refused by its length, before any prompt is read:
    the first prompt is malformed, and reading it would have raised its own error instead."""
    d = _anchor().with_world(stack).to_dict()
    bad_first = [{"object": 1, "world": "not an object"}]
    d.update(schema=SCHEMA_V2, prompts=bad_first + [{"object": 1, "world": {"points_ras": [[0.0, 0.0, 0.0, 1]]}}] * 99_999)
    with pytest.raises(AnchorError, match="100000 prompts; at most 64"):
        EvidenceAnchor.from_dict(d, stack)
    d["prompts"] = bad_first + [{"object": 1, "world": {"points_ras": [[0.0, 0.0, 0.0, 1]] * 10_000}}]
    with pytest.raises(AnchorError, match="too many points"):
        EvidenceAnchor.from_dict(d, stack)
    d["prompts"] = bad_first
    with pytest.raises(AnchorError, match="'world' must be an object"):
        EvidenceAnchor.from_dict(d, stack)


# ---- absent anchors (schema /3) --------------------------------------------------------------------

def _absent_dict(**over):
    d = {"schema": "medvol.anchor/3", "absent": True, "slice": None, "boxes": [], "boxes_norm": [],
         "image_size": [W, H], "query": "the kidney cyst", "reasoning": "none seen", "source": "grounder"}
    d.update(over)
    return d


def test_absent_anchor_round_trips_through_a_file(tmp_path, stack):
    a = EvidenceAnchor.absent_for([W, H], query="the kidney cyst", reasoning="none seen", source="grounder",
                                  notes=["not found in this CT: the kidney cyst"])
    p = a.save(tmp_path / "a.anchor.json")
    d = json.loads(p.read_text())
    assert d == _absent_dict(notes=["not found in this CT: the kidney cyst"])
    b = EvidenceAnchor.load(p, stack)
    assert b.absent and b.slice is None and b.boxes == [] and b.query == "the kidney cyst"
    assert EvidenceAnchor.from_dict(_absent_dict(slice=None, boxes=None, boxes_norm=None)).absent
    assert not EvidenceAnchor.from_dict({"schema": SCHEMA, "absent": False, "slice": 3, "boxes": [[1, 1, 5, 5]],
                                         "image_size": [W, H]}).absent  # "absent": false is an ordinary anchor


@pytest.mark.parametrize("over, message", [
    (dict(schema=SCHEMA_V2), "'absent' needs schema 'medvol.anchor/3'"),
    (dict(absent="yes"), "'absent' must be true"),
    (dict(absent=False), "'absent' must be true in a 'medvol.anchor/3' anchor"),
    (dict(slice=4), "an absent anchor has no 'slice'"),
    (dict(boxes=[[1, 1, 5, 5]]), "an absent anchor has no 'boxes'"),
    (dict(z_range=[1, 4]), "no 'slice' or 'z_range'"),
    (dict(image_size=[W + 1, H]), "was it made for another volume"),
])
def test_contradictory_absent_anchors_are_refused(stack, over, message):
    with pytest.raises(AnchorError, match=message):
        EvidenceAnchor.from_dict(_absent_dict(**over), stack)


def test_an_absent_anchor_plans_nothing_and_old_schemas_say_so():
    a = EvidenceAnchor.absent_for([W, H])
    with pytest.raises(AnchorError, match="nothing to propagate"):
        a.plan()
    with pytest.raises(AnchorError, match="has no slice"):
        EvidenceAnchor(None, [[1, 1, 5, 5]], [W, H])
    with pytest.raises(AnchorError, match="has no slice, boxes"):
        EvidenceAnchor(None, [[1, 1, 5, 5]], [W, H], absent=True)
