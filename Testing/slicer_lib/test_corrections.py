"""Corrections as the panel sends them (``medvol.anchor/2``: prompts and a slice range, world
form only), checked against MedVolCore's canonical stack on the real CT's grid stored RAS, LPS,
with permuted axes and obliquely: each world box, point and range end lands on the stack slice
and pixels it was made on."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
from MedVolR1SlicerLib.corrections import (
    MAX_OBJECTS,
    MAX_PROMPTS,
    SCHEMA_V2,
    CorrectionBox,
    CorrectionPoint,
    build_anchor,
    parse_point_label,
    point_label,
    prompts_from_anchor,
    range_text,
)
from MedVolR1SlicerLib.geometry import GeometryError, RoiBox, VolumeGeometry, anchor_from_rois, rois_from_anchor
from medvolcore.anchor import anchor_from_mask
from medvolcore.stack import AxialStack
from medvolcore.volume import CTVolume
from test_geometry import LIVER, _variants

VARIANTS = ["ras", "lps", "permuted", "oblique"]


@pytest.fixture(scope="module")
def real(ct_sm_path, seg_sm_path):
    ct = nib.load(str(ct_sm_path))
    seg = nib.load(str(seg_sm_path))
    return np.asarray(seg.dataobj).astype(np.uint8), ct.affine


def setup(real, name):
    """The liver's key-slice ROI on a variant, its stack, geometry and key slice index."""
    labels, affine = real
    arr, aff = _variants(labels, affine)[name]
    stack = AxialStack(CTVolume(arr, aff))
    geo = VolumeGeometry(aff, arr.shape)
    anchor = anchor_from_mask(stack.data == LIVER, stack=stack)
    rois, k = rois_from_anchor(geo, anchor.to_dict())
    return stack, geo, rois, k


def stack_voxel(stack, ras):
    """The stack voxel ``(z, y, x)`` of a RAS point, which must be a voxel centre."""
    zyx = stack.ras_to_stack(np.asarray(ras, dtype=float))
    np.testing.assert_allclose(zyx, np.rint(zyx), atol=1e-6)
    return [int(v) for v in np.rint(zyx)]


def pixel_prompt(stack, prompt):
    """A world prompt in the pixel form the worker derives (slice, box, points on its stack)."""
    world = prompt["world"]
    out = {"object": prompt["object"], "box": None, "points": []}
    zs = []
    if world["box_ras"] is not None:
        (z0, y0, x0), (z1, y1, x1) = (stack_voxel(stack, c) for c in world["box_ras"])
        assert z0 == z1 and x0 <= x1 and y0 <= y1  # first corner is (x0, y0), as boxes_ras
        out["box"] = [x0, y0, x1, y1]
        zs.append(z0)
    for r, a, s, label in world["points_ras"]:
        z, y, x = stack_voxel(stack, [r, a, s])
        out["points"].append([x, y, label])
        zs.append(z)
    assert len(set(zs)) == 1
    out["slice"] = zs[0]
    return out


def inplane(geo, k, stack_yx, stack):
    """The IJK voxel of stack pixel (y, x) on slice k."""
    return stack.stack_to_source_index([geo.stack_z(k), stack_yx[0], stack_yx[1]])


# ---- geometry helpers ------------------------------------------------------------------------

@pytest.mark.parametrize("name", VARIANTS)
def test_stack_indices_match_medvolcore(real, name):
    labels, affine = real
    arr, aff = _variants(labels, affine)[name]
    stack = AxialStack(CTVolume(arr, aff))
    geo = VolumeGeometry(aff, arr.shape)
    assert geo.stack_axes == stack.perm
    rng = np.random.default_rng(0)
    zyx = rng.integers(0, stack.shape, size=(20, 3))
    np.testing.assert_allclose(geo.stack_to_ijk(zyx), stack.stack_to_source_index(zyx), atol=1e-9)
    for k in (0, 3, geo.depth - 1):
        z = int(np.rint(stack.ras_to_stack(geo.slice_center_ras(k))[0]))
        assert geo.stack_z(k) == z and geo.slice_of_stack_z(z) == k
    assert geo.slice_text(0).startswith(f"slice {geo.stack_z(0) + 1} (S ")


@pytest.mark.parametrize("name", ["oblique", "lps"])
def test_a_point_is_snapped_to_its_voxels_centre_and_refused_outside_the_volume(real, name):
    _, geo, _, _ = setup(real, name)
    voxel = np.array([10, 20, 5])
    for offset in ([0.3, -0.4, 0.45], [-0.49, 0.49, -0.2]):
        k, centre = geo.point_voxel(geo.to_ras(voxel + np.array(offset)))
        assert k == voxel[geo.slice_axis]
        np.testing.assert_allclose(centre, geo.to_ras(voxel), atol=1e-9)
    outside = np.array(voxel, dtype=float)
    outside[geo.inplane_axes[0]] = -1
    with pytest.raises(GeometryError, match="point \\+1 lies outside the volume"):
        geo.point_voxel(geo.to_ras(outside), "point +1")


def test_a_box_here_is_a_quarter_of_the_image_centred_on_the_view_and_kept_on_it(real):
    _, geo, _, k = setup(real, "oblique")
    lo, hi = geo.box_around(k)
    for a in geo.inplane_axes:
        n = geo.shape[a]
        assert (lo[a], hi[a]) == (3 * n // 8, 5 * n // 8)
    assert lo[geo.slice_axis] == hi[geo.slice_axis] == k
    centre = np.array([0, 0, 0])
    centre[geo.slice_axis] = k + 7  # another slice: only the in-plane position counts
    a0, a1 = geo.inplane_axes
    centre[a0], centre[a1] = 12, geo.shape[a1] - 2  # near a corner: slid back onto the image
    lo2, hi2 = geo.box_around(k, geo.to_ras(centre))
    assert lo2[geo.slice_axis] == hi2[geo.slice_axis] == k
    for a in geo.inplane_axes:
        assert hi2[a] - lo2[a] == hi[a] - lo[a] and 0 <= lo2[a] and hi2[a] <= geo.shape[a] - 1
    assert hi2[a1] == geo.shape[a1] - 1 and lo2[a0] <= 12 <= hi2[a0]
    with pytest.raises(GeometryError, match="outside the volume"):
        geo.box_around(geo.depth)


def test_point_labels():
    assert point_label(2, True) == "+2" and point_label(3, False) == "-3"
    assert parse_point_label("+2") == (2, True) and parse_point_label(" -3 ") == (3, False)
    assert parse_point_label("\u22121") == (1, False)  # a typographic minus
    for bad in ("MedVol points-1", "+0", "2", "", None):
        with pytest.raises(GeometryError, match="label is \\+N"):
            parse_point_label(bad)


# ---- the anchor the panel sends --------------------------------------------------------------

def corrections(geo, stack, k, step):
    """Box for object 1 (key box) on slice k+step; a new object 5 with a box on k-step; a
    positive and a negative point of object 1 on k+step and a positive point of object 5 on
    k-step; one point of object 1 on the key slice (points only there)."""
    a0, a1 = geo.inplane_axes
    lo, hi = [0, 0, 0], [0, 0, 0]
    lo[a0], hi[a0], lo[a1], hi[a1] = 20, 40, 30, 45
    up, down = k + step, k - step
    boxes = []
    for obj, kk in ((1, up), (5, down)):
        lo[geo.slice_axis] = hi[geo.slice_axis] = kk
        boxes.append(CorrectionBox(obj, kk, geo.roi_from_voxels(lo, hi)))

    def near(kk, i, j):
        v = np.zeros(3)
        v[geo.slice_axis], v[a0], v[a1] = kk + 0.3, i + 0.2, j - 0.4  # off-centre: snapped
        return list(geo.to_ras(v))

    points = [CorrectionPoint(1, True, near(up, 30, 38)), CorrectionPoint(1, False, near(up, 22, 31)),
              CorrectionPoint(5, True, near(down, 33, 40)), CorrectionPoint(1, True, near(k, 25, 35))]
    return boxes, points


@pytest.mark.parametrize("name", VARIANTS)
def test_boxes_on_other_slices_points_and_a_range_make_a_v2_world_anchor(real, name):
    stack, geo, rois, k = setup(real, name)
    step = 3
    boxes, points = corrections(geo, stack, k, step)
    built = build_anchor(geo, rois, [1], k, boxes, points, (k + 4, k - 5), query="the liver", reasoning="r")
    a = built.anchor
    v1, _ = anchor_from_rois(geo, rois, k, query="the liver", reasoning="r")
    assert a["schema"] == SCHEMA_V2 == "medvol.anchor/2"
    assert a["world"]["boxes_ras"] == v1["world"]["boxes_ras"] and a["source"] == "user"
    assert built.objects == {1: 1, 5: 2}  # the new object is numbered N+1 in the anchor
    assert "boxes" not in a and "z_range" not in a  # world form only, as Slicer writes boxes
    assert all(set(p) == {"object", "world"} and set(p["world"]) == {"box_ras", "points_ras"} for p in a["prompts"])

    pixel = [pixel_prompt(stack, p) for p in a["prompts"]]
    z = geo.stack_z
    # object 1: its box + two points on k+step, its point on the key slice; object 2: box + point
    got = [(p["object"], p["slice"], p["box"] is not None, [pt[2] for pt in p["points"]]) for p in pixel]
    assert got == [(1, z(k + step), True, [1, 0]), (1, z(k), False, [1]), (2, z(k - step), True, [1])]
    # the boxes are the voxel ranges the ROIs were made of, on their own slices
    for p, kk in ((pixel[0], k + step), (pixel[2], k - step)):
        x0, y0, x1, y1 = p["box"]
        corners = [inplane(geo, kk, (y0, x0), stack), inplane(geo, kk, (y1, x1), stack)]
        a0, a1 = geo.inplane_axes
        assert sorted(c[a0] for c in corners) == [20, 40] and sorted(c[a1] for c in corners) == [30, 45]
    # each point is the voxel it was placed in, at that voxel's centre
    for pt, placed in zip(points, built.points_ras):
        want = np.rint(geo.to_ijk(pt.ras))
        np.testing.assert_allclose(geo.to_ijk(placed), want, atol=1e-9)
    x, y, _ = pixel[0]["points"][0]
    ijk = inplane(geo, k + step, (y, x), stack)
    assert (ijk[geo.inplane_axes[0]], ijk[geo.inplane_axes[1]]) == (30, 38)
    # the range: its two end slices, the stack's smaller z first
    (z0, _, _), (z1, _, _) = (stack_voxel(stack, e) for e in a["world"]["z_range_ras"])
    assert [z0, z1] == sorted([z(k + 4), z(k - 5)])
    assert built.notes == []


@pytest.mark.parametrize("name", ["ras", "oblique"])
def test_without_corrections_the_anchor_is_exactly_the_v1_one(real, name):
    stack, geo, rois, k = setup(real, name)
    built = build_anchor(geo, rois, [1], k, query="q", reasoning="r")
    assert built.anchor == anchor_from_rois(geo, rois, k, query="q", reasoning="r")[0]
    assert built.anchor["schema"] == "medvol.anchor/1" and "prompts" not in built.anchor
    only_range = build_anchor(geo, rois, [1], k, z_range=(k, k)).anchor
    assert only_range["schema"] == SCHEMA_V2 and "prompts" not in only_range
    assert len(only_range["world"]["z_range_ras"]) == 2


def test_a_correction_box_moved_off_its_slice_is_put_back_on_it(real):
    stack, geo, rois, k = setup(real, "oblique")
    boxes, _ = corrections(geo, stack, k, 4)
    moved = boxes[0].roi
    up = np.zeros(3)
    up[geo.slice_axis] = 2
    boxes[0] = CorrectionBox(1, k + 4, RoiBox(geo.to_ras(geo.to_ijk(moved.center) + up), moved.size, moved.axes))
    built = build_anchor(geo, rois, [1], k, boxes)
    assert any("was moved off its slice; it is kept on its slice" in n and "object 1" in n for n in built.notes)
    assert pixel_prompt(stack, built.anchor["prompts"][0])["slice"] == geo.stack_z(k + 4)


def test_what_the_worker_would_refuse_is_refused_with_a_message(real):
    stack, geo, rois, k = setup(real, "lps")
    boxes, points = corrections(geo, stack, k, 3)

    def box(obj, kk):
        lo, hi = geo.box_around(kk)
        return CorrectionBox(obj, kk, geo.roi_from_voxels(lo, hi))

    with pytest.raises(GeometryError, match="object 1 already has its box on the key slice"):
        build_anchor(geo, rois, [1], k, [box(1, k)])
    with pytest.raises(GeometryError, match="object 1 has two boxes on slice"):
        build_anchor(geo, rois, [1], k, [box(1, k + 2), box(1, k + 2)])
    with pytest.raises(GeometryError, match="object 7 has only negative"):
        build_anchor(geo, rois, [1], k, [], [CorrectionPoint(7, False, geo.slice_center_ras(k + 1))])
    # a new object may start with a positive point only
    ok = build_anchor(geo, rois, [1], k, [], [CorrectionPoint(7, False, geo.slice_center_ras(k + 1)),
                                             CorrectionPoint(7, True, geo.slice_center_ras(k + 2))]).anchor
    assert [p["world"]["points_ras"][0][3] for p in ok["prompts"]] == [1, 0]  # the positive one first
    with pytest.raises(GeometryError, match=f"9 objects: at most {MAX_OBJECTS}"):
        build_anchor(geo, rois, [1], k, [box(n, k + 1) for n in range(2, 10)])
    build_anchor(geo, rois, [1], k, [box(n, k + 1) for n in range(2, 9)])  # 8 is fine
    many = [CorrectionPoint(obj, True, geo.slice_center_ras(kk)) for obj in (1, 2, 3)
            for kk in range(0, geo.depth) if kk != k]
    assert len(many) > MAX_PROMPTS  # one prompt per object and slice
    with pytest.raises(GeometryError, match=f"{len(many)} corrections .* at most {MAX_PROMPTS}"):
        build_anchor(geo, rois, [1], k, [], many)
    build_anchor(geo, rois, [1], k, [], many[:MAX_PROMPTS])
    with pytest.raises(GeometryError, match="the key slice, slice .* lies outside the slice range"):
        build_anchor(geo, rois, [1], k, z_range=(k + 1, k + 5))
    with pytest.raises(GeometryError, match="a correction of object 5 on slice .* outside the slice range"):
        build_anchor(geo, rois, [1], k, boxes, points, z_range=(k, k + 3))
    with pytest.raises(GeometryError, match="outside this volume"):
        build_anchor(geo, rois, [1], k, z_range=(0, geo.depth))
    far = np.array(geo.slice_center_ras(k)) + 1000.0
    with pytest.raises(GeometryError, match="point -1 lies outside the volume"):
        build_anchor(geo, rois, [1], k, [], [CorrectionPoint(1, False, far)])


@pytest.mark.parametrize("name", VARIANTS)
def test_the_prompts_that_ran_are_read_back_from_world_or_pixel_form(real, name):
    stack, geo, rois, k = setup(real, name)
    boxes, points = corrections(geo, stack, k, 2)
    built = build_anchor(geo, rois, [1], k, boxes, points, (k - 4, k + 3))
    sent = built.anchor
    prompts, z_range = prompts_from_anchor(geo, sent)
    assert z_range == (k - 4, k + 3)
    assert [(p.object, p.slice) for p in prompts] == [(1, k + 2), (1, k), (2, k - 2)]
    assert prompts[0].box_ras == sent["prompts"][0]["world"]["box_ras"] and prompts[1].box_ras is None
    assert [s for _, s in prompts[0].points] == [True, False]
    # what the worker sends back: pixel and world forms; pixel only must land on the same voxels
    back = dict(sent, z_range=sorted(geo.stack_z(kk) for kk in (k - 4, k + 3)),
                prompts=[pixel_prompt(stack, p) for p in sent["prompts"]])
    back["world"] = {key: v for key, v in sent["world"].items() if key != "z_range_ras"}
    again, z_again = prompts_from_anchor(geo, back)
    assert z_again == z_range
    for a, b in zip(prompts, again):
        assert (a.object, a.slice) == (b.object, b.slice)
        np.testing.assert_allclose(a.box_ras if a.box_ras else [], b.box_ras if b.box_ras else [], atol=1e-6)
        np.testing.assert_allclose([r for r, _ in a.points], [r for r, _ in b.points], atol=1e-6)
        assert [s for _, s in a.points] == [s for _, s in b.points]
    assert prompts_from_anchor(geo, anchor_from_rois(geo, rois, k)[0]) == ([], None)
    with pytest.raises(GeometryError, match="different slices"):
        prompts_from_anchor(geo, {"prompts": [{"object": 1, "world": {
            "box_ras": None, "points_ras": [geo.slice_center_ras(k) + [1], geo.slice_center_ras(k + 1) + [0]]}}]})


def test_mask_prompts_of_a_result_make_no_node(real):
    """A /4 result's painted slices are in its segment: prompts_from_anchor skips them."""
    _, geo, _, k = setup(real, "ras")
    box = {"object": 1, "world": {"box_ras": None, "points_ras": [geo.slice_center_ras(k) + [1]]}}
    mask = {"object": 1, "slice": 3, "box": None, "points": [], "mask": {"runs": [0, 4]},
            "world": {"slice_center_ras": geo.slice_center_ras(k)}}
    prompts, _ = prompts_from_anchor(geo, {"schema": "medvol.anchor/4", "prompts": [mask, box]})
    assert len(prompts) == 1 and prompts[0].points


def test_the_range_as_the_panel_shows_it(real):
    _, geo, _, k = setup(real, "ras")
    text = range_text(geo, k + 2, k - 3)
    z0, z1 = sorted((geo.stack_z(k + 2) + 1, geo.stack_z(k - 3) + 1))
    assert text.startswith(f"slices {z0}\u2013{z1} (S ") and text.endswith(" mm)")


def test_the_session_sends_v1_v2_and_v4_anchors_and_nothing_else():
    from MedVolR1SlicerLib.client import WorkerError
    from MedVolR1SlicerLib.session import Options, propagate_fields

    options = Options(preset="tiny")
    for schema in ("medvol.anchor/1", SCHEMA_V2, "medvol.anchor/4"):
        assert propagate_fields("/v.nii", {"schema": schema}, options)["anchor"] == {"schema": schema}
    with pytest.raises(WorkerError, match=r"schema medvol.anchor/1, /2 or /4"):
        propagate_fields("/v.nii", {"schema": "medvol.anchor/3"}, options)
