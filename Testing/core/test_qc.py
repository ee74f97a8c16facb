"""The QC picture (:mod:`medvolcore.qc`), read back from the PNG pixel by pixel: orientation letters
from the stack's direction, the mask outline (2 px, along the mask's own edge, the image's border
included) and its translucent fill, the ground-truth contour, the mask's share and the implausible
size flag, the text budget that keeps the model line, legend and notice on a long query, the
legend, window/level, key slice and S position, duplicate boxes flagged, box numbers apart. A small
synthetic CT on a known grid; no model."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
from PIL import Image, ImageDraw
from scipy import ndimage, signal

from medvolcore.anchor import EvidenceAnchor
from medvolcore.qc import MARGIN_PX, RING_PX, _font, duplicate_boxes, orientation_letters, save_qc
from medvolcore.stack import AxialStack
from medvolcore.volume import CTVolume

RED, CYAN, BG = (255, 40, 40), (0, 220, 255), (20, 20, 20)
SHAPE = (40, 32, 6)  # i → R, j → A, k → S; 40 wide: the picture enlarges it 13 times
SCALE = 13
AFFINE_RAS = np.array([[2.0, 0, 0, -40.0], [0, 2.0, 0, -30.0], [0, 0, 5.0, 100.0], [0, 0, 0, 1]])


def _ras_volume():
    """A CT (RAS axes): -1000 HU air with a 200 HU block left of centre (the patient's right)."""
    a = np.full(SHAPE, -1000.0, np.float32)
    a[20:34, 8:22, 1:5] = 200.0  # i 20..33: patient right (+R) of the grid's middle
    a[5:9, 5:9, :] = 60.0  # a small asymmetric mark, so a flip would show
    return CTVolume(a, AFFINE_RAS.copy())


def _lps_copy(vol):
    """The same CT stored with the first two axes reversed (LPS): same voxels at the same RAS points."""
    flip = np.diag([-1.0, -1.0, 1.0, 1.0])
    flip[0, 3], flip[1, 3] = SHAPE[0] - 1, SHAPE[1] - 1
    return CTVolume(np.ascontiguousarray(vol.array[::-1, ::-1, :]), vol.affine @ flip)


def _mask(vol):
    return vol.array > 100


def _render(vol, anchor, *, mask=True, gt=None, tmp_path=None, name="qc.png", window="abdomen"):
    stack = AxialStack(vol)
    path = (tmp_path or _render.tmp) / name
    ms = stack.to_stack(_mask(vol)) if mask else None
    save_qc(path, stack, anchor, ms, overwrite=True, gt_mask=gt, title="query: the block", window=window,
            reasoning="a bright block", model="model: test")
    with Image.open(path) as im:
        return stack, np.asarray(im.convert("RGB")).copy()


def _slice_area(pic, stack):
    return pic[MARGIN_PX:MARGIN_PX + stack.height * SCALE, MARGIN_PX:MARGIN_PX + stack.width * SCALE]


def _enlarged(m2d):
    return np.kron(np.asarray(m2d, np.uint8), np.ones((SCALE, SCALE), np.uint8)).astype(bool)


def _is(pic, colour):
    return np.all(pic == np.array(colour, np.uint8), axis=-1)


def _text(text, colour, size=13, height=16):
    """``text`` as the picture draws it (the default font, on the panel's background)."""
    font = _font(size)
    im = Image.new("RGB", (int(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(text, font=font)) + 1, height), BG)
    ImageDraw.Draw(im).text((0, 0), text, fill=colour, font=font)
    return np.asarray(im).astype(np.float64)


def _glyph(letter):
    """An orientation letter as the picture draws it (centred on its point), cropped to its ink."""
    im = Image.new("RGB", (60, 60), BG)
    ImageDraw.Draw(im).text((30, 30), letter, fill=(255, 255, 120), font=_font(16), anchor="mm")
    a = np.asarray(im).astype(np.float64)
    ys, xs = np.nonzero(np.any(a != BG, axis=-1))
    return a[ys.min():ys.max() + 1, xs.min():xs.max() + 1]


def _find(pic, template) -> bool:
    """Whether ``template`` occurs pixel for pixel in ``pic`` (FFT to find candidates, then exact)."""
    p = pic.astype(np.float64)
    th, tw = template.shape[:2]
    corr = sum(signal.fftconvolve(p[..., c], template[::-1, ::-1, c], mode="valid") for c in range(3))
    win = signal.fftconvolve((p ** 2).sum(-1), np.ones((th, tw)), mode="valid")
    ssd = win - 2 * corr + (template ** 2).sum()
    for y, x in zip(*np.nonzero(ssd < 1000)):
        if np.array_equal(p[y:y + th, x:x + tw], template):
            return True
    return False


@pytest.fixture
def anchor():
    vol = _ras_volume()
    stack = AxialStack(vol)
    z = 2  # stack z runs head → feet: source k = 5 - 2 = 3
    ys, xs = np.nonzero(stack.to_stack(_mask(vol))[z])
    box = [int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())]
    return EvidenceAnchor(z, [box], [stack.width, stack.height])


def test_orientation_letters_come_from_the_stack_direction():
    ras, lps = _ras_volume(), _lps_copy(_ras_volume())
    assert "".join(nib.aff2axcodes(ras.affine)) == "RAS" and "".join(nib.aff2axcodes(lps.affine)) == "LPS"
    radiological = {"left": "R", "right": "L", "top": "A", "bottom": "P"}
    # both files give the same view (the stack reorders them), so the same letters; letters read off
    # the file's own axes would swap them for one of the two
    assert orientation_letters(AxialStack(ras)) == orientation_letters(AxialStack(lps)) == radiological
    # a grid turned 30° about S: columns point (cos, sin, 0) in RAS; the stack reverses them, so its
    # x axis points (-0.87, -0.5, 0): left and posterior (right edge "LP"); its y axis (0.5, -0.87, 0)
    t = np.deg2rad(30)
    rot = np.eye(4)
    rot[:2, :2] = [[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]]
    turned = AxialStack(CTVolume(np.zeros((8, 8, 3), np.float32), rot @ AFFINE_RAS))
    assert orientation_letters(turned) == {"left": "RA", "right": "LP", "top": "AL", "bottom": "PR"}


def test_the_same_ct_stored_ras_or_lps_gives_the_same_picture_with_the_letters_on_the_right_edges(tmp_path, anchor):
    _render.tmp = tmp_path
    stack, ras_pic = _render(_ras_volume(), anchor, name="ras.png")
    _, lps_pic = _render(_lps_copy(_ras_volume()), anchor, name="lps.png")
    assert np.array_equal(ras_pic, lps_pic)
    h, w = stack.height * SCALE, stack.width * SCALE
    beside = 2 * MARGIN_PX + w  # the slice and its margins, not the panel
    bands = {"R": ras_pic[:, :MARGIN_PX], "L": ras_pic[:, MARGIN_PX + w:beside],
             "A": ras_pic[:MARGIN_PX, :beside], "P": ras_pic[MARGIN_PX + h:2 * MARGIN_PX + h, :beside]}
    for letter, band in bands.items():
        assert _find(band, _glyph(letter)), letter
        assert not any(_find(band, _glyph(o)) for o in "RLAP" if o != letter), letter
    # the block lies at the patient's right: the image's left half
    block = _mask(_ras_volume())
    assert stack.to_stack(block)[anchor.slice][:, :stack.width // 2].sum() > 0
    assert stack.to_stack(block)[anchor.slice][:, stack.width // 2:].sum() == 0


def test_mask_outline_is_2px_along_its_edge_and_the_ground_truth_outside_its_edge(tmp_path, anchor):
    _render.tmp = tmp_path
    vol = _ras_volume()
    stack, pic = _render(vol, anchor, name="no_gt.png")
    area = _slice_area(pic, stack)
    m = _enlarged(stack.to_stack(_mask(vol))[anchor.slice])
    outside = ndimage.distance_transform_cdt(~m, metric="chessboard")  # steps from the mask
    inside = ndimage.distance_transform_cdt(m, metric="chessboard")
    assert np.array_equal(_is(area, RED), m & (inside <= RING_PX))
    assert RING_PX == 2
    fill = m & (inside > RING_PX)  # the mask's inside: the image under a translucent red
    assert fill.any() and not _is(area, RED)[fill].any()
    assert np.all(area[fill][:, 0].astype(int) > area[fill][:, 1].astype(int))  # reddened, not grey
    assert not _is(pic, CYAN).any()
    assert not _find(pic, _text("ground truth, outside its edge", (230, 230, 230)))

    # a ground truth equal to the mask: its contour lies just outside, beside the outline, not under it
    _, pic = _render(vol, anchor, gt=_mask(vol), name="gt.png")
    area = _slice_area(pic, stack)
    assert np.array_equal(_is(area, CYAN), (outside >= 1) & (outside <= RING_PX))
    assert np.array_equal(_is(area, RED), m & (inside <= RING_PX))
    for legend in ("mask: outline along its edge, translucent fill", "ground truth, outside its edge",
                   "evidence box(es)"):
        assert _find(pic, _text(legend, (230, 230, 230))), legend
    elsewhere = np.zeros(SHAPE, bool)
    elsewhere[20:34, 8:22, 5] = True  # on file slice k=5 (stack z=0), not on the key slice
    _, other = _render(vol, anchor, gt=elsewhere, name="gt_elsewhere.png")
    assert not _is(other, CYAN)[:, :2 * MARGIN_PX + stack.width * SCALE].any()
    assert _find(other, _text("ground truth: none on this slice", (230, 230, 230)))
    # the swatches of the legend: the outline's and the ground truth's colours in the panel
    panel = pic[:, 2 * MARGIN_PX + stack.width * SCALE:]
    assert _is(panel, RED).sum() == 100 and _is(panel, CYAN).sum() == 100  # 10×10 px each


def test_a_mask_over_98_percent_of_the_slice_is_outlined_along_the_border_and_flagged(tmp_path):
    """A runaway mask that reaches all four edges of the slice: its outline runs along the whole
    border of the picture's slice (it used to be drawn outside the mask, so off the image), its
    share is stated and it is flagged."""
    a = np.full(SHAPE, 40.0, np.float32)  # soft tissue everywhere: all body
    vol = CTVolume(a, AFFINE_RAS.copy())
    stack = AxialStack(vol)
    mask = np.ones(SHAPE, bool)
    mask[18:22, 14:18, :] = False  # a 4×4 hole: the mask is 98.75 % of each slice
    ms = stack.to_stack(mask)
    assert 0.98 < ms[2].mean() < 0.99
    box = [0, 0, stack.width - 1, stack.height - 1]
    path = tmp_path / "runaway.png"
    save_qc(path, stack, EvidenceAnchor(2, [box], [stack.width, stack.height]), ms, title="query: the liver",
            model="model: test")
    with Image.open(path) as im:
        pic = np.asarray(im.convert("RGB")).copy()
    area = _slice_area(pic, stack)
    red = _is(area, RED)
    h, w = red.shape
    # every pixel of the border's 2 px band is outline (the box frame is drawn under it)
    band = np.zeros((h, w), bool)
    band[:RING_PX], band[-RING_PX:], band[:, :RING_PX], band[:, -RING_PX:] = True, True, True, True
    assert red[band].all()
    assert red[0].all() and red[-1].all() and red[:, 0].all() and red[:, -1].all()
    # and round the hole, inside the mask
    hole = ~_enlarged(ms[2])
    near_hole = (ndimage.distance_transform_cdt(~hole, metric="chessboard") <= RING_PX) & ~hole
    assert red[near_hole].all() and not red[hole].any()
    flag = (255, 90, 90)
    assert _find(pic, _text("IMPLAUSIBLE SIZE: the mask covers 99% of the", flag))
    assert _find(pic, _text("mask: 98.8% of this slice (98.8% of the body on", (255, 120, 120)))


def test_a_small_mask_is_not_flagged_and_a_long_query_keeps_the_panel(tmp_path, anchor):
    """A plausible mask gets its share stated, no flag; a 2000-character query is cut to its line
    budget: the model line, key slice, legend and notice still show."""
    from medvolcore import RESEARCH_USE_NOTICE

    vol = _ras_volume()
    vol.array[vol.array == -1000.0] = 40.0  # a body all round the block: the mask is a small share of it
    stack = AxialStack(vol)
    path = tmp_path / "long.png"
    save_qc(path, stack, anchor, stack.to_stack(_mask(vol)), title="query: " + "the liver " * 200,
            model="model: test", reasoning="a bright block " * 100)
    with Image.open(path) as im:
        pic = np.asarray(im.convert("RGB")).copy()
    assert not _find(pic, _text("IMPLAUSIBLE SIZE", (255, 90, 90)))
    assert _find(pic, _text("model: test", (255, 200, 120)))
    assert _find(pic, _text("key slice z=2 of 6 (z=0 at the head end)", (200, 200, 200)))
    assert _find(pic, _text("mask: outline along its edge, translucent fill", (230, 230, 230)))
    assert _find(pic, _text(" ".join(RESEARCH_USE_NOTICE.split()[:3]), (255, 255, 160)))  # whole, not overdrawn
    assert _find(pic, _text("mask: 15.3% of this slice (15.3% of the body on", (200, 200, 200)))


def test_box_numbers_are_never_drawn_over_each_other(tmp_path, anchor):
    """Boxes of one corner that are not duplicates: each number where it can be read."""
    b = anchor.boxes[0]
    boxes = [b, [b[0], b[1], b[2] - 6, b[3] - 6], [b[0], b[1], b[2] - 10, b[3]]]
    assert duplicate_boxes(boxes) == []
    vol = _ras_volume()
    stack = AxialStack(vol)
    path = tmp_path / "boxes.png"
    save_qc(path, stack, EvidenceAnchor(anchor.slice, boxes, anchor.image_size), None, scale=SCALE)
    with Image.open(path) as im:
        pic = np.asarray(im.convert("RGB")).copy()
    from medvolcore.qc import _BOX_COLOURS

    for i in range(3):
        im = Image.new("RGB", (30, 30), (0, 0, 0))  # the number as drawn on the slice's black air
        ImageDraw.Draw(im).text((5, 5), str(i + 1), fill=_BOX_COLOURS[i], font=_font(11))
        t = np.asarray(im).astype(np.float64)
        ys, xs = np.nonzero(np.any(t > 0, axis=-1))
        found = _find(pic, t[ys.min():ys.max() + 1, xs.min():xs.max() + 1])  # whole, nothing drawn over it
        assert found, i + 1


def test_panel_says_window_key_slice_and_its_s_position(tmp_path, anchor):
    _render.tmp = tmp_path
    _, pic = _render(_ras_volume(), anchor, window="abdomen")
    grey = (200, 200, 200)
    # stack slice 2 is file slice k = 3: S = 100 + 5 * 3 = +115 mm
    assert _find(pic, _text("S +115.0 mm (slice centre), file index k=3", grey))
    assert _find(pic, _text("key slice z=2 of 6 (z=0 at the head end)", grey))
    assert _find(pic, _text("window/level 350/60 HU (abdomen)", grey))
    _, pic = _render(_ras_volume(), anchor, window=(-600, 1500), name="lung.png")
    assert _find(pic, _text("window/level 1500/-600 HU", grey))


def test_duplicate_boxes_are_found_and_flagged_in_the_picture(tmp_path, anchor):
    b = anchor.boxes[0]
    near = [b[0], b[1], b[2] + 1, b[3]]  # one column wider: IoU 14·14 / (15·14) ≈ 0.93 (the block is 14×14 voxels)
    far = [0, 0, 3, 3]
    pairs = duplicate_boxes([b, list(b), near, far])
    assert [(i, j) for i, j, _ in pairs] == [(0, 1), (0, 2), (1, 2)]
    assert pairs[0][2] == 1.0 and 0.9 < pairs[1][2] < 1.0
    assert duplicate_boxes([[0, 0, 9, 9], [0, 0, 9, 10]], threshold=0.95) == []  # IoU 100/110
    assert duplicate_boxes([[0, 0, 9, 9], [1, 0, 10, 9]]) == []  # IoU 90/110: not a duplicate

    _render.tmp = tmp_path
    dup = EvidenceAnchor(anchor.slice, [b, list(b), far], anchor.image_size)
    _, pic = _render(_ras_volume(), dup, name="dup.png")
    flag = (255, 200, 60)
    assert _find(pic, _text("duplicate boxes 1 and 2 (identical)", flag))
    assert not _find(pic, _text("duplicate boxes 1 and 3 (identical)", flag))
    assert _find(pic, _text("flagged, not merged: all drawn, labelled", flag))
    _, pic = _render(_ras_volume(), anchor, name="single.png")
    assert not _find(pic, _text("flagged, not merged: all drawn, labelled", flag))


def test_qc_line_prints_the_confidence_else_the_answer_signal():
    from medvolcore.qc import signal_text

    a = EvidenceAnchor(3, [[10, 20, 29, 39]], [100, 200], confidence=0.8333,
                       samples=[{"sample": i} for i in range(1, 5)], signal={"answer_mean_prob": 0.5})
    assert signal_text(a).startswith("confidence 0.83: agreement of 4 samples") and "not the chance" in signal_text(a)
    b = EvidenceAnchor(3, [[10, 20, 29, 39]], [100, 200], signal={"answer_mean_prob": 0.912})
    assert signal_text(b).startswith("answer signal 0.91") and "not the chance" in signal_text(b)
    assert signal_text(EvidenceAnchor(3, [[10, 20, 29, 39]], [100, 200])) == ""


def test_a_dicom_slice_is_named_in_the_series_not_as_a_file_index():
    from medvolcore.qc import _file_index

    vol = _ras_volume()
    assert _file_index(AxialStack(vol), 2) == "file index k=3"
    dicom = CTVolume(vol.array, vol.affine, source_format="dicom")
    assert _file_index(AxialStack(dicom), 2) == "DICOM series slice 4 of 6, by position"


def test_a_target_whose_voxels_went_to_an_earlier_one_says_so(tmp_path, anchor):
    vol = _ras_volume()
    stack = AxialStack(vol)
    note = "mask: none left here (taken by an earlier target)"  # as medvolcore.jobs writes it
    path = tmp_path / "lost.png"
    save_qc(path, stack, anchor, np.zeros(stack.data.shape, np.uint8), empty_note=note)
    with Image.open(path) as im:
        pic = np.asarray(im.convert("RGB")).copy()
    assert _find(pic, _text(note, (230, 230, 230)))
    assert not _find(pic, _text("mask: none on this slice", (230, 230, 230)))
